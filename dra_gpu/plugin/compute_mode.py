"""GPU compute modes through NVML (the node's pynvml: the driver keeps the mode, so
nvidia-smi and a restarted plugin see it; unit tests: FakeNvml).

MPS needs its GPUs in EXCLUSIVE_PROCESS (the MPS server is then the one context on them); time
slicing needs DEFAULT. The mode is not persistent across reboots but is across processes, so the
plugin records the mode it found and restores it when the last claim that needed another is gone.
Only full GPUs get a compute mode: on a MIG-enabled GPU it is DEFAULT and cannot be changed
(NVML up to the CUDA 13.1 headers: "changing it is not supported"; the driver answers
NOT_SUPPORTED on a MIG device's handle). MPS on a MIG device needs none: each MIG device has its
own MPS server. NVIDIA's DRA driver does the same (compute mode on full-GPU UUIDs only).
"""

from __future__ import annotations

import threading
from typing import Any

DEFAULT = 0
PROHIBITED = 2
EXCLUSIVE_PROCESS = 3
NAMES = {DEFAULT: "Default", PROHIBITED: "Prohibited", EXCLUSIVE_PROCESS: "ExclusiveProcess"}


class ComputeModeError(RuntimeError):
    """NVML refused to read or set a device's compute mode."""


class DeviceGoneError(ComputeModeError):
    """The device is not on the node any more (NVML does not find it, or it fell off the bus)."""


# nvml.h: NVML_ERROR_NOT_FOUND (no device of that UUID), NVML_ERROR_GPU_IS_LOST
_GONE = (6, 15)


def settable(uuid: str) -> bool:
    """Whether `uuid` is a device whose compute mode can be set: a full GPU ("GPU-..."), not a MIG
    device (NVML names every MIG device "MIG-...")."""
    return not uuid.startswith("MIG-")


def mode_name(mode: int) -> str:
    return NAMES.get(mode, f"mode {mode}")


class ComputeModes:
    """Read and set compute modes by device UUID (GPU or MIG device)."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml  # the node's pynvml (unit tests: a FakeNvml)
        self._lock = threading.Lock()  # NVML init/shutdown pairs from several threads

    def _call(self, uuid: str, what: str, fn: Any, *args: Any) -> Any:
        with self._lock:
            try:
                self.nvml.nvmlInit()
            except self.nvml.NVMLError as exc:
                raise ComputeModeError(f"NVML init failed: {exc}") from exc
            try:
                handle = self.nvml.nvmlDeviceGetHandleByUUID(uuid)
                return fn(handle, *args)
            except self.nvml.NVMLError as exc:
                error = DeviceGoneError if getattr(exc, "value", None) in _GONE else ComputeModeError
                raise error(f"device {uuid}: cannot {what} compute mode: {exc}") from exc
            finally:
                self.nvml.nvmlShutdown()

    def get(self, uuid: str) -> int:
        return int(self._call(uuid, "read the", self.nvml.nvmlDeviceGetComputeMode))

    def set(self, uuid: str, mode: int) -> None:
        self._call(uuid, f"set the {mode_name(mode)}", self.nvml.nvmlDeviceSetComputeMode, mode)
