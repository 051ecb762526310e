"""The review pool: real worker processes forked from a warm template, real CEL.

A costly review costs its worker (reniced, then replaced) but a review that only waited for a
core does not; a replacement is a child of the template, with the events sent before its fork in
its state and the ones after on its own pipe; a dead template is replaced; nothing is left after
close."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from bench.webhook_hostile_bench import doubling_selector
from dra_gpu.controller.review_pool import SLOW_AFTER_S, OverBudget, ReviewPool

from .objects import GPU_CLASS, claim, node_slices

DRIVER = "gpu.dra-gpu.io"
PRODUCT = f'device.attributes["{DRIVER}"].productName'


async def _pool(workers: int = 1, memory_bytes: int = 1 << 30) -> ReviewPool:
    pool = ReviewPool(DRIVER, workers=workers, memory_bytes=memory_bytes)
    pool.replace("slices", node_slices())
    pool.replace("classes", [GPU_CLASS])
    await pool.start()
    return pool


def _run(scenario: Callable[[ReviewPool], Awaitable[None]], **kwargs: int) -> None:
    async def main() -> None:
        pool = await _pool(**kwargs)
        try:
            await scenario(pool)
        finally:
            await pool.close()

    asyncio.run(main())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _until(condition: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def _cpu_ns(pid: int) -> int:
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def _address_space_limit(pid: int) -> str:
    (line,) = [x for x in Path(f"/proc/{pid}/limits").read_text().splitlines() if "address space" in x]
    return line.split()[4]  # "Max address space <soft> <hard> bytes"


def _template_pid(pool: ReviewPool) -> int:
    assert pool._template is not None and pool._template.process.pid is not None
    return pool._template.process.pid


def test_a_review_that_waited_for_a_core_keeps_its_worker(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(pool: ReviewPool) -> None:
        assert not (await pool.validate(claim("first", 2))).errors
        (pid,) = [w.pid for w in pool._workers]
        os.kill(pid, signal.SIGSTOP)  # as if every core were busy: no CPU for the worker
        review = asyncio.create_task(pool.validate(claim("waited", 2)))
        await asyncio.sleep(SLOW_AFTER_S * 6)
        os.kill(pid, signal.SIGCONT)
        assert not (await review).errors
        assert not (await pool.validate(claim("next", 2))).errors

    with caplog.at_level(logging.WARNING, logger="dra_gpu.controller.review_pool"):
        _run(scenario)
    assert "review_worker_replaced" not in caplog.text


def test_a_hostile_review_is_denied_and_a_capped_child_of_the_template_takes_its_place() -> None:
    async def scenario(pool: ReviewPool) -> None:
        normal = claim("normal", 2, selectors=[f'{PRODUCT}.startsWith("NVIDIA H100")'])
        assert not (await pool.validate(normal)).errors
        before = {w.pid for w in pool._workers}
        with pytest.raises(OverBudget, match=r"memory budget|took longer"):
            await pool.validate(claim("hostile", selectors=[doubling_selector(26)]))
        (hostile,) = before - {w.pid for w in pool._workers}
        await _until(lambda: not _alive(hostile))  # killed, its memory released
        await _until(lambda: pool._idle.qsize() == 2)
        for w in pool._workers:
            assert _parent(w.pid) == _template_pid(pool)
            assert _address_space_limit(w.pid) != "unlimited"  # each child has its own cap
        for _ in range(4):  # the replacement answers, warm, like the one that was kept
            assert not (await pool.validate(normal)).errors

    _run(scenario, workers=2, memory_bytes=256 << 20)


def test_events_before_its_fork_and_after_both_reach_a_new_worker() -> None:
    l4 = claim("l4", selectors=[f'{PRODUCT} == "NVIDIA L4"'])
    h100 = claim("h100", selectors=[f'{PRODUCT}.startsWith("NVIDIA H100")'])

    async def scenario(pool: ReviewPool) -> None:
        assert (await pool.validate(l4)).errors  # no L4 in the cluster yet
        assert not (await pool.validate(h100)).errors
        worker = await pool._idle.get()
        for s in node_slices("node-m", "mixed"):
            pool.apply("slices", "ADDED", s)  # before the fork: in the template's state
        pool._replace_worker(worker)
        while not pool._starting:  # each turn of the loop: the fork is being asked for
            await asyncio.sleep(0)
        for s in node_slices():
            pool.apply("slices", "DELETED", s)  # after: on the new worker's own pipe
        await _until(lambda: pool._idle.qsize() == 1)
        (new,) = pool._workers
        assert new.pid != worker.pid
        assert [e[2] for e in new.pending] == ["DELETED"] * len(node_slices())  # sent with its first review
        assert not (await pool.validate(l4)).errors
        assert (await pool.validate(h100)).errors  # the only H100 node is gone

    _run(scenario)


def test_the_last_worker_to_answer_takes_the_next_review_and_the_others_get_events_meanwhile() -> None:
    l4 = claim("l4", selectors=[f'{PRODUCT} == "NVIDIA L4"'])

    async def scenario(pool: ReviewPool) -> None:
        assert (await pool.validate(l4)).errors  # no L4 in the cluster yet
        before = {w.pid: _cpu_ns(w.pid) for w in pool._workers}
        for i in range(10):  # one after another: always the same (warm) worker
            assert not (await pool.validate(claim(f"c{i}", 2))).errors
        ran = [pid for pid, ns in before.items() if _cpu_ns(pid) != ns]
        assert len(ran) == 1, ran  # the others slept through them
        for s in node_slices("node-m", "mixed"):
            pool.apply("slices", "ADDED", s)
        # The idle ones get the events without a review (within about a second), so one that is
        # needed later has no backlog to take in first; the top one gets them with its next review.
        await _until(lambda: sum(bool(w.pending) for w in pool._workers) == 1, timeout=5)
        top = await pool._idle.get()
        assert top.pending and top.pid in ran
        assert not (await pool.validate(l4)).errors  # answered by another worker, with the new view
        pool._idle.put_nowait(top)
        assert not (await pool.validate(l4)).errors

    _run(scenario, workers=3)


def test_a_killed_template_is_replaced_and_forks_the_next_worker() -> None:
    async def scenario(pool: ReviewPool) -> None:
        old = _template_pid(pool)
        os.kill(old, signal.SIGKILL)
        await _until(lambda: pool._template is not None and pool._template.process.pid != old)
        await _until(lambda: not _alive(old))
        for s in node_slices("node-m", "mixed"):
            pool.apply("slices", "ADDED", s)  # reaches the new template too
        worker = await pool._idle.get()
        pool._replace_worker(worker)
        await _until(lambda: pool._idle.qsize() == 1)
        (new,) = pool._workers
        assert _parent(new.pid) == _template_pid(pool)
        assert not (await pool.validate(claim("l4", selectors=[f'{PRODUCT} == "NVIDIA L4"']))).errors

    _run(scenario)


def test_no_process_is_left_after_close() -> None:
    async def scenario() -> None:
        pool = await _pool(workers=2)
        worker = await pool._idle.get()
        pool._replace_worker(worker)
        await _until(lambda: pool._idle.qsize() == 2)
        pids = [worker.pid, _template_pid(pool), *(w.pid for w in pool._workers)]
        assert all(_alive(p) for p in pids[1:])
        await pool.close()
        assert [p for p in pids if _alive(p)] == []

    asyncio.run(scenario())
