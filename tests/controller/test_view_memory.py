"""The webhook's view holds what reviews read and no more: a claim of a mebibyte is kept as the
devices it holds, an unallocated claim not at all, a process that has not been sent its events is
behind by at most about the view, a REJECTED object leaves the view, and reviews answer as they
did over the full objects."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Iterator
from typing import Any

from dra_gpu.controller.cluster_state import ClusterState
from dra_gpu.controller.review_pool import BACKLOG_EVENTS, ReviewPool
from dra_gpu.controller.review_processes import Starting
from dra_gpu.controller.review_worker import _apply_event
from dra_gpu.controller.rules import ProblemKind, Validator
from dra_gpu.controller.view_records import AllocatedClaim

from .objects import DRIVER, GPU_CLASS, allocated, claim, device_names, node_slices
from .test_sharing_validation import memory_claim, share, shares_slices

MIB = 1 << 20


def large(c: dict[str, Any], i: int = 0) -> dict[str, Any]:
    """`c` grown to over a mebibyte: an annotation and another driver's opaque parameters, unique
    to `i` (nothing shared between claims that would hide one kept whole)."""
    c["metadata"]["annotations"] = {"example.com/pad": f"{i}-".ljust(MIB, "a")}
    c["metadata"]["managedFields"] = [{"manager": "kubectl", "fieldsV1": {"f:pad": f"{i}".ljust(1000)}}]
    c["spec"]["devices"]["config"] = [
        {"opaque": {"driver": "other.example.com", "parameters": {"pad": f"{i}-".ljust(64 * 1024, "p")}}}
    ]
    c.setdefault("status", {})["reservedFor"] = [{"resource": "pods", "name": f"pod-{i}", "uid": f"uid-{i}"}]
    return c


def large_allocated(i: int, device: str = "gpu-0") -> dict[str, Any]:
    return large(allocated(f"claim-{i}", f"node-{i}", [device]), i)


def retained(*objects: Any) -> int:
    return len(pickle.dumps(objects))


def test_a_claim_of_a_mebibyte_is_kept_as_the_device_it_holds() -> None:
    state = ClusterState(DRIVER)
    state.apply("claims", "ADDED", large_allocated(7))
    kept = state.stores["claims"]["default/claim-7"]
    assert isinstance(kept, AllocatedClaim)
    assert retained(kept) < 512
    assert dict(kept) == {
        "metadata": {"name": "claim-7", "namespace": "default"},
        "status": {
            "allocation": {"devices": {"results": [{"driver": DRIVER, "pool": "node-7", "device": "gpu-0"}]}}
        },
    }


def test_an_unallocated_claim_is_not_kept_and_a_deallocated_one_leaves() -> None:
    state = ClusterState(DRIVER)
    unallocated = large(claim("waiting"), 1)
    state.replace("claims", [unallocated, large_allocated(2)])
    assert list(state.stores["claims"]) == ["default/claim-2"]
    released = large_allocated(2)
    del released["status"]["allocation"]
    state.apply("claims", "MODIFIED", released)
    assert state.stores["claims"] == {}


def test_many_large_claims_leave_the_view_and_the_pools_backlog_bounded() -> None:
    state = ClusterState(DRIVER)
    pool = ReviewPool(DRIVER)
    state.pool = pool
    behind = Starting()  # a process that is sent none of its events meanwhile (as a worker left idle)
    pool._starting.append(behind)

    def listed(n: int) -> Iterator[dict[str, Any]]:  # made one at a time, as a list is decoded
        for i in range(n):
            yield large_allocated(i)

    state.replace("claims", listed(40))
    for i in range(40, 100):  # created, allocated, its pod bound, released, deleted
        c = large(claim(f"claim-{i}"), i)
        state.apply("claims", "ADDED", c)
        state.apply("claims", "MODIFIED", large_allocated(i))
        state.apply("claims", "MODIFIED", large_allocated(i))  # only reservedFor, annotations: no event
        if i % 2:
            state.apply("claims", "DELETED", large_allocated(i))
    kept = len(state.stores["claims"])
    assert kept == 40 + 30
    # ~100 MiB of claims went through; what is held is a few hundred bytes a claim.
    assert retained(state.stores, pool.view, behind.pending) < 600 * kept

    # Churn without end (claims with generated names) leaves the backlog as long as the view at most.
    for i in range(100, 100 + 3 * BACKLOG_EVENTS):
        state.apply("claims", "MODIFIED", allocated(f"claim-{i}", "node-x", ["gpu-1"]))
        state.apply("claims", "DELETED", allocated(f"claim-{i}", "node-x", ["gpu-1"]))
    assert len(behind.pending) <= BACKLOG_EVENTS + 2 * kept + 3
    # ... and still brings that process to the same view.
    caught_up = ClusterState(DRIVER)
    for event in behind.pending:
        _apply_event(caught_up, event)
    assert caught_up.stores == state.stores == pool.view


def test_a_rejected_object_leaves_the_view_and_the_workers_view() -> None:
    state = ClusterState(DRIVER)
    pool = ReviewPool(DRIVER)
    state.pool = pool
    behind = Starting()
    pool._starting.append(behind)
    slices = node_slices()
    state.replace("slices", slices)
    state.apply("claims", "ADDED", large_allocated(3))
    identity = {"metadata": {"name": "claim-3", "namespace": "default", "uid": "u-3"}}
    state.apply("claims", "REJECTED", identity)
    state.apply("slices", "REJECTED", {"metadata": {"name": slices[0]["metadata"]["name"], "uid": "u"}})
    assert state.stores["claims"] == pool.view["claims"] == {}
    assert state.device_count() == len(device_names(slices[1:]))
    assert [e[2] for e in behind.pending[1:]] == ["ADDED", "DELETED", "DELETED"]
    state.apply("claims", "REJECTED", identity)  # not in the view: nothing to tell the workers
    assert len(behind.pending) == 4


def _answers(validator: Validator, claims: list[dict[str, Any]]) -> list[Any]:
    out = []
    for c in claims:
        v = validator.validate(c)
        out.append(
            (
                [(p.path, p.message, p.kind) for p in v.errors],
                [(p.path, p.message, p.kind) for p in v.warnings],
            )
        )
    return out


def test_reviews_answer_as_over_the_full_claims() -> None:
    exclusive = node_slices()
    gpus = device_names(exclusive)
    shares = shares_slices()
    shared_gpus = [
        d["name"] for s in shares for d in s["spec"]["devices"] if d.get("allowMultipleAllocations")
    ]
    admin = allocated("admin", "node-a", gpus[:4])
    for r in admin["status"]["allocation"]["devices"]["results"]:
        r["adminAccess"] = True
    cases = [
        (exclusive, [allocated("half", "node-a", gpus[:4])], [claim("c", 4), claim("d", 5)]),
        (exclusive, [allocated("all", "node-a", gpus)], [claim("c", 1)]),
        (exclusive, [admin], [claim("c", 8)]),
        (shares, [share(f"s{i}", g, "40Gi") for i, g in enumerate(shared_gpus)], [memory_claim("m", "48Gi")]),
    ]
    kinds = set()
    for slices, in_use, reviewed in cases:
        state = ClusterState(DRIVER)
        state.replace("slices", slices)
        state.replace("classes", [GPU_CLASS])
        state.replace("claims", [large(c, i) for i, c in enumerate(in_use)])
        full = Validator(DRIVER, slices, [GPU_CLASS], in_use)
        assert _answers(state.validator(), reviewed) == _answers(full, reviewed)
        kinds |= {w[2] for errors, warnings in _answers(full, reviewed) for w in warnings}
    assert ProblemKind.IN_USE in kinds  # the cases do depend on the allocated claims


def test_a_worker_left_idle_through_heavy_churn_answers_from_the_current_view() -> None:
    slices = node_slices()
    gpus = device_names(slices)

    async def scenario() -> None:
        state = ClusterState(DRIVER)
        pool = ReviewPool(DRIVER, workers=1, deadline_s=10)
        state.pool = pool
        state.replace("slices", slices)
        state.replace("classes", [GPU_CLASS])
        await pool.start()
        try:
            assert (await pool.validate(claim("c", 1))).warnings == []
            for i in range(2 * BACKLOG_EVENTS):  # no review meanwhile: the worker is sent nothing
                c = allocated(f"churn-{i}", "node-a", [gpus[i % len(gpus)]])
                state.apply("claims", "ADDED", c)
                state.apply("claims", "DELETED", c)
            for i, g in enumerate(gpus):
                state.apply("claims", "ADDED", large(allocated(f"held-{i}", "node-a", [g]), i))
            (worker,) = pool._workers
            assert len(worker.pending) <= BACKLOG_EVENTS + 2 * len(gpus) + 3
            (warning,) = (await pool.validate(claim("c", 1))).warnings
            assert "cannot be allocated right now" in warning[1]
            state.apply("claims", "REJECTED", {"metadata": {"name": "held-0", "namespace": "default"}})
            assert (await pool.validate(claim("c", 1))).warnings == []
        finally:
            await pool.close()

    asyncio.run(scenario())
