"""The claim's `status.devices` (KEP-4817): for each device the plugin prepared, what it is (`data`:
UUID, product, index, minor, MIG profile) and two conditions, `Ready` (prepared) and `Healthy`
(follows the health monitor), and for a memory share `MemoryLimitEnforced` (True: the driver
holds its container to the share's size; False: only its MPS daemon's limit, cooperative), so
`kubectl get resourceclaim -o yaml` says which GPU a workload got and whether it is still healthy.

Written with server-side apply to the status subresource (field manager = the driver name), which
owns exactly this driver's entries. An apiserver (seen on 1.37.2) refuses every patch (apply, merge
or JSON patch, whoever sends it) to the status of a claim whose allocation holds an opaque config
(a time-sliced or MPS claim, any claim with a GpuConfig): `status.allocation: Invalid value: null:
field cannot be modified once set`; an update of the claim as read is accepted, so such a claim's
entries are written by read, change our entries, update (its resourceVersion guards against a
concurrent writer: a 409 is retried). Best effort, in the background: a failure is logged, never fails
or delays a prepare. A prepare's status is written PREPARED_DELAY_S after it, and once no prepare
has been in flight for QUIET_AFTER_S (at most QUIET_WAIT_S later), so that the write (and the
apiserver's and etcd's work for it) does not compete with the prepares of the same pod start or
burst, whose calls follow each other with gaps of a millisecond; a claim unprepared before then
writes nothing. A write that falls in an apiserver outage is retried with backoff for up to
STATUS_RETRY_SECONDS, and a newer write for the same claim replaces it; a missing permission (the
chart's `kubeletPlugin.claimStatusWrites`) is logged once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential, wait_random

from dra_gpu.health.manager import HealthManager
from dra_gpu.kube.api import Kube, KubeError, wait_retry_after
from dra_gpu.node.catalog import DeviceCatalog

log = logging.getLogger(__name__)

HTTP_FORBIDDEN, HTTP_NOT_FOUND, HTTP_CONFLICT, HTTP_UNPROCESSABLE = 403, 404, 409, 422
STATUS_RETRY_SECONDS = 300.0
# A health change waits this long for the statuses it causes, then lets them finish on their own.
SYNC_WAIT_SECONDS = 2.0
PREPARED_DELAY_S = 0.2
QUIET_WAIT_S = 5.0  # a node that never stops preparing still gets its statuses
QUIET_AFTER_S = 0.1  # "quiet": no prepare or unprepare for this long, not just between two calls
# A burst's statuses queue on a few connections: a burst of 100 writes opened all 16 the client's
# pool allows and kept them after it, each with its TLS buffers (asyncio's read buffer, OpenSSL's;
# ~4 MB in all, bench/RESULTS.md).
WRITES_IN_FLIGHT = 4
# A memory share's condition: True when the driver holds its container's cgroup to the share's size.
MEMORY_LIMIT_CONDITION = "MemoryLimitEnforced"


def _patch_refused(exc: KubeError) -> bool:
    """The apiserver refused a patch of the status of a claim whose allocation holds an opaque
    config, which an update of the claim as read passes (see the module's docstring)."""
    return (
        exc.status == HTTP_UNPROCESSABLE and "status.allocation" in exc.message and "once set" in exc.message
    )


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, KubeError):
        return exc.status >= 500 or exc.status == HTTP_CONFLICT or exc.status == 429
    return isinstance(exc, OSError | asyncio.TimeoutError)


def rfc3339(wall: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))


