"""The scale benchmark's `explain` agreement (bench/scale_bench.py): what counts as agreeing with
the scheduler, checked on claim outcomes a scheduler could and could not have produced."""

from __future__ import annotations

from typing import Any

from bench.scale_bench import agreement, claim_body
from tests.controller.objects import node_slices


def _devices(slices: list[dict[str, Any]]) -> list[str]:
    return [d["name"] for s in slices for d in s["spec"]["devices"]]


def _allocate(claim: dict[str, Any], node: str, devices: list[str]) -> dict[str, Any]:
    claim["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {"request": "gpus", "driver": "gpu.dra-gpu.io", "pool": node, "device": d}
                    for d in devices
                ]
            }
        }
    }
    return claim


def test_outcomes_a_scheduler_would_produce_agree() -> None:
    a, b = node_slices("node-a"), node_slices("node-b")
    da = _devices(a)
    # claim 4: 1 GPU with the NVLink constraint; claim 7: 8 GPUs, unconstrained; claim 12: 1 GPU
    nvlink_one = _allocate(claim_body(4), "node-a", da[:1])
    whole_node = _allocate(claim_body(7), "node-b", _devices(b))
    one_more = _allocate(claim_body(12), "node-a", da[1:2])
    never = claim_body(3)  # 8 NVLink-connected GPUs: hgx-2x4's domains hold 4
    res = agreement([*a, *b], [nvlink_one, whole_node, one_more, never])
    assert res["agree_pct"] == 100.0
    assert (res["allocated_agree"], res["pending_agree"]) == (3, 1)
    assert res["disagreements"] == []


def test_impossible_allocation_and_placeable_pending_claim_disagree() -> None:
    a = node_slices("node-a")
    da = _devices(a)
    # 4 NVLink-connected GPUs taken across both domains: not a placement the constraint allows
    split = _allocate(claim_body(2), "node-a", [da[0], da[1], da[4], da[5]])
    split["spec"]["devices"]["constraints"] = [{"matchAttribute": "gpu.dra-gpu.io/nvlinkDomain"}]
    pending = claim_body(8)  # 1 GPU, pending while six are free
    res = agreement(a, [split, pending])
    assert res["agree_pct"] == 0.0
    assert len(res["disagreements"]) == 2
    assert "explain finds no placement there with exactly those devices" in res["disagreements"][0]
    assert "pending, explain places it on node-a" in res["disagreements"][1]


def test_claims_of_one_node_checked_one_after_another_agree() -> None:
    """Each claim is checked with a view of its own (the node's other devices taken): what one
    claim's check saw free must not carry over to the next claim's."""
    a = node_slices("node-a")
    da = _devices(a)
    one = _allocate(claim_body(0), "node-a", da[:1])  # 1 GPU
    two = _allocate(claim_body(1), "node-a", da[1:3])  # 2 GPUs, same class and selectors
    four = _allocate(claim_body(6), "node-a", da[4:8])  # 4 GPUs, one NVLink domain
    res = agreement(a, [one, two, four])
    assert res["disagreements"] == []
    assert res["allocated_agree"] == 3


def test_a_changed_view_of_devices_in_use_is_seen_by_the_next_placement() -> None:
    from dra_gpu.controller.allocator import place
    from dra_gpu.controller.allocator_view import Cluster
    from dra_gpu.controller.rules import Validator
    from tests.controller.objects import DRIVER, GPU_CLASS

    a = node_slices("node-a")
    keys = {(DRIVER, "node-a", d) for d in _devices(a)}
    cluster = Cluster(Validator(DRIVER, a, [GPU_CLASS]).env, a, {DRIVER: GPU_CLASS}, in_use=keys)
    spec = claim_body(1)["spec"]  # 2 GPUs
    assert place(cluster, spec, "node-a") is None  # every device taken
    cluster.in_use = set()
    assert place(cluster, spec, "node-a") is not None
    cluster.in_use = keys
    assert place(cluster, spec, "node-a") is None
