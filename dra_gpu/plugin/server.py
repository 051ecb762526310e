"""`dra-gpu kubelet-plugin`: builds the GPU driver (discovery, device nodes, checkpoint, CDI,
prepare) and runs it through the kubelet-plugin layer, with the stale-claim sweeper and the HTTP
endpoints, on one asyncio event loop; shuts them down cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dra_gpu.device_catalog import DeviceCatalog
from dra_gpu.health.claim_status import ClaimStatusWriter
from dra_gpu.health.node import HealthConfig, HealthNode
from dra_gpu.kube import Kube, small_tls_read_buffers
from dra_gpu.kubeletplugin.heap_trim import limit_arenas
from dra_gpu.kubeletplugin.helper import KubeletPluginHelper, Sockets
from dra_gpu.kubeletplugin.metrics import PluginMetrics
from dra_gpu.kubeletplugin.publisher import BACKOFF
from dra_gpu.node_backend import open_backend
from dra_gpu.plugin.cdi import CdiSpecs
from dra_gpu.plugin.checkpoint import COMPLETED, Checkpoint
from dra_gpu.plugin.claim_cache import ClaimCache
from dra_gpu.plugin.device_nodes import DeviceNodes, find_modprobe
from dra_gpu.plugin.driver_files import DriverFiles
from dra_gpu.plugin.gpu_driver import GpuDriver
from dra_gpu.plugin.mig_binding import MigBinder
from dra_gpu.plugin.mig_lifecycle import MigInstances
from dra_gpu.plugin.prepare import Preparer
from dra_gpu.plugin.sharing import node_sharing

log = logging.getLogger(__name__)
NOT_REGISTERED = "not ready: the kubelet has not confirmed the registration\n"


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
    # The NVIDIA driver's files, as this process sees them; None: "/" (a simulated node: the
    # profile's simulated driver, built on first use).
    driver_root: Path | None = None
    host_driver_root: str | None = None  # the same root as the container runtime sees it
    cdi_hook_path: str | None = None  # nvidia-cdi-hook on the host, for update-ldcache
    sweep_interval: float = 600.0
    sweep_grace: float = 60.0
    dynamic_mig: bool = False  # publish MIG placements, create instances at prepare
    health: HealthConfig = field(default_factory=HealthConfig)
    memory_shares: bool = False  # whole GPUs shareable by memory (consumable capacity)
    claim_watch: bool = True  # prepare reads claims from a watch (dynamic MIG watches anyway)

    @property
    def sockets(self) -> Sockets:
        return Sockets.for_driver(self.driver, self.plugin_dir, self.registry_dir)

    def check(self) -> None:
        self.sockets.check()


class KubeletPlugin:
    def __init__(self, cfg: PluginConfig) -> None:
        self.cfg = cfg
        self.metrics = PluginMetrics()
        self.stopping = asyncio.Event()
        self.ready = asyncio.Event()

    async def run(self) -> None:
        cfg = self.cfg
        cfg.check()
        # One NVML for the whole plugin: the driver root's libnvidia-ml.so.1 (a simulated node's
        # device nodes are made first, under its dev root).
        backend = await asyncio.to_thread(open_backend, cfg.profile, cfg.driver_root, cfg.dev_root)
        inventory = await asyncio.to_thread(backend.discover, cfg.node_name, cfg.dynamic_mig)
        # The node's devices, derived once for the slices, prepare, health and claim status.
        catalog = DeviceCatalog.build(inventory, cfg.memory_shares)
        dynamic_mig = bool(catalog.dynamic_gpus)
        # Always: a claim prepared while dynamic MIG was on keeps its instances after it is turned
        # off, and its unprepare must still destroy them.
        mig = await asyncio.to_thread(MigInstances, backend.nvml)
        driver_files = await asyncio.to_thread(
            DriverFiles,
            backend.driver_root,
            inventory.driver_version,
            cfg.host_driver_root,
            cfg.cdi_hook_path,
        )
        kube = await Kube.connect(cfg.kubeconfig)
        cfg.plugin_dir.mkdir(parents=True, exist_ok=True)
        checkpoint = await asyncio.to_thread(Checkpoint, cfg.plugin_dir / "checkpoint.json")
        # One watch of the claims serves the prepare path and dynamic MIG's binding conditions.
        claims = (
            ClaimCache(kube, cfg.driver, cfg.node_name, backoff=BACKOFF)
            if cfg.claim_watch or dynamic_mig
            else None
        )
        preparer = Preparer(
            cfg.driver,
            cfg.node_name,
            catalog,
            checkpoint,
            CdiSpecs(cfg.cdi_dir, cfg.driver),
            DeviceNodes(cfg.dev_root, modprobe=find_modprobe(backend.driver_root)),
            kube,
            driver_files,
            sharing=node_sharing(cfg.plugin_dir / "mps", driver_files, backend.nvml, backend.tool_env),
            mig=mig,
            cache=claims,
        )
        if checkpoint.rebuild_pending:  # the file was corrupt: records from the specs and the API
            await preparer.rebuild(kube)
        counts = await asyncio.to_thread(preparer.reconcile)
        log.info("checkpoint reconciled with the CDI dir %s", " ".join(f"{k}={v}" for k, v in counts.items()))
        health = HealthNode(
            cfg.health,
            cfg.driver,
            catalog,
            cfg.plugin_dir,
            self.metrics.registry,
            backend.nvml,
            backend.events,
            made_instances=preparer.instances.made_instances,
        )
        claim_status = None
        if cfg.health.claim_status:

            def prepared_claims() -> list[tuple[str, str, str, list[dict[str, Any]]]]:
                return [
                    (r.namespace, r.name, r.uid, r.status_devices())
                    for r in checkpoint.records()
                    if r.state == COMPLETED
                ]

            claim_status = ClaimStatusWriter(kube, cfg.driver, catalog, health.manager, prepared_claims)
        driver = GpuDriver(cfg.driver, cfg.node_name, catalog, preparer, health.manager, claim_status)
        helper = KubeletPluginHelper(cfg.driver, cfg.node_name, driver, kube, cfg.sockets, self.metrics)
        await helper.start()
        health.subscribe(helper.publisher.refresh)
        health.subscribe(helper.health_changed)
        if claim_status is not None:
            health.subscribe(claim_status.sync)
        await health.start()
        http = await self._start_http(helper)
        sweeper = asyncio.create_task(self._sweep(preparer), name="sweeper")
        # Dynamic MIG: instances are made between allocation and binding (binding conditions).
        binder = MigBinder(cfg.driver, cfg.node_name, preparer, kube) if dynamic_mig else None
        if binder is not None and claims is not None:
            claims.subscribe(binder.on_list, binder.on_event)
        watching = asyncio.create_task(claims.run(), name="claim-watch") if claims is not None else None
        log.info(
            "kubelet plugin serving driver=%s node=%s dra_socket=%s registration_socket=%s",
            cfg.driver,
            cfg.node_name,
            cfg.sockets.dra,
            cfg.sockets.registration,
        )
        self.ready.set()
        helper.heap.once_idle()  # the start-up's garbage, once it has settled
        try:
            await self.stopping.wait()
        finally:
            log.info("kubelet plugin stopping")
            await health.stop()
            await helper.stop()
            if watching is not None:
                watching.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watching
            if binder is not None:
                await binder.stop()
            if claim_status is not None:
                await claim_status.close()
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            if http is not None:
                await http.cleanup()
            await kube.close()

    async def _sweep(self, preparer: Preparer) -> None:
        while True:
            await asyncio.sleep(self.cfg.sweep_interval)
            try:
                await preparer.sweep(self.cfg.sweep_grace)
            except Exception as exc:
                log.warning("stale-claim sweep failed error=%r", str(exc))

    async def _start_http(self, helper: KubeletPluginHelper) -> web.AppRunner | None:
        if not self.cfg.http_address:
            return None
        host, _, port = self.cfg.http_address.rpartition(":")

        async def healthz(_request: web.Request) -> web.Response:
            problem = await helper.self_check()
            if problem is None:
                return web.Response(text="ok\n")
            return web.Response(status=503, text=f"unhealthy: {problem}\n")

        async def readyz(request: web.Request) -> web.Response:
            # Until the kubelet confirmed the registration it answers prepares with "not registered".
            if not helper.registration.registered.is_set():
                return web.Response(status=503, text=NOT_REGISTERED)
            return await healthz(request)

        async def metrics(_request: web.Request) -> web.Response:
            return web.Response(
                body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
            )

        app = web.Application()
        routes = {"/healthz": healthz, "/readyz": readyz, "/metrics": metrics}
        app.add_routes([web.get(path, handler) for path, handler in routes.items()])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host or "0.0.0.0", int(port)).start()
        return runner


def run(cfg: PluginConfig) -> int:
    limit_arenas()  # before any thread starts
    small_tls_read_buffers()
    plugin = KubeletPlugin(cfg)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, plugin.stopping.set)
        await plugin.run()

    asyncio.run(main())
    return 0
