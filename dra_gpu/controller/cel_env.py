"""A CEL environment modelled on the Kubernetes DRA one, on cel-expr-python (cel-cpp).

Two environments share one set of function implementations:

* the **eval env** mirrors Kubernetes: `device` is `map(string, dyn)` holding `driver`,
  `attributes[domain][name]` and `capacity[domain][name]`; version attributes and capacities are
  `k8sdra.Semver` / `k8sdra.Quantity` protobuf messages, made at runtime (cel-expr-python only accepts
  protobuf messages as custom values).
* the **check env** is stricter than the apiserver: the driver's own domain is a typed message with one
  field per published attribute, so `device.attributes["<driver>"].prodName`, `productName == 1` or
  `capacity[...].memory.compareTo(40)` are compile-time errors. The expression is rewritten so that a
  literal `device.attributes["<driver>"]` becomes a field of the typed device; anything else (other
  domains, computed keys) stays dynamic.

The Kubernetes quantity and semver libraries are not part of cel-cpp; they are implemented here
(`quantity()`, `isQuantity()`, `semver()`, `isSemver()`, `compareTo`, `isGreaterThan`, `isLessThan`,
`sign`, `asInteger`, `asApproximateFloat`, `isInteger`, `add`, `sub`, `major`, `minor`, `patch`).
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from cel_expr_python import cel
from cel_expr_python.ext import ext_bindings, ext_optional
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, struct_pb2
from kubernetes.utils.quantity import parse_quantity

STANDARD_DOMAIN = "resource.kubernetes.io"
MAX_EXPRESSION_LENGTH = 10 * 1024  # CELSelectorExpressionMaxLength
MAX_ESTIMATED_COST = 1_000_000  # CELSelectorExpressionMaxCost
MAX_MAP_SIZE = 32  # ResourceSliceMaxAttributesAndCapacitiesPerDevice: the size cel-go assumes

# Attributes the driver publishes (see DESIGN.md, "Contracts"); published slices may add more.
KNOWN_ATTRIBUTES: dict[str, str] = {
    "type": "string",
    "uuid": "string",
    "productName": "string",
    "brand": "string",
    "architecture": "string",
    "index": "int",
    "minor": "int",
    "cudaComputeCapability": "version",
    "driverVersion": "version",
    "cudaDriverVersion": "version",
    "numaNode": "int",
    "nvlinkDomain": "string",
    "nvlinkDomainSize": "int",
    "profile": "string",
    "parentUUID": "string",
    "parentIndex": "int",
    "parentMinor": "int",
}
KNOWN_CAPACITIES = (
    "memory",
    "multiprocessors",
    "copyEngines",
    "decoders",
    "encoders",
    "jpegEngines",
    "ofaEngines",
)
KNOWN_STANDARD_ATTRIBUTES = {"pciBusID": "string", "pcieRoot": "string"}

_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
_LOOSE_SEMVER = re.compile(r"^v?(\d+)(?:\.(\d+))?(?:\.(\d+))?(?:-([0-9A-Za-z.-]+))?(?:\+([0-9A-Za-z.-]+))?$")
_DOMAIN_REF = re.compile(r"device\s*\.\s*(?:attributes|capacity)\s*\[\s*([\"'])([^\"']+)\1\s*\]")
_ERROR_LINE = re.compile(r"ERROR: <input>:(\d+):(\d+): ([^\n]*)")


class CelError(ValueError):
    """An expression that does not compile, type-check or fit the limits."""


# ---------------------------------------------------------------- quantity and semver values


@functools.lru_cache(maxsize=4096)
def parse_quantity_str(text: str) -> Decimal:
    try:
        value = parse_quantity(text)  # type: ignore[no-untyped-call]
    except (ValueError, InvalidOperation) as exc:
        raise ValueError(f"{text!r} is not a quantity") from exc
    return Decimal(value)


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
    if normalize:
        m = _LOOSE_SEMVER.match(text)
        if not m:
            raise ValueError(f"{text!r} is not a semantic version")
        nums = [int(g) if g else 0 for g in m.group(1, 2, 3)]
        pre = tuple(m.group(4).split(".")) if m.group(4) else ()
        return SemverValue(nums[0], nums[1], nums[2], pre)
    m = _SEMVER.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a semantic version")
    pre = tuple(m.group(4).split(".")) if m.group(4) else ()
    return SemverValue(int(m.group(1)), int(m.group(2)), int(m.group(3)), pre)


def format_quantity(value: Decimal) -> str:
    """Bytes as a readable quantity: 85899345920 -> "80Gi", 85520809984 -> "81559Mi"."""
    if value == value.to_integral_value():
        n = int(value)
        for suffix, factor in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
            if n >= factor and n % factor == 0:
                return f"{n // factor}{suffix}"
        return str(n)
    return str(value.normalize())


# ---------------------------------------------------------------- protobuf types

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


@dataclass
class Schema:
    """Attribute names and value kinds of one driver domain, for the check env and suggestions."""

    driver: str
    attributes: dict[str, str] = field(default_factory=dict)  # name -> string|int|bool|version
    capacities: set[str] = field(default_factory=set)

    @classmethod
    def default(cls, driver: str) -> Schema:
        return cls(driver, dict(KNOWN_ATTRIBUTES), set(KNOWN_CAPACITIES))

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


# ---------------------------------------------------------------- environments


@dataclass(frozen=True)
class Selector:
    """A compiled selector for evaluation."""

    expression: str
    program: Any  # cel.Expression
    domains: tuple[str, ...]  # literal attribute/capacity domains it indexes


class SelectorEvalError(RuntimeError):
    """A selector failed at runtime for a device (the scheduler aborts the allocation then)."""


class CelEnvironment:
    """Compiles, checks and evaluates DRA device selectors for one driver."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.driver = schema.driver
        fdp = descriptor_pb2.FileDescriptorProto(
            name="k8sdra.proto",
            package="k8sdra",
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
            name="driver_attributes__",
            number=3,
            label=_F.LABEL_OPTIONAL,
            type=_F.TYPE_MESSAGE,
            type_name=".k8sdra.DriverAttributes",
        )
        dev.field.add(
            name="driver_capacity__",
            number=4,
            label=_F.LABEL_OPTIONAL,
            type=_F.TYPE_MESSAGE,
            type_name=".k8sdra.DriverCapacity",
        )
        _map_field(fdp, "Device", "attributes", 5)
        _map_field(fdp, "Device", "capacity", 6)
        self.pool = descriptor_pool.DescriptorPool()
        self.pool.AddSerializedFile(struct_pb2.DESCRIPTOR.serialized_pb)
        self.pool.Add(fdp)
        self.Quantity: Any = message_factory.GetMessageClass(
            self.pool.FindMessageTypeByName("k8sdra.Quantity")
        )
        self.Semver: Any = message_factory.GetMessageClass(self.pool.FindMessageTypeByName("k8sdra.Semver"))
        self._eval_env = self._new_env(typed=False)
        self._check_env = self._new_env(typed=True)
        self._rewrite = re.compile(
            r"device\s*\.\s*(attributes|capacity)\s*\[\s*(\"|')" + re.escape(self.driver) + r"\2\s*\]"
            # Only where a field is read: a comprehension or `in` over the map stays dynamic.
            r"(?:\s*\[\s*(\"|')([A-Za-z_][A-Za-z0-9_]*)\3\s*\]|(?=\s*\.\s*\??\s*[A-Za-z_]\w*\b(?!\s*\()))"
        )
        self._compiled: dict[str, Selector] = {}

    # -- function implementations (one dispatcher per name: cel-cpp dispatches by kind only)

    def _q(self, v: Any) -> Decimal:
        return parse_quantity_str(v.value)

    def _s(self, v: Any) -> SemverValue:
        return parse_semver(v.value, True)

    def _is_q(self, v: Any) -> bool:
        return isinstance(v, self.Quantity)

    def _compare(self, a: Any, b: Any) -> int:
        if self._is_q(a) and self._is_q(b):
            x, y = self._q(a), self._q(b)
            return (x > y) - (x < y)
        if isinstance(a, self.Semver) and isinstance(b, self.Semver):
            return self._s(a).compare(self._s(b))
        raise TypeError(f"no such overload: compare {type(a).__name__} with {type(b).__name__}")

    def _quantity(self, text: str) -> Any:
        parse_quantity_str(text)
        return self.Quantity(value=text)

    def _semver(self, text: str, normalize: bool = False) -> Any:
        v = parse_semver(text, normalize)
        return self.Semver(value=f"{v.major}.{v.minor}.{v.patch}" + (f"-{'.'.join(v.pre)}" if v.pre else ""))

    def _is_semver(self, text: str, normalize: bool = False) -> bool:
        try:
            parse_semver(text, normalize)
        except ValueError:
            return False
        return True

    def _is_quantity(self, text: str) -> bool:
        try:
            parse_quantity_str(text)
        except ValueError:
            return False
        return True

    def _arith(self, a: Any, b: Any, sign: int) -> Any:
        y = self._q(b) if self._is_q(b) else Decimal(b)
        return self.Quantity(value=str(self._q(a) + sign * y))

    def _decls(self, typed: bool) -> list[Any]:
        T = cel.Type
        Q, S = T("k8sdra.Quantity"), T("k8sdra.Semver")
        S2 = S if typed else T.DYN  # (Semver, dyn): (Semver, Semver) would collide with (Quantity, Quantity)

        def member(name: str, ret: Any, impl: Callable[..., Any], sem: bool = True) -> Any:
            overloads = [cel.Overload(f"quantity_{name}", ret, [Q, Q], is_member=True, impl=impl)]
            if sem:
                overloads.append(cel.Overload(f"semver_{name}", ret, [S, S2], is_member=True, impl=impl))
            return cel.FunctionDecl(name, overloads)

        def unary(name: str, ret: Any, arg: Any, impl: Callable[..., Any]) -> Any:
            return cel.FunctionDecl(
                name, [cel.Overload(f"{name}_{arg.name()}", ret, [arg], is_member=True, impl=impl)]
            )

        return [
            cel.FunctionDecl(
                "quantity", [cel.Overload("quantity_string", Q, [T.STRING], impl=self._quantity)]
            ),
            cel.FunctionDecl(
                "isQuantity", [cel.Overload("isQuantity_string", T.BOOL, [T.STRING], impl=self._is_quantity)]
            ),
            cel.FunctionDecl(
                "semver",
                [
                    cel.Overload("semver_string", S, [T.STRING], impl=self._semver),
                    cel.Overload("semver_string_bool", S, [T.STRING, T.BOOL], impl=self._semver),
                ],
            ),
            cel.FunctionDecl(
                "isSemver",
                [
                    cel.Overload("isSemver_string", T.BOOL, [T.STRING], impl=self._is_semver),
                    cel.Overload("isSemver_string_bool", T.BOOL, [T.STRING, T.BOOL], impl=self._is_semver),
                ],
            ),
            member("compareTo", T.INT, self._compare),
            member("isGreaterThan", T.BOOL, lambda a, b: self._compare(a, b) > 0),
            member("isLessThan", T.BOOL, lambda a, b: self._compare(a, b) < 0),
            cel.FunctionDecl(
                "add",
                [
                    cel.Overload(
                        "quantity_add", Q, [Q, Q], is_member=True, impl=lambda a, b: self._arith(a, b, 1)
                    ),
                    cel.Overload(
                        "quantity_add_int",
                        Q,
                        [Q, T.INT],
                        is_member=True,
                        impl=lambda a, b: self._arith(a, b, 1),
                    ),
                ],
            ),
            cel.FunctionDecl(
                "sub",
                [
                    cel.Overload(
                        "quantity_sub", Q, [Q, Q], is_member=True, impl=lambda a, b: self._arith(a, b, -1)
                    ),
                    cel.Overload(
                        "quantity_sub_int",
                        Q,
                        [Q, T.INT],
                        is_member=True,
                        impl=lambda a, b: self._arith(a, b, -1),
                    ),
                ],
            ),
            unary("sign", T.INT, Q, lambda a: (self._q(a) > 0) - (self._q(a) < 0)),
            unary("asInteger", T.INT, Q, lambda a: int(self._q(a))),
            unary("isInteger", T.BOOL, Q, lambda a: self._q(a) == self._q(a).to_integral_value()),
            unary("asApproximateFloat", T.DOUBLE, Q, lambda a: float(self._q(a))),
            unary("major", T.INT, S, lambda a: self._s(a).major),
            unary("minor", T.INT, S, lambda a: self._s(a).minor),
            unary("patch", T.INT, S, lambda a: self._s(a).patch),
        ]

    def _new_env(self, typed: bool) -> Any:
        device = cel.Type("k8sdra.Device") if typed else cel.Type.Map(cel.Type.STRING, cel.Type.DYN)
        return cel.NewEnv(
            self.pool,
            variables={"device": device},
            extensions=[ext_bindings.ExtBindings(), ext_optional.ExtOptional()],
            functions=self._decls(typed),
        )

    # -- compile and check

    @staticmethod
    def _format_error(exc: Exception, shift: bool = True) -> str:
        text = str(exc)
        lines = _ERROR_LINE.findall(text)
        if lines:
            msgs = [f"column {col}: {msg}" if shift else msg for _, col, msg in lines]
            return "; ".join(dict.fromkeys(msgs))
        text = re.sub(r"\s*\[[A-Z_]+\]\s*$", "", text.strip())
        return re.sub(r"^[A-Z_]+: ", "", text)

    def check(self, expression: str) -> list[str]:
        """Problems with a selector expression (empty when it is valid)."""
        if not isinstance(expression, str) or not expression.strip():
            return ["must be a non-empty CEL expression"]
        if len(expression) > MAX_EXPRESSION_LENGTH:
            return [f"expression is {len(expression)} bytes long, the limit is {MAX_EXPRESSION_LENGTH}"]
        try:
            self._eval_env.compile(expression)
        except Exception as exc:  # cel-cpp raises RuntimeError/ValueError with a status text
            return [f"does not compile: {self._format_error(exc)}"]
        cost = estimate_cost(expression)
        if cost > MAX_ESTIMATED_COST:
            return [
                f"estimated cost {cost} exceeds the limit of {MAX_ESTIMATED_COST}; simplify the expression"
            ]
        rewritten = self._rewrite.sub(self._typed_ref, expression)
        try:
            typed = self._check_env.compile(rewritten)
        except Exception as exc:
            return [self._type_error(str(exc))]
        rtype = typed.return_type()
        if rtype != cel.Type.BOOL and rtype != cel.Type.DYN:
            return [f"must evaluate to bool, evaluates to {rtype.name().lower()}"]
        return []

    def _typed_ref(self, m: re.Match[str]) -> str:
        field_ = "driver_attributes__" if m.group(1) == "attributes" else "driver_capacity__"
        return f"device.{field_}" + (f".{m.group(4)}" if m.group(4) else "")

    def _type_error(self, text: str) -> str:
        unknown = re.search(
            r"undefined field '([^']+)' not found in struct 'k8sdra\.Driver(Attributes|Capacity)'", text
        )
        if unknown:
            name, what = unknown.group(1), unknown.group(2)
            cap = what == "Capacity"
            kind = "capacity" if cap else "attribute"
            return f"unknown {kind} {self.driver}/{name}: {self.schema.suggest(name, cap)}"
        field_ = re.search(r"undefined field '([^']+)' not found in struct 'k8sdra\.Device'", text)
        if field_:
            return (
                f"unknown field device.{field_.group(1)} "
                "(known: driver, attributes, capacity, allowMultipleAllocations)"
            )
        msg = self._format_error(Exception(text), shift=False)
        msg = msg.replace("k8sdra.Quantity", "quantity").replace("k8sdra.Semver", "semver")
        msg = msg.replace("driver_attributes__", f'attributes["{self.driver}"]')
        msg = msg.replace("driver_capacity__", f'capacity["{self.driver}"]')
        return f"type error: {msg}"

    def compile(self, expression: str) -> Selector:
        sel = self._compiled.get(expression)
        if sel is None:
            try:
                program = self._eval_env.compile(expression)
            except Exception as exc:
                raise CelError(f"does not compile: {self._format_error(exc)}") from exc
            domains = tuple(sorted({m.group(2) for m in _DOMAIN_REF.finditer(expression)}))
            sel = Selector(expression, program, domains)
            if len(self._compiled) > 10_000:
                self._compiled.clear()
            self._compiled[expression] = sel
        return sel

    # -- evaluation

    def device_view(self, driver: str, device: Mapping[str, Any]) -> dict[str, Any]:
        """The `device` variable for a published device (attributes under their domains)."""
        attrs: dict[str, dict[str, Any]] = {driver: {}, STANDARD_DOMAIN: {}}
        for key, value in (device.get("attributes") or {}).items():
            domain, _, name = key.rpartition("/")
            if not isinstance(value, dict) or not value:
                continue
            kind, v = next(iter(value.items()))
            if kind == "version":
                v = self.Semver(value=str(v))
            attrs.setdefault(domain or driver, {})[name] = v
        caps: dict[str, dict[str, Any]] = {driver: {}}
        for key, value in (device.get("capacity") or {}).items():
            domain, _, name = key.rpartition("/")
            raw = value.get("value") if isinstance(value, dict) else value
            caps.setdefault(domain or driver, {})[name] = self.Quantity(value=str(raw))
        return {
            "driver": driver,
            "attributes": attrs,
            "capacity": caps,
            "allowMultipleAllocations": bool(device.get("allowMultipleAllocations", False)),
        }

    def activation(self, view: dict[str, Any]) -> Any:
        return self._eval_env.Activation(data={"device": view})

    def evaluate(self, selector: Selector, view: dict[str, Any], activation: Any | None = None) -> bool:
        """True/False, or SelectorEvalError (unknown key, no such overload, non-bool result)."""
        missing = [d for d in selector.domains if d not in view["attributes"] or d not in view["capacity"]]
        if missing:  # Kubernetes: an unknown domain is an empty map, not an error
            view = dict(view, attributes=dict(view["attributes"]), capacity=dict(view["capacity"]))
            for d in missing:
                view["attributes"].setdefault(d, {})
                view["capacity"].setdefault(d, {})
            activation = None
        result = (
            selector.program.eval(activation)
            if activation is not None
            else selector.program.eval(data={"device": view})
        )
        if result.type() == cel.Type.BOOL:
            return bool(result.value())
        if result.type() == cel.Type.ERROR:
            raise SelectorEvalError(self._format_error(Exception(str(result.value()))))
        raise SelectorEvalError(f"evaluated to {result.type().name().lower()}, not bool")


# ---------------------------------------------------------------- cost estimate

_MACROS = re.compile(r"\.\s*(all|exists|exists_one|map|filter|transformList|transformMap)\s*\(")


def estimate_cost(expression: str) -> int:
    """A conservative stand-in for cel-go's static cost estimate (cel-expr-python has none).

    Each token costs 1; a comprehension multiplies the cost of its body by the assumed size of the
    collection (32, the most attributes a device may have), so nested comprehensions grow as 32^depth,
    as they do in cel-go. String functions on unbounded strings are not modelled.
    """
    cost, mult = 0, 1
    stack: list[bool] = []
    tokens = re.finditer(
        r"\.\s*(?:all|exists|exists_one|map|filter|transformList|transformMap)\s*\(|[()]|"
        r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|[A-Za-z_][A-Za-z0-9_]*|\d+|\S",
        expression,
    )
    for tok in tokens:
        t = tok.group(0)
        if _MACROS.fullmatch(t):
            stack.append(True)
            mult *= MAX_MAP_SIZE
        elif t == "(":
            stack.append(False)
        elif t == ")" and stack and stack.pop():
            mult //= MAX_MAP_SIZE
        cost += mult
    return cost
