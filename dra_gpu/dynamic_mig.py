"""Dynamic MIG as the scheduler sees it: one counter set per GPU, what each device consumes from
it, and the order in which the devices are published.

The counters encode NVML's placement rules, so the scheduler never allocates two placements the
GPU cannot hold at once: one counter per memory slice (overlapping placements share one), the
compute slices, and the SMs, engines and memory as the largest profile has them. The whole GPU
consumes everything, so it and any MIG device exclude each other.

The order is the scheduler's only preference (first fit, no scoring; slices by name, devices in
order): partial profiles from the first GPU on, full-GPU ones from the last GPU back, and within a
GPU each profile packed from the high end of the memory slices, so the 4-slice placement at 0
(4g.40gb, 3g.40gb) stays free longest (see two_ended_order and bench/mig_fragmentation.py).
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

# A dynamic-MIG device: (GPU, placement), or (GPU, None) for the whole GPU.
Device = tuple[Gpu, MigPlacement | None]
# The first-fit order of all dynamic-MIG devices of a node (GPUs in index order).
PlacementOrder = Callable[[list[Gpu]], list[Device]]
SMALL_SLICES = 4  # profiles up to half a GPU are packed from the first GPU on


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


def _per_gpu(gpus: list[Gpu], starts_descending: bool) -> list[Device]:
    out: list[Device] = []
    for gpu in gpus:
        out.append((gpu, None))
        placements = gpu.mig_placements()
        rank = {p.profile.name: i for i, p in enumerate(placements)}
        if starts_descending:
            placements.sort(key=lambda p: (rank[p.profile.name], -p.start))
        out += [(gpu, p) for p in placements]
    return out


def ascending_order(gpus: list[Gpu]) -> list[Device]:
    """Naive: GPU by GPU, each profile's placements as NVML lists them (low slice first), so a
    1g.10gb takes slice 0 and with it the GPU's 4g.40gb, 7g.80gb and one 3g.40gb."""
    return _per_gpu(gpus, starts_descending=False)


def packed_order(gpus: list[Gpu]) -> list[Device]:
    """GPU by GPU, each profile's placements from the high end down."""
    return _per_gpu(gpus, starts_descending=True)


def two_ended_order(gpus: list[Gpu]) -> list[Device]:
    """dra-gpu's order. Profiles up to half a GPU (1g..4g) from the first GPU on, each packed
    from the high end of the GPU; the full-GPU profile (7g.80gb) and whole GPUs from the last GPU
    back. Partial instances pile onto the GPUs already split, and the requests that need a whole
    GPU find one at the other end, so the two meet only when the node is nearly full."""
    small: list[Device] = []
    large: list[Device] = []
    for gpu in gpus:
        for dev in packed_order([gpu])[1:]:
            placement = dev[1]
            is_small = placement is not None and placement.profile.memory_slices <= SMALL_SLICES
            (small if is_small else large).append(dev)
    large_by_gpu: dict[int, list[Device]] = {}
    for dev in large:
        large_by_gpu.setdefault(dev[0].index, []).append(dev)
    out = small
    for gpu in sorted(gpus, key=lambda g: g.index, reverse=True):
        out += large_by_gpu.get(gpu.index, [])
    for gpu in sorted(gpus, key=lambda g: g.index, reverse=True):
        out.append((gpu, None))
    return out


PLACEMENT_ORDERS: dict[str, PlacementOrder] = {
    "ascending": ascending_order,
    "packed": packed_order,
    "two-ended": two_ended_order,
}
