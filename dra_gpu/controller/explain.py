"""Whether a claim can be allocated, where, and if not why: the allocator's search plus the diagnosis.

Its own module so that the allocator (the search) and the diagnosis (the words for a failed search,
built on the allocator) depend on each other in one direction only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dra_gpu.controller.allocator import (
    AllocationError,
    Cluster,
    Placement,
    SearchLimitError,
    UnmodelledError,
    place,
)
from dra_gpu.controller.diagnosis import why_not


@dataclass
class Explanation:
    allocatable: bool
    placement: Placement | None = None
    best: Placement | None = None
    reason: str = ""
    simulated: bool = True  # False: a selector could not be evaluated here (UnmodelledError)


def explain(cluster: Cluster, spec: Mapping[str, Any], ignore_in_use: bool = False) -> Explanation:
    """First-fit placement on the first node (by name) where the claim fits, and the cheapest there."""
    try:
        for node in cluster.nodes:
            p = place(cluster, spec, node, ignore_in_use)
            if p is not None:
                b = p
                if len(p.results) > 1:
                    try:
                        b = place(cluster, spec, node, ignore_in_use, best=True) or p
                    except SearchLimitError:
                        b = p
                return Explanation(True, p, b if b.link_cost < p.link_cost else p)
    except AllocationError as exc:
        return Explanation(False, reason=str(exc), simulated=not isinstance(exc, UnmodelledError))
    return Explanation(False, reason=why_not(cluster, spec, ignore_in_use))
