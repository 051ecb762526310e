"""What replacing one review worker costs: the time from taking a worker out to its replacement
being ready, the CPU the main (event-loop) process spends on it, the CPU the new worker spent
before it was ready, and the latency of the first review the new worker answers.

    .venv/bin/python bench/review_pool_replace_bench.py [--nodes 125] [--rounds 20] [--tree PATH]

`--tree` runs it against another checkout's dra_gpu (a before/after pair from one script).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _cpu_ms(pid: int) -> float:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e6


def _pid(worker: Any) -> int:
    pid = getattr(worker, "pid", None)
    return int(pid if pid is not None else worker.process.pid)


async def run(nodes: int, rounds: int) -> None:
    from bench.controller_bench import SELECTORS, cluster
    from dra_gpu.controller.review_pool import ReviewPool
    from tests.controller.objects import NVLINK, claim

    docs = cluster(nodes, nodes // 2)
    pool = ReviewPool("gpu.dra-gpu.io", deadline_s=10)  # a cold first review on a busy machine
    pool.replace("slices", [d for d in docs if d.get("kind") == "ResourceSlice"])
    pool.replace("claims", [d for d in docs if d.get("kind") == "ResourceClaim"])
    pool.replace("classes", [d for d in docs if d.get("kind") == "DeviceClass"])
    normal = claim("normal", 2, selectors=SELECTORS, constraints=NVLINK)
    await pool.start()
    wall, main_cpu, worker_cpu, template_cpu, first = [], [], [], [], []
    try:
        for _ in range(2 * pool.size):  # every worker (and the template, if any) warm
            await pool.validate(normal)
        for _ in range(rounds):
            victim = await pool._idle.get()
            before = {_pid(w) for w in pool._workers}
            template = getattr(pool, "_template", None)  # none before the template existed
            t0, c0 = time.perf_counter(), time.process_time()
            tc0 = _cpu_ms(template.process.pid) if template else 0.0
            pool._replace_worker(victim)
            while pool._idle.qsize() < pool.size:
                await asyncio.sleep(0.0005)
            wall.append((time.perf_counter() - t0) * 1000)
            main_cpu.append((time.process_time() - c0) * 1000)
            template_cpu.append(_cpu_ms(template.process.pid) - tc0 if template else 0.0)
            new = [w for w in pool._workers if _pid(w) not in before][-1]  # the last one started
            worker_cpu.append(_cpu_ms(_pid(new)))
            # The new worker answers the next review: the others go to the back of the queue.
            idle = [pool._idle.get_nowait() for _ in range(pool._idle.qsize())]
            for w in sorted(idle, key=lambda w: w is not new):
                pool._idle.put_nowait(w)
            t0 = time.perf_counter()
            await pool.validate(normal)
            first.append((time.perf_counter() - t0) * 1000)
            await asyncio.sleep(0.2)  # the killed worker's exit out of the way
    finally:
        await pool.close()
    devices = sum(len(d["spec"]["devices"]) for d in docs if d.get("kind") == "ResourceSlice")
    print(f"worker replacement: {devices} devices on {nodes} nodes, {rounds} rounds (median, max)")
    for label, values in [
        ("taken out -> replacement ready", wall),
        ("main process CPU", main_cpu),
        ("new worker's CPU before ready", worker_cpu),
        ("template's CPU (fork)", template_cpu),
        ("its first review", first),
    ]:
        print(f"  {label:32s} {statistics.median(values):8.2f} ms {max(values):8.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=125)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    args = ap.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    asyncio.run(run(args.nodes, args.rounds))


if __name__ == "__main__":
    main()
