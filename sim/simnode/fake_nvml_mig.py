"""The MIG half of the fake NVML: MIG mode, MIG device handles, GPU and compute instances (their
profiles, placements, creation and destruction on `fake_mig.SimulatedMig`'s placement rules) and the
processes on them.

Kept apart from fake_nvml.py's inventory calls; FakeNvml mixes it in, beside fake_nvml_events.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import pynvml

from dra_gpu.discovery.nvml_compat import exported_in
from simnode.fake_mig import Instance, SimulatedMig
from simnode.fake_nvml_base import (
    CI_PROFILE_BY_SLICES,
    MAX_MIG_DEVICES,
    _ComputeInstanceHandle,
    _GpuHandle,
    _GpuInstanceHandle,
    _MigHandle,
    _nvml_call,
    _Process,
    _raise,
)
from simnode.profiles import NodeProfile


class FakeNvmlMig:
    """MIG mode, MIG devices and GPU / compute instances of a simulated node."""

    profile: NodeProfile
    mig: SimulatedMig

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
