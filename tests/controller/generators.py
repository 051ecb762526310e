"""Hypothesis strategies that build *valid* resource.k8s.io/v1 objects for the published devices of
two simulated nodes, each claim with its own oracle, and mutations of them.

A generated claim comes with a `ClaimModel`: what each request asks for, with every selector as a
CEL expression *and* a Python predicate over a published device (written here from the slices'
JSON, not through the CEL environment or the allocator), so a property can check a placement
against the claim without trusting the code under test.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from hypothesis import strategies as st

from tests.mutation import paths, replace_at

from .objects import DRIVER, GPU_CLASS, node_slices

MIG_SELECTOR = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "mig"'
MIG_CLASS: dict[str, Any] = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": "mig.gpu.dra-gpu.io"},
    "spec": {"selectors": [{"cel": {"expression": MIG_SELECTOR}}]},
}
CLASSES = [GPU_CLASS, MIG_CLASS]
CLASS_TYPE = {"gpu.dra-gpu.io": "gpu", "mig.gpu.dra-gpu.io": "mig"}
SLICES = node_slices("node-a", "hgx-2x4") + node_slices("node-b", "dgx-a100-mig")
# (node, device name) -> the published device, as JSON
DEVICES: dict[tuple[str, str], dict[str, Any]] = {
    (s["spec"]["nodeName"], d["name"]): d for s in SLICES for d in s["spec"]["devices"]
}
BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def value(device: dict[str, Any], name: str) -> Any:
    """An attribute's value (of whichever type), None when the device does not have it."""
    typed = device["attributes"].get(name)
    return None if typed is None else next(iter(typed.values()))


def memory_bytes(device: dict[str, Any]) -> int:
    """The device's memory capacity in bytes, from the published quantity ("80Gi", "40192Mi")."""
    text = device["capacity"]["memory"]["value"]
    for suffix, factor in BINARY.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * factor
    return int(text)


def of_type(kind: str) -> list[dict[str, Any]]:
    return [d for d in DEVICES.values() if value(d, "type") == kind]


@dataclass(frozen=True)
class Selector:
    cel: str
    holds: Callable[[dict[str, Any]], bool]  # the oracle: does the published device match


def _attr(name: str) -> str:
    return f'device.attributes["{DRIVER}"].{name}'


def _equal(name: str, v: Any) -> Selector:
    literal = f'"{v}"' if isinstance(v, str) else str(v)
    return Selector(f"{_attr(name)} == {literal}", lambda d: value(d, name) == v)


def _at_most(name: str, v: int) -> Selector:
    return Selector(f"{_attr(name)} <= {v}", lambda d: value(d, name) is not None and value(d, name) <= v)


def _memory_at_least(q: str) -> Selector:
    want = int(q[:-2]) * BINARY[q[-2:]]
    return Selector(
        f'device.capacity["{DRIVER}"].memory.compareTo(quantity("{q}")) >= 0',
        lambda d: memory_bytes(d) >= want,
    )


def _selectors(kind: str) -> list[Selector]:
    """Selectors on attributes every device of `kind` has, with the values the devices publish
    (so that most match some device) and a few that match none."""
    devices = of_type(kind)
    out = [_memory_at_least(q) for q in ("10Gi", "40Gi", "80Gi", "100Gi")]
    for name in ("numaNode", "productName", "architecture"):
        out += [_equal(name, v) for v in sorted({value(d, name) for d in devices}, key=str)]
    out.append(_equal("productName", "NVIDIA B200"))
    if kind == "gpu":
        out += [_equal("index", i) for i in range(0, 9, 3)] + [_at_most("index", i) for i in (1, 3, 5)]
    else:
        out += [_equal("profile", v) for v in sorted({value(d, "profile") for d in devices})]
        out += [_equal("parentIndex", i) for i in (0, 1, 2)]
    return out


SELECTORS = {kind: _selectors(kind) for kind in ("gpu", "mig")}
# Attributes a constraint may name, by the device types of the requests it covers.
CONSTRAINT_ATTRIBUTES = {
    "gpu": ("nvlinkDomain", "numaNode", "productName"),
    "mig": ("parentIndex", "numaNode"),
}


