"""The layer as the kubelet sees it: a GPU-free driver run by KubeletPluginHelper, called over real
gRPC on real unix sockets, its slices published to the in-memory API."""

from __future__ import annotations

import asyncio
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from fake_kube import FakeApiServer, until

from dra_gpu.kubeletplugin._proto import dra_health_v1alpha1_pb2 as health_pb
from dra_gpu.kubeletplugin._proto import dra_health_v1alpha1_pb2_grpc as health_grpc
from dra_gpu.kubeletplugin._proto import dra_v1_pb2 as v1_pb
from dra_gpu.kubeletplugin._proto import dra_v1_pb2_grpc as v1_grpc
from dra_gpu.kubeletplugin._proto import dra_v1beta1_pb2 as v1beta1_pb
from dra_gpu.kubeletplugin._proto import dra_v1beta1_pb2_grpc as v1beta1_grpc
from dra_gpu.kubeletplugin._proto import pluginregistration_v1_pb2 as reg_pb
from dra_gpu.kubeletplugin._proto import pluginregistration_v1_pb2_grpc as reg_grpc
from dra_gpu.kubeletplugin.claims import ClaimFetcher
from dra_gpu.kubeletplugin.helper import KubeletPluginHelper, Sockets
from dra_gpu.kubeletplugin.metrics import PluginMetrics

from .conftest import DRIVER, NODE, FakeClaims, FakeDriver


@dataclass
class Running:
    helper: KubeletPluginHelper
    driver: FakeDriver
    claims: FakeClaims
    api: FakeApiServer
    metrics: PluginMetrics
    registration: Any  # grpc.aio channels to the two sockets
    dra: Any


def run_plugin(tmp_path: Path, test: Callable[[Running], Awaitable[None]]) -> None:
    sockets = Sockets.for_driver(DRIVER, tmp_path / "plug", tmp_path / "reg")
    sockets.dra.parent.mkdir()
    sockets.dra.write_text("a stale socket file from an earlier run")

    async def body() -> None:
        api, driver, metrics, claims = FakeApiServer(), FakeDriver(), PluginMetrics(), FakeClaims()
        helper = KubeletPluginHelper(
            DRIVER,
            NODE,
            driver,
            api.kube(),
            sockets,
            metrics,
            health_resend_seconds=0.05,
            claims=ClaimFetcher(claims),
        )
        await helper.start()
        try:
            async with (
                grpc.aio.insecure_channel(f"unix://{sockets.registration}") as reg,
                grpc.aio.insecure_channel(f"unix://{sockets.dra}") as dra,
            ):
                await test(Running(helper, driver, claims, api, metrics, reg, dra))
        finally:
            await helper.stop()
        assert not sockets.dra.exists() and not sockets.registration.exists()
        assert await helper.self_check(timeout=0.5) is not None  # nobody answers any more

    asyncio.run(body())


