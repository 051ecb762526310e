"""status.devices of prepared claims: device data, Ready, and Healthy following the monitor."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from fake_kube import until
from prometheus_client import CollectorRegistry
from simnode.fake import discover_node

from dra_gpu.health.claim_status import WRITES_IN_FLIGHT, ClaimStatusWriter
from dra_gpu.health.classification import Classifier, EventKind
from dra_gpu.health.manager import HealthManager
from dra_gpu.health.monitor import Observation, Seen
from dra_gpu.health.taint_book import TaintBook
from dra_gpu.kube.api import KubeError
from dra_gpu.node.catalog import DeviceCatalog

DRIVER = "gpu.dra-gpu.io"


class RecordingKube:
    def __init__(self, fail: list[int] | None = None) -> None:
        self.applied: list[tuple[str, str, dict[str, Any]]] = []
        self.fail = fail or []
        self.sent = 0
        self.gate: asyncio.Event | None = None  # set: answers wait for it (a slow apiserver)

    async def apply_claim_status(
        self, namespace: str, name: str, body: dict[str, Any], field_manager: str
    ) -> dict[str, Any]:
        assert field_manager == DRIVER
        self.sent += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise KubeError(self.fail.pop(0), "injected")
        self.applied.append((namespace, name, body))
        return body


def one_gpu_writer(kube: RecordingKube, **kwargs: Any) -> tuple[ClaimStatusWriter, list[dict[str, Any]]]:
    """A writer for hgx-2x4 without a health monitor, and the devices of a one-GPU claim."""
    inv = discover_node("node-a", "hgx-2x4")
    devices = [{"deviceName": inv.gpus[0].device_name, "poolName": "node-a"}]
    writer = ClaimStatusWriter(
        kube, DRIVER, DeviceCatalog.build(inv), None, lambda: [("ns", "c", "uid-1", devices)], **kwargs
    )  # type: ignore[arg-type]
    return writer, devices


def test_status_follows_prepare_and_health(tmp_path: Path) -> None:
    async def body() -> None:
        inv = discover_node("node-a", "dgx-a100-mig")
        gpu = inv.gpus[1]
        mig = gpu.mig_devices[2]
        catalog = DeviceCatalog.build(inv)
        manager = HealthManager(
            catalog,
            f"{DRIVER}/unhealthy",
            TaintBook(None, catalog.names()),
            Classifier(),
            CollectorRegistry(),
        )
        kube = RecordingKube(fail=[503])  # a transient failure is retried
        devices = [{"deviceName": gpu.mig_device_name(mig), "poolName": "node-a", "shareId": "s-1"}]
        writer = ClaimStatusWriter(
            kube,  # type: ignore[arg-type]
            DRIVER,
            catalog,
            manager,
            lambda: [("ns", "c", "uid-1", devices)],
        )
        writer.prepared("ns", "c", "uid-1", devices)
        await until(lambda: bool(kube.applied))  # after its delay and one retry
        ((ns, name, applied),) = kube.applied
        (entry,) = applied["status"]["devices"]
        assert (ns, name, applied["metadata"]["uid"]) == ("ns", "c", "uid-1")
        assert entry["driver"] == DRIVER and entry["shareID"] == "s-1"
        assert entry["data"] == {
            "uuid": mig.uuid,
            "productName": gpu.product_name,
            "index": gpu.index,
            "minor": gpu.minor,
            "migProfile": mig.profile,
            "parentUUID": gpu.uuid,
        }
        assert [(c["type"], c["status"]) for c in entry["conditions"]] == [
            ("Ready", "True"),
            ("Healthy", "True"),
        ]
        await writer.sync()
        assert len(kube.applied) == 1  # nothing changed: nothing written
        manager.handle(Observation(gpu.uuid, Seen.EVENT, EventKind.XID, 48, mig.gpu_instance_id))
        await writer.sync()
        healthy = kube.applied[-1][2]["status"]["devices"][0]["conditions"][1]
        assert healthy["status"] == "False" and healthy["reason"] == "DeviceUnhealthy"
        assert "XID 48" in healthy["message"]
        kube.fail = [403]
        writer.unprepared("uid-1")
        await writer.sync()  # no permission: logged, not raised
        await writer.close()

    asyncio.run(body())


def test_a_claim_unprepared_before_its_status_is_due_writes_nothing() -> None:
    async def body() -> None:
        kube = RecordingKube()
        writer, devices = one_gpu_writer(kube, prepared_delay=0.2)
        writer.prepared("ns", "brief", "uid-1", devices)
        writer.prepared("ns", "stays", "uid-2", devices)
        await asyncio.sleep(0.05)
        assert not kube.applied  # not yet: the prepares of a burst go first
        writer.unprepared("uid-1")
        with writer.preparing():  # another prepare in flight past the delay: still waiting
            await asyncio.sleep(0.4)
            assert not kube.applied
        await until(lambda: bool(kube.applied))
        assert [name for _, name, _ in kube.applied] == ["stays"]
        await writer.close()

    asyncio.run(body())


def test_statuses_wait_for_a_quiet_moment_not_a_gap_between_two_calls() -> None:
    """A burst's calls follow each other with gaps of a millisecond: no write lands in one."""

    async def body() -> None:
        kube = RecordingKube()
        writer, devices = one_gpu_writer(kube, prepared_delay=0.01)
        writer.prepared("ns", "c", "uid-1", devices)
        for _ in range(30):  # 0.3 s of calls, each 5 ms, 5 ms apart
            with writer.preparing():
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.005)
        assert not kube.sent
        await until(lambda: kube.sent > 0, timeout=2)  # once nothing was in flight for a while
        assert [name for _, name, _ in kube.applied] == ["c"]
        await writer.close()

    asyncio.run(body())


