"""The cluster as `dra-gpu top` reads it, parsed once into typed records: the driver's published
devices (with their slice taints and the DeviceTaintRules that match them), dynamic-MIG counter
sets, the claims' allocations and reservations, and the pods that hold them.

Every object is decoded (bounds, then shape: dra_gpu.decoding) before a field of it is read; one
that does not decode is left out with a line in `problems`, so a malformed object costs its own
row, not the screen. Attributes and capacities are read the way the allocator reads them
(dra_gpu.controller.published_devices.Device): the driver's own may be published unqualified.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dra_gpu.controller.published_devices import Device
from dra_gpu.controller.schemas import METADATA, SHAPES, TOLERATION
from dra_gpu.decoding import ListOf, MapOf, Obj, Quantity, Str, decode
from dra_gpu.kubernetes_values import quantity_or_none

MEMORY_SLICE_PREFIX = "memory-slice-"  # dynamic MIG: one counter per memory slice (dra_gpu.dynamic_mig)

_TAINT = Obj({"key": Str(), "value": Str(), "effect": Str()})
_RESULT = Obj(
    {
        "request": Str(),
        "driver": Str(),
        "pool": Str(),
        "device": Str(),
        "shareID": Str(),
        "consumedCapacity": MapOf(Quantity()),
        "tolerations": ListOf(TOLERATION),
    },
    required=("driver", "pool", "device"),
)
_CLAIM = Obj(
    {
        "metadata": METADATA,
        "status": Obj(
            {
                "allocation": Obj({"devices": Obj({"results": ListOf(_RESULT)})}),
                "reservedFor": ListOf(Obj({"resource": Str(), "name": Str(), "uid": Str()})),
            }
        ),
    },
    required=("metadata",),
)
_POD = Obj(
    {"metadata": METADATA, "spec": Obj({"nodeName": Str()}), "status": Obj({"phase": Str()})},
    required=("metadata",),
)
_RULE = Obj(
    {
        "metadata": METADATA,
        "spec": Obj(
            {
                "deviceSelector": Obj({"driver": Str(), "pool": Str(), "device": Str()}),
                "taint": _TAINT,
            },
            required=("taint",),
        ),
    },
    required=("spec",),
)


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: str
    source: str  # "slice" or "DeviceTaintRule <name>"

    def text(self) -> str:
        value = f"={self.value}" if self.value else ""
        return f"{self.key}{value}:{self.effect}"


@dataclass(frozen=True)
class PublishedDevice:
    """One device of the driver's slices: a whole GPU, a MIG device made beforehand, or a
    dynamic-MIG placement (`counter_set` set: it is made when allocated)."""

    node: str
    pool: str
    name: str
    kind: str  # the `type` attribute: "gpu" or "mig"
    gpu_uuid: str  # the GPU's own UUID; a MIG device's parentUUID
    index: int | None  # the GPU's index (a MIG device's parentIndex)
    product: str
    nvlink_domain: str | None
    nvlink_domain_size: int
    memory: int | None  # bytes
    profile: str | None  # MIG only
    shareable: bool  # allowMultipleAllocations: memory shares
    counter_set: str | None  # dynamic MIG: the GPU's counter set
    memory_slices: frozenset[int]  # dynamic MIG: the memory slices the placement takes
    taints: tuple[Taint, ...]


@dataclass(frozen=True)
class CounterSet:
    """A dynamic-MIG GPU's counters: how many memory slices it has, and its memory."""

    pool: str
    name: str
    memory_slices: int
    memory: int | None


@dataclass(frozen=True)
class Allocation:
    driver: str
    pool: str
    device: str
    share_id: str | None
    memory: int | None  # consumedCapacity.memory of a share, bytes


@dataclass(frozen=True)
class Claim:
    namespace: str
    name: str
    allocations: tuple[Allocation, ...]
    pods: tuple[str, ...]  # names of the pods in status.reservedFor (the claim's namespace)