@dataclass
class Sub:
    """One way to satisfy a request: `exactly`, or one of its `firstAvailable` subrequests."""

    name: str
    device_class: str
    count: int | None  # None: allocationMode All
    selectors: list[Selector]

    def json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"deviceClassName": self.device_class}
        if self.count is None:
            out["allocationMode"] = "All"
        else:
            out["count"] = self.count
        if self.selectors:
            out["selectors"] = [{"cel": {"expression": s.cel}} for s in self.selectors]
        return out

    def matches(self, device: dict[str, Any]) -> bool:
        return value(device, "type") == CLASS_TYPE[self.device_class] and all(
            s.holds(device) for s in self.selectors
        )


@dataclass
class Request:
    name: str
    subs: list[Sub]  # one: `exactly`; more: `firstAvailable`
    first_available: bool


@dataclass
class Constraint:
    match: bool  # matchAttribute, else distinctAttribute
    attribute: str
    requests: list[str]  # empty: all requests


@dataclass
class ClaimModel:
    requests: list[Request]
    constraints: list[Constraint] = field(default_factory=list)

    def json(self, name: str = "fuzzed") -> dict[str, Any]:
        reqs = []
        for r in self.requests:
            if r.first_available:
                reqs.append(
                    {"name": r.name, "firstAvailable": [{"name": s.name, **s.json()} for s in r.subs]}
                )
            else:
                reqs.append({"name": r.name, "exactly": r.subs[0].json()})
        devices: dict[str, Any] = {"requests": reqs}
        if self.constraints:
            devices["constraints"] = [
                {
                    ("matchAttribute" if c.match else "distinctAttribute"): f"{DRIVER}/{c.attribute}",
                    **({"requests": c.requests} if c.requests else {}),
                }
                for c in self.constraints
            ]
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": devices},
        }


@st.composite
def subs(draw: st.DrawFn, name: str) -> Sub:
    device_class = draw(st.sampled_from(list(CLASS_TYPE)))
    count = (
        draw(st.one_of(st.integers(1, 3), st.none()))
        if draw(st.integers(0, 9)) == 0
        else draw(st.integers(1, 3))
    )
    selectors = draw(
        st.lists(st.sampled_from(SELECTORS[CLASS_TYPE[device_class]]), max_size=2, unique_by=lambda s: s.cel)
    )
    return Sub(name, device_class, count, selectors)


@st.composite
def claim_models(draw: st.DrawFn) -> ClaimModel:
    """A valid claim: 1-3 requests (a tenth of them `firstAvailable` with 2 subrequests), counts
    1-3 or All, 0-2 selectors each, and 0-2 match/distinct constraints over some of the requests."""
    requests = []
    for i in range(draw(st.integers(1, 3))):
        if draw(st.integers(0, 9)) == 0:
            requests.append(Request(f"r{i}", [draw(subs("a")), draw(subs("b"))], True))
        else:
            requests.append(Request(f"r{i}", [draw(subs(""))], False))
    constraints = []
    for _ in range(draw(st.integers(0, 2))):
        covered = draw(
            st.lists(st.sampled_from([r.name for r in requests]), unique=True, max_size=len(requests))
        )
        kinds = {
            CLASS_TYPE[s.device_class] for r in requests if not covered or r.name in covered for s in r.subs
        }
        names = sorted(set.intersection(*(set(CONSTRAINT_ATTRIBUTES[k]) for k in kinds)))
        constraints.append(Constraint(draw(st.integers(0, 3)) > 0, draw(st.sampled_from(names)), covered))
    return ClaimModel(requests, constraints)


