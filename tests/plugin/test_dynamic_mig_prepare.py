"""Dynamic MIG prepare/unprepare on the simulated H100 node: instances made at the allocated
placement and destroyed at unprepare, every step in the checkpoint, failures that leave nothing
behind, and the start-up rollback of half-made instances and orphans."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import pynvml
import pytest
from simnode.fake_nvml import FakeNvml
from simnode.profiles import load_profile

from dra_gpu.discovery import discover
from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.model.inventory import Inventory
from dra_gpu.node.catalog import DeviceCatalog
from dra_gpu.plugin.cdi import CdiSpecs
from dra_gpu.plugin.checkpoint import COMPLETED, STARTED, Checkpoint
from dra_gpu.plugin.device_nodes import DeviceNodes
from dra_gpu.plugin.driver_files import DriverFiles
from dra_gpu.plugin.mig_lifecycle import MigInstances
from dra_gpu.plugin.plan import PrepareError
from dra_gpu.plugin.prepare import Preparer
from dra_gpu.plugin.record import MIG_GPU_INSTANCE, MIG_PLANNED
from plugin.conftest import DRIVER, NODE, ClaimStore, claim, prepare_claim, validate_cdi
from tests.driver_root import make_root
from tests.fake_node import create_simulated

PROFILE = "dgx-h100-mig"
GPU0 = "gpu-0000-18-00-0"


@dataclass
class Node:
    root: Path
    nv: FakeNvml
    inventory: Inventory
    claims: ClaimStore
    checkpoint: Checkpoint
    cdi: CdiSpecs
    preparer: Preparer
    driver_root: Path

    @property
    def gpu0_uuid(self) -> str:
        return self.inventory.gpus[0].uuid

    def live(self, gpu_uuid: str | None = None) -> list:
        return self.nv.mig.gpus[gpu_uuid or self.gpu0_uuid]

    def add(self, c: dict) -> ClaimRef:
        m = c["metadata"]
        self.claims[(m["namespace"], m["name"])] = c
        return ClaimRef(m["namespace"], m["uid"], m["name"])

    def restart(self) -> Node:
        return start_node(self.root, self.driver_root, self.claims)


def start_node(
    root: Path, driver_root: Path, claims: ClaimStore | None = None, dynamic_mig: bool = True
) -> Node:
    """A plugin process on the node: the fake reads the MIG state the last one left."""
    dev_root = root / "devroot"
    nv = FakeNvml(load_profile(PROFILE), dev_root)
    inventory = discover(nv, NODE, lambda _bus: None, dynamic_mig=dynamic_mig)
    create_simulated(inventory, dev_root)
    checkpoint = Checkpoint(root / "plugin" / "checkpoint.json", boot_id="boot-1")
    cdi = CdiSpecs(root / "cdi", DRIVER)
    claims = claims if claims is not None else ClaimStore()
    preparer = Preparer(
        DRIVER,
        NODE,
        DeviceCatalog.build(inventory),
        checkpoint,
        cdi,
        DeviceNodes(dev_root),
        claims,
        DriverFiles(driver_root, inventory.driver_version),
        mig=MigInstances(nv),
    )
    return Node(root, nv, inventory, claims, checkpoint, cdi, preparer, driver_root)


@pytest.fixture(scope="module")
def h100_driver_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    version = load_profile(PROFILE).driver_version
    return make_root(tmp_path_factory.mktemp("driver") / "root", version)


@pytest.fixture
def node(tmp_path: Path, h100_driver_root: Path) -> Node:
    n = start_node(tmp_path, h100_driver_root)
    assert n.preparer.reconcile() == {"rolledBack": 0, "rebuilt": 0, "removed": 0, "orphansDestroyed": 0}
    return n


def uid() -> str:
    return str(uuid.uuid4())


def test_prepare_makes_the_instance_and_unprepare_destroys_it(node: Node) -> None:
    c = claim(uid(), [f"{GPU0}-mig-3g40gb-4"])
    ref = node.add(c)
    asyncio.run(prepare_claim(node.preparer, ref))
    (inst,) = node.live()
    assert (inst.profile, inst.placement, inst.ci_id) == ("3g.40gb", 4, 0)
    spec = json.loads(node.cdi.path(ref.uid).read_text())
    validate_cdi(spec)
    assert f"DRA_GPU_VISIBLE_DEVICES={inst.uuid}" in spec["containerEdits"]["env"]
    nodes = spec["devices"][0]["containerEdits"]["deviceNodes"]
    assert nodes[0]["path"] == "/dev/nvidia0"
    caps = [n for n in nodes if n["path"].startswith("/dev/nvidia-caps/")]
    # By number: the nodes the (simulated) driver made for the instance, no host path needed.
    host = [node.root / "devroot" / n["path"].lstrip("/") for n in caps]
    assert len(caps) == 2 and all("hostPath" not in n and n["type"] == "c" for n in caps)
    assert [(n["major"], n["minor"]) for n in caps] == [
        (os.major(os.stat(h).st_rdev), os.minor(os.stat(h).st_rdev)) for h in host
    ]
    rec = node.checkpoint.get(ref.uid)
    assert rec is not None and rec.state == COMPLETED
    (m,) = rec.mig_instances
    assert m["step"] == "ready" and m["uuid"] == inst.uuid and m["giId"] == inst.gi_id
    # Prepared again: same answer, nothing new made.
    asyncio.run(prepare_claim(node.preparer, ref))
    assert len(node.live()) == 1

    asyncio.run(node.preparer.unprepare(ref))
    assert node.live() == []
    assert not node.cdi.path(ref.uid).exists() and not node.checkpoint.has(ref.uid)
    assert not any(h.exists() for h in host)


def test_two_3g_claims_share_a_gpu(node: Node) -> None:
    refs = [node.add(claim(uid(), [f"{GPU0}-mig-3g40gb-{s}"])) for s in (0, 4)]
    for r in refs:
        asyncio.run(prepare_claim(node.preparer, r))
    assert sorted(i.placement for i in node.live()) == [0, 4]
    assert len({i.uuid for i in node.live()}) == 2


def test_a_failed_step_fails_prepare_and_leaves_nothing(node: Node) -> None:
    ref = node.add(claim(uid(), [f"{GPU0}-mig-2g20gb-2"]))
    node.nv.fail_next("nvmlGpuInstanceCreateComputeInstance", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(
        PrepareError, match=r"compute instance.*2g\.20gb.*Unknown Error.*nothing was left behind"
    ):
        asyncio.run(prepare_claim(node.preparer, ref))
    assert node.live() == [] and not node.checkpoint.has(ref.uid) and not node.cdi.path(ref.uid).exists()
    asyncio.run(prepare_claim(node.preparer, ref))  # the kubelet's retry succeeds
    assert len(node.live()) == 1


def test_a_placement_taken_outside_the_driver_is_named(node: Node) -> None:
    gpu = load_profile(PROFILE).gpus[0]
    outside = node.nv.mig.create_gpu_instance(gpu, 19, 5, 1)  # someone ran nvidia-smi mig -cgi
    ref = node.add(claim(uid(), [f"{GPU0}-mig-3g40gb-4"]))
    with pytest.raises(
        PrepareError,
        match=rf"3g\.40gb GPU instance at memory slices 4-7.*held by GPU instance {outside.gi_id}",
    ):
        asyncio.run(prepare_claim(node.preparer, ref))
    assert [i.gi_id for i in node.live()] == [outside.gi_id]
    assert not node.checkpoint.has(ref.uid)


def _crash_state(node: Node, step: str) -> tuple[ClaimRef, int]:
    """What a plugin killed after NVML made the GPU instance leaves: the instance, and a record
    at `planned` (killed before recording the ID) or at `gpu-instance`."""
    gpu = load_profile(PROFILE).gpus[0]
    ref = node.add(claim(uid(), [f"{GPU0}-mig-3g40gb-0"]))
    inst = node.nv.mig.create_gpu_instance(gpu, 9, 0, 4)
    mig = {
        "device": f"{GPU0}-mig-3g40gb-0",
        "parentUUID": gpu.uuid,
        "profileId": 9,
        "start": 0,
        "size": 4,
        "step": step,
    }
    if step == MIG_GPU_INSTANCE:
        mig["giId"] = inst.gi_id
    node.checkpoint.put(
        ref.uid,
        {
            "state": STARTED,
            "namespace": ref.namespace,
            "name": ref.name,
            "devices": [],
            "migInstances": [mig],
        },
    )
    return ref, inst.gi_id


@pytest.mark.parametrize("step", [MIG_PLANNED, MIG_GPU_INSTANCE])
def test_restart_rolls_back_an_instance_made_halfway(node: Node, step: str) -> None:
    ref, _ = _crash_state(node, step)
    after = node.restart()
    counts = after.preparer.reconcile()
    assert counts["rolledBack"] == 1 and counts["orphansDestroyed"] == 0
    assert after.live() == [] and not after.checkpoint.has(ref.uid)
    asyncio.run(prepare_claim(after.preparer, ref))  # the kubelet's retry gets the device
    assert [i.placement for i in after.live()] == [0]


def test_a_kept_claims_instance_survives_restart_and_orphans_go_unless_busy(node: Node) -> None:
    ref = node.add(claim(uid(), [f"{GPU0}-mig-1g10gb-6"]))
    asyncio.run(prepare_claim(node.preparer, ref))
    gpu = load_profile(PROFILE).gpus[0]
    idle = node.nv.mig.create_gpu_instance(gpu, 19, 0, 1)
    busy = node.nv.mig.create_gpu_instance(gpu, 19, 1, 1)
    node.nv.mig.create_compute_instance(gpu, busy, 1)
    busy.processes.append(4242)
    node.nv.mig.save()
    after = node.restart()
    assert after.preparer.reconcile()["orphansDestroyed"] == 1
    left = sorted(i.placement for i in after.live())
    assert left == [1, 6]  # the busy orphan (logged) and the claim's instance
    assert idle.gi_id not in {i.gi_id for i in after.live()}


def test_an_instance_in_use_is_not_destroyed_and_the_claim_stays(node: Node) -> None:
    ref = node.add(claim(uid(), [f"{GPU0}-mig-1g10gb-0"]))
    asyncio.run(prepare_claim(node.preparer, ref))
    (inst,) = node.live()
    inst.processes.append(777)  # the container is still running on it
    with pytest.raises(
        PrepareError, match=r"cannot destroy GPU instance 1 \(profile 19 at 0\): NVML: .*InUse"
    ):
        asyncio.run(node.preparer.unprepare(ref))
    assert node.checkpoint.has(ref.uid) and node.cdi.path(ref.uid).exists()
    inst.processes.clear()
    asyncio.run(node.preparer.unprepare(ref))  # the kubelet's retry
    assert node.live() == [] and not node.checkpoint.has(ref.uid)


@pytest.mark.usefixtures("enabled_failpoints")
def test_failpoints_and_simulated_failures_parse_strictly(monkeypatch: pytest.MonkeyPatch) -> None:
    from simnode.fake_nvml import parse_failures

    from dra_gpu.common import failpoints

    monkeypatch.setenv(failpoints.ENV, "a=error")
    with pytest.raises(failpoints.FailpointError):
        failpoints.hit("a")
    failpoints.hit("b")  # not set: nothing
    monkeypatch.setenv(failpoints.ENV, "a=explode")
    with pytest.raises(ValueError, match="action must be one of kill, error"):
        failpoints.hit("a")
    assert parse_failures("nvmlGpuInstanceDestroy=InUse") == {
        "nvmlGpuInstanceDestroy": pynvml.NVML_ERROR_IN_USE
    }
    with pytest.raises(ValueError, match="DRA_GPU_SIM_NVML_FAIL"):
        parse_failures("nvmlGpuInstanceDestroy=Oops")


def test_instances_made_at_binding_are_used_by_prepare_and_kept_across_restarts(node: Node) -> None:
    c = claim(uid(), [f"{GPU0}-mig-3g40gb-4"])
    ref = node.add(c)
    made = asyncio.run(node.preparer.bind(ref, c))
    (inst,) = node.live()
    assert made[f"{GPU0}-mig-3g40gb-4"].uuid == inst.uuid
    rec = node.checkpoint.get(ref.uid)
    assert rec is not None and rec.state == "bound" and not node.cdi.path(ref.uid).exists()
    assert asyncio.run(node.preparer.bind(ref, c)) == made  # idempotent: nothing new
    after = node.restart()
    assert after.preparer.reconcile()["rolledBack"] == 0  # a bound claim is kept
    asyncio.run(prepare_claim(after.preparer, ref))
    (same,) = after.live()
    assert same.uuid == inst.uuid
    spec = json.loads(after.cdi.path(ref.uid).read_text())
    assert f"DRA_GPU_VISIBLE_DEVICES={inst.uuid}" in spec["containerEdits"]["env"]
    rec = after.checkpoint.get(ref.uid)
    assert rec is not None and rec.state == COMPLETED


def test_a_binding_failure_leaves_nothing_and_a_given_up_allocation_is_swept(node: Node) -> None:
    c = claim(uid(), [f"{GPU0}-mig-1g10gb-0"])
    ref = node.add(c)
    node.nv.fail_next("nvmlDeviceCreateGpuInstanceWithPlacement", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(PrepareError, match="nothing was left behind"):
        asyncio.run(node.preparer.bind(ref, c))
    assert node.live() == [] and not node.checkpoint.has(ref.uid)
    asyncio.run(node.preparer.bind(ref, c))
    assert len(node.live()) == 1
    # The scheduler gave the allocation up (binding timed out): the sweeper undoes it.
    del c["status"]["allocation"]
    clock = iter([0.0, 0.0, 100.0, 100.0])
    assert asyncio.run(node.preparer.sweep(10, now=lambda: next(clock))) == []
    assert asyncio.run(node.preparer.sweep(10, now=lambda: next(clock))) == [ref]
    assert node.live() == [] and not node.checkpoint.has(ref.uid)


class _Kube:
    """get_claim / replace_claim_status over the test's claim store, with resourceVersions."""

    def __init__(self, claims: ClaimStore) -> None:
        self.claims = claims
        self.patches: list[dict] = []

    async def get_claim(self, namespace: str, name: str) -> dict | None:
        return await self.claims.get_claim(namespace, name)

    async def replace_claim_status(self, namespace: str, name: str, patch: dict) -> dict:
        stored = self.claims[(namespace, name)]
        assert patch["metadata"]["resourceVersion"] == stored["metadata"]["resourceVersion"]
        stored.setdefault("status", {})["devices"] = patch["status"]["devices"]
        stored["metadata"]["resourceVersion"] = str(int(stored["metadata"]["resourceVersion"]) + 1)
        self.patches.append(patch)
        return stored


