"""A simulation of the Kubernetes structured allocator (k8s.io/dynamic-resource-allocation/structured).

Per node: pools (highest generation, complete ones only) sorted by ID, their slices and devices in
published order; requests in order, `firstAvailable` subrequests in listed order; for each device slot
the first device that is free, matches the class and request selectors, is not tainted, fits the
counters and keeps every matchAttribute/distinctAttribute constraint; depth-first backtracking, the
first full solution wins. Constraints are set properties, so trying devices in increasing order per
request (combinations) finds the same first solution as the scheduler's permutation search, faster.

Besides the first-fit answer it finds the placement with the lowest NVLink link cost on that node
(1 per pair of GPUs in one NVLink domain, 4 per pair across domains; devices of other kinds, such
as a NIC beside the GPU, cost nothing).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from dra_gpu.controller.allocation_errors import SearchLimitError
from dra_gpu.controller.allocator_view import Cluster
from dra_gpu.controller.claim_requests import Constraint, Request, SubRequest, parse_requests
from dra_gpu.controller.published_devices import Device, blocking_taint

SAME_DOMAIN_COST = 1
CROSS_DOMAIN_COST = 4
MAX_RESULTS_PER_CLAIM = 32  # AllocationResultsMaxSize


@dataclass
class Placement:
    node: str
    results: list[tuple[str, Device]]  # (request name as in the allocation result, device)
    link_cost: int
    consumed: list[dict[str, Decimal]] = field(default_factory=list)  # per result; {} unless shared

    @property
    def devices(self) -> list[str]:
        return [d.name for _, d in self.results]


GPU_TYPES = frozenset({"gpu", "mig"})


def link_cost(devices: Sequence[Device]) -> int:
    """The NVLink cost of the GPUs among `devices`: a device of another kind (a NIC a claim asks for
    beside its GPU) has no NVLink to price."""
    doms = [d.attribute(f"{d.driver}/nvlinkDomain") for d in devices if _is_gpu(d)]
    cost = 0
    for a, b in itertools.combinations(doms, 2):
        cost += SAME_DOMAIN_COST if a is not None and a == b else CROSS_DOMAIN_COST
    return cost


def _is_gpu(d: Device) -> bool:
    kind = d.attribute(f"{d.driver}/type")
    return kind is not None and kind[1] in GPU_TYPES


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
