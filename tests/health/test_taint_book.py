"""Taint state: hold-down, flapping, operator overrides, and persistence across restarts."""

from __future__ import annotations

from pathlib import Path

from dra_gpu.health.classification import Effect, Verdict
from dra_gpu.health.taint_book import HoldDown, TaintBook


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


HOLD = HoldDown(initial=10, maximum=40, flap_window=60)
XID79 = Verdict(Effect.NO_EXECUTE, "xid-79")
XID74 = Verdict(Effect.NO_SCHEDULE, "xid-74")


def book(path: Path | None, clock: Clock) -> TaintBook:
    return TaintBook(path, ["gpu-a", "gpu-b"], HOLD, wall=clock, monotonic=clock)


def test_taint_goes_after_the_hold_down_of_passed_checks(tmp_path: Path) -> None:
    clock = Clock()
    b = book(None, clock)
    assert b.record("gpu-a", XID74)
    assert b.record("gpu-a", XID79)  # stronger: replaces
    assert not b.record("gpu-a", XID74)  # weaker: kept
    assert b.slice_taints("d.io/unhealthy")["gpu-a"][0] == {
        "key": "d.io/unhealthy",
        "value": "xid-79",
        "effect": "NoExecute",
        "timeAdded": "1970-01-01T00:16:40Z",
    }
    b.healthy("gpu-a")
    clock.t += 9
    assert b.expire() == []
    b.unhealthy("gpu-a")  # a failed check restarts the hold-down
    b.healthy("gpu-a")
    clock.t += 9
    assert b.expire() == []
    clock.t += 1
    assert b.expire() == ["gpu-a"]
    assert b.tainted() == {}


def test_a_flapping_device_gets_a_growing_hold_down() -> None:
    clock = Clock()
    b = book(None, clock)
    holds = []
    for _ in range(4):
        b.record("gpu-a", XID74)
        holds.append(b.devices["gpu-a"].hold_down)
        b.healthy("gpu-a")
        clock.t += b.devices["gpu-a"].hold_down
        assert b.expire() == ["gpu-a"]
        clock.t += 1
    assert holds == [10, 20, 40, 40]
    clock.t += 61  # quiet for longer than the flap window: back to the initial hold-down
    b.record("gpu-a", XID74)
    assert b.devices["gpu-a"].hold_down == 10


def test_forced_taints_stay_until_cleared() -> None:
    clock = Clock()
    b = book(None, clock)
    b.force("gpu-b", Effect.NO_SCHEDULE, "maintenance")
    b.healthy("gpu-b")
    clock.t += 1000
    assert b.expire() == []
    assert b.slice_taints("k/x")["gpu-b"][0]["value"] == "maintenance"
    assert b.clear("gpu-b") and b.tainted() == {}


def test_a_restart_keeps_the_taint_and_starts_the_hold_down_again(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "health-taints.json"
    b = book(path, clock)
    b.record("gpu-a", XID79)
    b.healthy("gpu-a")
    clock.t += 9
    again = book(path, clock)  # the plugin restarts 9 s into a 10 s hold-down
    assert again.tainted()["gpu-a"].cause == "xid-79"
    again.healthy("gpu-a")
    clock.t += 5
    assert again.expire() == []  # not early: the hold-down started again
    clock.t += 5
    assert again.expire() == ["gpu-a"]
    assert book(path, clock).tainted() == {}


def test_a_corrupt_state_file_is_named_and_ignored(tmp_path: Path, caplog: object) -> None:
    path = tmp_path / "health-taints.json"
    path.write_text("{not json")
    assert book(path, Clock()).tainted() == {}
    path.write_text('{"version": 1, "devices": {"gpu-a": {"cause": "x"}, "gone": {}}}')
    assert book(path, Clock()).tainted() == {}