@dataclass(frozen=True)
class Pod:
    namespace: str
    name: str
    node: str
    phase: str


@dataclass(frozen=True)
class TaintRule:
    """A DeviceTaintRule: its taint on every device its selector matches (unset fields match all)."""

    name: str
    driver: str | None
    pool: str | None
    device: str | None
    taint: Taint

    def matches(self, driver: str, pool: str, device: str) -> bool:
        return all(
            want is None or want == have
            for want, have in ((self.driver, driver), (self.pool, pool), (self.device, device))
        )


@dataclass(frozen=True)
class Snapshot:
    driver: str
    devices: tuple[PublishedDevice, ...]
    counter_sets: tuple[CounterSet, ...]
    claims: tuple[Claim, ...]
    pods: tuple[Pod, ...]
    rules: tuple[TaintRule, ...]
    problems: tuple[str, ...] = ()  # objects left out, and why


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _label(kind: str, obj: Any) -> str:
    meta = _meta(obj) if isinstance(obj, dict) else {}
    ns = f"{meta['namespace']}/" if isinstance(meta.get("namespace"), str) else ""
    name = meta.get("name")
    return f"{kind} {ns}{name if isinstance(name, str) else '?'}"


def _decoded(kind: str, obj: Any, shape: Obj, problems: list[str]) -> bool:
    found = decode(obj, shape)
    if found:
        path, message = found[0]
        problems.append(f"{_label(kind, obj)}: {path}: {message}; left out")
    return not found


def _bytes(value: Any) -> int | None:
    amount = quantity_or_none(value)
    return int(amount) if amount is not None else None


def _taint(raw: Mapping[str, Any], source: str) -> Taint:
    return Taint(str(raw.get("key") or ""), str(raw.get("value") or ""), str(raw.get("effect") or ""), source)


def parse_rules(items: Iterable[Any], problems: list[str]) -> list[TaintRule]:
    rules = []
    for obj in items:
        if not _decoded("DeviceTaintRule", obj, _RULE, problems):
            continue
        spec = obj["spec"]
        sel = spec.get("deviceSelector") or {}
        name = str(_meta(obj).get("name") or "")
        rules.append(
            TaintRule(
                name,
                sel.get("driver") or None,
                sel.get("pool") or None,
                sel.get("device") or None,
                _taint(spec["taint"], f"DeviceTaintRule {name}"),
            )
        )
    return rules


def _device(
    driver: str, node: str, pool: str, raw: Mapping[str, Any], rules: list[TaintRule]
) -> PublishedDevice:
    dev = Device(driver, pool, str(raw["name"]), node, raw, (driver, pool))

    def attr(name: str) -> Any:
        found = dev.attribute(f"{driver}/{name}")
        return found[1] if found else None

    kind = str(attr("type") or "gpu")
    gpu_uuid = attr("parentUUID") if kind == "mig" else attr("uuid")
    index = attr("parentIndex") if kind == "mig" else attr("index")
    memory = dev.capacity("memory")
    consumes = raw.get("consumesCounters") or []
    counter_set = str(consumes[0].get("counterSet")) if consumes else None
    slices = frozenset(
        int(name[len(MEMORY_SLICE_PREFIX) :])
        for entry in consumes
        for name in entry.get("counters") or {}
        if name.startswith(MEMORY_SLICE_PREFIX) and name[len(MEMORY_SLICE_PREFIX) :].isdigit()
    )
    taints = [_taint(t, "slice") for t in dev.taints()]
    taints += [r.taint for r in rules if r.matches(driver, pool, dev.name)]
    domain = attr("nvlinkDomain")
    size = attr("nvlinkDomainSize")
    return PublishedDevice(
        node=node,
        pool=pool,
        name=dev.name,
        kind=kind,
        gpu_uuid=str(gpu_uuid or dev.name),  # without a UUID a device stands for a GPU of its own
        index=index if isinstance(index, int) else None,
        product=str(attr("productName") or "unknown"),
        nvlink_domain=str(domain) if isinstance(domain, str) else None,
        nvlink_domain_size=size if isinstance(size, int) else 1,
        memory=int(memory) if memory is not None else None,
        profile=str(attr("profile")) if kind == "mig" and attr("profile") else None,
        shareable=dev.multi,
        counter_set=counter_set,
        memory_slices=slices,
        taints=tuple(taints),
    )


