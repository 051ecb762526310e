"""`dra-gpu kubelet-plugin`'s wiring: a simulated node served through the kubelet-plugin layer, with
its slices published to the in-memory API, /healthz, /readyz, /metrics and a clean stop."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import aiohttp
import grpc
import pytest
from fake_kube import FakeApiServer

from dra_gpu.kube import Kube
from dra_gpu.kubeletplugin._proto import pluginregistration_v1_pb2 as reg_pb
from dra_gpu.kubeletplugin._proto import pluginregistration_v1_pb2_grpc as reg_grpc
from dra_gpu.plugin import server
from dra_gpu.plugin.server import KubeletPlugin, PluginConfig

from .conftest import DRIVER, NODE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def kubelet_confirms(registration: Path) -> None:
    """What the kubelet's plugin watcher does: GetInfo, then NotifyRegistrationStatus."""
    async with grpc.aio.insecure_channel(f"unix://{registration}") as channel:
        stub = reg_grpc.RegistrationStub(channel)
        info = await stub.GetInfo(reg_pb.InfoRequest(), timeout=5)
        assert info.name == DRIVER
        await stub.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=True), timeout=5)


def test_plugin_serves_a_simulated_node_and_stops_cleanly(
    tmp_path: Path, driver_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = FakeApiServer()
    kube = api.kube()

    async def connect(cls: type[Kube], kubeconfig: str | None = None) -> Kube:
        return kube

    monkeypatch.setattr(server.Kube, "connect", classmethod(connect))
    port = free_port()
    cfg = PluginConfig(
        node_name=NODE,
        driver=DRIVER,
        profile="dgx-a100-mig",
        kubeconfig=None,
        plugin_dir=tmp_path / "p",
        registry_dir=tmp_path / "r",
        cdi_dir=tmp_path / "cdi",
        dev_root=tmp_path / "dev",
        http_address=f"127.0.0.1:{port}",
        driver_root=driver_root,
        sweep_interval=0.05,
    )

    async def body() -> None:
        plugin = KubeletPlugin(cfg)
        task = asyncio.create_task(plugin.run())
        await asyncio.wait_for(plugin.ready.wait(), 30)
        try:
            (published,) = api.items("resourceslices")
            devices = len(published["spec"]["devices"])
            assert published["spec"]["nodeName"] == NODE and devices > 8  # GPUs and MIG devices
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
                async with http.get("/healthz") as resp:
                    assert (resp.status, await resp.text()) == (200, "ok\n")
                async with http.get("/readyz") as resp:  # serving, but no kubelet took it yet
                    assert resp.status == 503 and "not confirmed the registration" in await resp.text()
                await kubelet_confirms(cfg.sockets.registration)
                async with http.get("/readyz") as resp:
                    assert (resp.status, await resp.text()) == (200, "ok\n")
                async with http.get("/metrics") as resp:
                    assert f"dra_gpu_published_devices {devices}.0" in await resp.text()
                await asyncio.sleep(0.2)  # a few stale-claim sweeps (nothing to sweep)
                cfg.sockets.dra.unlink()  # the kubelet could not reach the plugin any more
                async with http.get("/healthz") as resp:
                    assert resp.status == 503 and (await resp.text()).startswith("unhealthy: UNAVAILABLE")
        finally:
            plugin.stopping.set()
            await asyncio.wait_for(task, 30)
        assert not cfg.sockets.registration.exists()
        assert kube.api_client.closed

    asyncio.run(body())
