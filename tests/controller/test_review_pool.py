"""The review pool tells a costly review from one that waits for a core: only the first costs its
worker (reniced, then replaced); on a busy node a cheap review that waited keeps its worker warm."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest

from dra_gpu.controller.review_pool import SLOW_AFTER_S, ReviewPool

from .objects import GPU_CLASS, claim, node_slices

DRIVER = "gpu.dra-gpu.io"


async def _pool() -> ReviewPool:
    pool = ReviewPool(DRIVER, workers=1)
    pool.replace("slices", node_slices())
    pool.replace("classes", [GPU_CLASS])
    await pool.start()
    return pool


def test_a_review_that_waited_for_a_core_keeps_its_worker(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        pool = await _pool()
        try:
            assert not (await pool.validate(claim("first", 2))).errors
            (pid,) = [w.pid for w in pool._workers]
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)  # as if every core were busy: no CPU for the worker
            review = asyncio.create_task(pool.validate(claim("waited", 2)))
            await asyncio.sleep(SLOW_AFTER_S * 6)
            os.kill(pid, signal.SIGCONT)
            assert not (await review).errors
            assert not (await pool.validate(claim("next", 2))).errors
        finally:
            await pool.close()

    with caplog.at_level(logging.WARNING, logger="dra_gpu.controller.review_pool"):
        asyncio.run(scenario())
    assert "review_worker_replaced" not in caplog.text
