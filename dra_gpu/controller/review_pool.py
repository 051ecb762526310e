"""Worker processes that run the validation rules for the webhook, each review with a deadline and
a memory cap, so that one hostile review never blocks the event loop.

cel-expr-python (cel-cpp) holds the GIL while it evaluates and offers neither a cost limit nor an
interrupt, so a selector that doubles a string with `cel.bind` can run for seconds and take
gigabytes. A thread would stall the loop (and `/healthz`) all the same; a process can be killed.
Each worker keeps its own copy of the cluster view (the loop forwards every list and watch event),
answers one review at a time and runs under RLIMIT_AS. A review that passes the deadline, or a
worker that dies (out of memory), gets a clear deny; the worker is killed, which releases all its
memory, and a fresh one takes its place while the others keep answering.

Fresh workers are forked from a template process that gets every cluster event and the recent
reviews like a worker but never answers one: a hostile review costs a worker, and a child of the
template starts with the view applied and the selectors compiled and evaluated (copy-on-write),
so replacing it costs neither a transfer of the view nor a warm-up next to the workers that are
answering. The template is itself replaced, from the view the loop keeps, when it dies.

The worker that answered last takes the next review, with its caches warm; the idle ones are sent
the cluster events every second, so none collects a backlog while reviews do not overlap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from dra_gpu.controller import view_records
from dra_gpu.controller.bounded import OverBudget
from dra_gpu.controller.review_processes import (
    IdleWorkers,
    Starting,
    Template,
    Worker,
    cpu_clock,
    cpu_ns,
    exited,
    reap,
)
from dra_gpu.controller.review_worker import WARM_UP_REVIEWS, template_main

__all__ = ["OverBudget", "ReviewPool", "ReviewResult"]

log = logging.getLogger(__name__)

DEFAULT_WORKERS = 3  # one busy with a hostile review, one being replaced, one answering
DEFAULT_DEADLINE_S = 1.0  # the scheduler stops a selector at ~0.1 s (runtime cost 1,000,000)
DEFAULT_MEMORY_BYTES = 1 << 30  # beyond the worker's own ~150 MiB
STORES = view_records.STORES
# Events a process may be behind by (beyond twice the view's objects) before they are cut to the view.
BACKLOG_EVENTS = 1024
WORKER_NICE = 0
SLOW_NICE = 19  # a worker whose review used SLOW_AFTER_S of CPU: it gets only spare CPU
SLOW_AFTER_S = 0.02  # of CPU: a warm review takes 0.5-1.2 ms (1,000-4,000 devices)
SLOW_CHECK_S = 0.01  # how often a running review's CPU is looked at
WARM_UP_TIMEOUT_S = 30.0
# How often the template is sent the events and recent reviews it has not had (the ones left are
# sent before a fork): at most a few warm-up reviews a second, whatever the rate of reviews.
TEMPLATE_FEED_EVERY_S = 1.0
RECYCLE_BYTES = 768 << 20  # a worker whose peak RSS reached this is replaced: its memory released
PRELOAD = ["dra_gpu.controller.cluster_state"]
DIRECT_SEND_BYTES = 16 * 1024


@dataclass(frozen=True)
class ReviewResult:
    """What the rules said about one object; `errors` / `warnings` are (path, message) pairs."""

    name: str
    namespace: str
    errors: list[tuple[str, str]]
    warnings: list[tuple[str, str]]


class ReviewPool:
    """A few worker processes over one cluster view; `validate` awaits a verdict within the deadline."""

    def __init__(
        self,
        driver: str,
        workers: int = DEFAULT_WORKERS,
        deadline_s: float = DEFAULT_DEADLINE_S,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        nvidia_compatible: bool = False,
    ) -> None:
        self.driver = driver
        self.nvidia_compatible = nvidia_compatible
        self.size = workers
        self.deadline_s = deadline_s
        self.memory_bytes = memory_bytes
        # The view as the workers have it once they applied every event: one entry per object,
        # what a new template is sent (as one replace per store) and what a backlog is cut to.
        self.view: dict[str, dict[str, Mapping[str, Any]]] = {s: {} for s in STORES}
        self._workers: list[Worker] = []
        self._starting: list[Starting] = []
        self._idle = IdleWorkers()
        self._template: Template | None = None
        self._template_lock = asyncio.Lock()  # one conversation with the template at a time
        # Not fork (this process has threads and a loop): a fork server, started clean, that has
        # imported the rules and the CEL engine once, starts the template.
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(PRELOAD)
        self._respawns: set[asyncio.Task[None]] = set()  # replacements being started, kills being reaped
        self._recent: list[Any] = []  # the last objects answered within budget (warm-up of the template)
        self._recent_count = 0  # how many objects have entered _recent
        self._feeder: asyncio.Task[None] | None = None
        self._closed = False

    async def start(self) -> None:
        async with self._template_lock:
            await self._start_template()
        for _ in range(self.size):
            await self._add_worker()
        self._feeder = asyncio.get_running_loop().create_task(self._feed_regularly())

    async def close(self) -> None:
        self._closed = True
        for task in [*self._respawns, *([self._feeder] if self._feeder else [])]:
            task.cancel()
        for w in self._workers:
            self._kill(w, wait=True)
        self._workers.clear()
        if self._template is not None:  # after its workers: it reaps them
            self._kill_template(self._template, wait=True)
            self._template = None

    # -- the cluster view, forwarded to every worker and the template

    def replace(self, store: str, items: list[Mapping[str, Any]]) -> None:
        self.view[store] = {view_records.key(o): o for o in items}
        self._forward(("replace", store, list(items)))

    def apply(self, store: str, event_type: str, obj: Mapping[str, Any]) -> None:
        if event_type in view_records.GONE:
            self.view[store].pop(view_records.key(obj), None)
        elif event_type in ("ADDED", "MODIFIED"):
            self.view[store][view_records.key(obj)] = obj
        else:
            return
        self._forward(("apply", store, event_type, obj))

    def _forward(self, event: tuple[Any, ...]) -> None:
        # A process that has not been sent its events for a while (the top idle worker while no
        # review comes, the one busy with a long review) has them cut to the view itself once
        # they outnumber it: what it holds back stays bounded by the view, whatever the churn.
        limit = BACKLOG_EVENTS + 2 * sum(len(v) for v in self.view.values())
        holders: list[Worker | Starting | Template] = [*self._workers, *self._starting]
        if self._template is not None:
            holders.append(self._template)
        for holder in holders:
            holder.pending.append(event)
            if len(holder.pending) > limit:
                holder.pending[:] = self._snapshot()

    def _snapshot(self) -> list[tuple[Any, ...]]:
        """Events that bring a process of any state, or a new one, to the view: one replace a store."""
        return [("replace", s, list(self.view[s].values())) for s in STORES]

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
                await asyncio.to_thread(self._send_all, worker.conn, pending)
                await asyncio.to_thread(worker.conn.send_bytes, request)
            # A review that has used 20 ms of CPU is likely costly: let it have only
            # spare CPU, so that the workers answering normal reviews keep theirs. CPU, not wall
            # time: on a busy node a cheap review can wait that long for a core, and replacing
            # its worker would only make the next review a cold one.
            worker.cpu_at_start = cpu_ns(worker)
            slow = loop.call_later(SLOW_CHECK_S, self._check_slow, worker, loop)
            try:
                async with asyncio.timeout(self.deadline_s):  # no task of its own, unlike wait_for
                    reply = await self._receive(loop, worker.conn)
            finally:
                worker.cpu_at_start = -1
                slow.cancel()
        except asyncio.CancelledError:  # the client went away: the worker may still be busy
            self._replace_worker(worker)
            raise
        except (TimeoutError, EOFError, OSError, BrokenPipeError) as exc:
            dead = exited(worker) or isinstance(exc, EOFError | OSError)
            self._replace_worker(worker)
            if dead and not isinstance(exc, TimeoutError):
                raise OverBudget(
                    f"validation ran out of its memory budget ({self.memory_bytes >> 20} MiB)"
                ) from exc
            raise OverBudget(
                f"validation took longer than {self.deadline_s:g}s (a CEL selector too costly to "
                "evaluate?); simplify the selectors"
            ) from exc
        if reply[0] != "error" and obj not in self._recent:  # within budget: worth warming with
            self._recent = [*self._recent, obj][-WARM_UP_REVIEWS:]
            self._recent_count += 1
        if reply[0] == "error" or reply[2] > RECYCLE_BYTES or worker.reniced:
            self._replace_worker(worker)  # per-review state released with the process
        else:
            self._idle.put_nowait(worker)
        if reply[0] == "error":
            raise OverBudget(f"validation failed: {reply[1]}")
        return ReviewResult(*reply[1])

    @staticmethod
    def _send_all(conn: Connection, messages: list[tuple[Any, ...]]) -> None:
        for m in messages:
            conn.send(m)

    @staticmethod
    async def _receive(loop: asyncio.AbstractEventLoop, conn: Connection) -> Any:
        ready: asyncio.Future[None] = loop.create_future()
        fd = conn.fileno()

        def readable() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(fd, readable)
        try:
            await ready
        finally:
            loop.remove_reader(fd)
        return conn.recv()  # a whole message is there or the pipe is closed (EOFError)

    # -- workers

    def _check_slow(self, worker: Worker, loop: asyncio.AbstractEventLoop) -> None:
        if worker.cpu_at_start < 0:
            return  # answered meanwhile
        used = cpu_ns(worker) - worker.cpu_at_start
        if used >= SLOW_AFTER_S * 1e9 or worker.cpu_at_start == 0:
            self._renice(worker)
        else:  # waiting for a core rather than working: look again later
            loop.call_later(SLOW_CHECK_S, self._check_slow, worker, loop)

    @staticmethod
    def _renice(worker: Worker) -> None:
        worker.reniced = True
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, worker.pid, SLOW_NICE)

    async def _add_worker(self) -> None:
        """A worker forked from the template (a fresh template first, if it has gone), once ready."""
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type((EOFError, OSError, TimeoutError)),
            stop=stop_after_attempt(3),
            wait=wait_exponential(multiplier=0.1, max=1),
            reraise=True,
        ):
            with attempt:
                worker = await self._forked_worker()
                await self._until_ready(worker)
        self._idle.put_nowait(worker)

    async def _forked_worker(self) -> Worker:
        async with self._template_lock:
            try:
                template = self._template or await self._start_template()
                worker = await self._fork(template)
            except (EOFError, OSError, TimeoutError) as exc:
                log.warning("event=review_template_failed error=%r", exc)
                if self._template is not None:
                    self._kill_template(self._template)
                raise
            self._workers.append(worker)  # forwarded events from now on; killed by close()
            return worker

    async def _until_ready(self, worker: Worker) -> None:
        """Outside the template's lock: another replacement can be forked while this one warms up."""
        try:
            reply = await asyncio.wait_for(
                self._receive(asyncio.get_running_loop(), worker.conn), WARM_UP_TIMEOUT_S
            )
            if reply != ("ready",):
                raise OSError(f"unexpected first message {reply!r}")
        except (EOFError, OSError, TimeoutError) as exc:
            log.warning("event=review_worker_not_ready pid=%s error=%r", worker.pid, exc)
            self._kill(worker)
            with contextlib.suppress(ValueError):
                self._workers.remove(worker)
            raise

    async def _fork(self, template: Template) -> Worker:
        # Taken at one instant on the loop: the events sent to the template before the fork are
        # in the child's state; the ones after go to the child's own pipe, in order (FIFO).
        messages = self._template_messages(template)
        starting = Starting()
        self._starting.append(starting)
        parent, child = multiprocessing.Pipe()  # a socket pair: the worker's end travels as an fd
        try:
            reply = await asyncio.to_thread(self._request_fork, template, messages, child)
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
            self._starting.remove(starting)
        if reply[0] != "forked":
            parent.close()
            raise OSError(f"the template could not fork a worker: {reply[1]}")
        pid: int = reply[1]
        pidfd = os.pidfd_open(pid)  # it goes only when its pipe closes (or its warm-up fails)
        return Worker(pid, pidfd, parent, cpu_clock(pid), starting.pending)

    @staticmethod
    def _request_fork(template: Template, messages: list[tuple[Any, ...]], child: Connection) -> Any:
        ReviewPool._send_all(template.conn, [*messages, ("fork",)])
        reduction.send_handle(template.conn, child.fileno(), template.process.pid or 0)
        if not template.conn.poll(WARM_UP_TIMEOUT_S):
            raise TimeoutError(f"the review template did not fork within {WARM_UP_TIMEOUT_S:g}s")
        return template.conn.recv()

    def _replace_worker(self, worker: Worker) -> None:
        self._kill(worker)  # a process of gigabytes takes a while to go: not on the loop
        with contextlib.suppress(ValueError):
            self._workers.remove(worker)
        log.warning("event=review_worker_replaced pid=%s", worker.pid)
        self._background(self._add_worker())

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._respawns.add(task)
        task.add_done_callback(self._respawns.discard)

    def _kill(self, worker: Worker, wait: bool = False) -> None:
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(worker.pidfd, signal.SIGKILL)
        with contextlib.suppress(OSError):
            worker.conn.close()
        if wait:
            exited(worker, timeout=1)
            reap(worker)
            os.close(worker.pidfd)
        else:  # its pidfd closed once it has gone
            self._background(self._close_when_exited(worker))

    @staticmethod
    async def _close_when_exited(worker: Worker) -> None:
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not gone.done():
                gone.set_result(None)

        loop.add_reader(worker.pidfd, readable)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(gone, 10)
        finally:
            loop.remove_reader(worker.pidfd)
            reap(worker)
            os.close(worker.pidfd)

    # -- the template

    async def _start_template(self, warm: bool = True) -> Template:
        """A template with the whole view, warmed with the recent reviews; called under the lock."""
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(
            target=template_main,
            args=(child, self.driver, self.memory_bytes, WORKER_NICE, self.nvidia_compatible),
            daemon=True,
        )
        # Off the loop: the fork server forks and answers with the pid, milliseconds that every
        # review waiting on the loop would otherwise wait too.
        await asyncio.to_thread(process.start)
        child.close()
        template = Template(process, parent, self._snapshot())
        self._template = template  # from now on it is forwarded every event
        asyncio.get_running_loop().add_reader(process.sentinel, self._template_exited, template)
        messages = self._template_messages(template, warm)
        try:
            await asyncio.to_thread(self._send_all, parent, [*messages, ("ping",)])
            if not await asyncio.to_thread(parent.poll, WARM_UP_TIMEOUT_S):
                raise TimeoutError(f"the review template was not ready within {WARM_UP_TIMEOUT_S:g}s")
            parent.recv()
        except (EOFError, OSError, TimeoutError) as exc:
            self._kill_template(template)
            if not warm:
                raise
            log.warning("event=review_template_not_ready pid=%s error=%r", process.pid, exc)
            return await self._start_template(warm=False)  # without the objects that may have held it up
        log.info("event=review_template_started pid=%s", process.pid)
        return template

    def _template_messages(self, template: Template, warm: bool = True) -> list[tuple[Any, ...]]:
        """What the template has not had: events, then the recent reviews it was not warmed with
        (all of them after an event, which drops what the selectors' results were cached on)."""
        messages, template.pending = template.pending, []
        new = len(self._recent) if messages else self._recent_count - template.warmed
        if warm and new > 0 and self._recent:
            messages.append(("warm", self._recent[-new:]))
        template.warmed = self._recent_count
        return messages

    async def _feed_regularly(self) -> None:
        while True:
            await asyncio.sleep(TEMPLATE_FEED_EVERY_S)
            await self._feed_template()
            await self._feed_idle_workers()

    async def _feed_template(self) -> None:
        async with self._template_lock:
            template = self._template
            if template is None:
                return
            messages = self._template_messages(template)
            if messages:
                with contextlib.suppress(OSError):  # it has died: _template_exited replaces it
                    await asyncio.to_thread(self._send_all, template.conn, messages)

    async def _feed_idle_workers(self) -> None:
        """The events that the idle workers below the top one have not had. The top one takes
        nearly every review and gets its events with it; the others would otherwise collect a
        backlog for as long as reviews do not overlap, and the review that finally needs one of
        them would wait for all of it."""
        for worker in self._idle.take_behind_top():
            pending, worker.pending = worker.pending, []
            try:
                await asyncio.to_thread(self._send_all, worker.conn, pending)
            except OSError:
                self._replace_worker(worker)
                continue
            self._idle.put_bottom(worker)

    def _template_exited(self, template: Template) -> None:
        asyncio.get_running_loop().remove_reader(template.process.sentinel)
        if self._template is not template or self._closed:
            return
        log.warning("event=review_template_exited pid=%s", template.process.pid)
        self._kill_template(template)
        self._background(self._restart_template())

    async def _restart_template(self) -> None:
        async with self._template_lock:
            if self._template is None and not self._closed:
                await self._start_template()

    def _kill_template(self, template: Template, wait: bool = False) -> None:
        if self._template is template:
            self._template = None
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(template.process.sentinel)
        with contextlib.suppress(Exception):
            template.process.kill()
        with contextlib.suppress(Exception):
            template.conn.close()
        if wait:
            template.process.join(1)
        else:
            self._background(asyncio.to_thread(template.process.join, 10))
