"""The node's published devices, derived once: what each device is and which health events reach it.

Built from the Inventory and the node's options (dynamic MIG is already marked on each GPU by
discovery; memory shares are an option of the publication), and read by every part that needs
the device list: the slices (what is published, in the scheduler's order), the planner (what an
allocated name is), health (what an event taints, what the kubelet's health stream lists), the
claim status (what a prepared device is) and the driver.

A device is one of three kinds:

- `GPU`: a whole GPU, for a GPU not in MIG mode (under memory shares: allocatable to several
  claims by memory, `shared`);
- `MIG`: a MIG device made beforehand (static MIG: a GPU in MIG mode without dynamic MIG);
- `PLACEMENT`: a (profile, placement) of a dynamic-MIG GPU, made at prepare or binding. The GPU
  itself is not published (see dra_gpu.node.dynamic_mig).

Which health events reach a device (`reached_by`): every device of a GPU is reached by an event on
the GPU that NVML attributes to no GPU / compute instance (an XID on the GPU affects all its
instances); an event NVML attributes to an instance reaches the MIG device with those IDs, or on a
dynamic-MIG GPU the placement whose instance it is (known once made: `made`); an instance no
placement is known to hold reaches every placement of its GPU, as an event on the GPU does.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field

from dra_gpu.model.inventory import Gpu, Inventory, MigDevice, MigPlacement
from dra_gpu.node.dynamic_mig import PlacementOrder, two_ended_order

# Memory shares: a GPU is shared in steps of this much memory; a smaller one is not shared.
SHARE_MEMORY_STEP = 1 << 30


class DeviceKind(enum.StrEnum):
    GPU = "gpu"  # a whole GPU
    MIG = "mig"  # a MIG device made beforehand (static MIG)
    PLACEMENT = "placement"  # a dynamic-MIG placement, made on demand


# (GPU UUID, GPU-instance ID) -> the placement device whose instance it is (dynamic MIG).
MadeInstances = Mapping[tuple[str, int], str]


@dataclass(frozen=True)
class CatalogDevice:
    """One published device."""

    name: str
    kind: DeviceKind
    gpu: Gpu
    mig: MigDevice | None = None  # MIG: the instance
    placement: MigPlacement | None = None  # PLACEMENT: where its instance is made
    shared: bool = False  # GPU under memory shares: several claims, each a share of its memory

    @property
    def is_mig(self) -> bool:
        return self.kind is not DeviceKind.GPU

    @property
    def profile(self) -> str | None:
        if self.mig is not None:
            return self.mig.profile
        if self.placement is not None:
            return self.placement.profile.name
        return None

    @property
    def instance(self) -> tuple[int, int] | None:
        """(GPU instance, compute instance) of a MIG device made beforehand; events NVML
        attributes to them reach it."""
        if self.mig is None:
            return None
        return self.mig.gpu_instance_id, self.mig.compute_instance_id


@dataclass(frozen=True)
class DeviceCatalog:
    inventory: Inventory
    devices: tuple[CatalogDevice, ...]  # the scheduler's first-fit order: GPU by GPU, placements
    memory_shares: bool = False
    _by_name: Mapping[str, CatalogDevice] = field(init=False, repr=False, compare=False)
    _by_gpu: Mapping[str, tuple[CatalogDevice, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_gpu: dict[str, list[CatalogDevice]] = {g.uuid: [] for g in self.inventory.gpus}
        for d in self.devices:
            by_gpu.setdefault(d.gpu.uuid, []).append(d)
        object.__setattr__(self, "_by_name", {d.name: d for d in self.devices})
        object.__setattr__(self, "_by_gpu", {u: tuple(ds) for u, ds in by_gpu.items()})

    @classmethod
    def build(
        cls,
        inventory: Inventory,
        memory_shares: bool = False,
        order: PlacementOrder = two_ended_order,
        mig_profiles: Collection[str] = (),
    ) -> DeviceCatalog:
        """The node's devices; `order`: the first-fit order of the dynamic-MIG placements;
        `mig_profiles`: the only MIG profiles offered as dynamic-MIG placements (empty: all). The
        scheduler evaluates every published device's selectors for every claim it places, so each
        profile left out is that many devices less to evaluate (bench/RESULTS.md, scheduler cost).
        The GPUs' counter sets stay whole: they describe the GPU, not the offer."""
        gpus = sorted(inventory.gpus, key=lambda g: g.index)
        # Whole GPUs and MIG devices made beforehand GPU by GPU, as `nvidia-smi -L` lists them (and
        # NVIDIA's driver orders its per-GPU slices): the allocator walks devices in order and
        # evaluates a request's selectors on each until one fits, so a request for one kind no
        # longer passes every device of the other kind first (bench/RESULTS.md, the scheduler at
        # equal fill: whole GPUs first cost each MIG request their evaluation on every node).
        present: list[CatalogDevice] = []
        for g in gpus:
            if not g.mig_enabled:
                shared = memory_shares and g.memory_bytes is not None and g.memory_bytes >= SHARE_MEMORY_STEP
                present.append(CatalogDevice(g.device_name, DeviceKind.GPU, g, shared=shared))
            elif not g.dynamic_mig:  # a MIG-mode GPU runs no CUDA work whole (dynamic MIG too)
                present += [
                    CatalogDevice(g.mig_device_name(m), DeviceKind.MIG, g, mig=m) for m in g.mig_devices
                ]
        dynamic = [
            CatalogDevice(g.mig_name(p.profile.name, p.start), DeviceKind.PLACEMENT, g, placement=p)
            for g, p in order([g for g in gpus if g.dynamic_mig])
            if not mig_profiles or p.profile.name in mig_profiles
        ]
        return cls(inventory, (*present, *dynamic), memory_shares)

    # -- lookups -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[CatalogDevice]:
        return iter(self.devices)

    def __len__(self) -> int:
        return len(self.devices)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> CatalogDevice:
        return self._by_name[name]

    def get(self, name: str) -> CatalogDevice | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return [d.name for d in self.devices]

    def of_kind(self, kind: DeviceKind) -> list[CatalogDevice]:
        return [d for d in self.devices if d.kind is kind]

    def of_gpu(self, gpu_uuid: str) -> tuple[CatalogDevice, ...]:
        return self._by_gpu.get(gpu_uuid, ())

    def groups(self) -> list[list[CatalogDevice]]:
        """The devices that exist (whole GPUs and MIG devices, GPU by GPU), then the dynamic-MIG
        placements: each group starts a new slice; empty groups left out."""
        present = [d for d in self.devices if d.kind is not DeviceKind.PLACEMENT]
        return [g for g in (present, self.of_kind(DeviceKind.PLACEMENT)) if g]

    @property
    def gpus(self) -> list[Gpu]:
        return self.inventory.gpus

    @property
    def dynamic_gpus(self) -> list[Gpu]:
        return [g for g in self.inventory.gpus if g.dynamic_mig]

    def placements(self) -> dict[str, tuple[Gpu, MigPlacement]]:
        """Dynamic-MIG device name -> (its GPU, its placement)."""
        return {d.name: (d.gpu, d.placement) for d in self.devices if d.placement is not None}

    # -- health --------------------------------------------------------------------------------

    def reached_by(
        self,
        gpu_uuid: str,
        gpu_instance: int | None = None,
        compute_instance: int | None = None,
        made: MadeInstances | None = None,
    ) -> list[str]:
        """The devices an event on `gpu_uuid` concerns; `gpu_instance` / `compute_instance`: the
        instance NVML attributes it to (None: the GPU itself); `made`: the dynamic-MIG
        instances made so far."""
        devices = self.of_gpu(gpu_uuid)
        if gpu_instance is None:
            return [d.name for d in devices]  # on the GPU: the GPU, all its MIG devices, placements
        premade = [d for d in devices if d.instance is not None]
        if premade:
            return [
                d.name
                for d in premade
                if d.instance is not None
                and d.instance[0] == gpu_instance
                and (compute_instance is None or d.instance[1] == compute_instance)
            ]
        placements = [d.name for d in devices if d.kind is DeviceKind.PLACEMENT]
        if placements:
            holder = (made or {}).get((gpu_uuid, gpu_instance))
            # An instance no placement is known to hold: as an event on the GPU.
            return [holder] if holder in placements else placements
        return [d.name for d in devices]
