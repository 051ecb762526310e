"""A GPU that fails: the kubelet's health stream says so before the apiserver holds the NoExecute
taint. The taint gets the pod evicted, and the kubelet writes a pod's allocatedResourcesStatus only
when it syncs the pod: an evicted pod is synced once before its containers are killed and next
after its claims are unprepared, so a health update that came after the eviction would never show
in the pod's status."""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from fake_kube import FakeApiServer

from dra_gpu.kube.api import Kube
from dra_gpu.kubeletplugin._proto import dra_health_v1_pb2 as v1_health_pb
from dra_gpu.kubeletplugin._proto import dra_health_v1_pb2_grpc as v1_health_grpc
from dra_gpu.node.settings import NodeSettings
from dra_gpu.plugin import server
from dra_gpu.plugin.server import KubeletPlugin, PluginConfig
from tests.plugin.conftest import DRIVER, NODE
from tests.simnode_support import in_child, needs_root, needs_toolchain, nvml_h  # noqa: F401 - a fixture

pytestmark = [needs_toolchain, needs_root, pytest.mark.usefixtures("nvml_h")]
DRA_GPU = shutil.which("dra-gpu") or str(Path(sys.executable).with_name("dra-gpu"))
# How long the taint's write waits for the kubelet's stream to show the GPU unhealthy. The
# stream's own re-send comes 10 s after it opened, so only the change itself can arrive in time.
HEARD_WITHIN = 1.0


def test_the_kubelet_hears_of_a_lost_gpu_before_the_taint_is_published(tmp_path: Path) -> None:
    in_child(kubelet_hears_first, tmp_path)  # one simulated NVML per process


def kubelet_hears_first(tmp_path: Path) -> None:
    api = FakeApiServer()
    kube = api.kube()

    async def connect(cls: type[Kube], kubeconfig: str | None = None) -> Kube:
        return kube

    server.Kube.connect = classmethod(connect)  # type: ignore[method-assign,assignment]
    cfg = PluginConfig(
        NodeSettings(
            node_name=NODE,
            driver=DRIVER,
            profile="hgx-2x4",
            plugin_dir=tmp_path / "p",
            registry_dir=tmp_path / "r",
            cdi_dir=tmp_path / "cdi",
            dev_root=tmp_path / "dev",
            driver_root=None,  # the profile's simulated driver, built on first use
        ),
        kubeconfig=None,
    )
    heard: dict[str, int] = {}  # device -> its health in the kubelet's last message
    verdicts: list[bool] = []  # per tainted write: had the kubelet heard of the device first?

    async def body() -> None:
        plugin = KubeletPlugin(cfg)
        task = asyncio.create_task(plugin.run())
        await asyncio.wait_for(plugin.ready.wait(), 60)
        try:
            (published,) = api.items("resourceslices")
            target = next(
                d["name"] for d in published["spec"]["devices"] if d["attributes"]["index"]["int"] == 2
            )
            apply_slice = kube.apply_slice

            async def watched_apply(body: dict[str, Any], field_manager: str) -> dict[str, Any]:
                if any(d["name"] == target and d.get("taints") for d in body["spec"]["devices"]):
                    verdicts.append(await kubelet_heard(target))
                return await apply_slice(body, field_manager)

            kube.apply_slice = watched_apply  # type: ignore[method-assign]
            async with grpc.aio.insecure_channel(f"unix://{cfg.sockets.dra}") as channel:
                stream = v1_health_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                    v1_health_pb.NodeWatchResourcesRequest()
                )
                reading = asyncio.create_task(read(stream))
                async with asyncio.timeout(5):
                    while heard.get(target) != v1_health_pb.HEALTHY:
                        await asyncio.sleep(0.01)
                simulate = await asyncio.create_subprocess_exec(
                    DRA_GPU, "health", "--plugin-dir", str(cfg.node.plugin_dir), "simulate", "xid",
                    "--xid", "79", "--gpu", "2",
                )  # fmt: skip
                assert await simulate.wait() == 0
                async with asyncio.timeout(10):
                    while not verdicts:
                        await asyncio.sleep(0.02)
                stream.cancel()
                await asyncio.gather(reading, return_exceptions=True)
            assert verdicts == [True], "the taint was written before the kubelet heard of the GPU"
        finally:
            plugin.stopping.set()
            await asyncio.wait_for(task, 30)

    async def read(stream: Any) -> None:
        async for message in stream:
            heard.update({d.device.device_name: d.health for d in message.devices})

    async def kubelet_heard(device: str) -> bool:
        try:
            async with asyncio.timeout(HEARD_WITHIN):
                while heard.get(device) != v1_health_pb.UNHEALTHY:
                    await asyncio.sleep(0.005)
        except TimeoutError:
            return False
        return True

    asyncio.run(body())
