"""The webhook's memory against the cluster's ResourceClaims: its cluster view (ClusterState) and its
review pool (ReviewPool: the template and 3 workers, real processes) fed N claims of about the
largest size the apiserver stores, each allocated on a device of its own.

Each claim is ~1.2 MB: a 256 KiB annotation (the apiserver's limit on annotations), one request
with 32 CEL selectors of 10,000 characters, 32 opaque configs of another driver with 10,000 bytes
of parameters each (copied into status.allocation, as the scheduler does) and 32 reservedFor
entries. Every claim's large strings are its own (nothing shared between claims that would hide one
kept whole) and each is made, fed and dropped: the bench never holds more than one.

Per count, in a process of its own (a fresh heap): the floor (pool started, slices and class in
the view, no claims); then `replace` with the N claims, read one at a time from a generator as a
list is decoded; then rounds of `apply` (--rounds, 2): in each, N more claims each ADDED
unallocated and then MODIFIED allocated, and the round's first N DELETED, so the view holds N
claims again after each. After each step one review is
answered (the worker that takes it gets its events first) and the idle worker and the template get
theirs within a second; the step's row is read then: VmRSS of the webhook process, its VmHWM (peak
since the step began, /proc/PID/clear_refs), the template's and the largest worker's VmRSS. A
process over --cap-mb stops the run (before the view was bounded, each claim stayed whole).

    .venv/bin/python bench/webhook_view_rss.py [--counts 1000,5000,20000] [--rounds 2] [--tree PATH]
        [--cap-mb 4000]

`--tree` runs it against another checkout's dra_gpu (before/after from one script).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DRIVER = "gpu.dra-gpu.io"
ANNOTATION_BYTES = 256 * 1024
SELECTORS, CEL_CHARS = 32, 10_000
CONFIGS, PARAMETER_BYTES = 32, 10_000
GPUS_PER_NODE = 8


def large_claim(i: int, allocated: bool = True) -> dict[str, Any]:
    """Claim `i`, ~1.2 MB of strings of its own; allocated on device i (GPUS_PER_NODE a node)."""
    tag = f"{i}-"
    configs = [
        {
            "requests": ["gpu"],
            "opaque": {
                "driver": "other.example.com",
                "parameters": {"kind": "Config", "pad": (tag + str(c)).ljust(PARAMETER_BYTES, "p")},
            },
        }
        for c in range(CONFIGS)
    ]
    product = f'device.attributes["{DRIVER}"].productName'
    selectors = [
        {"cel": {"expression": f'{product} == "{(tag + str(s)).ljust(CEL_CHARS, "x")}"'}}
        for s in range(SELECTORS)
    ]
    claim: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": f"claim-{i:06d}",
            "namespace": "tenant",
            "uid": f"00000000-0000-0000-0000-{i:012d}",
            "resourceVersion": str(10 + i),
            "annotations": {"example.com/pad": tag.ljust(ANNOTATION_BYTES, "a")},
        },
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER, "selectors": selectors}}],
                "config": configs,
            }
        },
        "status": {
            "reservedFor": [
                {"resource": "pods", "name": f"pod-{i}-{p}", "uid": f"{i:08d}-0000-0000-0000-{p:012d}"}
                for p in range(32)
            ]
        },
    }
    if allocated:
        node = f"node-{i // GPUS_PER_NODE}"
        claim["status"]["allocation"] = {
            "devices": {
                "results": [
                    {"request": "gpu", "driver": DRIVER, "pool": node, "device": f"gpu-{i % GPUS_PER_NODE}"}
                ],
                "config": [{**c, "source": "FromClaim"} for c in configs],
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]
            },
        }
    return claim


def status_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


class Over(Exception):
    pass


async def one_count(count: int, rounds: int, cap_mb: float) -> None:
    from bench.process_memory import memory
    from dra_gpu.controller.cluster_state import ClusterState
    from dra_gpu.controller.review_pool import OverBudget, ReviewPool
    from tests.controller.objects import GPU_CLASS, claim, node_slices

    state = ClusterState(DRIVER)
    pool = ReviewPool(DRIVER, deadline_s=10)
    state.pool = pool
    state.replace("slices", node_slices())
    state.replace("classes", [GPU_CLASS])
    await pool.start()
    probe = claim("probe", 1)
    me = Path("/proc/self/clear_refs")

    def check() -> None:
        pids = [0, *(w.pid for w in pool._workers)]
        if pool._template is not None and pool._template.process.pid:
            pids.append(pool._template.process.pid)
        for pid in pids:
            mb = status_mb(pid or os.getpid(), "VmRSS")
            if mb > cap_mb:
                raise Over(f"{'a review process' if pid else 'the webhook'} at {mb:.0f} MB, over --cap-mb")

    async def row(step: str, started: float) -> None:
        try:
            await pool.validate(probe)  # the top worker gets its events with it
            await asyncio.sleep(2.5)  # the idle worker and the template get theirs (every second)
            await pool.validate(probe)
        except OverBudget as exc:  # the view did not fit a worker's memory budget
            raise Over(f"the {step} review was refused: {exc}") from exc
        main = memory(os.getpid())
        template = status_mb(pool._template.process.pid, "VmRSS") if pool._template else 0.0
        workers = max(status_mb(w.pid, "VmRSS") for w in pool._workers)
        print(
            f"{count:6d}  {step:8s}  {len(state.stores['claims']):5d}  {main.rss_mb:8.1f}  "
            f"{main.anonymous_mb:7.1f}  {status_mb(os.getpid(), 'VmHWM'):7.1f}  {template:8.1f}  "
            f"{workers:8.1f}  {time.monotonic() - started:6.1f}",
            flush=True,
        )

    def listed() -> Iterator[dict[str, Any]]:
        for i in range(count):
            if i % 200 == 0:
                check()
            yield large_claim(i)

    try:
        started = time.monotonic()
        me.write_text("5")
        await row("floor", started)
        started = time.monotonic()
        me.write_text("5")
        state.replace("claims", listed())
        await row("replace", started)
        for round_ in range(1, rounds + 1):  # the view stays at `count` claims; the churn goes on
            started = time.monotonic()
            me.write_text("5")
            for i in range(round_ * count, (round_ + 1) * count):
                state.apply("claims", "ADDED", large_claim(i, allocated=False))
                state.apply("claims", "MODIFIED", large_claim(i))
                state.apply("claims", "DELETED", large_claim(i - count))
                if i % 50 == 0:
                    check()
                    await asyncio.sleep(0)  # as a watch reads its socket: the loop runs its feeder
            await row(f"apply {round_}", started)
    except Over as exc:
        print(f"{count:6d}  stopped: {exc}", flush=True)
    finally:
        await pool.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="1000,5000,20000", help="claims, comma-separated")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose dra_gpu is measured")
    ap.add_argument("--cap-mb", type=float, default=4000, help="stop when a process passes this RSS")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of apply events after the replace")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # one count, in this process
    args = ap.parse_args()
    if args.one is not None:
        sys.path[:0] = [str(args.tree.resolve()), str(ROOT)]
        asyncio.run(one_count(args.one, args.rounds, args.cap_mb))
        return
    size = len(json.dumps(large_claim(0), separators=(",", ":")))
    print(f"one claim: {size / 1e6:.2f} MB of JSON; tree {args.tree}", flush=True)
    print("claims  step      kept   main MB  anon MB  peak MB  templ MB  worker MB  seconds", flush=True)
    for count in (int(c) for c in args.counts.split(",")):
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--one",
                str(count),
                "--rounds",
                str(args.rounds),
                "--tree",
                str(args.tree),
                "--cap-mb",
                str(args.cap_mb),
            ],
            check=True,
            timeout=3600,
        )


if __name__ == "__main__":
    main()
