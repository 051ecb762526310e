"""e2e/harness/shuffle.py: a shuffled test order keeps each file's tests together."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from harness.shuffle import shuffled


def test_files_stay_whole_the_order_changes_and_a_seed_repeats_it() -> None:
    items = [f"{f}::t{i}" for f in "abcde" for i in range(4)]
    file_of = lambda item: item.split("::")[0]  # noqa: E731
    orders = {tuple(shuffled(items, file_of, str(seed))) for seed in range(20)}
    assert len(orders) > 15  # the seeds give different orders
    for order in orders:
        assert sorted(order) == sorted(items)
        runs = [key for key, _ in itertools.groupby(order, key=file_of)]
        assert len(runs) == 5  # each file's tests in one stretch
    assert any(o[:4] != tuple(items[:4]) for o in orders)  # within a file too
    assert shuffled(items, file_of, "7") == shuffled(items, file_of, "7")
