"""The kubelet's view: real gRPC calls over unix sockets to the registration and DRA services."""

from __future__ import annotations

import asyncio
import shutil
import stat
import tempfile
import uuid
from pathlib import Path
from typing import Any

import grpc

from dra_gpu.kubeletplugin._proto import dra_health_v1alpha1_pb2 as health_pb
from dra_gpu.kubeletplugin._proto import dra_health_v1alpha1_pb2_grpc as health_grpc
from dra_gpu.kubeletplugin._proto import dra_v1_pb2 as v1_pb
from dra_gpu.kubeletplugin._proto import dra_v1_pb2_grpc as v1_grpc
from dra_gpu.kubeletplugin._proto import dra_v1beta1_pb2 as v1beta1_pb
from dra_gpu.kubeletplugin._proto import dra_v1beta1_pb2_grpc as v1beta1_grpc
from dra_gpu.kubeletplugin._proto import pluginregistration_v1_pb2 as reg_pb
from dra_gpu.kubeletplugin._proto import pluginregistration_v1_pb2_grpc as reg_grpc
from dra_gpu.kubeletplugin.claims import ClaimFetcher
from dra_gpu.kubeletplugin.driver import DeviceHealth, Health
from dra_gpu.kubeletplugin.health import HealthService
from dra_gpu.kubeletplugin.helper import serve_unix
from dra_gpu.kubeletplugin.metrics import PluginMetrics
from dra_gpu.kubeletplugin.node_service import DraV1beta1Service, DraV1Service, NodeService
from dra_gpu.kubeletplugin.registration import RegistrationService
from dra_gpu.plugin.gpu_driver import GpuDriver
from plugin.conftest import DRIVER, NODE, PluginCore, claim, gpu_names


async def with_servers(core: PluginCore, body: Any) -> Any:
    sock_dir = Path(tempfile.mkdtemp(prefix="dra", dir="/tmp"))  # unix paths must be < 108 bytes
    try:
        metrics = PluginMetrics()
        driver = GpuDriver(DRIVER, NODE, core.preparer.planner.catalog, core.preparer)
        node = NodeService(driver, ClaimFetcher(core.claims), metrics)
        dra = sock_dir / "dra.sock"
        dra.write_text("stale socket from a previous run")
        dra_server = await serve_unix(
            dra,
            [
                (v1_grpc.add_DRAPluginServicer_to_server, DraV1Service(node)),
                (v1beta1_grpc.add_DRAPluginServicer_to_server, DraV1beta1Service(node)),
                (
                    health_grpc.add_DRAResourceHealthServicer_to_server,
                    HealthService(
                        lambda: [DeviceHealth(NODE, n, Health.HEALTHY) for n in gpu_names(core)],
                        resend_seconds=0.05,
                    ),
                ),
            ],
        )
        registration = RegistrationService(DRIVER, str(dra))
        reg = sock_dir / f"{DRIVER}-reg.sock"
        reg_server = await serve_unix(reg, [(reg_grpc.add_RegistrationServicer_to_server, registration)])
        try:
            async with (
                grpc.aio.insecure_channel(f"unix://{reg}") as rch,
                grpc.aio.insecure_channel(f"unix://{dra}") as dch,
            ):
                return await body(rch, dch, registration, metrics, dra, reg)
        finally:
            await reg_server.stop(None)
            await dra_server.stop(None)
    finally:
        shutil.rmtree(sock_dir)


def test_registration_handshake(core: PluginCore) -> None:
    async def body(
        rch: Any, dch: Any, registration: RegistrationService, metrics: Any, dra: Path, reg: Path
    ) -> None:
        stub = reg_grpc.RegistrationStub(rch)
        info = await stub.GetInfo(reg_pb.InfoRequest(), timeout=1)
        assert info.type == "DRAPlugin" and info.name == DRIVER and info.endpoint == str(dra)
        assert list(info.supported_versions) == [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1.DRAResourceHealth",
            "v1alpha1.DRAResourceHealth",
        ]
        await stub.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=True), timeout=5)
        assert registration.registered.is_set()
        for sock in (dra, reg):
            mode = sock.stat().st_mode
            assert stat.S_ISSOCK(mode) and mode & 0o077 == 0  # stale file replaced, owner-only

    asyncio.run(with_servers(core, body))


