"""What the allocator sees: the published pools (highest generation, complete ones only, sorted by
ID), each node's devices in published order, the device classes, which devices allocated claims
hold (exclusively, or shares of their capacity), and which devices each request's class and
selectors match, cached, since selectors are pure and most devices share the values they read.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from dra_gpu.controller.allocation_errors import AllocationError, UnknownClassError, UnmodelledError
from dra_gpu.controller.cel import CelEnvironment, CelError, SelectorEvalError
from dra_gpu.controller.cel.environment import Selector, device_value
from dra_gpu.controller.claim_requests import Request, SubRequest
from dra_gpu.controller.published_devices import Device, Pool
from dra_gpu.kube.values import parse_quantity, quantity_or_none

DEFAULT_STEP_BUDGET = 500_000


def allocated_devices(claims: Iterable[Mapping[str, Any]]) -> set[tuple[str, str, str]]:
    """Devices in use by allocated claims (admin-access results and shares do not block others)."""
    out: set[tuple[str, str, str]] = set()
    for c in claims:
        alloc = ((c.get("status") or {}).get("allocation") or {}).get("devices") or {}
        for r in alloc.get("results") or []:
            if not r.get("adminAccess") and not r.get("shareID"):
                out.add((str(r.get("driver")), str(r.get("pool")), str(r.get("device"))))
    return out


def shared_consumption(claims: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str, str], dict[str, Decimal]]:
    """Capacity consumed on shared devices (allowMultipleAllocations) by allocated claims."""
    out: dict[tuple[str, str, str], dict[str, Decimal]] = {}
    for c in claims:
        alloc = ((c.get("status") or {}).get("allocation") or {}).get("devices") or {}
        for r in alloc.get("results") or []:
            if not r.get("shareID"):
                continue
            used = out.setdefault((str(r.get("driver")), str(r.get("pool")), str(r.get("device"))), {})
            for name, value in (r.get("consumedCapacity") or {}).items():
                amount = quantity_or_none(value)
                if amount is not None:
                    key = str(name).rpartition("/")[2]
                    used[key] = used.get(key, Decimal(0)) + amount
    return out


class Cluster:
    """Published slices, device classes and devices in use: what the allocator sees."""

    def __init__(
        self,
        env: CelEnvironment,
        slices: Iterable[Mapping[str, Any]],
        classes: Mapping[str, Mapping[str, Any]],
        in_use: set[tuple[str, str, str]] | None = None,
        step_budget: int = DEFAULT_STEP_BUDGET,
        shared_use: Mapping[tuple[str, str, str], Mapping[str, Decimal]] | None = None,
    ) -> None:
        self.env = env
        self.classes = dict(classes)
        self._free: dict[tuple[str, str, tuple[str, ...]], int] = {}
        self.in_use = set(in_use or ())
        self.shared_use = {k: dict(v) for k, v in (shared_use or {}).items()}
        self.step_budget = step_budget
        self.pools = self._gather(slices)
        self._pools = {(p.driver, p.name): p for p in self.pools}
        # Explanations by claim spec, for a caller that explains many claims against one view.
        self.explained: dict[tuple[str, bool, bool], Any] | None = None
        self.nodes = sorted(
            {str(s["spec"]["nodeName"]) for p in self.pools for s in p.slices if s["spec"].get("nodeName")}
        ) or [""]
        self._devices: dict[str, list[Device]] = {}
        self._pools_by_node: tuple[dict[str, set[int]], set[int]] | None = None
        self._selected: dict[tuple[str, int], bool] = {}  # (expression, id(device)) -> match
        # (expression, the device's values it reads) -> match, or the text of its runtime error:
        # most devices share the values a selector reads (product, memory, driver version), so a
        # selector runs once per distinct set of them instead of once per device.
        self._outcomes: dict[tuple[str, Any], bool | str] = {}
        self._candidates: dict[tuple[str, str, tuple[str, ...]], list[Device]] = {}

    @property
    def in_use(self) -> frozenset[tuple[str, str, str]]:
        """The devices allocations hold exclusively. Replaced whole (a caller checking claim after
        claim against views of its own), never changed in place: the free counts follow it."""
        return self._in_use

    @in_use.setter
    def in_use(self, keys: Iterable[tuple[str, str, str]]) -> None:
        self._in_use = frozenset(keys)
        self._free.clear()

    @staticmethod
    def _gather(slices: Iterable[Mapping[str, Any]]) -> list[Pool]:
        pools: dict[tuple[str, str], Pool] = {}
        for s in slices:
            spec = s.get("spec") or {}
            pool = spec.get("pool") or {}
            key = (str(spec.get("driver", "")), str(pool.get("name", "")))
            gen = int(pool.get("generation") or 0)
            p = pools.get(key)
            if p is None or gen > p.generation:
                p = pools[key] = Pool(key[0], key[1], gen, int(pool.get("resourceSliceCount") or 1), [])
            if gen == p.generation:
                p.slices.append(s)
        for p in pools.values():
            p.slices.sort(key=lambda s: str((s.get("metadata") or {}).get("name", "")))
            for s in p.slices:
                for cs in s["spec"].get("sharedCounters") or []:
                    for cname, c in (cs.get("counters") or {}).items():
                        p.counters[(str(cs.get("name")), str(cname))] = parse_quantity(str(c.get("value")))

        # The scheduler tries pools with binding-condition devices last.
        def waits(p: Pool) -> bool:
            return any(d.get("bindingConditions") for s in p.slices for d in s["spec"].get("devices") or [])

        return sorted((pools[k] for k in sorted(pools)), key=waits)

    def _pools_on(self, node: str) -> list[Pool]:
        """The pools with a slice for `node` or for all nodes, in order (one pass over all pools
        for all nodes, not one per node)."""
        if node == "":
            return self.pools
        if self._pools_by_node is None:
            by_node: dict[str, set[int]] = {}
            everywhere: set[int] = set()
            for i, p in enumerate(self.pools):
                for s in p.slices:
                    spec = s["spec"]
                    if spec.get("allNodes"):
                        everywhere.add(i)
                    elif isinstance(spec.get("nodeName"), str):
                        by_node.setdefault(spec["nodeName"], set()).add(i)
            self._pools_by_node = (by_node, everywhere)
        by_node, everywhere = self._pools_by_node
        return [self.pools[i] for i in sorted(by_node.get(node, set()) | everywhere)]

    def devices(self, node: str) -> list[Device]:
        """The devices usable on `node`, in the allocator's order."""
        if node not in self._devices:
            out: list[Device] = []
            for p in self._pools_on(node):
                if not p.complete:
                    continue
                names: set[str] = set()
                for s in p.slices:
                    spec = s["spec"]
                    if not (spec.get("allNodes") or spec.get("nodeName") == node or node == ""):
                        continue
                    for d in spec.get("devices") or []:
                        name = str(d.get("name", ""))
                        if name in names:
                            continue
                        names.add(name)
                        consumes = [
                            (
                                str(cc.get("counterSet")),
                                {
                                    str(k): parse_quantity(str(v.get("value")))
                                    for k, v in (cc.get("counters") or {}).items()
                                },
                            )
                            for cc in d.get("consumesCounters") or []
                        ]
                        out.append(
                            Device(
                                p.driver, p.name, name, spec.get("nodeName"), d, (p.driver, p.name), consumes
                            )
                        )
            self._devices[node] = out
        return self._devices[node]

    def consumed_by_in_use(self, node: str) -> dict[tuple[tuple[str, str], str, str], Decimal]:
        """Counters the allocated devices usable on `node` consume: (pool, set, counter) -> sum."""
        out: dict[tuple[tuple[str, str], str, str], Decimal] = {}
        for d in self.devices(node):
            if not d.consumes or d.key not in self.in_use:
                continue
            for cset, counters in d.consumes:
                for cname, v in counters.items():
                    k = (d.pool_key, cset, cname)
                    out[k] = out.get(k, Decimal(0)) + v
        return out

    def pool(self, key: tuple[str, str]) -> Pool | None:
        return self._pools.get(key)

    def matches(self, expression: str, device: Device) -> bool:
        k = (expression, id(device))
        hit = self._selected.get(k)
        if hit is None:
            try:
                selector = self.env.compile(expression)
            except CelError as exc:
                names = self.env.unmodelled(expression)
                if names:
                    raise UnmodelledError(
                        f"selector {expression!r} uses {', '.join(names)} of the Kubernetes CEL libraries, "
                        "which dra-gpu does not model: the allocation cannot be simulated"
                    ) from exc
                raise AllocationError(f"selector {expression!r} {exc}") from exc
            shared = self._shared_key(selector, device)
            outcome = self._outcomes.get(shared) if shared is not None else None
            if outcome is None:
                outcome = self._evaluate(selector, device)
                if shared is not None:
                    self._outcomes[shared] = outcome
            if isinstance(outcome, str):
                raise AllocationError(
                    f"selector {expression!r} failed on device {device.name} ({device.pool}): {outcome}"
                )
            hit = self._selected[k] = outcome
        return hit

    def _shared_key(self, selector: Selector, device: Device) -> tuple[str, Any] | None:
        """The key under which devices share the selector's outcome, or None (evaluate this one)."""
        if selector.reads is None:
            return None
        values = device._values
        key: list[Any] = [device.driver, bool(device.raw.get("allowMultipleAllocations", False))]
        for read in selector.reads:
            try:
                key.append(values[read])
            except KeyError:
                value = values[read] = device_value(device.driver, device.raw, read)
                key.append(value)
        return (selector.expression, tuple(key))

    def _evaluate(self, selector: Selector, device: Device) -> bool | str:
        if device._view is None:
            device._view = self.env.device_view(device.driver, device.raw)
            device._activation = self.env.activation(device._view)
        try:
            return self.env.evaluate(selector, device._view, device._activation)
        except SelectorEvalError as exc:
            return str(exc)

    @functools.cached_property
    def tainted(self) -> bool:
        """Some device has a taint (published data: fixed for this view)."""
        return any(d.taints() for node in self.nodes for d in self.devices(node))

    def warm(self) -> None:
        """Build every node's devices now (published data only, no selector runs), so a forked
        child (bounded.py) starts with them. CEL views are made only for the devices a selector
        is evaluated on: most share their outcome with an equal device (`_shared_key`)."""
        for node in self.nodes:
            self.devices(node)

    def selectable(self, sub: SubRequest, device: Device) -> bool:
        cls = self.classes.get(sub.device_class)
        if cls is None:
            raise UnknownClassError(sub.device_class)
        for s in (cls.get("spec") or {}).get("selectors") or []:
            if not self.matches(str((s.get("cel") or {}).get("expression", "")), device):
                return False
        return all(self.matches(e, device) for e in sub.selectors)

    @property
    def busy(self) -> bool:
        """Some device is allocated (exclusively or a share of it)."""
        return bool(self.in_use or self.shared_use)

    def free(self, d: Device, name: str, ignore_in_use: bool = False) -> Decimal | None:
        """How much of a shared device's capacity no allocation has consumed."""
        value = d.capacity(name)
        if value is None:
            return None
        used = Decimal(0) if ignore_in_use else self.shared_use.get(d.key, {}).get(name, Decimal(0))
        return value - used

    def candidates(self, node: str, sub: SubRequest) -> list[Device]:
        """Devices on `node` matching the class and request selectors (cached: selectors are pure)."""
        k = (node, sub.device_class, tuple(sub.selectors))
        hit = self._candidates.get(k)
        if hit is None:
            hit = self._candidates[k] = [d for d in self.devices(node) if self.selectable(sub, d)]
        return hit

    def free_candidates(self, node: str, sub: SubRequest) -> int:
        """How many of the candidates no allocation holds exclusively (cached until in_use changes)."""
        k = (node, sub.device_class, tuple(sub.selectors))
        hit = self._free.get(k)
        if hit is None:
            hit = self._free[k] = sum(d.key not in self.in_use for d in self.candidates(node, sub))
        return hit

    def may_start(self, node: str, request: Request, ignore_in_use: bool) -> bool:
        """False when no alternative of `request` has enough candidates on `node`: the search's
        own first check, from cached counts, so that a full node costs a lookup, not a search.
        The alternatives' candidates are computed in the search's order (the same errors)."""
        for sub in request.alternatives:
            if sub.mode == "All":
                return True
            if len(self.candidates(node, sub)) < sub.count:
                continue
            if sub.admin_access or ignore_in_use or self.free_candidates(node, sub) >= sub.count:
                return True
        return False
