"""Sharing strategies applied on the GPU, for the preparer: what a claim's GpuConfig.sharing asks
for is planned with the claim, applied before its CDI spec is written, and undone at unprepare.

- MPS: one control daemon per claim (per distinct MPS config of the claim) with the configured
  limits, its full GPUs in EXCLUSIVE_PROCESS while it runs (MIG devices keep theirs: it cannot be
  changed); containers get its pipe dir through CDI.
- Memory shares (a result with a shareID on a GPU published with allowMultipleAllocations): one
  daemon per share, its pinned-memory limit the consumed `memory`, its active thread percentage
  the consumed `computeShare` (none when 0); the GPU stays in DEFAULT compute mode so the shares'
  MPS servers run side by side. Where the driver can (`memory_limits`), the share's container
  also gets the consumed `memory` as its cgroup's GPU memory limit; such shares of one claim must
  be of one size (NVIDIA's hook reads one limit for the whole container).
- TimeSlicing: the GPU's compute mode DEFAULT and its time slice at the requested level; both
  restored when the last claim that set them is gone.
- Exclusive: nothing to apply.

What was applied is recorded in the claim's checkpoint entry (`sharing`), so a restarted plugin
re-adopts the daemons, restarts a dead one, and stops those no claim owns any more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import InvalidOperation
from pathlib import Path
from typing import Any

from dra_gpu.common import failpoints
from dra_gpu.kube.values import parse_quantity
from dra_gpu.model.config import GpuConfig
from dra_gpu.plugin.compute_mode import (
    DEFAULT,
    EXCLUSIVE_PROCESS,
    ComputeModeError,
    ComputeModes,
    DeviceGoneError,
    mode_name,
    settable,
)
from dra_gpu.plugin.driver_files import DriverFiles
from dra_gpu.plugin.driver_programs import program_locator
from dra_gpu.plugin.memory_limits import (
    COOPERATIVE,
    HOOK,
    LIMIT_ENV,
    Enforcement,
    MemoryLimits,
    limit_mib,
    mixed_sizes,
)
from dra_gpu.plugin.mps import CONTROL_BINARY, MpsDaemon, MpsDaemons, MpsError, pinned_limit
from dra_gpu.plugin.mps_pods import DaemonPods
from dra_gpu.plugin.timeslice import LEVELS, NVIDIA_SMI, TimeSliceError, TimeSlices

log = logging.getLogger(__name__)

MPS_LIMITS_MIN_CC = (7, 0)  # execution-resource provisioning came with Volta
# How long a daemon that runs but does not answer is kept before it is taken as wedged: NVIDIA's
# serves one control client at a time, so a tenant's open session (an interactive
# nvidia-cuda-mps-control) leaves the plugin's checks unanswered meanwhile.
SILENT_GRACE = 300.0


class SharingError(RuntimeError):
    """A sharing config that cannot be applied; the message names the claim part and field."""


@dataclass(frozen=True)
class SharedDevice:
    """One prepared device as sharing sees it."""

    name: str  # the pool's device name
    uuid: str  # the GPU's, or the MIG device's
    config: GpuConfig
    where: str  # "claim ...: status.allocation.devices.results[i]", for errors
    compute_capability: tuple[int, int] | None = None
    share_id: str | None = None  # a share of a GPU allocated to several claims
    consumed: dict[str, str] = field(default_factory=dict)  # the share's consumedCapacity
    # Bytes: its MPS pinned memory limit from its config (the default or its per-device limit),
    # resolved by the planner over the devices its config entry applies to; None: no limit.
    pinned_limit: int | None = None

    @property
    def needs_sharing(self) -> bool:
        return self.share_id is not None or self.config.sharing.strategy in ("MPS", "TimeSlicing")


@dataclass
class DeviceEdits:
    """What sharing adds to one device's CDI edits."""

    env: dict[str, str] = field(default_factory=dict)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    hooks: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class SharingPlan:
    """`record` goes into the checkpoint entry; `device_edits` into the devices' CDI edits;
    `memory` says, for each memory share (by CDI device name), what holds it to its size."""

    record: dict[str, Any] = field(default_factory=dict)
    device_edits: dict[str, DeviceEdits] = field(default_factory=dict)
    memory: dict[str, Enforcement] = field(default_factory=dict)