def _waiting_claim(devices: list[str]) -> dict:
    c = claim(uid(), devices)
    c["metadata"]["resourceVersion"] = "1"
    for r in c["status"]["allocation"]["devices"]["results"]:
        r["bindingConditions"] = ["MigInstanceReady"]
        r["bindingFailureConditions"] = ["MigInstanceFailed"]
    return c


def test_the_binder_reports_ready_or_failed_in_the_claims_device_status(node: Node) -> None:
    from dra_gpu.plugin.mig_binding import MigBinder

    kube = _Kube(node.claims)
    binder = MigBinder(DRIVER, NODE, node.preparer, kube)  # type: ignore[arg-type]
    ok = _waiting_claim([f"{GPU0}-mig-2g20gb-0"])
    ref = node.add(ok)
    assert binder.waiting(ok) == [f"{GPU0}-mig-2g20gb-0"]
    asyncio.run(binder._bind(ref, ok))
    (status,) = node.claims[(ref.namespace, ref.name)]["status"]["devices"]
    (cond,) = status["conditions"]
    (inst,) = node.live()
    assert (cond["type"], cond["status"], cond["message"]) == (
        "MigInstanceReady",
        "True",
        f"MIG device {inst.uuid}",
    )
    assert binder.waiting(node.claims[(ref.namespace, ref.name)]) == []

    bad = _waiting_claim([f"{GPU0}-mig-2g20gb-0"])  # the same placement: taken by the first claim
    binder.departing_wait = 0  # (which is not going away)
    ref2 = node.add(bad)
    asyncio.run(binder._bind(ref2, bad))
    (status,) = node.claims[(ref2.namespace, ref2.name)]["status"]["devices"]
    (cond,) = status["conditions"]
    assert (cond["type"], cond["reason"]) == ("MigInstanceFailed", "InstanceCreationFailed")
    assert "already prepared for claim" in cond["message"]
    assert len(node.live()) == 1


