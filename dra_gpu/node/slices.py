"""The node's DeviceCatalog -> resource.k8s.io/v1 ResourceSlice objects (plain dicts, ready for
the API).

One pool per node, named after the node. Devices get stable DNS-label names derived from the PCI
address. The API's limits are enforced here, before anything is sent, with errors that name the
device and the field: the apiserver would reject the whole slice for one bad attribute.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Collection, Mapping
from typing import Any

from dra_gpu.kube.values import (
    DNS_LABEL,
    DNS_SUBDOMAIN,
    MAX_ATTRIBUTES_AND_CAPACITIES,
    RESOURCE_API_VERSION,
    SEMVER,
    format_quantity,
    qualified_name_problem,
)
from dra_gpu.model.attributes import (
    CAPACITIES,
    DRIVER_ATTRIBUTES,
    MAX_MEMORY_SLICES,
    STANDARD_ATTRIBUTES,
    STANDARD_DOMAIN,
    cuda_version,
    normalise_version,
)
from dra_gpu.model.inventory import DEFAULT_DRIVER_NAME, Gpu, Inventory, MigDevice, MigPlacement, MigProfile
from dra_gpu.node.catalog import SHARE_MEMORY_STEP, CatalogDevice, DeviceCatalog, DeviceKind
from dra_gpu.node.dynamic_mig import (
    FAILED_CONDITION,
    READY_CONDITION,
    consumes,
    counter_set,
    placement_consumption,
)

log = logging.getLogger(__name__)

MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_SLICE_ADVANCED = 64  # when any device has taints or consumes counters
MAX_COUNTER_SETS_PER_SLICE = 8
MAX_COUNTERS_PER_SET = 32
MAX_CONSUMES_ENTRIES = 2
MAX_STRING_VALUE = 64
MAX_VERSION_VALUE = 64
INT64 = (-(2**63), 2**63 - 1)
# Memory shares (consumable capacity): requests are rounded up to whole GiB (SHARE_MEMORY_STEP); a
# claim that asks for no memory gets all of it (a whole GPU), one that asks for no compute share
# gets no reserved share (its work is time-shared with the other shares').
COMPUTE_SHARE_TOTAL = 100
# A node's packing ranks: as many as a request's prioritized list (firstAvailable) may have entries.
PACKING_RANKS = 8


class SliceLimitError(ValueError):
    """A device or slice the apiserver would reject; the message names the device and field."""


def _attribute(name: str, value: str | int) -> dict[str, Any]:
    """The value object of one of the driver's declared attributes (KeyError: not declared)."""
    return {DRIVER_ATTRIBUTES[name]: value}


def _standard_attribute(name: str, value: str | int) -> dict[str, Any]:
    """The value object of a declared attribute of the standard domain (KeyError: not declared)."""
    return {STANDARD_ATTRIBUTES[name]: value}


def _capacity(name: str, value: str) -> dict[str, str]:
    """The value object of one of the declared capacities (KeyError: not declared)."""
    if name not in CAPACITIES:
        raise KeyError(name)
    return {"value": value}


def share_capacity(memory_bytes: int) -> dict[str, dict[str, Any]]:
    """`memory` and `computeShare` with the request policies of a GPU shared by memory."""
    step = SHARE_MEMORY_STEP
    top = memory_bytes // step * step  # the range's max must be min + n * step
    memory = {
        "value": format_quantity(memory_bytes),
        "requestPolicy": {
            "default": format_quantity(top),
            "validRange": {
                "min": format_quantity(step),
                "max": format_quantity(top),
                "step": format_quantity(step),
            },
        },
    }
    compute = {
        "value": str(COMPUTE_SHARE_TOTAL),
        "requestPolicy": {
            "default": "0",
            "validRange": {"min": "0", "max": str(COMPUTE_SHARE_TOTAL), "step": "1"},
        },
    }
    return {"memory": memory, "computeShare": compute}


