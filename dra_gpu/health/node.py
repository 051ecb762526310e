"""The health half of the kubelet plugin, assembled: the monitor threads on the node's NVML, the
taint book under the plugin dir, the manager and the control socket (on a simulated node with its
event injection, for `dra-gpu health simulate`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from dra_gpu.health.classification import Classifier
from dra_gpu.health.control import SOCKET_NAME, ControlServer
from dra_gpu.health.manager import HealthManager
from dra_gpu.health.monitor import Monitor
from dra_gpu.health.taint_book import HoldDown, TaintBook
from dra_gpu.node.catalog import DeviceCatalog, MadeInstances
from dra_gpu.node.profiles import NodeEvents

log = logging.getLogger(__name__)

STATE_FILE = "health-taints.json"
TAINT_KEY_NAME = "unhealthy"


@dataclass(frozen=True)
class HealthConfig:
    enabled: bool = True
    check_interval: float = 5.0  # seconds between liveness / recovery-action checks
    hold_down: HoldDown = field(default_factory=HoldDown)
    classifier: Classifier = field(default_factory=Classifier)
    claim_status: bool = True  # write status.devices of prepared claims (data, Ready, Healthy)


def taint_key(driver_name: str) -> str:
    return f"{driver_name}/{TAINT_KEY_NAME}"


class HealthNode:
    def __init__(
        self,
        cfg: HealthConfig,
        driver_name: str,
        catalog: DeviceCatalog,
        plugin_dir: Path,
        registry: CollectorRegistry,
        nvml: Any,
        events: NodeEvents | None = None,
        made_instances: Callable[[], MadeInstances] | None = None,
    ) -> None:
        """`catalog`: the node's published devices, each of which health can taint; `nvml`: the
        node's (pynvml bound to its driver root's library); `events`: a simulated node's event
        injection (None on a real node); `made_instances`: the dynamic-MIG instances claims
        hold (see HealthManager)."""
        self.cfg = cfg
        self._nvml = nvml
        self.book = TaintBook(plugin_dir / STATE_FILE, catalog.names(), cfg.hold_down)
        self.manager = HealthManager(
            catalog,
            taint_key(driver_name),
            self.book,
            cfg.classifier,
            registry,
            tick=min(1.0, cfg.check_interval),
            made_instances=made_instances,
        )
        self.nvml: Any = None  # while the monitor holds NVML initialised
        self.monitor: Monitor | None = None
        self.control = ControlServer(plugin_dir / SOCKET_NAME, self.manager, events)
        self._task: asyncio.Task[None] | None = None

    def subscribe(self, callback: Callable[[], Awaitable[object]]) -> None:
        self.manager.subscribers.append(callback)

    async def start(self) -> None:
        self.manager.bind(asyncio.get_running_loop())
        if self.cfg.enabled:
            await asyncio.to_thread(self._nvml.nvmlInit)
            self.nvml = self._nvml
        await self.control.start()
        self._task = asyncio.create_task(self.manager.run(), name="health")
        if self.nvml is not None:
            self.monitor = Monitor(
                self.nvml, self.manager.gpu_uuids(), self.manager.sink, self.cfg.check_interval
            )
            self.monitor.start()
            log.info(
                "health monitor started gpus=%d interval=%.1fs hold_down=%.0fs taint_key=%s",
                len(self.manager.gpu_uuids()),
                self.cfg.check_interval,
                self.cfg.hold_down.initial,
                self.manager.taint_key,
            )
        else:
            log.warning("health monitor disabled: devices are tainted only by an operator")

    async def stop(self) -> None:
        if self.monitor is not None:
            await asyncio.to_thread(self.monitor.stop)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.control.stop()
        if self.nvml is not None:
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()