# A sharing record's driver-held memory limit (MiB) and the pods that reserved the claim when it
# was prepared (its `status.reservedFor`): NVIDIA's hook holds every GPU of a container to one
# container-wide limit, so two claims held to different sizes must not reach one pod.
DRIVER_LIMIT = "driverMemoryLimitMiB"
PODS = "pods"


def with_pods(record: dict[str, Any], claim: Mapping[str, Any]) -> dict[str, Any]:
    """`record` with the pods that reserve `claim`, when the claim is held to a driver limit."""
    if DRIVER_LIMIT not in record:
        return record
    reserved = (claim.get("status") or {}).get("reservedFor") or []
    pods = sorted(
        {str(r.get("uid")) for r in reserved if isinstance(r, dict) and r.get("resource") == "pods"}
    )
    return {**record, PODS: pods}


def _limit_conflict(record: dict[str, Any], ref: str, other: dict[str, Any]) -> str | None:
    mine, theirs = record.get(DRIVER_LIMIT), other.get(DRIVER_LIMIT)
    shared = set(record.get(PODS) or ()) & set(other.get(PODS) or ())
    if mine is None or theirs is None or mine == theirs or not shared:
        return None
    return (
        f"its memory share is held to {mine} MiB and claim {ref}'s to {theirs} MiB, and pod "
        f"{sorted(shared)[0]} reserves both: NVIDIA's {HOOK} hook holds every GPU of a container to "
        f"one container-wide {LIMIT_ENV}, so a container given both would hold one share's GPU to "
        f"the other's size; give a pod memory shares of one size"
    )


def _daemons(record: dict[str, Any]) -> list[MpsDaemon]:
    return [MpsDaemon.from_dict(d) for d in record.get("mps") or []]


