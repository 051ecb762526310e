"""`dra-gpu top` says why a Pending pod's claim is not allocated, from `dra-gpu explain` run as a
child process over the cluster as top read it."""

from __future__ import annotations

import argparse
import asyncio
import copy
import io
import json
from typing import Any

from dra_gpu.fleet.command import Printer
from dra_gpu.fleet.pending import MAX_EXPLAINED, explain_pending
from dra_gpu.fleet.read import Scope, read_once
from dra_gpu.fleet.snapshot import Snapshot, parse_snapshot
from dra_gpu.fleet.text import render_text
from dra_gpu.fleet.view import build_view
from tests.controller.objects import DRIVER, GPU_CLASS, NVLINK, claim
from tests.fake_kube import FakeApiServer
from tests.fleet_cluster import Cluster

OTHER_CLASS: dict[str, Any] = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": "fpga.example.com"},
    "spec": {"selectors": [{"cel": {"expression": 'device.driver == "fpga.example.com"'}}]},
}


def waiting(name: str, namespace: str, count: int, **kw: Any) -> dict[str, Any]:
    c = claim(name, count=count, **kw)
    c["metadata"]["namespace"] = namespace
    del c["apiVersion"], c["kind"]  # as a list's items come
    return c


def pending_pod(name: str, namespace: str, claims: dict[str, str], templated: bool = False) -> dict[str, Any]:
    """A pod the scheduler has not placed. `claims`: its entry name -> the claim's name; `templated`:
    the claims were made from a template and are named in the pod's status."""
    if templated:
        entries = [{"name": e, "resourceClaimTemplateName": "tpl"} for e in claims]
        status = {
            "phase": "Pending",
            "resourceClaimStatuses": [{"name": e, "resourceClaimName": c} for e, c in claims.items()],
        }
    else:
        entries = [{"name": e, "resourceClaimName": c} for e, c in claims.items()]
        status = {"phase": "Pending"}
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"resourceClaims": entries},
        "status": status,
    }


def cluster() -> Cluster:
    """node-a: two NVLink domains of 4 GPUs; one domain and one GPU of the other held."""
    c = Cluster()
    names = c.add_node("node-a", "hgx-2x4")
    c.hold("team-a", "train", "node-a", names[:4], pod="trainer-0")
    c.hold("team-a", "one", "node-a", names[4:5], pod="one-0")
    c.claims += [
        waiting("big", "team-b", 4, constraints=NVLINK),  # 3 GPUs left in the free domain
        waiting("two", "team-b", 2, constraints=NVLINK),
        waiting("fpga", "team-b", 1),
    ]
    c.claims[-1]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "fpga.example.com"
    c.pods += [
        pending_pod("big-0", "team-b", {"gpus": "big"}),
        pending_pod("two-0", "team-b", {"gpus": "two-0-gpus-x1"}, templated=True),
        pending_pod("fpga-0", "team-b", {"fpga": "fpga"}),
    ]
    c.claims[-2]["metadata"]["name"] = "two-0-gpus-x1"
    return c


def snapshot_of(c: Cluster) -> Snapshot:
    return parse_snapshot(DRIVER, c.slices, c.claims, c.pods, c.rules, [GPU_CLASS, OTHER_CLASS])


def test_a_pending_pods_claim_says_why_it_cannot_fit_and_where_one_would() -> None:
    pending = asyncio.run(explain_pending(snapshot_of(cluster()), timeout=60))
    by_pod = {p.pod: p for p in pending}
    assert set(by_pod) == {"big-0", "two-0"}  # the FPGA claim is another driver's: not explained here
    big = by_pod["big-0"]
    assert (big.namespace, big.claim, big.fits) == ("team-b", "big", False)
    assert "largest free NVLink domain: 3 GPUs" in big.reason, big.reason
    two = by_pod["two-0"]  # a claim made from a template, found through the pod's status
    assert (two.claim, two.fits, two.node, len(two.devices)) == ("two-0-gpus-x1", True, "node-a", 2)

    text = render_text(build_view(snapshot_of(cluster()), pending=pending))
    tail = text[text.index("pending pods") :]
    assert "team-b/big-0 (claim big)" in tail and "cannot fit: " in tail
    assert "fits now on node-a: " in tail
    assert all(len(line) <= 80 for line in text.splitlines())


def test_nothing_is_explained_without_pending_pods_and_a_scheduled_pod_is_not_pending() -> None:
    c = cluster()
    for pod in c.pods:
        pod["spec"]["nodeName"] = "node-a"  # placed: its claim is being prepared, not allocated
    assert asyncio.run(explain_pending(snapshot_of(c), timeout=60)) == ()


def test_more_claims_than_the_cap_are_named_but_not_explained() -> None:
    c = cluster()
    c.pods = [p for p in c.pods if p["metadata"]["name"] == "two-0"]
    template = c.claims[-2]
    for i in range(MAX_EXPLAINED + 2):
        extra = copy.deepcopy(template)
        extra["metadata"]["name"] = f"x-{i:02d}"
        c.claims.append(extra)
        c.pods.append(pending_pod(f"x-{i:02d}", "team-b", {"gpus": f"x-{i:02d}"}))
    pending = asyncio.run(explain_pending(snapshot_of(c), timeout=120))
    assert len(pending) == MAX_EXPLAINED + 3
    unexplained = [p for p in pending if p.fits is None]
    assert len(unexplained) == 3 and all(f"more than {MAX_EXPLAINED}" in p.reason for p in unexplained)


def test_an_explanation_that_does_not_answer_in_time_is_said_and_killed() -> None:
    pending = asyncio.run(explain_pending(snapshot_of(cluster()), timeout=0.01))
    assert pending and all(p.fits is None for p in pending)
    assert "did not answer within 0.01s" in pending[0].reason


def test_top_json_from_the_api_has_the_pending_pods_with_their_reasons() -> None:
    c = cluster()
    server = FakeApiServer()
    for plural, objs in (
        ("resourceslices", c.slices),
        ("resourceclaims", c.claims),
        ("pods", c.pods),
        ("deviceclasses", [GPU_CLASS, OTHER_CLASS]),
    ):
        for obj in objs:
            server.put(plural, obj)
    out = io.StringIO()
    args = argparse.Namespace(node=None, namespace="team-b", output="json", watch=False, timeout=60.0)

    async def body() -> None:
        await Printer(args, out)(await read_once(server.kube(), Scope(DRIVER, namespace="team-b"), timeout=5))

    asyncio.run(body())
    doc = json.loads(out.getvalue())
    rows = {p["pod"]: p for p in doc["pending"]}
    assert set(rows) == {"big-0", "two-0"}
    assert rows["big-0"]["fits"] is False and "NVLink" in rows["big-0"]["reason"]
    assert rows["two-0"]["fits"] is True and rows["two-0"]["node"] == "node-a"
