"""Compiling, checking and evaluating DRA device selectors, in a CEL environment modelled on the
Kubernetes DRA one, on cel-expr-python (cel-cpp).

Two environments share one function library (functions.py):

* the **eval env** mirrors Kubernetes: `device` is `map(string, dyn)` holding `driver`,
  `attributes[domain][name]` and `capacity[domain][name]`; version attributes and capacities are
  `k8sdra.Semver` / `k8sdra.Quantity` protobuf messages, made at runtime (cel-expr-python only accepts
  protobuf messages as custom values).
* the **check env** is stricter than the apiserver: the driver's own domain is a typed message with one
  field per published attribute (schema.py), so `device.attributes["<driver>"].prodName`,
  `productName == 1` or `capacity[...].memory.compareTo(40)` are compile-time errors. The expression is
  rewritten so that a literal `device.attributes["<driver>"]` becomes a field of the typed device;
  anything else (other domains, computed keys) stays dynamic. What Kubernetes accepts that this would
  not is in compat.py.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cel_expr_python import cel
from cel_expr_python.ext import ext_bindings, ext_optional, ext_strings
from google.protobuf import message_factory

from dra_gpu.controller.cel.compat import (
    MAX_ESTIMATED_COST,
    MAX_EXPRESSION_LENGTH,
    error_lines,
    estimate_cost,
    is_lenient_type_error,
    unmodelled_functions,
)
from dra_gpu.controller.cel.functions import KubernetesFunctions
from dra_gpu.controller.cel.schema import (
    DEVICE,
    DRIVER_ATTRIBUTES_FIELD,
    DRIVER_CAPACITY_FIELD,
    QUANTITY,
    SEMVER,
    Schema,
    descriptor_pool_for,
)
from dra_gpu.model.attributes import STANDARD_DOMAIN

# What cel-expr-python's compile() raises: RuntimeError with cel-cpp's status text for an invalid
# expression (syntax, undeclared names, types, recursion limit); TypeError for a str it cannot pass
# to C++ (a lone surrogate, which JSON can carry).
COMPILE_ERRORS = (RuntimeError, TypeError)
_DOMAIN_REF = re.compile(r"device\s*\.\s*(?:attributes|capacity)\s*\[\s*([\"'])([^\"']+)\1\s*\]")
_DEVICE = re.compile(r"\bdevice\b")
# One read of the `device` variable whose answer is a single value: a literal domain, then a literal
# field (`.name`, not a method call such as `.size()`) or literal index (`["name"]`); or
# `device.driver` / `device.allowMultipleAllocations`. String literals with escapes, quotes or a
# prefix (r"", b"") do not match, so what they spell never has to be decoded here.
_READ = re.compile(
    r"device\s*\.\s*(?:"
    r"(attributes|capacity)\s*\[\s*([\"'])([^\"'\\]+)\2\s*\]"
    r"(?:\s*\.\s*([A-Za-z_][A-Za-z0-9_]*)(?![A-Za-z0-9_])(?!\s*\()|\s*\[\s*([\"'])([^\"'\\]+)\5\s*\])"
    r"|(?:driver|allowMultipleAllocations)(?![A-Za-z0-9_])(?!\s*\())"
)

# One value of the `device` variable: ("attributes" | "capacity", domain, name).
Read = tuple[str, str, str]


class CelError(ValueError):
    """An expression that does not compile, type-check or fit the limits."""


@dataclass(frozen=True)
class Selector:
    """A compiled selector for evaluation."""

    expression: str
    program: Any  # cel.Expression
    domains: tuple[str, ...]  # literal attribute/capacity domains it indexes
    # Every value of `device` its result can depend on (besides `driver` and
    # `allowMultipleAllocations`), or None when it reads the device otherwise (a whole map, a
    # computed key, a comprehension): two devices equal in these values get the same answer.
    reads: tuple[Read, ...] | None = None


class SelectorEvalError(RuntimeError):
    """A selector failed at runtime for a device (the scheduler aborts the allocation then)."""


class CelEnvironment:
    """Compiles, checks and evaluates DRA device selectors for one driver."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.driver = schema.driver
        self.pool = descriptor_pool_for(schema)
        self.Quantity: Any = message_factory.GetMessageClass(self.pool.FindMessageTypeByName(QUANTITY))
        self.Semver: Any = message_factory.GetMessageClass(self.pool.FindMessageTypeByName(SEMVER))
        self._functions = KubernetesFunctions(self.Quantity, self.Semver)
        self._eval_env = self._new_env(typed=False)
        self._check_env = self._new_env(typed=True)
        self._rewrite = re.compile(
            r"device\s*\.\s*(attributes|capacity)\s*\[\s*(\"|')" + re.escape(self.driver) + r"\2\s*\]"
            # Only where a field is read: a comprehension or `in` over the map stays dynamic.
            r"(?:\s*\[\s*(\"|')([A-Za-z_][A-Za-z0-9_]*)\3\s*\]|(?=\s*\.\s*\??\s*[A-Za-z_]\w*\b(?!\s*\()))"
        )
        self._compiled: dict[str, Selector] = {}
        self._unmodelled: dict[str, list[str]] = {}

    def _new_env(self, typed: bool) -> Any:
        device = cel.Type(DEVICE) if typed else cel.Type.Map(cel.Type.STRING, cel.Type.DYN)
        return cel.NewEnv(
            self.pool,
            variables={"device": device},
            extensions=[ext_bindings.ExtBindings(), ext_optional.ExtOptional(), ext_strings.ExtStrings(2)],
            functions=self._functions.declarations(typed),
        )

    # -- compile and check

    @staticmethod
    def _format_error(text: str, shift: bool = True) -> str:
        """cel-cpp's status text as one line: "column 4: undeclared reference to 'x'; ..."."""
        lines = error_lines(text)
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
            except COMPILE_ERRORS as exc:
                hit = unmodelled_functions(expression, str(exc))
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
        except COMPILE_ERRORS as exc:
            if self.unmodelled(expression):
                return []  # valid in Kubernetes; the caller warns that it is not checked
            return [f"does not compile: {self._format_error(str(exc))}"]
        cost = estimate_cost(expression)
        if cost > MAX_ESTIMATED_COST:
            return [
                f"estimated cost {cost} exceeds the limit of {MAX_ESTIMATED_COST}; simplify the expression"
            ]
        rewritten = self._rewrite.sub(self._typed_ref, expression)
        try:
            typed = self._check_env.compile(rewritten)
        except COMPILE_ERRORS as exc:
            lines = error_lines(str(exc))
            strict = [x for x in lines if not is_lenient_type_error(x[2])]
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
        field_ = DRIVER_ATTRIBUTES_FIELD if m.group(1) == "attributes" else DRIVER_CAPACITY_FIELD
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
        msg = self._format_error(text, shift=False)
        msg = msg.replace(QUANTITY, "quantity").replace(SEMVER, "semver")
        msg = msg.replace(DRIVER_ATTRIBUTES_FIELD, f'attributes["{self.driver}"]')
        msg = msg.replace(DRIVER_CAPACITY_FIELD, f'capacity["{self.driver}"]')
        return f"type error: {msg}"

    def compile(self, expression: str) -> Selector:
        sel = self._compiled.get(expression)
        if sel is None:
            try:
                program = self._eval_env.compile(expression)
            except COMPILE_ERRORS as exc:
                raise CelError(f"does not compile: {self._format_error(str(exc))}") from exc
            domains = tuple(sorted({m.group(2) for m in _DOMAIN_REF.finditer(expression)}))
            sel = Selector(expression, program, domains, selector_reads(expression))
            if len(self._compiled) > 10_000:
                self._compiled.clear()
            self._compiled[expression] = sel
        return sel

    # -- evaluation

    def device_view(self, driver: str, device: Mapping[str, Any]) -> dict[str, Any]:
        """The `device` variable for a published device (attributes under their domains)."""
        attrs: dict[str, dict[str, Any]] = {driver: {}, STANDARD_DOMAIN: {}}
        caps: dict[str, dict[str, Any]] = {driver: {}}
        for section, domain, name, kind, v in _entries(driver, device):
            if section == "capacity":
                caps.setdefault(domain, {})[name] = self.Quantity(value=str(v))
            else:
                attrs.setdefault(domain, {})[name] = self.Semver(value=str(v)) if kind == "version" else v
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
            raise SelectorEvalError(self._format_error(str(result.value())))
        raise SelectorEvalError(f"evaluated to {result.type().name().lower()}, not bool")


