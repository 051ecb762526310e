"""The cluster as `dra-gpu top` reads it, parsed once into typed records: the driver's published
devices (with their slice taints and the DeviceTaintRules that match them), dynamic-MIG counter
sets, the claims' allocations and reservations, the pods that hold them, and what `explain` needs
to say why a Pending pod's claim is not allocated (the claims waiting for an allocation, the
DeviceClasses, and the slices and allocated claims as the API served them).

Every object is decoded (bounds, then shape: dra_gpu.common.decoding) before a field of it is read; one
that does not decode is left out with a line in `problems`, so a malformed object costs its own
row, not the screen. Attributes and capacities are read the way the allocator reads them
(dra_gpu.controller.published_devices.Device): the driver's own may be published unqualified.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from dra_gpu.common.decoding import ANY, Bool, ListOf, MapOf, Obj, Str, decode
from dra_gpu.controller.published_devices import Device
from dra_gpu.controller.schemas import COUNTER, METADATA, TOLERATION
from dra_gpu.kube.values import Quantity, quantity_or_none
from dra_gpu.model.mps_daemon_pods import DAEMON_LABEL

MEMORY_SLICE_PREFIX = "memory-slice-"  # dynamic MIG: one counter per memory slice (dra_gpu.node.dynamic_mig)

_TAINT = Obj({"key": Str(), "value": Str(), "effect": Str()})
# The fields of a slice read here. Attribute and capacity values are read by Device, which takes
# a malformed one as absent; checking each one's type (the webhook's full shape) would be ~3x the
# cost of everything else on a large cluster (bench/top_render.py).
_SLICE = Obj(
    {
        "metadata": METADATA,
        "spec": Obj(
            {
                "driver": Str(),
                "nodeName": Str(),
                "pool": Obj({"name": Str()}, required=("name",)),
                "devices": ListOf(
                    Obj(
                        {
                            "name": Str(),
                            "attributes": MapOf(ANY),
                            "capacity": MapOf(ANY),
                            "taints": ListOf(_TAINT),
                            "allowMultipleAllocations": Bool(),
                            "consumesCounters": ListOf(
                                Obj({"counterSet": Str(), "counters": MapOf(ANY)}, required=("counterSet",))
                            ),
                        },
                        required=("name",),
                    )
                ),
                "sharedCounters": ListOf(
                    Obj({"name": Str(), "counters": MapOf(COUNTER)}, required=("name", "counters"))
                ),
            },
            required=("driver", "pool"),
        ),
    },
    required=("spec",),
)
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
    {
        "metadata": METADATA,
        "spec": Obj(
            {
                "nodeName": Str(),
                "resourceClaims": ListOf(
                    Obj({"name": Str(), "resourceClaimName": Str(), "resourceClaimTemplateName": Str()})
                ),
            }
        ),
        "status": Obj(
            {
                "phase": Str(),
                "resourceClaimStatuses": ListOf(Obj({"name": Str(), "resourceClaimName": Str()})),
            }
        ),
    },
    required=("metadata",),
)
_CLASS = Obj({"metadata": METADATA}, required=("metadata",))
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
    uid: str = ""
    obj: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # as served, for explain


@dataclass(frozen=True)
class WaitingClaim:
    """A claim with no allocation yet: what `explain` is asked about when a Pending pod uses it."""

    namespace: str
    name: str
    obj: dict[str, Any] = field(compare=False, repr=False)


@dataclass(frozen=True)
class Pod:
    namespace: str
    name: str
    node: str
    phase: str
    claims: tuple[str, ...] = ()  # the names of the ResourceClaims it uses (those made so far)
    mps_daemon: str = ""  # an MPS daemon's pod: the daemon's id (dra_gpu.model.mps_daemon_pods)

    @property
    def unscheduled(self) -> bool:
        return self.phase == "Pending" and not self.node


@dataclass(frozen=True)
class DeviceClassRecord:
    name: str
    obj: dict[str, Any] = field(compare=False, repr=False)


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
class SliceRecord:
    devices: tuple[PublishedDevice, ...]  # their own taints only; rules are applied by `assemble`
    counter_sets: tuple[CounterSet, ...]
    obj: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # as served, for explain


Record = SliceRecord | Claim | WaitingClaim | Pod | TaintRule | DeviceClassRecord
COLLECTIONS = ("slices", "claims", "pods", "rules", "classes")


@dataclass(frozen=True)
class Snapshot:
    driver: str
    devices: tuple[PublishedDevice, ...]
    counter_sets: tuple[CounterSet, ...]
    claims: tuple[Claim, ...]
    pods: tuple[Pod, ...]
    rules: tuple[TaintRule, ...]
    problems: tuple[str, ...] = ()  # objects left out, and why
    waiting: tuple[WaitingClaim, ...] = ()
    classes: tuple[DeviceClassRecord, ...] = ()
    slice_objects: tuple[dict[str, Any], ...] = field(default=(), compare=False, repr=False)


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _label(kind: str, obj: Any) -> str:
    meta = _meta(obj) if isinstance(obj, dict) else {}
    ns = f"{meta['namespace']}/" if isinstance(meta.get("namespace"), str) else ""
    name = meta.get("name")
    return f"{kind} {ns}{name if isinstance(name, str) else '?'}"


def _bytes(value: Any) -> int | None:
    amount = quantity_or_none(value)
    return int(amount) if amount is not None else None


def _taint(raw: Mapping[str, Any], source: str) -> Taint:
    return Taint(str(raw.get("key") or ""), str(raw.get("value") or ""), str(raw.get("effect") or ""), source)


def _rule(obj: dict[str, Any]) -> TaintRule:
    spec = obj["spec"]
    sel = spec.get("deviceSelector") or {}
    name = str(_meta(obj).get("name") or "")
    return TaintRule(
        name,
        sel.get("driver") or None,
        sel.get("pool") or None,
        sel.get("device") or None,
        _taint(spec["taint"], f"DeviceTaintRule {name}"),
    )


def _device(driver: str, node: str, pool: str, raw: Mapping[str, Any]) -> PublishedDevice:
    dev = Device(driver, pool, str(raw["name"]), node, raw, (driver, pool))

    def attr(name: str) -> Any:
        found = dev.attribute(f"{driver}/{name}")
        return found[1] if found else None

    kind = str(attr("type") or "gpu")
    gpu_uuid = attr("parentUUID") if kind == "mig" else attr("uuid")
    index = attr("parentIndex") if kind == "mig" else attr("index")
    memory = dev.capacity("memory")
    consumes = raw.get("consumesCounters") or []
    slices = frozenset(
        int(name[len(MEMORY_SLICE_PREFIX) :])
        for entry in consumes
        for name in entry.get("counters") or {}
        if name.startswith(MEMORY_SLICE_PREFIX) and name[len(MEMORY_SLICE_PREFIX) :].isdigit()
    )
    domain, size, profile = attr("nvlinkDomain"), attr("nvlinkDomainSize"), attr("profile")
    return PublishedDevice(
        node=node,
        pool=pool,
        name=dev.name,
        kind=kind,
        gpu_uuid=str(gpu_uuid or dev.name),  # without a UUID a device stands for a GPU of its own
        index=index if isinstance(index, int) and not isinstance(index, bool) else None,
        product=str(attr("productName") or "unknown"),
        nvlink_domain=domain if isinstance(domain, str) else None,
        nvlink_domain_size=size if isinstance(size, int) and not isinstance(size, bool) else 1,
        memory=int(memory) if memory is not None else None,
        profile=profile if kind == "mig" and isinstance(profile, str) else None,
        shareable=dev.multi,
        counter_set=str(consumes[0]["counterSet"]) if consumes else None,
        memory_slices=slices,
        taints=tuple(_taint(t, "slice") for t in dev.taints()),
    )


def _slice(driver: str, obj: dict[str, Any]) -> SliceRecord:
    spec = obj["spec"]
    pool = str(spec["pool"]["name"])
    node = str(spec.get("nodeName") or pool)
    sets = []
    for cs in spec.get("sharedCounters") or []:
        counters = cs["counters"]
        slices = sum(1 for name in counters if name.startswith(MEMORY_SLICE_PREFIX))
        sets.append(
            CounterSet(pool, str(cs["name"]), slices, _bytes((counters.get("memory") or {}).get("value")))
        )
    devices = tuple(_device(driver, node, pool, d) for d in spec.get("devices") or [])
    return SliceRecord(devices, tuple(sets), _typed(obj, "ResourceSlice"))


def _typed(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    """The object with the kind a list's items lack (explain reads objects by their kind)."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": kind, **obj}


