"""The gRPC services the kubelet talks to: registration, DRA v1 + v1beta1, device health."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc

from dra_gpu.plugin._proto import (
    dra_health_v1alpha1_pb2 as health_pb,
)
from dra_gpu.plugin._proto import (
    dra_health_v1alpha1_pb2_grpc as health_grpc,
)
from dra_gpu.plugin._proto import (
    dra_v1_pb2 as v1_pb,
)
from dra_gpu.plugin._proto import (
    dra_v1_pb2_grpc as v1_grpc,
)
from dra_gpu.plugin._proto import (
    dra_v1beta1_pb2 as v1beta1_pb,
)
from dra_gpu.plugin._proto import (
    dra_v1beta1_pb2_grpc as v1beta1_grpc,
)
from dra_gpu.plugin._proto import (
    pluginregistration_v1_pb2 as reg_pb,
)
from dra_gpu.plugin._proto import (
    pluginregistration_v1_pb2_grpc as reg_grpc,
)
from dra_gpu.plugin.metrics import PluginMetrics
from dra_gpu.plugin.prepare import ClaimRef, PreparedDevice, PrepareError, Preparer

log = logging.getLogger(__name__)

SUPPORTED_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")
HEALTH_RESEND_SECONDS = 10
HEALTH_TIMEOUT_SECONDS = 30


class RegistrationService(reg_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, driver: str, endpoint: str) -> None:
        self.driver = driver
        self.endpoint = endpoint
        self.registered = asyncio.Event()

    async def GetInfo(self, request: Any, context: Any) -> Any:
        return reg_pb.PluginInfo(
            type="DRAPlugin",
            name=self.driver,
            endpoint=self.endpoint,
            supported_versions=list(SUPPORTED_SERVICES),
        )

    async def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        if request.plugin_registered:
            log.info("registered with the kubelet driver=%s", self.driver)
            self.registered.set()
        else:
            log.error("kubelet refused the registration driver=%s error=%r", self.driver, request.error)
            self.registered.clear()
        return reg_pb.RegistrationStatusResponse()


class NodeService:
    """Both DRA API versions call into this; only the message module differs."""

    def __init__(self, preparer: Preparer, metrics: PluginMetrics) -> None:
        self.preparer = preparer
        self.metrics = metrics

    async def _one(self, operation: str, ref: ClaimRef, call: Callable[[ClaimRef], Any]) -> tuple[Any, str]:
        start = time.perf_counter()
        try:
            result = await call(ref)
            self.metrics.requests.labels(operation, "success").inc()
            return result, ""
        except PrepareError as exc:
            self.metrics.requests.labels(operation, "error").inc()
            log.warning("%s failed claim=%s error=%r", operation, ref, str(exc))
            return None, str(exc)
        except Exception as exc:  # a bug must fail one claim, not the kubelet's whole batch
            self.metrics.requests.labels(operation, "error").inc()
            log.exception("%s failed unexpectedly claim=%s", operation, ref)
            return None, f"internal error: {exc}"
        finally:
            self.metrics.latency.labels(operation).observe(time.perf_counter() - start)
            self.metrics.prepared_devices.set(self.preparer.prepared_device_count())

    async def prepare(self, request: Any, pb: Any) -> Any:
        refs = [ClaimRef(c.namespace, c.uid, c.name) for c in request.claims]
        outcomes = await asyncio.gather(*(self._one("prepare", r, self.preparer.prepare) for r in refs))
        response = pb.NodePrepareResourcesResponse()
        for ref, (devices, error) in zip(refs, outcomes, strict=True):
            entry = response.claims[ref.uid]
            if error:
                entry.error = error
                continue
            for d in devices:
                entry.devices.append(_device(pb, d))
        return response

    async def unprepare(self, request: Any, pb: Any) -> Any:
        refs = [ClaimRef(c.namespace, c.uid, c.name) for c in request.claims]
        outcomes = await asyncio.gather(*(self._one("unprepare", r, self.preparer.unprepare) for r in refs))
        response = pb.NodeUnprepareResourcesResponse()
        for ref, (_, error) in zip(refs, outcomes, strict=True):
            response.claims[ref.uid].error = error
        return response


def _device(pb: Any, d: PreparedDevice) -> Any:
    msg = pb.Device(
        request_names=d.request_names,
        pool_name=d.pool_name,
        device_name=d.device_name,
        cdi_device_ids=d.cdi_device_ids,
    )
    if d.share_id is not None and pb is v1_pb:
        msg.share_id = d.share_id  # v1beta1 has no share_id
    return msg


class DraV1Service(v1_grpc.DRAPluginServicer):  # type: ignore[misc]
    def __init__(self, node: NodeService) -> None:
        self.node = node

    async def NodePrepareResources(self, request: Any, context: Any) -> Any:
        return await self.node.prepare(request, v1_pb)

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        return await self.node.unprepare(request, v1_pb)


class DraV1beta1Service(v1beta1_grpc.DRAPluginServicer):  # type: ignore[misc]
    def __init__(self, node: NodeService) -> None:
        self.node = node

    async def NodePrepareResources(self, request: Any, context: Any) -> Any:
        return await self.node.prepare(request, v1beta1_pb)

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        return await self.node.unprepare(request, v1beta1_pb)


class HealthService(health_grpc.DRAResourceHealthServicer):  # type: ignore[misc]
    """Reports every published device healthy, re-sent well within the kubelet's timeout."""

    def __init__(
        self, pool: str, device_names: Callable[[], list[str]], resend_seconds: float = HEALTH_RESEND_SECONDS
    ) -> None:
        self.pool = pool
        self.device_names = device_names
        self.resend_seconds = resend_seconds

    def snapshot(self) -> Any:
        now = int(time.time())
        return health_pb.NodeWatchResourcesResponse(
            devices=[
                health_pb.DeviceHealth(
                    device=health_pb.DeviceIdentifier(pool_name=self.pool, device_name=name),
                    health=health_pb.HEALTHY,
                    last_updated_time=now,
                    health_check_timeout_seconds=HEALTH_TIMEOUT_SECONDS,
                )
                for name in self.device_names()
            ]
        )

    async def NodeWatchResources(self, request: Any, context: Any) -> AsyncIterator[Any]:
        while True:
            yield self.snapshot()
            await asyncio.sleep(self.resend_seconds)


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
