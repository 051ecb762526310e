"""What the fuzz suites share: their Hypothesis settings, and every place in a JSON-like object
(as a path of keys and indexes) for them to mutate."""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings


def fuzz_settings(default_examples: int) -> tuple[int, settings]:
    """(examples, settings): a fixed-seed run of `default_examples` in CI; with
    $DRA_GPU_FUZZ_EXAMPLES, that many random examples (the documented longer run)."""
    examples = int(os.environ.get("DRA_GPU_FUZZ_EXAMPLES", str(default_examples)))
    return examples, settings(
        max_examples=examples,
        derandomize=not os.environ.get("DRA_GPU_FUZZ_EXAMPLES"),
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )


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
