"""The pure parts of bench/nvlink_placement_bench.py that decide what its figures mean: the seeded
job trace, the best-fit oracle, the refusal counts, and the claims a user writes for each variant
(accepted by dra-gpu's own rules over the slices it publishes)."""

from __future__ import annotations

from typing import Any

import pytest
from simnode.fake import discover_node

from bench.nvlink_placement_bench import (
    DRIVER,
    MIX,
    RANK_BOUNDS,
    Job,
    Oracle,
    Outcome,
    check_domains,
    claim_spec,
    figures,
    mean_life,
    node_slices,
    run_oracle,
    trace,
)
from dra_gpu.controller.allocator import place
from dra_gpu.controller.rules import Validator
from dra_gpu.node.slices import build_slices, packing_rank

GPU_CLASS = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": DRIVER},
    "spec": {"selectors": [{"cel": {"expression": f'device.attributes["{DRIVER}"].type == "gpu"'}}]},
}


def test_the_trace_is_the_seeds_and_offers_the_load() -> None:
    a, b = trace(7, 4000, 32, 0.9), trace(7, 4000, 32, 0.9)
    assert a == b
    assert a != trace(8, 4000, 32, 0.9)
    assert [j.step for j in a] == list(range(4000))
    assert all(j.leaves > j.step for j in a)
    shares = {n: sum(j.gpus == n for j in a) / len(a) for n, _ in MIX}
    for n, p in MIX:
        assert shares[n] == pytest.approx(p, abs=0.03)
    life = sum(j.leaves - j.step for j in a) / len(a)
    assert life == pytest.approx(mean_life(32, 0.9), rel=0.1)
    # offered load: mean GPUs a job x mean life = load x GPUs
    assert mean_life(32, 0.9) * sum(n * p for n, p in MIX) == pytest.approx(0.9 * 256)


def test_the_oracle_fits_each_job_where_it_leaves_least_free() -> None:
    oracle = Oracle("hgx-2x4", ["a", "b"])
    book = oracle.book
    book.take(Job(0, 2, 99), "b", (4, 5))  # b: domain 1 half used
    # one GPU: the domain with the fewest left after it (b's second domain), not a whole one
    assert oracle.place(Job(1, 1, 99)) == ("b", (6,))
    book.take(Job(1, 1, 99), "b", (6,))
    # four: a whole domain, on the node with fewest free GPUs (b), keeping node a whole
    assert oracle.place(Job(2, 4, 99)) == ("b", (0, 1, 2, 3))
    book.take(Job(2, 4, 99), "b", (0, 1, 2, 3))
    # eight on hgx-2x4 is the whole node: only a is
    assert oracle.place(Job(3, 8, 99)) == ("a", tuple(range(8)))
    book.take(Job(3, 8, 99), "a", tuple(range(8)))
    assert oracle.place(Job(4, 2, 99)) is None  # b has 1 free
    assert oracle.place(Job(4, 1, 99)) == ("b", (7,))


def test_the_oracle_on_nvswitch_nodes_packs_one_domain_a_node() -> None:
    oracle = Oracle("dgx-h100", ["a", "b", "c"])
    oracle.book.take(Job(0, 4, 99), "c", (0, 1, 2, 3))
    assert oracle.place(Job(1, 4, 99)) == ("c", (4, 5, 6, 7))
    assert oracle.place(Job(1, 2, 99)) == ("c", (4, 5))
    assert oracle.place(Job(1, 8, 99)) == ("a", tuple(range(8)))


def test_refusals_count_as_fragmented_only_with_enough_gpus_free_in_total() -> None:
    jobs = [Job(0, 4, 9), Job(1, 8, 9), Job(2, 8, 9), Job(3, 4, 9), Job(4, 1, 9)]
    outcomes = [
        Outcome(jobs[0], "a", (0, 1, 2, 3), 16),
        Outcome(jobs[1], None, free_before=12),  # 12 free, none whole: fragmented
        Outcome(jobs[2], None, free_before=7),  # not enough in total
        Outcome(jobs[3], None, free_before=4),
        Outcome(jobs[4], None, free_before=0),
    ]
    f = figures(outcomes, 16, warmup=0)
    assert f["by_size"]["8"] == {"jobs": 2, "refused": 2, "fragmented": 1}
    assert f["by_size"]["4"] == {"jobs": 2, "refused": 1, "fragmented": 1}
    assert (f["large_jobs"], f["large_refused"], f["large_fragmented"], f["refused"]) == (4, 3, 2, 4)
    assert f["fill"] == pytest.approx(1 - (16 + 12 + 7 + 4 + 0) / 5 / 16)
    assert figures(outcomes, 16, warmup=3)["measured"] == 2


