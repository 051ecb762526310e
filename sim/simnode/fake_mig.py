"""The simulated GPU's MIG state: GPU and compute instances, created and destroyed by the real
placement rules, kept in a file the way the real driver keeps them in the kernel.

The kernel's MIG state outlives the kubelet plugin; so does this file (under the simulated root),
so a plugin killed halfway through a creation finds the instance it left behind when it restarts.
Creating an instance also makes what the driver makes: the capability files under
`<root>/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>[/ci<C>]/access` and the
`/dev/nvidia-caps/nvidia-cap<N>` character devices they name.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import uuid as uuidlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml

from dra_gpu.common.durable import replace_atomically
from simnode.devnodes import make_char
from simnode.profiles import MEMORY_SLICES, GpuSpec, MigProfileSpec, NodeProfile

log = logging.getLogger(__name__)

STATE_FILE = "sim-nvml/mig-state.json"
COMPUTE_SLICES = 7  # SM slices of an A100 / H100
MAX_GPU_INSTANCE_ID = 14
CAPS_MAJOR = 508  # as device_nodes.SIM_CAPS_MAJOR (the caps major is dynamic on a real node)
# Capability minors of dynamically made instances: one block per GPU, clear of the sequential
# minors the static simulation hands out from 1.
CAPS_MINOR_BASE = 4096
CAPS_MINORS_PER_GI = 9  # the GI's own + one per compute instance (at most 8)
CAPS_MINORS_PER_GPU = (MAX_GPU_INSTANCE_ID + 1) * CAPS_MINORS_PER_GI


class MigStateError(Exception):
    """An NVML-level refusal; `code` is the NVML return code the fake raises."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Instance:
    """A GPU instance and (once made) its compute instance: one MIG device."""

    profile: str
    placement: int
    gi_id: int
    ci_id: int | None = None
    uuid: str | None = None  # the MIG device's UUID, known once the compute instance exists
    processes: list[int] = field(default_factory=list)  # pids running on it (tests set these)

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "placement": self.placement,
            "giId": self.gi_id,
            "ciId": self.ci_id,
            "uuid": self.uuid,
            "processes": self.processes,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Instance:
        return cls(
            profile=str(d["profile"]),
            placement=int(d["placement"]),
            gi_id=int(d["giId"]),
            ci_id=None if d.get("ciId") is None else int(d["ciId"]),
            uuid=d.get("uuid"),
            processes=[int(p) for p in d.get("processes") or []],
        )


