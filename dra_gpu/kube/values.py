"""Kubernetes' value vocabulary, written once: names (DNS labels and subdomains, C identifiers,
qualified names), resource quantities and semantic versions, as the apiserver checks them.

Shared by the slice builder (which must publish only what the apiserver accepts) and the controller
(which must judge objects the way the apiserver and the scheduler do).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from dra_gpu.common.decoding import Problems, Shape, type_name

RESOURCE_API_VERSION = "resource.k8s.io/v1"
MAX_ATTRIBUTES_AND_CAPACITIES = 32  # per device: ResourceSliceMaxAttributesAndCapacitiesPerDevice

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
QUALIFIED_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
# Semantic Versioning 2.0.0, as the apiserver checks it.
SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
# What CEL's semver(text, true) accepts: a leading "v", missing minor/patch.
_LOOSE_SEMVER = re.compile(r"^v?(\d+)(?:\.(\d+))?(?:\.(\d+))?(?:-([0-9A-Za-z.-]+))?(?:\+([0-9A-Za-z.-]+))?$")
_BINARY_SUFFIXES = (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10))


def qualified_name_problem(name: str) -> str | None:
    """None when `name` is a valid attribute/capacity name ([domain/]identifier), else why not."""
    domain, sep, ident = name.rpartition("/")
    if sep and (not domain or len(domain) > 63 or not DNS_SUBDOMAIN.match(domain)):
        return f"domain {domain!r} must be a DNS subdomain of <= 63 chars"
    if len(ident) > 32 or not C_IDENTIFIER.match(ident):
        return f"{ident!r} must be a C identifier of <= 32 chars"
    return None


# ---------------------------------------------------------------- quantities


# The quantity grammar of k8s.io/apimachinery (resource.Quantity): a signed decimal number and one of
# a binary suffix, a decimal suffix or a decimal exponent.
_QUANTITY = re.compile(
    r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:(Ki|Mi|Gi|Ti|Pi|Ei)|([eE][+-]?[0-9]+)|(n|u|m|k|M|G|T|P|E)?)$"
)
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
MAX_QUANTITY_CHARS = 128
# Kubernetes quantities never exceed 2^63-1 in magnitude nor go below 10^-9 (nano); an exponent
# beyond these bounds cannot be meant, and refusing it keeps the arithmetic on it O(1).
MAX_QUANTITY_EXPONENT = 64


@functools.lru_cache(maxsize=4096)
def parse_quantity(text: str) -> Decimal:
    """A Kubernetes quantity ("80Gi", "1.5", "500m", "100u", "1e3") as a number; ValueError when it is none.

    Bounded: at most 128 characters and a decimal exponent within +-64, so no input costs more than
    a constant amount of work (a huge exponent would make Decimal arithmetic take minutes); NaN and
    Infinity are not quantities.
    """
    if not isinstance(text, str):
        raise ValueError(f"{text!r} is not a quantity")
    if len(text) > MAX_QUANTITY_CHARS:
        raise ValueError(f"quantity of {len(text)} characters is too long (at most {MAX_QUANTITY_CHARS})")
    m = _QUANTITY.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a quantity")
    number, binary, exponent, decimal = m.groups()
    try:
        value = Decimal(number)
    except InvalidOperation as exc:  # pragma: no cover - the pattern admits only decimal numbers
        raise ValueError(f"{text!r} is not a quantity") from exc
    if binary:
        return value * (1 << _BINARY[binary])
    exp = int(exponent[1:]) if exponent else _DECIMAL[decimal or ""]
    if abs(exp) > MAX_QUANTITY_EXPONENT:
        raise ValueError(f"{text!r}: exponent out of range (at most +-{MAX_QUANTITY_EXPONENT})")
    return value * Decimal(10) ** exp


def quantity_or_none(value: Any) -> Decimal | None:
    """`value` (a string or a number) as a quantity; None when it is None or no quantity."""
    try:
        return parse_quantity(str(value)) if value is not None else None
    except ValueError:
        return None


def format_quantity(value: int | Decimal) -> str:
    """A number as a canonical, readable quantity: 85899345920 -> "80Gi", 85520809984 -> "81559Mi"."""
    if isinstance(value, Decimal) and value != value.to_integral_value():
        return str(value.normalize())
    n = int(value)
    for suffix, factor in _BINARY_SUFFIXES:
        if n >= factor and n % factor == 0:
            return f"{n // factor}{suffix}"
    return str(n)


# ---------------------------------------------------------------- semantic versions


@dataclass(frozen=True, order=False)
class SemverValue:
    major: int
    minor: int
    patch: int
    pre: tuple[str, ...] = ()

    def key(self) -> tuple[Any, ...]:
        # SemVer 2.0 precedence: a release sorts after its pre-releases; numeric ids before alphanumeric.
        pre_key = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in self.pre)
        return (self.major, self.minor, self.patch, 0 if self.pre else 1, pre_key)

    def compare(self, other: SemverValue) -> int:
        a, b = self.key(), other.key()
        return (a > b) - (a < b)


@functools.lru_cache(maxsize=4096)
def parse_semver(text: str, normalize: bool = False) -> SemverValue:
    """A semantic version; with `normalize`, also "v1", "1.2" (as CEL's semver(text, true))."""
    if normalize:
        m = _LOOSE_SEMVER.match(text)
        if not m:
            raise ValueError(f"{text!r} is not a semantic version")
        nums = [int(g) if g else 0 for g in m.group(1, 2, 3)]
        pre = tuple(m.group(4).split(".")) if m.group(4) else ()
        return SemverValue(nums[0], nums[1], nums[2], pre)
    m = SEMVER.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a semantic version")
    pre = tuple(m.group(4).split(".")) if m.group(4) else ()
    return SemverValue(int(m.group(1)), int(m.group(2)), int(m.group(3)), pre)


class Quantity(Shape):
    """A Kubernetes quantity: a string such as "80Gi" or a plain integer (YAML reads 80 as one)."""

    description = "a quantity such as 80Gi"

    def check(self, value: Any, path: str, problems: Problems) -> None:
        if isinstance(value, bool) or not isinstance(value, str | int):
            problems.append((path, f"must be {self.description}, got {type_name(value)}"))
            return
        try:
            parse_quantity(str(value))
        except ValueError as exc:
            problems.append((path, str(exc)))
