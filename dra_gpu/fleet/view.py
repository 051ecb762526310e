"""Snapshot -> what `dra-gpu top` shows: per node its GPUs grouped by NVLink domain, each GPU's
state and who holds it, totals per node, per model and for the cluster. A pure function of the
snapshot, so the renderers (text and JSON) and the tests see the same facts.

A GPU is one physical card: a whole-GPU device, or all the MIG devices / dynamic-MIG placements
with the same parent UUID. Its state is one of

- `free`: nothing allocated;
- `held`: allocated whole to one claim (or, with adminAccess, to several);
- `shared`: published for memory shares and allocated to one or more claims, each with its memory;
- `mig`: in MIG mode; its instances (made, or placements made at prepare) used and free.

A taint is independent of the state: a held GPU can be tainted too.
"""

from __future__ import annotations

import enum
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from dra_gpu.fleet.pending import PendingClaim
from dra_gpu.fleet.snapshot import Allocation, Claim, CounterSet, PublishedDevice, Snapshot, Taint
from dra_gpu.model.mps_daemon_pods import claim_uid_of

MIG_NAME_SEPARATOR = "-mig-"  # MIG device names are the parent GPU's name + "-mig-" + profile + start


class GpuState(enum.StrEnum):
    FREE = "free"
    HELD = "held"
    SHARED = "shared"
    MIG = "mig"


class DomainKind(enum.StrEnum):
    NVLINK = "nvlink"  # GPUs that are all NVLink-connected to each other (two or more)
    NONE = "none"  # GPUs with no NVLink peer
    MIG = "mig"  # GPUs in MIG mode: their devices publish no NVLink domain


@dataclass(frozen=True)
class PodRef:
    name: str
    phase: str  # "" when the pod was not listed (gone, or outside --namespace)


@dataclass(frozen=True)
class Holder:
    namespace: str
    claim: str
    pods: tuple[PodRef, ...]
    memory: int | None = None  # a share's memory, bytes
    mps_daemons: tuple[PodRef, ...] = ()  # the claim's MPS daemons' pods (`namespace/name`)

    @property
    def owner(self) -> str:
        """`namespace/pod` (the first reserving pod) or `namespace/claim` without one."""
        return f"{self.namespace}/{self.pods[0].name if self.pods else self.claim}"


@dataclass(frozen=True)
class MigInstance:
    device: str
    profile: str
    holders: tuple[Holder, ...]


@dataclass(frozen=True)
class MigView:
    dynamic: bool  # placements made at prepare (dynamic MIG) or instances made beforehand
    used: tuple[MigInstance, ...]
    free: tuple[tuple[str, int], ...]  # (profile, how many could be allocated now), smallest first
    slices_used: int | None = None  # memory slices (dynamic MIG)
    slices_total: int | None = None


@dataclass(frozen=True)
class GpuView:
    node: str
    name: str
    uuid: str
    index: int | None
    product: str
    memory: int | None
    state: GpuState
    holders: tuple[Holder, ...] = ()
    free_memory: int | None = None  # shared: what no share holds
    taints: tuple[Taint, ...] = ()
    mig: MigView | None = None

    @property
    def tainted(self) -> bool:
        return bool(self.taints)


@dataclass(frozen=True)
class Totals:
    gpus: int = 0
    free: int = 0
    held: int = 0
    shared: int = 0
    mig: int = 0
    tainted: int = 0

    @classmethod
    def of(cls, gpus: Iterable[GpuView]) -> Totals:
        gpus = list(gpus)
        states = Counter(g.state for g in gpus)
        return cls(
            gpus=len(gpus),
            free=states[GpuState.FREE],
            held=states[GpuState.HELD],
            shared=states[GpuState.SHARED],
            mig=states[GpuState.MIG],
            tainted=sum(1 for g in gpus if g.tainted),
        )


@dataclass(frozen=True)
class DomainView:
    kind: DomainKind
    domain: str | None  # the nvlinkDomain attribute (NVLINK only)
    gpus: tuple[GpuView, ...]


@dataclass(frozen=True)
class NodeView:
    name: str
    domains: tuple[DomainView, ...]
    totals: Totals

    @property
    def gpus(self) -> list[GpuView]:
        return [g for d in self.domains for g in d.gpus]


