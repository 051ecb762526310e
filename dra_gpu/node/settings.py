"""Which node this is, where its files are and how its devices are published: resolved once, from
the command line and its environment fallbacks (dra_gpu.node.flags), for every node command
(`kubelet-plugin`, `inventory`, `doctor`'s node checks, `health`).

A command reads the flags it declared; a flag it did not declare takes its default, resolved here
and nowhere else: the plugin dir `/var/lib/kubelet/plugins/<driver>`, the dev root `/` (a
simulated node: `<plugin dir>/simulated-root`), the driver root `/` (a simulated node: its
simulated driver, built on first use in the cache dir).
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from dra_gpu.model.nvidia_compat import driver_name
from dra_gpu.node.flags import DEFAULT_CDI_DIR, DEFAULT_REGISTRY_DIR

REAL_DRIVER_ROOT = Path("/")


def default_plugin_dir(driver: str) -> Path:
    return Path(f"/var/lib/kubelet/plugins/{driver}")


def default_node_name() -> str:
    return os.environ.get("NODE_NAME") or socket.gethostname().lower()


@dataclass(frozen=True)
class NodeSettings:
    node_name: str
    driver: str
    profile: str | None  # a node made from a profile (dra_gpu.node.profiles): a built-in name or a file
    plugin_dir: Path
    registry_dir: Path
    cdi_dir: Path
    dev_root: Path  # root of dev/ and proc/: "/" on a real node
    # The NVIDIA driver's files as this process sees them; None only on a simulated node without
    # --driver-root: its simulated driver, built on first use in `cache_dir`.
    driver_root: Path | None
    host_driver_root: str | None = None  # the same root as the container runtime sees it
    cache_dir: Path | None = None  # where a profile's package builds driver roots; None: its own default
    dynamic_mig: bool = False  # publish MIG placements, made on demand
    memory_shares: bool = False  # whole GPUs shareable by memory (consumable capacity)
    mig_profiles: tuple[str, ...] = ()  # dynamic MIG: the only profiles offered (empty: all)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> NodeSettings:
        """The settings of a parsed node command (its flags, their environment fallbacks, the
        defaults)."""

        def arg(name: str) -> str | None:
            value = getattr(args, name, None)
            return str(value) if value else None

        driver = driver_name(arg("driver_name"), bool(getattr(args, "nvidia_compatible", False)))
        profile = arg("profile")
        plugin_dir = Path(arg("plugin_dir") or default_plugin_dir(driver))
        driver_root = arg("driver_root")
        return cls(
            node_name=arg("node_name") or default_node_name(),
            driver=driver,
            profile=profile,
            plugin_dir=plugin_dir,
            registry_dir=Path(arg("registry_dir") or DEFAULT_REGISTRY_DIR),
            cdi_dir=Path(arg("cdi_dir") or DEFAULT_CDI_DIR),
            dev_root=Path(arg("dev_root") or (plugin_dir / "simulated-root" if profile else "/")),
            driver_root=Path(driver_root) if driver_root else None if profile else REAL_DRIVER_ROOT,
            host_driver_root=arg("host_driver_root"),
            cache_dir=None,
            dynamic_mig=bool(getattr(args, "dynamic_mig", False)),
            memory_shares=bool(getattr(args, "memory_shares", False)),
            mig_profiles=tuple(getattr(args, "mig_profiles", None) or ()),
        )

    @property
    def simulated(self) -> bool:
        return self.profile is not None

    @property
    def dra_socket(self) -> Path:
        return self.plugin_dir / "dra.sock"

    @property
    def registration_socket(self) -> Path:
        return self.registry_dir / f"{self.driver}-reg.sock"

    @property
    def checkpoint(self) -> Path:
        return self.plugin_dir / "checkpoint.json"
