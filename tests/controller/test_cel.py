"""The CEL environment's answers for what cel-expr-python raises on compile (nothing else is caught)."""

from __future__ import annotations

import pytest

from dra_gpu.controller.cel import CelEnvironment, CelError, Schema

from .objects import DRIVER


@pytest.fixture(scope="module")
def env() -> CelEnvironment:
    return CelEnvironment(Schema.default(DRIVER))


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1 +", "does not compile: column 4: Syntax error"),  # RuntimeError with a status text
        ("(" * 40 + "true" + ")" * 40, "does not compile: Expression recursion limit exceeded"),
        ("'\ud800' == 'a'", "does not compile: compile(): incompatible function arguments"),  # TypeError
    ],
)
def test_what_compile_raises_is_a_problem_not_a_crash(
    env: CelEnvironment, expression: str, message: str
) -> None:
    (problem,) = env.check(expression)
    assert problem.startswith(message), problem
    assert env.unmodelled(expression) == []
    with pytest.raises(CelError, match="does not compile"):
        env.compile(expression)
