"""Give the C heap's free memory back to the kernel once a burst of node requests has ended.

A burst (the kubelet preparing a hundred claims at once) grows glibc's heaps: every Python object
over 512 bytes, the claims' JSON, the CDI specs, the protobuf messages come from malloc. Freed,
that memory stays in the process: glibc gives back only the top of a heap by itself, and the
free chunks in the middle only on malloc_trim(). In the prepare bench (bench/RESULTS.md) a trim
after the run returned ~12 MB of the ~16 MB the burst had added, in 1-3 ms.

So once no request has been in flight for `idle_seconds` and some ran since the last trim,
malloc_trim(0) runs in a worker thread (the event loop keeps serving; a malloc in another thread
may wait for the arena it is trimming). Where the C library has no malloc_trim (musl), nothing runs.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

IDLE_SECONDS = 1.0


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class HeapTrimmer:
    """Count requests in and out (`started`, `finished`, on the event loop); trim when idle."""

    def __init__(self, idle_seconds: float = IDLE_SECONDS) -> None:
        self.idle_seconds = idle_seconds
        self.in_flight = 0
        self.since_trim = 0  # requests finished since the last trim
        self.trims = 0
        self._trim = _malloc_trim()
        self._timer: asyncio.TimerHandle | None = None
        self._running: asyncio.Future[None] | None = None

    @property
    def available(self) -> bool:
        return self._trim is not None

    def started(self) -> None:
        self.in_flight += 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def finished(self) -> None:
        self.in_flight -= 1
        self.since_trim += 1
        if self.in_flight == 0 and self._trim is not None:
            self._timer = asyncio.get_running_loop().call_later(self.idle_seconds, self._start_trim)

    def _start_trim(self) -> None:
        self._timer = None
        if self.in_flight or not self.since_trim or (self._running and not self._running.done()):
            return
        self.since_trim = 0
        self._running = asyncio.get_running_loop().run_in_executor(None, self._trim_now)

    def _trim_now(self) -> None:
        assert self._trim is not None
        start = time.perf_counter()
        released = self._trim(0)
        self.trims += 1
        log.debug("heap trimmed released=%s seconds=%.4f", bool(released), time.perf_counter() - start)

    async def wait_idle(self) -> None:
        """Until a trim that has started has ended (tests, shutdown)."""
        if self._running is not None:
            await self._running
