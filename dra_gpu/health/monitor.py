"""Watches the GPUs through NVML: event sets for XIDs, ECC and lost GPUs, plus a periodic liveness
and recovery-action check. All in threads: `nvmlEventSetWait` blocks, and NVML calls must never
block the plugin's event loop.

One event set and one thread per physical GPU (MIG devices included, which NVML reports on the
parent): a `GPU_IS_LOST` from a wait then names the GPU it is about, and one broken GPU cannot stall
the others. Each observation goes to `sink`, which must be thread-safe.

Only `NVML_ERROR_GPU_IS_LOST` is a lost GPU (as in NVIDIA's own drivers). Any other error of an
event wait or a query (`NVML_ERROR_UNKNOWN`, a driver hiccup) is transient: retried with
exponential backoff, each failed attempt reported as `Seen.ERROR` (counted in a metric, labelled
from closed sets: `CALLS`, `error_label`), never a taint. An event set whose waits keep failing
for a whole check interval is freed and registered again at the next check.
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
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    stop_any,
    stop_when_event_set,
    wait_exponential,
)
from tenacity.stop import stop_base

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
# Backoff of a failing NVML call: 0.1 s, 0.2 s, 0.4 s, ... up to 30 s between attempts.
BACKOFF_INITIAL = 0.1
BACKOFF_MAX = 30.0
QUERY_ATTEMPTS = 3  # a liveness query's attempts within one check
# The calls whose errors are counted (the metric's `call` label).
CALLS = ("event-register", "event-wait", "liveness", "recovery-action")
_ERROR_LABELS = {
    pynvml.NVML_ERROR_UNINITIALIZED: "uninitialized",
    pynvml.NVML_ERROR_INVALID_ARGUMENT: "invalid-argument",
    pynvml.NVML_ERROR_NOT_SUPPORTED: "not-supported",
    pynvml.NVML_ERROR_NO_PERMISSION: "no-permission",
    pynvml.NVML_ERROR_NOT_FOUND: "not-found",
    pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES: "insufficient-resources",
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "driver-not-loaded",
    pynvml.NVML_ERROR_TIMEOUT: "timeout",
    pynvml.NVML_ERROR_IRQ_ISSUE: "irq-issue",
    pynvml.NVML_ERROR_RESET_REQUIRED: "reset-required",
    pynvml.NVML_ERROR_OPERATING_SYSTEM: "operating-system",
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: "rm-version-mismatch",
    pynvml.NVML_ERROR_IN_USE: "in-use",
    pynvml.NVML_ERROR_MEMORY: "memory",
    pynvml.NVML_ERROR_NO_DATA: "no-data",
    pynvml.NVML_ERROR_UNKNOWN: "unknown",
}
ERROR_LABELS = (*_ERROR_LABELS.values(), "other")  # the metric's `error` label


def error_label(exc: BaseException | None) -> str:
    """The metric label of an NVML error: one of ERROR_LABELS."""
    value = getattr(exc, "value", None)
    return _ERROR_LABELS.get(value, "other") if isinstance(value, int) else "other"


class Seen(enum.Enum):
    EVENT = "event"  # an NVML event (kind, data, gi, ci)
    ALIVE = "alive"  # the liveness check passed (recovery_action: NVML's, None if not reported)
    LOST = "lost"  # GPU_IS_LOST from a call or a wait
    UNMONITORED = "unmonitored"  # events cannot be registered on this GPU (liveness still runs)
    ERROR = "error"  # another NVML error of `call` (retried): counted, never a taint


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
    call: str = ""  # Seen.ERROR: one of CALLS
    error: str = ""  # Seen.ERROR: one of ERROR_LABELS


def _is_lost(exc: BaseException) -> bool:
    return isinstance(exc, pynvml.NVMLError) and exc.value == pynvml.NVML_ERROR_GPU_IS_LOST


def _transient(exc: BaseException) -> bool:
    """An NVML error worth another attempt: not a lost GPU, not a wait's plain timeout."""
    return isinstance(exc, pynvml.NVMLError) and not _is_lost(exc) and exc.value != pynvml.NVML_ERROR_TIMEOUT


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

    def _failed(self, call: str, exc: BaseException | None) -> None:
        self._emit(Seen.ERROR, call=call, error=error_label(exc), detail=str(exc))

    def _retrying(self, call: str, stop: stop_base) -> Retrying:
        """Transient NVML errors of `call` retried with backoff until `stop` (or the watch ends),
        each failed attempt reported; the last error is raised again."""

        def failed(state: RetryCallState) -> None:
            self._failed(call, state.outcome.exception() if state.outcome else None)

        def sleep(seconds: float) -> None:
            self.stopping.wait(seconds)  # stop() ends a backoff at once

        return Retrying(
            retry=retry_if_exception(_transient),
            wait=wait_exponential(multiplier=BACKOFF_INITIAL, max=BACKOFF_MAX),
            stop=stop_any(stop_when_event_set(self.stopping), stop),
            sleep=sleep,
            after=failed,
            reraise=True,
        )

    def _query(self, call: str, fn: Callable[..., Any], *args: Any) -> Any:
        for attempt in self._retrying(call, stop_after_attempt(QUERY_ATTEMPTS)):
            with attempt:
                return fn(*args)
        raise AssertionError("unreachable: Retrying reraises")  # pragma: no cover

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
            elif exc.value == pynvml.NVML_ERROR_NOT_SUPPORTED:
                if not self._unmonitored_said:
                    self._unmonitored_said = True
                    self._emit(Seen.UNMONITORED, detail=str(exc))
            else:
                self._failed("event-register", exc)  # registered again at the next check

    def _check(self) -> None:
        """Liveness: the memory query answers (a lost GPU does not), and NVML's recovery action.
        A transient error is retried; when it persists the GPU is neither alive nor lost."""
        if self._handle is None:
            return
        try:
            self._query("liveness", self.nvml.nvmlDeviceGetMemoryInfo, self._handle)
        except pynvml.NVMLError as exc:
            if _is_lost(exc):
                self._emit(Seen.LOST, detail=str(exc))
            return
        try:
            action = self._recovery_action()
        except pynvml.NVMLError as exc:
            if _is_lost(exc):
                self._emit(Seen.LOST, detail=str(exc))
                return
            action = None
        self._emit(Seen.ALIVE, recovery_action=action)

    def _recovery_action(self) -> int | None:
        """NVML's NVML_FI_DEV_GET_GPU_RECOVERY_ACTION of the GPU (None: not reported)."""
        (value,) = self._query(
            "recovery-action",
            self.nvml.nvmlDeviceGetFieldValues,
            self._handle,
            [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION],
        )
        return int(value.value.uiVal) if value.nvmlReturn == pynvml.NVML_SUCCESS else None

    def _wait_once(self, seconds: float) -> None:
        if self._set is None:
            self.stopping.wait(seconds)
            return
        try:
            # A failing wait is retried with backoff for up to one check interval.
            for attempt in self._retrying("event-wait", stop_after_delay(self.interval)):
                with attempt:
                    event = self.nvml.nvmlEventSetWait(self._set, max(1, int(seconds * 1000)))
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                return
            if _is_lost(exc):
                self._emit(Seen.LOST, detail=str(exc))
                self.stopping.wait(seconds)  # no busy loop on a lost GPU's set
            elif not self.stopping.is_set():
                # Failing for a whole interval: a new event set at the next check.
                log.warning("event wait keeps failing, new event set gpu=%s error=%r", self.uuid, str(exc))
                with contextlib.suppress(pynvml.NVMLError):
                    self.nvml.nvmlEventSetFree(self._set)
                self._set = None
            return
        kind = _EVENT_KINDS.get(int(event.eventType))
        if kind is not None:
            data = int(event.eventData)
            if kind is EventKind.RECOVERY_ACTION:
                # nvml.h: eventData is 0 for any event but an XID; the action is NVML's field.
                try:
                    data = self._recovery_action() or 0
                except pynvml.NVMLError as exc:
                    log.warning("recovery action unreadable gpu=%s error=%r", self.uuid, str(exc))
            self._emit(
                Seen.EVENT,
                kind=kind,
                data=data,
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
