"""The DeviceCatalog: one list of the node's devices, the same the slices publish, with each
device's GPU, kind and the health events that reach it."""

from __future__ import annotations

import pytest
from simnode.fake import discover_node

from dra_gpu.health.control import _find_gpu
from dra_gpu.health.monitor import NO_ID
from dra_gpu.node.catalog import DeviceCatalog, DeviceKind
from dra_gpu.node.slices import build_slices


@pytest.mark.parametrize(
    ("profile", "dynamic_mig", "memory_shares"),
    [
        ("hgx-2x4", False, False),
        ("mixed", False, True),
        ("dgx-a100-mig", False, False),
        ("dgx-a100-mig", False, True),
        ("dgx-h100-mig", True, False),
    ],
)
def test_the_catalog_is_what_the_slices_publish(profile: str, dynamic_mig: bool, memory_shares: bool) -> None:
    inv = discover_node("node-a", profile, dynamic_mig=dynamic_mig)
    catalog = DeviceCatalog.build(inv, memory_shares)
    published = [
        d for s in build_slices(inv, memory_shares=memory_shares) for d in s["spec"].get("devices") or []
    ]
    assert catalog.names() == [d["name"] for d in published]
    for device, obj in zip(catalog, published, strict=True):
        assert obj["attributes"]["type"]["string"] == ("gpu" if device.kind is DeviceKind.GPU else "mig")
        assert device.shared == bool(obj.get("allowMultipleAllocations"))
        assert (device.kind is DeviceKind.PLACEMENT) == ("consumesCounters" in obj)


def test_kinds_of_a_static_and_a_dynamic_mig_node() -> None:
    static = DeviceCatalog.build(discover_node("node-a", "dgx-a100-mig"))
    mig_gpus = {d.gpu.uuid for d in static.of_kind(DeviceKind.MIG)}
    assert mig_gpus and not any(d.gpu.uuid in mig_gpus for d in static.of_kind(DeviceKind.GPU))
    assert not static.of_kind(DeviceKind.PLACEMENT) and not static.dynamic_gpus

    dynamic = DeviceCatalog.build(discover_node("node-a", "dgx-h100-mig", dynamic_mig=True))
    assert not dynamic.of_kind(DeviceKind.GPU)  # a dynamic-MIG GPU is published as its placements
    assert len(dynamic) == len(dynamic.of_kind(DeviceKind.PLACEMENT)) == 8 * 18
    gpu = dynamic.gpus[0]
    assert {d.profile for d in dynamic.of_gpu(gpu.uuid)} == {
        "1g.10gb",
        "1g.20gb",
        "2g.20gb",
        "3g.40gb",
        "4g.40gb",
        "7g.80gb",
    }
    assert dynamic.placements()[f"{gpu.device_name}-mig-3g40gb-4"][1].start == 4


def test_devices_are_published_gpu_by_gpu() -> None:
    """The allocator tries a node's devices in the published order, evaluating the request's
    selectors on each: GPU by GPU (whole, or its MIG devices) a MIG request does not first pass
    every whole GPU of the node, nor a whole-GPU request every MIG device."""
    inv = discover_node("node-a", "dgx-a100-mig")
    published = [d for s in build_slices(inv) for d in s["spec"].get("devices") or []]
    owners = [
        d["attributes"]["index" if d["attributes"]["type"]["string"] == "gpu" else "parentIndex"]["int"]
        for d in published
    ]
    assert owners == sorted(owners)
    kinds = [d["attributes"]["type"]["string"] for d in published]
    assert kinds[0] == "mig" and kinds[-1] == "gpu"  # this node's MIG GPUs have the lowest indices
    assert len(set(owners)) == len(inv.gpus)


def test_which_events_reach_which_devices() -> None:
    static = DeviceCatalog.build(discover_node("node-a", "dgx-a100-mig"))
    mig = static.of_kind(DeviceKind.MIG)[0]
    assert mig.instance is not None
    gi, ci = mig.instance
    siblings = [d.name for d in static.of_gpu(mig.gpu.uuid)]
    assert static.reached_by(mig.gpu.uuid) == siblings  # on the GPU: all its MIG devices
    assert static.reached_by(mig.gpu.uuid, gi, ci) == [mig.name]
    whole = static.of_kind(DeviceKind.GPU)[0]
    assert static.reached_by(whole.gpu.uuid) == [whole.name]
    assert static.reached_by("GPU-unknown") == []

    dynamic = DeviceCatalog.build(discover_node("node-a", "dgx-h100-mig", dynamic_mig=True))
    gpu = dynamic.gpus[0]
    placements = [d.name for d in dynamic.of_gpu(gpu.uuid)]
    held = f"{gpu.device_name}-mig-1g10gb-3"
    assert dynamic.reached_by(gpu.uuid) == placements
    assert dynamic.reached_by(gpu.uuid, 2, 0, {(gpu.uuid, 2): held}) == [held]
    # An instance no claim is known to hold: as an event on the GPU.
    assert dynamic.reached_by(gpu.uuid, 5, 0, {(gpu.uuid, 2): held}) == placements


def test_a_simulated_event_names_a_placement_by_its_instance() -> None:
    """`dra-gpu health simulate --gpu <placement>`: the instance a claim made there, else the GPU."""
    dynamic = DeviceCatalog.build(discover_node("node-a", "dgx-h100-mig", dynamic_mig=True))
    gpu = dynamic.gpus[1]
    held = f"{gpu.device_name}-mig-3g40gb-4"
    assert _find_gpu(dynamic, held, {(gpu.uuid, 2): held}) == (gpu, 2, NO_ID)
    assert _find_gpu(dynamic, f"{gpu.device_name}-mig-3g40gb-0", {(gpu.uuid, 2): held}) == (gpu, NO_ID, NO_ID)
    assert _find_gpu(dynamic, "1", {}) == (gpu, NO_ID, NO_ID)