def _claim(driver: str, obj: dict[str, Any]) -> Claim | WaitingClaim | None:
    """The claim, when at least one device of `driver` is allocated to it (others hold none of its
    GPUs); a claim with no allocation at all as waiting."""
    status = obj.get("status") or {}
    meta = _meta(obj)
    if not status.get("allocation"):
        return WaitingClaim(
            str(meta.get("namespace") or ""), str(meta.get("name") or ""), _typed(obj, "ResourceClaim")
        )
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
        return None
    pods = tuple(
        str(ref["name"])
        for ref in status.get("reservedFor") or []
        if ref.get("resource") == "pods" and ref.get("name")
    )
    return Claim(
        str(meta.get("namespace") or ""),
        str(meta.get("name") or ""),
        allocations,
        pods,
        str(meta.get("uid") or ""),
        _typed(obj, "ResourceClaim"),
    )


def _pod(obj: dict[str, Any]) -> Pod:
    meta = _meta(obj)
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    # A claim from a template is named in the pod's status once the controller has made it.
    made = {s.get("name"): s.get("resourceClaimName") for s in status.get("resourceClaimStatuses") or []}
    claims = tuple(
        str(name)
        for entry in spec.get("resourceClaims") or []
        if (name := entry.get("resourceClaimName") or made.get(entry.get("name")))
    )
    return Pod(
        str(meta.get("namespace") or ""),
        str(meta.get("name") or ""),
        str(spec.get("nodeName") or ""),
        str(status.get("phase") or ""),
        claims,
        str((meta.get("labels") or {}).get(DAEMON_LABEL) or ""),
    )