def test_a_write_on_the_wire_is_not_cut_off_by_the_unprepare() -> None:
    """Cancelling a request in flight closes its connection (a TLS handshake for the next one)."""

    async def body() -> None:
        kube = RecordingKube()
        kube.gate = asyncio.Event()
        writer, devices = one_gpu_writer(kube, prepared_delay=0.0)
        writer.prepared("ns", "c", "uid-1", devices)
        await until(lambda: kube.sent > 0)
        writer.unprepared("uid-1")  # while its status write waits for the apiserver
        kube.gate.set()
        await asyncio.sleep(0.05)
        assert [name for _, name, _ in kube.applied] == ["c"]  # it landed, not cancelled
        assert not writer._written and not writer._since  # and the claim is forgotten
        await writer.close()

    asyncio.run(body())


def test_a_burst_of_statuses_goes_out_a_few_at_a_time_and_all_land() -> None:
    """Each request in flight holds a connection of the client's pool, kept open after the burst
    with its TLS buffers: a burst's statuses queue on a few instead of opening all."""

    async def body() -> None:
        kube = RecordingKube()
        kube.gate = asyncio.Event()
        writer, devices = one_gpu_writer(kube, prepared_delay=0.0)
        for i in range(20):
            writer.prepared("ns", f"c{i}", f"uid-{i}", devices)
        await until(lambda: kube.sent == WRITES_IN_FLIGHT)
        await asyncio.sleep(0.05)
        assert kube.sent == WRITES_IN_FLIGHT  # the others wait for the apiserver's answers
        writer.unprepared("uid-19")  # not on the wire yet: it never goes
        kube.gate.set()
        await until(lambda: len(kube.applied) == 19)
        assert sorted(name for _, name, _ in kube.applied) == sorted(f"c{i}" for i in range(19))
        await writer.close()

    asyncio.run(body())


def test_a_status_write_that_falls_in_an_outage_lands_after_it() -> None:
    async def body() -> None:
        kube = RecordingKube(fail=[503] * 8)  # the apiserver answers 503 for a while
        writer, devices = one_gpu_writer(kube, retry_initial=0.01)
        writer.prepared("ns", "c", "uid-1", devices)
        await until(lambda: bool(kube.applied))
        assert not kube.fail and [name for _, name, _ in kube.applied] == ["c"]
        await writer.close()

    asyncio.run(body())