class ClaimStatusWriter:
    def __init__(
        self,
        kube: Kube,
        driver_name: str,
        catalog: DeviceCatalog,
        health: HealthManager | None,
        prepared_claims: Callable[[], list[tuple[str, str, str, list[dict[str, Any]]]]],
        retry_initial: float = 0.2,
        prepared_delay: float = PREPARED_DELAY_S,
    ) -> None:
        """`catalog`: the node's devices (a device it does not list gets no status entry);
        `prepared_claims`: (namespace, name, uid, ClaimRecord.status_devices())."""
        self.kube = kube
        self.driver = driver_name
        self.health = health
        self.prepared_claims = prepared_claims
        self.catalog = catalog
        self._written: dict[str, str] = {}  # claim uid -> the status last applied (JSON)
        # claim uid -> (device, condition type) -> (its status, since when)
        self._since: dict[str, dict[tuple[str, str], tuple[str, float]]] = {}
        self._forbidden_said = False
        self._retry_initial = retry_initial
        self._prepared_delay = prepared_delay
        self._in_flight = 0
        self._calls = 0  # prepares and unprepares started: a quiet timer is stale once it moved
        self._sending: set[asyncio.Future[Any]] = set()  # writes on the wire
        self._draining: set[asyncio.Future[Any]] = set()  # those of claims since unprepared
        self._quiet = asyncio.Event()
        self._quiet.set()
        self._pending: dict[str, asyncio.Task[None]] = {}  # claim uid -> its write in flight
        self._wire = asyncio.Semaphore(WRITES_IN_FLIGHT)

    def data(self, device: str, mig_uuid: str | None = None) -> dict[str, Any]:
        """`mig_uuid`: a dynamic-MIG device's instance, as its claim's record has it."""
        d = self.catalog[device]
        gpu = d.gpu
        uuid = d.mig.uuid if d.mig is not None else mig_uuid if d.is_mig else gpu.uuid
        out: dict[str, Any] = {"productName": gpu.product_name, "index": gpu.index, "minor": gpu.minor}
        if uuid is not None:
            out = {"uuid": uuid, **out}
        if d.is_mig:
            out.update(migProfile=d.profile, parentUUID=gpu.uuid)
        return out

    def _condition(
        self, uid: str, device: str, ctype: str, ok: bool, reason: str, message: str
    ) -> dict[str, Any]:
        status = "True" if ok else "False"
        since = self._since.setdefault(uid, {})
        last = since.get((device, ctype))
        if last is None or last[0] != status:
            last = since[(device, ctype)] = (status, time.time())
        return {
            "type": ctype,
            "status": status,
            "reason": reason,
            "message": message[:1024],
            "lastTransitionTime": rfc3339(last[1]),
        }

    def body(self, namespace: str, name: str, uid: str, devices: Sequence[dict[str, Any]]) -> dict[str, Any]:
        verdicts = self.health.health() if self.health is not None else {}
        entries = []
        for d in devices:
            device = str(d["deviceName"])
            if device not in self.catalog:
                continue
            healthy, message = verdicts.get(device, (True, ""))
            entry: dict[str, Any] = {
                "driver": self.driver,
                "pool": str(d["poolName"]),
                "device": device,
                "data": self.data(device, d.get("migUUID")),
                "conditions": [
                    self._condition(uid, device, "Ready", True, "Prepared", "prepared on the node"),
                    self._condition(
                        uid,
                        device,
                        "Healthy",
                        healthy,
                        "DeviceHealthy" if healthy else "DeviceUnhealthy",
                        message or ("the GPU passes its health checks" if healthy else "unhealthy"),
                    ),
                ],
            }
            if d.get("shareId"):
                entry["shareID"] = d["shareId"]
            limit = d.get("memoryLimit")
            if isinstance(limit, dict):  # a memory share: what holds it to its size
                by_driver = limit.get("enforcedBy") == "driver"
                entry["data"]["memoryLimitEnforcedBy"] = "driver" if by_driver else "cooperative"
                entry["conditions"].append(
                    self._condition(
                        uid,
                        device,
                        MEMORY_LIMIT_CONDITION,
                        by_driver,
                        "DriverMemoryLimit" if by_driver else "CooperativeMpsLimit",
                        str(limit.get("reason", ""))
                        if by_driver
                        else "only the MPS daemon's pinned-memory limit holds this share (a client "
                        f"that bypasses MPS is not held to it): {limit.get('reason', '')}",
                    )
                )
            entries.append(entry)
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "status": {"devices": entries},
        }

    async def write(self, namespace: str, name: str, uid: str, devices: Sequence[dict[str, Any]]) -> None:
        body = self.body(namespace, name, uid, devices)
        encoded = json.dumps(body, sort_keys=True)
        if self._written.get(uid) == encoded:
            return
        task = asyncio.current_task()
        try:
            async for attempt in AsyncRetrying(
                wait=wait_retry_after(
                    wait_exponential(multiplier=self._retry_initial, max=10)
                    + wait_random(0, self._retry_initial)
                ),
                stop=stop_after_delay(STATUS_RETRY_SECONDS),
                retry=retry_if_exception(_transient),
                reraise=True,
            ):
                with attempt:
                    async with self._wire:
                        if task is not None:  # on the wire from here (see `unprepared`)
                            self._sending.add(task)
                        try:
                            await self.kube.apply_claim_status(namespace, name, body, self.driver)
                        except KubeError as exc:
                            if not _patch_refused(exc):
                                raise
                            await self._update(namespace, name, uid, body["status"]["devices"])
            self._written[uid] = encoded
        except KubeError as exc:
            if exc.status == HTTP_FORBIDDEN:
                if not self._forbidden_said:
                    self._forbidden_said = True
                    log.error(
                        "claim status not written: no permission to patch resourceclaims/status "
                        "(Helm: kubeletPlugin.claimStatusWrites) claim=%s/%s error=%r",
                        namespace,
                        name,
                        exc.message,
                    )
            elif exc.status != HTTP_NOT_FOUND:
                log.warning("claim status not written claim=%s/%s error=%r", namespace, name, str(exc))
        except (TimeoutError, OSError) as exc:
            log.warning("claim status not written claim=%s/%s error=%r", namespace, name, str(exc))
        finally:
            if task is not None:
                self._sending.discard(task)

    async def _update(self, namespace: str, name: str, uid: str, entries: list[dict[str, Any]]) -> None:
        """Write `entries` as this driver's entries of the claim's status.devices by an update of
        the claim as read: every other entry kept, in its order (another driver's, or this
        driver's of another node: the node-scoped policy checks both); a claim gone or
        re-created under the same name is left alone."""
        claim = await self.kube.get_claim(namespace, name)
        if claim is None or (claim.get("metadata") or {}).get("uid") != uid:
            return
        ours = {(e["driver"], e["pool"]) for e in entries}
        status = claim.setdefault("status", {})
        kept = [e for e in status.get("devices") or [] if (e.get("driver"), e.get("pool")) not in ours]
        status["devices"] = kept + entries
        await self.kube.replace_claim_status(namespace, name, claim)

    def prepared(self, namespace: str, name: str, uid: str, devices: Sequence[dict[str, Any]]) -> None:
        """In the background, a moment later: a prepare does not wait for its status."""
        self._schedule(namespace, name, uid, devices, self._prepared_delay)

    @contextlib.contextmanager
    def preparing(self) -> Iterator[None]:
        """Around each prepare and unprepare: statuses wait while any is in flight."""
        self._in_flight += 1
        self._calls += 1
        self._quiet.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                asyncio.get_running_loop().call_later(QUIET_AFTER_S, self._quiet_if_still_idle, self._calls)

    def _quiet_if_still_idle(self, calls: int) -> None:
        if self._in_flight == 0 and self._calls == calls:
            self._quiet.set()

    async def _write_later(
        self, delay: float, namespace: str, name: str, uid: str, devices: Sequence[dict[str, Any]]
    ) -> None:
        await asyncio.sleep(delay)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._quiet.wait(), QUIET_WAIT_S)
        await self.write(namespace, name, uid, devices)

    def _schedule(
        self, namespace: str, name: str, uid: str, devices: Sequence[dict[str, Any]], delay: float = 0.0
    ) -> asyncio.Task[None]:
        old = self._pending.pop(uid, None)
        if old is not None:
            old.cancel()  # what it would write is out of date
        write = (
            self._write_later(delay, namespace, name, uid, devices)
            if delay
            else self.write(namespace, name, uid, devices)
        )
        task = asyncio.create_task(write, name=f"claim-status-{uid}")
        self._pending[uid] = task

        def forget(done: asyncio.Task[None]) -> None:
            if self._pending.get(uid) is done:
                del self._pending[uid]

        task.add_done_callback(forget)
        return task

    def unprepared(self, uid: str) -> None:
        task = self._pending.pop(uid, None)
        if task is not None and task in self._sending:
            # Already on the wire: cancelling it would close its (TLS) connection, and the next
            # write would pay for a new one. It lands, then is forgotten.
            self._draining.add(task)

            def landed(done: asyncio.Future[Any]) -> None:
                self._draining.discard(done)
                self._forget(uid)

            task.add_done_callback(landed)
        elif task is not None:
            task.cancel()
        self._forget(uid)

    def _forget(self, uid: str) -> None:
        self._written.pop(uid, None)
        self._since.pop(uid, None)

    async def sync(self) -> None:
        """Every prepared claim's status as it should be now (after a health change, at start)."""
        tasks = [self._schedule(*claim) for claim in self.prepared_claims()]
        if tasks:
            await asyncio.wait(tasks, timeout=SYNC_WAIT_SECONDS)

    async def close(self) -> None:
        tasks = [*self._pending.values(), *self._draining]
        self._pending.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