_KINDS = {
    "slices": "ResourceSlice",
    "claims": "ResourceClaim",
    "pods": "Pod",
    "rules": "DeviceTaintRule",
    "classes": "DeviceClass",
}
_SHAPES = {"slices": _SLICE, "claims": _CLAIM, "pods": _POD, "rules": _RULE, "classes": _CLASS}


def parse_object(collection: str, driver: str, obj: Any) -> tuple[Record | None, str | None]:
    """One listed or watched object of a collection (COLLECTIONS) as its record, or None when it
    has nothing of `driver` (another driver's slice, a claim of none of its devices); and the
    problem that left it out, if any."""
    if collection == "slices" and (
        not isinstance(obj, dict) or (obj.get("spec") or {}).get("driver") != driver
    ):
        return None, None
    found = decode(obj, _SHAPES[collection])
    if found:
        path, message = found[0]
        return None, f"{_label(_KINDS[collection], obj)}: {path}: {message}; left out"
    if collection == "slices":
        return _slice(driver, obj), None
    if collection == "claims":
        return _claim(driver, obj), None
    if collection == "pods":
        return _pod(obj), None
    if collection == "classes":
        return DeviceClassRecord(str(_meta(obj).get("name") or ""), _typed(obj, "DeviceClass")), None
    return _rule(obj), None


def assemble(driver: str, records: Iterable[Record], problems: Iterable[str] = ()) -> Snapshot:
    """The snapshot of parsed records: each DeviceTaintRule's taint added to the devices it matches."""
    slices: list[SliceRecord] = []
    claims: list[Claim] = []
    waiting: list[WaitingClaim] = []
    pods: list[Pod] = []
    rules: list[TaintRule] = []
    classes: list[DeviceClassRecord] = []
    for r in records:
        if isinstance(r, SliceRecord):
            slices.append(r)
        elif isinstance(r, Claim):
            claims.append(r)
        elif isinstance(r, WaitingClaim):
            waiting.append(r)
        elif isinstance(r, Pod):
            pods.append(r)
        elif isinstance(r, DeviceClassRecord):
            classes.append(r)
        else:
            rules.append(r)
    devices = []
    for s in slices:
        for d in s.devices:
            extra = tuple(r.taint for r in rules if r.matches(driver, d.pool, d.name))
            devices.append(replace(d, taints=d.taints + extra) if extra else d)
    return Snapshot(
        driver=driver,
        devices=tuple(devices),
        counter_sets=tuple(cs for s in slices for cs in s.counter_sets),
        claims=tuple(claims),
        pods=tuple(pods),
        rules=tuple(rules),
        problems=tuple(problems),
        waiting=tuple(waiting),
        classes=tuple(classes),
        slice_objects=tuple(s.obj for s in slices),
    )


def parse_snapshot(
    driver: str,
    slices: Iterable[Any],
    claims: Iterable[Any],
    pods: Iterable[Any] = (),
    taint_rules: Iterable[Any] = (),
    classes: Iterable[Any] = (),
) -> Snapshot:
    """The typed snapshot of the API objects as listed (plain JSON dicts)."""
    records: list[Record] = []
    problems: list[str] = []
    for collection, items in zip(COLLECTIONS, (slices, claims, pods, taint_rules, classes), strict=True):
        for obj in items:
            record, problem = parse_object(collection, driver, obj)
            if record is not None:
                records.append(record)
            if problem:
                problems.append(problem)
    return assemble(driver, records, problems)
