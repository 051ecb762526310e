"""The plugin's state made to agree with itself and with the API: the rebuild of a corrupt
checkpoint and the start-up reconcile (before serving), the stale-claim sweeper (while serving).

The rebuild runs when the checkpoint was found corrupt. Without it, the plugin had no records,
and the start-up reconcile then deleted the CDI spec of every claim still running ("owned by no
claim"): a container restarted in such a pod could not get its devices, and the plugin no longer
knew which devices were held. What survives the file is enough to rebuild it:

- the CDI specs on disk name the claims this node prepared (the UID is in the file name);
- the ResourceClaims in the API allocated to this node say what each claim holds (its namespace,
  name, devices and configs), so each record is planned again exactly as prepare planned it;
- dynamic MIG instances are found on the GPU at the allocated placements; MPS daemons are
  recorded under the ids prepare gives them, and the reconcile then re-adopts the running ones.

A spec is trusted only when the API confirms its claim (same UID, allocated here): such a claim
is recorded `completed`, so its spec and sharing are kept. A spec whose claim the API no longer
has is left to the reconcile, which removes it as before. A claim allocated here with made MIG
instances and no spec yet is recorded `bound`, so its instances are not taken for orphans.
The API is asked with retries; if it never answers, the plugin exits (CheckpointRebuildError)
with the rebuild still marked pending, and nothing on disk has been removed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from tenacity import AsyncRetrying, RetryError, stop_after_delay, wait_exponential, wait_random

from dra_gpu.health.node import STATE_FILE as HEALTH_STATE_FILE
from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.plugin.allocation import Allocation
from dra_gpu.plugin.checkpoint import CheckpointRebuildError
from dra_gpu.plugin.claim_mig import ClaimMig
from dra_gpu.plugin.claim_sharing import ClaimSharing, as_applied
from dra_gpu.plugin.device_metadata import pod_claim_name
from dra_gpu.plugin.driver_files import DriverFiles, DriverInstallationError
from dra_gpu.plugin.journal import Journal
from dra_gpu.plugin.mig_lifecycle import MigError
from dra_gpu.plugin.plan import Planner, PrepareError
from dra_gpu.plugin.record import ClaimRecord, ClaimState

log = logging.getLogger(__name__)

API_DEADLINE = 120.0  # seconds of the rebuild's retries before the plugin gives up (and restarts)


class ClaimSource(Protocol):
    async def get_claim(self, namespace: str, name: str) -> dict[str, Any] | None: ...


class ClaimLister(Protocol):
    async def list_claims(
        self, keep: Callable[[dict[str, Any]], bool] | None = None
    ) -> list[dict[str, Any]]: ...


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

    # -- before serving: a corrupt checkpoint's records ------------------------------------------

    async def rebuild(self, lister: ClaimLister, deadline: float = API_DEADLINE) -> dict[str, int]:
        """Rebuild the records of a checkpoint marked `rebuildPending`; counts of what was done."""
        try:
            async for attempt in AsyncRetrying(
                wait=wait_exponential(multiplier=0.5, max=10) + wait_random(0, 0.5),
                stop=stop_after_delay(deadline),
                reraise=False,
            ):
                with attempt:
                    claims = await lister.list_claims(keep=self._allocated_here)
        except RetryError as exc:
            error = exc.last_attempt.exception()
            raise CheckpointRebuildError(
                f"the checkpoint was corrupt and its records cannot be rebuilt: listing ResourceClaims "
                f"failed for {deadline:.0f}s ({error}); nothing was removed, the next start tries again"
            ) from exc
        return await asyncio.to_thread(self._rebuild_from, claims)  # files and NVML: blocking

    def _allocated_here(self, claim: dict[str, Any]) -> bool:
        """Kept of the list (the others are dropped as it is decoded): this node's claims."""
        return bool(
            (claim.get("metadata") or {}).get("uid")
            and Allocation.of(claim).results_for(self.planner.driver, self.planner.node_name)
        )

    def _rebuild_from(self, claims: list[dict[str, Any]]) -> dict[str, int]:
        counts = {"rebuiltClaims": 0, "rebuiltBound": 0, "specsUnconfirmed": 0, "notRebuilt": 0}
        here = {str(c["metadata"]["uid"]): c for c in claims if self._allocated_here(c)}
        specs = self.journal.cdi.owned()
        # The claims whose containers were given device metadata: theirs is kept whatever the flag.
        with_metadata = self.journal.metadata.claims_with_specs()
        for uid in sorted(set(specs) | set(here)):
            claim = here.get(uid)
            if claim is None:
                counts["specsUnconfirmed"] += 1
                log.warning("CDI spec of a claim the API no longer allocates here, not rebuilt uid=%s", uid)
                continue
            meta = claim["metadata"]
            ref = ClaimRef(str(meta.get("namespace", "")), uid, str(meta.get("name", "")))
            try:
                state = self._rebuild_claim(
                    ref, claim, has_spec=uid in specs, with_metadata=uid in with_metadata
                )
            except (PrepareError, MigError) as exc:
                counts["notRebuilt"] += 1
                log.error("claim's record could not be rebuilt claim=%s error=%s", ref, exc)
                continue
            if state == ClaimState.COMPLETED:
                counts["rebuiltClaims"] += 1
            elif state == ClaimState.BOUND:
                counts["rebuiltBound"] += 1
        self.journal.rebuilt()
        summary = " ".join(f"{k}={v}" for k, v in counts.items())
        log.warning("checkpoint rebuilt from the CDI specs and the API %s", summary)
        return counts

    def _rebuild_claim(
        self, ref: ClaimRef, claim: dict[str, Any], has_spec: bool, with_metadata: bool = False
    ) -> str | None:
        """Stage the claim's record as prepare would have written it; the state recorded, or None.
        `with_metadata`: its device metadata's CDI specs are there (the kubelet has their IDs)."""
        wanted = self.planner.placements_of(Allocation.of(claim))
        made = self.mig.found_on_gpu(wanted)
        if not has_spec and (not wanted or len(made) < len(wanted)):
            return None  # not prepared here: the kubelet prepares it when it needs it
        if len(made) < len(wanted):
            raise PrepareError(f"{len(wanted) - len(made)} of its MIG instances are not on the GPU any more")
        plan = self.planner.plan(
            ref,
            self.planner.allocation(ref, claim),
            made,
            pod_claim_name(claim),
            with_metadata=with_metadata and has_spec,
        )
        if plan.targets or plan.spec is None:
            raise PrepareError("its allocation names devices that do not exist")
        state = ClaimState.COMPLETED if has_spec else ClaimState.BOUND
        record = plan.record(ref, state, self.driver_files.digest, self.mig.ready_steps(made))
        record = record.evolve(
            cdi_spec=plan.spec if has_spec else None,
            sharing=as_applied(plan.sharing.record) if has_spec and plan.sharing.record else None,
            rebuilt=True,  # for the operator: this record came from the specs and the API
        )
        self.journal.check_free(ref, plan.exclusive, plan.sharing.record if has_spec else {})
        self.journal.stage_rebuilt(record)
        log.warning("claim's record rebuilt claim=%s state=%s devices=%s", ref, state, len(plan.devices))
        return str(state)

    # -- start-up ------------------------------------------------------------------------------

    def reconcile(self) -> dict[str, int]:
        """Make the CDI directory agree with the checkpoint (run before serving)."""
        counts = {"rolledBack": 0, "rebuilt": 0, "removed": 0}
        # First the temp files of writes a kill interrupted (the plugin's own naming only): nothing
        # else removes them, and no write of this plugin can be under way yet.
        stale = self.journal.remove_stale_temps((HEALTH_STATE_FILE,))
        if stale:
            counts["tempsRemoved"] = len(stale)
            log.warning(
                "temp files of writes a kill interrupted removed files=%s", ",".join(str(p) for p in stale)
            )
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
        # Device metadata: a completed claim's as its record makes it, the rest removed.
        counts.update(self.journal.metadata.reconcile_now(records.values()))
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
        # A record without `driverFiles` (written before the driver's part left the checkpoint,
        # pre-release) carries the whole spec, the driver's files included: added again they
        # would be mounted twice.
        want = cdi.compose(rec.cdi_spec, driver_edits if rec.driver_files is not None else {})
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
