"""`dra-gpu kubelet-plugin`: builds the GPU driver (discovery, device nodes, checkpoint, CDI,
prepare) and runs it through the kubelet-plugin layer, with the stale-claim sweeper and the HTTP
endpoints, on one asyncio event loop; shuts them down cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dra_gpu.common.build_info import register_build_info
from dra_gpu.common.exit_codes import EXIT_DRIVER_CHANGED, EXIT_OK
from dra_gpu.discovery.driver_versions import library_version
from dra_gpu.health.claim_status import ClaimStatusWriter
from dra_gpu.health.node import HealthConfig, HealthNode
from dra_gpu.kube.api import Kube, server_minor_version, small_tls_read_buffers
from dra_gpu.kube.values import parse_quantity
from dra_gpu.kubeletplugin.claims import ClaimFetcher
from dra_gpu.kubeletplugin.heap_trim import freeze_startup_objects, limit_arenas
from dra_gpu.kubeletplugin.helper import KubeletPluginHelper, Sockets
from dra_gpu.kubeletplugin.instance_lock import InstanceLock
from dra_gpu.kubeletplugin.metrics import PluginMetrics
from dra_gpu.kubeletplugin.publisher import BACKOFF
from dra_gpu.node.backend import NodeBackend, open_backend
from dra_gpu.node.catalog import DeviceCatalog, DeviceKind
from dra_gpu.node.settings import NodeSettings
from dra_gpu.plugin.cdi import CdiSpecs
from dra_gpu.plugin.checkpoint import COMPLETED, Checkpoint
from dra_gpu.plugin.claim_cache import ClaimCache
from dra_gpu.plugin.device_metadata import Decision, decide, kubelet_version
from dra_gpu.plugin.device_nodes import DeviceNodes, find_modprobe
from dra_gpu.plugin.driver_files import DriverFiles
from dra_gpu.plugin.driver_upgrade import POLL_SECONDS, DriverVersions, DriverVersionWatch
from dra_gpu.plugin.gpu_driver import GpuDriver
from dra_gpu.plugin.memory_limits import MemoryLimits
from dra_gpu.plugin.memory_limits import detect as detect_memory_limits
from dra_gpu.plugin.mig_binding import MigBinder
from dra_gpu.plugin.mig_lifecycle import MigInstances
from dra_gpu.plugin.mps import MIN_SHM_SIZE
from dra_gpu.plugin.mps_pods import DaemonPods, PluginPod
from dra_gpu.plugin.prepare import Preparer
from dra_gpu.plugin.sharing import node_sharing

log = logging.getLogger(__name__)
NOT_REGISTERED = "not ready: the kubelet has not confirmed the registration\n"


@dataclass(frozen=True)
class MpsSettings:
    """Where the MPS daemons run and what they get."""

    daemons: str = "auto"  # pod | process | auto (pod when the plugin runs in a pod)
    shm_size: int | None = None  # bytes of each daemon's /dev/shm; None: half the node's memory
    resources: dict[str, Any] = field(default_factory=dict)  # each daemon pod's requests/limits

    @classmethod
    def parse(cls, daemons: str, shm_size: str, resources: str) -> MpsSettings:
        """From the flags; ValueError naming the flag for a value that cannot be used."""
        if daemons not in ("auto", "pod", "process"):  # argparse does not check an env default
            raise ValueError(
                f"--mps-daemons (or $DRA_GPU_MPS_DAEMONS): {daemons!r} is not auto, pod or process"
            )
        size = None
        if shm_size:
            try:
                size = int(parse_quantity(shm_size))
            except ValueError as exc:
                raise ValueError(f"--mps-shm-size (or $DRA_GPU_MPS_SHM_SIZE): {shm_size!r}: {exc}") from exc
            if size < MIN_SHM_SIZE:
                raise ValueError(f"--mps-shm-size (or $DRA_GPU_MPS_SHM_SIZE): {shm_size!r} is under 64Mi")
        parsed: dict[str, Any] = {}
        if resources:
            try:
                parsed = json.loads(resources)
            except ValueError as exc:
                raise ValueError(
                    f"--mps-daemon-resources (or $DRA_GPU_MPS_DAEMON_RESOURCES): not JSON: {exc}"
                ) from exc
            if not isinstance(parsed, dict) or not set(parsed) <= {"requests", "limits", "claims"}:
                raise ValueError(
                    "--mps-daemon-resources (or $DRA_GPU_MPS_DAEMON_RESOURCES): "
                    "an object of requests and limits"
                )
        return cls(daemons, size, parsed)

    def plugin_pod(self, node_name: str) -> PluginPod | None:
        """The plugin's pod when the daemons are to be pods (ValueError when that cannot be)."""
        name, namespace = os.environ.get("POD_NAME", ""), os.environ.get("POD_NAMESPACE", "")
        if self.daemons == "process" or (self.daemons == "auto" and not (name and namespace)):
            return None
        if not (name and namespace):
            raise ValueError(
                "--mps-daemons=pod: the plugin's pod is not known ($POD_NAME, $POD_NAMESPACE unset)"
            )
        return PluginPod(name, namespace, node_name)


