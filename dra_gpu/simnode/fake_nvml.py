"""A pynvml-shaped NVML that serves a simulated node profile.

It has the same function names, returns the same pynvml ctypes structs and raises the same
`NVMLError` subclasses as `pynvml`, so discovery runs unchanged against it. Constants, struct
classes and exception classes are pynvml's own. An `nvml*` function the fake does not implement
raises `NVMLError_FunctionNotFound`, as an old driver would, rather than reaching the real library.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import uuid as uuidlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pynvml

from dra_gpu.discovery.nvml_compat import exported_in
from dra_gpu.durable import atomic_write
from dra_gpu.simnode.fake_mig import Instance, MigStateError, SimulatedMig
from dra_gpu.simnode.fake_nvml_events import FakeNvmlEvents
from dra_gpu.simnode.profiles import (
    NODE_FAILURE_ENV,
    NVML_ERROR_CODES,
    GpuSpec,
    NodeProfile,
)

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger(__name__)

MAX_MIG_DEVICES = 7
HOPPER = 9
# Full-GI compute-instance profile index by compute slices (NVML_COMPUTE_INSTANCE_PROFILE_*).
CI_PROFILE_BY_SLICES = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}


def parse_failures(text: str) -> dict[str, int]:
    """`nvmlFunction=ErrorName,...` (names as in a profile's nvmlErrors) -> one-shot failures."""
    out: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        fn, _, err = item.partition("=")
        if not fn.startswith("nvml") or err not in NVML_ERROR_CODES:
            raise ValueError(
                f"{NODE_FAILURE_ENV}: {item!r} is not nvmlFunction=Error "
                f"(errors: {', '.join(sorted(NVML_ERROR_CODES))})"
            )
        out[fn] = NVML_ERROR_CODES[err]
    return out


class _GpuHandle:
    def __init__(self, spec: GpuSpec) -> None:
        self.spec = spec


class _MigHandle:
    def __init__(self, parent: _GpuHandle, instance: Instance) -> None:
        self.parent = parent
        self.instance = instance
        self.spec = parent.spec  # errors injected on the parent apply to its MIG devices too


class _GpuInstanceHandle:
    def __init__(self, parent: _GpuHandle, instance: Instance) -> None:
        self.parent = parent
        self.instance = instance
        self.spec = parent.spec


class _ComputeInstanceHandle:
    def __init__(self, gi: _GpuInstanceHandle) -> None:
        self.gi = gi
        self.instance = gi.instance
        self.spec = gi.spec


class _Process:
    """What nvmlDeviceGetComputeRunningProcesses lists (the fields dra-gpu reads)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.usedGpuMemory = 0


def _raise(code: int) -> None:
    raise pynvml.NVMLError(code)


def _pci_info(bus_id: str) -> Any:
    """An nvmlPciInfo_t as NVML fills it: upper-case hex, 8-digit domain in `busId` (bytes)."""
    info = pynvml.nvmlPciInfo_t()
    dom, bus, rest = bus_id.split(":")
    dev, fn = rest.split(".")
    info.busId = f"{int(dom, 16):08X}:{int(bus, 16):02X}:{int(dev, 16):02X}.{fn}".encode()
    info.domain, info.bus, info.device = int(dom, 16), int(bus, 16), int(dev, 16)
    return info


def _nvml_call(fn: F) -> F:
    """Checks init state and the profile's injected errors before the call."""

    @functools.wraps(fn)
    def wrapper(self: FakeNvml, *args: Any, **kwargs: Any) -> Any:
        if not self._initialised:
            _raise(pynvml.NVML_ERROR_UNINITIALIZED)
        handle = args[0] if args else None
        spec = getattr(handle, "spec", None)
        code = self._fail_once.pop(fn.__name__, None)
        if code is not None:
            _raise(code)
        if isinstance(spec, GpuSpec):
            code = spec.nvml_errors.get(fn.__name__, spec.nvml_errors.get("*"))
            if code is not None:
                _raise(code)
        self._check_lost(handle)  # a simulated lost GPU (health events)
        code = self.profile.nvml_errors.get(fn.__name__)
        if code is not None:
            _raise(code)
        try:
            return fn(self, *args, **kwargs)
        except MigStateError as exc:
            log.info("simulated nvml refused call=%s reason=%s", fn.__name__, exc)
            raise pynvml.NVMLError(exc.code) from exc

    return wrapper  # type: ignore[return-value]


class FakeNvml(FakeNvmlEvents):
    """Drop-in for the `pynvml` module, backed by a NodeProfile.

    `root`: the simulated node's root; its MIG state is kept there (see fake_mig) and survives
    this object, as the kernel's does the process. Without it the state lives in memory.
    `state_file`: where settings a driver keeps until reboot (compute modes) are kept, so that a
    restarted process sees them as it would on a GPU; None keeps them in memory.
    """

    def __init__(
        self, profile: NodeProfile, root: Path | None = None, state_file: Path | None = None
    ) -> None:
        self.profile = profile
        self.mig = SimulatedMig(profile, root)
        self._fail_once: dict[str, int] = parse_failures(os.environ.get(NODE_FAILURE_ENV, ""))
        self._init_count = 0
        self._handles = [_GpuHandle(g) for g in profile.gpus]
        self._by_bus = {h.spec.pci_bus_id.lower(): h for h in self._handles}
        self._init_events()
        self._state_file = state_file
        self._compute_modes: dict[str, int] = {}

    def fail_next(self, function: str, code: int) -> None:
        """Make the next call of `function` raise NVMLError(code) (a failing step, for tests)."""
        self._fail_once[function] = code

    @property
    def _initialised(self) -> bool:
        return self._init_count > 0

    def __getattr__(self, name: str) -> Any:
        real = getattr(pynvml, name)  # AttributeError for names pynvml lacks too
        if name.startswith("nvml") and callable(real) and not isinstance(real, type):

            def not_found(*_args: Any, **_kwargs: Any) -> Any:
                _raise(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

            return not_found
        return real  # constants, version numbers, structs, exception classes

    # -- init ----------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        code = self.profile.nvml_errors.get("nvmlInit")
        if code is not None:
            _raise(code)
        self._init_count += 1

    def nvmlShutdown(self) -> None:
        if not self._initialised:
            _raise(pynvml.NVML_ERROR_UNINITIALIZED)
        self._init_count -= 1

    # -- system --------------------------------------------------------------------------------

    @_nvml_call
    def nvmlSystemGetDriverVersion(self) -> str:
        return self.profile.driver_version

    @_nvml_call
    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.profile.cuda_driver_version

    @_nvml_call
    def nvmlDeviceGetCount(self) -> int:
        return len(self._handles)

    @_nvml_call
    def nvmlDeviceGetHandleByIndex(self, index: int) -> _GpuHandle:
        for h in self._handles:
            if h.spec.index == index:
                code = h.spec.nvml_errors.get("nvmlDeviceGetHandleByIndex")
                if code is not None:
                    _raise(code)
                return h
        _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        raise AssertionError("unreachable")

    @_nvml_call
    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> _GpuHandle | _MigHandle:
        for h in self._handles:
            if h.spec.uuid == uuid:
                return h
            for instance in self._mig_devices(h) if h.spec.mig_enabled else []:
                if instance.uuid == uuid:
                    return _MigHandle(h, instance)
        if self.mig.root is not None:
            # A MIG device another process made since (the node's state, as the kernel's): read
            # afresh, without touching this object's own view.
            fresh = SimulatedMig(self.profile, self.mig.root)
            for h in self._handles:
                for instance in fresh.gpus.get(h.spec.uuid, []) if h.spec.mig_enabled else []:
                    if instance.ci_id is not None and instance.uuid == uuid:
                        return _MigHandle(h, instance)
        _raise(pynvml.NVML_ERROR_NOT_FOUND)
        raise AssertionError("unreachable")

    # -- compute mode (kept in the state file: the driver keeps it until reboot) --------------

    def _uuid_of(self, h: Any) -> str:
        return str(h.instance.uuid) if isinstance(h, _MigHandle) else str(h.spec.uuid)

    def _load_state(self) -> None:
        if self._state_file is not None and self._state_file.exists():
            doc = json.loads(self._state_file.read_text())
            self._compute_modes = {str(k): int(v) for k, v in doc.get("computeModes", {}).items()}

    @_nvml_call
    def nvmlDeviceGetComputeMode(self, h: Any) -> int:
        if isinstance(h, _GpuHandle) and h.spec.mig_enabled:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)  # a MIG-enabled GPU: ask its MIG devices
        self._load_state()
        return int(self._compute_modes.get(self._uuid_of(h), pynvml.NVML_COMPUTEMODE_DEFAULT))

    @_nvml_call
    def nvmlDeviceSetComputeMode(self, h: Any, mode: int) -> None:
        if isinstance(h, _MigHandle) or h.spec.mig_enabled:
            # As drivers before NVML 13.2: a MIG device's compute mode cannot be changed.
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if mode not in (
            pynvml.NVML_COMPUTEMODE_DEFAULT,
            pynvml.NVML_COMPUTEMODE_PROHIBITED,
            pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
        ):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._load_state()
        self._compute_modes[self._uuid_of(h)] = mode
        if self._state_file is not None:
            doc = {"computeModes": dict(sorted(self._compute_modes.items()))}
            atomic_write(self._state_file, json.dumps(doc, indent=2).encode(), mode=0o644)

    @_nvml_call
    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> _GpuHandle:
        h = self._by_bus.get(bus_id.lower())
        if h is None:
            _raise(pynvml.NVML_ERROR_NOT_FOUND)
        assert h is not None
        return h

    # -- identity ------------------------------------------------------------------------------

    @_nvml_call
    def nvmlDeviceGetUUID(self, h: Any) -> str:
        return str(h.instance.uuid) if isinstance(h, _MigHandle) else str(h.spec.uuid)

    @_nvml_call
    def nvmlDeviceGetName(self, h: Any) -> str:
        if isinstance(h, _MigHandle):
            return f"{h.spec.name} MIG {h.instance.profile}"
        return str(h.spec.name)

    @_nvml_call
    def nvmlDeviceGetIndex(self, h: _GpuHandle) -> int:
        return h.spec.index

    @_nvml_call
    def nvmlDeviceGetMinorNumber(self, h: _GpuHandle) -> int:
        return h.spec.minor

    @_nvml_call
    def nvmlDeviceGetBrand(self, h: _GpuHandle) -> int:
        return h.spec.brand

    @_nvml_call
    def nvmlDeviceGetArchitecture(self, h: _GpuHandle) -> int:
        return h.spec.architecture

    @_nvml_call
    def nvmlDeviceGetCudaComputeCapability(self, h: _GpuHandle) -> tuple[int, int]:
        return h.spec.compute_capability

    @_nvml_call
    def nvmlDeviceGetMemoryInfo(self, h: Any, version: Any = None) -> Any:
        if isinstance(h, _MigHandle):
            total = self.profile.mig_profiles[h.instance.profile].memory_mib << 20
        else:
            total = h.spec.memory_mib << 20
        # Real drivers reserve some memory; `used` is never zero on a live GPU.
        used = min(total, 600 << 20)
        if version is not None:
            mem2 = pynvml.c_nvmlMemory_v2_t()
            mem2.version, mem2.total, mem2.reserved = version, total, 0
            mem2.free, mem2.used = total - used, used
            return mem2
        mem = pynvml.c_nvmlMemory_t()
        mem.total, mem.free, mem.used = total, total - used, used
        return mem

    @_nvml_call
    def nvmlDeviceGetPciInfo(self, h: _GpuHandle) -> Any:
        info = _pci_info(h.spec.pci_bus_id)
        info.busIdLegacy = info.busId[4:]
        info.pciDeviceId = 0x233010DE if h.spec.architecture == 9 else 0x20B510DE
        return info

    @_nvml_call
    def nvmlDeviceGetNumaNodeId(self, h: _GpuHandle) -> int:
        if h.spec.numa_node is None:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(h.spec.numa_node)  # type: ignore[arg-type]

    @_nvml_call
    def nvmlDeviceGetAttributes_v2(self, h: Any) -> Any:
        if not isinstance(h, _MigHandle):
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)  # as a real H200 answers for a whole GPU
        attrs = pynvml.c_nvmlDeviceAttributes()
        p = self.profile.mig_profiles[h.instance.profile]
        attrs.multiprocessorCount = p.multiprocessors
        attrs.gpuInstanceSliceCount = attrs.computeInstanceSliceCount = p.slice_count
        attrs.memorySizeMB = p.memory_mib
        return attrs

    def nvmlDeviceGetAttributes(self, h: Any) -> Any:
        return self.nvmlDeviceGetAttributes_v2(h)

    # -- MIG -----------------------------------------------------------------------------------

    @_nvml_call
    def nvmlDeviceGetMigMode(self, h: _GpuHandle) -> list[int]:
        if not h.spec.mig_capable:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        mode = int(h.spec.mig_enabled)
        return [mode, mode]

    @_nvml_call
    def nvmlDeviceGetMaxMigDeviceCount(self, h: _GpuHandle) -> int:
        if not h.spec.mig_capable:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return MAX_MIG_DEVICES if h.spec.mig_enabled else 0  # a real H200 says 0 when disabled

    def _mig_devices(self, h: _GpuHandle) -> list[Instance]:
        """Instances with a compute instance, i.e. MIG devices, in GPU-instance order."""
        return sorted((i for i in self.mig.gpus[h.spec.uuid] if i.ci_id is not None), key=lambda i: i.gi_id)

    @_nvml_call
    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: _GpuHandle, index: int) -> _MigHandle:
        if not 0 <= index < MAX_MIG_DEVICES:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        devices = self._mig_devices(h)
        if index >= len(devices):
            _raise(pynvml.NVML_ERROR_NOT_FOUND)
        return _MigHandle(h, devices[index])

    @_nvml_call
    def nvmlDeviceIsMigDeviceHandle(self, h: Any) -> ctypes.c_uint:
        return ctypes.c_uint(1 if isinstance(h, _MigHandle) else 0)  # pynvml returns the c_uint

    @_nvml_call
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, h: _MigHandle) -> _GpuHandle:
        if not isinstance(h, _MigHandle):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return h.parent

    @_nvml_call
    def nvmlDeviceGetGpuInstanceId(self, h: _MigHandle) -> int:
        if not isinstance(h, _MigHandle):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return h.instance.gi_id

    @_nvml_call
    def nvmlDeviceGetComputeInstanceId(self, h: _MigHandle) -> int:
        if not isinstance(h, _MigHandle):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(h.instance.ci_id or 0)

    @_nvml_call
    def nvmlDeviceGetComputeRunningProcesses(self, h: Any) -> list[_Process]:
        if isinstance(h, _MigHandle):
            return [_Process(pid) for pid in h.instance.processes]
        if isinstance(h, _GpuHandle):
            return [_Process(pid) for i in self.mig.gpus[h.spec.uuid] for pid in i.processes]
        _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        raise AssertionError("unreachable")

    @_nvml_call
    def nvmlDeviceGetGpuInstanceById(self, h: _GpuHandle, gi_id: int) -> _GpuInstanceHandle:
        if not h.spec.mig_capable:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        for inst in self.mig.gpus[h.spec.uuid]:
            if inst.gi_id == gi_id:
                return _GpuInstanceHandle(h, inst)
        _raise(pynvml.NVML_ERROR_NOT_FOUND)
        raise AssertionError("unreachable")

    def _live(self, gi: Any) -> Instance:
        """The instance behind a GI/CI handle; a destroyed one is an invalid argument, as in NVML."""
        if not isinstance(gi, _GpuInstanceHandle | _ComputeInstanceHandle):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if gi.instance not in self.mig.gpus[gi.spec.uuid]:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gi.instance  # type: ignore[no-any-return]

    @_nvml_call
    def nvmlGpuInstanceGetInfo(self, gi: _GpuInstanceHandle) -> Any:
        inst = self._live(gi)
        p = self.profile.mig_profiles[inst.profile]
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.id, info.profileId = inst.gi_id, p.profile_id
        info.placement.start, info.placement.size = inst.placement, p.placement_size
        return info

    def _profile_info(self, h: _GpuHandle, match: Callable[[Any], bool]) -> Any:
        if not h.spec.mig_capable:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        for p in self.profile.mig_profiles.values():
            if match(p):
                info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
                info.version = 0  # the driver leaves it zero (seen on an H200)
                info.id, info.sliceCount = p.profile_id, p.slice_count
                info.instanceCount = p.max_instances
                info.multiprocessorCount, info.memorySizeMB = p.multiprocessors, p.memory_mib
                info.copyEngineCount, info.decoderCount = p.copy_engines, p.decoders
                info.encoderCount, info.jpegCount, info.ofaCount = p.encoders, p.jpeg, p.ofa
                info.name = f"MIG {p.name}".encode()
                return info
        _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)

    @_nvml_call
    def nvmlDeviceGetGpuInstanceProfileInfo(self, h: _GpuHandle, profile: int, version: int = 2) -> Any:
        if version not in (1, 2):
            _raise(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return self._profile_info(h, lambda p: p.index == profile)

    @_nvml_call
    def nvmlDeviceGetGpuInstanceProfileInfoById(self, h: _GpuHandle, profile_id: int) -> Any:
        # Its C symbol (...ByIdV) first ships with driver 580: older libraries lack it.
        if not exported_in("nvmlDeviceGetGpuInstanceProfileInfoByIdV", self.profile.driver_version):
            _raise(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return self._profile_info(h, lambda p: p.profile_id == profile_id)

    @_nvml_call
    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, h: _GpuHandle, profile_id: int, placements_ref: Any, count_ref: Any
    ) -> int:
        """Every placement of the profile, used or not (as NVML documents); the caller allocates.
        A null `placements_ref` asks for the count only."""
        if not h.spec.mig_capable:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        spec = self.mig.spec(profile_id)
        count = getattr(count_ref, "_obj", count_ref)  # byref(c_uint) or the c_uint itself
        if placements_ref is None:
            count.value = len(spec.placements)
            return int(pynvml.NVML_SUCCESS)
        if count.value < len(spec.placements):
            count.value = len(spec.placements)
            _raise(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, start in enumerate(spec.placements):
            placements_ref[i].start, placements_ref[i].size = start, spec.placement_size
        count.value = len(spec.placements)
        return int(pynvml.NVML_SUCCESS)

    @_nvml_call
    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, h: _GpuHandle, profile_id: int, placement: Any
    ) -> _GpuInstanceHandle:
        if not h.spec.mig_capable:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        p = getattr(placement, "_obj", placement)  # byref(struct) or the struct
        inst = self.mig.create_gpu_instance(h.spec, profile_id, int(p.start), int(p.size))
        return _GpuInstanceHandle(h, inst)

    @_nvml_call
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, gi: _GpuInstanceHandle, profile: int, eng_profile: int, version: int = 2
    ) -> Any:
        inst = self._live(gi)
        if version not in (1, 2):
            _raise(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        spec = self.profile.mig_profiles[inst.profile]
        found = next((n for n, idx in CI_PROFILE_BY_SLICES.items() if idx == profile), None)
        if found is None or found > spec.slice_count or eng_profile != 0:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        slices = int(found or 0)
        info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
        info.id, info.sliceCount = profile, slices
        info.instanceCount = spec.slice_count // max(slices, 1)
        info.multiprocessorCount = spec.multiprocessors * slices // max(spec.slice_count, 1)
        info.name = f"{slices}c.{spec.name}".encode()
        return info

    @_nvml_call
    def nvmlGpuInstanceCreateComputeInstance(self, gi: _GpuInstanceHandle, profile_id: int) -> Any:
        inst = self._live(gi)
        slices = next((n for n, idx in CI_PROFILE_BY_SLICES.items() if idx == profile_id), None)
        if slices is None:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self.mig.create_compute_instance(gi.spec, inst, int(slices))  # type: ignore[arg-type]
        return _ComputeInstanceHandle(gi)

    @_nvml_call
    def nvmlGpuInstanceGetComputeInstanceById(self, gi: _GpuInstanceHandle, ci_id: int) -> Any:
        inst = self._live(gi)
        if inst.ci_id is None or inst.ci_id != ci_id:
            _raise(pynvml.NVML_ERROR_NOT_FOUND)
        return _ComputeInstanceHandle(gi)

    @_nvml_call
    def nvmlComputeInstanceGetInfo(self, ci: _ComputeInstanceHandle) -> Any:
        inst = self._live(ci)
        if inst.ci_id is None:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        spec = self.profile.mig_profiles[inst.profile]
        info = pynvml.c_nvmlComputeInstanceInfo_t()
        info.id, info.profileId = int(inst.ci_id or 0), CI_PROFILE_BY_SLICES.get(spec.slice_count, 0)
        info.placement.start, info.placement.size = 0, spec.slice_count
        return info

    @_nvml_call
    def nvmlComputeInstanceDestroy(self, ci: _ComputeInstanceHandle) -> int:
        inst = self._live(ci)
        if inst.ci_id is None:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self.mig.destroy_compute_instance(ci.spec, inst)
        return int(pynvml.NVML_SUCCESS)

    @_nvml_call
    def nvmlGpuInstanceDestroy(self, gi: _GpuInstanceHandle) -> int:
        inst = self._live(gi)
        self.mig.destroy_gpu_instance(gi.spec, inst)
        return int(pynvml.NVML_SUCCESS)

    # -- NVLink and topology -------------------------------------------------------------------

    def _link_remote(self, h: _GpuHandle, link: int) -> str | None:
        if not 0 <= link < h.spec.nvlink_count:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        first = 0
        for nv in h.spec.nvlinks:
            if first <= link < first + nv.links:
                return nv.remote
            first += nv.links
        return None

    @_nvml_call
    def nvmlDeviceGetNvLinkState(self, h: _GpuHandle, link: int) -> int:
        if h.spec.nvlink_count == 0:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(self._link_remote(h, link) is not None)

    @_nvml_call
    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: _GpuHandle, link: int) -> Any:
        if h.spec.nvlink_count == 0:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        remote = self._link_remote(h, link)
        if remote is None:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)  # an inactive link has no remote end
        return _pci_info(str(remote))

    @_nvml_call
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: _GpuHandle, link: int) -> int:
        if h.spec.nvlink_count == 0:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        remote = self._link_remote(h, link)
        if remote is None:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if str(remote).lower() in self._by_bus:
            return int(pynvml.NVML_NVLINK_DEVICE_TYPE_GPU)
        return int(pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH)

    @_nvml_call
    def nvmlDeviceGetTopologyCommonAncestor(self, h1: _GpuHandle, h2: _GpuHandle) -> int:
        a, b = h1.spec, h2.spec
        if a is b:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)  # what a real H200 answers for itself
        if a.pcie_switch is not None and a.pcie_switch == b.pcie_switch:
            return int(pynvml.NVML_TOPOLOGY_SINGLE)
        if a.pcie_root is not None and a.pcie_root == b.pcie_root:
            return int(pynvml.NVML_TOPOLOGY_HOSTBRIDGE)
        if a.numa_node is not None and a.numa_node == b.numa_node:
            return int(pynvml.NVML_TOPOLOGY_NODE)
        return int(pynvml.NVML_TOPOLOGY_SYSTEM)

    @_nvml_call
    def nvmlDeviceGetGpuFabricInfoV(self, h: _GpuHandle, ref: Any) -> int:
        fabric = h.spec.fabric
        if fabric is None and h.spec.architecture < HOPPER:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        out = ref._obj  # a ctypes byref() of the caller's struct, as with the real library
        if fabric is None:
            # Hopper without a fabric: success, state NOT_SUPPORTED, a zero cluster UUID (H200).
            out.status, out.state, out.cliqueId = pynvml.NVML_SUCCESS, 0, 0
            return int(pynvml.NVML_SUCCESS)
        raw = uuidlib.UUID(fabric.cluster_uuid).bytes
        for i, byte in enumerate(raw):
            out.clusterUuid[i] = byte
        out.status = pynvml.NVML_SUCCESS
        out.cliqueId = fabric.clique_id
        out.state = fabric.state
        return int(pynvml.NVML_SUCCESS)