def placement_problems(model: ClaimModel, node: str, results: list[tuple[str, str]]) -> list[str]:
    """Why a placement (request name as in the results, device name) on `node` does not satisfy
    the claim: each request gets its count (or every matching device with All) of devices that
    match its class and selectors, from one subrequest; no device twice; every constraint holds."""
    problems: list[str] = []
    names = [d for _, d in results]
    if len(names) != len(set(names)):
        problems.append(f"a device given twice: {names}")
    placed: dict[str, list[dict[str, Any]]] = {}
    for request, device in results:
        found = DEVICES.get((node, device))
        if found is None:
            problems.append(f"{device} is not published on {node}")
            continue
        placed.setdefault(request.split("/")[0], []).append(found)
    for r in model.requests:
        got = [req for req, _ in results if req.split("/")[0] == r.name]
        used = {req.partition("/")[2] for req in got}
        if len(used) != 1:
            problems.append(f"request {r.name}: results {got} (one subrequest expected)")
            continue
        (sub_name,) = used
        subs = [s for s in r.subs if s.name == sub_name]
        if len(subs) != 1:
            problems.append(f"request {r.name}: no subrequest {sub_name!r}")
            continue
        sub, devices = subs[0], placed.get(r.name, [])
        for d in devices:
            if not sub.matches(d):
                problems.append(f"request {r.name}: {d['name']} does not match its class and selectors")
        want = (
            sum(1 for (n, _), d in DEVICES.items() if n == node and sub.matches(d))
            if sub.count is None
            else sub.count
        )
        if len(devices) != want:
            problems.append(f"request {r.name}: {len(devices)} devices, wanted {want}")
    for c in model.constraints:
        covered = [d for r, ds in placed.items() if not c.requests or r in c.requests for d in ds]
        values = [value(d, c.attribute) for d in covered]
        if any(v is None for v in values):
            problems.append(f"constraint on {c.attribute}: a device without it")
        elif c.match and len(set(values)) > 1:
            problems.append(f"matchAttribute {c.attribute}: values {values}")
        elif not c.match and len(set(values)) != len(values):
            problems.append(f"distinctAttribute {c.attribute}: values {values}")
    return problems


# -- mutation --------------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(["1e999999999", "NaN", "Infinity", "80Gi", "-1", "gpu.dra-gpu.io", "ExactCount", "All"])
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@st.composite
def like(draw: st.DrawFn, old: Any) -> Any:
    """A value of the same type as `old`, near it: most mutations keep the shape and change the meaning."""
    if isinstance(old, bool):
        return not old
    if isinstance(old, int):
        return draw(st.sampled_from([old - 1, old + 1, 0, -1, old * 1000, 2**31]))
    if isinstance(old, str):
        return draw(
            st.sampled_from(
                [old + "x", old.upper(), "", old[: len(old) // 2], "gpu.dra-gpu.io", "All", "r0", "a/b", "ü"]
            )
        )
    if isinstance(old, list) and old:
        return draw(st.sampled_from([[], old * 2, old[:-1], [*old, old[0]]]))
    if isinstance(old, dict) and old:
        key = draw(st.sampled_from(sorted(old)))
        return draw(
            st.sampled_from([{}, {k: v for k, v in old.items() if k != key}, {**old, key + "x": old[key]}])
        )
    return draw(json_values)


@st.composite
def mutated(draw: st.DrawFn, valid: Any, rate: int = 3) -> tuple[Any, int]:
    """(object, number of mutations): `valid` itself in about `rate - 1` of `rate` cases, else with
    one to three values replaced, mostly by one of the same type (`like`), sometimes by any JSON."""
    if draw(st.integers(0, rate - 1)) != 0:
        return valid, 0
    obj = copy.deepcopy(valid)
    n = draw(st.integers(1, 3))
    for _ in range(n):
        where = draw(st.sampled_from(paths(obj)))
        old = obj
        for key in where:
            old = old[key]
        new = draw(like(old)) if draw(st.integers(0, 3)) else draw(json_values)
        obj = replace_at(obj, where, new)
    return obj, n


# -- other kinds -----------------------------------------------------------------------------------


@st.composite
def templates(draw: st.DrawFn) -> dict[str, Any]:
    claim = draw(claim_models()).json()
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "t", "namespace": "default"},
        "spec": {"spec": claim["spec"]},
    }


