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

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cel_expr_python import cel
from cel_expr_python.ext import ext_bindings, ext_optional, ext_strings
from google.protobuf import message_factory

from dra_gpu.attributes import STANDARD_DOMAIN
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

# What cel-expr-python's compile() raises: RuntimeError with cel-cpp's status text for an invalid
# expression (syntax, undeclared names, types, recursion limit); TypeError for a str it cannot pass
# to C++ (a lone surrogate, which JSON can carry).
COMPILE_ERRORS = (RuntimeError, TypeError)
_DOMAIN_REF = re.compile(r"device\s*\.\s*(?:attributes|capacity)\s*\[\s*([\"'])([^\"']+)\1\s*\]")


class CelError(ValueError):
    """An expression that does not compile, type-check or fit the limits."""


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
            raise SelectorEvalError(self._format_error(str(result.value())))
        raise SelectorEvalError(f"evaluated to {result.type().name().lower()}, not bool")
