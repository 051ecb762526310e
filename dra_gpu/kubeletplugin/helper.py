"""Runs a Driver as a kubelet plugin (Go: kubeletplugin.Start and its Helper).

start() publishes the driver's ResourceSlices, then serves the DRA socket (node service v1 and
v1beta1, health stream) and, last, the registration socket, so the kubelet finds a plugin that is
ready. stop() goes in the reverse order: the registration socket first, so the kubelet stops sending
work before the DRA service goes.

Rolling updates (Go: the RollingUpdate option): with the pod's UID each instance names its sockets
after it (`<driver>-<uid>-reg.sock`, `dra-<uid>.sock`), so a new pod registers beside the old one
and the kubelet (1.33+) sends its calls to the newer, falling back to the older when it goes. The
two serialise their work on the plugin directory's lock (instance_lock). An instance removes its
own sockets at exit; a starting one removes the unique-named sockets of this driver that nobody
listens on any more (an instance that was killed). A stopping instance first waits, bounded, until
another instance of the driver answers on its registration socket (`wait_for_successor`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import hashlib
import logging
import os
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from tenacity import AsyncRetrying, retry_if_result, stop_after_delay

from dra_gpu.kube.api import Backoff, Kube
from dra_gpu.kubeletplugin._proto import dra_health_v1_pb2 as health_v1_pb
from dra_gpu.kubeletplugin._proto import dra_health_v1_pb2_grpc as health_v1_grpc
from dra_gpu.kubeletplugin._proto import dra_health_v1alpha1_pb2_grpc as health_grpc
from dra_gpu.kubeletplugin._proto import dra_v1_pb2_grpc as v1_grpc
from dra_gpu.kubeletplugin._proto import dra_v1beta1_pb2_grpc as v1beta1_grpc
from dra_gpu.kubeletplugin._proto import pluginregistration_v1_pb2 as reg_pb
from dra_gpu.kubeletplugin._proto import pluginregistration_v1_pb2_grpc as reg_grpc
from dra_gpu.kubeletplugin.claims import ClaimFetcher
from dra_gpu.kubeletplugin.driver import Driver
from dra_gpu.kubeletplugin.health import HEALTH_RESEND_SECONDS, HEALTH_SEND_SECONDS, HealthService
from dra_gpu.kubeletplugin.instance_lock import InstanceLock
from dra_gpu.kubeletplugin.metrics import PluginMetrics
from dra_gpu.kubeletplugin.node_service import DraV1beta1Service, DraV1Service, NodeService
from dra_gpu.kubeletplugin.publisher import SlicePublisher
from dra_gpu.kubeletplugin.registration import RegistrationService
from dra_gpu.kubeletplugin.self_check import SelfCheck

log = logging.getLogger(__name__)

# The longest socket path gRPC serves is 105 bytes: its unix address parser refuses 106 and more
# (grpcio 1.85, measured), short of the kernel's sun_path (107 and a NUL). Names are chosen by it.
SOCKET_PATH_MAX = 105


# The kubelet's plugin watcher looks at its directory about once a second (its reconciler's
# period): a successor that just appeared is registered within this.
REGISTRATION_SETTLE_SECONDS = 2.0
SUCCESSOR_BACKOFF = Backoff(initial=0.1, maximum=1.0)


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


@dataclass(frozen=True)
class Sockets:
    """The DRA socket in the plugin dir and the registration socket the kubelet's watcher finds.
    `instance`: the pod UID the names carry (rolling updates), "" for the fixed names."""

    dra: Path
    registration: Path
    instance: str = ""

    @classmethod
    def for_driver(cls, driver_name: str, plugin_dir: Path, registry_dir: Path) -> Sockets:
        return cls(plugin_dir / "dra.sock", registry_dir / f"{driver_name}-reg.sock")

    @classmethod
    def for_instance(cls, driver_name: str, plugin_dir: Path, registry_dir: Path, uid: str) -> Sockets:
        """Names unique to the instance (Go: RollingUpdate): the registration socket is the first
        of `<driver>-<uid>-reg.sock`, `<driver>-<sha256(uid)[:8]>-reg.sock` and
        `dra-<sha256(driver NUL uid)[:16]>-reg.sock` (base64url) that fits a unix socket path;
        without a UID the fixed names."""
        if not uid:
            return cls.for_driver(driver_name, plugin_dir, registry_dir)
        both = driver_name.encode() + b"\0" + uid.encode()
        candidates = (
            f"{driver_name}-{uid}-reg.sock",
            f"{driver_name}-{_b64(hashlib.sha256(uid.encode()).digest()[:8])}-reg.sock",
            f"dra-{_b64(hashlib.sha256(both).digest()[:16])}-reg.sock",
        )
        registration = next(
            (registry_dir / n for n in candidates if len(str(registry_dir / n)) <= SOCKET_PATH_MAX),
            registry_dir / candidates[-1],  # too long even so: check() says so
        )
        return cls(plugin_dir / f"dra-{uid}.sock", registration, uid)

    @property
    def rolling(self) -> bool:
        return bool(self.instance)

    def check(self) -> None:
        for sock in (self.dra, self.registration):
            if len(str(sock)) > SOCKET_PATH_MAX:
                raise ValueError(f"socket path {sock} is longer than {SOCKET_PATH_MAX} bytes (gRPC's limit)")

    def registrations_of(self, driver_name: str) -> list[Path]:
        """The registration sockets of other instances of the driver in the registry dir (by
        name: the fixed one and the UID-named; a hashed `dra-*` name says no driver)."""
        return self._other_registrations(f"{driver_name}-")

    def hashed_registrations(self) -> list[Path]:
        """The other `dra-<hash>-reg.sock` sockets in the registry dir: an instance of some driver
        whose UID-named path would not fit (its name says no driver: GetInfo tells). Never removed
        as stale here, since they may be another driver's."""
        return self._other_registrations("dra-")

    def _other_registrations(self, prefix: str) -> list[Path]:
        """The registration sockets in the registry dir named `<prefix>...-reg.sock`, but ours."""
        try:
            names = os.listdir(self.registration.parent)
        except OSError:
            return []
        return [
            self.registration.parent / n
            for n in sorted(names)
            if n.startswith(prefix) and n.endswith("-reg.sock") and n != self.registration.name
        ]

    def remove_stale(self, driver_name: str) -> list[Path]:
        """Remove the sockets of gone instances: the DRA sockets in the plugin dir and the driver's
        registration sockets in the registry dir that nobody listens on. Run before this instance
        serves its own; what another instance serves is left alone."""
        candidates = self.registrations_of(driver_name)
        with contextlib.suppress(OSError):
            candidates += [
                self.dra.parent / n
                for n in sorted(os.listdir(self.dra.parent))
                if (n == "dra.sock" or (n.startswith("dra-") and n.endswith(".sock"))) and n != self.dra.name
            ]
        removed = []
        for path in candidates:
            if _dead_socket(path):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed.append(path)
        if removed:
            log.info("removed the sockets of gone plugin instances sockets=%s", ",".join(map(str, removed)))
        return removed


