"""What the fuzz suites share: their Hypothesis profiles, the reach counter, and every place in a
JSON-like object (as a path of keys and indexes) for them to mutate.

Profiles (`HYPOTHESIS_PROFILE`, registered by tests/conftest.py):
  ci       the default: a fixed seed (derandomized; every run tries the same inputs) and a small
           number of examples per property, so the whole fuzz set stays well under a minute.
  nightly  random inputs, NIGHTLY_FACTOR times as many examples per property.

Reach: a fuzz test calls `reach(outcome)` once per example with what the example got to (decoded,
allowed, prepared, ...). The counts, by test, are printed at the end of the run (and are Hypothesis
events, for `--hypothesis-show-statistics`): a fuzzer whose inputs never pass decoding is visible.
`reaches` / `reaching` make it fail: a test asserts that at least a share of its examples reached
the logic under test (shares set at about half the lowest seen over several random seeds).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from hypothesis import event, settings

NIGHTLY_FACTOR = 20
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")

settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("nightly", derandomize=False, database=None, deadline=None, print_blob=True)

REACHED: Counter[tuple[str, str]] = Counter()
F = TypeVar("F", bound=Callable[..., Any])


def fuzz_settings(ci_examples: int) -> settings:
    """The settings of one fuzz property: `ci_examples` in the ci profile, NIGHTLY_FACTOR times
    that in the nightly one (the profile itself says seed and deadline)."""
    factor = NIGHTLY_FACTOR if PROFILE == "nightly" else 1
    return settings(max_examples=ci_examples * factor)


def reach(outcome: str) -> None:
    """Count what this example of the running test reached."""
    event(outcome)
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    REACHED[(test, outcome)] += 1


def reach_report() -> list[str]:
    """The reach counts, one line per test: outcome counts and their total."""
    by_test: dict[str, Counter[str]] = {}
    for (test, outcome), n in REACHED.items():
        by_test.setdefault(test, Counter())[outcome] += n
    lines = []
    for test, outcomes in sorted(by_test.items()):
        total = sum(outcomes.values())
        parts = ", ".join(f"{o} {n}" for o, n in sorted(outcomes.items()))
        lines.append(f"{test}: {total} examples: {parts}")
    return lines


def check_reach(counts: Mapping[str, int], minimum: float, outcomes: tuple[str, ...], what: str) -> None:
    """AssertionError unless at least `minimum` (a share) of the examples counted in `counts`
    (outcome -> examples) reached an outcome starting with one of `outcomes`."""
    total = sum(counts.values())
    hit = sum(n for outcome, n in counts.items() if outcome.startswith(outcomes))
    assert total > 0 and hit >= minimum * total, (
        f"{what}: {hit} of {total} examples reached {' or '.join(map(repr, outcomes))}, "
        f"at least {minimum:.0%} wanted (the generator degenerated?): {dict(sorted(counts.items()))}"
    )


@contextlib.contextmanager
def reaching(minimum: float, *outcomes: str) -> Iterator[None]:
    """Around a Hypothesis run inside a test: check_reach over the examples `reach`ed in it."""
    before = Counter(REACHED)
    yield
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    counts = {o: n - before[(t, o)] for (t, o), n in REACHED.items() if t == test and n > before[(t, o)]}
    check_reach(counts, minimum, outcomes, test)


def reaches(minimum: float, *outcomes: str) -> Callable[[F], F]:
    """A @given test (decorated above its @given) run `reaching(minimum, *outcomes)`."""

    def decorate(test: F) -> F:
        @functools.wraps(test)
        def run(*args: Any, **kwargs: Any) -> Any:
            with reaching(minimum, *outcomes):
                return test(*args, **kwargs)

        return run  # type: ignore[return-value]

    return decorate


def paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path of `obj` itself (empty) and of every value nested in its dicts and lists."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += paths(v, (*prefix, i))
    return out


def replace_at(obj: Any, where: tuple[Any, ...], value: Any) -> Any:
    """`obj` with the value at `where` replaced (in place; the new root when `where` is empty)."""
    if not where:
        return value
    target = obj
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    return obj
