"""Discovery + ResourceSlice build time for each 8-GPU simulated profile, in-process.

Run: .venv/bin/python bench/discovery_bench.py [--runs N]
Prints median / p99 per profile and the peak Python memory of one discovery.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

from simnode.fake import simulated_nvml
from simnode.profiles import load_profile

from dra_gpu.discovery import discover
from dra_gpu.node.slices import build_slices

PROFILES = ("hgx-2x4", "dgx-h100", "dgx-a100-mig")


def measure(name: str, runs: int) -> tuple[float, float, int, int]:
    profile = load_profile(name)
    nvml, pcie_root = simulated_nvml(profile)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        slices = build_slices(discover(nvml, "bench-node", pcie_root))
        times.append(time.perf_counter() - start)
    tracemalloc.start()
    build_slices(discover(nvml, "bench-node", pcie_root))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    times.sort()
    devices = sum(len(s["spec"]["devices"]) for s in slices)
    return statistics.median(times), times[int(len(times) * 0.99) - 1], peak, devices


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=300)
    args = parser.parse_args()
    print(f"{'profile':<14} {'devices':>7} {'median ms':>10} {'p99 ms':>8} {'peak KiB':>9}")
    for name in PROFILES:
        median, p99, peak, devices = measure(name, args.runs)
        print(f"{name:<14} {devices:>7} {median * 1e3:>10.2f} {p99 * 1e3:>8.2f} {peak / 1024:>9.0f}")


if __name__ == "__main__":
    main()
