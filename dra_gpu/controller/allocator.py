"""A simulation of the Kubernetes structured allocator (k8s.io/dynamic-resource-allocation/structured).

Per node: pools (highest generation, complete ones only) sorted by ID, their slices and devices in
published order; requests in order, `firstAvailable` subrequests in listed order; for each device slot
the first device that is free, matches the class and request selectors, is not tainted, fits the
counters and keeps every matchAttribute/distinctAttribute constraint; depth-first backtracking, the
first full solution wins. Constraints are set properties, so trying devices in increasing order per
request (combinations) finds the same first solution as the scheduler's permutation search, faster.

Besides the first-fit answer it finds the placement with the lowest NVLink link cost on that node
(1 per pair of devices in one NVLink domain, 4 per pair across domains).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from dra_gpu.controller.cel import CelEnvironment, CelError, SelectorEvalError
from dra_gpu.controller.cel.environment import Selector, device_value
from dra_gpu.kubernetes_values import parse_quantity

SAME_DOMAIN_COST = 1
CROSS_DOMAIN_COST = 4
MAX_RESULTS_PER_CLAIM = 32  # AllocationResultsMaxSize
DEFAULT_STEP_BUDGET = 500_000


class AllocationError(RuntimeError):
    """The allocation cannot even be attempted (unknown class, a selector failing at runtime, ...)."""


class UnknownClassError(AllocationError):
    """A request names a DeviceClass that does not exist (it may be created later)."""

    def __init__(self, device_class: str) -> None:
        super().__init__(f"device class {device_class!r} does not exist")
        self.device_class = device_class


class UnmodelledError(AllocationError):
    """A selector uses Kubernetes CEL functions this simulation does not model (valid, not simulated)."""


class SearchLimitError(AllocationError):
    """The search ran out of its step budget (the scheduler has a filter timeout for the same reason)."""


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


def _q(value: Any) -> Decimal | None:
    try:
        return parse_quantity(str(value)) if value is not None else None
    except ValueError:
        return None


def policy_amount(request: Decimal | None, value: Decimal, policy: Any) -> Decimal | None:
    """The amount a request consumes under a capacity's request policy (None: not allocatable),
    as the scheduler rounds it: up to min, up to the next step, up to the next valid value."""
    if not isinstance(policy, dict):
        amount = value if request is None else request
    elif request is None:
        amount = _q(policy.get("default")) or Decimal(0)
    elif policy.get("validValues"):
        valid = sorted(v for v in (_q(x) for x in policy["validValues"]) if v is not None)
        fitting = [v for v in valid if v >= request]
        if not fitting:
            return None
        amount = fitting[0]
    elif isinstance(policy.get("validRange"), dict):
        rng = policy["validRange"]
        low, high, step = _q(rng.get("min")) or Decimal(0), _q(rng.get("max")), _q(rng.get("step"))
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


@dataclass
class SubRequest:
    """One alternative of a request: the request itself (`sub` None) or one `firstAvailable` entry."""

    request: str
    sub: str | None
    device_class: str
    selectors: list[str]
    mode: str  # ExactCount | All
    count: int
    admin_access: bool
    tolerations: list[Mapping[str, Any]]
    capacity: dict[str, Decimal] = field(default_factory=dict)  # capacity.requests

    @property
    def name(self) -> str:
        return f"{self.request}/{self.sub}" if self.sub else self.request


@dataclass
class Request:
    name: str
    alternatives: list[SubRequest]


@dataclass
class Constraint:
    kind: str  # match | distinct
    attribute: str
    requests: list[str]

    def applies(self, sub: SubRequest) -> bool:
        return not self.requests or sub.request in self.requests or sub.name in self.requests


@dataclass
class Placement:
    node: str
    results: list[tuple[str, Device]]  # (request name as in the allocation result, device)
    link_cost: int
    consumed: list[dict[str, Decimal]] = field(default_factory=list)  # per result; {} unless shared

    @property
    def devices(self) -> list[str]:
        return [d.name for _, d in self.results]


def parse_requests(spec: Mapping[str, Any]) -> tuple[list[Request], list[Constraint]]:
    """Requests and constraints of a claim's `spec.devices`, with API defaults applied."""
    devices = spec.get("devices") or {}
    requests: list[Request] = []
    for r in devices.get("requests") or []:
        name = str(r.get("name", ""))
        if r.get("firstAvailable"):
            alts = [_sub(name, s.get("name"), s) for s in r["firstAvailable"]]
        else:
            alts = [_sub(name, None, r.get("exactly") or r)]
        requests.append(Request(name, alts))
    constraints: list[Constraint] = []
    for c in devices.get("constraints") or []:
        if c.get("matchAttribute"):
            constraints.append(Constraint("match", str(c["matchAttribute"]), list(c.get("requests") or [])))
        elif c.get("distinctAttribute"):
            constraints.append(
                Constraint("distinct", str(c["distinctAttribute"]), list(c.get("requests") or []))
            )
    return requests, constraints


