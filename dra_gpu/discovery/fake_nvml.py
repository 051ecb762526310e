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
import uuid as uuidlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pynvml

from dra_gpu.discovery.fake_nvml_events import FakeNvmlEvents
from dra_gpu.discovery.profiles import GpuSpec, MigInstanceSpec, NodeProfile
from dra_gpu.durable import atomic_write

F = TypeVar("F", bound=Callable[..., Any])

MAX_MIG_DEVICES = 7
HOPPER = 9


class _GpuHandle:
    def __init__(self, spec: GpuSpec) -> None:
        self.spec = spec


class _MigHandle:
    def __init__(self, parent: _GpuHandle, instance: MigInstanceSpec) -> None:
        self.parent = parent
        self.instance = instance
        self.spec = parent.spec  # errors injected on the parent apply to its MIG devices too


class _GpuInstanceHandle:
    def __init__(self, parent: _GpuHandle, instance: MigInstanceSpec) -> None:
        self.parent = parent
        self.instance = instance
        self.spec = parent.spec


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
        if isinstance(spec, GpuSpec):
            code = spec.nvml_errors.get(fn.__name__, spec.nvml_errors.get("*"))
            if code is not None:
                _raise(code)
        self._check_lost(handle)  # a simulated lost GPU (health events)
        code = self.profile.nvml_errors.get(fn.__name__)
        if code is not None:
            _raise(code)
        return fn(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class FakeNvml(FakeNvmlEvents):
    """Drop-in for the `pynvml` module, backed by a NodeProfile."""

    def __init__(self, profile: NodeProfile, state_file: Path | None = None) -> None:
        """`state_file`: where settings a driver keeps until reboot (compute modes) are kept, so
        that a restarted process sees them as it would on a GPU; None keeps them in memory."""
        self.profile = profile
        self._init_count = 0
        self._handles = [_GpuHandle(g) for g in profile.gpus]
        self._by_bus = {h.spec.pci_bus_id.lower(): h for h in self._handles}
        self._init_events()
        self._state_file = state_file
        self._compute_modes: dict[str, int] = {}

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
            for instance in h.spec.mig_instances if h.spec.mig_enabled else []:
                if instance.uuid == uuid:
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
        if isinstance(h, _GpuHandle) and h.spec.mig_enabled:
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

    @_nvml_call
    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: _GpuHandle, index: int) -> _MigHandle:
        if not 0 <= index < MAX_MIG_DEVICES:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if index >= len(h.spec.mig_instances):
            _raise(pynvml.NVML_ERROR_NOT_FOUND)
        return _MigHandle(h, h.spec.mig_instances[index])

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
        return 0

    @_nvml_call
    def nvmlDeviceGetGpuInstanceById(self, h: _GpuHandle, gi_id: int) -> _GpuInstanceHandle:
        for inst in h.spec.mig_instances:
            if inst.gi_id == gi_id:
                return _GpuInstanceHandle(h, inst)
        _raise(pynvml.NVML_ERROR_NOT_FOUND)
        raise AssertionError("unreachable")

    @_nvml_call
    def nvmlGpuInstanceGetInfo(self, gi: _GpuInstanceHandle) -> Any:
        p = self.profile.mig_profiles[gi.instance.profile]
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.id, info.profileId = gi.instance.gi_id, p.profile_id
        info.placement.start, info.placement.size = gi.instance.placement, p.placement_size
        return info

    def _profile_info(self, h: _GpuHandle, match: Callable[[Any], bool]) -> Any:
        if not h.spec.mig_capable:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        for p in self.profile.mig_profiles.values():
            if match(p):
                info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
                info.version = 0  # the driver leaves it zero (seen on an H200)
                info.id, info.sliceCount = p.profile_id, p.slice_count
                info.instanceCount = 7 // max(p.slice_count, 1)
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
        return self._profile_info(h, lambda p: p.profile_id == profile_id)

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
