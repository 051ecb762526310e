"""The GPU driver publishes the health manager's taints in its slices and its verdicts as kubelet
health, and stays within the 64-devices-per-slice limit that taints bring."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from dra_gpu.health.classification import Classifier, Effect, EventKind
from dra_gpu.health.manager import HealthManager
from dra_gpu.health.monitor import Observation, Seen
from dra_gpu.health.taint_book import TaintBook
from dra_gpu.kubeletplugin.driver import Health
from dra_gpu.model import Gpu
from dra_gpu.plugin.gpu_driver import GpuDriver
from dra_gpu.simnode.fake import discover_node
from dra_gpu.slices import build_slices

DRIVER = "gpu.dra-gpu.io"


def test_taints_reach_the_slice_and_the_health_stream(tmp_path: Path) -> None:
    inv = discover_node("node-a", "hgx-2x4")
    gpu = inv.gpus[2]
    book = TaintBook(tmp_path / "t.json", [g.device_name for g in inv.gpus])
    manager = HealthManager(inv, f"{DRIVER}/unhealthy", book, Classifier(), CollectorRegistry())
    driver = GpuDriver(DRIVER, "node-a", inv, preparer=None, health=manager)  # type: ignore[arg-type]
    manager.handle(Observation(gpu.uuid, Seen.EVENT, EventKind.XID, 79))
    (s,) = driver.resource_slices(3)
    devices: dict[str, Any] = {d["name"]: d for d in s["spec"]["devices"]}
    assert devices[gpu.device_name]["taints"][0]["effect"] == Effect.NO_EXECUTE.api
    assert sum("taints" in d for d in devices.values()) == 1
    health = {h.device_name: h for h in driver.device_health()}
    assert health[gpu.device_name].health is Health.UNHEALTHY
    assert "XID 79" in health[gpu.device_name].message
    assert health[inv.gpus[0].device_name].health is Health.HEALTHY


def test_a_taint_splits_a_large_node_at_64_devices() -> None:
    inv = discover_node("node-a", "hgx-2x4")
    template = inv.gpus[0]
    inv.gpus = [
        Gpu(
            index=i,
            minor=i,
            uuid=f"GPU-{i:08d}",
            product_name=template.product_name,
            pci_bus_id=f"0000:{i // 32:02x}:{i % 32:02x}.0",
        )
        for i in range(100)
    ]
    assert len(build_slices(inv, DRIVER)) == 1
    taints = {inv.gpus[5].device_name: [{"key": "k.io/x", "value": "v", "effect": "NoSchedule"}]}
    slices = build_slices(inv, DRIVER, 1, taints)
    assert [len(s["spec"]["devices"]) for s in slices] == [64, 36]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {2}
