"""The Kubernetes quantity and semver CEL libraries, which cel-cpp lacks, as cel-expr-python functions.

`quantity()`, `isQuantity()`, `semver()`, `isSemver()`, `compareTo`, `isGreaterThan`, `isLessThan`,
`sign`, `asInteger`, `asApproximateFloat`, `isInteger`, `add`, `sub`, `major`, `minor`, `patch`.
Values are `k8sdra.Quantity` / `k8sdra.Semver` protobuf messages holding the text (cel-expr-python
accepts custom values only as messages); one dispatcher per name, as cel-cpp dispatches by kind only.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

from cel_expr_python import cel

from dra_gpu.controller.cel.schema import QUANTITY, SEMVER
from dra_gpu.kube.values import SemverValue, parse_quantity, parse_semver


class KubernetesFunctions:
    """The function declarations and their implementations over one pair of message classes."""

    def __init__(self, quantity_class: Any, semver_class: Any) -> None:
        self.Quantity = quantity_class
        self.Semver = semver_class

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

    def declarations(self, typed: bool) -> list[Any]:
        """The cel.FunctionDecls; `typed` for the check environment (semver compares with semver only)."""
        T = cel.Type
        Q, S = T(QUANTITY), T(SEMVER)
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
