"""Whether a claim can be allocated, where, and if not why: the allocator's search plus the diagnosis.

Its own module so that the allocator (the search) and the diagnosis (the words for a failed search,
built on the allocator) depend on each other in one direction only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from dra_gpu.controller.allocation_errors import (
    AllocationError,
    SearchLimitError,
    UnknownClassError,
    UnmodelledError,
)
from dra_gpu.controller.allocator import Placement, place
from dra_gpu.controller.allocator_view import Cluster
from dra_gpu.controller.claim_requests import parse_requests
from dra_gpu.controller.diagnosis import why_not


class Failure(Enum):
    """Why a claim is not allocatable, for callers that act on it; the words are in `reason`."""

    NO_PLACEMENT = "no-placement"  # the search ran and no combination of devices fits
    UNKNOWN_CLASS = "unknown-class"  # a request names a DeviceClass that does not exist (yet)
    NOT_SIMULATED = "not-simulated"  # a selector uses Kubernetes CEL functions dra-gpu does not model
    NOT_ATTEMPTED = "not-attempted"  # a selector failed at runtime, or the search ran out of steps


@dataclass
class Explanation:
    allocatable: bool
    placement: Placement | None = None
    best: Placement | None = None  # None also when the caller did not ask for it
    reason: str = ""
    failure: Failure | None = None  # None when allocatable

    @property
    def simulated(self) -> bool:
        """False: a selector could not be evaluated here, so the allocation was not simulated."""
        return self.failure is not Failure.NOT_SIMULATED


@dataclass(frozen=True)
class SharedValue:
    """The value a matchAttribute constraint's devices share in a placement: the PCIe root a GPU
    and a NIC of another driver sit on, the NVLink domain of a claim's GPUs."""

    attribute: str
    value: str
    requests: tuple[str, ...]  # as in the allocation's results ("gpu", "gpu/h100"), each once, in order
    drivers: tuple[str, ...]  # of the devices under it, each once, in order

    @property
    def spans_drivers(self) -> bool:
        return len(self.drivers) > 1

    def describe(self) -> str:
        """ "gpu and nic on pcieRoot pci0000:16"."""
        names = list(self.requests)
        who = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        return f"{who} on {self.attribute.rpartition('/')[2]} {self.value}"


def shared_values(spec: Mapping[str, Any], placement: Placement) -> list[SharedValue]:
    """What each matchAttribute constraint of the claim's spec holds equal in `placement`."""
    _, constraints = parse_requests(spec)
    out: list[SharedValue] = []
    for con in constraints:
        if con.kind != "match":
            continue
        under = [
            (name, d)
            for name, d in placement.results
            if not con.requests or name in con.requests or name.partition("/")[0] in con.requests
        ]
        value = under[0][1].attribute(con.attribute) if under else None
        if value is None:
            continue
        out.append(
            SharedValue(
                con.attribute,
                str(value[1]),
                tuple(dict.fromkeys(name for name, _ in under)),
                tuple(dict.fromkeys(d.driver for _, d in under)),
            )
        )
    return out


def _failure(exc: AllocationError) -> Failure:
    if isinstance(exc, UnknownClassError):
        return Failure.UNKNOWN_CLASS
    if isinstance(exc, UnmodelledError):
        return Failure.NOT_SIMULATED
    return Failure.NOT_ATTEMPTED


def explain(
    cluster: Cluster, spec: Mapping[str, Any], ignore_in_use: bool = False, best: bool = True
) -> Explanation:
    """First-fit placement on the first node (by name) where the claim fits, and with `best` the
    cheapest there (a second search; the admission rules, which only ask whether it fits, skip it).
    Kept in `cluster.explained` when the caller gave it one (the cluster does not change)."""
    if cluster.explained is None:
        return _explain(cluster, spec, ignore_in_use, best)
    key = (json.dumps(spec, sort_keys=True, default=str), ignore_in_use, best)
    found = cluster.explained.get(key)
    if found is None:
        found = cluster.explained[key] = _explain(cluster, spec, ignore_in_use, best)
    return found


def _explain(cluster: Cluster, spec: Mapping[str, Any], ignore_in_use: bool, best: bool) -> Explanation:
    try:
        parsed = parse_requests(spec)
        for node in cluster.nodes:
            p = place(cluster, spec, node, ignore_in_use, parsed=parsed)
            if p is not None:
                if not best:
                    return Explanation(True, p)
                b = p
                if len(p.results) > 1:
                    try:
                        b = place(cluster, spec, node, ignore_in_use, best=True, parsed=parsed) or p
                    except SearchLimitError:
                        b = p
                return Explanation(True, p, b if b.link_cost < p.link_cost else p)
    except AllocationError as exc:
        return Explanation(False, reason=str(exc), failure=_failure(exc))
    try:
        reason = why_not(cluster, spec, ignore_in_use)
    except UnknownClassError as exc:
        return Explanation(False, reason=str(exc), failure=Failure.UNKNOWN_CLASS)
    except AllocationError as exc:  # the search did run: its words are the diagnosis's error
        return Explanation(False, reason=str(exc), failure=Failure.NO_PLACEMENT)
    return Explanation(False, reason=reason, failure=Failure.NO_PLACEMENT)
