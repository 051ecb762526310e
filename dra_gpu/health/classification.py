"""Which GPU events taint a device, and how hard.

Application errors (a kernel faulted, a process was killed) say nothing about the GPU: counted,
never tainted. Hardware and driver errors stop new work (`NoSchedule`). Where running work cannot
go on (the GPU fell off the bus, uncontained ECC, GPU lost) the pods must go too (`NoExecute`).
The table is NVIDIA's XID catalog (reference/node-runtime.md §4.1) read that way; operators can
move XIDs between classes with flags / Helm values.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field


class Effect(enum.IntEnum):
    """Taint effects, ordered by severity so that the stronger one wins."""

    NONE = 0
    NO_SCHEDULE = 1
    NO_EXECUTE = 2

    @property
    def api(self) -> str:
        return {Effect.NONE: "None", Effect.NO_SCHEDULE: "NoSchedule", Effect.NO_EXECUTE: "NoExecute"}[self]


class EventKind(enum.Enum):
    XID = "xid"
    DOUBLE_BIT_ECC = "ecc-dbe"
    GPU_LOST = "gpu-lost"
    GPU_UNAVAILABLE = "gpu-unavailable"
    RECOVERY_ACTION = "recovery-action"


# Application XIDs: the application's own fault; the GPU stays healthy (NVIDIA's skip list).
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
# XIDs after which running work cannot continue on the GPU.
FATAL_XIDS = frozenset({79, 95, 140})
# NVML's "unknown XID" value.
UNKNOWN_XID = 999


@dataclass(frozen=True)
class Verdict:
    """What an event does to a device: the taint effect and the cause (the taint's value)."""

    effect: Effect
    cause: str

    @property
    def taints(self) -> bool:
        return self.effect is not Effect.NONE


@dataclass(frozen=True)
class Classifier:
    """The classification table with the operator's overrides applied."""

    application_xids: frozenset[int] = APPLICATION_XIDS
    fatal_xids: frozenset[int] = FATAL_XIDS
    extra_no_schedule: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def with_overrides(
        cls,
        ignore_xids: Iterable[int] = (),
        no_execute_xids: Iterable[int] = (),
        no_schedule_xids: Iterable[int] = (),
    ) -> Classifier:
        """Defaults plus the operator's lists. An operator's list beats the defaults; between the
        operator's lists the stronger effect wins (NoExecute > NoSchedule > ignore)."""
        ne, ns, ig = set(no_execute_xids), set(no_schedule_xids), set(ignore_xids)
        no_execute = (FATAL_XIDS - ig - ns) | ne
        no_schedule = ns - ne
        ignored = (APPLICATION_XIDS | ig) - ne - ns
        return cls(frozenset(ignored), frozenset(no_execute), frozenset(no_schedule))

    def classify(self, kind: EventKind, xid: int = 0) -> Verdict:
        if kind is EventKind.XID:
            if xid in self.fatal_xids:
                return Verdict(Effect.NO_EXECUTE, f"xid-{xid}")
            if xid in self.application_xids:
                return Verdict(Effect.NONE, f"xid-{xid}")
            return Verdict(Effect.NO_SCHEDULE, "xid-unknown" if xid == UNKNOWN_XID else f"xid-{xid}")
        if kind is EventKind.DOUBLE_BIT_ECC:
            # An uncorrectable ECC error: memory contents are wrong, running work cannot trust it.
            return Verdict(Effect.NO_EXECUTE, "ecc-dbe")
        if kind in (EventKind.GPU_LOST, EventKind.GPU_UNAVAILABLE):
            return Verdict(Effect.NO_EXECUTE, kind.value)
        return Verdict(Effect.NO_SCHEDULE, kind.value)

    def table(self) -> list[tuple[str, str]]:
        """(events, effect) rows, for the documentation and `dra-gpu health classes`."""
        ign = ", ".join(map(str, sorted(self.application_xids)))
        fatal = ", ".join(map(str, sorted(self.fatal_xids)))
        rows = [
            (f"XID {ign} (application errors)", "none (counted)"),
            (f"XID {fatal}; double-bit ECC; GPU lost / unavailable", "NoExecute"),
        ]
        extra = ", ".join(map(str, sorted(self.extra_no_schedule)))
        rows.append(
            (f"any other XID{' (incl. ' + extra + ')' if extra else ''}; recovery action", "NoSchedule")
        )
        return rows


def parse_xids(text: str, what: str) -> list[int]:
    """A comma-separated XID list from a flag or env var; errors name the flag."""
    out = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        if not part.isdigit():
            raise ValueError(f"{what}: {part!r} is not an XID number (comma-separated integers)")
        out.append(int(part))
    return out