def test_prepare_and_unprepare_over_v1_and_v1beta1(core: PluginCore) -> None:
    g0, g1, g2 = gpu_names(core)[:3]
    good = claim(str(uuid.uuid4()), [g0, g1], requests=["gpus/a100", "other"])
    bad = claim(str(uuid.uuid4()), [g2])
    bad["status"] = {}
    beta = claim(str(uuid.uuid4()), [g2])
    for c in (good, bad, beta):
        core.add(c)

    def pb_claim(pb: Any, c: dict) -> Any:
        m = c["metadata"]
        return pb.Claim(namespace=m["namespace"], uid=m["uid"], name=m["name"])

    async def body(rch: Any, dch: Any, registration: Any, metrics: Any, dra: Path, reg: Path) -> None:
        v1 = v1_grpc.DRAPluginStub(dch)
        resp = await v1.NodePrepareResources(
            v1_pb.NodePrepareResourcesRequest(claims=[pb_claim(v1_pb, good), pb_claim(v1_pb, bad)]),
            timeout=45,
        )
        ok = resp.claims[good["metadata"]["uid"]]
        assert ok.error == ""
        assert [(list(d.request_names), d.pool_name, d.device_name) for d in ok.devices] == [
            (["gpus"], NODE, g0),
            (["other"], NODE, g1),
        ]
        assert ok.devices[0].cdi_device_ids == [f"k8s.{DRIVER}/claim={good['metadata']['uid']}-{g0}"]
        assert not ok.devices[0].HasField("share_id")
        assert "is not allocated" in resp.claims[bad["metadata"]["uid"]].error
        empty = await v1.NodePrepareResources(v1_pb.NodePrepareResourcesRequest(), timeout=5)
        assert len(empty.claims) == 0
        beta1 = v1beta1_grpc.DRAPluginStub(dch)
        bresp = await beta1.NodePrepareResources(
            v1beta1_pb.NodePrepareResourcesRequest(claims=[pb_claim(v1beta1_pb, beta)]), timeout=45
        )
        assert bresp.claims[beta["metadata"]["uid"]].devices[0].device_name == g2
        un = await v1.NodeUnprepareResources(
            v1_pb.NodeUnprepareResourcesRequest(claims=[pb_claim(v1_pb, good), pb_claim(v1_pb, bad)]),
            timeout=45,
        )
        assert set(un.claims) == {good["metadata"]["uid"], bad["metadata"]["uid"]}
        assert all(e.error == "" for e in un.claims.values())
        assert metrics.requests.labels("prepare", "success")._value.get() == 2
        assert metrics.requests.labels("prepare", "error")._value.get() == 1
        assert (
            metrics.registry.get_sample_value("dra_gpu_prepared_devices") == 1
        )  # only `beta` is still prepared

    asyncio.run(with_servers(core, body))
    assert set(core.cdi.owned()) == {beta["metadata"]["uid"]}


def test_health_stream_reports_every_device_healthy(core: PluginCore) -> None:
    async def body(rch: Any, dch: Any, *_: Any) -> None:
        stream = health_grpc.DRAResourceHealthStub(dch).NodeWatchResources(
            health_pb.NodeWatchResourcesRequest(), timeout=5
        )
        first = await stream.read()
        second = await stream.read()
        stream.cancel()
        for msg in (first, second):
            assert [d.device.device_name for d in msg.devices] == gpu_names(core)
            assert {d.health for d in msg.devices} == {health_pb.HEALTHY}
            assert {d.device.pool_name for d in msg.devices} == {NODE}
            assert all(d.health_check_timeout_seconds == 30 for d in msg.devices)

    asyncio.run(with_servers(core, body))


def test_hostile_input_gets_errors_never_a_crash(core: PluginCore) -> None:
    import socket

    async def body(rch: Any, dch: Any, registration: Any, metrics: Any, dra: Path, reg: Path) -> None:
        v1 = v1_grpc.DRAPluginStub(dch)
        # A huge batch of claims nobody has heard of: one error per claim, all answered.
        claims = [v1_pb.Claim(namespace="ns", uid=str(uuid.uuid4()), name=f"c{i}") for i in range(500)]
        resp = await v1.NodePrepareResources(v1_pb.NodePrepareResourcesRequest(claims=claims), timeout=45)
        assert len(resp.claims) == 500
        assert all("not found" in e.error for e in resp.claims.values())
        # Garbage bytes straight onto the socket, then bytes that are no protobuf message.
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(dra))
            s.sendall(b"\x00\xffPRI * HTTP/9.9 garbage\r\n" * 50)
        raw = dch.unary_unary(
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        try:
            await raw(b"\xff\xff\xff\xff\x0f not protobuf", timeout=5)
            raise AssertionError("garbage request was accepted")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
        # Still serving, and nothing was written.
        info = await reg_grpc.RegistrationStub(rch).GetInfo(reg_pb.InfoRequest(), timeout=1)
        assert info.name == DRIVER
        assert core.cdi.owned() == {}
        assert core.checkpoint.records() == []

    asyncio.run(with_servers(core, body))
