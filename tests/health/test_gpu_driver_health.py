"""The GPU driver publishes the health manager's taints in its slices and its verdicts as kubelet
health, and stays within the 64-devices-per-slice limit that taints bring."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest.mock import ANY

from prometheus_client import CollectorRegistry
from simnode.fake import discover_node

from dra_gpu.health.classification import Classifier, Effect, EventKind
from dra_gpu.health.manager import HealthManager
from dra_gpu.health.monitor import Observation, Seen
from dra_gpu.health.taint_book import TaintBook
from dra_gpu.kubeletplugin.driver import Health
from dra_gpu.model.inventory import Gpu
from dra_gpu.node.catalog import DeviceCatalog
from dra_gpu.node.slices import build_slices
from dra_gpu.plugin.gpu_driver import GpuDriver

DRIVER = "gpu.dra-gpu.io"


def test_taints_reach_the_slice_and_the_health_stream(tmp_path: Path) -> None:
    inv = discover_node("node-a", "hgx-2x4")
    gpu = inv.gpus[2]
    book = TaintBook(tmp_path / "t.json", [g.device_name for g in inv.gpus])
    catalog = DeviceCatalog.build(inv)
    manager = HealthManager(catalog, f"{DRIVER}/unhealthy", book, Classifier(), CollectorRegistry())
    driver = GpuDriver(DRIVER, "node-a", catalog, preparer=None, health=manager)  # type: ignore[arg-type]
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


def test_memory_share_devices_get_taints(tmp_path: Path) -> None:
    """A GPU shared by memory (`--memory-shares`) is one device of several claims: its taint and
    health reach the slice and the stream like a whole GPU's."""
    inv = discover_node("node-a", "mixed")
    catalog = DeviceCatalog.build(inv, memory_shares=True)
    shared = [d for d in catalog if d.shared]
    assert len(shared) == len(inv.gpus) == 4
    gpu = shared[1].gpu
    book = TaintBook(tmp_path / "t.json", catalog.names())
    manager = HealthManager(catalog, f"{DRIVER}/unhealthy", book, Classifier(), CollectorRegistry())
    driver = GpuDriver(DRIVER, "node-a", catalog, preparer=None, health=manager)  # type: ignore[arg-type]
    assert manager.handle(Observation(gpu.uuid, Seen.EVENT, EventKind.DOUBLE_BIT_ECC))
    devices = {d["name"]: d for s in driver.resource_slices(1) for d in s["spec"]["devices"]}
    tainted = devices[gpu.device_name]
    assert tainted["allowMultipleAllocations"] is True and "computeShare" in tainted["capacity"]
    assert tainted["taints"] == [
        {"key": f"{DRIVER}/unhealthy", "value": "ecc-dbe", "effect": "NoExecute", "timeAdded": ANY}
    ]
    assert [n for n, d in devices.items() if d.get("taints")] == [gpu.device_name]
    health = {h.device_name: h.health for h in driver.device_health()}
    assert health[gpu.device_name] is Health.UNHEALTHY
    assert sum(h is Health.HEALTHY for h in health.values()) == 3
