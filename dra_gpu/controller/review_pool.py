"""Worker processes that run the validation rules for the webhook, each review with a deadline and
a memory cap, so that one hostile review never blocks the event loop.

cel-expr-python (cel-cpp) holds the GIL while it evaluates and offers neither a cost limit nor an
interrupt, so a selector that doubles a string with `cel.bind` can run for seconds and take
gigabytes. A thread would stall the loop (and `/healthz`) all the same; a process can be killed.
Each worker keeps its own copy of the cluster view (the loop forwards every list and watch event),
answers one review at a time and runs under RLIMIT_AS. A review that passes the deadline, or a
worker that dies (out of memory), gets a clear deny; the worker is killed, which releases all its
memory, and a fresh one takes its place while the others keep answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import resource
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from dra_gpu.controller.bounded import OverBudget, address_space, resident_bytes

__all__ = ["OverBudget", "ReviewPool", "ReviewResult"]

log = logging.getLogger(__name__)

DEFAULT_WORKERS = 3  # one busy with a hostile review, one being replaced, one answering
DEFAULT_DEADLINE_S = 1.0  # the scheduler stops a selector at ~0.1 s (runtime cost 1,000,000)
DEFAULT_MEMORY_BYTES = 1 << 30  # beyond the worker's own ~150 MiB
STORES = ("slices", "classes", "claims")
WORKER_NICE = 0
SLOW_NICE = 19  # a worker whose review used SLOW_AFTER_S of CPU: it gets only spare CPU
SLOW_AFTER_S = 0.02  # of CPU: a warm review takes 0.5-1.2 ms (1,000-4,000 devices)
SLOW_CHECK_S = 0.01  # how often a running review's CPU is looked at
# A new worker reviews the last few objects that were answered within budget before it takes
# real reviews, so their selectors are compiled and evaluated off the request path.
WARM_UP_REVIEWS = 4
WARM_UP_CPU_S = 0.2
WARM_UP_TIMEOUT_S = 30.0
RECYCLE_BYTES = 768 << 20  # a worker left this large by a review is replaced: its memory released
PRELOAD = ["dra_gpu.controller.cluster_state"]
DIRECT_SEND_BYTES = 16 * 1024


@dataclass(frozen=True)
class ReviewResult:
    """What the rules said about one object; `errors` / `warnings` are (path, message) pairs."""

    name: str
    namespace: str
    errors: list[tuple[str, str]]
    warnings: list[tuple[str, str]]


def _worker_main(conn: Connection, driver: str, memory_bytes: int, nice: int) -> None:
    """A worker: apply cluster events, answer reviews, until the pipe closes."""
    with contextlib.suppress(OSError):
        os.nice(nice)  # below the event loop: /healthz and the loop's own work come first
    # Imported by the fork server already (PRELOAD): a new worker is ready in milliseconds, so
    # replacing one does not take a core away from the others for a second.
    from dra_gpu.controller.cluster_state import ClusterState

    if memory_bytes > 0:
        limit = address_space() + memory_bytes
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    state = ClusterState(driver)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        op = message[0]
        if op == "replace":
            state.replace(message[1], message[2])
        elif op == "apply":
            state.apply(message[1], message[2], message[3])
        elif op == "ping":
            validator = state.validator()  # warm: the CEL environments, and recent reviews' selectors
            start = time.process_time()
            for obj in message[1] if len(message) > 1 else ():
                if time.process_time() - start > WARM_UP_CPU_S:
                    break  # a warm-up costs at most this (plus one review, within its deadline)
                with contextlib.suppress(Exception):
                    validator.validate(obj)
            conn.send(("pong",))
        elif op == "validate":
            try:
                v = state.validator().validate(message[1])
                result = ReviewResult(
                    v.name,
                    v.namespace,
                    [(p.path, p.message) for p in v.errors],
                    [(p.path, p.message) for p in v.warnings],
                )
                conn.send(("verdict", result, resident_bytes()))
            except MemoryError:
                conn.send(("error", "ran out of its memory budget", 0))
            except Exception as exc:  # a bug in a rule: deny with its name, keep serving
                log.exception("event=review_failed")
                conn.send(("error", f"internal error: {type(exc).__name__}", 0))


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection
    pending: list[tuple[Any, ...]] = field(default_factory=list)  # events to send before the next review
    reniced: bool = False  # its review was slow; it is replaced rather than kept at low priority
    cpu_at_start: int = 0  # its CPU time (ns) when the current review was sent


def _cpu_ns(worker: _Worker) -> int:
    """CPU time the worker has used, in ns (/proc/<pid>/schedstat); 0 when it cannot be read."""
    try:
        with open(f"/proc/{worker.process.pid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


class ReviewPool:
    """A few worker processes over one cluster view; `validate` awaits a verdict within the deadline."""

    def __init__(
        self,
        driver: str,
        workers: int = DEFAULT_WORKERS,
        deadline_s: float = DEFAULT_DEADLINE_S,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
    ) -> None:
        self.driver = driver
        self.size = workers
        self.deadline_s = deadline_s
        self.memory_bytes = memory_bytes
        self.stores: dict[str, list[tuple[Any, ...]]] = {
            s: [] for s in STORES
        }  # events since the last replace
        self._workers: list[_Worker] = []
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        # Not fork (this process has threads and a loop): a fork server, started clean, that has
        # imported the rules and the CEL engine once.
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(PRELOAD)
        self._respawns: set[asyncio.Task[None]] = set()  # replacements being started, kills being reaped
        self._recent: list[Any] = []  # the last objects answered within budget (warm-up of new workers)

    async def start(self) -> None:
        for _ in range(self.size):
            await self._add_worker()

    async def close(self) -> None:
        for task in self._respawns:
            task.cancel()
        for w in self._workers:
            self._kill(w)
        self._workers.clear()

    # -- the cluster view, forwarded to every worker

    def replace(self, store: str, items: list[dict[str, Any]]) -> None:
        self.stores[store] = [("replace", store, list(items))]
        for w in self._workers:
            w.pending.append(("replace", store, list(items)))

    def apply(self, store: str, event_type: str, obj: dict[str, Any]) -> None:
        event = ("apply", store, event_type, obj)
        self.stores[store].append(event)
        if len(self.stores[store]) > 10_000:  # compact: a new worker gets one replace
            self.stores[store] = self._compacted(store)
        for w in self._workers:
            w.pending.append(event)

    def _compacted(self, store: str) -> list[tuple[Any, ...]]:
        from dra_gpu.controller.cluster_state import ClusterState

        state = ClusterState(self.driver)
        for event in self.stores[store]:
            if event[0] == "replace":
                state.replace(store, event[2])
            else:
                state.apply(store, event[2], event[3])
        return [("replace", store, list(state.stores[store].values()))]

    # -- reviews

    async def validate(self, obj: Any) -> ReviewResult:
        """The verdict on `obj`; OverBudget when it took too long or too much memory."""
        worker = await self._idle.get()
        loop = asyncio.get_running_loop()
        try:
            pending, worker.pending = worker.pending, []
            request = pickle.dumps(("validate", obj))
            if not pending and len(request) < DIRECT_SEND_BYTES:
                worker.conn.send_bytes(request)  # fits the pipe's buffer of an idle worker: no wait
            else:
                await asyncio.to_thread(self._send_all, worker, pending)
                await asyncio.to_thread(worker.conn.send_bytes, request)
            # A review that has used 20 ms of CPU is likely costly: let it have only
            # spare CPU, so that the workers answering normal reviews keep theirs. CPU, not wall
            # time: on a busy node a cheap review can wait that long for a core, and replacing
            # its worker would only make the next review a cold one.
            worker.cpu_at_start = _cpu_ns(worker)
            slow = loop.call_later(SLOW_CHECK_S, self._check_slow, worker, loop)
            try:
                reply = await asyncio.wait_for(self._receive(loop, worker), self.deadline_s)
            finally:
                worker.cpu_at_start = -1
                slow.cancel()
        except asyncio.CancelledError:  # the client went away: the worker may still be busy
            self._replace_worker(worker)
            raise
        except (TimeoutError, EOFError, OSError, BrokenPipeError) as exc:
            dead = worker.process.exitcode is not None or isinstance(exc, EOFError | OSError)
            self._replace_worker(worker)
            if dead and not isinstance(exc, TimeoutError):
                raise OverBudget(
                    f"validation ran out of its memory budget ({self.memory_bytes >> 20} MiB)"
                ) from exc
            raise OverBudget(
                f"validation took longer than {self.deadline_s:g}s (a CEL selector too costly to "
                "evaluate?); simplify the selectors"
            ) from exc
        if reply[0] != "error":  # answered within budget (a cold one too): worth warming with
            self._recent = [*self._recent, obj][-WARM_UP_REVIEWS:]
        if reply[0] == "error" or reply[2] > RECYCLE_BYTES or worker.reniced:
            self._replace_worker(worker)  # per-review state released with the process
        else:
            self._idle.put_nowait(worker)
        if reply[0] == "error":
            raise OverBudget(f"validation failed: {reply[1]}")
        result: ReviewResult = reply[1]
        return result

    @staticmethod
    def _send_all(worker: _Worker, messages: list[tuple[Any, ...]]) -> None:
        for m in messages:
            worker.conn.send(m)

    @staticmethod
    async def _receive(loop: asyncio.AbstractEventLoop, worker: _Worker) -> Any:
        ready: asyncio.Future[None] = loop.create_future()
        fd = worker.conn.fileno()

        def readable() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(fd, readable)
        try:
            await ready
        finally:
            loop.remove_reader(fd)
        return worker.conn.recv()  # a whole message is there or the pipe is closed (EOFError)

    # -- workers

    def _check_slow(self, worker: _Worker, loop: asyncio.AbstractEventLoop) -> None:
        if worker.cpu_at_start < 0:
            return  # answered meanwhile
        used = _cpu_ns(worker) - worker.cpu_at_start
        if used >= SLOW_AFTER_S * 1e9 or worker.cpu_at_start == 0:
            self._renice(worker)
        else:  # waiting for a core rather than working: look again later
            loop.call_later(SLOW_CHECK_S, self._check_slow, worker, loop)

    @staticmethod
    def _renice(worker: _Worker) -> None:
        worker.reniced = True
        with contextlib.suppress(OSError, TypeError):
            os.setpriority(os.PRIO_PROCESS, worker.process.pid or 0, SLOW_NICE)

    async def _add_worker(self, nice: int = WORKER_NICE, warm: bool = True) -> None:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(
            target=_worker_main, args=(child, self.driver, self.memory_bytes, nice), daemon=True
        )
        # Off the loop: the fork server forks and answers with the pid, milliseconds that every
        # review waiting on the loop would otherwise wait too (a hostile review costs a worker).
        await asyncio.to_thread(process.start)
        child.close()
        worker = _Worker(process, parent, [e for s in STORES for e in self.stores[s]])
        self._workers.append(worker)
        pending, worker.pending = worker.pending, []
        warm_up = list(self._recent) if warm else []
        await asyncio.to_thread(self._send_all, worker, [*pending, ("ping", warm_up)])
        # The worker has imported, applied the view and reviewed the warm-up objects.
        if not await asyncio.to_thread(worker.conn.poll, WARM_UP_TIMEOUT_S):
            log.warning("event=review_worker_not_ready pid=%s", worker.process.pid)
            self._kill(worker, wait=False)
            with contextlib.suppress(ValueError):
                self._workers.remove(worker)
            if not warm:
                raise TimeoutError(f"a review worker was not ready within {WARM_UP_TIMEOUT_S:g}s")
            await self._add_worker(nice, warm=False)  # without the objects that may have held it up
            return
        worker.conn.recv()
        self._idle.put_nowait(worker)

    def _replace_worker(self, worker: _Worker) -> None:
        self._kill(worker, wait=False)  # a process of gigabytes takes a while to go: not on the loop
        with contextlib.suppress(ValueError):
            self._workers.remove(worker)
        log.warning("event=review_worker_replaced pid=%s", worker.process.pid)
        task = asyncio.get_running_loop().create_task(self._add_worker())
        self._respawns.add(task)
        task.add_done_callback(self._respawns.discard)

    def _kill(self, worker: _Worker, wait: bool = True) -> None:
        with contextlib.suppress(Exception):
            worker.process.kill()
            if wait:
                worker.process.join(1)
            else:
                reap = asyncio.get_running_loop().create_task(asyncio.to_thread(worker.process.join, 10))
                self._respawns.add(reap)
                reap.add_done_callback(self._respawns.discard)
        with contextlib.suppress(Exception):
            worker.conn.close()
