"""A published device and its pool as the allocator reads them: attributes (the driver's own may be
unqualified), capacities and the amount a request consumes under a capacity's request policy, the
counters a device consumes, and the taints a request does not tolerate."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from dra_gpu.controller.claim_requests import SubRequest
from dra_gpu.kube.values import parse_quantity, quantity_or_none


@dataclass(eq=False)
class Device:
    driver: str
    pool: str
    name: str
    node: str | None  # None: all nodes
    raw: Mapping[str, Any]
    pool_key: tuple[str, str]
    consumes: list[tuple[str, dict[str, Decimal]]] = field(default_factory=list)
    _view: dict[str, Any] | None = None
    _activation: Any = None
    _values: dict[tuple[str, str, str], Any] = field(default_factory=dict)  # read -> cel.device_value
    _attributes: dict[str, tuple[str, Any] | None] = field(default_factory=dict)

    @functools.cached_property
    def key(self) -> tuple[str, str, str]:
        return (self.driver, self.pool, self.name)

    def attribute(self, qualified: str) -> tuple[str, Any] | None:
        """(kind, value) of a fully qualified attribute; the driver's own may be published unqualified."""
        try:
            return self._attributes[qualified]
        except KeyError:
            found = self._attributes[qualified] = self._attribute(qualified)
            return found

    def _attribute(self, qualified: str) -> tuple[str, Any] | None:
        attrs = self.raw.get("attributes") or {}
        value = attrs.get(qualified)
        domain, _, ident = qualified.rpartition("/")
        if value is None and domain == self.driver:
            value = attrs.get(ident)
        if not isinstance(value, dict) or len(value) != 1:
            return None
        kind, v = next(iter(value.items()))
        return kind, v

    def capacity(self, name: str) -> Decimal | None:
        caps = self.raw.get("capacity") or {}
        value = caps.get(name) or caps.get(f"{self.driver}/{name}")
        if isinstance(value, dict) and "value" in value:
            try:
                return parse_quantity(str(value["value"]))
            except ValueError:
                return None
        return None

    def taints(self) -> list[Mapping[str, Any]]:
        return [t for t in self.raw.get("taints") or [] if isinstance(t, dict)]

    @property
    def multi(self) -> bool:
        """Allocatable to several claims at once (consumable capacity)."""
        return self.raw.get("allowMultipleAllocations") is True

    def consumption(self, requests: Mapping[str, Decimal]) -> dict[str, Decimal] | None:
        """What one allocation with these capacity requests consumes (request policies applied:
        rounded up to a valid value), or None when no allocation of this device can give them."""
        caps = self.raw.get("capacity") or {}
        if any(self.capacity(name) is None for name in requests):
            return None
        if not self.multi:  # a whole device: its capacity must cover the requests
            ok = all(amount <= (self.capacity(name) or 0) for name, amount in requests.items())
            return {} if ok else None
        out: dict[str, Decimal] = {}
        for key, spec in caps.items():
            name = key.rpartition("/")[2] if key.startswith(f"{self.driver}/") else key
            value = self.capacity(name)
            if value is None or not isinstance(spec, dict):
                continue
            amount = policy_amount(requests.get(name), value, spec.get("requestPolicy"))
            if amount is None:
                return None
            out[name] = amount
        return out


def policy_amount(request: Decimal | None, value: Decimal, policy: Any) -> Decimal | None:
    """The amount a request consumes under a capacity's request policy (None: not allocatable),
    as the scheduler rounds it: up to min, up to the next step, up to the next valid value."""
    if not isinstance(policy, dict):
        amount = value if request is None else request
    elif request is None:
        amount = quantity_or_none(policy.get("default")) or Decimal(0)
    elif policy.get("validValues"):
        valid = sorted(v for v in (quantity_or_none(x) for x in policy["validValues"]) if v is not None)
        fitting = [v for v in valid if v >= request]
        if not fitting:
            return None
        amount = fitting[0]
    elif isinstance(policy.get("validRange"), dict):
        rng = policy["validRange"]
        low, high, step = (
            quantity_or_none(rng.get("min")) or Decimal(0),
            quantity_or_none(rng.get("max")),
            quantity_or_none(rng.get("step")),
        )
        amount = max(request, low)
        if step:
            amount = low + math.ceil((amount - low) / step) * step
        if high is not None and amount > high:
            return None
    else:
        amount = request
    return amount if amount <= value else None


@dataclass
class Pool:
    driver: str
    name: str
    generation: int
    slice_count: int
    slices: list[Mapping[str, Any]]
    counters: dict[tuple[str, str], Decimal] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.slices) == self.slice_count


def blocking_taint(device: Device, sub: SubRequest) -> Mapping[str, Any] | None:
    """The first NoSchedule / NoExecute taint of the device the request does not tolerate."""
    for t in device.taints():
        if t.get("effect") in ("NoSchedule", "NoExecute") and not _tolerated(t, sub.tolerations):
            return t
    return None


def describe_taint(taint: Mapping[str, Any]) -> str:
    value = taint.get("value")
    return f"{taint.get('key')}{'=' + str(value) if value else ''}:{taint.get('effect')}"


def _tolerated(taint: Mapping[str, Any], tolerations: Sequence[Mapping[str, Any]]) -> bool:
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t.get("key") == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False
