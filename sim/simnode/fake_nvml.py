"""A pynvml-shaped NVML that serves a simulated node profile.

It has the same function names, returns the same pynvml ctypes structs and raises the same
`NVMLError` subclasses as `pynvml`, so discovery runs unchanged against it. Constants, struct
classes and exception classes are pynvml's own. An `nvml*` function the fake does not implement
raises `NVMLError_FunctionNotFound`, as an old driver would, rather than reaching the real library.

For in-process tests and benchmarks only (`simnode.fake`): a simulated node's commands
load the C library built from the same profile. Its MIG calls are in fake_nvml_mig.py, its event
and health calls in fake_nvml_events.py, the handles and the call wrapper in fake_nvml_base.py.
"""

from __future__ import annotations

import json
import os
import uuid as uuidlib
from pathlib import Path
from typing import Any

import pynvml

from dra_gpu.common.durable import replace_atomically
from simnode.fake_mig import SimulatedMig
from simnode.fake_nvml_base import (
    HOPPER,
    _GpuHandle,
    _MigHandle,
    _nvml_call,
    _pci_info,
    _raise,
    parse_failures,
)
from simnode.fake_nvml_events import FakeNvmlEvents
from simnode.fake_nvml_mig import FakeNvmlMig
from simnode.profiles import NODE_FAILURE_ENV, NodeProfile

__all__ = ["FakeNvml", "parse_failures"]


class FakeNvml(FakeNvmlMig, FakeNvmlEvents):
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
            replace_atomically(self._state_file, json.dumps(doc, indent=2).encode(), mode=0o644)

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
