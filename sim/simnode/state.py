"""What a simulated node's kernel keeps, read from outside (tests, e2e checks): the state file the
simulated libnvidia-ml.so.1 keeps under `<device-node dir>/.nvidia-sim/state` (MIG mode, GPU and
compute instances, compute modes, per-cgroup memory limits), in the form the product never reads
(it asks NVML).

Lines (written by the library, replaced atomically):
    gpu <gpu-uuid> <mig-enabled> <compute-mode> <persistence-mode>   (older files: no persistence)
    gi <gpu-uuid> <gi-id> <profile-id> <start>
    ci <gpu-uuid> <gi-id> <ci-id> <compute-mode> <mig-uuid>
    limit <gpu-uuid> <soft> <hard> <cgroup-inode> <namespace>
A limit whose cgroup is gone (or was made again: another inode) was cleared with it, as the driver
clears it, and is not read back. No file: the boot state (the profile's MIG modes and pre-made instances).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simnode.inject import sim_dir
from simnode.profiles import NodeProfile

DEFAULT_COMPUTE_MODE = 0


@dataclass
class SimState:
    compute_modes: dict[str, int] = field(default_factory=dict)  # GPU or MIG device UUID -> mode
    # GPU UUID -> its instances: {"profile", "placement", "giId", "ciId", "uuid"} (ciId/uuid None:
    # a GPU instance without a compute instance)
    instances: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # GPU UUID -> cgroup path -> (soft, hard) memory limit in bytes
    memory_limits: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    persistent: set[str] = field(default_factory=set)  # GPU UUIDs in driver persistence mode

    def compute_mode(self, uuid: str) -> int:
        return self.compute_modes.get(uuid, DEFAULT_COMPUTE_MODE)


def state_file(dev_dir: Path | str) -> Path:
    return sim_dir(dev_dir) / "state"


def _boot(profile: NodeProfile | None) -> SimState:
    state = SimState()
    for g in profile.gpus if profile is not None else []:
        state.instances[g.uuid] = [
            {"profile": m.profile, "placement": m.placement, "giId": m.gi_id, "ciId": 0, "uuid": m.uuid}
            for m in g.mig_instances
        ]
    return state


def read_state(dev_dir: Path | str, profile: NodeProfile | None = None) -> SimState:
    """The node's state now (the boot state when the library never changed it, known with the
    node's `profile`, which also names the MIG profiles; without it they are their NVML ids)."""
    try:
        text = state_file(dev_dir).read_text()
    except FileNotFoundError:
        return _boot(profile)
    names = {p.profile_id: name for name, p in (profile.mig_profiles if profile else {}).items()}
    state = SimState()
    by_gi: dict[tuple[str, int], dict[str, Any]] = {}
    for line in text.splitlines():
        word, *rest = line.split() or [""]
        if word == "gpu":
            uuid, _mig, mode = rest[:3]
            state.compute_modes[uuid] = int(mode)
            if rest[3:4] == ["1"]:
                state.persistent.add(uuid)
            state.instances[uuid] = []
        elif word == "gi":
            uuid, gi, profile_id, start = rest[:4]
            name = names.get(int(profile_id), profile_id)
            made: dict[str, Any] = {"profile": name, "placement": int(start), "giId": int(gi)}
            made.update(ciId=None, uuid=None)
            state.instances.setdefault(uuid, []).append(made)
            by_gi[(uuid, int(gi))] = made
        elif word == "ci":
            uuid, gi, ci, mode, mig_uuid = rest[:5]
            found = by_gi.get((uuid, int(gi)))
            if found is not None:
                found.update(ciId=int(ci), uuid=mig_uuid)
                state.compute_modes[mig_uuid] = int(mode)
        elif word == "limit":
            uuid, soft, hard, ino = rest[:4]
            namespace = line.split(None, 5)[5]
            if _inode(namespace) == int(ino):
                state.memory_limits.setdefault(uuid, {})[namespace] = (int(soft), int(hard))
    return state


def _inode(path: str) -> int:
    try:
        return os.stat(path).st_ino
    except OSError:
        return 0


TIMESLICES = ".nvidia-sim-timeslices"  # the simulated nvidia-smi's time-slice levels (src/nvidia-smi.c)


def reboot(dev_dir: Path | str) -> None:
    """Forget what the kernel kept: MIG instances, compute modes, memory limits and time-slice
    levels are the boot state again."""
    state_file(dev_dir).unlink(missing_ok=True)
    (Path(dev_dir) / TIMESLICES).unlink(missing_ok=True)
