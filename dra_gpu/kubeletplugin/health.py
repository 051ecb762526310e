"""The device-health stream (dra-health v1alpha1) the kubelet reads on the DRA socket."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from dra_gpu.kubeletplugin._proto import dra_health_v1alpha1_pb2 as health_pb
from dra_gpu.kubeletplugin._proto import dra_health_v1alpha1_pb2_grpc as health_grpc
from dra_gpu.kubeletplugin.driver import DeviceHealth, Health

HEALTH_RESEND_SECONDS = 10
HEALTH_TIMEOUT_SECONDS = 30

_WIRE_HEALTH = {
    Health.UNKNOWN: health_pb.UNKNOWN,
    Health.HEALTHY: health_pb.HEALTHY,
    Health.UNHEALTHY: health_pb.UNHEALTHY,
}


class HealthService(health_grpc.DRAResourceHealthServicer):  # type: ignore[misc]
    """Sends the driver's device health, re-sent well within the kubelet's timeout."""

    def __init__(
        self,
        device_health: Callable[[], list[DeviceHealth]],
        resend_seconds: float = HEALTH_RESEND_SECONDS,
    ) -> None:
        self.device_health = device_health
        self.resend_seconds = resend_seconds

    def snapshot(self) -> Any:
        now = int(time.time())
        return health_pb.NodeWatchResourcesResponse(
            devices=[
                health_pb.DeviceHealth(
                    device=health_pb.DeviceIdentifier(pool_name=d.pool_name, device_name=d.device_name),
                    health=_WIRE_HEALTH[d.health],
                    last_updated_time=now,
                    health_check_timeout_seconds=HEALTH_TIMEOUT_SECONDS,
                )
                for d in self.device_health()
            ]
        )

    async def NodeWatchResources(self, request: Any, context: Any) -> AsyncIterator[Any]:
        while True:
            yield self.snapshot()
            await asyncio.sleep(self.resend_seconds)
