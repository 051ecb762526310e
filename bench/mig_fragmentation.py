"""Dynamic MIG fragmentation: a seeded random trace of MIG requests through `explain`'s allocator.

    .venv/bin/python bench/mig_fragmentation.py [--seed 7] [--steps 4000] [--life 20] [--runs 5]

8 simulated H100s (dgx-h100-mig, dynamic MIG). One request arrives per step, for one MIG device of a
profile drawn from 1g.10gb 45 %, 2g.20gb 25 %, 3g.40gb 20 %, 7g.80gb 10 %; an allocated request
leaves after a geometric lifetime (mean `--life` steps), freeing its device. Each arrival is placed
by the same first-fit search with counters that the scheduler runs (dra_gpu.controller.allocator);
a request that does not fit is refused (it would wait; here it is dropped, so both orders see the
same trace). "Fragmented" = a 3g.40gb / 7g.80gb request refused while the GPUs have at least as many
free memory slices in total as it needs. The device orders compared:

- ascending: each GPU's placements as NVML lists them (low memory slice first), GPU by GPU.
- packed: GPU by GPU, each profile's placements from the high end down.
- two-ended (dra-gpu's): packed for profiles up to half a GPU from the first GPU on, the full-GPU
  profile from the last GPU back.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simnode.fake import discover_node  # noqa: E402

from dra_gpu.controller.allocator import place  # noqa: E402
from dra_gpu.controller.allocator_view import Cluster  # noqa: E402
from dra_gpu.controller.rules import Validator  # noqa: E402
from dra_gpu.model.inventory import DEFAULT_DRIVER_NAME as DRIVER  # noqa: E402
from dra_gpu.node.catalog import DeviceCatalog  # noqa: E402
from dra_gpu.node.dynamic_mig import PLACEMENT_ORDERS, PlacementOrder  # noqa: E402
from dra_gpu.node.slices import SliceBuilder  # noqa: E402

NODE = "node-a"
MIX = (("1g.10gb", 0.45), ("2g.20gb", 0.25), ("3g.40gb", 0.20), ("7g.80gb", 0.10))
SLICES = {"1g.10gb": 1, "2g.20gb": 2, "3g.40gb": 4, "7g.80gb": 8}
LARGE = ("3g.40gb", "7g.80gb")
MIG_SELECTOR = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "mig"'
MIG_CLASS: dict[str, Any] = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": "mig.dra-gpu.io"},
    "spec": {"selectors": [{"cel": {"expression": MIG_SELECTOR}}]},
}


ORDERS: dict[str, PlacementOrder] = PLACEMENT_ORDERS


@dataclass(frozen=True)
class Arrival:
    step: int
    profile: str
    leaves: int  # step at which it departs, if allocated


def trace(seed: int, steps: int, life: float) -> list[Arrival]:
    rng = random.Random(seed)
    names, weights = zip(*MIX, strict=True)
    out = []
    for step in range(steps):
        profile = rng.choices(names, weights)[0]
        lifetime = 1
        while rng.random() > 1 / life:
            lifetime += 1
        out.append(Arrival(step, profile, step + lifetime))
    return out


def claim_spec(profile: str) -> dict[str, Any]:
    selector = f'device.attributes["{DRIVER}"].profile == "{profile}"'
    return {
        "devices": {
            "requests": [
                {
                    "name": "mig",
                    "exactly": {
                        "deviceClassName": "mig.dra-gpu.io",
                        "selectors": [{"cel": {"expression": selector}}],
                    },
                }
            ]
        }
    }


def run(order: str, arrivals: list[Arrival]) -> dict[str, Any]:
    inventory = discover_node(NODE, "dgx-h100-mig", dynamic_mig=True)
    slices = SliceBuilder(DeviceCatalog.build(inventory, order=ORDERS[order]), DRIVER).slices()
    env = Validator(DRIVER, slices, [MIG_CLASS]).env
    cluster = Cluster(env, slices, {"mig.dra-gpu.io": MIG_CLASS}, set())
    specs = {p: claim_spec(p) for p, _ in MIX}
    slice_of = {
        d["name"]: {k for k in d["consumesCounters"][0]["counters"] if k.startswith("memory-slice-")}
        for s in slices
        for d in s["spec"].get("devices") or []
        if d.get("consumesCounters")
    }
    total_slices = sum(g.memory_slice_count for g in inventory.gpus)
    active: dict[tuple[str, str, str], int] = {}  # device key -> departure step
    stats = {p: {"requests": 0, "refused": 0, "fragmented": 0} for p, _ in MIX}
    placements: list[tuple[int, str, str | None]] = []
    started = time.perf_counter()
    for a in arrivals:
        for key in [k for k, leaves in active.items() if leaves <= a.step]:
            del active[key]
            cluster.in_use = cluster.in_use - {key}
        s = stats[a.profile]
        s["requests"] += 1
        got = place(cluster, specs[a.profile], NODE)
        if got is None:
            s["refused"] += 1
            used = sum(len(slice_of[k[2]]) for k in active)
            if total_slices - used >= SLICES[a.profile]:
                s["fragmented"] += 1
            placements.append((a.step, a.profile, None))
            continue
        ((_, device),) = got.results
        active[device.key] = a.leaves
        cluster.in_use = cluster.in_use | {device.key}
        placements.append((a.step, a.profile, device.name))
    return {"stats": stats, "seconds": time.perf_counter() - started, "placements": placements}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument(
        "--life", type=float, default=20.0, help="mean lifetime of an allocated request, in steps"
    )
    ap.add_argument("--runs", type=int, default=5, help="traces (seeds seed, seed+1, ...)")
    args = ap.parse_args()
    totals: dict[str, dict[str, dict[str, int]]] = {}
    for r in range(args.runs):
        arrivals = trace(args.seed + r, args.steps, args.life)
        for order in ORDERS:
            result = run(order, arrivals)
            agg = totals.setdefault(
                order, {p: {"requests": 0, "refused": 0, "fragmented": 0} for p, _ in MIX}
            )
            for p, s in result["stats"].items():
                for k, v in s.items():
                    agg[p][k] += v
            print(f"seed {args.seed + r} {order:9s} {result['seconds']:.1f} s", file=sys.stderr)
    print(
        f"{args.runs} traces x {args.steps} requests (seeds {args.seed}..{args.seed + args.runs - 1}), "
        f"8x H100, mean life {args.life:g} steps, mix {', '.join(f'{p} {w:.0%}' for p, w in MIX)}"
    )
    print(f"{'order':10s} {'profile':8s} {'requests':>8s} {'refused':>8s} {'fragmented':>10s} {'share':>7s}")
    for order, agg in totals.items():
        for p, s in agg.items():
            share = s["fragmented"] / s["requests"] if s["requests"] else 0.0
            print(
                f"{order:10s} {p:8s} {s['requests']:8d} {s['refused']:8d} {s['fragmented']:10d} {share:7.2%}"
            )
        large = [agg[p] for p in LARGE]
        req = sum(s["requests"] for s in large)
        frag = sum(s["fragmented"] for s in large)
        acc = sum(s["requests"] - s["refused"] for s in agg.values()) / sum(
            s["requests"] for s in agg.values()
        )
        print(
            f"{order:10s} 3g+7g: {frag}/{req} = {frag / req:.2%} refused while enough slices were free "
            f"in total; all requests accepted: {acc:.2%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
