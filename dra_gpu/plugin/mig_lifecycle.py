"""Dynamic MIG instances through NVML: create at a pinned placement, find, destroy.

Every call blocks (NVML does) and runs under one lock, since NVML's MIG calls on a GPU must not
interleave; the preparer calls them from a worker thread. Nothing here decides *whether* an
instance may be destroyed: callers pass what the checkpoint recorded, and `destroy` refuses an
instance whose profile or placement is not the recorded one (its ID was reused since).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from typing import Any

from dra_gpu.model.inventory import MigDevice, MigPlacement

log = logging.getLogger(__name__)

MAX_GPU_INSTANCE_ID = 32  # NVML's IDs are small (H100: < 15); scanning past them is harmless
MAX_COMPUTE_INSTANCE_ID = 8


class MigError(RuntimeError):
    """An NVML MIG call failed; the message names the GPU, the placement and NVML's answer."""

    def __init__(self, message: str, nvml_error: Exception | None = None) -> None:
        super().__init__(message)
        self.nvml_error = nvml_error


@dataclass(frozen=True)
class LiveInstance:
    """A GPU instance NVML reports, with its compute instances."""

    parent_uuid: str
    gi_id: int
    profile_id: int
    start: int
    size: int
    ci_ids: tuple[int, ...]

    def describe(self) -> str:
        return f"GPU instance {self.gi_id} (profile {self.profile_id} at {self.start}:{self.size})"


