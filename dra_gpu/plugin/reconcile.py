"""The plugin's state made to agree with itself and with the API: the start-up reconcile (before
serving) and the stale-claim sweeper (while serving). The rebuild of a corrupt checkpoint is
rebuild.py, which plans claims through the same planner.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.plugin.claim_mig import ClaimMig
from dra_gpu.plugin.claim_sharing import ClaimSharing
from dra_gpu.plugin.driver_files import DriverFiles, DriverInstallationError
from dra_gpu.plugin.journal import Journal
from dra_gpu.plugin.mig_lifecycle import MigError
from dra_gpu.plugin.plan import Planner
from dra_gpu.plugin.record import ClaimRecord, ClaimState

log = logging.getLogger(__name__)


class ClaimSource(Protocol):
    async def get_claim(self, namespace: str, name: str) -> dict[str, Any] | None: ...


class Claims(Protocol):
    """What the sweeper asks of the preparer: it unprepares under the claim's lock."""

    async def unprepare(self, ref: ClaimRef) -> None: ...

    async def keep_sharing(self, ref: ClaimRef) -> None: ...


class Reconciler:
    def __init__(
        self,
        journal: Journal,
        planner: Planner,
        mig: ClaimMig,
        sharing: ClaimSharing,
        driver_files: DriverFiles,
        claims: ClaimSource,
        preparer: Claims,
    ) -> None:
        self.journal = journal
        self.planner = planner
        self.mig = mig
        self.sharing = sharing
        self.driver_files = driver_files
        self.claims = claims  # the apiserver, never the watch cache: a deletion is seen as it is
        self.preparer = preparer
        self._gone_since: dict[str, float] = {}

    # -- start-up ------------------------------------------------------------------------------

    def reconcile(self) -> dict[str, int]:
        """Make the CDI directory agree with the checkpoint (run before serving)."""
        counts = {"rolledBack": 0, "rebuilt": 0, "removed": 0}
        records = {r.uid: r for r in self.journal.records()}
        for rec in list(records.values()):
            if not rec.settled:
                self.sharing.reconcile(rec, counts)
                try:
                    self.mig.destroy_now(rec)
                except MigError as exc:
                    log.error(
                        "half-prepared claim kept: its MIG instance is still there claim=%s error=%s",
                        rec.ref(),
                        exc,
                    )
                    continue
                self.journal.remove_spec_now(rec.uid)
                self.journal.forget_now(rec.uid)
                del records[rec.uid]
                counts["rolledBack"] += 1
                log.warning("claim left half-prepared, rolled back claim=%s", rec.ref())
            else:
                if rec.cdi_spec is not None:
                    self._restore_spec(rec, counts)
                self.sharing.reconcile(rec, counts)
        if self.planner.dynamic_gpus:
            counts["orphansDestroyed"] = self.mig.destroy_orphans()
        for uid in self.journal.cdi.owned():
            owner = records.get(uid)  # a bound claim has no spec yet: its file is stale too
            if (owner is None or owner.state != ClaimState.COMPLETED) and self.journal.remove_spec_now(uid):
                counts["removed"] += 1
                log.warning("CDI spec owned by no claim removed uid=%s", uid)
        if self.sharing.sharing is not None:
            stopped = len(self.sharing.stop_orphan_daemons())
            if stopped:
                counts["daemonsStopped"] = stopped
        return counts

    def _restore_spec(self, rec: ClaimRecord, counts: dict[str, int]) -> None:
        """Rewrite a completed claim's spec file unless it is what prepare wrote."""
        assert rec.cdi_spec is not None
        cdi = self.journal.cdi
        try:
            driver_edits = self.driver_files.edits()
        except DriverInstallationError as exc:
            # Without the driver's files no spec can be made; an existing one is left as it is.
            if cdi.read(rec.uid) is None:
                log.error(
                    "CDI spec of a prepared claim is missing and cannot be rebuilt claim=%s error=%s",
                    rec.ref(),
                    exc,
                )
            return
        want = cdi.compose(rec.cdi_spec, driver_edits)
        if cdi.read(rec.uid) == want:
            return
        if rec.driver_files != self.driver_files.digest:
            log.warning("the driver installation changed since the claim was prepared claim=%s", rec.ref())
        self.journal.write_spec_now(rec.uid, want)
        counts["rebuilt"] += 1
        log.warning("CDI spec of a prepared claim rebuilt claim=%s", rec.ref())

    # -- while serving -------------------------------------------------------------------------

    def allocates(self, claim: dict[str, Any] | None, rec: ClaimRecord) -> bool:
        """Whether the claim's allocation still holds every device the record made."""
        held = self.planner.allocated_here(claim or {})
        return all(m.device in held for m in rec.mig_steps)

    async def holder_gone(self, other: ClaimRecord, devices: set[str]) -> bool:
        """Whether the apiserver (a GET, not the watch cache) says the claim of `other` is gone,
        replaced, or no longer allocated `devices`. False when it cannot be asked."""
        try:
            claim = await self.claims.get_claim(other.namespace, other.name)
        except Exception as exc:  # unreachable apiserver: keep the holder, refuse as before
            log.warning("cannot ask whether claim %s still holds its devices error=%r", other.ref(), exc)
            return False
        if claim is None or claim.get("metadata", {}).get("uid") != other.uid:
            return True
        return not devices <= self.planner.allocated_here(claim)

    async def sweep(self, grace_seconds: float, now: Callable[[], float] = time.monotonic) -> list[ClaimRef]:
        """Unprepare claims whose ResourceClaim has been gone (or replaced) for `grace_seconds`."""
        swept = []
        for rec in self.journal.records():
            if not rec.settled:
                continue
            claim = await self.claims.get_claim(rec.namespace, rec.name)
            gone = claim is None or claim.get("metadata", {}).get("uid") != rec.uid
            if not gone and rec.state == ClaimState.BOUND:
                # Made for an allocation that was given up (binding failed or timed out).
                gone = not self.allocates(claim, rec)
            if not gone:
                self._gone_since.pop(rec.uid, None)
                await self.preparer.keep_sharing(ClaimRef(rec.namespace, rec.uid, rec.name))
                continue
            first = self._gone_since.setdefault(rec.uid, now())
            if now() - first >= grace_seconds:
                ref = ClaimRef(rec.namespace, rec.uid, rec.name)
                await self.preparer.unprepare(ref)
                self._gone_since.pop(rec.uid, None)
                log.warning("stale claim unprepared by the sweeper claim=%s", ref)
                swept.append(ref)
        if self.sharing.sharing is not None:
            async with self.journal.state_lock:  # a claim being prepared has its record staged first
                await asyncio.to_thread(self.sharing.stop_orphan_daemons)
        return swept
