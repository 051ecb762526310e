"""What runs in the review processes: the template, which applies the cluster events and warm-ups
and forks a worker when the loop asks, and each worker, which applies the events and answers one
review at a time under its memory cap (the design: review_pool.py)."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
import resource
import signal
import time
from collections.abc import Iterator
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from dra_gpu.controller.bounded import address_space

if TYPE_CHECKING:
    from dra_gpu.controller.cluster_state import ClusterState

log = logging.getLogger(__name__)

# The template reviews the last few objects that were answered within budget, so that their
# selectors are compiled and evaluated off the request path, and each new worker reviews them
# again (cached, but touching the pages it inherited) before it takes real reviews.
WARM_UP_REVIEWS = 4
WARM_UP_CPU_S = 0.2


def _commands(conn: Connection, state: ClusterState) -> Iterator[tuple[Any, ...]]:
    """What the loop sends, with the cluster events applied on the way; ends when the pipe closes."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if not _apply_event(state, message):
            yield message


def _serve(conn: Connection, state: ClusterState) -> None:
    """A worker: apply cluster events, answer reviews, until the pipe closes."""
    for message in _commands(conn, state):
        if message[0] == "validate":
            try:
                v = state.validator().validate(message[1])
                # Plain tuples and pickle.dumps: a dataclass through the multiprocessing pickler
                # cost more than the rules take for a simple claim.
                result = (
                    v.name,
                    v.namespace,
                    [(p.path, p.message) for p in v.errors],
                    [(p.path, p.message) for p in v.warnings],
                )
                conn.send_bytes(pickle.dumps(("verdict", result, _peak_resident_bytes())))
            except MemoryError:
                conn.send(("error", "ran out of its memory budget", 0))
            except Exception as exc:  # a bug in a rule: deny with its name, keep serving
                log.exception("event=review_failed")
                conn.send(("error", f"internal error: {type(exc).__name__}", 0))


def _peak_resident_bytes() -> int:
    """The most memory this process has had resident: one system call per review, where reading
    the current size from /proc costs an open, a read and a close."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _apply_event(state: ClusterState, message: tuple[Any, ...]) -> bool:
    if message[0] == "replace":
        state.replace(message[1], message[2])
    elif message[0] == "apply":
        state.apply(message[1], message[2], message[3])
    else:
        return False
    return True


def _warm(state: ClusterState, objects: list[Any]) -> None:
    """Compile and evaluate what these reviews need, so that a worker forked afterwards has it."""
    validator = state.validator()  # the CEL environments, the devices' attributes
    start = time.process_time()
    for obj in objects:
        if time.process_time() - start > WARM_UP_CPU_S:
            break  # a warm-up costs at most this (plus one review that was answered within budget)
        with contextlib.suppress(Exception):
            validator.validate(obj)


def _limit_memory(memory_bytes: int) -> None:
    if memory_bytes > 0:
        limit = address_space() + memory_bytes
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def template_main(
    conn: Connection, driver: str, memory_bytes: int, nice: int, nvidia_compatible: bool = False
) -> None:
    """The template: apply cluster events and warm-ups, and fork a worker on each request."""
    with contextlib.suppress(OSError):
        os.nice(nice)  # inherited by the workers: below the event loop, which answers /healthz
    # Its workers are reaped by the kernel as they exit: a killed worker leaves no zombie.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    # Imported by the fork server already (PRELOAD). No RLIMIT_AS here: each worker sets its own
    # after the fork, above what it inherits; the template runs no review, only warm-ups of
    # reviews that were answered within budget.
    from dra_gpu.controller.cluster_state import ClusterState

    state = ClusterState(driver, nvidia_compatible)
    warmed_with: list[Any] = []
    for message in _commands(conn, state):
        if message[0] == "warm":
            _warm(state, message[1])
            warmed_with = [*warmed_with, *message[1]][-WARM_UP_REVIEWS:]
        elif message[0] == "ping":
            state.validator()
            conn.send(("pong",))
        elif message[0] == "fork":
            fd = reduction.recv_handle(conn)  # the worker's end of its pipe to the loop
            try:
                conn.send(("forked", _fork_worker(conn, fd, state, memory_bytes, warmed_with)))
            except OSError as exc:  # no process to be had (a limit on processes): the loop says so
                os.close(fd)
                conn.send(("error", str(exc)))


def _fork_worker(
    template_conn: Connection, fd: int, state: ClusterState, memory_bytes: int, warm_up: list[Any]
) -> int:
    """A worker that inherits the template's state; its pid. Called in the template only. The
    worker reviews `warm_up` again before it says it is ready: the results are cached, but a
    review touches the inherited objects, whose pages the kernel copies on that first touch (a
    few ms over 1,000 devices), and that is better done before a real review waits on it."""
    state.validator()  # built once here rather than in every child
    gc.freeze()  # what the child inherits stays out of its collections: those pages stay shared
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            template_conn.close()  # the template's death must be seen by the loop, not hidden
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _limit_memory(memory_bytes)
            conn = Connection(fd)
            _warm(state, warm_up)
            conn.send(("ready",))
            _serve(conn, state)
            code = 0
        finally:
            os._exit(code)  # never back into the template's loop
    gc.unfreeze()
    os.close(fd)
    return pid