@dataclass(frozen=True)
class FleetView:
    nodes: tuple[NodeView, ...]
    models: tuple[tuple[str, Totals], ...]  # product name -> totals, by name
    totals: Totals
    problems: tuple[str, ...] = ()
    filters: dict[str, str] = field(default_factory=dict)
    pending: tuple[PendingClaim, ...] = ()  # Pending pods' claims with no allocation, and why


# ---------------------------------------------------------------- building


def _holders(
    allocations: Sequence[tuple[Claim, Allocation]],
    pods: dict[tuple[str, str], str],
    daemons: dict[str, tuple[PodRef, ...]],
) -> tuple[Holder, ...]:
    return tuple(
        Holder(
            claim.namespace,
            claim.name,
            tuple(PodRef(p, pods.get((claim.namespace, p), "")) for p in claim.pods),
            alloc.memory if alloc.share_id else None,
            daemons.get(claim.uid, ()) if claim.uid else (),
        )
        for claim, alloc in allocations
    )


def _gpu_name(device: PublishedDevice, counter_set: CounterSet | None) -> str:
    """The GPU's own device name; a MIG GPU publishes none, its devices are named after it."""
    if device.kind != "mig":
        return device.name
    if counter_set is not None and counter_set.name.endswith("-counters"):
        return counter_set.name.removesuffix("-counters")
    base, sep, _ = device.name.partition(MIG_NAME_SEPARATOR)
    return base if sep else device.gpu_uuid


def _unique_taints(devices: Iterable[PublishedDevice]) -> tuple[Taint, ...]:
    return tuple(dict.fromkeys(t for d in devices for t in d.taints))


def _mig_view(
    devices: Sequence[PublishedDevice],
    held: dict[str, tuple[Holder, ...]],
    counter_set: CounterSet | None,
) -> MigView:
    dynamic = any(d.counter_set for d in devices)
    used = tuple(MigInstance(d.name, d.profile or "?", held[d.name]) for d in devices if d.name in held)
    memory: dict[str, int] = {}
    for d in devices:
        memory.setdefault(d.profile or "?", d.memory or 0)
    if dynamic:
        taken = frozenset().union(*(d.memory_slices for d in devices if d.name in held))
        free = Counter(
            d.profile or "?" for d in devices if d.name not in held and not d.memory_slices & taken
        )
        total = counter_set.memory_slices if counter_set else None
        slices_used: int | None = len(taken)
    else:
        free = Counter(d.profile or "?" for d in devices if d.name not in held)
        total = slices_used = None
    order = sorted(free, key=lambda p: (memory.get(p, 0), p))
    return MigView(dynamic, used, tuple((p, free[p]) for p in order), slices_used, total)


def _gpu_view(
    devices: Sequence[PublishedDevice],
    held: dict[str, tuple[Holder, ...]],
    sets: dict[tuple[str, str], CounterSet],
) -> GpuView:
    first = devices[0]
    taints = _unique_taints(devices)
    if first.kind == "mig":
        cs = sets.get((first.pool, first.counter_set or ""))
        return GpuView(
            node=first.node,
            name=_gpu_name(first, cs),
            uuid=first.gpu_uuid,
            index=first.index,
            product=first.product,
            memory=cs.memory if cs else None,
            state=GpuState.MIG,
            taints=taints,
            mig=_mig_view(devices, held, cs),
        )
    holders = held.get(first.name, ())
    free_memory = None
    if first.shareable:
        state = GpuState.SHARED if holders else GpuState.FREE
        if first.memory is not None:
            free_memory = max(0, first.memory - sum(h.memory or 0 for h in holders))
    else:
        state = GpuState.HELD if holders else GpuState.FREE
    return GpuView(
        node=first.node,
        name=first.name,
        uuid=first.gpu_uuid,
        index=first.index,
        product=first.product,
        memory=first.memory,
        state=state,
        holders=holders,
        free_memory=free_memory,
        taints=taints,
    )


