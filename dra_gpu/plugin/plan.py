"""What a claim's allocation comes to on this node: a `ClaimPlan`, computed without side effects.

The planner maps each allocated device of this driver to the node's device (a whole GPU, a MIG
device, or a dynamic MIG placement), picks its opaque config, checks its device nodes exist, and
builds the claim's own CDI spec and sharing plan. It writes nothing: the preparer carries the plan
out (journal, MIG instances, sharing), and the checkpoint's rebuild plans a claim the same way.

Dynamic MIG devices exist only once made: a placement the allocation names and `made` does not
hold is a target of the plan, and a plan with targets has no spec yet (it is planned again with
the made instances).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from dra_gpu.kubeletplugin.driver import ClaimError, ClaimRef
from dra_gpu.model.config import ConfigError, GpuConfig, decode
from dra_gpu.model.config.v1alpha1 import DEFAULT_GPU_CONFIG, DEFAULT_MIG_CONFIG
from dra_gpu.model.inventory import Gpu, MigDevice, MigPlacement
from dra_gpu.node.catalog import DeviceCatalog
from dra_gpu.plugin.allocation import Allocation, ShapeError
from dra_gpu.plugin.cdi import CdiDevice, CdiSpecs, visible_devices_env
from dra_gpu.plugin.device_metadata import DeviceMetadata
from dra_gpu.plugin.device_nodes import DeviceNodeError, DeviceNodes
from dra_gpu.plugin.driver_files import DriverFiles, DriverInstallationError
from dra_gpu.plugin.record import ClaimRecord, ClaimState, MetadataInputs, MigStep, PreparedDevice
from dra_gpu.plugin.sharing import SharedDevice, Sharing, SharingError, SharingPlan


class PrepareError(ClaimError):
    """A claim that cannot be prepared (or unprepared); the message goes back to the kubelet."""


class BusyPrepareError(PrepareError):
    """The device, or the memory slices of its MIG placement, are held by another instance."""


@dataclass(frozen=True)
class MigTarget:
    """A dynamic MIG device to make: its name, its parent GPU and its placement."""

    name: str
    gpu: Gpu
    placement: MigPlacement


@dataclass(frozen=True)
class ClaimPlan:
    devices: tuple[PreparedDevice, ...]
    targets: tuple[MigTarget, ...]  # dynamic MIG devices still to be made
    spec: dict[str, Any] | None  # the claim's own CDI spec; None while targets remain
    driver_edits: dict[str, Any]  # the driver's user space, added to the spec file
    sharing: SharingPlan  # for the devices that exist (not targets still to be made)
    metadata: MetadataInputs | None = None  # device metadata (KEP-5304) written for the claim

    def record(
        self, ref: ClaimRef, state: ClaimState, driver_files: str | None, mig_steps: tuple[MigStep, ...] = ()
    ) -> ClaimRecord:
        """The claim's checkpoint record for this plan (its sharing is added once applied)."""
        return ClaimRecord(
            uid=ref.uid,
            state=state,
            namespace=ref.namespace,
            name=ref.name,
            devices=self.devices,
            cdi_spec=self.spec,  # the claim's own part; the file adds the driver's user space
            driver_files=driver_files,
            mig_steps=mig_steps,
            metadata=self.metadata,
        )

    @property
    def exclusive(self) -> set[str]:
        """The devices the claim holds alone: not for admin access, not a share of a GPU."""
        return {d.device_name for d in self.devices if not d.admin_access and d.share_id is None}


_Configs = list[tuple[list[str], GpuConfig, str]]  # (requests, config, where)