class SimulatedMig:
    """MIG instances of every GPU of a profile; persisted under `root` when one is given."""

    def __init__(self, profile: NodeProfile, root: Path | None = None) -> None:
        self.profile = profile
        self.root = root
        self.gpus: dict[str, list[Instance]] = {
            g.uuid: [Instance(i.profile, i.placement, i.gi_id, 0, i.uuid) for i in g.mig_instances]
            for g in profile.gpus
        }
        self._minors = {g.uuid: g.minor for g in profile.gpus}
        if root is not None:
            self._load()

    @property
    def path(self) -> Path | None:
        return None if self.root is None else self.root / STATE_FILE

    def _load(self) -> None:
        path = self.path
        assert path is not None
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"simulated MIG state {path}: unreadable: {exc}") from exc
        for uuid, instances in (doc.get("gpus") or {}).items():
            if uuid in self.gpus:
                self.gpus[uuid] = [Instance.from_dict(i) for i in instances]

    def save(self) -> None:
        path = self.path
        if path is None:
            return
        doc = {"version": 1, "gpus": {u: [i.to_dict() for i in insts] for u, insts in self.gpus.items()}}
        replace_atomically(path, json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n", mode=0o644)

    # -- rules ---------------------------------------------------------------------------------

    def spec(self, profile_id: int) -> MigProfileSpec:
        for p in self.profile.mig_profiles.values():
            if p.profile_id == profile_id:
                return p
        raise MigStateError(
            pynvml.NVML_ERROR_INVALID_ARGUMENT, f"unknown GPU instance profile id {profile_id}"
        )

    def create_gpu_instance(self, gpu: GpuSpec, profile_id: int, start: int, size: int) -> Instance:
        """Create a GI at (start, size), refused as NVML refuses it: overlap, maxima, SM slices."""
        if not gpu.mig_enabled:
            raise MigStateError(pynvml.NVML_ERROR_INVALID_STATE, f"GPU {gpu.uuid}: MIG mode is off")
        spec = self.spec(profile_id)
        if start not in spec.placements or size != spec.placement_size:
            raise MigStateError(
                pynvml.NVML_ERROR_INVALID_ARGUMENT,
                f"GPU {gpu.uuid}: {spec.name} has no placement {start}:{size}",
            )
        live = self.gpus[gpu.uuid]
        mine = set(range(start, start + size))
        for other in live:
            o = self.profile.mig_profiles[other.profile]
            if mine & set(range(other.placement, other.placement + o.placement_size)):
                raise MigStateError(
                    pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES,
                    f"GPU {gpu.uuid}: {spec.name} at {start} overlaps GPU instance {other.gi_id} "
                    f"({other.profile} at {other.placement})",
                )
        if sum(1 for i in live if i.profile == spec.name) >= spec.max_instances:
            raise MigStateError(
                pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES, f"GPU {gpu.uuid}: {spec.name} maximum reached"
            )
        used = sum(self.profile.mig_profiles[i.profile].slice_count for i in live)
        if used + spec.slice_count > COMPUTE_SLICES:
            raise MigStateError(
                pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES, f"GPU {gpu.uuid}: not enough compute slices"
            )
        if start + size > MEMORY_SLICES:  # pragma: no cover - profiles are checked on load
            raise MigStateError(pynvml.NVML_ERROR_INVALID_ARGUMENT, "placement past the last slice")
        taken = {i.gi_id for i in live}
        gi_id = next(n for n in range(1, MAX_GPU_INSTANCE_ID + 1) if n not in taken)
        inst = Instance(spec.name, start, gi_id)
        live.append(inst)
        self._caps(gpu, inst, make=True)
        self.save()
        return inst

    def create_compute_instance(self, gpu: GpuSpec, inst: Instance, slices: int) -> Instance:
        """The GI's one full-size compute instance (the only kind dra-gpu makes)."""
        spec = self.profile.mig_profiles[inst.profile]
        if slices != spec.slice_count:
            raise MigStateError(
                pynvml.NVML_ERROR_NOT_SUPPORTED,
                f"GPU {gpu.uuid}: the simulation makes only full-GI compute instances",
            )
        if inst.ci_id is not None:
            raise MigStateError(
                pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES,
                f"GPU {gpu.uuid}: GPU instance {inst.gi_id} already has a compute instance",
            )
        inst.ci_id = 0
        inst.uuid = f"MIG-{uuidlib.uuid4()}"
        self._caps(gpu, inst, make=True)
        self.save()
        return inst

    def destroy_compute_instance(self, gpu: GpuSpec, inst: Instance) -> None:
        if inst.processes:
            raise MigStateError(
                pynvml.NVML_ERROR_IN_USE,
                f"GPU {gpu.uuid}: compute instance {inst.gi_id}/{inst.ci_id} runs processes {inst.processes}",
            )
        self._caps(gpu, inst, make=False, ci_only=True)
        inst.ci_id, inst.uuid = None, None
        self.save()

    def destroy_gpu_instance(self, gpu: GpuSpec, inst: Instance) -> None:
        if inst.ci_id is not None:
            raise MigStateError(
                pynvml.NVML_ERROR_IN_USE, f"GPU {gpu.uuid}: GPU instance {inst.gi_id} has a compute instance"
            )
        self._caps(gpu, inst, make=False)
        self.gpus[gpu.uuid].remove(inst)
        self.save()

    # -- capability files and nodes ------------------------------------------------------------

    def caps_minors(self, gpu: GpuSpec, inst: Instance) -> tuple[int, int]:
        """(GI access minor, CI access minor) of a dynamically made instance."""
        gi = CAPS_MINOR_BASE + gpu.minor * CAPS_MINORS_PER_GPU + inst.gi_id * CAPS_MINORS_PER_GI
        return gi, gi + 1 + (inst.ci_id or 0)

    def _caps(self, gpu: GpuSpec, inst: Instance, make: bool, ci_only: bool = False) -> None:
        if self.root is None:
            return
        gi_dir = self.root / "proc/driver/nvidia/capabilities" / f"gpu{gpu.minor}" / "mig" / f"gi{inst.gi_id}"
        gi_minor, ci_minor = self.caps_minors(gpu, inst)
        wanted = [] if inst.ci_id is None else [(gi_dir / f"ci{inst.ci_id}", ci_minor)]
        if not ci_only:
            wanted.insert(0, (gi_dir, gi_minor))
        for directory, minor in wanted:
            node = self.root / "dev" / "nvidia-caps" / f"nvidia-cap{minor}"
            if make:
                directory.mkdir(parents=True, exist_ok=True)
                replace_atomically(
                    directory / "access",
                    f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n".encode(),
                    mode=0o444,
                )
                _mknod(node, CAPS_MAJOR, minor)
            else:
                with contextlib.suppress(FileNotFoundError):
                    node.unlink()
                shutil.rmtree(directory, ignore_errors=True)


def _mknod(path: Path, major: int, minor: int) -> None:
    try:
        make_char(path, major, minor)
    except PermissionError:
        # Unit tests run unprivileged: a regular file stands in (prepare's check then fails).
        log.debug("mknod not permitted, capability node not made path=%s", path)