def _entries(driver: str, device: Mapping[str, Any]) -> Any:
    """(section, domain, name, kind, value) of each attribute and capacity of a published device, in
    order (a later one for the same name wins): what device_view and device_values are built from."""
    for key, value in (device.get("attributes") or {}).items():
        domain, _, name = key.rpartition("/")
        if not isinstance(value, dict) or not value:
            continue
        kind, v = next(iter(value.items()))
        yield "attributes", domain or driver, name, kind, v
    for key, value in (device.get("capacity") or {}).items():
        domain, _, name = key.rpartition("/")
        yield "capacity", domain or driver, name, "", value.get("value") if isinstance(value, dict) else value


def device_value(driver: str, device: Mapping[str, Any], read: Read) -> Any:
    """One value of the device as a selector reads it, hashable; None when it has none. Equal
    values make equal `device` variables for this read (device_view takes the same entry); a value
    that is not a plain scalar is never equal to another device's."""
    section, domain, name = read
    if "/" in name:
        return None  # device_view files "a/b" under domain "a": no entry is ever named so
    entries = device.get(section) or {}
    keys = [k for k in _spellings(driver, domain, name) if k in entries]
    if len(keys) > 1:  # several spellings of one name: the last valid one wins, as in device_view
        found = None
        for sec, dom, nm, kind, v in _entries(driver, device):
            if sec == section and dom == domain and nm == name:
                found = (kind, _hashable(v))
        return found
    if not keys:
        return None
    value = entries[keys[0]]
    if section == "capacity":
        return ("", _hashable(value.get("value") if isinstance(value, dict) else value))
    if not isinstance(value, dict) or not value:
        return None
    kind, v = next(iter(value.items()))
    return (kind, _hashable(v))