def test_registration_handshake(tmp_path: Path) -> None:
    async def test(p: Running) -> None:
        stub = reg_grpc.RegistrationStub(p.registration)
        info = await stub.GetInfo(reg_pb.InfoRequest(), timeout=1)
        assert (info.type, info.name, info.endpoint) == ("DRAPlugin", DRIVER, str(p.helper.sockets.dra))
        assert list(info.supported_versions) == [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1.DRAResourceHealth",
            "v1alpha1.DRAResourceHealth",
        ]
        await stub.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=True), timeout=5)
        assert p.helper.registration.registered.is_set()
        refused = reg_pb.RegistrationStatus(plugin_registered=False, error="version mismatch")
        await stub.NotifyRegistrationStatus(refused, timeout=5)
        assert not p.helper.registration.registered.is_set()
        for sock in (p.helper.sockets.dra, p.helper.sockets.registration):
            mode = sock.stat().st_mode
            assert stat.S_ISSOCK(mode) and mode & 0o077 == 0  # stale file replaced, owner-only
        assert await p.helper.self_check() is None
        # Slices were published before the sockets were served.
        assert [s["metadata"]["name"] for s in p.api.items("resourceslices")] == [f"{NODE}-{DRIVER}-0"]

    run_plugin(tmp_path, test)


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
def test_prepare_and_unprepare_answer_each_claim(tmp_path: Path, version: str) -> None:
    pb, grpc_mod = (v1_pb, v1_grpc) if version == "v1" else (v1beta1_pb, v1beta1_grpc)

    def claims(*names: str) -> list[Any]:
        return [pb.Claim(namespace="ns", uid=f"uid-{n}", name=n) for n in names]

    async def test(p: Running) -> None:
        stub = grpc_mod.DRAPluginStub(p.dra)
        request = pb.NodePrepareResourcesRequest(claims=claims("good", "bad-1", "bug-1", "other"))
        resp = await stub.NodePrepareResources(request, timeout=45)
        assert set(resp.claims) == {"uid-good", "uid-bad-1", "uid-bug-1", "uid-other"}
        good = resp.claims["uid-good"]
        assert good.error == ""
        assert [(list(d.request_names), d.pool_name, d.device_name) for d in good.devices] == [
            (["gpus"], NODE, "dev-0"),
            ([], NODE, "dev-1"),
        ]
        assert list(good.devices[0].cdi_device_ids) == [f"k8s.{DRIVER}/claim=uid-good"]
        if version == "v1":
            assert good.devices[0].share_id == "share-1" and not good.devices[1].HasField("share_id")
        else:
            assert "share_id" not in {f.name for f in good.devices[0].DESCRIPTOR.fields}
        assert resp.claims["uid-bad-1"].error == "claim ns/bad-1 (uid uid-bad-1): not allocated"
        assert not resp.claims["uid-bad-1"].devices
        assert resp.claims["uid-bug-1"].error == "internal error: 'allocation'"
        assert p.metrics.requests.labels("prepare", "success")._value.get() == 2
        assert p.metrics.requests.labels("prepare", "error")._value.get() == 2
        assert p.metrics.registry.get_sample_value("dra_gpu_prepared_devices") == 4
        assert p.metrics.latency.labels("prepare")._sum.get() > 0
        assert len((await stub.NodePrepareResources(pb.NodePrepareResourcesRequest(), timeout=5)).claims) == 0

        unrequest = pb.NodeUnprepareResourcesRequest(claims=claims("good", "bad-2", "never-prepared"))
        un = await stub.NodeUnprepareResources(unrequest, timeout=45)
        assert {uid: e.error for uid, e in un.claims.items()} == {
            "uid-good": "",
            "uid-bad-2": "claim ns/bad-2 (uid uid-bad-2): not allocated",
            "uid-never-prepared": "",
        }
        assert (
            p.metrics.registry.get_sample_value("dra_gpu_prepared_devices") == 2
        )  # `other` is still prepared
        assert p.metrics.requests.labels("unprepare", "error")._value.get() == 1

    run_plugin(tmp_path, test)


def test_the_layer_reads_each_claim_and_refuses_one_gone_or_replaced(tmp_path: Path) -> None:
    """As the upstream helper: the driver is handed the claim the kubelet named, never one deleted
    or created again under the same name since (another UID)."""

    async def test(p: Running) -> None:
        p.claims.uids["swapped"] = "uid-newer"
        names = ("good", "gone-1", "swapped")
        request = v1_pb.NodePrepareResourcesRequest(
            claims=[v1_pb.Claim(namespace="ns", uid=f"uid-{n}", name=n) for n in names]
        )
        resp = await v1_grpc.DRAPluginStub(p.dra).NodePrepareResources(request, timeout=45)
        assert {uid: c.error for uid, c in resp.claims.items()} == {
            "uid-good": "",
            "uid-gone-1": "ResourceClaim ns/gone-1 not found",
            "uid-swapped": "ResourceClaim ns/swapped got replaced: uid is uid-newer, "
            "the kubelet asked for uid-swapped",
        }
        assert p.driver.calls == [("prepare", "good")] and p.claims.gets == 3
        assert p.metrics.requests.labels("prepare", "error")._value.get() == 2

    run_plugin(tmp_path, test)