def _sub(request: str, sub: Any, body: Mapping[str, Any]) -> SubRequest:
    mode = body.get("allocationMode") or "ExactCount"
    count = body.get("count")
    return SubRequest(
        request=request,
        sub=str(sub) if sub else None,
        device_class=str(body.get("deviceClassName", "")),
        selectors=[
            str((s.get("cel") or {}).get("expression", ""))
            for s in body.get("selectors") or []
            if isinstance(s, dict)
        ],
        mode=str(mode),
        count=int(count) if isinstance(count, int) and not isinstance(count, bool) else 1,
        admin_access=bool(body.get("adminAccess", False)),
        tolerations=list(body.get("tolerations") or []),
        capacity=_capacity_requests(body),
    )


def _capacity_requests(body: Mapping[str, Any]) -> dict[str, Decimal]:
    requests = (body.get("capacity") or {}).get("requests") or {}
    out = {}
    for name, value in requests.items() if isinstance(requests, dict) else ():
        amount = _q(value)
        if amount is not None:
            out[str(name).rpartition("/")[2]] = amount
    return out


def allocated_devices(claims: Iterable[Mapping[str, Any]]) -> set[tuple[str, str, str]]:
    """Devices in use by allocated claims (admin-access results and shares do not block others)."""
    out: set[tuple[str, str, str]] = set()
    for c in claims:
        alloc = ((c.get("status") or {}).get("allocation") or {}).get("devices") or {}
        for r in alloc.get("results") or []:
            if not r.get("adminAccess") and not r.get("shareID"):
                out.add((str(r.get("driver")), str(r.get("pool")), str(r.get("device"))))
    return out


def blocking_taint(device: Device, sub: SubRequest) -> Mapping[str, Any] | None:
    """The first NoSchedule / NoExecute taint of the device the request does not tolerate."""
    for t in device.taints():
        if t.get("effect") in ("NoSchedule", "NoExecute") and not _tolerated(t, sub.tolerations):
            return t
    return None


def describe_taint(taint: Mapping[str, Any]) -> str:
    value = taint.get("value")
    return f"{taint.get('key')}{'=' + str(value) if value else ''}:{taint.get('effect')}"


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
                amount = _q(value)
                if amount is not None:
                    key = str(name).rpartition("/")[2]
                    used[key] = used.get(key, Decimal(0)) + amount
    return out


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


def link_cost(devices: Sequence[Device]) -> int:
    doms = [d.attribute(f"{d.driver}/nvlinkDomain") for d in devices]
    cost = 0
    for a, b in itertools.combinations(doms, 2):
        cost += SAME_DOMAIN_COST if a is not None and a == b else CROSS_DOMAIN_COST
    return cost


