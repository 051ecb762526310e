"""The life cycle of claims' dynamic MIG instances: made step by step on record, destroyed as
recorded, orphans found and destroyed.

Each instance's step goes into the claim's record before the next NVML call that makes
something (planned, then the GPU instance's ID, then the compute instance and MIG UUID), so a
restart knows what may exist and destroys exactly that. NVML itself is mig_lifecycle.MigInstances.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from dra_gpu.common import failpoints
from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.model.inventory import Gpu, MigDevice, MigPlacement
from dra_gpu.plugin.journal import Journal
from dra_gpu.plugin.mig_lifecycle import MigError, MigInstances, made_device
from dra_gpu.plugin.plan import MigTarget, PrepareError
from dra_gpu.plugin.record import MIG_GPU_INSTANCE, MIG_PLANNED, MIG_READY, ClaimRecord, MigStep

log = logging.getLogger(__name__)


def planned_steps(targets: tuple[MigTarget, ...]) -> tuple[MigStep, ...]:
    return tuple(
        MigStep(
            device=t.name,
            parent_uuid=t.gpu.uuid,
            profile_id=t.placement.profile.profile_id,
            start=t.placement.start,
            size=t.placement.profile.memory_slices,
            step=MIG_PLANNED,
        )
        for t in targets
    )


class ClaimMig:
    def __init__(
        self,
        journal: Journal,
        mig: MigInstances | None,
        placements: dict[str, tuple[Gpu, MigPlacement]],
        dynamic_gpus: list[Gpu],
    ) -> None:
        self.journal = journal
        self.mig = mig
        self.placements = placements
        self.dynamic_gpus = dynamic_gpus

    def made(self, record: ClaimRecord) -> dict[str, MigDevice]:
        """The MIG devices a record says were made (step ready)."""
        out = {}
        for m in record.mig_steps:
            if m.step != MIG_READY or m.device not in self.placements:
                continue
            _, placement = self.placements[m.device]
            out[m.device] = made_device(placement, int(m.gi_id or 0), int(m.ci_id or 0), str(m.uuid))
        return out

    def ready_steps(self, made: dict[str, MigDevice]) -> tuple[MigStep, ...]:
        """The steps of instances found made (the rebuild's record of them)."""
        return tuple(
            MigStep(
                device=name,
                parent_uuid=self.placements[name][0].uuid,
                profile_id=mig.gi_profile_id,
                start=mig.placement_start,
                size=mig.placement_size,
                step=MIG_READY,
                gi_id=mig.gpu_instance_id,
                ci_id=mig.compute_instance_id,
                uuid=mig.uuid,
            )
            for name, mig in made.items()
        )

    def holders(self, uid: str, targets: tuple[MigTarget, ...]) -> list[ClaimRecord]:
        """The other claims whose recorded MIG instances overlap one of `targets`."""
        out = []
        for other in self.journal.records():
            if other.uid == uid:
                continue
            if any(
                m.parent_uuid == t.gpu.uuid and m.slices & set(t.placement.slices)
                for m in other.mig_steps
                for t in targets
            ):
                out.append(other)
        return out

    # -- create ----------------------------------------------------------------------------------

    async def create(
        self, ref: ClaimRef, record: ClaimRecord, targets: tuple[MigTarget, ...]
    ) -> tuple[dict[str, MigDevice], ClaimRecord]:
        """Make each target's GPU and compute instance, recording every step durably; the made
        devices and the record as it now stands."""
        created: dict[str, MigDevice] = {}
        for i, target in enumerate(targets):
            try:
                created[target.name], record = await self._create_one(ref, record, i, target)
            except MigError as exc:
                raise MigError(f"device {target.name}: {exc}", exc.nvml_error) from exc
        return created, record

    async def _stage_step(self, record: ClaimRecord, i: int, step: MigStep) -> ClaimRecord:
        steps = list(record.mig_steps)
        steps[i] = step
        record = record.evolve(mig_steps=tuple(steps))
        async with self.journal.state_lock:
            self.journal.stage(record.uid, record)
        await self.journal.commit()
        return record

    async def _create_one(
        self, ref: ClaimRef, record: ClaimRecord, i: int, target: MigTarget
    ) -> tuple[MigDevice, ClaimRecord]:
        """GPU instance, its ID on record, compute instance, its ID and the MIG UUID on record."""
        assert self.mig is not None
        gpu, placement = target.gpu, target.placement
        gi_id = await asyncio.to_thread(self.mig.create_gpu_instance, gpu.uuid, placement)
        step = replace(record.mig_steps[i], gi_id=gi_id, step=MIG_GPU_INSTANCE)
        record = await self._stage_step(record, i, step)
        failpoints.hit(failpoints.MIG_AFTER_GPU_INSTANCE)
        ci_id = await asyncio.to_thread(self.mig.create_compute_instance, gpu.uuid, gi_id, placement)
        failpoints.hit(failpoints.MIG_AFTER_COMPUTE_INSTANCE)
        mig = await asyncio.to_thread(self.mig.mig_device, gpu.uuid, gi_id, ci_id, placement)
        step = replace(step, ci_id=ci_id, uuid=mig.uuid, step=MIG_READY)
        record = await self._stage_step(record, i, step)
        log.info(
            "mig instance created claim=%s device=%s gpu=%s gi=%d ci=%d uuid=%s",
            ref,
            target.name,
            gpu.uuid,
            gi_id,
            ci_id,
            mig.uuid,
        )
        return mig, record

    # -- destroy ---------------------------------------------------------------------------------

    async def destroy(self, record: ClaimRecord) -> None:
        """`destroy_now` in a worker thread; a failure is the claim's PrepareError."""
        try:
            await asyncio.to_thread(self.destroy_now, record)
        except MigError as exc:
            raise PrepareError(f"claim {record.ref()}: {exc}") from exc

    def destroy_now(self, record: ClaimRecord) -> None:
        """Destroy the instances a claim's record holds (last made first). An instance recorded
        as planned may exist without its ID on record: the one at that placement is it, unless
        another claim records it."""
        if not record.mig_steps:
            return
        assert self.mig is not None
        for m in reversed(record.mig_steps):
            gi_id = m.gi_id
            if gi_id is None:
                others = self.recorded_gpu_instances(exclude=record.uid)
                live = self.mig.instances(m.parent_uuid)
                found = [
                    i
                    for i in live
                    if (i.profile_id, i.start) == (m.profile_id, m.start)
                    and (m.parent_uuid, i.gi_id) not in others
                ]
                if not found:
                    continue
                gi_id = found[0].gi_id
            if self.mig.destroy(m.parent_uuid, gi_id, m.profile_id, m.start):
                log.info(
                    "mig instance of claim destroyed claim=%s device=%s gi=%s", record.ref(), m.device, gi_id
                )

    def recorded_gpu_instances(self, exclude: str | None = None) -> set[tuple[str, int]]:
        return {
            (m.parent_uuid, m.gi_id)
            for r in self.journal.records()
            if r.uid != exclude
            for m in r.mig_steps
            if m.gi_id is not None
        }

    def made_instances(self) -> dict[tuple[str, int], str]:
        """(GPU UUID, GPU-instance ID) -> the placement device whose instance it is, for every
        instance a claim records (health: an event NVML attributes to it taints that device)."""
        return {
            (m.parent_uuid, m.gi_id): m.device
            for r in self.journal.records()
            for m in r.mig_steps
            if m.gi_id is not None
        }

    def destroy_orphans(self) -> int:
        """Destroy MIG instances on dynamic-MIG GPUs that no claim records, unless in use."""
        if self.mig is None:
            return 0
        known = self.recorded_gpu_instances()
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

    def found_on_gpu(self, names: list[str]) -> dict[str, MigDevice]:
        """Of the placements `names`, those with an instance made on the GPU (for the rebuild)."""
        made: dict[str, MigDevice] = {}
        if not names or self.mig is None:
            return made
        for name in names:
            gpu, placement = self.placements[name]
            at = (placement.profile.profile_id, placement.start)
            for inst in self.mig.instances(gpu.uuid):
                if (inst.profile_id, inst.start) == at and inst.ci_ids:
                    made[name] = self.mig.mig_device(gpu.uuid, inst.gi_id, inst.ci_ids[0], placement)
                    break
        return made
