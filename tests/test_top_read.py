"""`dra-gpu top` against an API (the in-memory one of tests/fake_kube.py): one read, and --watch
redrawing on watch events without listing again."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
from typing import Any

import pytest

from dra_gpu.cli import main
from dra_gpu.fleet import read
from dra_gpu.fleet.command import Printer
from dra_gpu.fleet.read import Scope, read_once, watch
from dra_gpu.fleet.snapshot import Snapshot, parse_object
from dra_gpu.fleet.view import GpuState, build_view
from tests.controller.objects import DRIVER
from tests.fake_kube import FakeApiServer, until
from tests.fleet_cluster import Cluster


def serve(c: Cluster) -> FakeApiServer:
    server = FakeApiServer()
    for s in c.slices:
        server.put("resourceslices", s)
    for claim in c.claims:
        server.put("resourceclaims", claim)
    for pod in c.pods:
        server.put("pods", pod)
    return server


def states(snapshot: Snapshot) -> dict[str, str]:
    return {f"{g.node}/{g.name}": g.state.value for n in build_view(snapshot).nodes for g in n.gpus}


def test_read_once_lists_the_drivers_slices_claims_and_pods_with_claims() -> None:
    c = Cluster()
    names = c.add_node("node-a", "hgx-2x4")
    c.hold("team-a", "train", "node-a", names[:2], pod="trainer-0")
    other = json.loads(json.dumps(c.slices[0]).replace(DRIVER, "gpu.example.com"))
    other["metadata"]["name"] = "other-driver"
    c.slices.append(other)
    c.pods.append(
        {"metadata": {"name": "web", "namespace": "team-a"}, "spec": {}, "status": {"phase": "Running"}}
    )

    async def body() -> Snapshot:
        server = serve(c)
        snapshot = await read_once(server.kube(), Scope(DRIVER), timeout=5)
        # Only the driver's slices were asked for (a field selector), not every driver's.
        (slice_list,) = [r for r in server.requests if r.path.endswith("/resourceslices")]
        assert slice_list.query["fieldSelector"] == f"spec.driver={DRIVER}"
        return snapshot

    snapshot = asyncio.run(body())
    assert {d.pool for d in snapshot.devices} == {"node-a"} and len(snapshot.devices) == 8
    assert [p.name for p in snapshot.pods] == ["trainer-0"]  # pods without claims are dropped
    assert list(states(snapshot).values()).count("held") == 2
    assert any("DeviceTaintRules: not served" in p for p in snapshot.problems)


def test_watch_redraws_on_events_without_listing_again(monkeypatch: pytest.MonkeyPatch) -> None:
    c = Cluster()
    names = c.add_node("node-a", "hgx-2x4")
    c.add_node("node-b", "dgx-h100-mig", dynamic_mig=True)
    drawn: list[Snapshot] = []
    parsed: list[str] = []

    def counting(collection: str, driver: str, obj: Any) -> Any:
        parsed.append(collection)
        return parse_object(collection, driver, obj)

    monkeypatch.setattr(read, "parse_object", counting)

    async def body() -> None:
        server = serve(c)
        task = asyncio.create_task(watch(server.kube(), Scope(DRIVER), drawn.append, timeout=5, settle=0.01))
        await until(lambda: len(drawn) == 1)
        assert set(states(drawn[0]).values()) == {"free", "mig"}
        assert parsed.count("slices") == len(c.slices)
        parsed.clear()
        later = Cluster(slices=c.slices)
        server.put("resourceclaims", later.hold("team-a", "train", "node-a", names[:1], pod="p"))
        await until(lambda: len(drawn) == 2)
        assert states(drawn[1])[f"node-a/{names[0]}"] == GpuState.HELD.value
        assert parsed == ["claims"]  # the redraw decoded the new claim only, not the slices again
        server.remove("resourceclaims", "train", "team-a")
        await until(lambda: len(drawn) == 3)
        assert set(states(drawn[2]).values()) == {"free", "mig"}
        # Each collection was listed once and then only watched.
        assert server.count("GET", "resourceclaims") == 1 and server.count("GET", "resourceslices") == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(body())


def test_watch_json_prints_one_document_a_line() -> None:
    c = Cluster()
    c.add_node("node-a", "mixed")
    out = io.StringIO()
    args = argparse.Namespace(node=None, namespace=None, output="json", watch=True, timeout=5.0)
    printer = Printer(args, out)

    async def body() -> None:
        server = serve(c)
        task = asyncio.create_task(watch(server.kube(), Scope(DRIVER), printer, timeout=5, settle=0.01))
        await until(lambda: out.getvalue().count("\n") == 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(body())
    (line,) = out.getvalue().splitlines()
    assert json.loads(line)["totals"]["gpus"] == 4


def test_cli_reports_an_unreachable_cluster_in_one_line(tmp_path: object, capsys: object) -> None:
    import pathlib

    assert isinstance(tmp_path, pathlib.Path)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
        "current-context: x\n"
    )
    code = main(["top", "--kubeconfig", str(kubeconfig), "--timeout", "5"])
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert code == 2
    assert err.startswith("dra-gpu top: cannot read the cluster:") and err.count("\n") == 1
