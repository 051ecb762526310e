"""A ResourceClaim's allocation, parsed once into frozen values.

Every part of the plugin that asks "which devices of this driver and pool does the claim hold"
(prepare, the binding conditions, the claim watch, the rebuild, the release of stale holders)
asks an `Allocation` instead of walking `status.allocation.devices.results` itself.

`Allocation.of` is as lenient as the walks it replaced (a missing or empty part reads as nothing
allocated): the claim watch and the binding conditions look at every claim in the cluster.
`Allocation.checked`, which prepare uses, first asks `claim_shape.status_problem` whether the
status has the right shape at all, so a bad claim fails with the field it is about.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dra_gpu.plugin.claim_shape import status_problem

CLASS_SOURCE = "FromClass"


class ShapeError(ValueError):
    """The claim's status has not the shape of an allocation; the message names the field."""


@dataclass(frozen=True, slots=True)
class DeviceResult:
    """One entry of `status.allocation.devices.results`."""

    request: str
    driver: str | None
    pool: str | None
    device: str
    admin_access: bool = False
    share_id: str | None = None
    consumed_capacity: Mapping[str, str] | None = None
    binding_conditions: tuple[str, ...] = ()

    @classmethod
    def parse(cls, result: Mapping[str, Any]) -> DeviceResult:
        driver, pool = result.get("driver"), result.get("pool")
        return cls(
            request=str(result.get("request", "")),
            driver=None if driver is None else str(driver),
            pool=None if pool is None else str(pool),
            device=str(result.get("device", "")),
            admin_access=bool(result.get("adminAccess", False)),
            share_id=str(result["shareID"]) if result.get("shareID") else None,
            consumed_capacity={str(k): str(v) for k, v in (result.get("consumedCapacity") or {}).items()},
            binding_conditions=tuple(str(c) for c in result.get("bindingConditions") or []),
        )

    @property
    def base_request(self) -> str:
        """The request's name without a subrequest (`gpus/big` -> `gpus`)."""
        return self.request.split("/", 1)[0]


@dataclass(frozen=True, slots=True)
class ConfigEntry:
    """One entry of `status.allocation.devices.config`, with its index there."""

    index: int
    source: str
    requests: tuple[str, ...]
    opaque_driver: str | None
    parameters: Any  # the opaque parameters, decoded by dra_gpu.model.config

    @classmethod
    def parse(cls, index: int, entry: Mapping[str, Any]) -> ConfigEntry:
        opaque = entry.get("opaque") or None
        return cls(
            index=index,
            source=str(entry.get("source", "")),
            requests=tuple(entry.get("requests") or []),
            opaque_driver=opaque.get("driver") if opaque else None,
            parameters=opaque.get("parameters") if opaque else None,
        )


@dataclass(frozen=True, slots=True)
class Allocation:
    """`status.allocation` of a claim (`allocated` is False when there is none)."""

    allocated: bool
    results: tuple[DeviceResult, ...] = ()
    config: tuple[ConfigEntry, ...] = ()
    timestamp: str = ""

    @classmethod
    def of(cls, claim: Mapping[str, Any]) -> Allocation:
        alloc = (claim.get("status") or {}).get("allocation")
        if not alloc:
            return cls(allocated=False)
        devices = alloc.get("devices") or {}
        return cls(
            allocated=True,
            results=tuple(DeviceResult.parse(r) for r in devices.get("results") or []),
            config=tuple(ConfigEntry.parse(i, c) for i, c in enumerate(devices.get("config") or [])),
            timestamp=str(alloc.get("allocationTimestamp") or ""),
        )

    @classmethod
    def checked(cls, claim: Mapping[str, Any]) -> Allocation:
        """`of`, after checking the status's shape (ShapeError: the first problem)."""
        problem = status_problem(claim)
        if problem:
            raise ShapeError(problem)
        return cls.of(claim)

    def results_for(self, driver: str, pool: str | None = None) -> tuple[DeviceResult, ...]:
        """The results of `driver` (and of `pool`, when given), in allocation order."""
        return tuple(r for r in self.results if r.driver == driver and (pool is None or r.pool == pool))

    def devices_for(self, driver: str, pool: str) -> set[str]:
        """The names of the devices of `driver` in `pool` that the claim holds."""
        return {r.device for r in self.results_for(driver, pool)}

    def configs_for(self, driver: str) -> list[ConfigEntry]:
        """The opaque configs of `driver`, class configs before claim configs."""
        ordered = sorted(self.config, key=lambda c: 0 if c.source == CLASS_SOURCE else 1)
        return [c for c in ordered if c.opaque_driver == driver]