@st.composite
def device_classes(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["gpu", "mig"]))
    extra = draw(st.lists(st.sampled_from(SELECTORS[kind]), max_size=2))
    base = GPU_CLASS if kind == "gpu" else MIG_CLASS
    cls = copy.deepcopy(base)
    cls["metadata"]["name"] = draw(st.sampled_from(["a.example.com", "gpus", "fast-gpus"]))
    cls["spec"]["selectors"] += [{"cel": {"expression": s.cel}} for s in extra]
    return cls


@st.composite
def resource_slices(draw: st.DrawFn) -> dict[str, Any]:
    s = copy.deepcopy(draw(st.sampled_from(SLICES)))
    s["spec"]["devices"] = draw(
        st.lists(st.sampled_from(s["spec"]["devices"]), min_size=1, max_size=4, unique_by=lambda d: d["name"])
    )
    return s


def validated_objects() -> st.SearchStrategy[dict[str, Any]]:
    """A valid object of a kind the admission rules validate."""
    return st.one_of(claim_models().map(lambda m: m.json()), templates(), device_classes())


def objects() -> st.SearchStrategy[dict[str, Any]]:
    """A valid object of any kind the controller reads."""
    return st.one_of(validated_objects(), resource_slices())


def quantity_texts() -> st.SearchStrategy[tuple[str, Decimal]]:
    """(text, value) of a Kubernetes quantity, the value computed here from its parts."""
    suffixes = {"": 1, "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    suffixes.update({k: v for k, v in BINARY.items()})

    @st.composite
    def build(draw: st.DrawFn) -> tuple[str, Decimal]:
        sign = draw(st.sampled_from(["", "+", "-"]))
        whole = draw(st.integers(0, 10**6))
        frac = draw(st.one_of(st.just(""), st.integers(0, 999).map(lambda f: f"{f:03d}")))
        number = Decimal(f"{whole}.{frac}" if frac else str(whole))
        if draw(st.booleans()):
            suffix = draw(st.sampled_from(sorted(suffixes)))
            mult: Decimal = Decimal(suffixes[suffix])
        else:
            exp = draw(st.integers(-20, 20))
            suffix, mult = f"e{exp}", Decimal(10) ** exp
        text = f"{sign}{whole}{'.' + frac if frac else ''}{suffix}"
        return text, (-1 if sign == "-" else 1) * number * mult

    return build()


PRODUCTS = [
    ("NVIDIA H100 80GB HBM3", "hopper", "9.0", 81559),
    ("NVIDIA A100-SXM4-80GB", "ampere", "8.0", 81920),
    ("NVIDIA L4", "ada", "8.9", 23034),
]


@st.composite
def profiles(draw: st.DrawFn) -> dict[str, Any]:
    """A valid node profile: 1-8 GPUs of one product, unique UUIDs and bus IDs, NVLinks between
    some pairs, NUMA nodes."""
    product, arch, cc, mib = draw(st.sampled_from(PRODUCTS))
    n = draw(st.integers(1, 8))
    gpus = []
    for i in range(n):
        gpu: dict[str, Any] = {
            "index": i,
            "uuid": f"GPU-{i:08x}-0000-4000-8000-{draw(st.integers(0, 2**32)):012x}",
            "pciBusId": f"00000000:{0x10 + i:02X}:00.0",
            "numaNode": draw(st.integers(0, 1)),
        }
        gpus.append(gpu)
    pairs = list(itertools.combinations(range(n), 2))
    for a, b in draw(st.lists(st.sampled_from(pairs), unique=True, max_size=4)) if pairs else []:
        links = draw(st.integers(1, 4))
        gpus[a].setdefault("nvlinks", []).append({"remote": gpus[b]["pciBusId"], "links": links})
        gpus[b].setdefault("nvlinks", []).append({"remote": gpus[a]["pciBusId"], "links": links})
    return {
        "name": "fuzzed",
        "driverVersion": draw(st.sampled_from(["570.133.20", "550.54.15", "575.51"])),
        "cudaDriverVersion": draw(st.sampled_from([12080, 12040, 12090])),
        "defaults": {
            "name": product,
            "brand": "nvidia",
            "architecture": arch,
            "computeCapability": cc,
            "memoryMiB": mib,
            "nvlinkCount": 18,
        },
        "gpus": gpus,
    }