def packing_rank(node_name: str) -> int:
    """The node's packing rank, 0..PACKING_RANKS-1: a stable hash of its name, so a cluster's
    nodes spread over the ranks with no coordination. The scheduler takes the first devices that
    fit on a node, but by default the node whose CPU and memory are least requested; a claim that
    lists the ranks lowest first in a prioritized list (`firstAvailable`: packingRank < 1, < 2, ...,
    then any GPU) is scored higher on a node where an earlier entry fits, so such claims fill the
    low ranks first and leave the other nodes' NVLink domains whole for the jobs that need them
    (docs/claims-and-examples.md, bench/RESULTS.md)."""
    digest = hashlib.sha256(node_name.encode()).digest()
    return int.from_bytes(digest[:8], "big") % PACKING_RANKS


class SliceBuilder:
    """Builds the devices and slices of one node for one driver, from the node's catalog."""

    def __init__(self, catalog: DeviceCatalog, driver: str = DEFAULT_DRIVER_NAME) -> None:
        if not DNS_SUBDOMAIN.match(driver) or len(driver) > 63:
            raise SliceLimitError(f"driver name {driver!r}: must be a DNS subdomain of <= 63 chars")
        self.catalog = catalog
        self.inv = catalog.inventory
        self.driver = driver
        self.node_versions = self._node_versions()
        self.packing_rank = packing_rank(self.inv.node_name)

    def _node_versions(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        if self.inv.driver_version:
            try:
                out["driverVersion"] = _attribute("driverVersion", normalise_version(self.inv.driver_version))
            except ValueError as exc:
                log.warning("driverVersion left out: %s", exc)
        if self.inv.cuda_driver_version:
            out["cudaDriverVersion"] = _attribute(
                "cudaDriverVersion", cuda_version(self.inv.cuda_driver_version)
            )
        return out

    def _identity(self, gpu: Gpu) -> dict[str, dict[str, Any]]:
        """Attributes a MIG device shares with its parent GPU."""
        attrs: dict[str, dict[str, Any]] = {"productName": _attribute("productName", gpu.product_name)}
        if gpu.brand:
            attrs["brand"] = _attribute("brand", gpu.brand)
        if gpu.architecture:
            attrs["architecture"] = _attribute("architecture", gpu.architecture)
        if gpu.cuda_compute_capability:
            major, minor = gpu.cuda_compute_capability
            attrs["cudaComputeCapability"] = _attribute("cudaComputeCapability", f"{major}.{minor}.0")
        # Copies: shared dicts would show up as YAML anchors in the printed objects.
        attrs.update({k: dict(v) for k, v in self.node_versions.items()})
        if gpu.numa_node is not None and gpu.numa_node >= 0:
            attrs["numaNode"] = _attribute("numaNode", gpu.numa_node)
            # Kubernetes' own name (KEP-5491), as NVIDIA's driver publishes it too.
            attrs[f"{STANDARD_DOMAIN}/numaNode"] = _standard_attribute("numaNode", gpu.numa_node)
        if gpu.addressing_mode:
            attrs["addressingMode"] = _attribute("addressingMode", gpu.addressing_mode)
        attrs[f"{STANDARD_DOMAIN}/pciBusID"] = _standard_attribute("pciBusID", gpu.pci_bus_id)
        if gpu.pcie_root:
            attrs[f"{STANDARD_DOMAIN}/pcieRoot"] = _standard_attribute("pcieRoot", gpu.pcie_root)
        return attrs

    def gpu_device(self, gpu: Gpu, shared: bool = False) -> dict[str, Any]:
        """A whole GPU; `shared`: allocatable to several claims by memory (memory shares)."""
        attrs: dict[str, dict[str, Any]] = {
            "type": _attribute("type", "gpu"),
            "uuid": _attribute("uuid", gpu.uuid),
            "index": _attribute("index", gpu.index),
            "minor": _attribute("minor", gpu.minor),
            **self._identity(gpu),
        }
        if gpu.nvlink_domain is not None:
            attrs["nvlinkDomain"] = _attribute("nvlinkDomain", gpu.nvlink_domain)
            attrs["nvlinkDomainSize"] = _attribute("nvlinkDomainSize", gpu.nvlink_domain_size or 1)
        attrs["packingRank"] = _attribute("packingRank", self.packing_rank)
        capacity: dict[str, dict[str, str]] = {}
        if gpu.memory_bytes is not None:
            capacity["memory"] = _capacity("memory", format_quantity(gpu.memory_bytes))
        if gpu.multiprocessors is not None:
            capacity["multiprocessors"] = _capacity("multiprocessors", str(gpu.multiprocessors))
        device: dict[str, Any] = {"name": gpu.device_name, "attributes": attrs, "capacity": capacity}
        if shared and gpu.memory_bytes is not None and gpu.memory_bytes >= SHARE_MEMORY_STEP:
            device["allowMultipleAllocations"] = True
            capacity.update(share_capacity(gpu.memory_bytes))
            # Unconstrained capacities default to all of it per allocation: it would stop sharing.
            capacity.pop("multiprocessors", None)
        return device

    def _mig_parts(
        self, gpu: Gpu, profile: str, uuid: str | None, memory: int, engines: dict[str, int | None]
    ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        """A MIG device's attributes and capacity, made (`uuid`) or a placement to make (None)."""
        attrs: dict[str, dict[str, Any]] = {"type": _attribute("type", "mig")}
        if uuid is not None:
            attrs["uuid"] = _attribute("uuid", uuid)
        attrs |= {
            "profile": _attribute("profile", profile),
            "parentUUID": _attribute("parentUUID", gpu.uuid),
            "parentIndex": _attribute("parentIndex", gpu.index),
            "parentMinor": _attribute("parentMinor", gpu.minor),
            **self._identity(gpu),
        }
        capacity = {"memory": _capacity("memory", format_quantity(memory))}
        for name, value in engines.items():
            if value is not None:
                capacity[name] = _capacity(name, str(value))
        return attrs, capacity

    @staticmethod
    def _engines(m: MigDevice | MigProfile) -> dict[str, int | None]:
        return {
            "multiprocessors": m.multiprocessors,
            "copyEngines": m.copy_engines,
            "decoders": m.decoders,
            "encoders": m.encoders,
            "jpegEngines": m.jpeg_engines,
            "ofaEngines": m.ofa_engines,
        }

    def mig_device(self, gpu: Gpu, mig: MigDevice) -> dict[str, Any]:
        attrs, capacity = self._mig_parts(gpu, mig.profile, mig.uuid, mig.memory_bytes, self._engines(mig))
        for i in range(mig.placement_start, mig.placement_start + mig.placement_size):
            if i < MAX_MEMORY_SLICES:
                capacity[f"memorySlice{i}"] = _capacity(f"memorySlice{i}", "1")
        return {"name": gpu.mig_device_name(mig), "attributes": attrs, "capacity": capacity}

    def placement_device(self, gpu: Gpu, placement: MigPlacement) -> dict[str, Any]:
        """A MIG device that does not exist yet: made at prepare, at this placement."""
        p = placement.profile
        attrs, capacity = self._mig_parts(gpu, p.name, None, p.memory_bytes, self._engines(p))
        return {
            "name": gpu.mig_name(p.name, placement.start),
            "attributes": attrs,
            "capacity": capacity,
            "consumesCounters": consumes(gpu, placement_consumption(gpu, placement)),
            # Made between allocation and binding: a failure goes back to the scheduler.
            "bindingConditions": [READY_CONDITION],
            "bindingFailureConditions": [FAILED_CONDITION],
        }

    def device(self, device: CatalogDevice) -> dict[str, Any]:
        """The published object of one of the catalog's devices."""
        if device.kind is DeviceKind.PLACEMENT:
            assert device.placement is not None
            return self.placement_device(device.gpu, device.placement)
        if device.kind is DeviceKind.MIG:
            assert device.mig is not None
            return self.mig_device(device.gpu, device.mig)
        return self.gpu_device(device.gpu, device.shared)

    def device_groups(self) -> list[list[dict[str, Any]]]:
        """Devices in the scheduler's first-fit order, grouped so a group starts a new slice:
        whole GPUs and pre-made MIG devices GPU by GPU, then the dynamic-MIG devices (every placement; not the
        whole GPU: in MIG mode it runs no CUDA work without an instance, see dra_gpu.node.dynamic_mig)."""
        groups = [[self.device(d) for d in group] for group in self.catalog.groups()]
        names: set[str] = set()
        for group in groups:
            for dev in group:
                validate_device(dev)
                if dev["name"] in names:
                    raise SliceLimitError(f"device {dev['name']}: name is not unique in the pool")
                names.add(dev["name"])
        return groups

    def devices(self) -> list[dict[str, Any]]:
        """Every device, in the scheduler's first-fit order."""
        return [d for group in self.device_groups() for d in group]

    def counter_sets(self) -> list[dict[str, Any]]:
        out = []
        for gpu in sorted(self.catalog.dynamic_gpus, key=lambda g: g.index):
            cs = counter_set(gpu)
            if len(cs["counters"]) > MAX_COUNTERS_PER_SET:  # type: ignore[arg-type]
                raise SliceLimitError(f"counter set {cs['name']}: more than {MAX_COUNTERS_PER_SET} counters")
            out.append(cs)
        return out

    def slice_name(self, i: int) -> str:
        name = f"{self.inv.node_name}-{self.driver}-{i}"
        if len(name) <= 253:
            return name
        digest = hashlib.sha256(name.encode()).hexdigest()[:10]
        return f"{name[:230].rstrip('.-')}-{digest}-{i}"

    def slices(
        self,
        generation: int = 1,
        taints: Mapping[str, list[dict[str, Any]]] | None = None,
        *,
        withdraw_tainted: bool = False,
        counters: bool = True,
        counters_beside_devices: bool = False,
    ) -> list[dict[str, Any]]:
        """The node's slices; `taints`: device name -> its taints (health), if any.

        `counters_beside_devices`: the layout of a 1.34 apiserver, which refuses a device whose
        counter set is in another slice and more than 32 counters a slice: each GPU's placements
        in a slice of their own with its counter set (1.35+ refuses a slice with both).

        For an apiserver that drops fields (a feature gate off): `withdraw_tainted`, a device with
        a NoSchedule or NoExecute taint is left out instead (taints dropped: the only way to keep
        new claims off it); `counters=False`, the devices that consume counters and the counter
        sets are left out (without its counters, a placement would be allocated beside one it
        overlaps: dynamic MIG is off rather than wrong)."""
        if not DNS_SUBDOMAIN.match(self.inv.node_name) or len(self.inv.node_name) > 253:
            raise SliceLimitError(
                f"node name {self.inv.node_name!r}: must be a lowercase DNS subdomain (the pool name)"
            )
        groups = self.device_groups()
        for dev in (d for g in groups for d in g):
            if taints and taints.get(dev["name"]):
                dev["taints"] = [dict(t) for t in taints[dev["name"]]]

        def kept(dev: dict[str, Any]) -> bool:
            if not counters and dev.get("consumesCounters"):
                return False
            return not (withdraw_tainted and any(t.get("effect") != "None" for t in dev.get("taints") or []))

        if not counters or withdraw_tainted:
            groups = [g for g in ([d for d in group if kept(d)] for group in groups) if g]
        devices = [d for g in groups for d in g]
        advanced = any(d.get("taints") or d.get("consumesCounters") for d in devices)
        per_slice = MAX_DEVICES_PER_SLICE_ADVANCED if advanced else MAX_DEVICES_PER_SLICE
        sets = self.counter_sets() if counters else []
        bodies: list[dict[str, Any]]
        if counters_beside_devices:
            plain = [g for g in ([d for d in g if not d.get("consumesCounters")] for g in groups) if g]
            bodies = [{"devices": chunk} for chunk in _pack(plain, per_slice) if chunk]
            by_set: dict[str, list[dict[str, Any]]] = {}  # a GPU's counter set -> its placements
            for dev in devices:
                if dev.get("consumesCounters"):
                    by_set.setdefault(dev["consumesCounters"][0]["counterSet"], []).append(dev)
            bodies += [
                {"sharedCounters": [cs], "devices": by_set[cs["name"]]} for cs in sets if cs["name"] in by_set
            ]
        else:
            # 1.35+: counter sets live in slices of their own, never beside devices.
            bodies = [
                {"sharedCounters": sets[i : i + MAX_COUNTER_SETS_PER_SLICE]}
                for i in range(0, len(sets), MAX_COUNTER_SETS_PER_SLICE)
            ]
            bodies += [{"devices": chunk} for chunk in _pack(groups, per_slice)]
        return [
            {
                "apiVersion": RESOURCE_API_VERSION,
                "kind": "ResourceSlice",
                "metadata": {"name": self.slice_name(i)},
                "spec": {
                    "driver": self.driver,
                    "nodeName": self.inv.node_name,
                    "pool": {
                        "name": self.inv.node_name,
                        "generation": generation,
                        "resourceSliceCount": len(bodies),
                    },
                    **body,
                },
            }
            for i, body in enumerate(bodies)
        ]


def _pack(groups: list[list[dict[str, Any]]], per_slice: int) -> list[list[dict[str, Any]]]:
    """Fill slices in order; a group that does not fit in the current slice starts the next one
    (one larger than a slice is split)."""
    chunks: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    for group in groups:
        if current and len(current) + len(group) > per_slice:
            chunks.append(current)
            current = []
        for dev in group:
            if len(current) == per_slice:
                chunks.append(current)
                current = []
            current.append(dev)
    if current or not chunks:
        chunks.append(current)
    return chunks


def build_slices(
    inventory: Inventory,
    driver: str = DEFAULT_DRIVER_NAME,
    generation: int = 1,
    taints: Mapping[str, list[dict[str, Any]]] | None = None,
    memory_shares: bool = False,
    mig_profiles: Collection[str] = (),
) -> list[dict[str, Any]]:
    """The slices of an inventory's catalog (see DeviceCatalog.build)."""
    catalog = DeviceCatalog.build(inventory, memory_shares, mig_profiles=mig_profiles)
    return SliceBuilder(catalog, driver).slices(generation, taints)


def validate_device(dev: dict[str, Any]) -> None:
    """Raise SliceLimitError when the apiserver would reject this device."""
    name = dev.get("name", "")
    if len(name) > 63 or not DNS_LABEL.match(name):
        raise SliceLimitError(f"device {name!r}: name must be a DNS label (<= 63 chars, [a-z0-9-])")
    attrs: dict[str, dict[str, Any]] = dev.get("attributes", {})
    capacity: dict[str, Any] = dev.get("capacity", {})
    total = len(attrs) + len(capacity)
    if total > MAX_ATTRIBUTES_AND_CAPACITIES:
        raise SliceLimitError(
            f"device {name}: {total} attributes + capacities, the limit is {MAX_ATTRIBUTES_AND_CAPACITIES}"
        )
    consumed = dev.get("consumesCounters") or []
    if len(consumed) > MAX_CONSUMES_ENTRIES:
        raise SliceLimitError(f"device {name}: consumesCounters has {len(consumed)} entries, the limit is 2")
    for i, entry in enumerate(consumed):
        if len(entry.get("counters") or {}) > MAX_COUNTERS_PER_SET:
            raise SliceLimitError(
                f"device {name}: consumesCounters[{i}]: more than {MAX_COUNTERS_PER_SET} counters"
            )
    for key in list(attrs) + list(capacity):
        problem = qualified_name_problem(key)
        if problem:
            raise SliceLimitError(f"device {name}: attribute {key!r}: {problem}")
    for key, value in attrs.items():
        where = f"device {name}: attributes[{key!r}]"
        if len(value) != 1:
            raise SliceLimitError(f"{where}: exactly one of int, bool, string, version is allowed")
        ((kind, v),) = value.items()
        if kind == "string":
            if not isinstance(v, str) or len(v.encode()) > MAX_STRING_VALUE:
                raise SliceLimitError(f"{where}: string must be <= {MAX_STRING_VALUE} bytes: {v!r}")
        elif kind == "version":
            if not isinstance(v, str) or len(v) > MAX_VERSION_VALUE or not SEMVER.match(v):
                raise SliceLimitError(f"{where}: {v!r} is not a valid semantic version")
        elif kind == "int":
            if isinstance(v, bool) or not isinstance(v, int) or not INT64[0] <= v <= INT64[1]:
                raise SliceLimitError(f"{where}: {v!r} is not an int64")
        elif kind == "bool":
            if not isinstance(v, bool):
                raise SliceLimitError(f"{where}: {v!r} is not a bool")
        else:
            raise SliceLimitError(f"{where}: unknown value type {kind!r}")