def _dead_socket(path: Path) -> bool:
    """A unix socket file that refuses connections (its server is gone)."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError as exc:
        return exc.errno in (errno.ECONNREFUSED, errno.ENOENT)
    finally:
        probe.close()
    return False


async def answers_for(path: Path, driver_name: str, timeout: float = 1.0) -> bool:
    """Whether the registration socket at `path` answers GetInfo as `driver_name`."""
    try:
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            info = await reg_grpc.RegistrationStub(channel).GetInfo(reg_pb.InfoRequest(), timeout=timeout)
    except (grpc.RpcError, OSError):
        return False
    return bool(info.name == driver_name and info.type == "DRAPlugin")


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
        lock: InstanceLock | None = None,
    ) -> None:
        """`claims`: where a prepare's claim is read; default: a GET through `kube`. `lock`: held
        around each prepare and unprepare batch (rolling updates: shared with the other instance)."""
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
        node = NodeService(driver, claims or ClaimFetcher(kube), metrics, lock=lock)
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
        if self.sockets.rolling:
            await asyncio.to_thread(self.sockets.remove_stale, self.driver_name)
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

    async def wait_for_successor(self, timeout: float) -> bool:
        """Before a stop with rolling updates: wait up to `timeout` seconds until another instance
        of the driver answers on its registration socket, so the kubelet has one to send calls to
        once this one goes (with maxSurge the new pod is registered and ready before the old one
        is told to stop: no wait for it). It answering is not yet its registration: the kubelet's
        plugin watcher is given its time (REGISTRATION_SETTLE_SECONDS) before this one stops.
        True when one answered."""
        if not self.sockets.rolling or timeout <= 0:
            return False
        start = time.monotonic()

        async def answering() -> bool:
            others = [*self.sockets.registrations_of(self.driver_name), *self.sockets.hashed_registrations()]
            for path in others:
                if await answers_for(path, self.driver_name):
                    return True
            return False

        found: bool = await AsyncRetrying(
            retry=retry_if_result(lambda ok: not ok),
            wait=SUCCESSOR_BACKOFF.wait(),
            stop=stop_after_delay(timeout),
            retry_error_callback=lambda _state: False,
        )(answering)
        waited = time.monotonic() - start
        if not found:
            log.warning(
                "stopping with no other instance of the driver registered (waited %.1fs): the kubelet's "
                "prepares fail until one starts",
                waited,
            )
            return False
        await asyncio.sleep(REGISTRATION_SETTLE_SECONDS)
        log.info("another instance of the driver answers, stopping waited_seconds=%.1f", waited)
        return True

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