def test_the_binder_waits_for_a_departing_claims_instance(node: Node) -> None:
    """The scheduler frees a deleted claim's devices before the kubelet unprepares it: the next
    claim of that placement waits for the instance to go instead of failing its binding."""
    from dra_gpu.plugin.mig_binding import MigBinder

    old = claim(uid(), [f"{GPU0}-mig-3g40gb-0"])
    old_ref = node.add(old)
    asyncio.run(prepare_claim(node.preparer, old_ref))
    new = _waiting_claim([f"{GPU0}-mig-1g10gb-0"])  # overlaps the 3g.40gb at 0
    ref = node.add(new)
    binder = MigBinder(DRIVER, NODE, node.preparer, _Kube(node.claims))  # type: ignore[arg-type]

    async def scenario() -> None:
        binding = asyncio.create_task(binder._bind(ref, new))
        await asyncio.sleep(1.5)
        assert not binding.done()
        await node.preparer.unprepare(old_ref)  # the kubelet's unprepare, late
        await binding

    asyncio.run(scenario())
    (status,) = node.claims[(ref.namespace, ref.name)]["status"]["devices"]
    assert status["conditions"][0]["type"] == "MigInstanceReady"
    assert [(i.profile, i.placement) for i in node.live()] == [("1g.10gb", 0)]


