"""`dra-gpu kubelet-plugin`'s wiring: a simulated node served through the kubelet-plugin layer, with
its slices published to the in-memory API, /healthz, /readyz, /metrics and a clean stop."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import grpc
import pytest
from fake_kube import FakeApiServer
from simnode.builder import default_cache_dir, ensure_driver_root, nvml_library

from dra_gpu.kube.api import Kube
from dra_gpu.kubeletplugin._proto import pluginregistration_v1_pb2 as reg_pb
from dra_gpu.kubeletplugin._proto import pluginregistration_v1_pb2_grpc as reg_grpc
from dra_gpu.node.settings import NodeSettings
from dra_gpu.plugin import server
from dra_gpu.plugin.server import KubeletPlugin, PluginConfig
from tests.plugin.conftest import DRIVER, NODE
from tests.simnode_support import in_child, needs_root, needs_toolchain, nvml_h  # noqa: F401 - a fixture

# A simulated node runs its simulated driver's libnvidia-ml.so.1 (compiled on first use, device
# nodes made with mknod).
pytestmark = [needs_toolchain, needs_root, pytest.mark.usefixtures("nvml_h")]
DRA_GPU = shutil.which("dra-gpu") or str(Path(sys.executable).with_name("dra-gpu"))


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


def test_plugin_serves_a_simulated_node_and_stops_cleanly(tmp_path: Path) -> None:
    # The simulated node's NVML is its driver's libnvidia-ml.so.1: one per process, so in a child.
    in_child(serve_a_simulated_node, tmp_path)


def serve_a_simulated_node(tmp_path: Path) -> None:
    api = FakeApiServer()
    kube = api.kube()

    async def connect(cls: type[Kube], kubeconfig: str | None = None) -> Kube:
        return kube

    server.Kube.connect = classmethod(connect)  # type: ignore[method-assign,assignment]
    stopped: list[str] = []  # the teardown, in order

    def recorded(cls: type, method: str, label: str) -> None:
        original = getattr(cls, method)

        async def stop(self: object) -> None:
            stopped.append(label)
            await original(self)

        setattr(cls, method, stop)

    recorded(server.HealthNode, "stop", "health")
    recorded(server.KubeletPluginHelper, "stop", "kubelet sockets")
    recorded(server.ClaimStatusWriter, "close", "claim statuses")
    recorded(server.web.AppRunner, "cleanup", "http")
    recorded(server.Kube, "close", "api client")
    port = free_port()
    cfg = PluginConfig(
        NodeSettings(
            node_name=NODE,
            driver=DRIVER,
            profile="dgx-a100-mig",
            plugin_dir=tmp_path / "p",
            registry_dir=tmp_path / "r",
            cdi_dir=tmp_path / "cdi",
            dev_root=tmp_path / "dev",
            driver_root=None,  # the profile's simulated driver, built on first use
        ),
        kubeconfig=None,
        http_address=f"127.0.0.1:{port}",
        sweep_interval=0.05,
    )

    def taints(device: str) -> list[dict[str, object]]:
        (published,) = api.items("resourceslices")
        return next(d.get("taints", []) for d in published["spec"]["devices"] if d["name"] == device)

    async def body() -> None:
        plugin = KubeletPlugin(cfg)
        task = asyncio.create_task(plugin.run())
        await asyncio.wait_for(plugin.ready.wait(), 60)
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
                    exported = await resp.text()
                    assert f"dra_gpu_published_devices {devices}.0" in exported
                    build = next(x for x in exported.splitlines() if x.startswith("dra_gpu_build_info{"))
                    assert 'component="kubelet-plugin"' in build and f'node="{cfg.node.node_name}"' in build
                    rss = next(
                        x for x in exported.splitlines() if x.startswith("process_resident_memory_bytes ")
                    )
                    assert float(rss.split()[1]) > 10e6  # this test's process: the plugin runs in it
                # `dra-gpu health simulate`, as a user runs it: the XID goes into the simulated
                # kernel; the plugin's monitor gets it from nvmlEventSetWait_v2 and taints.
                gpu3 = "gpu-0000-4e-00-0"
                assert taints(gpu3) == []
                simulate = await asyncio.create_subprocess_exec(
                    DRA_GPU, "health", "--plugin-dir", str(cfg.node.plugin_dir), "simulate", "xid",
                    "--xid", "74", "--gpu", "3",
                )  # fmt: skip
                assert await simulate.wait() == 0
                async with asyncio.timeout(10):
                    while not taints(gpu3):
                        await asyncio.sleep(0.05)
                assert taints(gpu3)[0]["value"] == "xid-74"
                await asyncio.sleep(0.2)  # a few stale-claim sweeps (nothing to sweep)
                cfg.sockets.dra.unlink()  # the kubelet could not reach the plugin any more
                async with http.get("/healthz") as resp:
                    text = await resp.text()
                    assert resp.status == 503 and text.startswith("unhealthy: "), (resp.status, text)
        finally:
            plugin.stopping.set()
            await asyncio.wait_for(task, 30)
        assert not cfg.sockets.registration.exists()
        assert kube.api_client.closed
        assert stopped == ["health", "kubelet sockets", "claim statuses", "http", "api client"]

    asyncio.run(body())


def test_the_plugin_loads_one_nvml_by_full_path_from_the_driver_root(tmp_path: Path) -> None:
    """A started `dra-gpu kubelet-plugin` on a simulated node: exactly one libnvidia-ml mapped, the
    driver root's, loaded without LD_LIBRARY_PATH; the simulated kernel lists the capability files
    of the profile's MIG instances under the node's proc/, as the NVIDIA driver does."""
    root = ensure_driver_root(default_cache_dir(), "dgx-a100-mig")
    # An API server that takes the connection and never answers: the plugin's first request after
    # its start-up's reconcile waits (its timeout) instead of failing at once and ending the
    # process while /proc is read. (--device-metadata off: no request before the reconcile.)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: 'https://127.0.0.1:{silent.getsockname()[1]}'}}}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\nusers: [{name: u, user: {token: t}}]\n"
    )
    (tmp_path / "registry").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LD_")}
    log = tmp_path / "plugin.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [DRA_GPU, "kubelet-plugin", "--node-name", NODE, "--profile", "dgx-a100-mig",
             "--driver-root", str(root), "--kubeconfig", str(kubeconfig),
             "--plugin-dir", str(tmp_path / "plugin"), "--registry-dir", str(tmp_path / "registry"),
             "--cdi-dir", str(tmp_path / "cdi"), "--http-address", "", "--device-metadata", "off"],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "checkpoint reconciled" not in log.read_text():  # NVML loaded, the node discovered
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        maps = Path(f"/proc/{proc.pid}/maps").read_text().splitlines()
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
    finally:
        proc.kill()  # still starting (no API server answers): SIGTERM waits for the start-up
        proc.wait(10)
        silent.close()
    mapped = {line.split()[-1] for line in maps if "libnvidia-ml" in line}
    assert mapped == {str(nvml_library(root).resolve())}
    assert not [e for e in environ if e.startswith(b"LD_LIBRARY_PATH=") or e.startswith(b"LD_PRELOAD=")]
    caps = tmp_path / "plugin/simulated-root/proc/driver/nvidia/capabilities/gpu0/mig"
    assert sorted(p.relative_to(caps).as_posix() for p in caps.rglob("access")) == [
        "gi1/access", "gi1/ci0/access", "gi2/access", "gi2/ci0/access",
    ]  # fmt: skip
    assert (caps / "gi1/access").read_text().startswith("DeviceFileMinor: 12\n")
