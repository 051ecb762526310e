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
from dra_gpu.plugin.allocation import Allocation
from dra_gpu.plugin.checkpoint import CheckpointRebuildError
from dra_gpu.plugin.claim_sharing import as_applied
from dra_gpu.plugin.mig_lifecycle import MigError
from dra_gpu.plugin.plan import PrepareError
from dra_gpu.plugin.prepare import Preparer
from dra_gpu.plugin.record import ClaimState

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


def _rebuild_from(preparer: Preparer, claims: list[dict[str, Any]]) -> dict[str, int]:
    counts = {"rebuiltClaims": 0, "rebuiltBound": 0, "specsUnconfirmed": 0, "notRebuilt": 0}
    here = {
        str(c["metadata"]["uid"]): c
        for c in claims
        if (c.get("metadata") or {}).get("uid")
        and Allocation.of(c).results_for(preparer.driver, preparer.node_name)
    }
    specs = preparer.journal.cdi.owned()
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
        if state == ClaimState.COMPLETED:
            counts["rebuiltClaims"] += 1
        elif state == ClaimState.BOUND:
            counts["rebuiltBound"] += 1
    preparer.journal.rebuilt()
    summary = " ".join(f"{k}={v}" for k, v in counts.items())
    log.warning("checkpoint rebuilt from the CDI specs and the API %s", summary)
    return counts


def _rebuild_claim(preparer: Preparer, ref: ClaimRef, claim: dict[str, Any], has_spec: bool) -> str | None:
    """Stage the claim's record as prepare would have written it; the state recorded, or None."""
    wanted = preparer.planner.placements_of(claim)
    made = preparer.instances.found_on_gpu(wanted)
    if not has_spec and (not wanted or len(made) < len(wanted)):
        return None  # not prepared here: the kubelet prepares it when it needs it
    if len(made) < len(wanted):
        raise PrepareError(f"{len(wanted) - len(made)} of its MIG instances are not on the GPU any more")
    plan = preparer.planner.plan(ref, claim, made)
    if plan.targets or plan.spec is None:
        raise PrepareError("its allocation names devices that do not exist")
    state = ClaimState.COMPLETED if has_spec else ClaimState.BOUND
    record = plan.record(ref, state, preparer.driver_files.digest, preparer.instances.ready_steps(made))
    record = record.evolve(
        cdi_spec=plan.spec if has_spec else None,
        sharing=as_applied(plan.sharing.record) if has_spec and plan.sharing.record else None,
        rebuilt=True,  # for the operator: this record came from the specs and the API
    )
    preparer.journal.check_free(ref, plan.exclusive, plan.sharing.record if has_spec else {})
    preparer.journal.stage_rebuilt(record)
    log.warning("claim's record rebuilt claim=%s state=%s devices=%s", ref, state, len(plan.devices))
    return str(state)
