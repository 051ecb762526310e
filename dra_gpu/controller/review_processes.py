"""The loop's handles on the review processes: a worker (its pidfd, pipe, CPU-time clock and the
events it has not had), the template, a worker being started, the idle workers' queue, and the
system calls that read a worker's CPU time, see it exit and reap it."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import select
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any


@dataclass
class Worker:
    pid: int
    pidfd: int  # a handle that cannot name another process once this one has gone
    conn: Connection
    cpu_clock: int | None  # its CPU-time clock (clock_getcpuclockid), None where there is none
    pending: list[tuple[Any, ...]] = field(default_factory=list)  # events to send before the next review
    reniced: bool = False  # its review was slow; it is replaced rather than kept at low priority
    cpu_at_start: int = 0  # its CPU time (ns) when the current review was sent


@dataclass
class Template:
    process: BaseProcess
    conn: Connection
    pending: list[tuple[Any, ...]] = field(default_factory=list)  # events not sent to it yet
    warmed: int = 0  # the reviews (counted by ReviewPool._recent_count) it has been warmed with


@dataclass
class Starting:
    """A worker asked of the template: it collects the events the template will not have had."""

    pending: list[tuple[Any, ...]] = field(default_factory=list)


def cpu_clock(pid: int) -> int | None:
    """The id of the process's CPU-time clock: read with one system call per review, where
    /proc/<pid>/schedstat costs an open, a read and a close on the event loop."""
    clock = ctypes.c_int()
    try:
        if _libc().clock_getcpuclockid(pid, ctypes.byref(clock)) != 0:
            return None
    except (AttributeError, OSError):  # no C library that has it
        return None
    return clock.value


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def cpu_ns(worker: Worker) -> int:
    """CPU time the worker has used, in ns; 0 when it cannot be read (it has gone)."""
    if worker.cpu_clock is not None:
        with contextlib.suppress(OSError):
            return time.clock_gettime_ns(worker.cpu_clock)
    try:
        with open(f"/proc/{worker.pid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def reap(worker: Worker) -> None:
    """Its exit status collected, where it has become this process's child: the template reaps its
    workers, but once a template has died they belong to init, which is this process when it is
    a container's first process (no zombie left behind in either case)."""
    with contextlib.suppress(OSError):
        os.waitid(os.P_PIDFD, worker.pidfd, os.WEXITED | os.WNOHANG)


def exited(worker: Worker, timeout: float = 0) -> bool:
    with contextlib.suppress(OSError, ValueError):
        return bool(select.select([worker.pidfd], [], [], timeout)[0])
    return True  # its pidfd is closed: it was killed and reaped


class IdleWorkers(asyncio.LifoQueue[Worker]):
    """Idle workers, the one that answered last on top: it takes the next review with its caches
    (CPU, TLB) warm, where taking them in turn had each review start cold (~1.5x its CPU)."""

    def _init(self, maxsize: int) -> None:  # the queue's storage: a list, top last (as LifoQueue's)
        self._queue: list[Worker] = []

    def take_behind_top(self) -> list[Worker]:
        """The idle workers with events pending, but the top one, taken out of the queue."""
        taken = [w for w in self._queue[:-1] if w.pending]
        self._queue[:-1] = [w for w in self._queue[:-1] if not w.pending]
        return taken

    def put_bottom(self, worker: Worker) -> None:
        """Back in the queue, under the ones that answered since."""
        self.put_nowait(worker)  # wakes a review waiting for a worker, if one is
        if worker in self._queue:
            self._queue.remove(worker)
            self._queue.insert(0, worker)
