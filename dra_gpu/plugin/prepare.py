"""Prepare and unprepare claims: allocation -> devices -> CDI spec, recorded in the checkpoint.

Calls for different claims run concurrently; calls for one claim are serialized by a per-claim
lock. Checks that look across claims (a device held by another claim) and checkpoint writes run
under one state lock, so two claims can never both be prepared with the same device.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from dra_gpu import failpoints
from dra_gpu.api import ConfigError, GpuConfig, decode
from dra_gpu.api.v1alpha1 import DEFAULT_GPU_CONFIG, DEFAULT_MIG_CONFIG
from dra_gpu.kubeletplugin.driver import ClaimError, ClaimRef
from dra_gpu.model import Gpu, Inventory, MigDevice, MigPlacement
from dra_gpu.plugin.cdi import SPEC_MODE, CdiDevice, CdiSpecs, CdiWriteError
from dra_gpu.plugin.checkpoint import BOUND, COMPLETED, STARTED, Checkpoint, ClaimRecord
from dra_gpu.plugin.claim_shape import status_problem
from dra_gpu.plugin.compute_mode import DEFAULT
from dra_gpu.plugin.device_nodes import DeviceNodeError, DeviceNodes
from dra_gpu.plugin.driver_files import DriverFiles, DriverInstallationError
from dra_gpu.plugin.mig_lifecycle import MigError, MigInstances, made_device
from dra_gpu.plugin.sharing import SharedDevice, Sharing, SharingError, SharingPlan
from dra_gpu.plugin.write_rounds import WriteRounds

log = logging.getLogger(__name__)


class PrepareError(ClaimError):
    """A claim that cannot be prepared (or unprepared); the message goes back to the kubelet."""


class BusyPrepareError(PrepareError):
    """The device, or the memory slices of its MIG placement, are held by another instance."""


class ClaimSource(Protocol):
    async def get_claim(self, namespace: str, name: str) -> dict[str, Any] | None: ...


class ClaimLookup(Protocol):
    """Claims kept current by a watch (claim_cache.ClaimCache); None means: ask the apiserver."""

    def lookup(self, ref: ClaimRef) -> dict[str, Any] | None: ...


@dataclass(frozen=True)
class PreparedDevice:
    request_names: list[str]
    pool_name: str
    device_name: str
    cdi_device_ids: list[str]
    share_id: str | None = None
    admin_access: bool = False

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "requestNames": self.request_names,
            "poolName": self.pool_name,
            "deviceName": self.device_name,
            "cdiDeviceIds": self.cdi_device_ids,
        }
        if self.share_id is not None:
            d["shareId"] = self.share_id
        if self.admin_access:
            d["adminAccess"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PreparedDevice:
        return cls(
            request_names=list(d.get("requestNames", [])),
            pool_name=d["poolName"],
            device_name=d["deviceName"],
            cdi_device_ids=list(d.get("cdiDeviceIds", [])),
            share_id=d.get("shareId"),
            admin_access=bool(d.get("adminAccess", False)),
        )


# Steps of a dynamic MIG instance in the checkpoint ("migInstances" of a claim's entry): recorded
# before each NVML call that makes something, so a restart knows what may exist.
MIG_PLANNED, MIG_GPU_INSTANCE, MIG_READY = "planned", "gpu-instance", "ready"

Target = tuple[str, Gpu, MigPlacement]  # a dynamic MIG device to create: (name, parent, placement)


def _snapshot(entry: dict[str, Any]) -> dict[str, Any]:
    """A copy of an entry still being built, for the checkpoint (which takes entries over and
    never sees them change); only the MIG step records are changed in place, so they are copied."""
    out = dict(entry)
    if "migInstances" in entry:
        out["migInstances"] = [dict(m) for m in entry["migInstances"]]
    return out


async def _together(*steps: Awaitable[Any]) -> None:
    """Run steps concurrently and wait for all of them, then raise the first failure (a roll-back
    must not race a write still in flight)."""
    for outcome in await asyncio.gather(*steps, return_exceptions=True):
        if isinstance(outcome, BaseException):
            raise outcome


def _exclusive(devices: list[PreparedDevice]) -> set[str]:
    """The devices a claim holds alone: not for admin access, not a share of a GPU."""
    return {d.device_name for d in devices if not d.admin_access and d.share_id is None}


def _with_previous_modes(sharing: dict[str, Any]) -> dict[str, Any]:
    """A half-prepared claim's sharing record is its plan: a compute mode it may have set before
    the crash has no `previous` on record, and would stay set. DEFAULT is what a GPU has after
    boot and what the driver leaves it in, so that is restored (unless another claim holds it)."""
    modes = sharing.get("computeModes") or {}
    if all("previous" in m for m in modes.values()):
        return sharing
    fixed = {u: m if "previous" in m else {**m, "previous": DEFAULT} for u, m in modes.items()}
    return {**sharing, "computeModes": fixed}


def _config_kind_for(is_mig: bool) -> str:
    return "MigDeviceConfig" if is_mig else "GpuConfig"


class Preparer:
    def __init__(
        self,
        driver: str,
        node_name: str,
        inventory: Inventory,
        checkpoint: Checkpoint,
        cdi: CdiSpecs,
        nodes: DeviceNodes,
        claims: ClaimSource,
        driver_files: DriverFiles,
        sharing: Sharing | None = None,
        mig: MigInstances | None = None,
        cache: ClaimLookup | None = None,
    ) -> None:
        self.driver = driver
        self.node_name = node_name
        self.checkpoint = checkpoint
        self.cdi = cdi
        self.nodes = nodes
        self.claims = claims
        self.cache = cache  # the prepare path's claims; the sweeper always asks the apiserver
        self.driver_files = driver_files
        self.sharing = sharing  # None: sharing strategies other than Exclusive are refused
        self.mig = mig
        self.devices: dict[str, tuple[Gpu, MigDevice | None]] = {}
        self.placements: dict[str, tuple[Gpu, MigPlacement]] = {}
        self.dynamic_gpus = [g for g in inventory.gpus if g.dynamic_mig]
        for gpu in inventory.gpus:
            if not gpu.mig_enabled or gpu.dynamic_mig:
                self.devices[gpu.device_name] = (gpu, None)
            if gpu.dynamic_mig:
                for p in gpu.mig_placements():
                    self.placements[gpu.mig_name(p.profile.name, p.start)] = (gpu, p)
            else:
                for made in gpu.mig_devices:
                    self.devices[gpu.mig_device_name(made)] = (gpu, made)
        if self.placements and mig is None:
            raise ValueError("dynamic MIG needs NVML's MIG calls (MigInstances)")
        self._claim_locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        self._state_lock = asyncio.Lock()
        # Group commit: concurrent claims share checkpoint writes (see _commit).
        self._commit_lock = asyncio.Lock()
        # The specs of concurrent claims are written and removed together (one worker-thread job
        # and one fsync of the CDI directory per round); the checkpoint's writes run beside them.
        self.spec_rounds = WriteRounds()
        self._staged = 0
        self._written = 0
        self._gone_since: dict[str, float] = {}

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

    def _stage(self, uid: str, entry: dict[str, Any] | None) -> dict[str, Any] | None:
        """Change the checkpoint in memory (call under the state lock, then `_commit`)."""
        self._staged += 1
        return self.checkpoint.stage(uid, entry)

    async def _commit(self) -> None:
        """Make everything staged so far durable. Whoever writes, writes all that is staged, so
        100 claims in flight need far fewer than 100 checkpoint writes."""
        target = self._staged
        async with self._commit_lock:
            if self._written >= target:
                return  # an earlier write already carried this change
            version = self._staged
            blob = self.checkpoint.encode()
            await asyncio.to_thread(self.checkpoint.write, blob)
            self._written = version

    async def _write_spec(self, uid: str, content: bytes) -> None:
        path = self.cdi.path(uid)
        try:
            await self.spec_rounds.write(path, content, SPEC_MODE)
        except OSError as exc:
            raise CdiWriteError(exc.errno, exc.strerror, path) from exc
        failpoints.hit(failpoints.PREPARE_AFTER_CDI_SPEC)  # the spec is written, its record maybe not

    async def _remove_spec(self, uid: str) -> bool:
        return await self.spec_rounds.remove(self.cdi.path(uid))

    async def _commit_then(self, failpoint: str) -> None:
        await self._commit()
        failpoints.hit(failpoint)

    def prepared_device_count(self) -> int:
        return sum(len(r.devices) for r in self.checkpoint.views() if r.state == COMPLETED)

    # -- prepare -------------------------------------------------------------------------------

    async def prepare(self, ref: ClaimRef) -> list[PreparedDevice]:
        async with self._lock(ref.uid):
            record = self.checkpoint.view(ref.uid)  # entries are replaced, never changed in place
            if record is not None and record.state == COMPLETED:
                await self._ensure_sharing(ref, record)
                return [PreparedDevice.from_dict(d) for d in record.devices]  # idempotent: no writes
            claim = self.cache.lookup(ref) if self.cache is not None else None
            if claim is None:
                claim = await self.claims.get_claim(ref.namespace, ref.name)
            if claim is None:
                raise PrepareError(f"ResourceClaim {ref.namespace}/{ref.name} not found")
            uid = claim.get("metadata", {}).get("uid")
            if uid != ref.uid:
                raise PrepareError(
                    f"ResourceClaim {ref.namespace}/{ref.name} got replaced: "
                    f"uid is {uid}, the kubelet asked for {ref.uid}"
                )
            if record is not None and record.state == BOUND:
                done = await self._complete_bound(ref, claim, record)
                if done is not None:
                    return done
                record = None  # rolled back: the allocation no longer matches what was made
            devices, spec, driver_edits, targets, sharing = self._plan(
                ref, claim, None if self.placements else {}
            )
            if record is not None and record.mig_instances:
                await self._destroy_recorded(record)  # an earlier partial attempt's instances
            entry = self._started_entry(ref, devices, spec, targets)
            if sharing.record:
                entry["sharing"] = sharing.record
            await self._release_stale_holders(ref, devices)
            async with self._state_lock:
                if record is not None and record.state == STARTED:
                    await self._remove_spec(ref.uid)  # an earlier partial attempt
                    await self._release_sharing(ref, record.raw, strict=False)
                self._check_conflicts(ref, devices, sharing)
                self._stage(ref.uid, _snapshot(entry))
            applied: dict[str, Any] | None = None
            try:
                if targets:
                    # "planned" is durable before NVML makes anything: a restart then knows
                    # which placement to look at.
                    await self._commit()
                    created = await self._create_instances(ref, entry, targets)
                    devices, spec, driver_edits, _, sharing = self._plan(ref, claim, created)
                    entry["cdiSpec"] = spec
                    # The made MIG devices' sharing (their UUIDs are known only now).
                    if sharing.record:
                        entry["sharing"] = sharing.record
                    else:
                        entry.pop("sharing", None)
                    async with self._state_lock:
                        self._check_conflicts(ref, devices, sharing)
                        self._stage(ref.uid, _snapshot(entry))
                assert spec is not None
                composed = self.cdi.encode_composed(spec, driver_edits)
                if sharing.record:
                    # "started" is durable before a daemon starts: only the record finds one a
                    # crash left half made. It and the spec may land in either order: a spec
                    # without a completed record is removed by the start-up reconciliation.
                    await _together(
                        self._commit_then(failpoints.PREPARE_AFTER_STARTED),
                        self._write_spec(ref.uid, composed),
                    )
                    applied = await self._apply_sharing(ref, sharing.record)
                    entry["sharing"] = applied
                    async with self._state_lock:
                        self._stage(ref.uid, {**_snapshot(entry), "state": COMPLETED})
                    await self._commit()
                else:
                    # Nothing but the spec is made (MIG instances are durable step by step in
                    # _create_instances): "started" held the devices in memory, and "completed"
                    # is written together with the spec, one durable round instead of two.
                    # Either may land first: the start-up reconciliation removes a spec that no
                    # completed record owns and rebuilds a completed claim's spec from its record.
                    failpoints.hit(failpoints.PREPARE_AFTER_STARTED)
                    async with self._state_lock:
                        self._stage(ref.uid, {**_snapshot(entry), "state": COMPLETED})
                    await _together(self._commit(), self._write_spec(ref.uid, composed))
                failpoints.hit(failpoints.PREPARE_AFTER_COMPLETED)
            except BaseException as exc:
                if applied is not None:
                    await self._release_sharing(ref, {"sharing": applied}, strict=False)
                try:
                    await self._roll_back(ref.uid)
                except PrepareError as undo:
                    log.error("claim could not be rolled back claim=%s error=%s", ref, undo)
                if isinstance(exc, MigError):
                    raise PrepareError(f"claim {ref}: {exc}; nothing was left behind") from exc
                if isinstance(exc, OSError):
                    raise PrepareError(f"claim {ref}: cannot write CDI spec or record: {exc}") from exc
                raise
            log.info(
                "claim prepared claim=%s/%s uid=%s devices=%s",
                ref.namespace,
                ref.name,
                ref.uid,
                ",".join(d.device_name for d in devices),
            )
            return devices

    async def bind(self, ref: ClaimRef, claim: dict[str, Any]) -> dict[str, MigDevice]:
        """Make a claim's dynamic MIG instances before its pod is bound (the devices' binding
        conditions), recorded as `bound`; prepare then only writes the spec. Idempotent: made
        instances are returned as they are. Failures leave nothing behind (PrepareError)."""
        async with self._lock(ref.uid):
            record = self.checkpoint.view(ref.uid)
            if record is not None and record.state in (BOUND, COMPLETED):
                return self._made(record)
            devices, _, _, targets, _ = self._plan(ref, claim, None)
            if not targets:
                return {}
            if record is not None and record.mig_instances:
                await self._destroy_recorded(record)  # an earlier partial attempt's instances
            entry = self._started_entry(ref, devices, None, targets)
            async with self._state_lock:
                self._check_conflicts(ref, devices, SharingPlan())  # sharing is applied at prepare
                self._stage(ref.uid, _snapshot(entry))
            try:
                await self._commit()
                created = await self._create_instances(ref, entry, targets)
                async with self._state_lock:
                    self._stage(ref.uid, {**_snapshot(entry), "state": BOUND})
                await self._commit()
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
            made = {str(m.get("device")) for m in other.mig_instances}
            if other.state in (COMPLETED, BOUND) and await self._holder_gone(other, made):
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
            _, _, _, targets, _ = self._plan(ref, claim, None)
        except PrepareError:
            return []
        out = []
        for other in self.checkpoint.views():
            if other.uid == ref.uid:
                continue
            if any(
                m.get("parentUUID") == gpu.uuid
                and set(range(int(m["start"]), int(m["start"]) + int(m["size"]))) & set(placement.slices)
                for m in other.mig_instances
                for _, gpu, placement in targets
            ):
                out.append(other)
        return out

    def _made(self, record: ClaimRecord) -> dict[str, MigDevice]:
        """The MIG devices a record says were made (step ready)."""
        out = {}
        for m in record.mig_instances:
            name = str(m.get("device"))
            if m.get("step") != MIG_READY or name not in self.placements:
                continue
            _, placement = self.placements[name]
            out[name] = made_device(placement, int(m["giId"]), int(m["ciId"]), str(m["uuid"]))
        return out

    async def _complete_bound(
        self, ref: ClaimRef, claim: dict[str, Any], record: ClaimRecord
    ) -> list[PreparedDevice] | None:
        """Prepare a claim whose instances were made at binding: the spec, then `completed`.
        None (after a rollback) when the allocation asks for devices that were not made."""
        devices, spec, driver_edits, targets, sharing = self._plan(ref, claim, self._made(record))
        if targets or spec is None:
            log.warning("claim's allocation changed since binding, rolled back claim=%s", ref)
            await self._roll_back(ref.uid)
            return None
        entry = {
            **_snapshot(record.raw),
            "devices": [d.to_dict() for d in devices],
            "cdiSpec": spec,
            "driverFiles": self.driver_files.digest,
        }
        entry.pop("sharing", None)
        applied: dict[str, Any] | None = None
        try:
            if sharing.record:
                async with self._state_lock:
                    self._check_conflicts(ref, devices, sharing)
                    # on record before any daemon starts, so a restart knows what to undo
                    self._stage(ref.uid, {**entry, "sharing": sharing.record})
                await self._commit()
            await self._write_spec(ref.uid, self.cdi.encode_composed(spec, driver_edits))
            if sharing.record:
                applied = await self._apply_sharing(ref, sharing.record)
                entry["sharing"] = applied
            async with self._state_lock:
                self._stage(ref.uid, {**entry, "state": COMPLETED})
            await self._commit()
            failpoints.hit(failpoints.PREPARE_AFTER_COMPLETED)
        except (OSError, PrepareError) as exc:
            if applied is not None:
                await self._release_sharing(ref, {"sharing": applied}, strict=False)
            await self._remove_spec(ref.uid)
            if sharing.record:  # back to the bound record: nothing of its sharing is left
                async with self._state_lock:
                    self._stage(ref.uid, {k: v for k, v in entry.items() if k != "sharing"})
                with contextlib.suppress(OSError):
                    await self._commit()
            if isinstance(exc, PrepareError):
                raise
            raise PrepareError(f"claim {ref}: cannot write CDI spec or record: {exc}") from exc
        log.info("claim prepared claim=%s devices=%s", ref, ",".join(d.device_name for d in devices))
        return devices

    def _started_entry(
        self, ref: ClaimRef, devices: list[PreparedDevice], spec: dict[str, Any] | None, targets: list[Target]
    ) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "state": STARTED,
            "namespace": ref.namespace,
            "name": ref.name,
            "devices": [d.to_dict() for d in devices],
            "cdiSpec": spec,  # the claim's own part; the file adds the driver's user space
            "driverFiles": self.driver_files.digest,
        }
        if targets:
            entry["migInstances"] = [
                {
                    "device": name,
                    "parentUUID": gpu.uuid,
                    "profileId": p.profile.profile_id,
                    "start": p.start,
                    "size": p.profile.memory_slices,
                    "step": MIG_PLANNED,
                }
                for name, gpu, p in targets
            ]
        return entry

    async def _create_instances(
        self, ref: ClaimRef, entry: dict[str, Any], targets: list[Target]
    ) -> dict[str, MigDevice]:
        """Make each target's GPU and compute instance, recording every step durably."""
        created: dict[str, MigDevice] = {}
        for rec, target in zip(entry["migInstances"], targets, strict=True):
            try:
                created[target[0]] = await self._create_instance(ref, entry, rec, target)
            except MigError as exc:
                raise MigError(f"device {target[0]}: {exc}", exc.nvml_error) from exc
        return created

    async def _create_instance(
        self, ref: ClaimRef, entry: dict[str, Any], rec: dict[str, Any], target: Target
    ) -> MigDevice:
        """GPU instance, its ID on record, compute instance, its ID and the MIG UUID on record."""
        assert self.mig is not None
        name, gpu, placement = target
        gi_id = await asyncio.to_thread(self.mig.create_gpu_instance, gpu.uuid, placement)
        rec.update(giId=gi_id, step=MIG_GPU_INSTANCE)
        async with self._state_lock:
            self._stage(ref.uid, _snapshot(entry))
        await self._commit()
        failpoints.hit(failpoints.MIG_AFTER_GPU_INSTANCE)
        ci_id = await asyncio.to_thread(self.mig.create_compute_instance, gpu.uuid, gi_id, placement)
        failpoints.hit(failpoints.MIG_AFTER_COMPUTE_INSTANCE)
        mig = await asyncio.to_thread(self.mig.mig_device, gpu.uuid, gi_id, ci_id, placement)
        rec.update(ciId=ci_id, uuid=mig.uuid, step=MIG_READY)
        async with self._state_lock:
            self._stage(ref.uid, _snapshot(entry))
        await self._commit()
        log.info(
            "mig instance created claim=%s device=%s gpu=%s gi=%d ci=%d uuid=%s",
            ref,
            name,
            gpu.uuid,
            gi_id,
            ci_id,
            mig.uuid,
        )
        return mig

    async def _destroy_recorded(self, record: ClaimRecord) -> None:
        try:
            await asyncio.to_thread(self.destroy_recorded, record)
        except MigError as exc:
            raise PrepareError(f"claim {record.ref()}: {exc}") from exc

    def destroy_recorded(self, record: ClaimRecord) -> None:
        """Destroy the instances a claim's entry records (last made first). An instance recorded
        as planned may exist without its ID on record: the one at that placement is it, unless
        another claim records it."""
        if not record.mig_instances:
            return
        assert self.mig is not None
        for rec in reversed(record.mig_instances):
            parent, profile_id, start = str(rec["parentUUID"]), int(rec["profileId"]), int(rec["start"])
            gi_id = rec.get("giId")
            if gi_id is None:
                others = self._recorded_gpu_instances(exclude=record.uid)
                live = self.mig.instances(parent)
                found = [
                    i
                    for i in live
                    if (i.profile_id, i.start) == (profile_id, start) and (parent, i.gi_id) not in others
                ]
                if not found:
                    continue
                gi_id = found[0].gi_id
            if self.mig.destroy(parent, int(gi_id), profile_id, start):
                log.info(
                    "mig instance of claim destroyed claim=%s device=%s gi=%s",
                    record.ref(),
                    rec["device"],
                    gi_id,
                )

    def _recorded_gpu_instances(self, exclude: str | None = None) -> set[tuple[str, int]]:
        return {
            (str(m["parentUUID"]), int(m["giId"]))
            for r in self.checkpoint.views()
            if r.uid != exclude
            for m in r.mig_instances
            if m.get("giId") is not None
        }

    async def _roll_back(self, uid: str) -> None:
        """Destroy the claim's MIG instances, then remove its spec, then its record. If an instance
        or the spec cannot be removed (a read-only CDI directory) the record stays, so the device
        stays taken and the kubelet's retry or the next start tries again; never the other way
        round, which would leave a spec that no record owns while the retry says done."""
        record = self.checkpoint.view(uid)  # entries are replaced whole, never changed in place
        if record is not None and record.mig_instances:  # else nothing to destroy: no thread hop
            await self._destroy_recorded(record)
            failpoints.hit(failpoints.UNPREPARE_AFTER_INSTANCES)
        await self._remove_spec(uid)
        async with self._state_lock:
            self._stage(uid, None)
        await self._commit()

    async def _release_stale_holders(self, ref: ClaimRef, devices: list[PreparedDevice]) -> None:
        """Unprepare, now, a claim whose record still holds a device the scheduler allocated to
        this one although the apiserver says that claim is gone, replaced, or no longer allocated
        it: its unprepare was lost while this plugin was down. The sweeper would release it after
        its grace; until then this claim's pod could not start. A holder the apiserver still gives
        the device to, or that cannot be asked, stays, and _check_conflicts refuses as before."""
        mine = _exclusive(devices)
        asked: set[str] = set()
        while (held := self.checkpoint.holder(mine, other_than=ref.uid)) is not None:
            device, other = held
            if other.uid in asked or other.state not in (COMPLETED, BOUND):
                return  # still held, or being prepared right now
            asked.add(other.uid)
            if not await self._holder_gone(other, {device}):
                return
            log.warning(
                "stale claim unprepared: the scheduler allocated its device to another claim "
                "stale=%s device=%s claim=%s",
                other.ref(),
                device,
                ref,
            )
            await self.unprepare(ClaimRef(other.namespace, other.uid, other.name))

    async def _holder_gone(self, other: ClaimRecord, devices: set[str]) -> bool:
        """Whether the apiserver (a GET, not the watch cache) says the claim of `other` is gone,
        replaced, or no longer allocated `devices`. False when it cannot be asked."""
        try:
            claim = await self.claims.get_claim(other.namespace, other.name)
        except Exception as exc:  # unreachable apiserver: keep the holder, refuse as before
            log.warning("cannot ask whether claim %s still holds its devices error=%r", other.ref(), exc)
            return False
        if claim is None or claim.get("metadata", {}).get("uid") != other.uid:
            return True
        return not devices <= self._allocated_here(claim)

    def _allocated_here(self, claim: dict[str, Any]) -> set[str]:
        """The devices of this node's pool the claim's allocation holds."""
        alloc = (claim.get("status") or {}).get("allocation") or {}
        return {
            str(r.get("device"))
            for r in (alloc.get("devices") or {}).get("results") or []
            if r.get("driver") == self.driver and r.get("pool") == self.node_name
        }

    def _check_conflicts(self, ref: ClaimRef, devices: list[PreparedDevice], sharing: SharingPlan) -> None:
        held = self.checkpoint.holder(_exclusive(devices), other_than=ref.uid)
        if held is not None:
            device, other = held
            raise BusyPrepareError(
                f"claim {ref}: device {device} is already prepared for claim "
                f"{other.ref()}; refusing to hand it to two claims"
            )
        if sharing.record:
            others = [
                (o.ref(), o.raw["sharing"])
                for o in self.checkpoint.views()
                if o.uid != ref.uid and o.raw.get("sharing")
            ]
            problem = Sharing.conflict(sharing.record, others)
            if problem:
                raise PrepareError(f"claim {ref}: {problem}")

    # -- sharing hooks (dra_gpu.plugin.sharing does the work) ------------------------------------

    def _other_sharing(self, uid: str) -> list[dict[str, Any]]:
        return [o.raw["sharing"] for o in self.checkpoint.views() if o.uid != uid and o.raw.get("sharing")]

    def _plan_sharing(self, ref: ClaimRef, shared: list[SharedDevice]) -> SharingPlan:
        needs = [d for d in shared if d.needs_sharing]
        if not needs:
            return SharingPlan()
        if self.sharing is None:
            what = f"sharing.strategy: {needs[0].config.sharing.strategy}"
            if needs[0].share_id is not None:
                what = f"share {needs[0].share_id}"
            raise PrepareError(f"{needs[0].where}: {what} is not supported by this plugin")
        try:
            return self.sharing.plan(ref.uid, shared)
        except SharingError as exc:
            raise PrepareError(str(exc)) from exc

    async def _apply_sharing(self, ref: ClaimRef, record: dict[str, Any]) -> dict[str, Any]:
        assert self.sharing is not None
        try:
            return await asyncio.to_thread(self.sharing.apply, record, self._other_sharing(ref.uid))
        except SharingError as exc:
            raise PrepareError(f"claim {ref}: sharing: {exc}") from exc

    async def _ensure_sharing(self, ref: ClaimRef, record: ClaimRecord) -> None:
        """A prepared claim's daemons answer before prepare returns (restarted if they died)."""
        if self.sharing is None or not record.raw.get("sharing"):
            return
        try:
            await asyncio.to_thread(self.sharing.ensure, record.raw["sharing"])
        except SharingError as exc:
            raise PrepareError(f"claim {ref}: sharing: {exc}") from exc

    async def _keep_sharing(self, ref: ClaimRef) -> None:
        """The sweeper's check of a live claim: its daemons are restarted if they died, without
        waiting for the claim's next prepare (a pod's clients need the daemon now)."""
        if self.sharing is None:
            return
        async with self._lock(ref.uid):
            record = self.checkpoint.view(ref.uid)
            if record is None or record.state != COMPLETED:
                return
            try:
                await self._ensure_sharing(ref, record)
            except PrepareError as exc:
                log.error("sharing of a prepared claim not restored claim=%s error=%s", ref, exc)

    async def _release_sharing(self, ref: ClaimRef | str, raw: dict[str, Any], strict: bool = True) -> None:
        if self.sharing is None or not raw.get("sharing"):
            return
        uid = ref.uid if isinstance(ref, ClaimRef) else ref
        try:
            await asyncio.to_thread(self.sharing.release, raw["sharing"], self._other_sharing(uid))
        except SharingError as exc:
            if strict:
                raise PrepareError(f"claim {ref}: cannot undo its sharing: {exc}") from exc
            log.error("sharing of a claim not fully undone claim=%s error=%s", ref, exc)

    def _plan(
        self, ref: ClaimRef, claim: dict[str, Any], created: dict[str, MigDevice] | None
    ) -> tuple[list[PreparedDevice], dict[str, Any] | None, dict[str, Any], list[Target], SharingPlan]:
        """Map the allocation to devices and build the claim's CDI spec (no side effects).

        Dynamic MIG devices exist only once made: with `created` None this only checks the claim
        and returns them as targets (no spec); with the made instances it builds the spec.
        The sharing plan covers the devices that exist (not targets still to be made)."""
        problem = status_problem(claim)
        if problem:
            raise PrepareError(f"claim {ref}: {problem}")
        allocation = (claim.get("status") or {}).get("allocation")
        if not allocation:
            raise PrepareError(f"claim {ref} is not allocated")
        results = (allocation.get("devices") or {}).get("results") or []
        results = [r for r in results if r.get("driver") == self.driver]
        if not results:
            raise PrepareError(f"claim {ref}: its allocation has no devices of driver {self.driver}")
        configs = self._configs(ref, allocation)
        prepared: list[PreparedDevice] = []
        cdi_devices: dict[str, CdiDevice] = {}
        shared: list[SharedDevice] = []
        targets: dict[str, Target] = {}
        uuids: list[str] = []
        for i, result in enumerate(results):
            request, device = str(result.get("request", "")), str(result.get("device", ""))
            where = f"claim {ref}: status.allocation.devices.results[{i}]"
            if result.get("pool") != self.node_name:
                raise PrepareError(
                    f"{where}: device {result.get('pool')}/{device} is not on this node ({self.node_name})"
                )
            if device in self.placements:
                gpu, placement = self.placements[device]
                mig = None if created is None else created.get(device)
                is_mig = True
                if mig is None:
                    targets[device] = (device, gpu, placement)
            elif device in self.devices:
                gpu, mig = self.devices[device]
                is_mig = mig is not None
            else:
                raise PrepareError(f"{where}: device {device} is not published by this node")
            config = self._config_for(where, request, is_mig, configs)
            share_id = str(result["shareID"]) if result.get("shareID") else None
            # A share of a GPU allocated to several claims is a CDI device of its own.
            cdi_name = f"{device}-{share_id}" if share_id else device
            if cdi_name not in cdi_devices and device not in targets:
                try:
                    nodes = self.nodes.mig(gpu, mig) if mig is not None else self.nodes.gpu(gpu)
                    self.nodes.verify(nodes)
                except DeviceNodeError as exc:
                    raise PrepareError(f"{where}: {exc}") from exc
                uuid = mig.uuid if mig is not None else gpu.uuid
                if uuid not in uuids:
                    uuids.append(uuid)
                cdi_devices[cdi_name] = CdiDevice(
                    name=cdi_name, device_nodes=nodes, env=config.container_env([uuid])
                )
                consumed = {str(k): str(v) for k, v in (result.get("consumedCapacity") or {}).items()}
                shared.append(
                    SharedDevice(
                        cdi_name, uuid, config, where, gpu.cuda_compute_capability, share_id, consumed
                    )
                )
            prepared.append(
                PreparedDevice(
                    request_names=[request.split("/", 1)[0]],
                    pool_name=self.node_name,
                    device_name=device,
                    cdi_device_ids=[self.cdi.device_id(ref.uid, cdi_name)],
                    share_id=share_id,
                    admin_access=bool(result.get("adminAccess", False)),
                )
            )
        sharing = self._plan_sharing(ref, shared)
        for name, (env, mounts) in sharing.device_edits.items():
            cdi_devices[name].env.update(env)
            cdi_devices[name].mounts.extend(mounts)
        control = self.nodes.control()
        try:
            self.nodes.verify(control)
        except DeviceNodeError as exc:
            raise PrepareError(f"claim {ref}: {exc}") from exc
        try:
            driver_edits = self.driver_files.edits()
        except DriverInstallationError as exc:
            raise PrepareError(f"claim {ref}: {exc}") from exc
        if targets:
            return prepared, None, driver_edits, list(targets.values()), sharing
        spec = self.cdi.build(
            ref.uid, list(cdi_devices.values()), control, {"NVIDIA_VISIBLE_DEVICES": ",".join(uuids)}
        )
        return prepared, spec, driver_edits, [], sharing

    def _configs(self, ref: ClaimRef, allocation: dict[str, Any]) -> list[tuple[list[str], GpuConfig, str]]:
        """This driver's configs, class configs before claim configs: (requests, config, where)."""
        entries = list(enumerate((allocation.get("devices") or {}).get("config") or []))
        entries.sort(key=lambda e: 0 if e[1].get("source") == "FromClass" else 1)
        out = []
        for i, entry in entries:
            opaque = entry.get("opaque")
            if not opaque or opaque.get("driver") != self.driver:
                continue
            where = f"status.allocation.devices.config[{i}].opaque.parameters"
            try:
                config = decode(opaque.get("parameters"))
            except ConfigError as exc:
                path = f"{where}.{exc.path}" if exc.path else where
                raise PrepareError(f"claim {ref}: {path}: {exc.message}") from exc
            out.append((list(entry.get("requests") or []), config, where))
        return out

    def _config_for(
        self, where: str, request: str, is_mig: bool, configs: list[tuple[list[str], GpuConfig, str]]
    ) -> GpuConfig:
        """The last config naming this request (or naming none) wins; kinds must match."""
        base = request.split("/", 1)[0]
        kind = _config_kind_for(is_mig)
        chosen = DEFAULT_MIG_CONFIG if is_mig else DEFAULT_GPU_CONFIG
        for requests, config, cwhere in configs:
            named = request in requests or base in requests
            if requests and not named:
                continue
            if config.kind != kind:
                if named:
                    raise PrepareError(
                        f"{where}: {cwhere}.kind: {config.kind} cannot configure "
                        f"a {'MIG device' if is_mig else 'whole GPU'} (use {kind})"
                    )
                continue
            chosen = config
        return chosen

    # -- unprepare -----------------------------------------------------------------------------

    async def unprepare(self, ref: ClaimRef) -> None:
        async with self._lock(ref.uid):
            record = self.checkpoint.view(ref.uid)
            if record is None:
                return  # unknown claims succeed: the kubelet may repeat itself
            await self._release_sharing(ref, record.raw)
            failpoints.hit(failpoints.UNPREPARE_AFTER_SHARING)
            try:
                await self._roll_back(ref.uid)
            except OSError as exc:
                raise PrepareError(f"claim {ref}: cannot remove its CDI spec or record: {exc}") from exc
            log.info("claim unprepared claim=%s/%s uid=%s", ref.namespace, ref.name, ref.uid)

    # -- start-up reconciliation and the stale-claim sweeper -----------------------------------

    def reconcile(self) -> dict[str, int]:
        """Make the CDI directory agree with the checkpoint (run before serving)."""
        counts = {"rolledBack": 0, "rebuilt": 0, "removed": 0}
        records = {r.uid: r for r in self.checkpoint.records()}
        for rec in list(records.values()):
            if rec.state not in (COMPLETED, BOUND):
                self._reconcile_sharing(rec, counts)
                try:
                    self.destroy_recorded(rec)
                except MigError as exc:
                    log.error(
                        "half-prepared claim kept: its MIG instance is still there claim=%s error=%s",
                        rec.ref(),
                        exc,
                    )
                    continue
                self.cdi.remove(rec.uid)
                self.checkpoint.remove(rec.uid)
                del records[rec.uid]
                counts["rolledBack"] += 1
                log.warning("claim left half-prepared, rolled back claim=%s", rec.ref())
            else:
                if rec.cdi_spec is not None:
                    self._restore_spec(rec, counts)
                self._reconcile_sharing(rec, counts)
        if self.dynamic_gpus:
            counts["orphansDestroyed"] = self._destroy_orphans()
        for uid in self.cdi.owned():
            owner = records.get(uid)  # a bound claim has no spec yet: its file is stale too
            if (owner is None or owner.state != COMPLETED) and self.cdi.remove(uid):
                counts["removed"] += 1
                log.warning("CDI spec owned by no claim removed uid=%s", uid)
        if self.sharing is not None:
            stopped = len(self._stop_orphan_daemons())
            if stopped:
                counts["daemonsStopped"] = stopped
        return counts

    def _reconcile_sharing(self, rec: ClaimRecord, counts: dict[str, int]) -> None:
        """Re-adopt a prepared claim's daemons (restarting dead ones); undo a half-prepared one's."""
        sharing = rec.raw.get("sharing")
        if self.sharing is None or not sharing:
            return
        try:
            if rec.state == COMPLETED:
                restarted = self.sharing.ensure(sharing)
                if restarted:
                    counts["daemonsRestarted"] = counts.get("daemonsRestarted", 0) + restarted
                log.info(
                    "MPS daemons of a prepared claim re-adopted claim=%s restarted=%d", rec.ref(), restarted
                )
            else:
                others = [
                    o.raw["sharing"]
                    for o in self.checkpoint.views()
                    if o.uid != rec.uid and o.raw.get("sharing")
                ]
                self.sharing.release(_with_previous_modes(sharing), others)
        except SharingError as exc:
            log.error("sharing of claim not reconciled claim=%s error=%s", rec.ref(), exc)

    def _stop_orphan_daemons(self) -> list[str]:
        assert self.sharing is not None
        owned: set[str] = set()
        for rec in self.checkpoint.views():
            if rec.raw.get("sharing"):
                owned |= self.sharing.daemon_ids(rec.raw["sharing"])
        return self.sharing.stop_orphans(owned)

    def _destroy_orphans(self) -> int:
        """Destroy MIG instances on dynamic-MIG GPUs that no claim records, unless in use."""
        if self.mig is None:
            return 0
        known = self._recorded_gpu_instances()
        destroyed = 0
        for gpu in self.dynamic_gpus:
            try:
                live = self.mig.instances(gpu.uuid)
            except MigError as exc:
                log.error("mig instances unreadable gpu=%s error=%s", gpu.uuid, exc)
                continue
            for inst in live:
                if (gpu.uuid, inst.gi_id) in known:
                    continue
                pids = self.mig.processes(gpu.uuid, inst.gi_id)
                if pids:
                    log.warning(
                        "mig instance no claim records is in use, left alone gpu=%s gi=%d pids=%s",
                        gpu.uuid,
                        inst.gi_id,
                        ",".join(map(str, pids)),
                    )
                    continue
                try:
                    if self.mig.destroy(gpu.uuid, inst.gi_id, inst.profile_id, inst.start):
                        destroyed += 1
                        log.warning("orphaned mig instance destroyed gpu=%s %s", gpu.uuid, inst.describe())
                except MigError as exc:
                    log.error("orphaned mig instance not destroyed gpu=%s error=%s", gpu.uuid, exc)
        return destroyed

    def _restore_spec(self, rec: ClaimRecord, counts: dict[str, int]) -> None:
        """Rewrite a completed claim's spec file unless it is what prepare wrote."""
        assert rec.cdi_spec is not None
        try:
            driver_edits = self.driver_files.edits()
        except DriverInstallationError as exc:
            # Without the driver's files no spec can be made; an existing one is left as it is.
            if self.cdi.read(rec.uid) is None:
                log.error(
                    "CDI spec of a prepared claim is missing and cannot be rebuilt claim=%s error=%s",
                    rec.ref(),
                    exc,
                )
            return
        want = self.cdi.compose(rec.cdi_spec, driver_edits)
        if self.cdi.read(rec.uid) == want:
            return
        if rec.raw.get("driverFiles") != self.driver_files.digest:
            log.warning("the driver installation changed since the claim was prepared claim=%s", rec.ref())
        self.cdi.write(rec.uid, want)
        counts["rebuilt"] += 1
        log.warning("CDI spec of a prepared claim rebuilt claim=%s", rec.ref())

    def _allocates(self, claim: dict[str, Any] | None, rec: ClaimRecord) -> bool:
        """Whether the claim's allocation still holds every device the record made."""
        held = self._allocated_here(claim or {})
        return all(str(m.get("device")) in held for m in rec.mig_instances)

    async def sweep(self, grace_seconds: float, now: Callable[[], float] = time.monotonic) -> list[ClaimRef]:
        """Unprepare claims whose ResourceClaim has been gone (or replaced) for `grace_seconds`."""
        swept = []
        for rec in self.checkpoint.records():
            if rec.state not in (COMPLETED, BOUND):
                continue
            claim = await self.claims.get_claim(rec.namespace, rec.name)
            gone = claim is None or claim.get("metadata", {}).get("uid") != rec.uid
            if not gone and rec.state == BOUND:
                # Made for an allocation that was given up (binding failed or timed out).
                gone = not self._allocates(claim, rec)
            if not gone:
                self._gone_since.pop(rec.uid, None)
                await self._keep_sharing(ClaimRef(rec.namespace, rec.uid, rec.name))
                continue
            first = self._gone_since.setdefault(rec.uid, now())
            if now() - first >= grace_seconds:
                ref = ClaimRef(rec.namespace, rec.uid, rec.name)
                await self.unprepare(ref)
                self._gone_since.pop(rec.uid, None)
                log.warning("stale claim unprepared by the sweeper claim=%s", ref)
                swept.append(ref)
        if self.sharing is not None:
            async with self._state_lock:  # a claim being prepared has its record staged first
                await asyncio.to_thread(self._stop_orphan_daemons)
        return swept