def test_a_memory_share_says_whether_the_driver_or_only_mps_holds_it_to_its_size() -> None:
    writer, _ = one_gpu_writer(RecordingKube())
    gpu = writer.catalog.gpus[0].device_name
    shares = [
        {
            "deviceName": gpu,
            "poolName": "node-a",
            "shareId": share,
            "memoryLimit": {"enforcedBy": by, "reason": reason},
        }
        for share, by, reason in (
            ("s1", "driver", "NVIDIA's hook sets it"),
            ("s2", "cooperative", "the node runs cgroup v1"),
        )
    ]
    entries = writer.body("ns", "c", "uid-1", shares)["status"]["devices"]
    by_share = {e["shareID"]: e for e in entries}
    limits = {
        s: next(c for c in e["conditions"] if c["type"] == "MemoryLimitEnforced") for s, e in by_share.items()
    }
    assert (limits["s1"]["status"], limits["s1"]["reason"]) == ("True", "DriverMemoryLimit")
    assert (limits["s2"]["status"], limits["s2"]["reason"]) == ("False", "CooperativeMpsLimit")
    assert "cgroup v1" in limits["s2"]["message"] and "cooperative" not in limits["s1"]["message"]
    assert by_share["s1"]["data"]["memoryLimitEnforcedBy"] == "driver"
    assert by_share["s2"]["data"]["memoryLimitEnforcedBy"] == "cooperative"
    # A device that is no share gets no such condition.
    (plain,) = writer.body("ns", "c", "uid-1", [{"deviceName": gpu, "poolName": "node-a"}])["status"][
        "devices"
    ]
    assert [c["type"] for c in plain["conditions"]] == ["Ready", "Healthy"]


class PatchRefusingKube(RecordingKube):
    """An apiserver that refuses patches of this claim's status as 1.37.2 does for a claim whose
    allocation holds an opaque config (its message, verbatim), and takes updates of the claim."""

    REFUSAL = (
        'ResourceClaim.resource.k8s.io "c" is invalid: status.allocation: Invalid value: null: '
        "field cannot be modified once set"
    )

    def __init__(self, claim: dict[str, Any], conflicts: int = 0) -> None:
        super().__init__()
        self.claim = claim
        self.conflicts = conflicts
        self.updated: list[dict[str, Any]] = []

    async def apply_claim_status(
        self, namespace: str, name: str, body: dict[str, Any], field_manager: str
    ) -> dict[str, Any]:
        raise KubeError(422, self.REFUSAL)

    async def get_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        return json.loads(json.dumps(self.claim))

    async def replace_claim_status(self, namespace: str, name: str, claim: dict[str, Any]) -> dict[str, Any]:
        if self.conflicts:
            self.conflicts -= 1
            raise KubeError(409, "the object has been modified")
        self.updated.append(claim)
        return claim


def test_a_claim_whose_status_cannot_be_patched_is_updated_keeping_other_entries() -> None:
    other = {"driver": "nic.example.com", "pool": "node-a", "device": "nic-0"}
    stale = {"driver": DRIVER, "pool": "node-a", "device": "gpu-old"}
    elsewhere = {"driver": DRIVER, "pool": "node-b", "device": "gpu-x"}
    claim = {
        "metadata": {"name": "c", "namespace": "ns", "uid": "uid-1", "resourceVersion": "7"},
        "status": {"allocation": {"devices": {"config": [{}]}}, "devices": [other, stale, elsewhere]},
    }

    async def body() -> None:
        kube = PatchRefusingKube(claim, conflicts=1)  # a concurrent writer: the 409 is retried
        writer, devices = one_gpu_writer(kube, retry_initial=0.01)  # type: ignore[arg-type]
        writer.prepared("ns", "c", "uid-1", devices)
        await until(lambda: bool(kube.updated))
        (updated,) = kube.updated
        entries = updated["status"]["devices"]
        # Another driver's entry and this driver's of another node kept, in order; ours replaced.
        assert entries[:2] == [other, elsewhere]
        assert [e["device"] for e in entries[2:]] == [devices[0]["deviceName"]]
        assert updated["metadata"]["resourceVersion"] == "7"  # the update is guarded by it
        assert updated["status"]["allocation"] == claim["status"]["allocation"]

        gone = PatchRefusingKube({**claim, "metadata": {**claim["metadata"], "uid": "uid-2"}})
        writer, devices = one_gpu_writer(gone)  # type: ignore[arg-type]
        writer.prepared("ns", "c", "uid-1", devices)
        await asyncio.sleep(0.6)
        assert not gone.updated  # a claim re-created under the name is not ours to write

    asyncio.run(body())
