"""Dynamic MIG as the scheduler sees it: one counter set per GPU, what each device consumes from
it, and the order in which the devices are published.

The counters encode NVML's placement rules, so the scheduler never allocates two placements the
GPU cannot hold at once: one counter per memory slice (overlapping placements share one), the
compute slices, and the SMs, engines and memory as the largest profile has them.

A dynamic-MIG GPU is offered as its MIG placements only, never as "the whole GPU": it stays in
MIG mode, and a GPU in MIG mode with no instance runs no CUDA work. Offering it would need MIG mode
switched off while no instance exists and on again before the next one, each switch a GPU reset
that fails while any process holds the GPU (and on some systems needs a reboot), with a rollback
for each failure. The full-GPU profile (e.g. 7g.80gb) is the way to get all of it.

The order is the scheduler's only preference (first fit, no scoring; slices by name, devices in
order): partial profiles from the first GPU on, full-GPU ones from the last GPU back; within a GPU
small profiles from the low end and 3g/4g from the high end (see two_ended_order and
bench/mig_fragmentation.py for what each choice is worth).
"""

from __future__ import annotations

from collections.abc import Callable

from dra_gpu.kube.values import format_quantity
from dra_gpu.model.inventory import Gpu, MigPlacement, MigProfile

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

# A dynamic-MIG device: (GPU, placement).
Device = tuple[Gpu, MigPlacement]
# The first-fit order of all dynamic-MIG devices of a node (GPUs in index order).
PlacementOrder = Callable[[list[Gpu]], list[Device]]
# Binding conditions of a MIG placement: the scheduler binds the pod only once the plugin has made
# the instance (True), and sends it back to scheduling if making it failed.
READY_CONDITION = "MigInstanceReady"
FAILED_CONDITION = "MigInstanceFailed"
SMALL_SLICES = 2  # profiles packed from the low end of a GPU
HALF_GPU_SLICES = 4  # profiles up to this many memory slices are placed from the first GPU on


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


def _by_profile(gpu: Gpu, start_key: Callable[[MigPlacement], int]) -> list[MigPlacement]:
    """The GPU's placements, smallest profiles first (a request several profiles match takes the
    smallest), each profile's placements ordered by `start_key`."""
    placements = gpu.mig_placements()
    rank = {p.profile.name: i for i, p in enumerate(placements)}
    return sorted(placements, key=lambda p: (rank[p.profile.name], start_key(p)))


def _split(p: MigPlacement) -> int:
    """Small profiles (<= 2 memory slices) from the low end; larger ones from the high end, the
    half that holds slice 7, which 1g.10gb and 2g.20gb can never use."""
    return p.start if p.profile.memory_slices <= SMALL_SLICES else -p.start


def ascending_order(gpus: list[Gpu]) -> list[Device]:
    """Naive: GPU by GPU, each profile's placements as NVML lists them."""
    return [(g, p) for g in gpus for p in _by_profile(g, lambda p: p.start)]


def packed_order(gpus: list[Gpu]) -> list[Device]:
    """GPU by GPU, each profile's placements from the high end down."""
    return [(g, p) for g in gpus for p in _by_profile(g, lambda p: -p.start)]


def two_ended_order(gpus: list[Gpu]) -> list[Device]:
    """dra-gpu's order. Profiles up to half a GPU from the first GPU on (small ones from the low
    end of each GPU, 3g/4g from the high end); the full-GPU profile (7g.80gb) from the last GPU
    back. Partial instances pile onto the GPUs already split, and requests that need
    a whole GPU find one at the other end, so the two meet only when the node is nearly full."""
    by_index = sorted(gpus, key=lambda g: g.index)
    partial: list[Device] = []
    full: list[Device] = []
    for gpu in by_index:
        for p in _by_profile(gpu, _split):
            (partial if p.profile.memory_slices <= HALF_GPU_SLICES else full).append((gpu, p))
    full.sort(key=lambda d: -d[0].index)  # stable: a GPU's own order is kept
    return partial + full


PLACEMENT_ORDERS: dict[str, PlacementOrder] = {
    "ascending": ascending_order,
    "packed": packed_order,
    "two-ended": two_ended_order,
}
