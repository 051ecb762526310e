"""The fuzz suites' reach floor (tests/mutation.py): a fuzz test fails when too few of its
examples reach the logic it is about, as when its generator degenerates."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.mutation import check_reach, reach, reaches, reaching

E2E_VALIDATOR = ("valid, accepted by both", "valid, unsatisfiable here, accepted by both")


def test_the_share_counts_every_outcome_named_by_prefix_and_fails_below_the_floor() -> None:
    seen = {
        "valid, accepted by both": 10,
        "valid, unsatisfiable here, accepted by both": 5,
        "mutated, denied": 45,
    }
    check_reach(seen, 0.25, E2E_VALIDATOR, "e2e validator fuzz")  # 15 of 60
    with pytest.raises(
        AssertionError, match=r"e2e validator fuzz: 15 of 60 examples reached .* at least 26%"
    ):
        check_reach(seen, 0.26, E2E_VALIDATOR, "e2e validator fuzz")
    with pytest.raises(AssertionError, match="0 of 0 examples"):
        check_reach({}, 0.0, E2E_VALIDATOR, "no examples ran")


def parity(n: int) -> None:
    reach("even" if n % 2 == 0 else "odd")


def test_a_run_whose_generator_degenerated_fails() -> None:
    @settings(max_examples=40, derandomize=True, database=None)
    @given(st.integers(0, 1000))
    def varied(n: int) -> None:
        parity(n)

    @settings(max_examples=40, derandomize=True, database=None)
    @given(st.integers(0, 1000).map(lambda n: 2 * n + 1))  # never even
    def degenerate(n: int) -> None:
        parity(n)

    with reaching(0.2, "even"):
        varied()
    with pytest.raises(AssertionError, match="examples reached 'even'"), reaching(0.2, "even"):
        degenerate()


@reaches(0.2, "even")
@settings(max_examples=40, derandomize=True, database=None)
@given(st.integers(0, 1000))
def test_reaches_checks_a_given_test_it_decorates(n: int) -> None:
    parity(n)
