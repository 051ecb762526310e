"""The device-health stream (dra-health v1alpha1, and v1 for 1.37+ kubelets, which prefer it) the
kubelet reads on the DRA socket. The two versions have the same messages in another proto package.

The full list is re-sent well within the kubelet's timeout, and at once after notify() (a device's
health changed), so a pod learns of a broken GPU in well under a second. sent() waits until every
open stream has written that change: the plugin tells the kubelet before it publishes the taint
that evicts the pod (see KubeletPluginHelper.health_changed).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from dra_gpu.kubeletplugin._proto import dra_health_v1alpha1_pb2 as health_pb
from dra_gpu.kubeletplugin._proto import dra_health_v1alpha1_pb2_grpc as health_grpc
from dra_gpu.kubeletplugin.driver import DeviceHealth, Health

HEALTH_RESEND_SECONDS = 10
HEALTH_TIMEOUT_SECONDS = 30
HEALTH_SEND_SECONDS = 0.5  # how long sent() waits for a stream whose kubelet does not read
MAX_MESSAGE = 1024

_WIRE_HEALTH = {  # the same numbers in v1alpha1 and v1
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
        pb: Any = health_pb,
    ) -> None:
        self.pb = pb  # the generated messages of the served version
        self.device_health = device_health
        self.resend_seconds = resend_seconds
        self._changed = asyncio.Event()
        self._version = 0  # bumped by notify()
        self._written: dict[object, int] = {}  # open stream -> the version it last wrote
        self._progress = asyncio.Event()  # set (and replaced) when a stream wrote or closed

    def notify(self) -> None:
        """Wake every open stream: the driver's device health changed."""
        self._version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def sent(self, timeout: float = HEALTH_SEND_SECONDS) -> bool:
        """Wait until every open stream has written the health of the last notify() to the
        kubelet's connection; False when one has not within `timeout`."""
        version = self._version
        try:
            async with asyncio.timeout(timeout):
                while any(v < version for v in self._written.values()):
                    await self._progress.wait()
        except TimeoutError:
            return False
        return True

    def _progressed(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()

    def snapshot(self) -> Any:
        now = int(time.time())
        pb = self.pb
        return pb.NodeWatchResourcesResponse(
            devices=[
                pb.DeviceHealth(
                    device=pb.DeviceIdentifier(pool_name=d.pool_name, device_name=d.device_name),
                    health=_WIRE_HEALTH[d.health],
                    last_updated_time=now,
                    health_check_timeout_seconds=HEALTH_TIMEOUT_SECONDS,
                    message=d.message[:MAX_MESSAGE],
                )
                for d in self.device_health()
            ]
        )

    async def NodeWatchResources(self, request: Any, context: Any) -> None:
        # context.write returns once gRPC has written the message: sent() knows what reached
        # the kubelet's connection.
        stream = object()
        self._written[stream] = -1
        try:
            while True:
                changed, version = self._changed, self._version
                await context.write(self.snapshot())
                self._written[stream] = version
                self._progressed()
                try:
                    async with asyncio.timeout(self.resend_seconds):
                        await changed.wait()
                except TimeoutError:
                    pass
        finally:
            del self._written[stream]
            self._progressed()