@dataclass(frozen=True)
class PluginConfig:
    """The node's settings and what only the plugin has."""

    node: NodeSettings
    kubeconfig: str | None = None  # None: in-cluster
    http_address: str = ""  # host:port; "" disables the HTTP endpoint
    cdi_hook_path: str | None = None  # nvidia-cdi-hook on the host, for NVIDIA's CDI hooks
    driver_memory_limits: str = "auto"  # memory shares held by the driver where it can; "off"
    sweep_interval: float = 600.0
    sweep_grace: float = 60.0
    health: HealthConfig = field(default_factory=HealthConfig)
    claim_watch: bool = True  # prepare reads claims from a watch (dynamic MIG watches anyway)
    device_metadata: str = "auto"  # KEP-5304 device metadata: auto (kubelet 1.37+), on, off
    mps: MpsSettings = field(default_factory=MpsSettings)
    # The plugin's pod UID: rolling updates (sockets named after it, beside another instance's,
    # work serialised on the plugin directory's lock); "": the fixed names, one instance.
    pod_uid: str = ""
    successor_wait: float = 10.0  # at SIGTERM: seconds to wait for another instance to answer

    @property
    def sockets(self) -> Sockets:
        return Sockets.for_instance(
            self.node.driver, self.node.plugin_dir, self.node.registry_dir, self.pod_uid
        )

    def check(self) -> None:
        self.sockets.check()


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _warn_unknown_mig_profiles(wanted: tuple[str, ...], catalog: DeviceCatalog) -> None:
    """A profile no dynamic-MIG GPU of this node has: another GPU model's (one DaemonSet's list
    serves them all), or a typo; said once, at start."""
    if not wanted or not catalog.dynamic_gpus:
        return
    known = {p.name for g in catalog.dynamic_gpus for p in g.mig_profiles}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        log.warning(
            "--mig-profiles names profiles no GPU of this node has profiles=%s known=%s",
            ",".join(unknown),
            ",".join(sorted(known)),
        )
    for gpu in catalog.dynamic_gpus:
        if not any(d.placement is not None for d in catalog.of_gpu(gpu.uuid)):
            log.warning("--mig-profiles leaves this GPU no MIG placement to offer gpu=%s", gpu.device_name)


