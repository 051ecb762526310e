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
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from cel_expr_python import cel
from cel_expr_python.ext import ext_bindings, ext_optional, ext_strings
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, struct_pb2

from dra_gpu.attributes import CAPACITIES, DRIVER_ATTRIBUTES, STANDARD_DOMAIN
from dra_gpu.kubernetes_values import SemverValue, parse_quantity, parse_semver

MAX_EXPRESSION_LENGTH = 10 * 1024  # CELSelectorExpressionMaxLength
MAX_ESTIMATED_COST = 1_000_000  # CELSelectorExpressionMaxCost
MAX_MAP_SIZE = 32  # ResourceSliceMaxAttributesAndCapacitiesPerDevice: the size cel-go assumes

_DOMAIN_REF = re.compile(r"device\s*\.\s*(?:attributes|capacity)\s*\[\s*([\"'])([^\"']+)\1\s*\]")
_ERROR_LINE = re.compile(r"ERROR: <input>:(\d+):(\d+): ([^\n]*)")


class CelError(ValueError):
    """An expression that does not compile, type-check or fit the limits."""


# Functions of the Kubernetes CEL libraries in the DRA environment (k8s.io/apiserver/pkg/cel/environment,
# base.go, compatibility version 1.36) that cel-cpp does not provide: Regex, Lists, ext.Lists(3), ext.Sets,
# URLs, IP, CIDR, Format and two-variable comprehensions. An expression that fails to compile only for
# these is valid for the apiserver and the scheduler: it is not denied, only neither checked nor simulated.
UNMODELLED_FUNCTIONS = frozenset(
    {
        # library.Regex
        "find", "findAll",
        # library.Lists (v0), ext.Lists (v3)
        "isSorted", "sum", "min", "max", "indexOf", "lastIndexOf", "lists", "range", "flatten",
        "distinct", "slice", "sort", "sortBy",
        # ext.Sets
        "sets", "contains", "equivalent", "intersects",
        # library.URLs, library.IP, library.CIDR
        "url", "isURL", "getScheme", "getHost", "getHostname", "getPort", "getEscapedPath", "getQuery",
        "ip", "isIP", "cidr", "isCIDR", "family", "isUnspecified", "isLoopback", "isLinkLocalMulticast",
        "isLinkLocalUnicast", "isGlobalUnicast", "isCanonical", "prefixLength", "masked",
        # library.Format
        "format", "named", "validate", "dns1123Label", "dns1123Subdomain", "dns1035Label",
        "qualifiedName", "dns1123LabelPrefix", "dns1123SubdomainPrefix", "dns1035LabelPrefix",
        "labelValue", "uri", "uuid", "byte", "date", "datetime",
        # ext.TwoVarComprehensions
        "all", "exists", "existsOne", "transformList", "transformMap", "transformMapEntry",
    }
)  # fmt: skip
_UNDECLARED = re.compile(r"undeclared reference to '([^']+)'|found no matching overload for '([^']+)'")
# Typed-check errors that are not errors for Kubernetes: there attribute values are `dyn`, comparisons
# across int/uint/double are enabled (cel.CrossTypeNumericComparisons) and equality is heterogeneous,
# and each of these evaluates fine at runtime: `index > 2.5`, `index < 6u`, `index == 3.0`,
# `numaNode != null`, `?index.orValue(0.5)`. (Arithmetic across numeric types is not in this list: it
# fails at runtime, so the claim could never be allocated.)
_NUM = r"(?:int|uint|double)"
_LENIENT_TYPE_ERRORS = (
    re.compile(rf"found no matching overload for '_(?:<|<=|>|>=|==|!=)_' applied to '\({_NUM}, {_NUM}\)'"),
    re.compile(r"found no matching overload for '_(?:==|!=)_' applied to '\([^,()]+, null_type\)'"),
    re.compile(r"found no matching overload for '_(?:==|!=)_' applied to '\(null_type, [^,()]+\)'"),
    re.compile(rf"found no matching overload for 'orValue' applied to '\(optional_type\({_NUM}\), {_NUM}\)'"),
)
_TWO_VAR_LOOP = re.compile(
    r"\.\s*(?:all|exists|existsOne|transformList|transformMap|transformMapEntry)\s*\(\s*(\w+)\s*,\s*(\w+)\s*,"
)


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
        """The attributes and capacities dra-gpu declares (dra_gpu.attributes)."""
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
        self._unmodelled: dict[str, list[str]] = {}

    # -- function implementations (one dispatcher per name: cel-cpp dispatches by kind only)

    def _q(self, v: Any) -> Decimal:
        return parse_quantity(v.value)

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
        parse_quantity(text)
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
            parse_quantity(text)
        except ValueError:
            return False
        return True

    def _arith(self, a: Any, b: Any, sign: int) -> Any:
        y = self._q(b) if self._is_q(b) else Decimal(b)
        return self.Quantity(value=str(self._q(a) + sign * y))

    def _sign(self, a: Any) -> int:
        q = self._q(a)
        return (q > 0) - (q < 0)

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
            # A global function in Kubernetes (`sign(q)`), unlike the other quantity functions.
            cel.FunctionDecl(
                "sign",
                [cel.Overload("sign_quantity", T.INT, [Q], impl=self._sign)],
            ),
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
            extensions=[ext_bindings.ExtBindings(), ext_optional.ExtOptional(), ext_strings.ExtStrings(2)],
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

    def unmodelled(self, expression: str) -> list[str]:
        """The Kubernetes CEL functions (UNMODELLED_FUNCTIONS) that keep `expression` from compiling
        here; empty when it compiles or when it fails for anything else too."""
        hit = self._unmodelled.get(expression)
        if hit is None:
            hit = []
            try:
                self._eval_env.compile(expression)
            except Exception as exc:
                names = {a or b for a, b in _UNDECLARED.findall(str(exc))}
                known = names & UNMODELLED_FUNCTIONS
                rest = names - UNMODELLED_FUNCTIONS
                # A two-variable comprehension also leaves its loop variables undeclared.
                allowed = {v for pair in _TWO_VAR_LOOP.findall(expression) for v in pair}
                # Every error must come from those names (or cascade from them: an '*error*' type).
                others = [m for _, _, m in _ERROR_LINE.findall(str(exc)) if not _UNDECLARED.search(m)]
                if known and not (rest - allowed) and all("'*error*'" in m for m in others):
                    hit = sorted(known)
            if len(self._unmodelled) > 10_000:
                self._unmodelled.clear()
            self._unmodelled[expression] = hit
        return hit

    def check(self, expression: str) -> list[str]:
        """Problems with a selector expression (empty when it is valid)."""
        if not isinstance(expression, str) or not expression.strip():
            return ["must be a non-empty CEL expression"]
        if len(expression) > MAX_EXPRESSION_LENGTH:
            return [f"expression is {len(expression)} bytes long, the limit is {MAX_EXPRESSION_LENGTH}"]
        try:
            self._eval_env.compile(expression)
        except Exception as exc:  # cel-cpp raises RuntimeError/ValueError with a status text
            if self.unmodelled(expression):
                return []  # valid in Kubernetes; the caller warns that it is not checked
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
            lines = _ERROR_LINE.findall(str(exc))
            strict = [x for x in lines if not any(p.search(x[2]) for p in _LENIENT_TYPE_ERRORS)]
            if lines and not strict:
                return []  # valid for Kubernetes, and the eval env (dyn, as Kubernetes) evaluates it
            if lines:
                return [self._type_error("\n".join(f"ERROR: <input>:{r}:{c}: {m}" for r, c, m in strict))]
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
