"""`explain`: the simulated structured allocator, starting with the classic example."""

from __future__ import annotations

from typing import Any

from dra_gpu.controller.commands import explain_inputs
from dra_gpu.controller.inputs import Inputs

from .objects import DRIVER, GPU_CLASS, NVLINK, allocated, claim, device_names, node_slices


def run(slices: list[dict[str, Any]], *objs: dict[str, Any]) -> list[dict[str, Any]]:
    inputs = Inputs()
    for o in [*slices, GPU_CLASS, *objs]:
        inputs.add(o, "test")
    result: list[dict[str, Any]] = explain_inputs(inputs)["claims"]
    return result


def test_classic_example(hgx: list[dict[str, Any]]) -> None:
    names = device_names(hgx)
    in_use = allocated("busy", "node-a", names[:2])
    linked, plain = run(hgx, in_use, claim("four-linked", 4, constraints=NVLINK), claim("four", 4))
    assert linked["allocatable"] and linked["node"] == "node-a"
    assert linked["devices"] == names[4:8] and linked["linkCost"] == 6
    assert linked["bestDevices"] == names[4:8] and linked["bestLinkCost"] == 6
    # First fit without the constraint: GPUs 2, 3, 4, 5 -> 2 same-domain pairs + 4 cross pairs * 4.
    assert plain["devices"] == names[2:6] and plain["linkCost"] == 18
    assert plain["bestDevices"] == names[4:8] and plain["bestLinkCost"] == 6
    # The first-fit result in the shape of status.allocation.devices.results.
    assert plain["results"] == [
        {"request": "gpus", "driver": "gpu.dra-gpu.io", "pool": "node-a", "device": d} for d in names[2:6]
    ]
    assert set(plain) == {
        "namespace",
        "name",
        "source",
        "usedBy",
        "allocatable",
        "allocated",
        "invalid",
        "node",
        "devices",
        "results",
        "linkCost",
        "bestDevices",
        "bestLinkCost",
        "sharedAttributes",
        "reason",
        "simulated",
        "concernsDriver",
    }


def test_not_allocatable_reasons(hgx: list[dict[str, Any]]) -> None:
    names = device_names(hgx)
    busy = allocated("busy", "node-a", names[:2])
    five, sixteen, nine = run(
        hgx, busy, claim("five", 5, constraints=NVLINK), claim("sixteen", 16), claim("nine", 7)
    )
    assert not five["allocatable"]
    assert "largest free NVLink domain: 4 GPUs (node-a)" in five["reason"]
    assert not sixteen["allocatable"] and "needs 16 GPUs; at most 6" in sixteen["reason"]
    assert not nine["allocatable"]


def test_first_available_falls_back_and_respects_order(hgx: list[dict[str, Any]]) -> None:
    names = device_names(hgx)
    c = claim("fa")
    c["spec"]["devices"] = {
        "requests": [
            {
                "name": "gpus",
                "firstAvailable": [
                    {"name": "eight", "deviceClassName": "gpu.dra-gpu.io", "count": 8},
                    {"name": "two", "deviceClassName": "gpu.dra-gpu.io", "count": 2},
                ],
            }
        ],
        "constraints": NVLINK,
    }
    (r,) = run(hgx, allocated("busy", "node-a", [names[0]]), c)
    assert r["allocatable"] and r["devices"] == names[1:3] and r["linkCost"] == 1


def test_all_mode_fails_when_one_device_is_in_use(hgx: list[dict[str, Any]]) -> None:
    names = device_names(hgx)
    c = claim("all")
    c["spec"]["devices"]["requests"][0]["exactly"] = {
        "deviceClassName": "gpu.dra-gpu.io",
        "allocationMode": "All",
    }
    (free,) = run(hgx, c)
    assert free["allocatable"] and free["devices"] == names
    (busy,) = run(hgx, allocated("busy", "node-a", [names[7]]), c)
    assert not busy["allocatable"]


def test_distinct_attribute_and_selectors(hgx: list[dict[str, Any]]) -> None:
    names = device_names(hgx)
    c = claim(
        "spread",
        2,
        selectors=['device.attributes["gpu.dra-gpu.io"].index >= 2'],
        constraints=[{"distinctAttribute": "gpu.dra-gpu.io/nvlinkDomain"}],
    )
    (r,) = run(hgx, c)
    assert r["devices"] == [names[2], names[4]] and r["linkCost"] == 4


def test_two_nodes_first_node_that_fits() -> None:
    slices = node_slices("node-a", "mixed") + node_slices("node-b", "hgx-2x4")
    (r,) = run(
        slices,
        claim(
            "big",
            4,
            selectors=['device.capacity["gpu.dra-gpu.io"].memory.compareTo(quantity("70Gi")) >= 0'],
            constraints=NVLINK,
        ),
    )
    assert r["allocatable"] and r["node"] == "node-b"


def test_full_nodes_are_passed_over_and_admin_access_still_takes_devices_in_use() -> None:
    slices = node_slices("node-a") + node_slices("node-b") + node_slices("node-c")
    a, b = device_names(node_slices("node-a")), device_names(node_slices("node-b"))
    busy = [allocated("busy-a", "node-a", a), allocated("busy-b", "node-b", b[:7])]
    admin = claim("admin", 2, constraints=NVLINK)
    admin["spec"]["devices"]["requests"][0]["exactly"]["adminAccess"] = True
    two, one, watcher = run(slices, *busy, claim("two", 2, constraints=NVLINK), claim("one", 1), admin)
    assert two["allocatable"] and two["node"] == "node-c"
    assert one["allocatable"] and one["node"] == "node-b" and one["devices"] == b[7:]
    assert watcher["allocatable"] and watcher["node"] == "node-a" and watcher["devices"] == a[:2]


def test_many_nodes_is_fast() -> None:
    import time

    slices = [s for i in range(30) for s in node_slices(f"node-{i:03d}")]
    start = time.perf_counter()
    results = run(slices, *[claim(f"c{i}", 4, constraints=NVLINK) for i in range(5)])
    assert all(r["allocatable"] for r in results)
    assert time.perf_counter() - start < 10


def test_unmodelled_selector_is_reported_as_not_simulated(hgx: list[dict[str, Any]]) -> None:
    sel = f'device.attributes["{DRIVER}"].productName.find("H[0-9]+") == "H100"'
    (r,) = run(hgx, claim("k8s-lib", 1, selectors=[sel]))
    assert not r["allocatable"] and not r["simulated"]
    assert "uses find of the Kubernetes CEL libraries" in r["reason"]


def test_the_heap_is_frozen_only_while_claims_are_explained(hgx: list[dict[str, Any]]) -> None:
    """explain_inputs keeps the inputs out of the collector's passes and then undoes it; a heap the
    caller froze stays frozen."""
    import gc

    seen: list[int] = []

    class Spy(dict[str, Any]):  # a claim spec read while explaining: notes the freeze count then
        def get(self, key: str, default: Any = None) -> Any:
            seen.append(gc.get_freeze_count())
            return super().get(key, default)

    c = claim("spy", 1)
    c["spec"] = Spy(c["spec"])
    gc.unfreeze()
    (r,) = run(hgx, c)
    assert r["allocatable"] and max(seen) > 0  # read while explaining (and before, unfrozen)
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        run(hgx, claim("again", 1))
        assert gc.get_freeze_count() >= frozen
    finally:
        gc.unfreeze()
