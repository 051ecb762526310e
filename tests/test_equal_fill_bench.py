"""The pure parts of the benches against NVIDIA's plugin that decide what a figure means: the scale
bench's equal-fill cases (which slices are cloned, which pairs compare like with like) and the
sustained-rate bench's steps (what passes, what the sustained rate is)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from bench.scale_bench import (
    EQUAL_FILL,
    NVIDIA_DRIVER,
    NVIDIA_MIG_CLASS,
    case_driver,
    claim_body,
    cloned_slice,
    counterpart,
    devices_by_type,
    equal_fill_table,
    pool_complete,
    unequal_fill,
)
from bench.sustained_rate_bench import (
    Step,
    kubelet_fetch_refused,
    parse_rates,
    pod_body,
    running_since,
    sustained,
)


def nvidia_slice(name: str, generation: int = 1, count: int = 2) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "metadata": {"name": name, "resourceVersion": "7", "uid": "u-1"},
        "spec": {
            "driver": NVIDIA_DRIVER,
            "nodeName": "gpu-000",
            "pool": {"name": "gpu-000", "generation": generation, "resourceSliceCount": count},
            "devices": [
                {"name": "gpu-0-mig-1", "attributes": {"type": {"string": "mig"}}},
                {"name": "gpu-1", "attributes": {"type": {"string": "gpu"}}},
            ],
        },
    }


def test_a_cloned_slice_is_the_template_on_another_node_and_the_template_is_untouched() -> None:
    template = nvidia_slice("gpu-000-abc")
    before = copy.deepcopy(template)
    clone = cloned_slice(template, "gpu-042", 1)
    assert template == before
    assert clone["spec"]["nodeName"] == clone["spec"]["pool"]["name"] == "gpu-042"
    assert clone["spec"]["devices"] == template["spec"]["devices"]
    assert clone["spec"]["pool"]["generation"] == 1 and clone["spec"]["pool"]["resourceSliceCount"] == 2
    # a name of its own, no server-set fields copied
    assert clone["metadata"] == {"name": f"gpu-042-{NVIDIA_DRIVER}-1"}


def test_a_pool_is_complete_only_with_all_of_its_newest_generation() -> None:
    assert not pool_complete([])
    assert not pool_complete([nvidia_slice("a")])  # one of two
    assert pool_complete([nvidia_slice("a"), nvidia_slice("b")])
    # an old generation's slice beside the new one's: the driver is still replacing the pool
    assert not pool_complete([nvidia_slice("a", 1), nvidia_slice("b", 2), nvidia_slice("c", 2)])
    assert pool_complete([nvidia_slice("a", 3, 1)])


def test_each_compat_case_compares_with_nvidias_and_only_those_pairs() -> None:
    assert counterpart("compat-static-mig") == "nvidia-static-mig"
    assert counterpart("nvidia-dynamic-mig") == "compat-dynamic-mig"
    assert counterpart("mig") is None and counterpart("plain") is None
    for case in EQUAL_FILL:
        assert counterpart(case) in EQUAL_FILL
        assert case_driver(case) == NVIDIA_DRIVER
        assert EQUAL_FILL[case][:2] == EQUAL_FILL[counterpart(case) or ""][:2]  # same node profile


@pytest.mark.parametrize("pair", ["static-mig", "dynamic-mig"])
def test_both_drivers_get_the_same_claims_of_nvidias_mig_class(pair: str) -> None:
    for i in range(8):
        ours, theirs = claim_body(i, f"compat-{pair}"), claim_body(i, f"nvidia-{pair}")
        assert ours == theirs
        (request,) = ours["spec"]["devices"]["requests"]
        assert request["exactly"]["deviceClassName"] == NVIDIA_MIG_CLASS
        assert f'device.attributes["{NVIDIA_DRIVER}"].profile' in str(request["exactly"]["selectors"])


def result(
    case: str, allocated: int, claims: int = 300, nodes: int = 100, cpu: float = 3.0
) -> dict[str, Any]:
    return {
        "case": case,
        "nodes": nodes,
        "claims": claims,
        "allocated": allocated,
        "published_devices": 19 * 8 * nodes,
        "devices_by_type": {"gpu": 8 * nodes, "mig": 18 * 8 * nodes},
        "nodes_with_slices": nodes,
        "scheduler_attempts": {"scheduled": allocated, "unschedulable": allocated, "scheduled_s": 1.0},
        "procs": {"kube-scheduler": {"cpu_claims_s": cpu}},
    }


def test_a_pair_that_did_not_allocate_every_claim_is_named_unequal() -> None:
    assert unequal_fill(result("nvidia-static-mig", 300), result("compat-static-mig", 300)) is None
    problem = unequal_fill(result("nvidia-static-mig", 280), result("compat-static-mig", 300))
    assert problem is not None and "NVIDIA allocated 280 of 300" in problem
    other = result("compat-static-mig", 300)
    other["nodes_with_slices"] = 99
    assert "compat's slices on 99 of 100 nodes" in (
        unequal_fill(result("nvidia-static-mig", 300), other) or ""
    )


def test_the_equal_fill_table_gives_compats_ratio_to_nvidia_and_flags_unequal_pairs() -> None:
    table = equal_fill_table([result("nvidia-static-mig", 300, cpu=6.0), result("compat-static-mig", 300)])
    compat_row = next(line for line in table.splitlines() if " compat " in line)
    assert compat_row.split()[-2:] == ["0.50", "0.50"]  # half the CPU, per claim and per attempt
    assert "UNEQUAL" not in table
    unequal = equal_fill_table([result("nvidia-static-mig", 250), result("compat-static-mig", 300)])
    assert "UNEQUAL FILL (static-mig, 100 nodes)" in unequal


def test_devices_are_counted_by_their_type_attribute_qualified_or_not() -> None:
    plain = nvidia_slice("a")
    qualified = nvidia_slice("b")
    qualified["spec"]["devices"] = [{"name": "x", "attributes": {f"{NVIDIA_DRIVER}/type": {"string": "mig"}}}]
    bare = nvidia_slice("c")
    bare["spec"]["devices"] = [{"name": "y"}]
    assert devices_by_type([plain, qualified, bare], NVIDIA_DRIVER) == {"-": 1, "gpu": 1, "mig": 2}


def test_rates_must_be_positive_ascending_and_distinct() -> None:
    assert parse_rates("1,2,4.5") == [1.0, 2.0, 4.5]
    for bad in ("", "2,1", "1,1", "0,1", "-1"):
        with pytest.raises(ValueError, match="--rates"):
            parse_rates(bad)


def step(rate: float, starts: list[float], never: int = 0) -> Step:
    return Step("dra-gpu", rate, len(starts) + never, start_s=starts, never=never, limit_s=2.0)


def test_a_step_passes_only_with_every_pod_started_and_its_p99_under_the_limit() -> None:
    assert step(1, [0.5] * 100).passed
    assert not step(1, [0.5] * 99, never=1).passed  # one pod never started
    assert not step(1, [0.5] * 98 + [2.5, 2.5]).passed  # p99 over 2 s
    assert not step(1, []).passed  # nothing started at all


def test_the_sustained_rate_is_the_last_passing_step_before_the_first_failure() -> None:
    ok, bad = [0.4] * 50, [3.0] * 50
    assert sustained([step(1, ok), step(2, ok), step(4, bad)]) == 2
    assert sustained([step(1, bad), step(2, ok)]) == 0  # stepping stops at the first failure
    assert sustained([]) == 0


def test_a_pod_counts_as_started_when_every_container_runs() -> None:
    body = pod_body("p-1", "r1-dr-100", "vm")
    assert body["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
    assert not running_since(body)
    body["status"] = {"containerStatuses": [{"state": {"waiting": {"reason": "ContainerCreating"}}}]}
    assert not running_since(body)
    body["status"] = {"containerStatuses": [{"state": {"running": {"startedAt": "2026-12-07T12:00:00Z"}}}]}
    assert running_since(body)


def test_only_the_kubelets_own_refused_claim_read_counts_as_its_race() -> None:
    race = (
        "Failed to prepare dynamic resources: prepare dynamic resources: fetch ResourceClaim p-gpu-x: "
        'resourceclaims.resource.k8s.io "p-gpu-x" is forbidden: User "system:node:vm" cannot get resource '
        "\"resourceclaims\" ...: node: no relationship found between node 'vm' and this object"
    )
    plugin = (
        "Failed to prepare dynamic resources: prepare dynamic resources: NodePrepareResources failed for "
        "ResourceClaim p-gpu-y: requested device gpu-4 is already allocated to different claim 86ed"
    )
    assert kubelet_fetch_refused(race)
    assert not kubelet_fetch_refused(plugin)
