"""Where a prepare's time goes, in process: the plugin's Preparer on a simulated node (the
prepare bench's 112 MIG devices, the node's driver user space in every spec), checkpoint and
CDI specs on a real file system, claims from memory. Each one-claim prepare is followed by its
unprepare, as in bench/prepare_bench.py; the claim read over the apiserver is measured there.

    .venv/bin/python bench/prepare_split.py [--rounds 300] [--dir DIR] [--profile-out FILE]

Prints per phase (wall time inside one prepare): plan (claim -> devices and spec, CPU), the
checkpoint writes ("started" overlapped with the CDI spec write, then "completed"), and the
whole prepare; then the CPU time per prepare + unprepare. `--profile-out` writes a pyinstrument
profile of the same loop as HTML (pip install pyinstrument).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simnode.fake import discover_node  # noqa: E402

from bench.prepare_bench import bench_profile  # noqa: E402
from dra_gpu.kubeletplugin.claims import ClaimFetcher  # noqa: E402
from dra_gpu.kubeletplugin.driver import ClaimRef  # noqa: E402
from dra_gpu.node.catalog import DeviceCatalog  # noqa: E402
from dra_gpu.plugin.cdi import CdiSpecs  # noqa: E402
from dra_gpu.plugin.checkpoint import Checkpoint  # noqa: E402
from dra_gpu.plugin.device_nodes import DeviceNodes  # noqa: E402
from dra_gpu.plugin.driver_files import DriverFiles  # noqa: E402
from dra_gpu.plugin.prepare import Preparer  # noqa: E402
from tests.fake_node import create_simulated  # noqa: E402

DRIVER, NODE = "gpu.dra-gpu.io", "bench-node"


class Claims(dict[tuple[str, str], dict[str, Any]]):
    async def get_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        claim = self.get((namespace, name))
        return json.loads(json.dumps(claim)) if claim is not None else None  # a fresh object, as parsed


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def setup(work: Path) -> tuple[Preparer, list[ClaimRef]]:
    profile = work / "bench-node.yaml"
    bench_profile(profile)
    inventory = discover_node(NODE, str(profile))
    create_simulated(inventory, work / "devroot")
    cache = Path(os.environ.get("DRA_GPU_CACHE", Path.home() / ".cache" / "dra-gpu"))
    build = [sys.executable, str(ROOT / "e2e" / "node" / "simdriver" / "build.py"), "--profile", str(profile)]
    root = subprocess.run([*build, "--cache", str(cache)], check=True, capture_output=True, text=True)
    driver_files = DriverFiles(Path(root.stdout.split()[-1]), inventory.driver_version)
    claims = Claims()
    refs = []
    for i, gpu in enumerate(inventory.gpus):
        for mig in gpu.mig_devices:
            uid = f"{i:04d}{len(refs):04d}-0000-4000-8000-000000000000"
            name = f"claim-{len(refs)}"
            claims[("bench", name)] = {
                "metadata": {"name": name, "namespace": "bench", "uid": uid},
                "status": {
                    "allocation": {
                        "devices": {
                            "results": [
                                {
                                    "request": "gpu",
                                    "driver": DRIVER,
                                    "pool": NODE,
                                    "device": gpu.mig_device_name(mig),
                                }
                            ]
                        }
                    }
                },
            }
            refs.append(ClaimRef("bench", uid, name))
    preparer = Preparer(
        DRIVER,
        NODE,
        DeviceCatalog.build(inventory),
        Checkpoint(work / "plugin" / "checkpoint.json", boot_id="bench"),
        CdiSpecs(work / "cdi", DRIVER),
        DeviceNodes(work / "devroot"),
        claims,
        driver_files,
    )
    return preparer, refs


def timed(
    phases: dict[str, list[float]], name: str, fn: Callable[..., Any], is_async: bool = False
) -> Callable[..., Any]:
    if is_async:

        async def wrapped_async(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return await fn(*a, **k)
            finally:
                phases[name].append(time.perf_counter() - t)

        return wrapped_async

    def wrapped(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            phases[name].append(time.perf_counter() - t)

    return wrapped


async def prepare(preparer: Preparer, ref: ClaimRef) -> None:
    """As the kubelet-plugin layer does: the claim read (here from memory), then the prepare."""
    await preparer.prepare(ref, await ClaimFetcher(preparer.claims).fetch(ref))


async def run(preparer: Preparer, refs: list[ClaimRef], rounds: int) -> tuple[list[float], float]:
    total: list[float] = []
    cpu0 = time.process_time()
    for i in range(rounds):
        ref = refs[i % len(refs)]
        t = time.perf_counter()
        await prepare(preparer, ref)
        total.append(time.perf_counter() - t)
        await preparer.unprepare(ref)
    return total, (time.process_time() - cpu0) / rounds


async def inflight(preparer: Preparer, refs: list[ClaimRef]) -> float:
    t = time.perf_counter()
    await asyncio.gather(*(prepare(preparer, r) for r in refs))
    wall = time.perf_counter() - t
    await asyncio.gather(*(preparer.unprepare(r) for r in refs))
    return len(refs) / wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--dir", default="/var/tmp", help="where the checkpoint and specs go (a real disk)")
    ap.add_argument("--profile-out", help="write a pyinstrument HTML profile of the loop here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dra-split-", dir=args.dir))
    preparer, refs = setup(work)
    asyncio.run(measure(preparer, refs, args))


async def measure(preparer: Preparer, refs: list[ClaimRef], args: argparse.Namespace) -> None:
    await run(preparer, refs, 20)  # warm-up
    phases: dict[str, list[float]] = defaultdict(list)
    # Wall time of each step as the prepare sees it (the writes run in worker threads).
    p, ck, specs = preparer.planner, preparer.checkpoint, preparer.journal.spec_rounds
    p.plan = timed(phases, "plan (claim -> devices, spec)", p.plan)  # type: ignore[method-assign]
    ck.encode = timed(phases, "checkpoint encode", ck.encode)  # type: ignore[method-assign]
    ck.write = timed(phases, "checkpoint write (atomic)", ck.write)  # type: ignore[method-assign]
    specs.write = timed(phases, "CDI spec write (atomic)", specs.write, True)  # type: ignore[method-assign]
    specs.remove = timed(phases, "CDI spec remove", specs.remove, True)  # type: ignore[method-assign]
    profiler = None
    if args.profile_out:
        from pyinstrument import Profiler

        profiler = Profiler(async_mode="enabled")
        profiler.start()
    total, cpu = await run(preparer, refs, args.rounds)
    if profiler is not None:
        profiler.stop()
        Path(args.profile_out).write_text(profiler.output_html())
    print(f"in-process prepare split, {args.rounds} one-claim rounds, files under {args.dir}")
    print(f"  {'step':<38} {'calls/round':>11} {'p50 ms':>7} {'p99 ms':>7}")
    for name, values in phases.items():
        per = len(values) / args.rounds
        print(f"  {name:<38} {per:>11.1f} {pct(values, 50) * 1e3:>7.2f} {pct(values, 99) * 1e3:>7.2f}")
    print(f"  {'whole prepare':<38} {1:>11.1f} {pct(total, 50) * 1e3:>7.2f} {pct(total, 99) * 1e3:>7.2f}")
    print(f"  CPU per prepare + unprepare: {cpu * 1e3:.2f} ms")
    rates = [await inflight(preparer, refs[:100]) for _ in range(3)]
    print(f"  100 claims in flight: {statistics.median(rates):.0f} claims/s (median of 3)")


if __name__ == "__main__":
    main()
