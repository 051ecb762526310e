"""Watches the GPUs through NVML: event sets for XIDs, ECC and lost GPUs, plus a periodic liveness
and recovery-action check. All in threads: `nvmlEventSetWait` blocks, and NVML calls must never
block the plugin's event loop.

One event set and one thread per physical GPU (MIG devices included, which NVML reports on the
parent): a `GPU_IS_LOST` from a wait then names the GPU it is about, and one broken GPU cannot stall
the others. Each observation goes to `sink`, which must be thread-safe.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pynvml

from dra_gpu.health.classification import EventKind

log = logging.getLogger(__name__)

NO_ID = 0xFFFFFFFF
WANTED_EVENTS = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypeGpuUnavailableError
    | pynvml.nvmlEventTypeGpuRecoveryAction
)
_EVENT_KINDS = {
    pynvml.nvmlEventTypeXidCriticalError: EventKind.XID,
    pynvml.nvmlEventTypeDoubleBitEccError: EventKind.DOUBLE_BIT_ECC,
    pynvml.nvmlEventTypeGpuUnavailableError: EventKind.GPU_UNAVAILABLE,
    pynvml.nvmlEventTypeGpuRecoveryAction: EventKind.RECOVERY_ACTION,
}
# The longest a thread blocks in one wait, so that stop() returns promptly.
MAX_WAIT_SECONDS = 1.0


class Seen(enum.Enum):
    EVENT = "event"  # an NVML event (kind, data, gi, ci)
    ALIVE = "alive"  # the liveness check passed (recovery_action: NVML's, None if not reported)
    LOST = "lost"  # GpuIsLost / Unknown from a call or a wait
    UNMONITORED = "unmonitored"  # events cannot be registered on this GPU (liveness still runs)


@dataclass(frozen=True)
class Observation:
    gpu_uuid: str
    seen: Seen
    kind: EventKind | None = None
    data: int = 0
    gpu_instance: int = NO_ID
    compute_instance: int = NO_ID
    recovery_action: int | None = None
    detail: str = ""
    at: float = 0.0  # time.monotonic() when observed


def _is_lost(exc: Exception) -> bool:
    return isinstance(exc, pynvml.NVMLError) and exc.value in (
        pynvml.NVML_ERROR_GPU_IS_LOST,
        pynvml.NVML_ERROR_UNKNOWN,
    )


class GpuWatcher:
    """One GPU's thread: wait for events, and every `interval` check liveness."""

    def __init__(
        self, nvml: Any, gpu_uuid: str, sink: Callable[[Observation], None], interval: float
    ) -> None:
        self.nvml = nvml
        self.uuid = gpu_uuid
        self.sink = sink
        self.interval = interval
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"gpu-health-{gpu_uuid[:12]}", daemon=True)
        self._handle: Any = None
        self._set: Any = None
        self._unmonitored_said = False

    def _emit(self, seen: Seen, **kw: Any) -> None:
        try:
            self.sink(Observation(self.uuid, seen, at=time.monotonic(), **kw))
        except Exception:  # the sink's bug must not end the watch
            log.exception("health sink failed gpu=%s", self.uuid)

    def _register(self) -> None:
        """Handle and event set; on failure the GPU is lost or unmonitored, retried next check."""
        try:
            if self._handle is None:
                self._handle = self.nvml.nvmlDeviceGetHandleByUUID(self.uuid)
            supported = int(self.nvml.nvmlDeviceGetSupportedEventTypes(self._handle))
            mask = WANTED_EVENTS & supported
            if not mask:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            event_set = self.nvml.nvmlEventSetCreate()
            self.nvml.nvmlDeviceRegisterEvents(self._handle, mask, event_set)
            self._set = event_set
        except pynvml.NVMLError as exc:
            if _is_lost(exc):
                self._emit(Seen.LOST, detail=str(exc))
            elif not self._unmonitored_said:
                self._unmonitored_said = True
                self._emit(Seen.UNMONITORED, detail=str(exc))

    def _check(self) -> None:
        if self._handle is None:
            return
        try:
            self.nvml.nvmlDeviceGetMemoryInfo(self._handle)
        except pynvml.NVMLError as exc:
            if _is_lost(exc):
                self._emit(Seen.LOST, detail=str(exc))
                return
        action: int | None = None
        try:
            (value,) = self.nvml.nvmlDeviceGetFieldValues(
                self._handle, [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
            )
            if value.nvmlReturn == pynvml.NVML_SUCCESS:
                action = int(value.value.uiVal)
        except pynvml.NVMLError as exc:
            if _is_lost(exc):
                self._emit(Seen.LOST, detail=str(exc))
                return
        self._emit(Seen.ALIVE, recovery_action=action)

    def _wait_once(self, seconds: float) -> None:
        if self._set is None:
            self.stopping.wait(seconds)
            return
        try:
            event = self.nvml.nvmlEventSetWait(self._set, max(1, int(seconds * 1000)))
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                return
            if _is_lost(exc):
                self._emit(Seen.LOST, detail=str(exc))
            else:
                log.warning("event wait failed gpu=%s error=%r", self.uuid, str(exc))
            self.stopping.wait(seconds)  # no busy loop on a broken set
            return
        kind = _EVENT_KINDS.get(int(event.eventType))
        if kind is not None:
            self._emit(
                Seen.EVENT,
                kind=kind,
                data=int(event.eventData),
                gpu_instance=int(event.gpuInstanceId),
                compute_instance=int(event.computeInstanceId),
            )

    def _run(self) -> None:
        next_check = 0.0
        while not self.stopping.is_set():
            now = time.monotonic()
            if now >= next_check:
                if self._set is None:
                    self._register()
                self._check()
                next_check = now + self.interval
            self._wait_once(min(MAX_WAIT_SECONDS, max(0.01, next_check - time.monotonic())))
        if self._set is not None:
            with contextlib.suppress(pynvml.NVMLError):
                self.nvml.nvmlEventSetFree(self._set)


class Monitor:
    """The watchers of all GPUs; start() and stop() are called from the event loop's side."""

    def __init__(
        self,
        nvml: Any,
        gpu_uuids: Sequence[str],
        sink: Callable[[Observation], None],
        interval: float = 5.0,
    ) -> None:
        self.watchers = [GpuWatcher(nvml, u, sink, interval) for u in gpu_uuids]

    def start(self) -> None:
        for w in self.watchers:
            w.thread.start()

    def stop(self, timeout: float = 2 * MAX_WAIT_SECONDS) -> None:
        for w in self.watchers:
            w.stopping.set()
        deadline = time.monotonic() + timeout
        for w in self.watchers:
            if w.thread.is_alive():
                w.thread.join(max(0.0, deadline - time.monotonic()))
