"""The classification table and the operator's overrides."""

from __future__ import annotations

import pytest

from dra_gpu.health.classification import Classifier, Effect, EventKind, parse_xids


@pytest.mark.parametrize(
    ("xid", "effect"),
    [
        (13, Effect.NONE),
        (31, Effect.NONE),
        (109, Effect.NONE),
        (48, Effect.NO_SCHEDULE),
        (74, Effect.NO_SCHEDULE),
        (79, Effect.NO_EXECUTE),
        (95, Effect.NO_EXECUTE),
        (140, Effect.NO_EXECUTE),
    ],
)
def test_default_xid_classes(xid: int, effect: Effect) -> None:
    verdict = Classifier().classify(EventKind.XID, xid)
    assert verdict.effect is effect
    assert verdict.cause == f"xid-{xid}"


def test_other_events() -> None:
    c = Classifier()
    assert c.classify(EventKind.DOUBLE_BIT_ECC).effect is Effect.NO_EXECUTE
    assert c.classify(EventKind.GPU_LOST).cause == "gpu-lost"
    assert c.classify(EventKind.GPU_LOST).effect is Effect.NO_EXECUTE
    assert c.classify(EventKind.XID, 999).cause == "xid-unknown"


def test_overrides_move_xids_between_classes() -> None:
    c = Classifier.with_overrides(ignore_xids=[63, 79], no_execute_xids=[74, 13], no_schedule_xids=[31])
    assert c.classify(EventKind.XID, 63).effect is Effect.NONE
    assert c.classify(EventKind.XID, 79).effect is Effect.NONE  # the operator's ignore wins over the default
    assert c.classify(EventKind.XID, 74).effect is Effect.NO_EXECUTE
    assert c.classify(EventKind.XID, 13).effect is Effect.NO_EXECUTE  # named stronger: leaves the app list
    assert c.classify(EventKind.XID, 31).effect is Effect.NO_SCHEDULE
    assert any("NoExecute" in effect for _, effect in c.table())


def test_xid_lists_name_the_flag() -> None:
    assert parse_xids("13, 31,", "--x") == [13, 31]
    with pytest.raises(ValueError, match="--health-ignore-xids: 'abc'"):
        parse_xids("13,abc", "--health-ignore-xids")