def _modes(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(record.get("computeModes") or {})


def _quantity(value: str, where: str) -> int:
    try:
        q = parse_quantity(value)
    except (ValueError, InvalidOperation) as exc:
        raise SharingError(f"{where}: {value!r} is not a quantity") from exc
    return int(q)


def _slices(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(record.get("timeSlices") or {})


_ERRORS = (ComputeModeError, MpsError, TimeSliceError)


class Sharing:
    """Plans, applies, checks and undoes the sharing of prepared claims on this node."""

    def __init__(
        self,
        mps: MpsDaemons,
        modes: ComputeModes,
        timeslices: TimeSlices | None = None,
        memory_limits: MemoryLimits | None = None,
    ) -> None:
        self.mps = mps
        self.modes = modes
        self.timeslices = timeslices
        self.memory_limits = memory_limits
        self.silent_grace = SILENT_GRACE
        self._silent_since: dict[str, float] = {}  # daemon id -> when it was first found silent

    # -- planning (no side effects) -------------------------------------------------------------

    def plan(self, claim_uid: str, devices: list[SharedDevice]) -> SharingPlan:
        plan = SharingPlan()
        groups: dict[GpuConfig, list[SharedDevice]] = {}
        modes: dict[str, dict[str, Any]] = {}
        slices: dict[str, dict[str, Any]] = {}
        daemons: list[MpsDaemon] = []
        limited = self._driver_limited([d for d in devices if d.share_id is not None])
        for dev in devices:
            if dev.share_id is not None:
                daemon = self._share_daemon(f"{claim_uid}-{len(daemons)}", dev)
                daemons.append(daemon)
                modes[dev.uuid] = {"mode": DEFAULT}
                env, mounts = self.mps.cdi_edits(daemon)
                edits = plan.device_edits[dev.name] = DeviceEdits(env, mounts)
                enforcement, memory = limited[dev.name]
                plan.memory[dev.name] = enforcement
                if enforcement.by_driver and self.memory_limits is not None:
                    limit_env, hooks = self.memory_limits.edits(dev.uuid, memory)
                    edits.env.update(limit_env)
                    edits.hooks.extend(hooks)
            elif dev.config.sharing.strategy == "MPS":
                self._check_mps(dev)
                groups.setdefault(dev.config, []).append(dev)
            elif dev.config.sharing.strategy == "TimeSlicing":
                interval = (
                    dev.config.sharing.time_slicing.interval if dev.config.sharing.time_slicing else "Default"
                )
                slices[dev.uuid] = {"interval": interval, "level": LEVELS[interval]}
                modes[dev.uuid] = {"mode": DEFAULT}
        for n, (config, members) in enumerate(groups.items(), start=len(daemons)):
            mps = config.sharing.mps
            daemon = MpsDaemon(
                id=f"{claim_uid}-{n}",
                uuids=[d.uuid for d in members],
                active_thread_percentage=mps.default_active_thread_percentage if mps else None,
                pinned_memory_limits={
                    d.uuid: pinned_limit(d.pinned_limit) for d in members if d.pinned_limit
                },
            )
            daemons.append(daemon)
            for d in members:
                modes[d.uuid] = {"mode": EXCLUSIVE_PROCESS}
                plan.device_edits[d.name] = DeviceEdits(*self.mps.cdi_edits(daemon))
        modes = {uuid: mode for uuid, mode in modes.items() if settable(uuid)}
        held = {limit_mib(size) for enforcement, size in limited.values() if enforcement.by_driver and size}
        if held:  # one size (mixed sizes were refused): what the claim's containers are held to
            plan.record[DRIVER_LIMIT] = held.pop()
        if daemons:
            plan.record["mps"] = [d.to_dict() for d in daemons]
        if modes:
            plan.record["computeModes"] = modes
        if slices:
            plan.record["timeSlices"] = slices
        return plan

    def _driver_limited(self, shares: list[SharedDevice]) -> dict[str, tuple[Enforcement, int]]:
        """(how each share's memory is held, its size in bytes), by CDI device name. NVIDIA's hook
        reads one container-wide limit, and a container may be given every device of its claim:
        driver-held shares of different sizes in one claim are refused (`memory_limits`)."""
        out: dict[str, tuple[Enforcement, int]] = {}
        held: list[tuple[SharedDevice, str, int]] = []
        for dev in shares:
            memory = dev.consumed.get("memory")
            size = _quantity(memory, f"{dev.where}: consumedCapacity.memory") if memory is not None else 0
            if self.memory_limits is None:
                enforcement = Enforcement(COOPERATIVE, "no driver memory limits on this node")
            elif memory is None:
                enforcement = Enforcement(COOPERATIVE, "the share consumed no memory capacity")
            else:
                enforcement = self.memory_limits.for_gpu(dev.uuid)
            if enforcement.by_driver and memory is not None:
                held.append((dev, memory, size))
            out[dev.name] = (enforcement, size)
        problem = mixed_sizes(
            [(f"{dev.where}.consumedCapacity.memory", memory, size) for dev, memory, size in held]
        )
        if problem:
            raise SharingError(problem)
        return out

    @staticmethod
    def _share_daemon(daemon_id: str, dev: SharedDevice) -> MpsDaemon:
        """The daemon that enforces one memory share: the consumed memory and compute share."""
        if dev.config.sharing.strategy == "TimeSlicing":
            raise SharingError(
                f"{dev.where}: sharing.strategy: TimeSlicing cannot enforce a memory share "
                f"(share {dev.share_id}); use MPS or Exclusive"
            )
        mps = dev.config.sharing.mps
        limits = {}
        memory = dev.consumed.get("memory")
        if memory is not None:
            limits[dev.uuid] = pinned_limit(_quantity(memory, f"{dev.where}: consumedCapacity.memory"))
        elif dev.pinned_limit:
            limits[dev.uuid] = pinned_limit(dev.pinned_limit)
        share = _quantity(
            dev.consumed.get("computeShare", "0"), f"{dev.where}: consumedCapacity.computeShare"
        )
        pct = min(100, share) if share > 0 else (mps.default_active_thread_percentage if mps else None)
        if (
            (limits or pct)
            and dev.compute_capability is not None
            and dev.compute_capability < MPS_LIMITS_MIN_CC
        ):
            cc = ".".join(map(str, dev.compute_capability))
            raise SharingError(
                f"{dev.where}: a memory share needs MPS limits; device {dev.name} has compute capability {cc}"
            )
        return MpsDaemon(
            id=daemon_id,
            uuids=[dev.uuid],
            active_thread_percentage=pct,
            pinned_memory_limits=limits,
            share_id=dev.share_id,
        )

    @staticmethod
    def _check_mps(dev: SharedDevice) -> None:
        mps = dev.config.sharing.mps
        if mps is None or dev.compute_capability is None or dev.compute_capability >= MPS_LIMITS_MIN_CC:
            return
        cc = ".".join(map(str, dev.compute_capability))
        for value, name in (
            (mps.default_active_thread_percentage, "defaultActiveThreadPercentage"),
            (mps.default_pinned_device_memory_limit, "defaultPinnedDeviceMemoryLimit"),
            (mps.per_device_pinned_memory_limits or None, "defaultPerDevicePinnedMemoryLimit"),
        ):
            if value is not None:
                raise SharingError(
                    f"{dev.where}: {mps.path}.{name}: device {dev.name} has compute capability {cc}; "
                    f"MPS limits need {'.'.join(map(str, MPS_LIMITS_MIN_CC))} or newer"
                )

    @staticmethod
    def conflict(record: dict[str, Any], others: Iterable[tuple[str, dict[str, Any]]]) -> str | None:
        """What stops `record` from being applied next to the other claims' (ref, record)."""
        mine = _modes(record)
        my_mps = {u for d in _daemons(record) if d.share_id is None for u in d.uuids}
        for ref, other in others:
            for uuid, theirs in _modes(other).items():
                if uuid in mine and mine[uuid]["mode"] != theirs["mode"]:
                    return (
                        f"device {uuid} is in compute mode {mode_name(theirs['mode'])} for claim {ref}; "
                        f"this claim's sharing needs {mode_name(mine[uuid]['mode'])}"
                    )
            clash = my_mps & {u for d in _daemons(other) for u in d.uuids}  # shares or not
            if clash:
                return f"device {sorted(clash)[0]} already has an MPS daemon for claim {ref}"
            problem = _limit_conflict(record, ref, other)
            if problem:
                return problem
            for uuid, theirs in _slices(other).items():
                mine_ts = _slices(record).get(uuid)
                if mine_ts is not None and mine_ts["level"] != theirs["level"]:
                    return (
                        f"device {uuid} has time slice {theirs['interval']} for claim {ref}; "
                        f"this claim asks for sharing.timeSlicing.interval {mine_ts['interval']}"
                    )
        return None

    # -- applying and undoing (blocking: run in a thread) ---------------------------------------

    def apply(self, record: dict[str, Any], others: list[dict[str, Any]]) -> dict[str, Any]:
        """Set compute modes and start daemons; the record with what to restore, or SharingError
        with everything this call did undone."""
        done = {**record, "computeModes": {}}
        try:
            for uuid, setting in _modes(record).items():
                holder = next((_modes(o)[uuid] for o in others if uuid in _modes(o)), None)
                previous = holder.get("previous") if holder else self.modes.get(uuid)
                if previous != setting["mode"]:
                    self.modes.set(uuid, setting["mode"])
                done["computeModes"][uuid] = {**setting, "previous": previous}
            for uuid, ts in _slices(record).items():
                if not any(uuid in _slices(o) for o in others):
                    self._timeslices().set(uuid, ts["level"])
            if _daemons(record):
                failpoints.hit(failpoints.MPS_AFTER_COMPUTE_MODE)
            for daemon in _daemons(record):
                self.mps.start(daemon)
                failpoints.hit(failpoints.MPS_AFTER_DAEMON_START)
        except _ERRORS as exc:
            self._undo(done, others)
            raise SharingError(str(exc)) from exc
        if not done["computeModes"]:
            del done["computeModes"]
        return done

    def release(self, record: dict[str, Any], others: list[dict[str, Any]]) -> None:
        """Stop the record's daemons and restore compute modes no other claim still needs."""
        errors = self._undo(record, others)
        if errors:
            raise SharingError("; ".join(errors))

    def _undo(self, record: dict[str, Any], others: list[dict[str, Any]]) -> list[str]:
        errors = []
        for uuid in _slices(record):
            if any(uuid in _slices(o) for o in others):
                continue
            try:
                self._timeslices().set(uuid, LEVELS["Default"])
            except TimeSliceError as exc:
                errors.append(str(exc))
        for daemon in _daemons(record):
            try:
                self.mps.stop(daemon.id)
            except MpsError as exc:
                errors.append(str(exc))
            except OSError as exc:
                errors.append(f"MPS daemon {daemon.id}: {exc}")
        for uuid, setting in _modes(record).items():
            if any(uuid in _modes(o) for o in others) or setting.get("previous") is None:
                continue  # still needed by another claim, or never set by this one
            if not settable(uuid):
                continue  # a MIG device in a record of an earlier release: never changed
            try:
                if self.modes.get(uuid) != setting["previous"]:
                    self.modes.set(uuid, setting["previous"])
            except DeviceGoneError as exc:
                # Nothing to restore on a GPU that is gone (its mode goes with it); failing would
                # keep the claim from ever being unprepared.
                log.warning("compute mode not restored, the device is gone: %s", exc)
            except ComputeModeError as exc:
                errors.append(str(exc))
        return errors

    def ensure(self, record: dict[str, Any]) -> int:
        """Restart the record's daemons that do not answer (with their modes), and set again the
        limits of those that answer differently from the record; how many were restarted."""
        restarted = 0
        for daemon in _daemons(record):
            if self.mps.answers(daemon.id):
                self._silent_since.pop(daemon.id, None)
                try:
                    self.mps.check(daemon)
                except MpsError as exc:
                    raise SharingError(str(exc)) from exc
                continue
            if self._silent_but_kept(daemon.id):
                continue
            log.warning("MPS daemon of a prepared claim is not answering, restarting id=%s", daemon.id)
            try:
                for uuid in filter(settable, daemon.uuids):
                    want = _modes(record).get(uuid, {}).get("mode", EXCLUSIVE_PROCESS)
                    if self.modes.get(uuid) != want:
                        self.modes.set(uuid, want)
                self.mps.start(daemon)
            except _ERRORS as exc:
                raise SharingError(str(exc)) from exc
            restarted += 1
        return restarted

    def _silent_but_kept(self, daemon_id: str) -> bool:
        """A daemon that runs but does not answer is kept, its clients with it, for silent_grace
        seconds from when it was first found so (a tenant may hold its one control session); one
        silent longer is taken as wedged. A daemon that does not run is never kept."""
        if not self.mps.alive(daemon_id):
            self._silent_since.pop(daemon_id, None)
            return False
        silent = time.monotonic() - self._silent_since.setdefault(daemon_id, time.monotonic())
        if silent < self.silent_grace:
            log.warning(
                "MPS daemon runs but does not answer, kept (a client may hold its control session) "
                "id=%s silent_seconds=%.0f restart_after_seconds=%.0f",
                daemon_id,
                silent,
                self.silent_grace,
            )
            return True
        log.warning("MPS daemon silent for %.0fs, taken as wedged id=%s", silent, daemon_id)
        del self._silent_since[daemon_id]
        return False

    def _timeslices(self) -> TimeSlices:
        if self.timeslices is None:
            raise TimeSliceError("time slicing is not available on this node")
        return self.timeslices

    def daemon_ids(self, record: dict[str, Any]) -> set[str]:
        return {d.id for d in _daemons(record)}

    def stop_orphans(self, owned: set[str]) -> list[str]:
        """Stop daemons whose directory no claim record owns (a crash between start and record)."""
        stopped: list[str] = []
        try:
            found = self.mps.owned()
        except MpsError as exc:  # the daemon pods unlisted: the next sweep tries again
            log.warning("MPS daemons not listed, orphans not looked for: %s", exc)
            return stopped
        for daemon_id in found:
            if daemon_id not in owned:
                log.warning("MPS daemon owned by no claim stopped id=%s", daemon_id)
                try:
                    self.mps.stop(daemon_id)
                except MpsError as exc:
                    log.warning("MPS daemon owned by no claim not stopped id=%s: %s", daemon_id, exc)
                    continue
                stopped.append(daemon_id)
        return stopped


def node_sharing(
    mps_root: Path,
    driver_files: DriverFiles,
    nvml: Any,
    tool_env: dict[str, str] | None = None,
    memory_limits: MemoryLimits | None = None,
    daemon_pods: DaemonPods | None = None,
    shm_size: int | None = None,
) -> Sharing:
    """The node's sharing: daemons under `mps_root` (each a pod of its own with `daemon_pods`,
    the node's processes without), compute modes through the node's NVML (the driver keeps them
    across processes: nvidia-smi and a restarted plugin see them), time slices through the
    driver's nvidia-smi. `tool_env`: what NVIDIA's tools must be told besides (a simulated node's
    device-node directory)."""
    tool_env = dict(tool_env or {})
    return Sharing(
        MpsDaemons(
            mps_root,
            program_locator(driver_files, CONTROL_BINARY),
            tool_env,
            shm_size=shm_size,
            pods=daemon_pods,
        ),
        ComputeModes(nvml),
        TimeSlices(program_locator(driver_files, NVIDIA_SMI), tool_env),
        memory_limits,
    )
