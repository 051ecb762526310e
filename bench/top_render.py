"""`dra-gpu top` on a large cluster: 500 nodes of 8 GPUs (by default) rendered from their objects.

    .venv/bin/python bench/top_render.py [--nodes 500] [--runs 5]

The nodes are the simulated profiles as the driver publishes them, in a mix: hgx-2x4 (a 4-GPU
NVLink claim and a 1-GPU claim), dgx-h100 with memory shares (three shares on one GPU, two on
another), dgx-a100-mig (two MIG instances held) and dgx-h100-mig with dynamic MIG (three
placements held); every tenth node has a GPU tainted. Each claim is reserved by a pod.

Figures, each the median of `--runs` (CPU time of this process): decoding the listed objects
into the snapshot (the edge), snapshot -> view, view -> text, view -> JSON text; the target is
snapshot -> screen (view + text) under one second. Then, with two Pending pods (an 8-GPU NVLink
claim no node can give, a 4-GPU one that fits), the wall time of explaining them
(dra_gpu.fleet.pending: `dra-gpu explain` as a child process over the whole cluster).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dra_gpu.fleet.as_json import view_to_json  # noqa: E402
from dra_gpu.fleet.pending import explain_pending  # noqa: E402
from dra_gpu.fleet.snapshot import parse_snapshot  # noqa: E402
from dra_gpu.fleet.text import render_text  # noqa: E402
from dra_gpu.fleet.view import build_view  # noqa: E402
from tests.controller.objects import DRIVER, GPU_CLASS, NVLINK, claim  # noqa: E402
from tests.fleet_cluster import Cluster, devices_of, slices_of  # noqa: E402

TEMPLATE = "template-node"
# profile, options, the claims of one node: (devices by position among its devices, share memory)
MIX: list[tuple[str, dict[str, bool], list[tuple[list[int], str | None]]]] = [
    ("hgx-2x4", {}, [([0, 1, 2, 3], None), ([5], None)]),
    (
        "dgx-h100",
        {"memory_shares": True},
        [([0], "20Gi"), ([0], "20Gi"), ([0], "10Gi"), ([1], "40Gi"), ([1], "40Gi")],
    ),
    ("dgx-a100-mig", {}, [([5], None), ([9], None)]),
    ("dgx-h100-mig", {"dynamic_mig": True}, [([0], None), ([14], None), ([20], None)]),
]
WEIGHTS = (4, 3, 2, 1)  # of every 10 nodes


def cluster(nodes: int) -> Cluster:
    templates = [json.dumps(slices_of(TEMPLATE, profile, **options)) for profile, options, _ in MIX]
    order = [i for i, w in enumerate(WEIGHTS) for _ in range(w)]
    c = Cluster()
    for n in range(nodes):
        kind = order[n % len(order)]
        node = f"gpu-node-{n:04d}"
        slices = json.loads(templates[kind].replace(TEMPLATE, node))
        c.slices += slices
        names = devices_of(slices, node)
        for i, (positions, memory) in enumerate(MIX[kind][2]):
            devices = [names[p] for p in positions]
            c.hold(f"team-{n % 7}", f"{node}-job-{i}", node, devices, pod=f"{node}-pod-{i}", memory=memory)
        if n % 10 == 0:
            c.taint_in_slice(node, names[-1], f"{DRIVER}/xid", "xid-79", "NoSchedule")
    return c


def timed(fn: Callable[[], Any], runs: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(runs):
        t0 = time.process_time()
        result = fn()
        times.append(time.process_time() - t0)
    return statistics.median(times), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=500)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    t0 = time.perf_counter()
    c = cluster(args.nodes)
    made = time.perf_counter() - t0
    devices = sum(len(s["spec"].get("devices") or []) for s in c.slices)
    print(
        f"{args.nodes} nodes: {len(c.slices)} slices, {devices} devices, {len(c.claims)} claims, "
        f"{len(c.pods)} pods (objects made in {made:.1f} s)"
    )
    parse_s, snapshot = timed(lambda: parse_snapshot(DRIVER, c.slices, c.claims, c.pods, c.rules), args.runs)
    view_s, view = timed(lambda: build_view(snapshot), args.runs)
    text_s, text = timed(lambda: render_text(view), args.runs)
    json_s, doc = timed(lambda: json.dumps(view_to_json(view)), args.runs)
    lines = text.splitlines()
    print(f"  GPUs {view.totals.gpus}: {view.totals}")
    widest = max(len(line) for line in lines)
    print(f"  text: {len(lines)} lines, widest {widest} columns; JSON {len(doc)} bytes")
    print(f"  objects -> snapshot (decode)   {parse_s * 1000:8.1f} ms")
    print(f"  snapshot -> view               {view_s * 1000:8.1f} ms")
    print(f"  view -> text                   {text_s * 1000:8.1f} ms")
    print(f"  view -> JSON                   {json_s * 1000:8.1f} ms")
    print(f"  snapshot -> screen (view+text) {(view_s + text_s) * 1000:8.1f} ms (target < 1000 ms)")
    for name, count in (("waits-8", 8), ("waits-4", 4)):
        waiting = claim(name, count=count, constraints=NVLINK)
        c.claims.append(waiting)
        c.pods.append(
            {
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"resourceClaims": [{"name": "gpus", "resourceClaimName": name}]},
                "status": {"phase": "Pending"},
            }
        )
    snapshot = parse_snapshot(DRIVER, c.slices, c.claims, c.pods, c.rules, [GPU_CLASS])
    walls = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        pending = asyncio.run(explain_pending(snapshot, timeout=120))
        walls.append(time.perf_counter() - t0)
    for p in pending:
        print(f"  pending {p.pod}: fits={p.fits} {p.node or p.reason[:60]}")
    print(f"  explain 2 Pending pods (wall)  {statistics.median(walls) * 1000:8.1f} ms")


if __name__ == "__main__":
    main()