class Planner:
    """The node's devices (its catalog) and everything a plan reads (device nodes, the driver's
    files)."""

    def __init__(
        self,
        driver: str,
        node_name: str,
        catalog: DeviceCatalog,
        cdi: CdiSpecs,
        nodes: DeviceNodes,
        driver_files: DriverFiles,
        sharing: Sharing | None,
        metadata: DeviceMetadata | None = None,
    ) -> None:
        self.driver = driver
        self.metadata = metadata  # None, or not enabled: no device metadata for new claims
        self.node_name = node_name
        self.cdi = cdi
        self.nodes = nodes
        self.driver_files = driver_files
        self.sharing = sharing  # None: sharing strategies other than Exclusive are refused
        self.catalog = catalog
        # Whole GPUs and MIG devices made beforehand; dynamic MIG placements (made on demand).
        self.devices: dict[str, tuple[Gpu, MigDevice | None]] = {
            d.name: (d.gpu, d.mig) for d in catalog if d.placement is None
        }
        self.placements: dict[str, tuple[Gpu, MigPlacement]] = catalog.placements()
        self.dynamic_gpus = catalog.dynamic_gpus

    def allocated_here(self, claim: Mapping[str, Any]) -> set[str]:
        """The devices of this node's pool the claim's allocation holds."""
        return Allocation.of(claim).devices_for(self.driver, self.node_name)

    def placements_of(self, allocation: Allocation) -> list[str]:
        """The dynamic MIG placements of this node the allocation holds."""
        here = allocation.results_for(self.driver, self.node_name)
        return [r.device for r in here if r.device in self.placements]

    @staticmethod
    def allocation(ref: ClaimRef, claim: Mapping[str, Any]) -> Allocation:
        """The claim's allocation, parsed once for its plans; a bad shape is the claim's error."""
        try:
            return Allocation.checked(claim)
        except ShapeError as exc:
            raise PrepareError(f"claim {ref}: {exc}") from exc

    def plan(
        self,
        ref: ClaimRef,
        allocation: Allocation,
        made: Mapping[str, MigDevice],
        pod_claim_name: str | None = None,
        with_metadata: bool | None = None,
    ) -> ClaimPlan:
        """Map the allocation to devices and build the claim's CDI spec (no side effects).
        `pod_claim_name`: the claim's name in its pod, for a claim made from a template (its
        device metadata's path); `with_metadata`: whether the claim gets device metadata (None:
        as the plugin's flag says)."""
        if not allocation.allocated:
            raise PrepareError(f"claim {ref} is not allocated")
        results = allocation.results_for(self.driver)
        if not results:
            raise PrepareError(f"claim {ref}: its allocation has no devices of driver {self.driver}")
        configs = self._configs(ref, allocation)
        prepared: list[PreparedDevice] = []
        cdi_devices: dict[str, CdiDevice] = {}
        shared: list[SharedDevice] = []
        targets: dict[str, MigTarget] = {}
        uuids: list[str] = []
        # Each config entry (by where) -> its config and the UUIDs of the made devices it applies
        # to: per-device limits name a device by UUID or by index into them sorted.
        applies: dict[str, tuple[GpuConfig, list[str]]] = {}
        unmade: set[str] = set()  # config entries applying to a dynamic MIG device still to be made
        config_of: dict[str, str] = {}  # CDI device name -> its config entry
        for i, result in enumerate(results):
            device = result.device
            where = f"claim {ref}: status.allocation.devices.results[{i}]"
            if result.pool != self.node_name:
                raise PrepareError(
                    f"{where}: device {result.pool}/{device} is not on this node ({self.node_name})"
                )
            if device in self.placements:
                gpu, placement = self.placements[device]
                mig = made.get(device)
                is_mig = True
                if mig is None:
                    targets[device] = MigTarget(device, gpu, placement)
            elif device in self.devices:
                gpu, mig = self.devices[device]
                is_mig = mig is not None
            else:
                raise PrepareError(f"{where}: device {device} is not published by this node")
            config, cwhere = self._config_for(where, result.request, is_mig, configs)
            if device in targets:
                unmade.add(cwhere)
            if result.admin_access and config.sharing.strategy != "Exclusive":
                # Admin access gets a device another claim may hold exclusively: sharing it would
                # change that claim's GPU (compute mode, an MPS daemon) under it.
                raise PrepareError(
                    f"{where}: request {result.request!r} has adminAccess, so its device cannot take "
                    f"sharing.strategy {config.sharing.strategy} (another claim may hold it exclusively)"
                )
            share_id = result.share_id
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
                config_uuids = applies.setdefault(cwhere, (config, []))[1]
                if uuid not in config_uuids:
                    config_uuids.append(uuid)
                config_of[cdi_name] = cwhere
                # Its environment once every device of its config is known (per-device limits).
                cdi_devices[cdi_name] = CdiDevice(name=cdi_name, device_nodes=nodes)
                consumed = dict(result.consumed_capacity or {})
                shared.append(
                    SharedDevice(
                        cdi_name, uuid, config, where, gpu.cuda_compute_capability, share_id, consumed
                    )
                )
            prepared.append(
                PreparedDevice(
                    request_names=[result.base_request],
                    pool_name=self.node_name,
                    device_name=device,
                    cdi_device_ids=[self.cdi.device_id(ref.uid, cdi_name)],
                    share_id=share_id,
                    admin_access=result.admin_access,
                )
            )
        pinned = {
            cwhere: self._pinned_limits(ref, cwhere, config, config_uuids, cwhere in unmade)
            for cwhere, (config, config_uuids) in applies.items()
        }
        for i, dev in enumerate(shared):
            limits = pinned[config_of[dev.name]]
            cdi_devices[dev.name].env.update(dev.config.container_env([dev.uuid], limits))
            shared[i] = replace(dev, pinned_limit=limits.get(dev.uuid))
        sharing = self._plan_sharing(ref, shared)
        if sharing.memory:
            prepared = [_with_memory_limit(p, sharing) for p in prepared]
        for name, edits in sharing.device_edits.items():
            cdi_devices[name].env.update(edits.env)
            cdi_devices[name].mounts.extend(edits.mounts)
            cdi_devices[name].hooks.extend(edits.hooks)
        control = self.nodes.control()
        try:
            self.nodes.verify(control)
        except DeviceNodeError as exc:
            raise PrepareError(f"claim {ref}: {exc}") from exc
        try:
            driver_edits = self.driver_files.edits()
        except DriverInstallationError as exc:
            raise PrepareError(f"claim {ref}: {exc}") from exc
        metadata = None
        if self.metadata is not None and (self.metadata.enabled if with_metadata is None else with_metadata):
            try:
                metadata = self.metadata.inputs((r.request for r in results), pod_claim_name)
                prepared = self.metadata.with_cdi_ids(ref.uid, metadata, prepared)
            except ValueError as exc:
                raise PrepareError(f"claim {ref}: device metadata: {exc}") from exc
        if targets:
            return ClaimPlan(tuple(prepared), tuple(targets.values()), None, driver_edits, sharing, metadata)
        spec = self.cdi.build(ref.uid, list(cdi_devices.values()), control, visible_devices_env(uuids))
        return ClaimPlan(tuple(prepared), (), spec, driver_edits, sharing, metadata)

    def _configs(self, ref: ClaimRef, allocation: Allocation) -> _Configs:
        """This driver's configs, class configs before claim configs: (requests, config, where)."""
        out = []
        for entry in allocation.configs_for(self.driver):
            where = f"status.allocation.devices.config[{entry.index}].opaque.parameters"
            try:
                config = decode(entry.parameters)
            except ConfigError as exc:
                path = f"{where}.{exc.path}" if exc.path else where
                raise PrepareError(f"claim {ref}: {path}: {exc.message}") from exc
            out.append((list(entry.requests), config, where))
        return out

    @staticmethod
    def _config_for(where: str, request: str, is_mig: bool, configs: _Configs) -> tuple[GpuConfig, str]:
        """The last config naming this request (or naming none) wins; kinds must match. With
        where it is (the default: its kind)."""
        base = request.split("/", 1)[0]
        kind = "MigDeviceConfig" if is_mig else "GpuConfig"
        chosen = DEFAULT_MIG_CONFIG if is_mig else DEFAULT_GPU_CONFIG
        chosen_where = kind
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
            chosen, chosen_where = config, cwhere
        return chosen, chosen_where

    @staticmethod
    def _pinned_limits(
        ref: ClaimRef, cwhere: str, config: GpuConfig, uuids: list[str], partial: bool
    ) -> dict[str, int]:
        """The MPS pinned memory limit (bytes) of each device a config entry applies to, by UUID.
        `partial`: some of its devices are still to be made, so an index or a UUID cannot be told
        yet: the default alone (the claim is planned again once they are made)."""
        mps = config.sharing.mps
        if mps is None:
            return {}
        if partial:
            limit = mps.default_pinned_device_memory_limit
            return dict.fromkeys(uuids, limit) if limit is not None else {}
        try:
            return mps.pinned_memory_limits(uuids)
        except ConfigError as exc:  # the webhook cannot know the devices: a key naming none
            raise PrepareError(f"claim {ref}: {cwhere}.{exc.path}: {exc.message}") from exc

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


def _with_memory_limit(device: PreparedDevice, sharing: SharingPlan) -> PreparedDevice:
    """A memory share's device, with what holds it to its size (for the claim's status)."""
    if device.share_id is None:
        return device
    enforcement = sharing.memory.get(f"{device.device_name}-{device.share_id}")
    if enforcement is None:
        return device
    return replace(device, memory_limit={"enforcedBy": enforcement.kind, "reason": enforcement.reason})
