"""Prepare, bind and unprepare claims: the order in which a claim's plan is carried out.

The rooms it orchestrates: plan (allocation -> ClaimPlan, no side effects), journal (the only
writer of the checkpoint and the CDI specs), claim_mig (dynamic MIG instances made and destroyed
on record), claim_sharing (MPS daemons and compute modes) and reconcile (a corrupt checkpoint's
rebuild, the start-up reconcile and the stale-claim sweeper).

Calls for different claims run concurrently; calls for one claim are serialized by a per-claim
lock. Checks that look across claims (a device held by another claim) and checkpoint stages run
under the journal's state lock, so two claims can never both be prepared with the same device.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from dra_gpu.common import failpoints
from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.model.inventory import MigDevice
from dra_gpu.node.catalog import DeviceCatalog
from dra_gpu.plugin.allocation import Allocation
from dra_gpu.plugin.cdi import CdiSpecs
from dra_gpu.plugin.checkpoint import Checkpoint
from dra_gpu.plugin.claim_mig import ClaimMig, planned_steps
from dra_gpu.plugin.claim_sharing import ClaimSharing
from dra_gpu.plugin.device_metadata import DeviceMetadata, MetadataWriteError, pod_claim_name
from dra_gpu.plugin.device_nodes import DeviceNodes
from dra_gpu.plugin.driver_files import DriverFiles
from dra_gpu.plugin.journal import Journal
from dra_gpu.plugin.mig_lifecycle import MigError, MigInstances
from dra_gpu.plugin.plan import BusyPrepareError, ClaimPlan, Planner, PrepareError
from dra_gpu.plugin.reconcile import API_DEADLINE, ClaimLister, ClaimSource, Reconciler
from dra_gpu.plugin.record import ClaimRecord, ClaimState, PreparedDevice
from dra_gpu.plugin.sharing import Sharing, with_pods

log = logging.getLogger(__name__)

STARTED, BOUND, COMPLETED = ClaimState.STARTED, ClaimState.BOUND, ClaimState.COMPLETED


def _metadata_failed(ref: ClaimRef, exc: MetadataWriteError) -> str:
    return (
        f"claim {ref}: cannot write its device metadata (KEP-5304): {exc}; the prepare was rolled "
        "back (the kubelet retries it; --device-metadata=off stops writing it)"
    )


async def _together(*steps: Awaitable[Any]) -> None:
    """Run steps concurrently and wait for all of them, then raise the first failure (a roll-back
    must not race a write still in flight)."""
    for outcome in await asyncio.gather(*steps, return_exceptions=True):
        if isinstance(outcome, BaseException):
            raise outcome


class Preparer:
    def __init__(
        self,
        driver: str,
        node_name: str,
        catalog: DeviceCatalog,
        checkpoint: Checkpoint,
        cdi: CdiSpecs,
        nodes: DeviceNodes,
        claims: ClaimSource,
        driver_files: DriverFiles,
        sharing: Sharing | None = None,
        mig: MigInstances | None = None,
        device_metadata: bool = False,
    ) -> None:
        """`device_metadata`: write KEP-5304 device metadata for the claims prepared from now on
        (dra_gpu.plugin.device_metadata; in the plugin's directory, the checkpoint's)."""
        self.driver = driver
        self.node_name = node_name
        self.checkpoint = checkpoint
        self.cdi = cdi
        self.sharing = sharing  # None: sharing strategies other than Exclusive are refused
        self.mig = mig
        self.metadata = DeviceMetadata(driver, checkpoint.path.parent, cdi.dir, catalog, device_metadata)
        self.planner = Planner(driver, node_name, catalog, cdi, nodes, driver_files, sharing, self.metadata)
        if self.planner.placements and mig is None:
            raise ValueError("dynamic MIG needs NVML's MIG calls (MigInstances)")
        self.journal = Journal(checkpoint, cdi, self.metadata)
        self.instances = ClaimMig(self.journal, mig, self.planner.placements, self.planner.dynamic_gpus)
        self.claim_sharing = ClaimSharing(self.journal, sharing)
        self.reconciler = Reconciler(
            self.journal, self.planner, self.instances, self.claim_sharing, driver_files, claims, self
        )
        self._claim_locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    # The claim source and the driver's files are shared with the rooms that read them.
    @property
    def claims(self) -> ClaimSource:
        return self.reconciler.claims

    @claims.setter
    def claims(self, claims: ClaimSource) -> None:
        self.reconciler.claims = claims

    @property
    def driver_files(self) -> DriverFiles:
        return self.planner.driver_files

    @driver_files.setter
    def driver_files(self, files: DriverFiles) -> None:
        self.planner.driver_files = self.reconciler.driver_files = files

    @contextlib.asynccontextmanager
    async def _lock(self, uid: str) -> AsyncIterator[None]:
        """Serialises calls for one claim; the lock is dropped when nobody holds or waits."""
        lock, users = self._claim_locks.setdefault(uid, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._claim_locks[uid]

    def prepared_device_count(self) -> int:
        return sum(len(r.devices) for r in self.journal.records() if r.state == COMPLETED)

    def reconcile(self) -> dict[str, int]:
        """Make the CDI directory agree with the checkpoint (run before serving)."""
        return self.reconciler.reconcile()

    async def rebuild(self, lister: ClaimLister, deadline: float = API_DEADLINE) -> dict[str, int]:
        """Rebuild a corrupt checkpoint's records from the CDI specs and the API (before serving)."""
        return await self.reconciler.rebuild(lister, deadline)

    async def sweep(self, grace_seconds: float, now: Callable[[], float] = time.monotonic) -> list[ClaimRef]:
        """Unprepare claims whose ResourceClaim has been gone (or replaced) for `grace_seconds`."""
        return await self.reconciler.sweep(grace_seconds, now)

    def _started(self, ref: ClaimRef, plan: ClaimPlan) -> ClaimRecord:
        return plan.record(ref, STARTED, self.driver_files.digest, planned_steps(plan.targets))

    async def _stage(self, record: ClaimRecord) -> None:
        async with self.journal.state_lock:
            self.journal.stage(record.uid, record)

    # -- prepare -------------------------------------------------------------------------------

    async def prepare(self, ref: ClaimRef, claim: Mapping[str, Any]) -> list[PreparedDevice]:
        """`claim`: the ResourceClaim as the kubelet-plugin layer read it, its UID the kubelet's."""
        async with self._lock(ref.uid):
            record = self.journal.get(ref.uid)  # records are frozen: no copy
            if record is not None and record.state == COMPLETED:
                await self.claim_sharing.ensure(ref, record)
                return list(record.devices)  # idempotent: no writes
            allocation = self.planner.allocation(ref, claim)
            pod_claim = pod_claim_name(claim)
            if record is not None and record.state == BOUND:
                done = await self._complete_bound(ref, allocation, record, pod_claim)
                if done is not None:
                    return done
                record = None  # rolled back: the allocation no longer matches what was made
            plan = self.planner.plan(ref, allocation, {}, pod_claim)
            # Who reserves it, next to a driver-held memory limit: check_free refuses a pod that
            # would get two claims held to different sizes.
            plan.sharing.record = with_pods(plan.sharing.record, claim)
            if record is not None and record.mig_steps:
                await self.instances.destroy(record)  # an earlier partial attempt's instances
            entry = self._started(ref, plan).evolve(sharing=plan.sharing.record or None)
            await self._release_stale_holders(ref, plan)
            async with self.journal.state_lock:
                if record is not None and record.state == STARTED:
                    await self.journal.remove_spec(ref.uid)  # an earlier partial attempt
                    await self.journal.remove_metadata(record)
                    await self.claim_sharing.release(ref, record.sharing, strict=False)
                self.journal.check_free(ref, plan.exclusive, plan.sharing.record)
                self.journal.stage(ref.uid, entry)
            applied: dict[str, Any] | None = None
            try:
                if plan.targets:
                    # "planned" is durable before NVML makes anything: a restart then knows
                    # which placement to look at.
                    await self.journal.commit()
                    created, entry = await self.instances.create(ref, entry, plan.targets)
                    plan = self.planner.plan(ref, allocation, created, pod_claim)
                    plan.sharing.record = with_pods(plan.sharing.record, claim)
                    # The made MIG devices' sharing (their UUIDs are known only now).
                    entry = entry.evolve(cdi_spec=plan.spec, sharing=plan.sharing.record or None)
                    async with self.journal.state_lock:
                        self.journal.check_free(ref, plan.exclusive, plan.sharing.record)
                        self.journal.stage(ref.uid, entry)
                assert plan.spec is not None
                composed = self.cdi.encode_composed(plan.spec, plan.driver_edits)
                if plan.sharing.record:
                    # "started" is durable before a daemon starts: only the record finds one a
                    # crash left half made. It and the spec may land in either order: a spec
                    # without a completed record is removed by the start-up reconciliation.
                    await _together(
                        self.journal.commit_then(failpoints.PREPARE_AFTER_STARTED),
                        self.journal.write_spec(ref.uid, composed),
                        self.journal.write_metadata(entry),
                    )
                    applied = await self.claim_sharing.apply(ref, plan.sharing.record)
                    entry = entry.evolve(sharing=applied)
                    await self._stage(entry.evolve(state=COMPLETED))
                    await self.journal.commit()
                else:
                    # Nothing but the spec is made (MIG instances are durable step by step in
                    # claim_mig): "started" held the devices in memory, and "completed" is
                    # written together with the spec, one durable round instead of two.
                    # Either may land first: the start-up reconciliation removes a spec that no
                    # completed record owns and rebuilds a completed claim's spec from its record.
                    failpoints.hit(failpoints.PREPARE_AFTER_STARTED)
                    await self._stage(entry.evolve(state=COMPLETED))
                    await _together(
                        self.journal.commit(),
                        self.journal.write_spec(ref.uid, composed),
                        self.journal.write_metadata(entry),
                    )
                failpoints.hit(failpoints.PREPARE_AFTER_COMPLETED)
            except BaseException as exc:
                if applied is not None:
                    await self.claim_sharing.release(ref, applied, strict=False)
                try:
                    await self._roll_back(ref.uid)
                except PrepareError as undo:
                    log.error("claim could not be rolled back claim=%s error=%s", ref, undo)
                if isinstance(exc, MigError):
                    raise PrepareError(f"claim {ref}: {exc}; nothing was left behind") from exc
                if isinstance(exc, MetadataWriteError):
                    raise PrepareError(_metadata_failed(ref, exc)) from exc
                if isinstance(exc, OSError):
                    raise PrepareError(f"claim {ref}: cannot write CDI spec or record: {exc}") from exc
                raise
            log.info(
                "claim prepared claim=%s/%s uid=%s devices=%s",
                ref.namespace,
                ref.name,
                ref.uid,
                ",".join(d.device_name for d in plan.devices),
            )
            return list(plan.devices)

    async def _complete_bound(
        self, ref: ClaimRef, allocation: Allocation, record: ClaimRecord, pod_claim: str | None
    ) -> list[PreparedDevice] | None:
        """Prepare a claim whose instances were made at binding: the spec, then `completed`.
        None (after a rollback) when the allocation asks for devices that were not made."""
        plan = self.planner.plan(ref, allocation, self.instances.made(record), pod_claim)
        if plan.targets or plan.spec is None:
            log.warning("claim's allocation changed since binding, rolled back claim=%s", ref)
            await self._roll_back(ref.uid)
            return None
        entry = record.evolve(
            devices=plan.devices,
            cdi_spec=plan.spec,
            driver_files=self.driver_files.digest,
            sharing=None,
            metadata=plan.metadata,
        )
        applied: dict[str, Any] | None = None
        try:
            if plan.sharing.record:
                async with self.journal.state_lock:
                    self.journal.check_free(ref, plan.exclusive, plan.sharing.record)
                    # on record before any daemon starts, so a restart knows what to undo
                    self.journal.stage(ref.uid, entry.evolve(sharing=plan.sharing.record))
                await self.journal.commit()
            await _together(
                self.journal.write_spec(ref.uid, self.cdi.encode_composed(plan.spec, plan.driver_edits)),
                self.journal.write_metadata(entry),
            )
            if plan.sharing.record:
                applied = await self.claim_sharing.apply(ref, plan.sharing.record)
                entry = entry.evolve(sharing=applied)
            await self._stage(entry.evolve(state=COMPLETED))
            await self.journal.commit()
            failpoints.hit(failpoints.PREPARE_AFTER_COMPLETED)
        except (OSError, PrepareError) as exc:
            if applied is not None:
                await self.claim_sharing.release(ref, applied, strict=False)
            await self.journal.remove_spec(ref.uid)
            await self.journal.remove_metadata(entry)
            if plan.sharing.record:  # back to the bound record: nothing of its sharing is left
                await self._stage(entry.evolve(sharing=None))
                with contextlib.suppress(OSError):
                    await self.journal.commit()
            if isinstance(exc, PrepareError):
                raise
            if isinstance(exc, MetadataWriteError):
                raise PrepareError(_metadata_failed(ref, exc)) from exc
            raise PrepareError(f"claim {ref}: cannot write CDI spec or record: {exc}") from exc
        log.info("claim prepared claim=%s devices=%s", ref, ",".join(d.device_name for d in plan.devices))
        return list(plan.devices)

    # -- bind (dynamic MIG's binding conditions) -------------------------------------------------

    async def bind(self, ref: ClaimRef, claim: dict[str, Any]) -> dict[str, MigDevice]:
        """Make a claim's dynamic MIG instances before its pod is bound (the devices' binding
        conditions), recorded as `bound`; prepare then only writes the spec. Idempotent: made
        instances are returned as they are. Failures leave nothing behind (PrepareError)."""
        async with self._lock(ref.uid):
            record = self.journal.get(ref.uid)
            if record is not None and record.settled:
                return self.instances.made(record)
            plan = self.planner.plan(ref, self.planner.allocation(ref, claim), {}, pod_claim_name(claim))
            if not plan.targets:
                return {}
            if record is not None and record.mig_steps:
                await self.instances.destroy(record)  # an earlier partial attempt's instances
            entry = self._started(ref, plan)
            async with self.journal.state_lock:
                self.journal.check_free(ref, plan.exclusive, {})  # sharing is applied at prepare
                self.journal.stage(ref.uid, entry)
            try:
                await self.journal.commit()
                created, entry = await self.instances.create(ref, entry, plan.targets)
                await self._stage(entry.evolve(state=BOUND))
                await self.journal.commit()
            except BaseException as exc:
                try:
                    await self._roll_back(ref.uid)
                except PrepareError as undo:
                    log.error("claim could not be rolled back claim=%s error=%s", ref, undo)
                if isinstance(exc, MigError):
                    busy = (
                        exc.nvml_error is not None
                        and "InsufficientResources" in type(exc.nvml_error).__name__
                    )
                    error = BusyPrepareError if busy else PrepareError
                    raise error(f"claim {ref}: {exc}; nothing was left behind") from exc
                if isinstance(exc, OSError):
                    raise PrepareError(f"claim {ref}: cannot write its record: {exc}") from exc
                raise
            log.info("claim's mig instances made before binding claim=%s devices=%s", ref, ",".join(created))
            return created

    def held_by_another_claim(self, ref: ClaimRef, claim: dict[str, Any]) -> bool:
        """Whether a placement the claim was allocated overlaps an instance another claim's record
        holds: one being torn down (its claim is gone before the kubelet unprepared it), so the
        scheduler already counts the slices free. Waiting a little then beats failing."""
        return bool(self._overlapping_holders(ref, claim))

    async def release_gone_holders(self, ref: ClaimRef, claim: dict[str, Any]) -> bool:
        """Unprepare each claim whose MIG instance overlaps a placement this claim was allocated
        and that the apiserver says is gone, replaced, or no longer allocated it: none of its
        containers runs any more, only the kubelet's unprepare has not come (or was lost while
        this plugin was down). True when one went, so the binding can go on at once."""
        released = False
        for other in self._overlapping_holders(ref, claim):
            made = {m.device for m in other.mig_steps}
            if other.settled and await self.reconciler.holder_gone(other, made):
                log.warning(
                    "stale claim unprepared: the scheduler allocated its MIG placement to another "
                    "claim stale=%s claim=%s",
                    other.ref(),
                    ref,
                )
                await self.unprepare(ClaimRef(other.namespace, other.uid, other.name))
                released = True
        return released

    def _overlapping_holders(self, ref: ClaimRef, claim: dict[str, Any]) -> list[ClaimRecord]:
        """The other claims whose recorded MIG instances overlap a placement this claim was allocated."""
        try:
            plan = self.planner.plan(ref, self.planner.allocation(ref, claim), {}, pod_claim_name(claim))
        except PrepareError:
            return []
        return self.instances.holders(ref.uid, plan.targets)

    # -- unprepare -----------------------------------------------------------------------------

    async def unprepare(self, ref: ClaimRef) -> None:
        async with self._lock(ref.uid):
            record = self.journal.get(ref.uid)
            if record is None:
                return  # unknown claims succeed: the kubelet may repeat itself
            await self.claim_sharing.release(ref, record.sharing)
            failpoints.hit(failpoints.UNPREPARE_AFTER_SHARING)
            try:
                await self._roll_back(ref.uid)
            except OSError as exc:
                raise PrepareError(
                    f"claim {ref}: cannot remove its CDI spec, device metadata or record: {exc}"
                ) from exc
            log.info("claim unprepared claim=%s/%s uid=%s", ref.namespace, ref.name, ref.uid)

    async def _roll_back(self, uid: str) -> None:
        """Destroy the claim's MIG instances, then remove its spec, then its record. If an instance
        or the spec cannot be removed (a read-only CDI directory) the record stays, so the device
        stays taken and the kubelet's retry or the next start tries again; never the other way
        round, which would leave a spec that no record owns while the retry says done."""
        record = self.journal.get(uid)
        if record is not None and record.mig_steps:  # else nothing to destroy: no thread hop
            await self.instances.destroy(record)
            failpoints.hit(failpoints.UNPREPARE_AFTER_INSTANCES)
        await _together(self.journal.remove_spec(uid), self.journal.remove_metadata(record))
        async with self.journal.state_lock:
            self.journal.stage(uid, None)
        await self.journal.commit()

    async def _release_stale_holders(self, ref: ClaimRef, plan: ClaimPlan) -> None:
        """Unprepare, now, a claim whose record still holds a device the scheduler allocated to
        this one although the apiserver says that claim is gone, replaced, or no longer allocated
        it: its unprepare was lost while this plugin was down. The sweeper would release it after
        its grace; until then this claim's pod could not start. A holder the apiserver still gives
        the device to, or that cannot be asked, stays, and check_free refuses as before."""
        mine = plan.exclusive
        asked: set[str] = set()
        while (held := self.journal.holder(mine, other_than=ref.uid)) is not None:
            device, other = held
            if other.uid in asked or not other.settled:
                return  # still held, or being prepared right now
            asked.add(other.uid)
            if not await self.reconciler.holder_gone(other, {device}):
                return
            log.warning(
                "stale claim unprepared: the scheduler allocated its device to another claim "
                "stale=%s device=%s claim=%s",
                other.ref(),
                device,
                ref,
            )
            await self.unprepare(ClaimRef(other.namespace, other.uid, other.name))

    async def keep_sharing(self, ref: ClaimRef) -> None:
        """The sweeper's check of a live claim: its daemons are restarted if they died, without
        waiting for the claim's next prepare (a pod's clients need the daemon now)."""
        if self.sharing is None:
            return
        async with self._lock(ref.uid):
            record = self.journal.get(ref.uid)
            if record is None or record.state != COMPLETED:
                return
            try:
                await self.claim_sharing.ensure(ref, record)
            except PrepareError as exc:
                log.error("sharing of a prepared claim not restored claim=%s error=%s", ref, exc)
