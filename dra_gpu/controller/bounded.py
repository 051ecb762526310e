"""Running one CPU-heavy step (the rules on one object: CEL evaluation, quantity arithmetic) with a
deadline and a memory cap, for the offline commands.

cel-expr-python can neither be interrupted nor limited in cost, and holds the GIL, so a selector
that doubles a string with `cel.bind` would run for seconds and take gigabytes. The step runs in a
forked child (the command line is single-threaded, so fork is safe and costs milliseconds) under
RLIMIT_AS; a child past its deadline is killed, and all its memory goes with it. The webhook, which
has threads and an event loop, uses long-lived workers instead (review_pool.py).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import resource
import select
import signal
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_DEADLINE_S = 10.0
DEFAULT_MEMORY_BYTES = 2 << 30


class OverBudget(Exception):
    """The step ran past its deadline or its memory cap; the message says which."""


def _statm(field: int) -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[field]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def address_space() -> int:
    """This process's virtual size in bytes (a child's RLIMIT_AS is this plus the budget)."""
    return _statm(0)


def resident_bytes() -> int:
    """This process's resident memory in bytes."""
    return _statm(1)


def run_bounded(
    fn: Callable[[], T], deadline_s: float = DEFAULT_DEADLINE_S, memory_bytes: int = DEFAULT_MEMORY_BYTES
) -> T:
    """fn() in a forked child; its result (picklable), or OverBudget. Exceptions of fn come back
    as OverBudget naming them, so nothing escapes as a traceback."""
    read_fd, write_fd = os.pipe()
    limit = address_space() + memory_bytes
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 0
        try:
            os.close(read_fd)
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            try:
                payload = pickle.dumps(("ok", fn()))
            except MemoryError:
                payload = pickle.dumps(("error", f"ran out of its memory budget ({memory_bytes >> 20} MiB)"))
            except Exception as exc:
                payload = pickle.dumps(("error", f"internal error: {type(exc).__name__}: {exc}"[:500]))
            with os.fdopen(write_fd, "wb") as out:
                out.write(payload)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    chunks: list[bytes] = []
    deadline = time.monotonic() + deadline_s
    timed_out = False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            ready, _, _ = select.select([read_fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(read_fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_fd)
        if timed_out:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if timed_out:
        raise OverBudget(f"took longer than {deadline_s:g}s (a CEL selector too costly to evaluate?)")
    try:
        status, value = pickle.loads(b"".join(chunks))
    except Exception as exc:  # the child died without answering: killed for memory
        raise OverBudget(f"ran out of its memory budget ({memory_bytes >> 20} MiB)") from exc
    if status != "ok":
        raise OverBudget(str(value))
    result: T = value
    return result
