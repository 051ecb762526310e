"""The health stream tells the kubelet before the plugin goes on: `health_changed()` returns once
every open stream has written the change (the plugin publishes the taint that evicts the pod only
then), never waits long for a kubelet that does not read, and forgets closed streams."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from fake_kube import until

from dra_gpu.kubeletplugin._proto import dra_health_v1_pb2 as v1_health_pb
from dra_gpu.kubeletplugin.driver import DeviceHealth, Health
from dra_gpu.kubeletplugin.health import HEALTH_SEND_SECONDS, HealthService

from .conftest import NODE
from .test_helper import Running, run_plugin


class Connection:
    """A servicer context as gRPC passes it: write() returns once the message is written, which
    takes `delay` seconds; while `stalled`, it does not return (a kubelet that does not read)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.written: list[Any] = []
        self.delay = delay
        self.stalled = False

    async def write(self, message: Any) -> None:
        await asyncio.sleep(self.delay)
        while self.stalled:
            await asyncio.sleep(3600)
        self.written.append(message)


def health_of(message: Any) -> dict[str, int]:
    return {d.device.device_name: d.health for d in message.devices}


def test_health_changed_returns_once_the_streams_wrote_the_change(tmp_path: Path) -> None:
    async def test(p: Running) -> None:
        p.helper.health_v1.resend_seconds = 60  # only the change can bring a second message
        kubelet = Connection(delay=0.05)
        stream = asyncio.create_task(p.helper.health_v1.NodeWatchResources(None, kubelet))
        await until(lambda: len(kubelet.written) == 1)
        p.driver.unhealthy.add("dev-1")
        await p.helper.health_changed()
        # No yield to the loop in between: what the kubelet's connection holds right now.
        assert len(kubelet.written) == 2
        assert health_of(kubelet.written[1])["dev-1"] == v1_health_pb.UNHEALTHY
        stream.cancel()

    run_plugin(tmp_path, test)


def test_a_kubelet_that_does_not_read_holds_the_plugin_back_briefly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def test(p: Running) -> None:
        kubelet = Connection()
        stream = asyncio.create_task(p.helper.health_v1.NodeWatchResources(None, kubelet))
        await until(lambda: len(kubelet.written) == 1)
        kubelet.stalled = True
        p.driver.unhealthy.add("dev-1")
        start = time.monotonic()
        with caplog.at_level(logging.WARNING):
            await asyncio.wait_for(p.helper.health_changed(), HEALTH_SEND_SECONDS + 2)
        assert HEALTH_SEND_SECONDS <= time.monotonic() - start < HEALTH_SEND_SECONDS + 1
        assert "not written to every kubelet health stream" in caplog.text
        stream.cancel()

    run_plugin(tmp_path, test)


def test_a_closed_stream_is_not_waited_for() -> None:
    async def test() -> None:
        devices = [DeviceHealth(NODE, "gpu-0", Health.HEALTHY)]
        service = HealthService(lambda: list(devices), resend_seconds=60, pb=v1_health_pb)
        gone, live = Connection(), Connection()
        streams = [asyncio.create_task(service.NodeWatchResources(None, c)) for c in (gone, live)]
        await until(lambda: len(gone.written) == len(live.written) == 1)
        gone.stalled = True
        streams[0].cancel()  # the kubelet went away in the middle of a write
        await asyncio.gather(streams[0], return_exceptions=True)
        devices[0] = DeviceHealth(NODE, "gpu-0", Health.UNHEALTHY, "XID 79")
        service.notify()
        assert await service.sent(timeout=2)
        assert health_of(live.written[-1])["gpu-0"] == v1_health_pb.UNHEALTHY
        streams[1].cancel()

    asyncio.run(test())
