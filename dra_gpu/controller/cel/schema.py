"""The attributes and capacities the selectors of one driver may use, and their protobuf types.

The schema starts from what dra-gpu declares (dra_gpu.model.attributes) and learns what the published
slices add. As protobuf messages (cel-expr-python takes custom types only as messages) it gives the
check environment a typed `device.attributes["<driver>"]`, so typos and type errors are caught.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, struct_pb2

from dra_gpu.model.attributes import CAPACITIES, DRIVER_ATTRIBUTES

PACKAGE = "k8sdra"
QUANTITY = f"{PACKAGE}.Quantity"
SEMVER = f"{PACKAGE}.Semver"
DEVICE = f"{PACKAGE}.Device"  # the typed `device` of the check environment
# Fields of DEVICE that stand for attributes["<driver>"] and capacity["<driver>"] once rewritten.
DRIVER_ATTRIBUTES_FIELD = "driver_attributes__"
DRIVER_CAPACITY_FIELD = "driver_capacity__"


@dataclass
class Schema:
    """Attribute names and value kinds of one driver domain, for the check env and suggestions."""

    driver: str
    attributes: dict[str, str] = field(default_factory=dict)  # name -> string|int|bool|version
    capacities: set[str] = field(default_factory=set)

    @classmethod
    def default(cls, driver: str) -> Schema:
        """The attributes and capacities dra-gpu declares (dra_gpu.model.attributes)."""
        return cls(driver, dict(DRIVER_ATTRIBUTES), set(CAPACITIES))

    def add_slices(self, slices: Iterable[Mapping[str, Any]]) -> None:
        """Learn the attributes the driver's published devices carry."""
        for s in slices:
            spec = s.get("spec") or {}
            if spec.get("driver") != self.driver:
                continue
            for dev in spec.get("devices") or []:
                for key, value in (dev.get("attributes") or {}).items():
                    domain, _, name = key.rpartition("/")
                    if domain in ("", self.driver) and isinstance(value, dict) and len(value) == 1:
                        kind = next(iter(value))
                        if kind in ("string", "int", "bool", "version"):
                            self.attributes.setdefault(name, kind)
                for key in dev.get("capacity") or {}:
                    domain, _, name = key.rpartition("/")
                    if domain in ("", self.driver):
                        self.capacities.add(name)

    def suggest(self, name: str, capacity: bool = False) -> str:
        names = sorted(self.capacities) if capacity else sorted(self.attributes)
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        if not close:
            lower = {n.lower(): n for n in names}
            close = [lower[name.lower()]] if name.lower() in lower else []
        return f"did you mean {close[0]!r}?" if close else f"known: {', '.join(names)}"


_F = descriptor_pb2.FieldDescriptorProto


def _message(fdp: descriptor_pb2.FileDescriptorProto, name: str, fields: Iterable[tuple[str, str]]) -> None:
    """Add message `name`; fields are (name, kind) with kind string|int|bool|version|quantity|struct."""
    m = fdp.message_type.add(name=name)
    for i, (fname, kind) in enumerate(fields, 1):
        f = m.field.add(name=fname, number=i, label=_F.LABEL_OPTIONAL)
        if kind == "string":
            f.type = _F.TYPE_STRING
        elif kind == "int":
            f.type = _F.TYPE_INT64
        elif kind == "bool":
            f.type = _F.TYPE_BOOL
        else:
            f.type = _F.TYPE_MESSAGE
            f.type_name = {
                "version": ".k8sdra.Semver",
                "quantity": ".k8sdra.Quantity",
                "struct": ".google.protobuf.Struct",
            }[kind]


def _map_field(fdp: descriptor_pb2.FileDescriptorProto, msg: str, name: str, number: int) -> None:
    """map<string, google.protobuf.Struct> field `name` on message `msg`."""
    m = next(x for x in fdp.message_type if x.name == msg)
    entry = m.nested_type.add(name=name[0].upper() + name[1:] + "Entry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, label=_F.LABEL_OPTIONAL, type=_F.TYPE_STRING)
    entry.field.add(
        name="value",
        number=2,
        label=_F.LABEL_OPTIONAL,
        type=_F.TYPE_MESSAGE,
        type_name=".google.protobuf.Struct",
    )
    m.field.add(
        name=name,
        number=number,
        label=_F.LABEL_REPEATED,
        type=_F.TYPE_MESSAGE,
        type_name=f".k8sdra.{msg}.{entry.name}",
    )


def descriptor_pool_for(schema: Schema) -> descriptor_pool.DescriptorPool:
    """The k8sdra messages: Quantity, Semver, and a Device typed after `schema`."""
    fdp = descriptor_pb2.FileDescriptorProto(
        name="k8sdra.proto",
        package=PACKAGE,
        syntax="proto3",
        dependency=["google/protobuf/struct.proto"],
    )
    _message(fdp, "Quantity", [("value", "string")])
    _message(fdp, "Semver", [("value", "string")])
    _message(fdp, "DriverAttributes", sorted(schema.attributes.items()))
    _message(fdp, "DriverCapacity", [(n, "quantity") for n in sorted(schema.capacities)])
    _message(fdp, "Device", [("driver", "string"), ("allowMultipleAllocations", "bool")])
    dev = next(x for x in fdp.message_type if x.name == "Device")
    dev.field.add(
        name=DRIVER_ATTRIBUTES_FIELD,
        number=3,
        label=_F.LABEL_OPTIONAL,
        type=_F.TYPE_MESSAGE,
        type_name=".k8sdra.DriverAttributes",
    )
    dev.field.add(
        name=DRIVER_CAPACITY_FIELD,
        number=4,
        label=_F.LABEL_OPTIONAL,
        type=_F.TYPE_MESSAGE,
        type_name=".k8sdra.DriverCapacity",
    )
    _map_field(fdp, "Device", "attributes", 5)
    _map_field(fdp, "Device", "capacity", 6)
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(struct_pb2.DESCRIPTOR.serialized_pb)
    pool.Add(fdp)
    return pool
