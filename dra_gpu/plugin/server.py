"""`dra-gpu kubelet-plugin`: wires discovery, slices, the gRPC services and HTTP endpoints on
one asyncio event loop, and shuts them down cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dra_gpu.discovery import discover, open_nvml
from dra_gpu.kube import Kube
from dra_gpu.plugin._proto import dra_health_v1alpha1_pb2_grpc as health_grpc
from dra_gpu.plugin._proto import dra_v1_pb2 as v1_pb
from dra_gpu.plugin._proto import dra_v1_pb2_grpc as v1_grpc
from dra_gpu.plugin._proto import dra_v1beta1_pb2_grpc as v1beta1_grpc
from dra_gpu.plugin._proto import pluginregistration_v1_pb2 as reg_pb
from dra_gpu.plugin._proto import pluginregistration_v1_pb2_grpc as reg_grpc
from dra_gpu.plugin.cdi import CdiSpecs
from dra_gpu.plugin.checkpoint import Checkpoint
from dra_gpu.plugin.device_nodes import DeviceNodes, create_simulated, find_modprobe
from dra_gpu.plugin.driver_files import DriverFiles
from dra_gpu.plugin.grpc_services import (
    DraV1beta1Service,
    DraV1Service,
    HealthService,
    NodeService,
    RegistrationService,
    serve_unix,
)
from dra_gpu.plugin.metrics import PluginMetrics
from dra_gpu.plugin.mig_lifecycle import MigInstances
from dra_gpu.plugin.prepare import Preparer
from dra_gpu.plugin.publisher import SlicePublisher
from dra_gpu.slices import build_slices

log = logging.getLogger(__name__)

UNIX_PATH_MAX = 108


@dataclass
class PluginConfig:
    node_name: str
    driver: str
    profile: str | None
    kubeconfig: str | None
    plugin_dir: Path
    registry_dir: Path
    cdi_dir: Path
    dev_root: Path
    http_address: str  # host:port; "" disables the HTTP endpoint
    driver_root: Path = Path("/")  # the NVIDIA driver's files, as this process sees them
    host_driver_root: str | None = None  # the same root as the container runtime sees it
    cdi_hook_path: str | None = None  # nvidia-cdi-hook on the host, for update-ldcache
    sweep_interval: float = 600.0
    sweep_grace: float = 60.0
    dynamic_mig: bool = False  # publish MIG placements, create instances at prepare

    @property
    def dra_socket(self) -> Path:
        return self.plugin_dir / "dra.sock"

    @property
    def registration_socket(self) -> Path:
        return self.registry_dir / f"{self.driver}-reg.sock"

    def check(self) -> None:
        for sock in (self.dra_socket, self.registration_socket):
            if len(str(sock)) >= UNIX_PATH_MAX:
                raise ValueError(f"socket path {sock} is longer than {UNIX_PATH_MAX - 1} bytes")


async def self_check(cfg: PluginConfig, timeout: float = 2.0) -> str | None:
    """None when both sockets answer as the kubelet would call them, else what failed."""
    try:
        async with grpc.aio.insecure_channel(f"unix://{cfg.registration_socket}") as ch:
            info = await reg_grpc.RegistrationStub(ch).GetInfo(reg_pb.InfoRequest(), timeout=timeout)
            if info.name != cfg.driver:
                return f"registration socket answers for driver {info.name!r}"
        async with grpc.aio.insecure_channel(f"unix://{cfg.dra_socket}") as ch:
            await v1_grpc.DRAPluginStub(ch).NodePrepareResources(
                v1_pb.NodePrepareResourcesRequest(), timeout=timeout
            )
    except grpc.aio.AioRpcError as exc:
        return f"{exc.code().name}: {exc.details()}"
    return None


class KubeletPlugin:
    def __init__(self, cfg: PluginConfig) -> None:
        self.cfg = cfg
        self.metrics = PluginMetrics()
        self.stopping = asyncio.Event()
        self.ready = asyncio.Event()

    async def run(self) -> None:
        cfg = self.cfg
        cfg.check()
        # A simulated node keeps its MIG state under its dev root, as the kernel keeps a GPU's.
        nvml, pcie_root = await asyncio.to_thread(
            open_nvml, cfg.profile, cfg.dev_root if cfg.profile else None
        )
        inventory = await asyncio.to_thread(discover, nvml, cfg.node_name, pcie_root, cfg.dynamic_mig)
        mig = (
            await asyncio.to_thread(MigInstances, nvml)
            if any(g.dynamic_mig for g in inventory.gpus)
            else None
        )
        if cfg.profile is not None:
            await asyncio.to_thread(create_simulated, inventory, cfg.dev_root)
        driver_files = await asyncio.to_thread(
            DriverFiles, cfg.driver_root, inventory.driver_version, cfg.host_driver_root, cfg.cdi_hook_path
        )
        kube = await Kube.connect(cfg.kubeconfig)
        cfg.plugin_dir.mkdir(parents=True, exist_ok=True)
        checkpoint = await asyncio.to_thread(Checkpoint, cfg.plugin_dir / "checkpoint.json")
        preparer = Preparer(
            cfg.driver,
            cfg.node_name,
            inventory,
            checkpoint,
            CdiSpecs(cfg.cdi_dir, cfg.driver),
            DeviceNodes(cfg.dev_root, modprobe=find_modprobe(cfg.driver_root)),
            kube,
            driver_files,
            mig,
        )
        counts = await asyncio.to_thread(preparer.reconcile)
        log.info("checkpoint reconciled with the CDI dir %s", " ".join(f"{k}={v}" for k, v in counts.items()))
        self.metrics.prepared_devices.set(preparer.prepared_device_count())
        publisher = SlicePublisher(
            kube,
            cfg.driver,
            cfg.node_name,
            lambda gen: build_slices(inventory, cfg.driver, gen),
            self.metrics,
        )
        await publisher.start()
        node = NodeService(preparer, self.metrics)
        health = HealthService(cfg.node_name, publisher.device_names)
        dra_server = await serve_unix(
            cfg.dra_socket,
            [
                (v1_grpc.add_DRAPluginServicer_to_server, DraV1Service(node)),
                (v1beta1_grpc.add_DRAPluginServicer_to_server, DraV1beta1Service(node)),
                (health_grpc.add_DRAResourceHealthServicer_to_server, health),
            ],
        )
        registration = RegistrationService(cfg.driver, str(cfg.dra_socket))
        reg_server = await serve_unix(
            cfg.registration_socket, [(reg_grpc.add_RegistrationServicer_to_server, registration)]
        )
        http = await self._start_http()
        tasks = [
            asyncio.create_task(publisher.run(), name="publisher"),
            asyncio.create_task(self._sweep(preparer), name="sweeper"),
        ]
        log.info(
            "kubelet plugin serving driver=%s node=%s dra_socket=%s registration_socket=%s",
            cfg.driver,
            cfg.node_name,
            cfg.dra_socket,
            cfg.registration_socket,
        )
        self.ready.set()
        try:
            await self.stopping.wait()
        finally:
            log.info("kubelet plugin stopping")
            # Registration socket first: the kubelet stops sending work before the service goes.
            await reg_server.stop(grace=1)
            cfg.registration_socket.unlink(missing_ok=True)
            await dra_server.stop(grace=5)
            cfg.dra_socket.unlink(missing_ok=True)
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if http is not None:
                await http.cleanup()
            await kube.close()

    async def _sweep(self, preparer: Preparer) -> None:
        while True:
            await asyncio.sleep(self.cfg.sweep_interval)
            try:
                await preparer.sweep(self.cfg.sweep_grace)
                self.metrics.prepared_devices.set(preparer.prepared_device_count())
            except Exception as exc:
                log.warning("stale-claim sweep failed error=%r", str(exc))

    async def _start_http(self) -> web.AppRunner | None:
        if not self.cfg.http_address:
            return None
        host, _, port = self.cfg.http_address.rpartition(":")

        async def healthz(_request: web.Request) -> web.Response:
            problem = await self_check(self.cfg)
            if problem is None:
                return web.Response(text="ok\n")
            return web.Response(status=503, text=f"unhealthy: {problem}\n")

        async def metrics(_request: web.Request) -> web.Response:
            return web.Response(
                body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
            )

        app = web.Application()
        app.add_routes([web.get("/healthz", healthz), web.get("/metrics", metrics)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host or "0.0.0.0", int(port)).start()
        return runner


def run(cfg: PluginConfig) -> int:
    plugin = KubeletPlugin(cfg)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, plugin.stopping.set)
        await plugin.run()

    asyncio.run(main())
    return 0
