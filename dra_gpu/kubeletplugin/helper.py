"""Runs a Driver as a kubelet plugin (Go: kubeletplugin.Start and its Helper).

start() publishes the driver's ResourceSlices, then serves the DRA socket (node service v1 and
v1beta1, health stream) and, last, the registration socket, so the kubelet finds a plugin that is
ready. stop() goes in the reverse order: the registration socket first, so the kubelet stops sending
work before the DRA service goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from dra_gpu.kube.api import Kube
from dra_gpu.kubeletplugin._proto import dra_health_v1_pb2 as health_v1_pb
from dra_gpu.kubeletplugin._proto import dra_health_v1_pb2_grpc as health_v1_grpc
from dra_gpu.kubeletplugin._proto import dra_health_v1alpha1_pb2_grpc as health_grpc
from dra_gpu.kubeletplugin._proto import dra_v1_pb2_grpc as v1_grpc
from dra_gpu.kubeletplugin._proto import dra_v1beta1_pb2_grpc as v1beta1_grpc
from dra_gpu.kubeletplugin._proto import pluginregistration_v1_pb2_grpc as reg_grpc
from dra_gpu.kubeletplugin.claims import ClaimFetcher
from dra_gpu.kubeletplugin.driver import Driver
from dra_gpu.kubeletplugin.health import HEALTH_RESEND_SECONDS, HEALTH_SEND_SECONDS, HealthService
from dra_gpu.kubeletplugin.metrics import PluginMetrics
from dra_gpu.kubeletplugin.node_service import DraV1beta1Service, DraV1Service, NodeService
from dra_gpu.kubeletplugin.publisher import SlicePublisher
from dra_gpu.kubeletplugin.registration import RegistrationService
from dra_gpu.kubeletplugin.self_check import SelfCheck

log = logging.getLogger(__name__)

UNIX_PATH_MAX = 108


@dataclass(frozen=True)
class Sockets:
    """The DRA socket in the plugin dir and the registration socket the kubelet's watcher finds."""

    dra: Path
    registration: Path

    @classmethod
    def for_driver(cls, driver_name: str, plugin_dir: Path, registry_dir: Path) -> Sockets:
        return cls(plugin_dir / "dra.sock", registry_dir / f"{driver_name}-reg.sock")

    def check(self) -> None:
        for sock in (self.dra, self.registration):
            if len(str(sock)) >= UNIX_PATH_MAX:
                raise ValueError(f"socket path {sock} is longer than {UNIX_PATH_MAX - 1} bytes")


async def serve_unix(path: Path, servicers: list[tuple[Callable[[Any, Any], None], Any]]) -> Any:
    """A grpc.aio server on a unix socket: stale socket removed first, owner-only permissions."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        path.unlink()
    server = grpc.aio.server()
    for add, servicer in servicers:
        add(servicer, server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    os.chmod(path, 0o600)
    return server


class KubeletPluginHelper:
    def __init__(
        self,
        driver_name: str,
        node_name: str,
        driver: Driver,
        kube: Kube,
        sockets: Sockets,
        metrics: PluginMetrics,
        health_resend_seconds: float = HEALTH_RESEND_SECONDS,
        claims: ClaimFetcher | None = None,
    ) -> None:
        """`claims`: where a prepare's claim is read; default: a GET through `kube`."""
        self.driver_name = driver_name
        self.sockets = sockets
        self.publisher = SlicePublisher(
            kube,
            driver_name,
            node_name,
            driver.resource_slices,
            metrics,
            on_dropped=driver.slice_fields_dropped,
        )
        node = NodeService(driver, claims or ClaimFetcher(kube), metrics)
        self.heap = node.heap
        self.health = HealthService(driver.device_health, health_resend_seconds)
        self.health_v1 = HealthService(driver.device_health, health_resend_seconds, pb=health_v1_pb)
        self._dra_servicers: list[tuple[Callable[[Any, Any], None], Any]] = [
            (v1_grpc.add_DRAPluginServicer_to_server, DraV1Service(node)),
            (v1beta1_grpc.add_DRAPluginServicer_to_server, DraV1beta1Service(node)),
            (health_grpc.add_DRAResourceHealthServicer_to_server, self.health),
            (health_v1_grpc.add_DRAResourceHealthServicer_to_server, self.health_v1),
        ]
        self.registration = RegistrationService(driver_name, str(sockets.dra))
        self._self_check = SelfCheck(sockets.registration, sockets.dra, driver_name)
        self._dra_server: Any = None
        self._registration_server: Any = None
        self._publishing: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.sockets.check()
        await self.publisher.start()
        self._dra_server = await serve_unix(self.sockets.dra, self._dra_servicers)
        self._registration_server = await serve_unix(
            self.sockets.registration,
            [(reg_grpc.add_RegistrationServicer_to_server, self.registration)],
        )
        self._publishing = asyncio.create_task(self.publisher.run(), name="publisher")

    async def stop(self) -> None:
        await self._self_check.close()  # probes from now on say "stopping", not a socket error
        if self._registration_server is not None:
            await self._registration_server.stop(grace=1)
            self.sockets.registration.unlink(missing_ok=True)
        if self._dra_server is not None:
            await self._dra_server.stop(grace=5)
            self.sockets.dra.unlink(missing_ok=True)
        if self._publishing is not None:
            self._publishing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._publishing

    async def health_changed(self) -> None:
        """The driver's device health changed: every open health stream sends it now; returns once
        they have written it (or after HEALTH_SEND_SECONDS). Called before the taint is published:
        the kubelet puts a device's health into a pod's status only when it syncs the pod, and an
        evicted pod is synced once before its containers are killed and next after its claims are
        unprepared, so health that comes after the eviction never shows in the pod's status."""
        self.health.notify()
        self.health_v1.notify()
        sent = await asyncio.gather(self.health.sent(), self.health_v1.sent())
        if not all(sent):
            log.warning(
                "device health change not written to every kubelet health stream within %.1fs; "
                "the slices are published anyway",
                HEALTH_SEND_SECONDS,
            )

    async def self_check(self, timeout: float = 2.0) -> str | None:
        """None when both sockets answer as the kubelet calls them, else what failed (self_check.py:
        two long-lived channels, one check at a time, a result reused for a second)."""
        return await self._self_check.check(timeout)
