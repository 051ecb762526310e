"""Dynamic MIG's binding conditions: make a claim's MIG instances between allocation and binding.

A MIG placement is published with the binding condition MigInstanceReady (and the failure
condition MigInstanceFailed). When the scheduler allocates one, it writes the allocation and waits
(in PreBind) before binding the pod. This watcher sees the allocation, makes the instances
(Preparer.bind, checkpointed like a prepare) and reports the outcome in the claim's
`status.devices`: Ready lets the scheduler bind the pod, Failed makes it give the allocation up and
schedule the pod again, instead of the pod waiting in ContainerCreating on a prepare that fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from dra_gpu.kube.api import Kube, KubeError
from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.model.inventory import MigDevice
from dra_gpu.node.dynamic_mig import FAILED_CONDITION, READY_CONDITION
from dra_gpu.plugin.allocation import Allocation
from dra_gpu.plugin.plan import BusyPrepareError, PrepareError
from dra_gpu.plugin.prepare import Preparer

log = logging.getLogger(__name__)

HTTP_CONFLICT = 409
MAX_MESSAGE = 32768  # metav1.Condition.message
REPORT_ATTEMPTS = 5
DEPARTING_WAIT = 60.0  # seconds to wait for an instance of a deleted claim to be unprepared
RETRY_SECONDS = 1.0


class MigBinder:
    """Looks at every ResourceClaim event (`on_list` / `on_event`, subscribed to the plugin's claim
    watch, claim_cache.ClaimCache) for dynamic MIG devices of this node waiting on their condition."""

    def __init__(
        self,
        driver: str,
        node: str,
        preparer: Preparer,
        kube: Kube,
        hold: Callable[[str], AbstractAsyncContextManager[None]] | None = None,
    ) -> None:
        self.driver = driver
        self.node = node
        self.preparer = preparer
        self.kube = kube
        # Held around each call that makes or destroys instances: during a rolling update both
        # instances of the plugin see the same claims (the plugin's instance lock), and the
        # second finds the first's record (re-read under it) instead of making another.
        self.hold = hold or (lambda what: contextlib.nullcontext())
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self.departing_wait = DEPARTING_WAIT

    def waiting(self, claim: dict[str, Any]) -> list[str]:
        """This node's devices of the claim that wait for their binding condition."""
        allocation = Allocation.of(claim)
        # A condition from before this allocation (an earlier, given-up one) does not count.
        since = allocation.timestamp
        reported = {
            str(d.get("device"))
            for d in (claim.get("status") or {}).get("devices") or []
            if d.get("driver") == self.driver
            and d.get("pool") == self.node
            and any(
                c.get("type") in (READY_CONDITION, FAILED_CONDITION)
                and c.get("status") == "True"
                and str(c.get("lastTransitionTime") or "") >= since
                for c in d.get("conditions") or []
            )
        }
        return [
            r.device
            for r in allocation.results_for(self.driver, self.node)
            if READY_CONDITION in r.binding_conditions and r.device not in reported
        ]

    async def on_list(self, items: list[dict[str, Any]], _version: str) -> None:
        for claim in items:
            self._consider(claim)

    async def on_event(self, kind: str, claim: dict[str, Any]) -> bool:
        if kind in ("ADDED", "MODIFIED"):
            self._consider(claim)
        return True

    def _consider(self, claim: dict[str, Any]) -> None:
        meta = claim.get("metadata") or {}
        uid = str(meta.get("uid", ""))
        if not self.waiting(claim) or uid in self._inflight:
            return
        ref = ClaimRef(str(meta.get("namespace", "")), uid, str(meta.get("name", "")))
        task = asyncio.create_task(self._bind(ref, claim), name=f"mig-bind-{uid}")
        self._inflight[uid] = task
        task.add_done_callback(lambda _t: self._inflight.pop(uid, None))

    async def _bind(self, ref: ClaimRef, claim: dict[str, Any]) -> None:
        devices = self.waiting(claim)
        try:
            made = await self._bind_when_free(ref, claim)
            outcome = {d: (True, f"MIG device {made[d].uuid}") for d in devices if d in made}
            outcome.update({d: (False, "no MIG instance was made for it") for d in devices if d not in made})
        except PrepareError as exc:
            log.warning("mig instance for binding failed claim=%s error=%s", ref, exc)
            outcome = {d: (False, str(exc)) for d in devices}
        except Exception as exc:  # the claim's pod must not wait for the binding timeout
            log.error("mig binding failed claim=%s error=%r", ref, str(exc))
            outcome = {d: (False, f"dra-gpu: {exc}") for d in devices}
        try:
            await self._report(ref, outcome)
        except Exception as exc:
            log.error("mig binding condition not reported claim=%s error=%r", ref, str(exc))

    async def _bind_when_free(self, ref: ClaimRef, claim: dict[str, Any]) -> dict[str, MigDevice]:
        """Preparer.bind, retried while the placement is still held by a claim on its way out
        (deleted before the kubelet unprepared it); the scheduler waits minutes for the condition."""
        deadline = time.monotonic() + self.departing_wait
        while True:
            try:
                async with self.hold("a dynamic MIG binding"):
                    return await self.preparer.bind(ref, claim)
            except BusyPrepareError:
                if not self.preparer.held_by_another_claim(ref, claim):
                    raise
                async with self.hold("a dynamic MIG binding"):
                    released = await self.preparer.release_gone_holders(ref, claim)
                if released:
                    continue  # the holder's claim was gone: its instance went, bind now
                if time.monotonic() >= deadline:
                    raise
                log.info("mig placement still held by a departing claim, waiting claim=%s", ref)
                await asyncio.sleep(RETRY_SECONDS)

    async def _report(self, ref: ClaimRef, outcome: dict[str, tuple[bool, str]]) -> None:
        """Set the condition of each device in status.devices (optimistic: retried on a conflict)."""
        for _ in range(REPORT_ATTEMPTS):
            claim = await self.kube.get_claim(ref.namespace, ref.name)
            if claim is None or claim["metadata"].get("uid") != ref.uid:
                return  # gone; the sweeper undoes what was made
            still = set(self.waiting(claim)) & set(outcome)
            if not still:
                return
            # Never older than the allocation it answers (`waiting` ignores those): a node clock
            # behind the apiserver's would otherwise have the binder answer its own write again
            # at every event of the claim until the clock caught up.
            now = max(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), Allocation.of(claim).timestamp)
            entries = [
                d
                for d in (claim.get("status") or {}).get("devices") or []
                if not (
                    d.get("driver") == self.driver and d.get("pool") == self.node and d.get("device") in still
                )
            ]
            for device in sorted(still):
                ok, message = outcome[device]
                entries.append(
                    {
                        "driver": self.driver,
                        "pool": self.node,
                        "device": device,
                        "conditions": [
                            {
                                "type": READY_CONDITION if ok else FAILED_CONDITION,
                                "status": "True",
                                "reason": "InstanceCreated" if ok else "InstanceCreationFailed",
                                "message": message[:MAX_MESSAGE],
                                "lastTransitionTime": now,
                            }
                        ],
                    }
                )
            # An update of the claim as read (its resourceVersion: a concurrent change is a 409),
            # not a patch: an apiserver (1.37.2) refuses every patch of the status of a claim
            # whose allocation holds an opaque config (dra_gpu/health/claim_status.py).
            claim.setdefault("status", {})["devices"] = entries
            try:
                await self.kube.replace_claim_status(ref.namespace, ref.name, claim)
            except KubeError as exc:
                if exc.status == HTTP_CONFLICT:
                    continue
                raise
            log.info(
                "mig binding condition reported claim=%s %s",
                ref,
                " ".join(f"{d}={'ready' if outcome[d][0] else 'failed'}" for d in sorted(still)),
            )
            return
        raise RuntimeError(f"claim {ref}: status kept changing; condition not reported")

    async def stop(self) -> None:
        for task in list(self._inflight.values()):
            task.cancel()
