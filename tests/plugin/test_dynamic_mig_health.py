"""Health on a dynamic-MIG GPU (docs/health.md): an event NVML does not attribute to a GPU or
compute instance concerns the whole GPU, so it taints every placement of that GPU; one attributed
to the instance a claim made taints that placement only. Memory-share devices get taints too."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from simnode.profiles import load_profile

from dra_gpu.health.claim_status import ClaimStatusWriter
from dra_gpu.health.classification import Effect, EventKind
from dra_gpu.health.monitor import Observation, Seen
from dra_gpu.health.node import HealthConfig, HealthNode
from dra_gpu.kubeletplugin.driver import Health
from dra_gpu.plugin.gpu_driver import GpuDriver
from plugin.conftest import DRIVER, NODE, claim, prepare_claim
from plugin.test_dynamic_mig_prepare import GPU0, PROFILE, start_node
from tests.driver_root import make_root

KEY = f"{DRIVER}/unhealthy"


@pytest.fixture(scope="module")
def h100_driver_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_root(tmp_path_factory.mktemp("driver") / "root", load_profile(PROFILE).driver_version)


IN_USE = f"{GPU0}-mig-3g40gb-4"


def _published(driver: GpuDriver) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in driver.resource_slices(1) for d in s["spec"].get("devices") or []}


def test_an_xid_on_a_dynamic_mig_gpu_taints_its_placements(tmp_path: Path, h100_driver_root: Path) -> None:
    node = start_node(tmp_path, h100_driver_root)
    node.preparer.reconcile()
    ref = node.add(claim(str(uuid.uuid4()), [IN_USE]))
    asyncio.run(prepare_claim(node.preparer, ref))
    (inst,) = node.live()
    gpu0, gpu1 = node.inventory.gpus[0], node.inventory.gpus[1]
    catalog = node.preparer.planner.catalog
    health = HealthNode(
        HealthConfig(enabled=False),
        DRIVER,
        catalog,
        tmp_path / "plugin",
        CollectorRegistry(),
        None,
        made_instances=node.preparer.instances.made_instances,
    )
    driver = GpuDriver(DRIVER, NODE, catalog, node.preparer, health.manager)
    mine = [n for n in _published(driver) if n.startswith(f"{gpu0.device_name}-mig-")]
    others = [n for n in _published(driver) if n.startswith(f"{gpu1.device_name}-mig-")]
    assert len(mine) == 18 and IN_USE in mine

    # Attributed by NVML to the claim's GPU / compute instance: that placement only.
    assert health.manager.handle(
        Observation(gpu0.uuid, Seen.EVENT, EventKind.XID, 74, inst.gi_id, inst.ci_id)
    )
    published = _published(driver)
    assert [n for n in published if published[n].get("taints")] == [IN_USE]
    assert published[IN_USE]["taints"][0]["value"] == "xid-74"

    # On the GPU (no instance named): every placement of that GPU, no other GPU's.
    assert health.manager.handle(Observation(gpu0.uuid, Seen.EVENT, EventKind.XID, 79))
    published = _published(driver)
    tainted = {n: d["taints"] for n, d in published.items() if d.get("taints")}
    assert sorted(tainted) == sorted(mine)
    assert all(t[0]["key"] == KEY and t[0]["effect"] == Effect.NO_EXECUTE.api for t in tainted.values())
    assert not any(published[n].get("taints") for n in others)

    verdicts = {h.device_name: h for h in driver.device_health()}
    assert verdicts[IN_USE].health is Health.UNHEALTHY and "XID 79" in verdicts[IN_USE].message
    assert all(verdicts[n].health is Health.UNHEALTHY for n in mine)
    assert all(verdicts[n].health is Health.HEALTHY for n in others)

    # The claim's status says its device is unhealthy.
    record = node.checkpoint.get(ref.uid)
    assert record is not None
    writer = ClaimStatusWriter(None, DRIVER, catalog, health.manager, lambda: [])  # type: ignore[arg-type]
    body = writer.body(ref.namespace, ref.name, ref.uid, record.status_devices())
    (entry,) = body["status"]["devices"]
    assert entry["device"] == IN_USE
    assert entry["data"] == {
        "uuid": inst.uuid,
        "productName": gpu0.product_name,
        "index": gpu0.index,
        "minor": gpu0.minor,
        "migProfile": "3g.40gb",
        "parentUUID": gpu0.uuid,
    }
    healthy = {c["type"]: c for c in entry["conditions"]}["Healthy"]
    assert healthy["status"] == "False" and "XID 79" in healthy["message"]
