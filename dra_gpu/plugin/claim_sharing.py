"""A claim's sharing as the plugin carries it out: applied at prepare, kept alive, undone at
unprepare, re-adopted or undone at start-up (dra_gpu.plugin.sharing does the work on the GPU).

Each call passes the other claims' sharing records, which the journal holds, so that a compute
mode another claim still needs is not restored.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.plugin.compute_mode import DEFAULT
from dra_gpu.plugin.journal import Journal
from dra_gpu.plugin.plan import PrepareError
from dra_gpu.plugin.record import ClaimRecord, ClaimState
from dra_gpu.plugin.sharing import Sharing, SharingError

log = logging.getLogger(__name__)


def with_previous_modes(sharing: dict[str, Any]) -> dict[str, Any]:
    """A half-prepared claim's sharing record is its plan: a compute mode it may have set before
    the crash has no `previous` on record, and would stay set. DEFAULT is what a GPU has after
    boot and what the driver leaves it in, so that is restored (unless another claim holds it)."""
    modes = sharing.get("computeModes") or {}
    if all("previous" in m for m in modes.values()):
        return sharing
    fixed = {u: m if "previous" in m else {**m, "previous": DEFAULT} for u, m in modes.items()}
    return {**sharing, "computeModes": fixed}


def as_applied(record: dict[str, Any]) -> dict[str, Any]:
    """A planned sharing record as apply() leaves it, when what a compute mode was before is not
    known any more (a rebuilt record): DEFAULT, the driver's own default, is restored."""
    out = dict(record)
    modes = out.get("computeModes")
    if modes:
        out["computeModes"] = {uuid: {**m, "previous": DEFAULT} for uuid, m in modes.items()}
    return out


class ClaimSharing:
    def __init__(self, journal: Journal, sharing: Sharing | None) -> None:
        self.journal = journal
        self.sharing = sharing

    async def apply(self, ref: ClaimRef, record: dict[str, Any]) -> dict[str, Any]:
        assert self.sharing is not None
        try:
            others = self.journal.other_sharing(ref.uid)
            return await asyncio.to_thread(self.sharing.apply, record, others)
        except SharingError as exc:
            raise PrepareError(f"claim {ref}: sharing: {exc}") from exc

    async def ensure(self, ref: ClaimRef, record: ClaimRecord) -> None:
        """A prepared claim's daemons answer before prepare returns (restarted if they died)."""
        if self.sharing is None or not record.sharing:
            return
        try:
            await asyncio.to_thread(self.sharing.ensure, record.sharing)
        except SharingError as exc:
            raise PrepareError(f"claim {ref}: sharing: {exc}") from exc

    async def release(self, ref: ClaimRef, sharing: dict[str, Any] | None, strict: bool = True) -> None:
        if self.sharing is None or not sharing:
            return
        try:
            await asyncio.to_thread(self.sharing.release, sharing, self.journal.other_sharing(ref.uid))
        except SharingError as exc:
            if strict:
                raise PrepareError(f"claim {ref}: cannot undo its sharing: {exc}") from exc
            log.error("sharing of a claim not fully undone claim=%s error=%s", ref, exc)

    def reconcile(self, rec: ClaimRecord, counts: dict[str, int]) -> None:
        """Re-adopt a prepared claim's daemons (restarting dead ones); undo a half-prepared one's."""
        if self.sharing is None or not rec.sharing:
            return
        try:
            if rec.state == ClaimState.COMPLETED:
                restarted = self.sharing.ensure(rec.sharing)
                if restarted:
                    counts["daemonsRestarted"] = counts.get("daemonsRestarted", 0) + restarted
                log.info(
                    "MPS daemons of a prepared claim re-adopted claim=%s restarted=%d", rec.ref(), restarted
                )
            else:
                others = self.journal.other_sharing(rec.uid)
                self.sharing.release(with_previous_modes(rec.sharing), others)
        except SharingError as exc:
            log.error("sharing of claim not reconciled claim=%s error=%s", rec.ref(), exc)

    def stop_orphan_daemons(self) -> list[str]:
        if self.sharing is None:
            return []
        owned: set[str] = set()
        for rec in self.journal.records():
            if rec.sharing:
                owned |= self.sharing.daemon_ids(rec.sharing)
        return self.sharing.stop_orphans(owned)
