"""Per-device taint state: which device is tainted, why, how hard, and when it may come back.

A taint goes once the device has passed its health checks for a hold-down period. A device that
was tainted again soon after a clear is flapping: its next hold-down doubles (up to a maximum), so
a GPU that fails every few minutes stays out instead of catching new work between failures.
Operator-forced taints never expire. The state is written atomically and durably (temp file,
fsync, rename, fsync of the directory: it must outlive a power loss, so that a reboot puts no
device the operator or a hold-down keeps out back into service) under the plugin dir after every
change; after a restart the hold-down starts again, so a restart never clears a taint early.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dra_gpu.common.durable import replace_durably
from dra_gpu.health.classification import Effect, Verdict

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
OPERATOR_CAUSE = "operator"


def rfc3339(wall: float) -> str:
    return datetime.fromtimestamp(int(wall), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class DeviceState:
    cause: str | None = None  # None: not tainted
    effect: Effect = Effect.NONE
    time_added: float = 0.0  # wall clock
    forced: bool = False
    hold_down: float = 0.0  # seconds of passed checks needed before the taint goes
    cleared_at: float | None = None  # wall clock of the last automatic clear (flap detection)
    healthy_since: float | None = None  # monotonic; not persisted: a restart starts it again
    message: str = ""

    @property
    def tainted(self) -> bool:
        return self.cause is not None


@dataclass(frozen=True)
class HoldDown:
    initial: float = 300.0
    maximum: float = 3600.0
    flap_window: float = 1800.0  # a taint within this long of the last clear counts as a flap


class TaintBook:
    def __init__(
        self,
        path: Path | None,
        devices: Iterable[str],
        hold_down: HoldDown = HoldDown(),
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.hold = hold_down
        self.wall = wall
        self.monotonic = monotonic
        self.devices: dict[str, DeviceState] = {d: DeviceState() for d in devices}
        if path is not None:
            self._load(path)

    # -- queries -------------------------------------------------------------------------------

    def tainted(self) -> dict[str, DeviceState]:
        return {name: s for name, s in self.devices.items() if s.tainted}

    def slice_taints(self, key: str) -> dict[str, list[dict[str, Any]]]:
        """The `taints` of each tainted device, as the ResourceSlice carries them."""
        return {
            name: [
                {
                    "key": key,
                    "value": s.cause,
                    "effect": s.effect.api,
                    "timeAdded": rfc3339(s.time_added),
                }
            ]
            for name, s in self.tainted().items()
        }

    # -- transitions (each returns whether the taints changed) ---------------------------------

    def record(self, device: str, verdict: Verdict, message: str = "") -> bool:
        """A problem on the device: taint it (or keep the stronger taint), and restart its hold-down."""
        state = self.devices.get(device)
        if state is None or not verdict.taints:
            return False
        state.healthy_since = None
        if state.tainted and (state.forced or state.effect >= verdict.effect):
            return False
        if not state.tainted:
            now = self.wall()
            flapping = state.cleared_at is not None and now - state.cleared_at < self.hold.flap_window
            state.hold_down = (
                min(max(state.hold_down, self.hold.initial) * 2, self.hold.maximum)
                if flapping
                else self.hold.initial
            )
            state.time_added = now
        state.cause, state.effect, state.message = verdict.cause, verdict.effect, message
        self._save()
        return True

    def unhealthy(self, device: str) -> None:
        """A failed check (lost, recovery action pending): the hold-down has to start again."""
        state = self.devices.get(device)
        if state is not None:
            state.healthy_since = None

    def healthy(self, device: str) -> None:
        state = self.devices.get(device)
        if state is not None and state.healthy_since is None:
            state.healthy_since = self.monotonic()

    def expire(self) -> list[str]:
        """Clear the taints whose device has been healthy for its hold-down; returns those devices."""
        now = self.monotonic()
        cleared = []
        for name, s in self.devices.items():
            if (
                s.tainted
                and not s.forced
                and s.healthy_since is not None
                and now - s.healthy_since >= s.hold_down
            ):
                s.cause, s.effect, s.message = None, Effect.NONE, ""
                s.cleared_at = self.wall()
                cleared.append(name)
        if cleared:
            self._save()
        return cleared

    def force(self, device: str, effect: Effect, cause: str = OPERATOR_CAUSE) -> None:
        """An operator's taint: kept until the operator clears it."""
        state = self._known(device)
        state.cause, state.effect, state.forced = cause, effect, True
        state.time_added, state.message = self.wall(), f"tainted by an operator: {cause}"
        state.healthy_since = None
        self._save()

    def clear(self, device: str) -> bool:
        """An operator's clear: the taint goes now, forced or not; the hold-down starts afresh."""
        state = self._known(device)
        was = state.tainted
        state.cause, state.effect, state.forced, state.message = None, Effect.NONE, False, ""
        state.cleared_at, state.hold_down = None, self.hold.initial
        self._save()
        return was

    def _known(self, device: str) -> DeviceState:
        state = self.devices.get(device)
        if state is None:
            raise KeyError(
                f"device {device!r} is not published by this node (known: {', '.join(self.devices)})"
            )
        return state

    # -- persistence ---------------------------------------------------------------------------

    def _save(self) -> None:
        if self.path is None:
            return
        devices = {
            name: {
                "cause": s.cause,
                "effect": s.effect.api,
                "timeAdded": s.time_added,
                "forced": s.forced,
                "holdDown": s.hold_down,
                "clearedAt": s.cleared_at,
                "message": s.message,
            }
            for name, s in self.devices.items()
            if s.tainted or s.cleared_at is not None
        }
        data = {"version": FORMAT_VERSION, "devices": devices}
        replace_durably(self.path, json.dumps(data, indent=1, sort_keys=True).encode())

    def _load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.error("health state %s unreadable, starting without taints error=%r", path, str(exc))
            return
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            log.error("health state %s: field version: %r is not %d; ignored", path, data, FORMAT_VERSION)
            return
        effects = {e.api: e for e in Effect}
        for name, raw in (data.get("devices") or {}).items():
            state = self.devices.get(name)
            if state is None:
                log.warning("health state %s: device %s is no longer on the node; dropped", path, name)
                continue
            try:
                state.cause = raw["cause"]
                state.effect = effects[raw["effect"]]
                state.time_added = float(raw["timeAdded"])
                state.forced = bool(raw.get("forced", False))
                state.hold_down = float(raw.get("holdDown", self.hold.initial))
                state.cleared_at = None if raw.get("clearedAt") is None else float(raw["clearedAt"])
                state.message = str(raw.get("message", ""))
            except (KeyError, TypeError, ValueError) as exc:
                log.error("health state %s: devices.%s: %r; device left untainted", path, name, str(exc))
                self.devices[name] = DeviceState()
        if self.tainted():
            log.info(
                "health state restored tainted=%s",
                ",".join(f"{n}={s.cause}:{s.effect.api}" for n, s in self.tainted().items()),
            )