def test_a_batch_runs_concurrently(tmp_path: Path) -> None:
    async def test(p: Running) -> None:
        names = [f"c{i}" for i in range(50)]
        p.claims.uids.update((n, n) for n in names)
        request = v1_pb.NodePrepareResourcesRequest(
            claims=[v1_pb.Claim(namespace="ns", uid=n, name=n) for n in names]
        )
        await v1_grpc.DRAPluginStub(p.dra).NodePrepareResources(request, timeout=45)
        # Every claim was started before the first one finished (the driver yields once).
        assert p.driver.calls[:50] == [("prepare", n) for n in names]

    run_plugin(tmp_path, test)


def test_health_stream_sends_the_drivers_device_health(tmp_path: Path) -> None:
    async def test(p: Running) -> None:
        stream = health_grpc.DRAResourceHealthStub(p.dra).NodeWatchResources(
            health_pb.NodeWatchResourcesRequest(), timeout=5
        )
        first = await stream.read()
        p.driver.unhealthy.add("dev-1")
        second = await stream.read()
        stream.cancel()
        assert [(d.device.pool_name, d.device.device_name, d.health) for d in first.devices] == [
            (NODE, "dev-0", health_pb.HEALTHY),
            (NODE, "dev-1", health_pb.HEALTHY),
            (NODE, "dev-2", health_pb.HEALTHY),
        ]
        assert [d.health for d in second.devices] == [
            health_pb.HEALTHY,
            health_pb.UNHEALTHY,
            health_pb.HEALTHY,
        ]
        assert all(d.health_check_timeout_seconds == 30 and d.last_updated_time > 0 for d in second.devices)

    run_plugin(tmp_path, test)


def test_slices_stay_published_while_it_runs(tmp_path: Path) -> None:
    async def test(p: Running) -> None:
        await until(lambda: p.api.count("GET", "resourceslices", watch=True) == 1)
        p.api.remove("resourceslices", f"{NODE}-{DRIVER}-0")  # the kubelet wipes them when it restarts
        await until(lambda: len(p.api.items("resourceslices")) == 1)
        assert p.metrics.slice_restores._value.get() == 1

    run_plugin(tmp_path, test)


def test_socket_paths_longer_than_grpc_serves_are_refused(tmp_path: Path) -> None:
    sockets = Sockets.for_driver(DRIVER, tmp_path / ("x" * 100), tmp_path)
    with pytest.raises(ValueError, match="is longer than 105 bytes"):
        sockets.check()
    # One byte under the kernel's limit, which gRPC refuses all the same: the check says so first.
    name = "dra.sock"
    plugin_dir = tmp_path / ("y" * (106 - len(str(tmp_path)) - 2 - len(name)))
    at_106 = Sockets.for_driver(DRIVER, plugin_dir, tmp_path)
    assert len(str(at_106.dra)) == 106
    with pytest.raises(ValueError, match="gRPC's limit"):
        at_106.check()


def test_v1_health_stream_sends_at_once_after_a_change(tmp_path: Path) -> None:
    from dra_gpu.kubeletplugin._proto import dra_health_v1_pb2 as v1_health_pb
    from dra_gpu.kubeletplugin._proto import dra_health_v1_pb2_grpc as v1_health_grpc

    async def test(p: Running) -> None:
        p.helper.health_v1.resend_seconds = 60  # only a change can make the second message come soon
        stream = v1_health_grpc.DRAResourceHealthStub(p.dra).NodeWatchResources(
            v1_health_pb.NodeWatchResourcesRequest(), timeout=5
        )
        first = await stream.read()
        p.driver.unhealthy.add("dev-2")
        await p.helper.health_changed()
        second = await asyncio.wait_for(stream.read(), 1)
        stream.cancel()
        assert [d.health for d in first.devices] == [v1_health_pb.HEALTHY] * 3
        assert [d.health for d in second.devices][2] == v1_health_pb.UNHEALTHY

    run_plugin(tmp_path, test)


def test_every_request_series_exists_from_the_start_at_zero() -> None:
    """An alert's increase() sees the first failed prepare only if the series was there before it
    (a series born at 1 increases by nothing): all four exist, at 0, before any request."""
    registry = PluginMetrics().registry
    for operation in ("prepare", "unprepare"):
        for result in ("success", "error"):
            labels = {"operation": operation, "result": result}
            assert registry.get_sample_value("dra_gpu_node_requests_total", labels) == 0.0
