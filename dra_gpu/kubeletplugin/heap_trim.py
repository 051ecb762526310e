"""Give the memory a burst of node requests used back to the kernel once the burst has ended.

A burst (the kubelet preparing a hundred claims at once) grows glibc's heaps: every Python object
over 512 bytes, the claims' JSON, the CDI specs, the protobuf messages, each TLS connection's
buffers come from malloc. Two things keep that memory after the burst:
- reference cycles: a cancelled API request (a claim's status write, cancelled when the claim is
  unprepared before it is done) leaves its exception, traceback and frames in a cycle with the
  aiohttp connection it closed, TLS buffers included; they wait for a full garbage collection;
- glibc gives back only the top of a heap by itself, the free chunks in the middle only on
  malloc_trim().
In the prepare bench (bench/RESULTS.md) the trim alone returned ~6 MB of the ~18 MB the run had
added, a full collection first (7,000-10,000 objects in cycles) then the trim ~15 MB.

So once no request has been in flight for `idle_seconds` and some ran since the last trim, a full
collection then malloc_trim(0) run in a worker thread. The collection holds the GIL: it stalls the
event loop for its duration, once per burst and only after a second without requests. Where the C
library has no malloc_trim (musl), nothing runs.

A full collection walks every object the collector tracks, most of them made at start-up and
alive until exit (modules, classes, the API client's models): 37 ms for the plugin's imports
alone on an idle 2-core VM; the trims' collections were 18% of the plugin's active CPU in the
prepare bench's profile, and Python's own full collections walk the same objects, stalling a
prepare the same way. `freeze_startup_objects`
moves them out of its reach once start-up is done (gc.freeze): a full collection then walks only
what came after (under 0.01 ms for the same imports).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import time
from collections.abc import Callable

from dra_gpu.common.log_format import V

log = logging.getLogger(__name__)

IDLE_SECONDS = 1.0
# glibc gives each thread that allocates a heap (arena) of its own, up to 8 per core: after a
# burst the worker threads' heaps held its freed memory until the trim (right after the bench's
# run: 83-84 MB with 16 arenas, 81 with 2, 80 with 1). One heap costs no parallelism here: the
# plugin's threads allocate mostly under the GIL, and wait (fsync, NVML, gRPC's poller) without it.
ARENAS = 1
_M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)


def freeze_startup_objects() -> None:
    """Collect start-up's garbage, then leave every object alive now to reference counting alone
    (a process's start-up, before it serves: a frozen object in a cycle is never freed)."""
    gc.collect()
    gc.freeze()


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas; call before threads start. An explicit MALLOC_ARENA_MAX in the
    environment wins; False where it is set or the C library has no mallopt (musl)."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_ARENA_MAX, arenas))


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
        self.since_trim = 0  # requests finished (and starts ended) since the last trim
        self.trims = 0
        self._trim = _malloc_trim()
        self._timer: asyncio.TimerHandle | None = None
        self._running: asyncio.Future[None] | None = None

    @property
    def available(self) -> bool:
        return self._trim is not None

    def once_idle(self) -> None:
        """Trim once `idle_seconds` from now unless requests come first, with none since the last
        trim: after the plugin's start, whose garbage (discovery, the first slices, the claims'
        list) left ~1.3 MB of free malloc memory that nothing else gives back on an idle node."""
        self.since_trim += 1
        self._arm()

    def started(self) -> None:
        self.in_flight += 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def finished(self) -> None:
        self.in_flight -= 1
        self.since_trim += 1
        self._arm()

    def _arm(self) -> None:
        """The trim, `idle_seconds` from now, when nothing is in flight (a timer set before is
        replaced)."""
        if self.in_flight == 0 and self._trim is not None:
            if self._timer is not None:
                self._timer.cancel()
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
        collected = gc.collect()
        collected_at = time.perf_counter()
        released = self._trim(0)
        self.trims += 1
        log.log(
            V(5),
            "heap trimmed collected=%d gc_seconds=%.4f released=%s trim_seconds=%.4f",
            collected,
            collected_at - start,
            bool(released),
            time.perf_counter() - collected_at,
        )

    async def wait_idle(self) -> None:
        """Until a trim that has started has ended (tests, shutdown)."""
        if self._running is not None:
            await self._running