class MigInstances:
    """MIG instance lifecycle on one node's GPUs (`nvml`: the node's pynvml; unit tests: FakeNvml)."""

    def __init__(self, nvml: Any) -> None:
        self.nv = nvml
        self._lock = threading.Lock()
        self.nv.nvmlInit()  # held for the plugin's life (NVML's init is reference-counted)

    def close(self) -> None:
        self.nv.nvmlShutdown()

    def _gpu(self, parent_uuid: str) -> Any:
        try:
            return self.nv.nvmlDeviceGetHandleByUUID(parent_uuid)
        except self.nv.NVMLError as exc:
            raise MigError(f"GPU {parent_uuid}: not found by NVML: {_describe(exc)}", exc) from exc

    def create_gpu_instance(self, parent_uuid: str, placement: MigPlacement) -> int:
        """Create the GI at exactly `placement`; returns its ID."""
        p = placement.profile
        with self._lock:
            h = self._gpu(parent_uuid)
            where = ctypes.byref(_placement(self.nv, placement.start, p.memory_slices))
            try:
                gi = self.nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, p.profile_id, where)
                return int(self.nv.nvmlGpuInstanceGetInfo(gi).id)
            except self.nv.NVMLError as exc:
                raise MigError(
                    f"GPU {parent_uuid}: cannot create a {p.name} GPU instance at memory slices "
                    f"{placement.start}-{placement.start + p.memory_slices - 1}: NVML: {_describe(exc)}"
                    f"{self._occupants(h, placement)}",
                    exc,
                ) from exc

    def create_compute_instance(self, parent_uuid: str, gi_id: int, placement: MigPlacement) -> int:
        """The GI's one compute instance spanning all its SMs; returns its ID."""
        with self._lock:
            h = self._gpu(parent_uuid)
            try:
                gi = self.nv.nvmlDeviceGetGpuInstanceById(h, gi_id)
                profile = self._full_ci_profile(gi, placement.profile.compute_slices)
                ci = self.nv.nvmlGpuInstanceCreateComputeInstance(gi, profile)
                return int(self.nv.nvmlComputeInstanceGetInfo(ci).id)
            except self.nv.NVMLError as exc:
                raise MigError(
                    f"GPU {parent_uuid}: cannot create the compute instance of GPU instance {gi_id} "
                    f"({placement.profile.name}): NVML: {_describe(exc)}",
                    exc,
                ) from exc

    def _full_ci_profile(self, gi: Any, slices: int) -> int:
        for index in range(int(self.nv.NVML_COMPUTE_INSTANCE_PROFILE_COUNT)):
            try:
                info = self.nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, index, self.nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                )
            except self.nv.NVMLError:
                continue
            if int(info.sliceCount) == slices:
                return int(info.id)
        raise self.nv.NVMLError(self.nv.NVML_ERROR_NOT_SUPPORTED)

    def mig_device(self, parent_uuid: str, gi_id: int, ci_id: int, placement: MigPlacement) -> MigDevice:
        """The MIG device of (GI, CI): its UUID is what the container is given."""
        with self._lock:
            h = self._gpu(parent_uuid)
            try:
                count = int(self.nv.nvmlDeviceGetMaxMigDeviceCount(h))
                for i in range(count):
                    try:
                        mig = self.nv.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
                    except self.nv.NVMLError_NotFound:
                        continue
                    if (
                        int(self.nv.nvmlDeviceGetGpuInstanceId(mig)) == gi_id
                        and int(self.nv.nvmlDeviceGetComputeInstanceId(mig)) == ci_id
                    ):
                        return made_device(placement, gi_id, ci_id, str(self.nv.nvmlDeviceGetUUID(mig)))
            except self.nv.NVMLError as exc:
                raise MigError(
                    f"GPU {parent_uuid}: cannot read MIG device {gi_id}/{ci_id}: NVML: {_describe(exc)}", exc
                ) from exc
        raise MigError(f"GPU {parent_uuid}: no MIG device for GPU instance {gi_id}, compute instance {ci_id}")

    def instances(self, parent_uuid: str) -> list[LiveInstance]:
        with self._lock:
            return self._instances(self._gpu(parent_uuid), parent_uuid)

    def _instances(self, h: Any, parent_uuid: str) -> list[LiveInstance]:
        out = []
        for gi_id in range(MAX_GPU_INSTANCE_ID):
            try:
                gi = self.nv.nvmlDeviceGetGpuInstanceById(h, gi_id)
                info = self.nv.nvmlGpuInstanceGetInfo(gi)
            except self.nv.NVMLError:
                continue  # NotFound / InvalidArgument: no such instance
            cis = []
            for ci_id in range(MAX_COMPUTE_INSTANCE_ID):
                try:
                    self.nv.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id)
                    cis.append(ci_id)
                except self.nv.NVMLError:
                    continue
            out.append(
                LiveInstance(
                    parent_uuid,
                    gi_id,
                    int(info.profileId),
                    int(info.placement.start),
                    int(info.placement.size),
                    tuple(cis),
                )
            )
        return out

    def _occupants(self, h: Any, placement: MigPlacement) -> str:
        """ ", held by ..." naming the instances overlapping `placement` (for error messages)."""
        try:
            live = self._instances(h, "")
        except Exception:  # best effort: the message is still useful without it
            return ""
        mine = set(placement.slices)
        clash = [i.describe() for i in live if mine & set(range(i.start, i.start + i.size))]
        return f"; the slices are held by {', '.join(clash)}" if clash else ""

    def processes(self, parent_uuid: str, gi_id: int) -> list[int]:
        """PIDs running on the GI's MIG devices (empty when it has none)."""
        with self._lock:
            h = self._gpu(parent_uuid)
            pids: list[int] = []
            count = int(self.nv.nvmlDeviceGetMaxMigDeviceCount(h))
            for i in range(count):
                try:
                    mig = self.nv.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
                    if int(self.nv.nvmlDeviceGetGpuInstanceId(mig)) != gi_id:
                        continue
                    pids += [int(p.pid) for p in self.nv.nvmlDeviceGetComputeRunningProcesses(mig)]
                except self.nv.NVMLError_NotFound:
                    continue
            return pids

    def destroy(self, parent_uuid: str, gi_id: int, profile_id: int, start: int) -> bool:
        """Destroy the GI (its compute instances first) if it is still the recorded one.

        False when there is nothing to destroy (already gone, or the ID now belongs to another
        instance, which is then left alone)."""
        with self._lock:
            h = self._gpu(parent_uuid)
            try:
                gi = self.nv.nvmlDeviceGetGpuInstanceById(h, gi_id)
                info = self.nv.nvmlGpuInstanceGetInfo(gi)
            except (self.nv.NVMLError_NotFound, self.nv.NVMLError_InvalidArgument):
                return False
            except self.nv.NVMLError as exc:
                raise MigError(
                    f"GPU {parent_uuid}: cannot look up GPU instance {gi_id}: NVML: {_describe(exc)}", exc
                ) from exc
            if (int(info.profileId), int(info.placement.start)) != (profile_id, start):
                log.warning(
                    "gpu instance id reused, not destroyed gpu=%s gi=%d recorded=%d@%d now=%d@%d",
                    parent_uuid,
                    gi_id,
                    profile_id,
                    start,
                    info.profileId,
                    info.placement.start,
                )
                return False
            try:
                for ci_id in range(MAX_COMPUTE_INSTANCE_ID):
                    try:
                        ci = self.nv.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id)
                    except (self.nv.NVMLError_NotFound, self.nv.NVMLError_InvalidArgument):
                        continue
                    self.nv.nvmlComputeInstanceDestroy(ci)
                self.nv.nvmlGpuInstanceDestroy(gi)
            except self.nv.NVMLError as exc:
                raise MigError(
                    f"GPU {parent_uuid}: cannot destroy GPU instance {gi_id} (profile {profile_id} at "
                    f"{start}): NVML: {_describe(exc)}",
                    exc,
                ) from exc
            log.info(
                "mig instance destroyed gpu=%s gi=%d profile=%d start=%d",
                parent_uuid,
                gi_id,
                profile_id,
                start,
            )
            return True


def made_device(placement: MigPlacement, gi_id: int, ci_id: int, uuid: str) -> MigDevice:
    """The MIG device of an instance made at `placement`."""
    p = placement.profile
    return MigDevice(
        uuid=uuid,
        profile=p.name,
        gpu_instance_id=gi_id,
        compute_instance_id=ci_id,
        gi_profile_id=p.profile_id,
        placement_start=placement.start,
        placement_size=p.memory_slices,
        memory_bytes=p.memory_bytes,
        multiprocessors=p.multiprocessors,
        copy_engines=p.copy_engines,
        decoders=p.decoders,
        encoders=p.encoders,
        jpeg_engines=p.jpeg_engines,
        ofa_engines=p.ofa_engines,
    )


def _describe(exc: Exception) -> str:
    """NVML's words for an error, with its name when the library could not give them."""
    text = str(exc)
    name = type(exc).__name__.removeprefix("NVMLError_").removeprefix("NVMLError")
    return text if not name or name in text.replace(" ", "") else f"{text} ({name})"


def _placement(nv: Any, start: int, size: int) -> Any:
    p = nv.c_nvmlGpuInstancePlacement_t()
    p.start, p.size = start, size
    return p
