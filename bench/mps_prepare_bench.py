"""Prepare latency of an MPS claim, daemon start included: the preparer in-process (no apiserver:
claims come from memory), on a simulated node whose driver root (e2e/node/simdriver) has the
simulated `nvidia-cuda-mps-control`, a real daemon process. Each prepare starts the claim's
daemon, waits until it answers on its pipe, sets and reads back its limits, sets the compute mode
and writes the CDI spec and checkpoint; each is followed by its unprepare (daemon stopped).

Run (root: device nodes are mknod'ed): .venv/bin/python bench/mps_prepare_bench.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from simnode.builder import ensure_driver_root
from simnode.fake import discover_node

from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.model.config import API_VERSION
from dra_gpu.node.catalog import DeviceCatalog
from dra_gpu.plugin.cdi import CdiSpecs
from dra_gpu.plugin.checkpoint import Checkpoint
from dra_gpu.plugin.device_nodes import DeviceNodes
from dra_gpu.plugin.driver_files import DriverFiles
from dra_gpu.plugin.prepare import Preparer
from tests.fake_node import create_simulated, fake_sharing

ROOT = Path(__file__).resolve().parents[1]

DRIVER, NODE, PROFILE = "gpu.dra-gpu.io", "bench", "hgx-2x4"


class Claims(dict[tuple[str, str], dict[str, Any]]):
    async def get_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.get((namespace, name))


def mps_claim(uid: str, device: str) -> dict[str, Any]:
    params = {
        "apiVersion": API_VERSION,
        "kind": "GpuConfig",
        "sharing": {
            "strategy": "MPS",
            "mps": {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi"},
        },
    }
    return {
        "metadata": {"name": f"mps-{uid[:8]}", "namespace": "bench", "uid": uid},
        "status": {
            "allocation": {
                "devices": {
                    "results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}],
                    "config": [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": params}}],
                }
            }
        },
    }


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


async def run(rounds: int, work: Path, cache: Path) -> None:
    inventory = discover_node(NODE, PROFILE)
    assert inventory.driver_version
    driver_root = ensure_driver_root(cache, PROFILE)
    dev_root = work / "devroot"
    create_simulated(inventory, dev_root)
    claims = Claims()
    driver_files = DriverFiles(driver_root, inventory.driver_version)
    mps_root = Path(tempfile.mkdtemp(prefix="mps-", dir="/tmp"))
    preparer = Preparer(
        DRIVER,
        NODE,
        DeviceCatalog.build(inventory),
        Checkpoint(work / "plugin" / "checkpoint.json"),
        CdiSpecs(work / "cdi", DRIVER),
        DeviceNodes(dev_root),
        claims,
        driver_files,
        fake_sharing(mps_root, driver_files, PROFILE, dev_root),
    )
    device = inventory.gpus[0].device_name
    prepare_ms: list[float] = []
    unprepare_ms: list[float] = []
    try:
        for _ in range(rounds):
            uid = str(uuid.uuid4())
            c = mps_claim(uid, device)
            claims[("bench", c["metadata"]["name"])] = c
            ref = ClaimRef("bench", uid, c["metadata"]["name"])
            t0 = time.perf_counter()
            await preparer.prepare(ref, claims[(ref.namespace, ref.name)])
            t1 = time.perf_counter()
            await preparer.unprepare(ref)
            t2 = time.perf_counter()
            prepare_ms.append((t1 - t0) * 1000)
            unprepare_ms.append((t2 - t1) * 1000)
    finally:
        shutil.rmtree(mps_root, ignore_errors=True)  # each round stopped its own daemon
    for name, values in (
        ("prepare (daemon start incl.)", prepare_ms),
        ("unprepare (daemon stop)", unprepare_ms),
    ):
        print(
            f"{name:30s} n={len(values)} p50 {statistics.median(values):7.1f} ms  "
            f"p99 {pct(values, 99):7.1f} ms  max {max(values):7.1f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "dra-gpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mps-bench-") as work:
        asyncio.run(run(args.rounds, Path(work), args.cache))


if __name__ == "__main__":
    main()
