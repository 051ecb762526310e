"""What the fuzzers mutate: every place in a JSON-like object, as a path of keys and indexes."""

from __future__ import annotations

from typing import Any


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
