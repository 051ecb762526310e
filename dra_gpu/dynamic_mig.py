"""Dynamic MIG as the scheduler sees it: one counter set per GPU, what each device consumes from
it, and the order in which the devices are published.

The counters encode NVML's placement rules, so the scheduler never allocates two placements the
GPU cannot hold at once: one counter per memory slice (overlapping placements share one), the
compute slices, and the SMs, engines and memory as the largest profile has them. The whole GPU
consumes everything, so it and any MIG device exclude each other.

The order is the scheduler's only preference (first fit, no scoring): GPUs in index order, so
small instances pile onto the first GPUs and leave later ones whole, and within a GPU each profile
is packed from the high end of the memory slices, so the 4-slice placement at 0 (4g.40gb,
3g.40gb) stays free longest.
"""

from __future__ import annotations

from collections.abc import Callable

from dra_gpu.kubernetes_values import format_quantity
from dra_gpu.model import Gpu, MigPlacement, MigProfile

# Counter names (DNS labels) -> the profile field they sum.
ENGINE_COUNTERS: dict[str, Callable[[MigProfile], int]] = {
    "compute-slices": lambda p: p.compute_slices,
    "multiprocessors": lambda p: p.multiprocessors,
    "copy-engines": lambda p: p.copy_engines,
    "decoders": lambda p: p.decoders,
    "encoders": lambda p: p.encoders,
    "jpeg-engines": lambda p: p.jpeg_engines,
    "ofa-engines": lambda p: p.ofa_engines,
    "memory": lambda p: p.memory_bytes,
}

PlacementOrder = Callable[[Gpu], list[MigPlacement]]


def counter_set_name(gpu: Gpu) -> str:
    return f"{gpu.device_name}-counters"


def memory_slice_counter(i: int) -> str:
    return f"memory-slice-{i}"


def counter_totals(gpu: Gpu) -> dict[str, int]:
    """What one GPU has: 1 per memory slice, and per engine the most any one profile uses (the
    full-GPU profile), never less than NVML reports for the whole GPU. Zero counters are left out."""
    totals = {memory_slice_counter(i): 1 for i in range(gpu.memory_slice_count)}
    for name, value in ENGINE_COUNTERS.items():
        total = max((value(p) for p in gpu.mig_profiles), default=0)
        if name == "memory" and gpu.memory_bytes:
            total = max(total, gpu.memory_bytes)
        if total > 0:
            totals[name] = total
    return totals


def counter_set(gpu: Gpu) -> dict[str, object]:
    return {
        "name": counter_set_name(gpu),
        "counters": {k: {"value": format_quantity(v)} for k, v in counter_totals(gpu).items()},
    }


def placement_consumption(gpu: Gpu, placement: MigPlacement) -> dict[str, int]:
    totals = counter_totals(gpu)
    used = {memory_slice_counter(i): 1 for i in placement.slices}
    for name, value in ENGINE_COUNTERS.items():
        v = value(placement.profile)
        if v > 0 and name in totals:
            used[name] = v
    return used


def consumes(gpu: Gpu, used: dict[str, int]) -> list[dict[str, object]]:
    """A device's `consumesCounters` (one entry: its GPU's set)."""
    return [
        {
            "counterSet": counter_set_name(gpu),
            "counters": {k: {"value": format_quantity(v)} for k, v in used.items()},
        }
    ]


def packed_order(gpu: Gpu) -> list[MigPlacement]:
    """dra-gpu's order: smallest profiles first (a request matching several takes the smallest),
    each profile's placements from the high end down."""
    out = gpu.mig_placements()
    rank = {p.profile.name: i for i, p in enumerate(out)}
    return sorted(out, key=lambda p: (rank[p.profile.name], -p.start))


def ascending_order(gpu: Gpu) -> list[MigPlacement]:
    """The naive order (placements as NVML lists them, low end first): for comparison."""
    return gpu.mig_placements()


PLACEMENT_ORDERS: dict[str, PlacementOrder] = {"packed": packed_order, "ascending": ascending_order}