def test_the_oracle_replays_a_trace_the_same_way_every_time() -> None:
    nodes = [f"gpu-{i:03d}" for i in range(8)]
    jobs = trace(3, 300, 8, 0.9)
    a, b = run_oracle("hgx-2x4", nodes, jobs), run_oracle("hgx-2x4", nodes, jobs)
    assert [(o.node, o.gpus) for o in a] == [(o.node, o.gpus) for o in b]
    # never more GPUs than the nodes have, never a domain split
    for o in a:
        if o.node is not None and o.job.gpus <= 4:
            assert set(o.gpus) <= {0, 1, 2, 3} or set(o.gpus) <= {4, 5, 6, 7}


@pytest.mark.parametrize("topology", ["hgx-2x4", "dgx-h100"])
def test_the_published_domains_are_the_oracles(topology: str) -> None:
    check_domains(topology, build_slices(discover_node("gpu-000", topology)))
    with pytest.raises(RuntimeError, match="NVLink domains"):
        check_domains(
            "dgx-h100" if topology == "hgx-2x4" else "hgx-2x4", node_slices(topology, "n", "today", 1)
        )


def test_domain_slices_regroup_the_builders_devices_in_order() -> None:
    (one,) = node_slices("hgx-2x4", "gpu-001", "today", 1)
    two = node_slices("hgx-2x4", "gpu-001", "domain-slices", 1)
    assert [s["spec"]["pool"]["resourceSliceCount"] for s in two] == [2, 2]
    assert [d for s in two for d in s["spec"]["devices"]] == one["spec"]["devices"]
    assert sorted(s["metadata"]["name"] for s in two) == [s["metadata"]["name"] for s in two]


def variant_claim(gpus: int, topology: str, variant: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": f"job-{gpus}", "namespace": "default"},
        "spec": claim_spec(gpus, topology, variant),
    }


@pytest.mark.parametrize("variant", ["today", "rank8", "rank4"])
@pytest.mark.parametrize("topology", ["hgx-2x4", "dgx-h100"])
def test_every_claim_is_accepted_and_placed_on_its_rank_first(topology: str, variant: str) -> None:
    nodes = [f"gpu-{i:03d}" for i in range(8)]
    slices = [s for n in nodes for s in build_slices(discover_node(n, topology))]
    validator = Validator(DRIVER, slices, [GPU_CLASS])
    for gpus, _ in MIX:
        claim = variant_claim(gpus, topology, variant)
        verdict = validator.validate(claim)
        assert verdict.allowed, verdict.lines()
        for node in nodes:
            got = place(validator.cluster, claim["spec"], node)
            assert got is not None and len(got.devices) == gpus
            requests = {r for r, _ in got.results}
            if variant in RANK_BOUNDS and gpus < 8:
                # the subrequest that fits first on a node is its rank's: what the scheduler scores
                (sub,) = requests
                below = [b for b in RANK_BOUNDS[variant] if packing_rank(node) < b]
                assert sub == (f"gpus/below{below[0]}" if below else "gpus/any")
            else:
                assert requests == {"gpus"}


def test_a_gpu_without_a_packing_rank_is_ranked_last_not_an_error() -> None:
    """A node whose dra-gpu predates the attribute (a rolling upgrade) still takes the claim,
    through its last subrequest."""
    slices = build_slices(discover_node("gpu-000", "hgx-2x4"))
    for dev in slices[0]["spec"]["devices"]:
        del dev["attributes"]["packingRank"]
    validator = Validator(DRIVER, slices, [GPU_CLASS])
    got = place(validator.cluster, claim_spec(2, "hgx-2x4", "rank8"), "gpu-000")
    assert got is not None and {r for r, _ in got.results} == {"gpus/any"}