class KubeletPlugin:
    def __init__(self, cfg: PluginConfig, freeze_startup: bool = False) -> None:
        """`freeze_startup`: the process is the plugin's own (not a test's), see `run`."""
        self.cfg = cfg
        self.freeze_startup = freeze_startup
        self.metrics = PluginMetrics()
        register_build_info(self.metrics.registry, "kubelet-plugin", cfg.node.node_name)
        self.stopping = asyncio.Event()
        self.ready = asyncio.Event()
        self.driver_changed: DriverVersions | None = None  # set: stopped to load the new driver's NVML

    @property
    def exit_code(self) -> int:
        return EXIT_DRIVER_CHANGED if self.driver_changed is not None else EXIT_OK

    def _watch_for(self, backend: NodeBackend, host_root: str | None) -> DriverVersionWatch | None:
        """The upgrade watch of the NVML loaded (none when its file name carries no version)."""
        loaded = library_version(backend.nvml_library)
        if loaded is None:
            return None
        loop = asyncio.get_running_loop()

        def upgraded(versions: DriverVersions) -> None:  # from a prepare, the poll or a thread
            loop.call_soon_threadsafe(self._stop_for_upgrade, watch, versions)

        watch = DriverVersionWatch(backend.driver_root, backend.dev_root, loaded, host_root, upgraded)
        return watch

    def _stop_for_upgrade(self, watch: DriverVersionWatch, versions: DriverVersions) -> None:
        if self.driver_changed is None:
            self.driver_changed = versions
            log.warning("%s: stopping (exit status %d)", watch.problem(versions), EXIT_DRIVER_CHANGED)
        self.stopping.set()

    def _memory_limits(
        self, backend: NodeBackend, catalog: DeviceCatalog, driver_files: DriverFiles
    ) -> MemoryLimits:
        """Whether memory shares are held by the driver on this node (said once, at start)."""
        shared = [d.gpu.uuid for d in catalog.of_kind(DeviceKind.GPU) if d.shared]
        limits = detect_memory_limits(
            mode=self.cfg.driver_memory_limits,
            nvml=backend.nvml,
            nvml_library=backend.nvml_library,
            driver_version=catalog.inventory.driver_version,
            gpus=[(u, backend.nvml.nvmlDeviceGetHandleByUUID(u)) for u in shared],
            hook_path=self.cfg.cdi_hook_path,
            host_driver_root=driver_files.host_root,
            hook_env=backend.tool_env,
            # What the hook said it has at start (None: no hook, or not asked).
            hook_subcommands=driver_files.hook.subcommands if driver_files.hook else None,
        )
        log.info(
            "memory shares enforced_by=%s reason=%r%s",
            limits.enforcement.kind,
            limits.enforcement.reason,
            f" unsupported_gpus={','.join(sorted(limits.unsupported))}" if limits.unsupported else "",
        )
        return limits

    def _daemon_pods(self, kube: Kube) -> DaemonPods | None:
        plugin = self.cfg.mps.plugin_pod(self.cfg.node.node_name)
        if plugin is None:
            log.info("MPS daemons run as this node's processes (not in a pod, or --mps-daemons=process)")
            return None
        log.info("MPS daemons run as pods of their own in namespace %s", plugin.namespace)
        return DaemonPods(kube, asyncio.get_running_loop(), plugin, self.cfg.mps.resources)

    async def run(self) -> None:
        """The composition root: each component is started, then its teardown registered on one
        exit stack, so what started is stopped in the reverse order however the run ends. The
        order of the starts is the reverse of the order of the stops: the health monitor first
        (no more slice updates), then the kubelet's sockets (no more prepares), the claim watch,
        the binder, the claim statuses, the sweeper, the HTTP endpoint and, last, the API client.

        With rolling updates (a pod UID) another instance may run beside this one: the checkpoint
        is read, rebuilt and reconciled under the instance lock, as are the kubelet's calls and
        the sweeps; at SIGTERM this one keeps serving until another answers (`successor_wait`)."""
        cfg, node = self.cfg, self.cfg.node
        cfg.check()
        # One NVML for the whole plugin: the driver root's libnvidia-ml.so.1 (a simulated node's
        # device nodes are made first, under its dev root).
        backend = await asyncio.to_thread(
            open_backend, node.profile, node.driver_root, node.dev_root, node.cache_dir
        )
        inventory = await asyncio.to_thread(backend.discover, node.node_name, node.dynamic_mig)
        # The node's devices, derived once for the slices, prepare, health and claim status.
        catalog = DeviceCatalog.build(inventory, node.memory_shares, mig_profiles=node.mig_profiles)
        _warn_unknown_mig_profiles(node.mig_profiles, catalog)
        dynamic_mig = bool(catalog.dynamic_gpus)
        # Always: a claim prepared while dynamic MIG was on keeps its instances after it is turned
        # off, and its unprepare must still destroy them.
        mig = await asyncio.to_thread(MigInstances, backend.nvml)
        watch = self._watch_for(backend, node.host_driver_root)
        driver_files = await asyncio.to_thread(
            DriverFiles,
            backend.driver_root,
            inventory.driver_version,
            node.host_driver_root,
            cfg.cdi_hook_path,
            watch=watch,
        )
        memory_limits = None
        if node.memory_shares:
            memory_limits = await asyncio.to_thread(self._memory_limits, backend, catalog, driver_files)
        async with contextlib.AsyncExitStack() as stack:
            kube = await Kube.connect(cfg.kubeconfig)
            kube.rejections.register(self.metrics.registry)
            stack.push_async_callback(kube.close)
            node.plugin_dir.mkdir(parents=True, exist_ok=True)
            lock = InstanceLock.in_dir(node.plugin_dir, rolling=cfg.sockets.rolling)
            stack.callback(lock.close)
            metadata = await self._device_metadata(kube)
            log.info("%s", metadata.line())
            # The start-up's reads and writes of the node's claims, under the instance lock.
            startup = contextlib.AsyncExitStack()
            stack.push_async_callback(startup.aclose)
            await startup.enter_async_context(lock.hold("the start-up reconcile"))
            checkpoint = await asyncio.to_thread(Checkpoint, node.checkpoint)
            # One watch of the claims serves the prepare path and dynamic MIG's binding conditions.
            claims = (
                ClaimCache(kube, node.driver, node.node_name, backoff=BACKOFF)
                if cfg.claim_watch or dynamic_mig
                else None
            )
            preparer = Preparer(
                node.driver,
                node.node_name,
                catalog,
                checkpoint,
                CdiSpecs(node.cdi_dir, node.driver),
                DeviceNodes(node.dev_root, modprobe=find_modprobe(backend.driver_root)),
                kube,
                driver_files,
                sharing=node_sharing(
                    node.plugin_dir / "mps",
                    driver_files,
                    backend.nvml,
                    backend.tool_env,
                    memory_limits,
                    daemon_pods=self._daemon_pods(kube),
                    shm_size=cfg.mps.shm_size,
                ),
                mig=mig,
                device_metadata=metadata.enabled,
            )
            if checkpoint.rebuild_pending:  # the file was corrupt: records from the specs and the API
                await preparer.rebuild(kube)
            counts = await asyncio.to_thread(preparer.reconcile)
            log.info(
                "checkpoint reconciled with the CDI dir %s", " ".join(f"{k}={v}" for k, v in counts.items())
            )
            # From now on each new hold first re-reads what another instance changed.
            lock.on_acquired = preparer.journal.refresh
            await startup.aclose()
            health = HealthNode(
                cfg.health,
                node.driver,
                catalog,
                node.plugin_dir,
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

                claim_status = ClaimStatusWriter(kube, node.driver, catalog, health.manager, prepared_claims)
            minor = await server_minor_version(kube)
            log.info("apiserver 1.%s: %s slice layout", minor, "1.34's" if minor == 34 else "the 1.35+")
            driver = GpuDriver(
                node.driver,
                node.node_name,
                catalog,
                preparer,
                health.manager,
                claim_status,
                counters_beside_devices=minor == 34,  # 1.34 validates counter sets per slice
            )
            helper = KubeletPluginHelper(
                node.driver,
                node.node_name,
                driver,
                kube,
                cfg.sockets,
                self.metrics,
                claims=ClaimFetcher(kube, claims),  # the watch's claims, else a GET
                lock=lock,
            )
            http = await self._start_http(helper)
            if http is not None:
                stack.push_async_callback(http.cleanup)
            sweeper = asyncio.create_task(self._sweep(preparer, lock), name="sweeper")
            stack.push_async_callback(_cancel, sweeper)
            if watch is not None:
                watching_driver = asyncio.create_task(self._watch_driver(watch), name="driver-watch")
                stack.push_async_callback(_cancel, watching_driver)
            if claim_status is not None:
                stack.push_async_callback(claim_status.close)
            # Dynamic MIG: instances are made between allocation and binding (binding conditions).
            if dynamic_mig:
                binder = MigBinder(node.driver, node.node_name, preparer, kube, hold=lock.hold)
                stack.push_async_callback(binder.stop)
                if claims is not None:
                    claims.subscribe(binder.on_list, binder.on_event)
            if claims is not None:
                watching = asyncio.create_task(claims.run(), name="claim-watch")
                stack.push_async_callback(_cancel, watching)
            if self.freeze_startup:  # before the sockets are served: no request waits for it
                freeze_startup_objects()
            await helper.start()
            stack.push_async_callback(helper.stop)
            # The kubelet hears first (health_changed says why), then the taint goes out.
            health.subscribe(helper.health_changed)
            health.subscribe(helper.publisher.refresh)
            if claim_status is not None:
                health.subscribe(claim_status.sync)
            await health.start()
            stack.push_async_callback(health.stop)
            stack.callback(log.info, "kubelet plugin stopping")
            log.info(
                "kubelet plugin serving driver=%s node=%s dra_socket=%s registration_socket=%s",
                node.driver,
                node.node_name,
                cfg.sockets.dra,
                cfg.sockets.registration,
            )
            self.ready.set()
            helper.heap.once_idle()  # the start-up's garbage, once it has settled
            await self.stopping.wait()
            if self.driver_changed is None:  # a restart for a new driver keeps the pod (and names)
                await helper.wait_for_successor(cfg.successor_wait)

    async def _device_metadata(self, kube: Kube) -> Decision:
        """Whether claims get KEP-5304 device metadata: with auto, by the version of this node's
        kubelet (its Node object, read once; with on, only for the line that says so)."""
        mode = self.cfg.device_metadata
        if mode == "off":
            return decide(mode, None)
        name = self.cfg.node.node_name
        try:
            node = await kube.get_json(f"/api/v1/nodes/{name}")
        except Exception as exc:  # no answer is no version: auto stays off, and says why
            return decide(mode, None, f"node {name} could not be read: {exc}")
        if node is None:
            return decide(mode, None, f"no node {name} in the API")
        return decide(mode, kubelet_version(node))

    async def _watch_driver(self, watch: DriverVersionWatch) -> None:
        """Between prepares too: a restarting container of a prepared claim needs its spec
        rewritten for the new driver, which the restarted plugin does."""
        while True:
            await asyncio.sleep(POLL_SECONDS)
            try:
                await asyncio.to_thread(watch.poll)
            except Exception as exc:
                log.warning("driver version check failed error=%r", str(exc))

    async def _sweep(self, preparer: Preparer, lock: InstanceLock) -> None:
        while True:
            await asyncio.sleep(self.cfg.sweep_interval)
            try:
                async with lock.hold("the stale-claim sweep"):
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
    # What start-up made lives until exit: out of every later full collection's way (heap_trim.py).
    plugin = KubeletPlugin(cfg, freeze_startup=True)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, plugin.stopping.set)
        await plugin.run()

    asyncio.run(main())
    return plugin.exit_code
