"""The GPU driver as the kubelet-plugin layer sees it: the Preparer for claims, the node's
DeviceCatalog for the ResourceSlices and the devices whose health is reported (the health
manager's taints go into the slices and its verdicts into the kubelet's health stream)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from dra_gpu.health.claim_status import ClaimStatusWriter
from dra_gpu.health.manager import HealthManager
from dra_gpu.kubeletplugin.driver import ClaimRef, DeviceHealth, Health
from dra_gpu.node.catalog import DeviceCatalog
from dra_gpu.node.slices import SliceBuilder
from dra_gpu.plugin.prepare import Preparer
from dra_gpu.plugin.record import PreparedDevice

log = logging.getLogger(__name__)


class GpuDriver:
    def __init__(
        self,
        driver_name: str,
        node_name: str,
        catalog: DeviceCatalog,
        preparer: Preparer,
        health: HealthManager | None = None,
        claim_status: ClaimStatusWriter | None = None,
        counters_beside_devices: bool = False,
    ) -> None:
        """`counters_beside_devices`: the apiserver is 1.34's (SliceBuilder.slices)."""
        self.health = health
        self.counters_beside_devices = counters_beside_devices
        self.claim_status = claim_status
        self.driver_name = driver_name
        self.pool_name = node_name  # one pool per node, named after it
        self.catalog = catalog
        self.slices = SliceBuilder(catalog, driver_name)
        self.slices.device_groups()  # the apiserver's limits, checked once at start
        self.preparer = preparer
        self.device_names = catalog.names()
        # What the apiserver cannot hold (slice_fields_dropped): for this process's life; a
        # restart after the gate is turned on publishes everything again.
        self.withdraw_tainted = False
        self.counters = True

    def _in_flight(self) -> contextlib.AbstractContextManager[None]:
        """Claim statuses wait while a prepare or unprepare is in flight."""
        return self.claim_status.preparing() if self.claim_status is not None else contextlib.nullcontext()

    async def prepare(self, ref: ClaimRef, claim: Mapping[str, Any]) -> list[PreparedDevice]:
        with self._in_flight():
            devices = await self.preparer.prepare(ref, claim)
        if self.claim_status is not None:
            record = self.preparer.journal.get(ref.uid)
            status = record.status_devices() if record is not None else [d.to_dict() for d in devices]
            self.claim_status.prepared(ref.namespace, ref.name, ref.uid, status)
        return devices

    async def unprepare(self, claim: ClaimRef) -> None:
        with self._in_flight():
            await self.preparer.unprepare(claim)
        if self.claim_status is not None:
            self.claim_status.unprepared(claim.uid)

    def prepared_device_count(self) -> int:
        return self.preparer.prepared_device_count()

    def resource_slices(self, generation: int) -> list[dict[str, Any]]:
        taints = self.health.slice_taints() if self.health is not None else None
        return self.slices.slices(
            generation,
            taints,
            withdraw_tainted=self.withdraw_tainted,
            counters=self.counters,
            counters_beside_devices=self.counters_beside_devices,
        )

    def slice_fields_dropped(self, fields: frozenset[str]) -> None:
        if "taints" in fields and not self.withdraw_tainted:
            self.withdraw_tainted = True
            log.warning(
                "device taints are dropped by the apiserver (DRADeviceTaints off): a GPU that fails is "
                "withdrawn from the slices instead, so no new claim gets it; pods already on it are "
                "not evicted"
            )
        if {"consumesCounters", "sharedCounters"} & fields and self.counters:
            self.counters = False
            log.warning(
                "counters are dropped by the apiserver (DRAPartitionableDevices off): dynamic MIG's "
                "placements are not published (overlapping ones could be allocated together); turn "
                "on DRAPartitionableDevices and restart the plugin"
            )

    def device_health(self) -> list[DeviceHealth]:
        """The health monitor's verdicts; every device healthy when no monitor runs."""
        if self.health is None:
            return [DeviceHealth(self.pool_name, name, Health.HEALTHY) for name in self.device_names]
        verdicts = self.health.health()
        out = []
        for name in self.device_names:
            healthy, message = verdicts.get(name, (True, ""))
            out.append(
                DeviceHealth(self.pool_name, name, Health.HEALTHY if healthy else Health.UNHEALTHY, message)
            )
        return out
