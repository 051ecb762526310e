"""The GPU driver as the kubelet-plugin layer sees it: the Preparer for claims, the node's
Inventory for the ResourceSlices and the devices whose health is reported."""

from __future__ import annotations

from typing import Any

from dra_gpu.kubeletplugin.driver import ClaimRef, DeviceHealth, Health
from dra_gpu.model import Inventory
from dra_gpu.plugin.prepare import PreparedDevice, Preparer
from dra_gpu.slices import build_slices


class GpuDriver:
    def __init__(self, driver_name: str, node_name: str, inventory: Inventory, preparer: Preparer) -> None:
        self.driver_name = driver_name
        self.pool_name = node_name  # one pool per node, named after it
        self.inventory = inventory
        self.preparer = preparer
        self.device_names = [
            d["name"] for s in build_slices(inventory, driver_name) for d in s["spec"].get("devices") or []
        ]

    async def prepare(self, claim: ClaimRef) -> list[PreparedDevice]:
        return await self.preparer.prepare(claim)

    async def unprepare(self, claim: ClaimRef) -> None:
        await self.preparer.unprepare(claim)

    def prepared_device_count(self) -> int:
        return self.preparer.prepared_device_count()

    def resource_slices(self, generation: int) -> list[dict[str, Any]]:
        return build_slices(self.inventory, self.driver_name, generation)

    def device_health(self) -> list[DeviceHealth]:
        """Every published device healthy: no health source is wired in yet."""
        return [DeviceHealth(self.pool_name, name, Health.HEALTHY) for name in self.device_names]
