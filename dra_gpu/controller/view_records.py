"""What the webhook keeps of each watched object: only the fields its reviews read.

A ResourceClaim can be ~1.5 MiB (etcd's request limit: CEL selectors, opaque parameters,
annotations, managedFields), and a cluster can have tens of thousands; the reviews read nothing of
a claim but the devices its allocation holds (allocator_view.allocated_devices and
shared_consumption). So a claim is kept as an `AllocatedClaim` of a few interned strings per
result, whatever its size, and one without results is not kept at all. A slice or a class is kept
as its name and spec, the part the rules read (the spec is the published devices or the
selectors, bounded by the API's own limits); its labels, annotations and managedFields are not.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

STORES = ("slices", "classes", "claims")
# A deletion, or an object the watch could not decode (REJECTED: only its metadata comes), which
# must leave the view all the same.
GONE = ("DELETED", "REJECTED")


def key(obj: Mapping[str, Any]) -> str:
    """`namespace/name`, the identity of an object in its store (`/name` when cluster-scoped)."""
    if isinstance(obj, AllocatedClaim):
        return obj.key
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    return f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"


def identity(object_key: str) -> dict[str, Any]:
    """The metadata of `object_key` alone: what a deletion needs to name the object."""
    namespace, _, name = object_key.partition("/")
    return {"metadata": {"name": name, "namespace": namespace}}


class AllocatedDevice(NamedTuple):
    """One result of an allocation, with the fields the allocator's view reads."""

    driver: str
    pool: str
    device: str
    admin_access: bool
    share_id: str | None  # set: a share of a device that takes several allocations
    consumed: tuple[tuple[str, Any], ...]  # consumedCapacity of a share (quantities as written)

    def as_result(self) -> dict[str, Any]:
        result: dict[str, Any] = {"driver": self.driver, "pool": self.pool, "device": self.device}
        if self.admin_access:
            result["adminAccess"] = True
        if self.share_id is not None:
            result["shareID"] = self.share_id
            result["consumedCapacity"] = dict(self.consumed)
        return result


@dataclass(frozen=True, slots=True)
class AllocatedClaim(Mapping[str, Any]):
    """A claim reduced to its allocation's results, still read as a claim is
    (`["status"]["allocation"]["devices"]["results"]`, `["metadata"]`): the mappings are made on
    each read, so that only the tuples are held between reviews."""

    key: str
    devices: tuple[AllocatedDevice, ...]

    def __getitem__(self, name: str) -> Any:
        if name == "metadata":
            return identity(self.key)["metadata"]
        if name == "status":
            results = [d.as_result() for d in self.devices]
            return {"allocation": {"devices": {"results": results}}}
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(("metadata", "status"))

    def __len__(self) -> int:
        return 2


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _text(value: Any) -> str:
    """Interned: the same driver, pool and device names recur across claims and results."""
    return sys.intern(str(value))


def slim_claim(obj: Mapping[str, Any]) -> AllocatedClaim | None:
    """What reviews use of a claim; None when it holds no device (not allocated)."""
    if isinstance(obj, AllocatedClaim):
        return obj
    allocation = _mapping(_mapping(obj.get("status")).get("allocation"))
    results = _mapping(allocation.get("devices")).get("results")
    devices = []
    for r in results if isinstance(results, list) else []:
        if not isinstance(r, Mapping):
            continue
        share = r.get("shareID")
        consumed = _mapping(r.get("consumedCapacity")) if share else {}
        devices.append(
            AllocatedDevice(
                _text(r.get("driver")),
                _text(r.get("pool")),
                _text(r.get("device")),
                bool(r.get("adminAccess")),
                str(share) if share else None,
                tuple((_text(name), value) for name, value in consumed.items()),
            )
        )
    return AllocatedClaim(key(obj), tuple(devices)) if devices else None


def slim_named(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A slice or a class: its name (namespace, if any) and spec."""
    meta = _mapping(obj.get("metadata"))
    slim: dict[str, Any] = {"metadata": {k: meta[k] for k in ("name", "namespace") if k in meta}}
    if "spec" in obj:
        slim["spec"] = obj["spec"]
    return slim


def slim(store: str, obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """What `store` keeps of `obj`; None when reviews never use it."""
    return slim_claim(obj) if store == "claims" else slim_named(obj)
