"""The judge: NVIDIA's published devices against dra-gpu's in NVIDIA-compatible mode, on the same
simulated node (same GPUs, same MIG layout), device by device and attribute by attribute.

Every attribute and capacity NVIDIA's plugin publishes, dra-gpu must publish under the same name
with the same type and value; what dra-gpu adds is fine. A difference that is known and has a
reason is an `Exception_` (docs/nvidia-side-by-side.md lists them all); anything else is
a finding and fails the test.

Devices are matched by what identifies them on both sides, not by name (the names differ by
design: NVIDIA's `gpu-<minor>`, dra-gpu's PCI-derived `gpu-0000-18-00-0`): a whole GPU or a MIG
device made beforehand by its `uuid`; a dynamic-MIG placement (no UUID before it is made) by
(parent UUID, profile, placement start), the start being the last part of both drivers' names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dra_gpu.kube.values import parse_quantity

NVIDIA_DRIVER = "gpu.nvidia.com"


@dataclass(frozen=True)
class Finding:
    device: str  # NVIDIA's device name
    key: str  # attribute or capacity name; "(device)" when the device itself is missing
    what: str  # "device", "attribute", "capacity"
    nvidia: Any
    ours: Any

    def __str__(self) -> str:
        return f"{self.device}: {self.what} {self.key}: NVIDIA {self.nvidia!r}, dra-gpu {self.ours!r}"


@dataclass(frozen=True)
class Exception_:
    """A known difference: `what` and `key` as in Finding ("*" matches any key), for devices whose
    `type` attribute is `device_type` (None: any), and why."""

    what: str
    key: str
    device_type: str | None
    reason: str

    def covers(self, f: Finding, device_type: str | None) -> bool:
        return (
            self.what == f.what
            and self.key in ("*", f.key)
            and (self.device_type is None or self.device_type == device_type)
        )


def devices(slices: Iterable[Mapping[str, Any]], driver: str = NVIDIA_DRIVER) -> list[dict[str, Any]]:
    return [d for s in slices if s["spec"]["driver"] == driver for d in s["spec"].get("devices") or []]


def _key(name: str) -> str:
    """An attribute's name with the driver's own domain dropped (unqualified = the driver's)."""
    return name.removeprefix(NVIDIA_DRIVER + "/")


def _attrs(dev: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    return {_key(k): next(iter(v.items())) for k, v in (dev.get("attributes") or {}).items()}


def identity(dev: Mapping[str, Any]) -> tuple[Any, ...]:
    attrs = _attrs(dev)
    if "uuid" in attrs:
        return ("uuid", attrs["uuid"][1])
    start = int(str(dev["name"]).rsplit("-", 1)[1])
    return ("placement", attrs["parentUUID"][1], attrs["profile"][1], start)


def judge(
    nvidia: Iterable[Mapping[str, Any]],
    ours: Iterable[Mapping[str, Any]],
    exceptions: Iterable[Exception_] = (),
) -> tuple[list[Finding], list[tuple[Finding, Exception_]], int]:
    """(findings no exception covers, findings an exception covers, values compared)."""
    mine = {identity(d): d for d in ours}
    known = list(exceptions)
    found: list[Finding] = []
    excused: list[tuple[Finding, Exception_]] = []
    compared = 0

    def report(f: Finding, device_type: str | None) -> None:
        cover = next((e for e in known if e.covers(f, device_type)), None)
        if cover is None:
            found.append(f)
        else:
            excused.append((f, cover))

    for theirs in nvidia:
        name = str(theirs["name"])
        their_attrs = _attrs(theirs)
        device_type = their_attrs.get("type", (None, None))[1]
        match = mine.get(identity(theirs))
        if match is None:
            report(Finding(name, "(device)", "device", identity(theirs), None), device_type)
            continue
        our_attrs = _attrs(match)
        for key, value in sorted(their_attrs.items()):
            compared += 1
            if our_attrs.get(key) != value:
                report(Finding(name, key, "attribute", value, our_attrs.get(key)), device_type)
        our_capacity = match.get("capacity") or {}
        for key, cap in sorted((theirs.get("capacity") or {}).items()):
            compared += 1
            mine_cap = our_capacity.get(key)
            if mine_cap is None or parse_quantity(str(mine_cap["value"])) != parse_quantity(
                str(cap["value"])
            ):
                report(
                    Finding(name, key, "capacity", cap["value"], (mine_cap or {}).get("value")), device_type
                )
    return found, excused, compared