def test_the_binder_takes_over_a_placement_whose_claim_is_gone(node: Node) -> None:
    """The old claim is gone from the apiserver but its unprepare never came (lost while the
    plugin was down): the binder destroys its instance at once instead of waiting for the
    kubelet until its departing wait runs out."""
    from dra_gpu.plugin.mig_binding import MigBinder

    old = claim(uid(), [f"{GPU0}-mig-3g40gb-0"], name="finished")
    old_ref = node.add(old)
    asyncio.run(prepare_claim(node.preparer, old_ref))
    del node.claims[(old_ref.namespace, old_ref.name)]
    new = _waiting_claim([f"{GPU0}-mig-1g10gb-0"])  # overlaps the 3g.40gb at 0
    ref = node.add(new)
    binder = MigBinder(DRIVER, NODE, node.preparer, _Kube(node.claims))  # type: ignore[arg-type]
    binder.departing_wait = 0  # no waiting: only the release lets the binding through

    asyncio.run(binder._bind(ref, new))
    (status,) = node.claims[(ref.namespace, ref.name)]["status"]["devices"]
    assert status["conditions"][0]["type"] == "MigInstanceReady"
    assert [(i.profile, i.placement) for i in node.live()] == [("1g.10gb", 0)]
    assert node.checkpoint.get(old_ref.uid) is None


