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
import gc
import os
import pickle
import resource
import select
import signal
import time
from collections.abc import Callable, Sequence
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


def run_bounded(
    fn: Callable[[], T], deadline_s: float = DEFAULT_DEADLINE_S, memory_bytes: int = DEFAULT_MEMORY_BYTES
) -> T:
    """fn() in a forked child; its result (picklable), or OverBudget. Exceptions of fn come back
    as OverBudget naming them, so nothing escapes as a traceback."""
    (answer,) = _run_from([fn], 0, deadline_s, memory_bytes)
    if isinstance(answer, OverBudget):
        raise answer
    return answer


def run_bounded_each(
    fns: Sequence[Callable[[], T]],
    deadline_s: float = DEFAULT_DEADLINE_S,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
) -> list[T | OverBudget]:
    """Each fn() with the bounds of run_bounded, in one forked child for as long as they stay in
    them: the child's caches (selector results, candidate lists) carry over from one step to
    the next, and a fork is paid only again after a step that went over. Each step has its own
    deadline, counted from the previous step's answer; a step over budget gets OverBudget and
    the next step starts in a fresh child."""
    out: list[T | OverBudget] = []
    while len(out) < len(fns):
        out += _run_from(fns, len(out), deadline_s, memory_bytes)
    return out


def _run_from(
    fns: Sequence[Callable[[], T]], start: int, deadline_s: float, memory_bytes: int
) -> list[T | OverBudget]:
    """Answers for fns[start:], until the first step that went over its budget (included)."""
    read_fd, write_fd = os.pipe()
    limit = address_space() + memory_bytes
    # The child's garbage collector would otherwise walk (and so copy) every page of the
    # parent's objects: a fork then cost ~80 ms with a 100-node cluster loaded, not ~5.
    gc.freeze()
    pid = os.fork()
    if pid == 0:  # the child: one length-prefixed pickle per step; stops after a failed one
        code = 0
        try:
            os.close(read_fd)
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            with os.fdopen(write_fd, "wb") as out:
                for fn in fns[start:]:
                    failed = True
                    try:
                        payload = pickle.dumps(("ok", fn()))
                        failed = False
                    except MemoryError:
                        payload = pickle.dumps(
                            ("error", f"ran out of its memory budget ({memory_bytes >> 20} MiB)")
                        )
                    except Exception as exc:
                        payload = pickle.dumps(
                            ("error", f"internal error: {type(exc).__name__}: {exc}"[:500])
                        )
                    out.write(len(payload).to_bytes(8, "big") + payload)
                    out.flush()
                    if failed:  # a step that ran out of memory may have left the heap in pieces
                        break
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    gc.unfreeze()
    os.close(write_fd)
    answers: list[T | OverBudget] = []
    buffer = b""
    deadline = time.monotonic() + deadline_s
    over: OverBudget | None = None
    try:
        while start + len(answers) < len(fns):
            while len(buffer) >= 8 and len(buffer) >= 8 + int.from_bytes(buffer[:8], "big"):
                size = int.from_bytes(buffer[:8], "big")
                status, value = pickle.loads(buffer[8 : 8 + size])
                buffer = buffer[8 + size :]
                answers.append(value if status == "ok" else OverBudget(str(value)))
                deadline = time.monotonic() + deadline_s
                if status != "ok":
                    return answers
            if start + len(answers) == len(fns):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                over = OverBudget(_too_long(deadline_s))
                break
            ready, _, _ = select.select([read_fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(read_fd, 1 << 20)
            if not chunk:  # the child died without answering: killed for memory
                over = OverBudget(f"ran out of its memory budget ({memory_bytes >> 20} MiB)")
                break
            buffer += chunk
    finally:
        os.close(read_fd)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if over is not None:
        answers.append(over)
    return answers


def _too_long(deadline_s: float) -> str:
    return f"took longer than {deadline_s:g}s (a CEL selector too costly to evaluate?)"