def _domains(gpus: list[tuple[GpuView, PublishedDevice]]) -> tuple[DomainView, ...]:
    nvlink: dict[str, list[GpuView]] = defaultdict(list)
    alone: list[GpuView] = []
    mig: list[GpuView] = []
    for gpu, device in gpus:
        if gpu.state is GpuState.MIG:
            mig.append(gpu)
        elif device.nvlink_domain and device.nvlink_domain_size > 1:
            nvlink[device.nvlink_domain].append(gpu)
        else:
            alone.append(gpu)
    out = [DomainView(DomainKind.NVLINK, name, tuple(members)) for name, members in nvlink.items()]
    out.sort(key=lambda d: _index_key(d.gpus[0]))
    if alone:
        out.append(DomainView(DomainKind.NONE, None, tuple(alone)))
    if mig:
        out.append(DomainView(DomainKind.MIG, None, tuple(mig)))
    return tuple(out)


def _index_key(gpu: GpuView) -> tuple[int, str]:
    return (gpu.index if gpu.index is not None else 1 << 30, gpu.name)


def _visible(gpu: GpuView, namespace: str) -> GpuView | None:
    """The GPU as a namespace sees it (its own holders only), or None when it holds none of them."""
    if gpu.mig is not None:
        used = tuple(
            MigInstance(i.device, i.profile, mine)
            for i in gpu.mig.used
            if (mine := tuple(h for h in i.holders if h.namespace == namespace))
        )
        if not used:
            return None
        return replace(gpu, mig=replace(gpu.mig, used=used))
    mine = tuple(h for h in gpu.holders if h.namespace == namespace)
    return replace(gpu, holders=mine) if mine else None


def build_view(
    snapshot: Snapshot,
    node: str | None = None,
    namespace: str | None = None,
    pending: tuple[PendingClaim, ...] = (),
) -> FleetView:
    """The view of `snapshot`; `node`: that node only; `namespace`: only the GPUs a claim of that
    namespace holds, with that namespace's holders (a shared GPU's free memory still counts all).
    `pending`: the explained claims of Pending pods (dra_gpu.fleet.pending), shown as given."""
    pods = {(p.namespace, p.name): p.phase for p in snapshot.pods}
    daemons: dict[str, list[PodRef]] = defaultdict(list)  # claim UID -> its MPS daemons' pods
    for p in snapshot.pods:
        if p.mps_daemon:
            daemons[claim_uid_of(p.mps_daemon)].append(PodRef(f"{p.namespace}/{p.name}", p.phase))
    by_claim = {uid: tuple(refs) for uid, refs in daemons.items()}
    by_device: dict[tuple[str, str], list[tuple[Claim, Allocation]]] = defaultdict(list)
    for claim in snapshot.claims:
        for alloc in claim.allocations:
            by_device[(alloc.pool, alloc.device)].append((claim, alloc))
    sets = {(cs.pool, cs.name): cs for cs in snapshot.counter_sets}
    # node -> GPU UUID -> its devices, in the order published
    cards: dict[str, dict[str, list[PublishedDevice]]] = defaultdict(lambda: defaultdict(list))
    for device in snapshot.devices:
        if node is None or device.node == node:
            cards[device.node][device.gpu_uuid].append(device)
    nodes = []
    for node_name in sorted(cards):
        gpus: list[tuple[GpuView, PublishedDevice]] = []
        for devices in cards[node_name].values():
            held = {
                d.name: _holders(by_device[(d.pool, d.name)], pods, by_claim)
                for d in devices
                if (d.pool, d.name) in by_device
            }
            gpu = _gpu_view(devices, held, sets)
            shown = _visible(gpu, namespace) if namespace is not None else gpu
            if shown is not None:
                gpus.append((shown, devices[0]))
        if not gpus:
            continue
        gpus.sort(key=lambda pair: _index_key(pair[0]))
        domains = _domains(gpus)
        nodes.append(NodeView(node_name, domains, Totals.of(g for g, _ in gpus)))
    every = [g for n in nodes for g in n.gpus]
    models: dict[str, list[GpuView]] = defaultdict(list)
    for gpu in every:
        models[gpu.product].append(gpu)
    filters = {k: v for k, v in (("node", node), ("namespace", namespace)) if v is not None}
    return FleetView(
        nodes=tuple(nodes),
        models=tuple((name, Totals.of(models[name])) for name in sorted(models)),
        totals=Totals.of(every),
        problems=snapshot.problems,
        filters=filters,
        pending=tuple(p for p in pending if namespace is None or p.namespace == namespace),
    )
