"""HeapTrimmer: after a burst of requests, once idle, the C heap's free memory goes back to the kernel."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dra_gpu.kubeletplugin.heap_trim import HeapTrimmer

pytestmark = pytest.mark.skipif(not HeapTrimmer().available, reason="the C library has no malloc_trim")


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_burst_is_trimmed_once_after_it_has_been_idle() -> None:
    async def body() -> None:
        heap = HeapTrimmer(idle_seconds=0.05)
        for _ in range(3):
            heap.started()
        heap.finished()
        heap.finished()
        await asyncio.sleep(0.15)
        assert heap.trims == 0  # one request still in flight
        heap.finished()
        heap.started()  # a new request within the idle time: no trim yet
        await asyncio.sleep(0.01)
        heap.finished()
        await asyncio.sleep(0.15)
        await heap.wait_idle()
        assert heap.trims == 1
        await asyncio.sleep(0.15)
        assert heap.trims == 1  # nothing ran since: nothing to trim

    asyncio.run(body())


def test_the_start_is_trimmed_once_unless_requests_come_first() -> None:
    async def body() -> None:
        heap = HeapTrimmer(idle_seconds=0.05)
        heap.once_idle()
        await asyncio.sleep(0.15)
        await heap.wait_idle()
        assert heap.trims == 1
        heap.once_idle()
        heap.started()  # a burst right after: its own trim, after it, is the only one
        await asyncio.sleep(0.15)
        assert heap.trims == 1
        heap.finished()
        await asyncio.sleep(0.15)
        await heap.wait_idle()
        assert heap.trims == 2

    asyncio.run(body())


async def one_request_then_idle(heap: HeapTrimmer) -> None:
    """A request starts and ends, then the node stays idle until the trim has run."""
    heap.started()
    heap.finished()
    await asyncio.sleep(0.1)
    await heap.wait_idle()


def test_the_trim_returns_freed_malloc_memory() -> None:
    async def body() -> None:
        heap = HeapTrimmer(idle_seconds=0.01)
        # 2,000-byte objects come from malloc (pymalloc takes up to 512); the last one stays,
        # so free() cannot give the heap's top back on its own.
        blocks = [bytes(2000) + bytes([i % 256]) for i in range(30_000)]
        keep = blocks[-1]
        del blocks
        before = rss_mb()
        await one_request_then_idle(heap)
        assert heap.trims == 1
        assert before - rss_mb() > 20, (before, rss_mb())
        assert keep

    asyncio.run(body())


def test_memory_held_by_reference_cycles_is_returned_too() -> None:
    class Node:
        def __init__(self) -> None:
            self.payload = bytes(4000)
            self.me = self  # a cycle: only the garbage collector frees it

    async def body() -> None:
        heap = HeapTrimmer(idle_seconds=0.01)
        gc.disable()  # as between two automatic full collections
        try:
            nodes = [Node() for _ in range(8_000)]
            keep = bytes(2000)  # above them in the heap
            del nodes
            before = rss_mb()
            await one_request_then_idle(heap)
        finally:
            gc.enable()
        assert before - rss_mb() > 20, (before, rss_mb())
        assert keep

    asyncio.run(body())


# Four threads allocate from malloc (objects over pymalloc's 512 bytes), then the process counts
# glibc's heaps (malloc_info's XML, through a pipe).
ALLOCATING_THREADS = """
import ctypes, os, threading
from dra_gpu.kubeletplugin.heap_trim import limit_arenas
print(limit_arenas(1))
done = threading.Event()
def work():
    kept = [bytes(1000 + i % 7) for i in range(2000)]
    done.wait()
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
libc = ctypes.CDLL(None)
libc.fdopen.restype = ctypes.c_void_p
r, w = os.pipe()
stream = ctypes.c_void_p(libc.fdopen(w, b"w"))
libc.malloc_info(0, stream)
libc.fclose(stream)
print(os.read(r, 1 << 20).decode().count("<heap nr="))
done.set()
"""


def heaps_of_threads(env: dict[str, str]) -> list[str]:
    run = subprocess.run(
        [sys.executable, "-c", ALLOCATING_THREADS],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=60,
    )
    return run.stdout.split()


def test_worker_threads_share_one_malloc_heap() -> None:
    """A heap per thread kept its share of a burst's freed memory until the trim."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    assert heaps_of_threads(env) == ["True", "1"]
    # The operator's own MALLOC_ARENA_MAX wins: the main heap and one per thread, up to it.
    assert heaps_of_threads({**env, "MALLOC_ARENA_MAX": "3"}) == ["False", "3"]


# In a process of its own: the plugin's modules imported, as in the plugin before it serves.
FREEZE = """
import gc, json
import dra_gpu.plugin.server
from dra_gpu.kubeletplugin.heap_trim import freeze_startup_objects

before = len(gc.get_objects())  # what a full collection walks
freeze_startup_objects()
after = len(gc.get_objects())

class Node:
    pass

a, b = Node(), Node()
a.other, b.other = b, a  # a cycle made while serving
del a, b
print(json.dumps({"before": before, "after": after, "cycle_freed": gc.collect() >= 2}))
"""


def test_a_full_collection_after_start_up_walks_only_what_came_after() -> None:
    out = subprocess.run(
        [sys.executable, "-c", FREEZE], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    result = json.loads(out)
    assert result["before"] > 20_000  # the imports: modules, classes, functions
    assert result["after"] < 1_000
    assert result["cycle_freed"]  # garbage made later is still collected
