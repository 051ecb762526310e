"""GPU health: event to taint visible in the apiserver, and the monitor's CPU when idle.

- Latency: the plugin's health half (the in-process Python fake NVML of hgx-2x4, monitor threads,
  taint book, slice publisher) publishes a bench node's slice through the real apiserver; each
  round injects an XID (as `dra-gpu health simulate` does) and times until a watch on the slice
  shows the taint; the taint is then cleared by the operator override and the round waits until
  that is visible too.
- Idle CPU: the process's CPU time over a quiet period with the monitor running (8 GPU threads,
  the default 5 s check interval), as a percentage of one core.

Needs a cluster: --kubeconfig (the local e2e cluster: `e2e/cluster up`, then
`eval "$(e2e/cluster env)"`). Run: .venv/bin/python bench/health_bench.py [--events 100]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pynvml
from prometheus_client import CollectorRegistry
from simnode.fake import simulated_nvml
from simnode.profiles import load_profile

from dra_gpu.discovery import discover
from dra_gpu.health.node import HealthConfig, HealthNode, taint_key
from dra_gpu.kube.api import RESOURCE_V1, Kube
from dra_gpu.kubeletplugin.metrics import PluginMetrics
from dra_gpu.kubeletplugin.publisher import SlicePublisher
from dra_gpu.node.catalog import DeviceCatalog
from dra_gpu.plugin.gpu_driver import GpuDriver

DRIVER = "bench-health.dra-gpu.io"
NODE = "bench-health-node"


def tainted(obj: dict[str, Any], device: str) -> bool:
    return any(d["name"] == device and d.get("taints") for d in obj["spec"]["devices"])


async def latency(kube: Kube, events: int, plugin_dir: Path) -> list[float]:
    nvml, pcie_root = simulated_nvml(load_profile("hgx-2x4"))  # the in-process fake
    inv = discover(nvml, NODE, pcie_root)
    catalog = DeviceCatalog.build(inv)
    health = HealthNode(
        HealthConfig(check_interval=5.0), DRIVER, catalog, plugin_dir, CollectorRegistry(), nvml
    )
    driver = GpuDriver(DRIVER, NODE, catalog, preparer=None, health=health.manager)  # type: ignore[arg-type]
    pub = SlicePublisher(kube, DRIVER, NODE, driver.resource_slices, PluginMetrics())
    await pub.start()
    health.subscribe(pub.refresh)
    await health.start()
    selector = f"spec.driver={DRIVER}"
    out: list[float] = []
    try:
        for i in range(events):
            gpu = inv.gpus[i % len(inv.gpus)]
            items, version = await kube.list_slices(selector)
            watch = kube.watch_objects(f"{RESOURCE_V1}/resourceslices", version, 30, selector)
            t0 = time.perf_counter()
            nvml.inject_event(gpu.uuid, pynvml.nvmlEventTypeXidCriticalError, 74)
            async with asyncio.timeout(10):
                async for _kind, obj in watch:
                    if tainted(obj, gpu.device_name):
                        out.append(time.perf_counter() - t0)
                        break
            await watch.aclose()
            await health.manager.clear(gpu.device_name)
            items, _ = await kube.list_slices(selector)
            assert not any(tainted(s, gpu.device_name) for s in items)
    finally:
        await health.stop()
        for s in (await kube.list_slices(selector))[0]:
            await kube.delete_slice(s["metadata"]["name"])
    return out


async def idle_cpu(seconds: float, plugin_dir: Path) -> float:
    nvml, pcie_root = simulated_nvml(load_profile("hgx-2x4"))
    inv = discover(nvml, NODE, pcie_root)
    health = HealthNode(
        HealthConfig(), DRIVER, DeviceCatalog.build(inv), plugin_dir, CollectorRegistry(), nvml
    )
    await health.start()
    await asyncio.sleep(1)
    c0, t0 = time.process_time(), time.monotonic()
    await asyncio.sleep(seconds)
    used = (time.process_time() - c0) / (time.monotonic() - t0)
    await health.stop()
    return 100 * used


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def main() -> None:
    logging.getLogger("dra_gpu").setLevel(logging.ERROR)  # one warning line per event otherwise
    ap = argparse.ArgumentParser()
    ap.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"))
    ap.add_argument("--events", type=int, default=100)
    ap.add_argument("--idle-seconds", type=float, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cpu = await idle_cpu(args.idle_seconds, Path(tmp) / "idle")
        print(
            f"monitor idle CPU: {cpu:.3f} % of one core over {args.idle_seconds:.0f} s (8 GPUs, 5 s checks)"
        )
        if not args.kubeconfig:
            print("no --kubeconfig: latency not measured")
            return
        kube = await Kube.connect(args.kubeconfig)
        try:
            lat = await latency(kube, args.events, Path(tmp) / "lat")
        finally:
            await kube.close()
    ms = [v * 1000 for v in lat]
    print(
        f"event -> taint visible in the apiserver ({len(ms)} events, key {taint_key(DRIVER)}): "
        f"p50 {statistics.median(ms):.1f} ms, p99 {pct(ms, 99):.1f} ms, max {max(ms):.1f} ms"
    )


if __name__ == "__main__":
    asyncio.run(main())
