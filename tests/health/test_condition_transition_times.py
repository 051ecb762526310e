"""The `lastTransitionTime` of the conditions the driver writes, with Kubernetes' meaning: set on
every condition, RFC 3339, moved when the condition's status changes and only then (a condition
written again unchanged keeps it), per device and condition type. The claim status writer's
Ready/Healthy, and dynamic MIG's binding condition, which must not be older than the allocation
it answers even when the node's clock is behind the apiserver's."""

from __future__ import annotations

import asyncio
import datetime
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from simnode.fake import discover_node

from dra_gpu.health.claim_status import ClaimStatusWriter
from dra_gpu.health.classification import Classifier, EventKind
from dra_gpu.health.manager import HealthManager
from dra_gpu.health.monitor import Observation, Seen
from dra_gpu.health.taint_book import TaintBook
from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.node.catalog import DeviceCatalog
from dra_gpu.node.dynamic_mig import READY_CONDITION
from dra_gpu.plugin.mig_binding import MigBinder

DRIVER = "gpu.dra-gpu.io"
NODE = "node-a"


def parsed(stamp: str) -> datetime.datetime:
    """An RFC 3339 time as metav1.Time serializes it (UTC, seconds, `Z`); ValueError otherwise."""
    when = datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")
    return when.replace(tzinfo=datetime.UTC)


class Clock:
    """time.time() (and time.gmtime() of now) as the test sets it."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock(1_750_000_000.0)
    real_gmtime = time.gmtime
    monkeypatch.setattr(time, "time", c)
    monkeypatch.setattr(time, "gmtime", lambda secs=None: real_gmtime(c() if secs is None else secs))
    return c


def health_writer() -> tuple[ClaimStatusWriter, HealthManager, Any, list[dict[str, Any]]]:
    inv = discover_node(NODE, "hgx-2x4")
    catalog = DeviceCatalog.build(inv)
    manager = HealthManager(
        catalog, f"{DRIVER}/unhealthy", TaintBook(None, catalog.names()), Classifier(), CollectorRegistry()
    )
    gpu = inv.gpus[0]
    devices = [{"deviceName": gpu.device_name, "poolName": NODE}]
    writer = ClaimStatusWriter(None, DRIVER, catalog, manager, lambda: [])  # type: ignore[arg-type]
    return writer, manager, gpu, devices


def conditions(
    writer: ClaimStatusWriter, devices: list[dict[str, Any]], uid: str = "uid-1"
) -> dict[str, Any]:
    (entry,) = writer.body("ns", "c", uid, devices)["status"]["devices"]
    return {c["type"]: c for c in entry["conditions"]}


def test_claim_conditions_move_their_transition_time_only_when_their_status_changes(clock: Clock) -> None:
    writer, manager, gpu, devices = health_writer()
    first = conditions(writer, devices)
    prepared_at = parsed(first["Ready"]["lastTransitionTime"])
    assert prepared_at == datetime.datetime.fromtimestamp(clock.now, datetime.UTC)
    assert parsed(first["Healthy"]["lastTransitionTime"]) == prepared_at

    clock.now += 60  # written again (a sync, another device's health change): nothing moves
    assert conditions(writer, devices) == first

    clock.now += 60
    manager.handle(Observation(gpu.uuid, Seen.EVENT, EventKind.XID, 79, None))
    sick = conditions(writer, devices)
    assert sick["Healthy"]["status"] == "False"
    assert parsed(sick["Healthy"]["lastTransitionTime"]) == prepared_at + datetime.timedelta(seconds=120)
    assert sick["Ready"] == first["Ready"]  # a condition whose status stayed keeps its time

    clock.now += 60
    assert conditions(writer, devices)["Healthy"] == sick["Healthy"]  # still unhealthy: unchanged


def test_a_claim_prepared_again_after_its_unprepare_gets_a_new_transition_time(clock: Clock) -> None:
    writer, _, _, devices = health_writer()
    before = conditions(writer, devices)["Ready"]["lastTransitionTime"]
    other = conditions(writer, devices, uid="uid-2")["Ready"]["lastTransitionTime"]
    clock.now += 30
    writer.unprepared("uid-1")
    assert conditions(writer, devices)["Ready"]["lastTransitionTime"] != before
    assert conditions(writer, devices, uid="uid-2")["Ready"]["lastTransitionTime"] == other  # per claim


class ClaimsKube:
    """get_claim / replace_claim_status over one stored claim, with resourceVersions."""

    def __init__(self, claim: dict[str, Any]) -> None:
        self.claim = claim

    async def get_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.claim

    async def replace_claim_status(self, namespace: str, name: str, claim: dict[str, Any]) -> dict[str, Any]:
        assert claim["metadata"]["resourceVersion"] == self.claim["metadata"]["resourceVersion"]
        self.claim["status"]["devices"] = claim["status"]["devices"]
        self.claim["metadata"]["resourceVersion"] = str(int(self.claim["metadata"]["resourceVersion"]) + 1)
        return self.claim


def waiting_claim(device: str, allocated_at: str, devices: list[dict[str, Any]]) -> dict[str, Any]:
    result = {
        "request": "gpu",
        "driver": DRIVER,
        "pool": NODE,
        "device": device,
        "bindingConditions": [READY_CONDITION],
        "bindingFailureConditions": ["MigInstanceFailed"],
    }
    return {
        "metadata": {"name": "c", "namespace": "ns", "uid": "uid-1", "resourceVersion": "1"},
        "status": {
            "allocation": {"devices": {"results": [result]}, "allocationTimestamp": allocated_at},
            "devices": devices,
        },
    }


def ready(when: str) -> dict[str, Any]:
    condition = {"type": READY_CONDITION, "status": "True", "reason": "InstanceCreated", "message": "m"}
    return {
        "driver": DRIVER,
        "pool": NODE,
        "device": "gpu-0-mig-1g10gb-0",
        "conditions": [{**condition, "lastTransitionTime": when}],
    }


@pytest.mark.parametrize("node_clock_behind_s", [0, 3600])
def test_a_binding_condition_is_never_older_than_the_allocation_it_answers(
    clock: Clock, node_clock_behind_s: int
) -> None:
    """The scheduler waits for a condition of this allocation: one older (an earlier, given-up
    allocation's) does not count. The condition written for it is no older than the allocation,
    whatever the node's clock says, so the binder sees its own answer and stops."""
    allocated = datetime.datetime.fromtimestamp(clock.now, datetime.UTC)
    clock.now -= node_clock_behind_s
    allocated_at = allocated.strftime("%Y-%m-%dT%H:%M:%SZ")
    earlier = (allocated - datetime.timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
    device = "gpu-0-mig-1g10gb-0"
    c = waiting_claim(device, allocated_at, [ready(earlier)])
    binder = MigBinder(DRIVER, NODE, None, ClaimsKube(c))  # type: ignore[arg-type]
    assert binder.waiting(c) == [device]  # the earlier allocation's condition does not count
    asyncio.run(binder._report(ClaimRef("ns", "uid-1", "c"), {device: (True, "MIG device MIG-1")}))
    (entry,) = c["status"]["devices"]
    (condition,) = entry["conditions"]
    assert condition["type"] == READY_CONDITION and condition["message"] == "MIG device MIG-1"
    assert parsed(condition["lastTransitionTime"]) >= allocated
    assert binder.waiting(c) == []