class _Search:
    """Backtracking over one node for one claim."""

    def __init__(
        self,
        cluster: Cluster,
        node: str,
        requests: list[Request],
        constraints: list[Constraint],
        ignore_in_use: bool,
        best: bool,
        ignore_counters: bool = False,
    ) -> None:
        self.c = cluster
        self.node = node
        self.requests = requests
        self.constraints = constraints
        self.in_use = set() if ignore_in_use else cluster.in_use
        self.ignore_taints = ignore_in_use  # "could it ever": taints come and go like allocations
        self.best_mode = best
        self.ignore_counters = ignore_counters
        self.chosen: list[tuple[SubRequest, Device]] = []
        self.allocating: set[tuple[str, str, str]] = set()
        self.values: list[list[tuple[str, Any]]] = [[] for _ in constraints]  # per constraint: taken values
        # Counters already taken by allocated devices, as the scheduler subtracts them.
        self.consumed: dict[tuple[tuple[str, str], str, str], Decimal] = (
            {} if ignore_in_use else cluster.consumed_by_in_use(node)
        )
        self.steps = 0
        self.found: list[tuple[SubRequest, Device]] | None = None
        self.best_cost: int | None = None
        self.cands: dict[int, list[Device]] = {}
        self._taken_stack: list[list[int]] = []  # per chosen device: the constraints it set a value in
        self.shared_base = {} if ignore_in_use else cluster.shared_use
        self.shared_used: dict[tuple[str, str, str], dict[str, Decimal]] = {}  # by this claim
        self._consumed_stack: list[dict[str, Decimal]] = []

    def run(self) -> list[tuple[SubRequest, Device]] | None:
        self._next(0)
        return self.found

    def _candidates(self, sub: SubRequest) -> list[Device]:
        k = id(sub)
        if k not in self.cands:
            self.cands[k] = self.c.candidates(self.node, sub)
        return self.cands[k]

    def _next(self, ri: int) -> bool:
        if ri == len(self.requests):
            return self._solution()
        for sub in self.requests[ri].alternatives:
            cands = self._candidates(sub)
            if sub.mode == "All":
                if not cands or any(not self.c.pool(d.pool_key) for d in cands):
                    continue
                added = 0
                for d in cands:
                    if not self._add(sub, d):
                        break
                    added += 1
                if added == len(cands) and len(self.chosen) <= MAX_RESULTS_PER_CLAIM and self._next(ri + 1):
                    return True
                for _ in range(added):
                    self._remove()
            else:
                if len(self.chosen) + sub.count > MAX_RESULTS_PER_CLAIM or len(cands) < sub.count:
                    continue
                if not sub.admin_access and self.in_use:
                    cands = [d for d in cands if d.key not in self.in_use]
                    if len(cands) < sub.count:
                        continue
                cands = self._matchable(sub, cands)
                if len(cands) < sub.count:
                    continue
                if self._fill(ri, sub, cands, sub.count, 0):
                    return True
        return False

    def _matchable(self, sub: SubRequest, cands: list[Device]) -> list[Device]:
        """Candidates that can be part of a solution under the match constraints: all `count`
        devices of the request share each matched attribute's value (the one an earlier request
        took, if any), so a device whose value fewer than `count` candidates have is never
        chosen. Pruning them first spares the search every combination that would fail later."""
        for i, con in enumerate(self.constraints):
            if con.kind != "match" or not con.applies(sub):
                continue
            taken = self.values[i][0] if self.values[i] else None
            groups: dict[Any, list[Device]] = {}
            for d in cands:
                value = d.attribute(con.attribute)
                if value is not None and (taken is None or value == taken):
                    groups.setdefault(value, []).append(d)
            keep = {id(d) for g in groups.values() if len(g) >= sub.count for d in g}
            if len(keep) < len(cands):
                cands = [d for d in cands if id(d) in keep]
        return cands

    def _fill(self, ri: int, sub: SubRequest, cands: list[Device], remaining: int, start: int) -> bool:
        if remaining == 0:
            return self._next(ri + 1)
        for j in range(start, len(cands) - remaining + 1):
            self.steps += 1
            if self.steps > self.c.step_budget:
                raise SearchLimitError(f"search gave up after {self.c.step_budget} steps on node {self.node}")
            d = cands[j]
            if self.best_mode and self.best_cost is not None and self._partial_cost(d) >= self.best_cost:
                continue
            if not self._add(sub, d):
                continue
            if self._fill(ri, sub, cands, remaining - 1, j + 1):
                return True
            self._remove()
        return False

    def _partial_cost(self, d: Device) -> int:
        return link_cost([x for _, x in self.chosen] + [d])

    def _add(self, sub: SubRequest, d: Device) -> bool:
        if d.key in self.allocating or (d.key in self.in_use and not sub.admin_access):
            return False
        shares: dict[str, Decimal] = {}
        if d.multi or sub.capacity:
            cons = d.consumption(sub.capacity)
            if cons is None:
                return False
            if d.multi:
                base, mine = self.shared_base.get(d.key, {}), self.shared_used.get(d.key, {})
                for name, amount in cons.items():
                    used = base.get(name, Decimal(0)) + mine.get(name, Decimal(0))
                    if used + amount > (d.capacity(name) or Decimal(0)):
                        return False
                shares = cons
        if not self.ignore_taints and blocking_taint(d, sub) is not None:
            return False
        pool = self.c.pool(d.pool_key)
        if d.consumes and pool is not None and not self.ignore_counters:
            for cset, counters in d.consumes:
                for cname, v in counters.items():
                    avail = pool.counters.get((cset, cname))
                    used = self.consumed.get((d.pool_key, cset, cname), Decimal(0))
                    if avail is None or used + v > avail:
                        return False
        taken: list[int] = []
        for i, con in enumerate(self.constraints):
            if not con.applies(sub):
                continue
            value = d.attribute(con.attribute)
            if value is None:
                return False
            if con.kind == "match" and self.values[i] and self.values[i][0] != value:
                return False
            if con.kind == "distinct" and value in self.values[i]:
                return False
            taken.append(i)
        for i in taken:
            self.values[i].append(d.attribute(self.constraints[i].attribute))  # type: ignore[arg-type]
        for cset, counters in d.consumes:
            for cname, v in counters.items():
                k = (d.pool_key, cset, cname)
                self.consumed[k] = self.consumed.get(k, Decimal(0)) + v
        self.chosen.append((sub, d))
        self._taken_stack.append(taken)
        self._consumed_stack.append(shares)
        if shares:
            mine = self.shared_used.setdefault(d.key, {})
            for name, amount in shares.items():
                mine[name] = mine.get(name, Decimal(0)) + amount
        if not sub.admin_access and not d.multi:  # a shared device may take another share
            self.allocating.add(d.key)
        return True

    def _remove(self) -> None:
        _, d = self.chosen.pop()
        for i in self._taken_stack.pop():
            self.values[i].pop()
        for name, amount in self._consumed_stack.pop().items():
            self.shared_used[d.key][name] -= amount
        for cset, counters in d.consumes:
            for cname, v in counters.items():
                self.consumed[(d.pool_key, cset, cname)] -= v
        self.allocating.discard(d.key)

    def _solution(self) -> bool:
        if not self.best_mode:
            self.found = list(self.chosen)
            return True
        cost = link_cost([d for _, d in self.chosen])
        if self.best_cost is None or cost < self.best_cost:
            self.best_cost = cost
            self.found = list(self.chosen)
        return cost == 0  # nothing beats 0


def place(
    cluster: Cluster,
    spec: Mapping[str, Any],
    node: str,
    ignore_in_use: bool = False,
    best: bool = False,
    ignore_counters: bool = False,
    parsed: tuple[list[Request], list[Constraint]] | None = None,
) -> Placement | None:
    """`ignore_counters`: as if devices shared no counters (the diagnosis asks whether they are
    what stands in the way). `parsed`: parse_requests(spec), for a caller placing one claim on
    many nodes (the search never changes it)."""
    requests, constraints = parsed or parse_requests(spec)
    if requests and not cluster.may_start(node, requests[0], ignore_in_use):
        return None
    found = _Search(cluster, node, requests, constraints, ignore_in_use, best, ignore_counters).run()
    if found is None:
        return None
    consumed = [(d.consumption(s.capacity) or {}) if d.multi else {} for s, d in found]
    return Placement(node, [(s.name, d) for s, d in found], link_cost([d for _, d in found]), consumed)
