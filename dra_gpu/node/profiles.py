"""`--profile`: a GPU node made from a profile by a package installed beside the driver.

dra-gpu serves the node it runs on. A node can also be made from a profile, for demos and tests on
machines without GPUs, by another installed package (the simulator, distribution `dra-gpu-simnode`),
which registers itself under the entry-point group `dra_gpu.node_profiles`. The driver neither
imports nor names that package: it asks the group, and what comes back is what a real node has
(a driver root with NVML's library; device nodes, the kernel's files and the PCI devices' sysfs
entries under a dev root), plus the environment NVIDIA's programs need there and a way to make its
kernel report an event (`dra-gpu health simulate`).

Without such a package, `--profile` is an error that says how to get one.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Protocol

ENTRY_POINT_GROUP = "dra_gpu.node_profiles"
INSTALL_HINT = (
    "node profiles come with the simulator package, dra-gpu-simnode, which is not installed "
    "(from a checkout of dra-gpu: pip install ./sim; the driver's image and wheel do not carry it)"
)


class NodePreparationError(Exception):
    """The node of a profile cannot be had; the message says why (an invalid profile, a missing C
    compiler, no profile package installed)."""


class NodeEvents(Protocol):
    """What the node's kernel can be made to report to every NVML event set on the node."""

    # gi / ci: the MIG instance an event is of; left out, the event is the whole GPU's.
    def inject_event(
        self, gpu_uuid: str, event_type: int, data: int = 0, gi: int = ..., ci: int = ...
    ) -> int: ...

    def set_recovery_action(self, gpu_uuid: str, action: int) -> None: ...

    def set_lost(self, gpu_uuid: str, lost: bool) -> None: ...


@dataclass(frozen=True)
class PreparedNode:
    driver_root: Path  # its NVIDIA driver installation (NVML's library and NVIDIA's programs)
    dev_root: Path  # root of its dev/, proc/ and sys/
    events: NodeEvents
    tool_env: Mapping[str, str] = field(default_factory=dict)  # for NVML and NVIDIA's programs


class NodeProfiles(Protocol):
    """What a package registers under `dra_gpu.node_profiles`."""

    @property
    def names(self) -> tuple[str, ...]: ...  # the profiles it has built in (it may also read files)

    def prepare(
        self, profile: str, dev_root: Path, driver_root: Path | None, cache_dir: Path | None
    ) -> PreparedNode: ...


@functools.cache
def installed() -> NodeProfiles | None:
    """The installed package's profiles (the first registered, by name), None when there is none."""
    found = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
    if not found:
        return None
    profiles: NodeProfiles = found[0].load()()
    return profiles


def profile_names() -> tuple[str, ...]:
    """The built-in profiles of the installed package; empty when none is installed."""
    profiles = installed()
    return profiles.names if profiles else ()


def prepare_node(
    profile: str, dev_root: Path, driver_root: Path | None = None, cache_dir: Path | None = None
) -> PreparedNode:
    """The node of `profile` (a built-in name or a file), its device nodes made under `dev_root`,
    with `driver_root` or the package's own. NodePreparationError when it cannot be had."""
    profiles = installed()
    if profiles is None:
        raise NodePreparationError(f"--profile {profile}: {INSTALL_HINT}")
    return profiles.prepare(profile, dev_root, driver_root, cache_dir)