@functools.lru_cache(maxsize=1024)
def _spellings(driver: str, domain: str, name: str) -> tuple[str, ...]:
    """The keys a device may publish `domain`/`name` under (the driver's own also unqualified)."""
    return (f"{domain}/{name}", name, f"/{name}") if domain == driver else (f"{domain}/{name}",)


def _hashable(v: Any) -> Any:
    t = type(v)
    if t is str or t is int or t is bool:
        return (t.__name__, v)  # the type too: True == 1, but they are different CEL values
    if t is float:
        return ("float", repr(v))  # -0.0 == 0.0; NaN != NaN
    return object()  # a list, a map, null: not shared with any other device


def selector_reads(expression: str) -> tuple[Read, ...] | None:
    """What of `device` the selector reads (see Selector.reads), or None when that is not plain
    from its text. Every occurrence of the name `device` must be one literal read; one that is
    not (a comprehension over a map, a computed key, `device` bound to another name, the word in a
    string literal) makes the answer None, which is always safe: the device is then evaluated on
    its own. A `//` comment could hide a call's parenthesis from the pattern: None as well."""
    if "//" in expression:
        return None
    reads: dict[Read, None] = {}
    for m in _DEVICE.finditer(expression):
        read = _READ.match(expression, m.start())
        if read is None:
            return None
        section = read.group(1)
        if section:
            name = read.group(4) or read.group(6)
            reads[(section, read.group(3), name)] = None
    return tuple(reads)
