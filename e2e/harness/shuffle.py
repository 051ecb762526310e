"""A shuffled order of a test run, reproducible from its seed (DRA_GPU_TEST_SHUFFLE=<seed>).

Test files are shuffled as blocks and the tests within each file among themselves: a file's
module-scoped fixtures (a plugin on the node's one HTTP port, a cluster-wide DeviceClass) are up
for one stretch, as in any run, while every test still meets another predecessor. A test that
passes only after another file's leftovers, or only in file order, fails in some seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def shuffled(items: Sequence[T], file_of: Callable[[T], str], seed: str) -> list[T]:
    """`items` with their files in a random order, and each file's items in a random order."""
    rng = random.Random(seed)
    by_file: dict[str, list[T]] = {}
    for item in items:
        by_file.setdefault(file_of(item), []).append(item)
    files = list(by_file)
    rng.shuffle(files)
    out: list[T] = []
    for name in files:
        group = by_file[name]
        rng.shuffle(group)
        out += group
    return out