def parse_slices(
    driver: str, items: Iterable[Any], rules: list[TaintRule], problems: list[str]
) -> tuple[list[PublishedDevice], list[CounterSet]]:
    """The devices and counter sets of `driver`'s slices (other drivers' slices are skipped)."""
    devices: list[PublishedDevice] = []
    sets: list[CounterSet] = []
    shape = SHAPES["ResourceSlice"]
    for obj in items:
        if not isinstance(obj, dict) or (obj.get("spec") or {}).get("driver") != driver:
            continue
        obj = {"kind": "ResourceSlice", **obj}  # list items carry no kind
        if not _decoded("ResourceSlice", obj, shape, problems):
            continue
        spec = obj["spec"]
        pool = str(spec["pool"]["name"])
        node = str(spec.get("nodeName") or pool)
        devices += [_device(driver, node, pool, d, rules) for d in spec.get("devices") or []]
        for cs in spec.get("sharedCounters") or []:
            counters = cs["counters"]
            slices = sum(1 for name in counters if name.startswith(MEMORY_SLICE_PREFIX))
            memory = _bytes((counters.get("memory") or {}).get("value"))
            sets.append(CounterSet(pool, str(cs["name"]), slices, memory))
    return devices, sets


def parse_claims(driver: str, items: Iterable[Any], problems: list[str]) -> list[Claim]:
    """The claims with at least one device of `driver` allocated; others hold none of its GPUs."""
    claims = []
    for obj in items:
        if not _decoded("ResourceClaim", obj, _CLAIM, problems):
            continue
        status = obj.get("status") or {}
        results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
        allocations = tuple(
            Allocation(
                str(r["driver"]),
                str(r["pool"]),
                str(r["device"]),
                r.get("shareID") or None,
                _bytes((r.get("consumedCapacity") or {}).get("memory")),
            )
            for r in results
            if r["driver"] == driver
        )
        if not allocations:
            continue
        pods = tuple(
            str(ref["name"])
            for ref in status.get("reservedFor") or []
            if ref.get("resource") == "pods" and ref.get("name")
        )
        meta = _meta(obj)
        claims.append(Claim(str(meta.get("namespace") or ""), str(meta.get("name") or ""), allocations, pods))
    return claims


def parse_pods(items: Iterable[Any], problems: list[str]) -> list[Pod]:
    pods = []
    for obj in items:
        if not _decoded("Pod", obj, _POD, problems):
            continue
        meta = _meta(obj)
        pods.append(
            Pod(
                str(meta.get("namespace") or ""),
                str(meta.get("name") or ""),
                str((obj.get("spec") or {}).get("nodeName") or ""),
                str((obj.get("status") or {}).get("phase") or ""),
            )
        )
    return pods


def parse_snapshot(
    driver: str,
    slices: Iterable[Any],
    claims: Iterable[Any],
    pods: Iterable[Any] = (),
    taint_rules: Iterable[Any] = (),
) -> Snapshot:
    """The typed snapshot of the API objects as listed (plain JSON dicts)."""
    problems: list[str] = []
    rules = parse_rules(taint_rules, problems)
    devices, sets = parse_slices(driver, slices, rules, problems)
    return Snapshot(
        driver=driver,
        devices=tuple(devices),
        counter_sets=tuple(sets),
        claims=tuple(parse_claims(driver, claims, problems)),
        pods=tuple(parse_pods(pods, problems)),
        rules=tuple(rules),
        problems=tuple(problems),
    )
