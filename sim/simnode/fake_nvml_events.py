"""The event and health half of the fake NVML: event sets that deliver injected events, a GPU
that can be lost, and the recovery-action field.

Kept apart from fake_nvml.py's inventory calls; FakeNvml mixes it in, beside fake_nvml_mig. The
`inject_*` and `set_*` methods are not NVML: they are how XIDs, ECC errors, lost GPUs and
recoveries get into the fake (in-process tests, the plugin's control socket among them; a
simulated node's commands inject through `simnode.inject`).
Like NVML, `nvmlEventSetWait` blocks the calling thread until an event or the timeout.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import pynvml

NO_ID = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId of an event not attributable to MIG
SUPPORTED_EVENTS = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypeSingleBitEccError
    | pynvml.nvmlEventTypeGpuUnavailableError
    | pynvml.nvmlEventTypeGpuRecoveryAction
)


class _EventSet:
    def __init__(self) -> None:
        self.masks: dict[str, int] = {}  # GPU UUID -> registered event mask
        self.pending: collections.deque[Any] = collections.deque()
        self.freed = False


def _uuid_of(handle: Any) -> str:
    spec = getattr(handle, "spec", None)
    if spec is None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return str(spec.uuid)


class FakeNvmlEvents:
    """Event sets, lost GPUs and recovery actions of a simulated node (thread-safe)."""

    def _init_events(self) -> None:
        self._events = threading.Condition()
        self._sets: list[_EventSet] = []
        self._lost: set[str] = set()
        self._recovery: dict[str, int] = {}

    def _check_lost(self, handle: Any) -> None:
        spec = getattr(handle, "spec", None)
        if spec is not None and spec.uuid in self._lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    # -- NVML ----------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> _EventSet:
        event_set = _EventSet()
        with self._events:
            self._sets.append(event_set)
        return event_set

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._check_lost(handle)
        return int(SUPPORTED_EVENTS)

    def nvmlDeviceRegisterEvents(self, handle: Any, mask: int, event_set: _EventSet) -> None:
        self._check_lost(handle)
        if mask & ~SUPPORTED_EVENTS:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self._events:
            uuid = _uuid_of(handle)
            event_set.masks[uuid] = event_set.masks.get(uuid, 0) | mask

    def nvmlEventSetWait_v2(self, event_set: _EventSet, timeout_ms: int) -> Any:
        deadline = time.monotonic() + timeout_ms / 1000
        with self._events:
            while True:
                if event_set.freed:
                    raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
                if event_set.pending:
                    return event_set.pending.popleft()
                if any(uuid in self._lost for uuid in event_set.masks):
                    raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
                self._events.wait(left)

    def nvmlEventSetWait(self, event_set: _EventSet, timeout_ms: int) -> Any:
        return self.nvmlEventSetWait_v2(event_set, timeout_ms)

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:
        with self._events:
            event_set.freed = True
            if event_set in self._sets:
                self._sets.remove(event_set)
            self._events.notify_all()

    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: list[Any]) -> Any:
        self._check_lost(handle)
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for i, field_id in enumerate(field_ids):
            values[i].fieldId = field_id
            if field_id == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
                values[i].nvmlReturn = pynvml.NVML_SUCCESS
                values[i].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                values[i].value.uiVal = self._recovery.get(_uuid_of(handle), 0)
            else:
                values[i].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    # -- injection (not NVML) ------------------------------------------------------------------

    def inject_event(
        self, gpu_uuid: str, event_type: int, data: int = 0, gi: int = NO_ID, ci: int = NO_ID
    ) -> int:
        """Deliver an event to every set registered for it on that GPU; returns how many got it."""
        delivered = 0
        with self._events:
            for event_set in self._sets:
                if event_set.masks.get(gpu_uuid, 0) & event_type:
                    event = pynvml.c_nvmlEventData_t()
                    event.eventType, event.eventData = event_type, data
                    event.gpuInstanceId, event.computeInstanceId = gi, ci
                    event_set.pending.append(event)
                    delivered += 1
            self._events.notify_all()
        return delivered

    def set_lost(self, gpu_uuid: str, lost: bool) -> None:
        """A lost GPU answers GPU_IS_LOST to every call, event waits included."""
        with self._events:
            if lost:
                self._lost.add(gpu_uuid)
            else:
                self._lost.discard(gpu_uuid)
            self._events.notify_all()

    def set_recovery_action(self, gpu_uuid: str, action: int) -> None:
        """NVML_FI_DEV_GET_GPU_RECOVERY_ACTION of the GPU from now on (0 = none)."""
        with self._events:
            self._recovery[gpu_uuid] = action
