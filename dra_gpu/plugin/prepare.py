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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from dra_gpu.api import ConfigError, GpuConfig, decode
from dra_gpu.api.v1alpha1 import DEFAULT_GPU_CONFIG, DEFAULT_MIG_CONFIG
from dra_gpu.kubeletplugin.driver import ClaimError, ClaimRef
from dra_gpu.model import Gpu, Inventory, MigDevice
from dra_gpu.plugin.cdi import CdiDevice, CdiSpecs
from dra_gpu.plugin.checkpoint import COMPLETED, STARTED, Checkpoint, ClaimRecord
from dra_gpu.plugin.device_nodes import DeviceNodeError, DeviceNodes
from dra_gpu.plugin.driver_files import DriverFiles, DriverInstallationError
from dra_gpu.plugin.sharing import SharedDevice, Sharing, SharingError, SharingPlan

log = logging.getLogger(__name__)


class PrepareError(ClaimError):
    """A claim that cannot be prepared (or unprepared); the message goes back to the kubelet."""


class ClaimSource(Protocol):
    async def get_claim(self, namespace: str, name: str) -> dict[str, Any] | None: ...


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


def _config_kind_for(mig: MigDevice | None) -> str:
    return "MigDeviceConfig" if mig is not None else "GpuConfig"


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
    ) -> None:
        self.driver = driver
        self.node_name = node_name
        self.checkpoint = checkpoint
        self.cdi = cdi
        self.nodes = nodes
        self.claims = claims
        self.driver_files = driver_files
        self.sharing = sharing  # None: sharing strategies other than Exclusive are refused
        self.devices: dict[str, tuple[Gpu, MigDevice | None]] = {}
        for gpu in inventory.gpus:
            if not gpu.mig_enabled:
                self.devices[gpu.device_name] = (gpu, None)
            for mig in gpu.mig_devices:
                self.devices[gpu.mig_device_name(mig)] = (gpu, mig)
        self._claim_locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        self._state_lock = asyncio.Lock()
        # Group commit: concurrent claims share checkpoint writes (see _commit).
        self._commit_lock = asyncio.Lock()
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

    def prepared_device_count(self) -> int:
        return sum(len(r.devices) for r in self.checkpoint.views() if r.state == COMPLETED)

    # -- prepare -------------------------------------------------------------------------------

    async def prepare(self, ref: ClaimRef) -> list[PreparedDevice]:
        async with self._lock(ref.uid):
            record = self.checkpoint.view(ref.uid)  # entries are replaced, never changed in place
            if record is not None and record.state == COMPLETED:
                await self._ensure_sharing(ref, record)
                return [PreparedDevice.from_dict(d) for d in record.devices]  # idempotent: no writes
            claim = await self.claims.get_claim(ref.namespace, ref.name)
            if claim is None:
                raise PrepareError(f"ResourceClaim {ref.namespace}/{ref.name} not found")
            uid = claim.get("metadata", {}).get("uid")
            if uid != ref.uid:
                raise PrepareError(
                    f"ResourceClaim {ref.namespace}/{ref.name} got replaced: "
                    f"uid is {uid}, the kubelet asked for {ref.uid}"
                )
            devices, spec, driver_edits, sharing = self._plan(ref, claim)
            entry = {
                "state": STARTED,
                "namespace": ref.namespace,
                "name": ref.name,
                "devices": [d.to_dict() for d in devices],
                "cdiSpec": spec,  # the claim's own part; the file adds the driver's user space
                "driverFiles": self.driver_files.digest,
            }
            if sharing.record:
                entry["sharing"] = sharing.record
            async with self._state_lock:
                if record is not None and record.state == STARTED:
                    await asyncio.to_thread(self.cdi.remove, ref.uid)  # an earlier partial attempt
                    await self._release_sharing(ref, record.raw, strict=False)
                self._check_conflicts(ref, devices, sharing)
                self._stage(ref.uid, entry)
            applied: dict[str, Any] | None = None
            try:
                # "started" and the spec may land in either order: a spec without a completed
                # record is removed by the start-up reconciliation.
                await asyncio.gather(
                    self._commit(),
                    asyncio.to_thread(self.cdi.write, ref.uid, self.cdi.compose(spec, driver_edits)),
                )
                if sharing.record:
                    applied = await self._apply_sharing(ref, sharing.record)
                    entry["sharing"] = applied
                async with self._state_lock:
                    self._stage(ref.uid, {**entry, "state": COMPLETED})
                await self._commit()
            except BaseException as exc:
                if applied is not None:
                    await self._release_sharing(ref, {"sharing": applied}, strict=False)
                await self._roll_back(ref.uid)
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

    async def _roll_back(self, uid: str) -> None:
        """Remove the claim's spec and record (either order is safe, see reconcile)."""
        async with self._state_lock:
            self._stage(uid, None)
        await asyncio.gather(asyncio.to_thread(self.cdi.remove, uid), self._commit())

    def _check_conflicts(self, ref: ClaimRef, devices: list[PreparedDevice], sharing: SharingPlan) -> None:
        mine = {d.device_name for d in devices if not d.admin_access and d.share_id is None}
        for other in self.checkpoint.views():
            if other.uid == ref.uid:
                continue
            clash = mine & other.device_names
            if clash:
                raise PrepareError(
                    f"claim {ref}: device {sorted(clash)[0]} is already prepared for claim "
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
        self, ref: ClaimRef, claim: dict[str, Any]
    ) -> tuple[list[PreparedDevice], dict[str, Any], dict[str, Any], SharingPlan]:
        """Map the allocation to devices and build the claim's CDI spec (no side effects)."""
        allocation = (claim.get("status") or {}).get("allocation")
        if not allocation:
            raise PrepareError(f"claim {ref} is not allocated")
        results = [
            r for r in allocation.get("devices", {}).get("results") or [] if r.get("driver") == self.driver
        ]
        if not results:
            raise PrepareError(f"claim {ref}: its allocation has no devices of driver {self.driver}")
        configs = self._configs(ref, allocation)
        prepared: list[PreparedDevice] = []
        cdi_devices: dict[str, CdiDevice] = {}
        shared: list[SharedDevice] = []
        uuids: list[str] = []
        for i, result in enumerate(results):
            request, device = str(result.get("request", "")), str(result.get("device", ""))
            where = f"claim {ref}: status.allocation.devices.results[{i}]"
            if result.get("pool") != self.node_name:
                raise PrepareError(
                    f"{where}: device {result.get('pool')}/{device} is not on this node ({self.node_name})"
                )
            if device not in self.devices:
                raise PrepareError(f"{where}: device {device} is not published by this node")
            gpu, mig = self.devices[device]
            config = self._config_for(where, request, mig, configs)
            share_id = str(result["shareID"]) if result.get("shareID") else None
            # A share of a GPU allocated to several claims is a CDI device of its own.
            cdi_name = f"{device}-{share_id}" if share_id else device
            if cdi_name not in cdi_devices:
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
        spec = self.cdi.build(
            ref.uid, list(cdi_devices.values()), control, {"NVIDIA_VISIBLE_DEVICES": ",".join(uuids)}
        )
        return prepared, spec, driver_edits, sharing

    def _configs(self, ref: ClaimRef, allocation: dict[str, Any]) -> list[tuple[list[str], GpuConfig, str]]:
        """This driver's configs, class configs before claim configs: (requests, config, where)."""
        entries = list(enumerate(allocation.get("devices", {}).get("config") or []))
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
        self, where: str, request: str, mig: MigDevice | None, configs: list[tuple[list[str], GpuConfig, str]]
    ) -> GpuConfig:
        """The last config naming this request (or naming none) wins; kinds must match."""
        base = request.split("/", 1)[0]
        kind = _config_kind_for(mig)
        chosen = DEFAULT_MIG_CONFIG if mig is not None else DEFAULT_GPU_CONFIG
        for requests, config, cwhere in configs:
            named = request in requests or base in requests
            if requests and not named:
                continue
            if config.kind != kind:
                if named:
                    raise PrepareError(
                        f"{where}: {cwhere}.kind: {config.kind} cannot configure "
                        f"a {'MIG device' if mig else 'whole GPU'} (use {kind})"
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
        for rec in records.values():
            if rec.state != COMPLETED:
                self._reconcile_sharing(rec, counts)
                self.cdi.remove(rec.uid)
                self.checkpoint.remove(rec.uid)
                counts["rolledBack"] += 1
                log.warning("claim left half-prepared, rolled back claim=%s", rec.ref())
            else:
                if rec.cdi_spec is not None:
                    self._restore_spec(rec, counts)
                self._reconcile_sharing(rec, counts)
        for uid in self.cdi.owned():
            owner = records.get(uid)
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
                self.sharing.release(sharing, others)
        except SharingError as exc:
            log.error("sharing of claim not reconciled claim=%s error=%s", rec.ref(), exc)

    def _stop_orphan_daemons(self) -> list[str]:
        assert self.sharing is not None
        owned: set[str] = set()
        for rec in self.checkpoint.views():
            if rec.raw.get("sharing"):
                owned |= self.sharing.daemon_ids(rec.raw["sharing"])
        return self.sharing.stop_orphans(owned)

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

    async def sweep(self, grace_seconds: float, now: Callable[[], float] = time.monotonic) -> list[ClaimRef]:
        """Unprepare claims whose ResourceClaim has been gone (or replaced) for `grace_seconds`."""
        swept = []
        for rec in self.checkpoint.records():
            if rec.state != COMPLETED:
                continue
            claim = await self.claims.get_claim(rec.namespace, rec.name)
            gone = claim is None or claim.get("metadata", {}).get("uid") != rec.uid
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