def test_the_whole_gpu_of_a_dynamic_mig_gpu_is_never_prepared(node: Node) -> None:
    """A MIG-mode GPU runs no CUDA work as a whole: an allocation naming it (the slices never
    offer it) is refused, and nothing is made or written."""
    ref = node.add(claim(uid(), [GPU0]))
    with pytest.raises(PrepareError, match=GPU0):
        asyncio.run(prepare_claim(node.preparer, ref))
    assert node.live() == [] and not node.checkpoint.has(ref.uid) and not node.cdi.path(ref.uid).exists()


def test_an_instance_recorded_under_dynamic_mig_is_destroyed_after_it_was_turned_off(node: Node) -> None:
    """An operator turns dynamic MIG off with a claim prepared: the restarted plugin still
    destroys that claim's instance at unprepare (it had failed there for ever)."""
    ref = node.add(claim(uid(), [f"{GPU0}-mig-3g40gb-4"]))
    asyncio.run(prepare_claim(node.preparer, ref))
    assert len(node.live()) == 1
    off = start_node(node.root, node.driver_root, node.claims, dynamic_mig=False)
    off.preparer.reconcile()
    asyncio.run(off.preparer.unprepare(ref))
    assert off.live() == [] and not off.checkpoint.has(ref.uid) and not off.cdi.path(ref.uid).exists()
