"""Rebuild the checkpoint's records after it was found corrupt, before the plugin serves.

Without this, a corrupt checkpoint left the plugin with no records, and the start-up reconcile
then deleted the CDI spec of every claim still running ("owned by no claim"): a container
restarted in such a pod could not get its devices, and the plugin no longer knew which devices
were held. What survives the file is enough to rebuild it:

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
from typing import Any, Protocol

from tenacity import AsyncRetrying, RetryError, stop_after_delay, wait_exponential, wait_random

from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.model import MigDevice
from dra_gpu.plugin.checkpoint import BOUND, COMPLETED, CheckpointRebuildError
from dra_gpu.plugin.compute_mode import DEFAULT
from dra_gpu.plugin.mig_lifecycle import MigError
from dra_gpu.plugin.prepare import MIG_READY, PrepareError, Preparer
from dra_gpu.plugin.sharing import SharingPlan

log = logging.getLogger(__name__)

API_DEADLINE = 120.0  # seconds of retries before the plugin gives up (and restarts)


class ClaimLister(Protocol):
    async def list_claims(self) -> list[dict[str, Any]]: ...


async def rebuild(preparer: Preparer, lister: ClaimLister, deadline: float = API_DEADLINE) -> dict[str, int]:
    """Rebuild the records of a checkpoint marked `rebuildPending`; counts of what was done."""
    try:
        async for attempt in AsyncRetrying(
            wait=wait_exponential(multiplier=0.5, max=10) + wait_random(0, 0.5),
            stop=stop_after_delay(deadline),
            reraise=False,
        ):
            with attempt:
                claims = await lister.list_claims()
    except RetryError as exc:
        error = exc.last_attempt.exception()
        raise CheckpointRebuildError(
            f"the checkpoint was corrupt and its records cannot be rebuilt: listing ResourceClaims "
            f"failed for {deadline:.0f}s ({error}); nothing was removed, the next start tries again"
        ) from exc
    return await asyncio.to_thread(_rebuild_from, preparer, claims)  # files and NVML: blocking


def _allocated_here(preparer: Preparer, claim: dict[str, Any]) -> bool:
    alloc = (claim.get("status") or {}).get("allocation") or {}
    return any(
        r.get("driver") == preparer.driver and r.get("pool") == preparer.node_name
        for r in (alloc.get("devices") or {}).get("results") or []
    )


def _rebuild_from(preparer: Preparer, claims: list[dict[str, Any]]) -> dict[str, int]:
    counts = {"rebuiltClaims": 0, "rebuiltBound": 0, "specsUnconfirmed": 0, "notRebuilt": 0}
    here = {
        str(c["metadata"]["uid"]): c
        for c in claims
        if (c.get("metadata") or {}).get("uid") and _allocated_here(preparer, c)
    }
    specs = preparer.cdi.owned()
    for uid in sorted(set(specs) | set(here)):
        claim = here.get(uid)
        if claim is None:
            counts["specsUnconfirmed"] += 1
            log.warning("CDI spec of a claim the API no longer allocates here, not rebuilt uid=%s", uid)
            continue
        meta = claim["metadata"]
        ref = ClaimRef(str(meta.get("namespace", "")), uid, str(meta.get("name", "")))
        try:
            state = _rebuild_claim(preparer, ref, claim, has_spec=uid in specs)
        except (PrepareError, MigError) as exc:
            counts["notRebuilt"] += 1
            log.error("claim's record could not be rebuilt claim=%s error=%s", ref, exc)
            continue
        if state == COMPLETED:
            counts["rebuiltClaims"] += 1
        elif state == BOUND:
            counts["rebuiltBound"] += 1
    preparer.checkpoint.rebuilt()
    summary = " ".join(f"{k}={v}" for k, v in counts.items())
    log.warning("checkpoint rebuilt from the CDI specs and the API %s", summary)
    return counts


def _made_instances(preparer: Preparer, claim: dict[str, Any]) -> tuple[dict[str, MigDevice], int]:
    """The claim's dynamic MIG devices found made on the GPU, and how many it was allocated."""
    alloc = (claim.get("status") or {}).get("allocation") or {}
    wanted = [
        str(r.get("device"))
        for r in (alloc.get("devices") or {}).get("results") or []
        if r.get("driver") == preparer.driver
        and r.get("pool") == preparer.node_name
        and str(r.get("device")) in preparer.placements
    ]
    made: dict[str, MigDevice] = {}
    if not wanted or preparer.mig is None:
        return made, len(wanted)
    for name in wanted:
        gpu, placement = preparer.placements[name]
        at = (placement.profile.profile_id, placement.start)
        for inst in preparer.mig.instances(gpu.uuid):
            if (inst.profile_id, inst.start) == at and inst.ci_ids:
                made[name] = preparer.mig.mig_device(gpu.uuid, inst.gi_id, inst.ci_ids[0], placement)
                break
    return made, len(wanted)


def _rebuild_claim(preparer: Preparer, ref: ClaimRef, claim: dict[str, Any], has_spec: bool) -> str | None:
    """Stage the claim's record as prepare would have written it; the state recorded, or None."""
    made, wanted = _made_instances(preparer, claim)
    if not has_spec and (not wanted or len(made) < wanted):
        return None  # not prepared here: the kubelet prepares it when it needs it
    if len(made) < wanted:
        raise PrepareError(f"{wanted - len(made)} of its MIG instances are not on the GPU any more")
    devices, spec, _, targets, sharing = preparer._plan(ref, claim, made if wanted else {})
    if targets or spec is None:
        raise PrepareError("its allocation names devices that do not exist")
    entry: dict[str, Any] = {
        "state": COMPLETED if has_spec else BOUND,
        "namespace": ref.namespace,
        "name": ref.name,
        "devices": [d.to_dict() for d in devices],
        "cdiSpec": spec if has_spec else None,
        "driverFiles": preparer.driver_files.digest,
        "rebuilt": True,  # for the operator: this record came from the specs and the API
    }
    if made:
        entry["migInstances"] = [
            {
                "device": name,
                "parentUUID": preparer.placements[name][0].uuid,
                "profileId": mig.gi_profile_id,
                "start": mig.placement_start,
                "size": mig.placement_size,
                "step": MIG_READY,
                "giId": mig.gpu_instance_id,
                "ciId": mig.compute_instance_id,
                "uuid": mig.uuid,
            }
            for name, mig in made.items()
        ]
    if has_spec and sharing.record:
        entry["sharing"] = _as_applied(sharing)
    preparer._check_conflicts(ref, devices, sharing if has_spec else SharingPlan())
    preparer.checkpoint.stage(ref.uid, entry)
    log.warning("claim's record rebuilt claim=%s state=%s devices=%s", ref, entry["state"], len(devices))
    return str(entry["state"])


def _as_applied(sharing: SharingPlan) -> dict[str, Any]:
    """The sharing record as apply() leaves it: what a compute mode was before is not known any
    more; DEFAULT, the driver's own default, is restored when the claim goes."""
    record = dict(sharing.record)
    modes = record.get("computeModes")
    if modes:
        record["computeModes"] = {uuid: {**m, "previous": DEFAULT} for uuid, m in modes.items()}
    return record
