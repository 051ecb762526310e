"""The DRA node service (NodePrepareResources / NodeUnprepareResources), v1 and v1beta1.

Both API versions call into one NodeService; only the message module differs. Each claim of a
kubelet batch is read (ClaimFetcher: its UID checked) and goes to the driver concurrently, and gets
its own answer: a ClaimError's message, or "internal error: ..." for anything else, so a bug fails
one claim rather than the whole batch.

A batch's work on the driver runs under the instance lock (instance_lock: with rolling updates the
other instance of the plugin waits meanwhile); the claims are read before it, as the Go helper
does, and an empty batch (the liveness self-check's) does not take it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from dra_gpu.common.log_format import V
from dra_gpu.kubeletplugin._proto import dra_v1_pb2 as v1_pb
from dra_gpu.kubeletplugin._proto import dra_v1_pb2_grpc as v1_grpc
from dra_gpu.kubeletplugin._proto import dra_v1beta1_pb2 as v1beta1_pb
from dra_gpu.kubeletplugin._proto import dra_v1beta1_pb2_grpc as v1beta1_grpc
from dra_gpu.kubeletplugin.claims import ClaimFetcher
from dra_gpu.kubeletplugin.driver import ClaimError, ClaimRef, Device, Driver
from dra_gpu.kubeletplugin.heap_trim import HeapTrimmer
from dra_gpu.kubeletplugin.instance_lock import InstanceLock, InstanceLockTimeout
from dra_gpu.kubeletplugin.metrics import PluginMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")


class NodeService:
    def __init__(
        self,
        driver: Driver,
        claims: ClaimFetcher,
        metrics: PluginMetrics,
        heap: HeapTrimmer | None = None,
        lock: InstanceLock | None = None,
    ) -> None:
        self.driver = driver
        self.claims = claims
        self.metrics = metrics
        self.heap = heap or HeapTrimmer()
        self.lock = lock or InstanceLock(None)
        # Counted when scraped, not after every call: a count over all claims per call was
        # quadratic in a burst.
        metrics.prepared_devices.set_function(driver.prepared_device_count)

    async def _one(
        self, operation: str, ref: ClaimRef, call: Callable[[ClaimRef], Awaitable[T]]
    ) -> tuple[T | None, str]:
        start = time.perf_counter()
        self.heap.started()
        try:
            result = await call(ref)
            self.metrics.requests.labels(operation, "success").inc()
            return result, ""
        except ClaimError as exc:
            self.metrics.requests.labels(operation, "error").inc()
            log.warning("%s failed claim=%s error=%r", operation, ref, str(exc))
            return None, str(exc)
        except Exception as exc:  # a bug must fail one claim, not the kubelet's whole batch
            self.metrics.requests.labels(operation, "error").inc()
            log.exception("%s failed unexpectedly claim=%s", operation, ref)
            return None, f"internal error: {exc}"
        finally:
            self.heap.finished()
            self.metrics.latency.labels(operation).observe(time.perf_counter() - start)

    async def _locked(
        self, operation: str, refs: list[ClaimRef], call: Callable[[ClaimRef], Awaitable[T]]
    ) -> list[tuple[T | None, str]]:
        """`call` for every claim under the instance lock; each claim fails with the lock's error
        when the other instance kept it too long."""
        if not refs:
            return []
        try:
            async with self.lock.hold(f"{operation} of {len(refs)} claim(s)"):
                return await _each(refs, lambda r: self._one(operation, r, call))
        except Exception as exc:  # the lock's (each claim's own are answered by _one)
            error = str(exc) if isinstance(exc, InstanceLockTimeout) else f"internal error: {exc}"
            log.warning("%s not done claims=%s error=%r", operation, ",".join(map(str, refs)), error)
            self.metrics.requests.labels(operation, "error").inc(len(refs))
            return [(None, error) for _ in refs]

    async def _fetch(self, ref: ClaimRef) -> tuple[Mapping[str, Any] | None, str]:
        """The claim the kubelet names (before the lock: the API's time is not the lock's)."""
        try:
            return await self.claims.fetch(ref), ""
        except ClaimError as exc:
            self.metrics.requests.labels("prepare", "error").inc()
            log.warning("prepare failed claim=%s error=%r", ref, str(exc))
            return None, str(exc)
        except Exception as exc:
            self.metrics.requests.labels("prepare", "error").inc()
            log.exception("prepare failed unexpectedly claim=%s", ref)
            return None, f"internal error: {exc}"

    async def prepare(self, request: Any, pb: Any) -> Any:
        start = time.perf_counter()
        refs, ambiguous = _distinct(request.claims)
        fetched = dict(zip((r.uid for r in refs), await _each(refs, self._fetch), strict=True))
        readable = [r for r in refs if not fetched[r.uid][1]]

        async def prepare_one(ref: ClaimRef) -> Sequence[Device]:
            claim = fetched[ref.uid][0]
            assert claim is not None
            return await self.driver.prepare(ref, claim)

        done = await self._locked("prepare", readable, prepare_one)
        outcomes = dict(zip((r.uid for r in readable), done, strict=True))
        response = pb.NodePrepareResourcesResponse()
        for uid, error in ambiguous.items():
            response.claims[uid].error = error
        for ref in refs:
            devices, error = outcomes.get(ref.uid, (None, fetched[ref.uid][1]))
            entry = response.claims[ref.uid]
            if error:
                entry.error = error
                continue
            for d in devices or ():
                entry.devices.append(_device(pb, d))
        _summary("prepare", response, start)
        return response

    async def unprepare(self, request: Any, pb: Any) -> Any:
        start = time.perf_counter()
        refs, ambiguous = _distinct(request.claims)
        outcomes = await self._locked("unprepare", refs, self.driver.unprepare)
        response = pb.NodeUnprepareResourcesResponse()
        for uid, error in ambiguous.items():
            response.claims[uid].error = error
        for ref, (_, error) in zip(refs, outcomes, strict=True):
            response.claims[ref.uid].error = error
        _summary("unprepare", response, start)
        return response


def _summary(operation: str, response: Any, start: float) -> None:
    """At -v=2: each kubelet call, its claims, how many failed and how long it took."""
    if log.isEnabledFor(V(2)):
        claims = response.claims.values()
        log.log(
            V(2),
            "kubelet call operation=%s claims=%d failed=%d seconds=%.3f",
            operation,
            len(claims),
            sum(1 for c in claims if c.error),
            time.perf_counter() - start,
        )


async def _each(refs: list[ClaimRef], call: Callable[[ClaimRef], Awaitable[T]]) -> list[T]:
    """`call` for every claim, concurrently; the usual one-claim batch (one pod, one claim)
    without a task of its own."""
    if len(refs) == 1:
        return [await call(refs[0])]
    return list(await asyncio.gather(*(call(r) for r in refs)))


def _distinct(claims: Any) -> tuple[list[ClaimRef], dict[str, str]]:
    """The batch's claims, each UID once, and an error for each UID named with two different
    claims: the answer is keyed by UID, so one claim's devices and another's error would mix."""
    seen: dict[str, ClaimRef] = {}
    ambiguous: dict[str, str] = {}
    for c in claims:
        ref = ClaimRef(c.namespace, c.uid, c.name)
        first = seen.setdefault(ref.uid, ref)
        if first != ref and ref.uid not in ambiguous:
            ambiguous[ref.uid] = (
                f"claim uid {ref.uid} is named twice in one request, as {first.namespace}/{first.name} "
                f"and as {ref.namespace}/{ref.name}; nothing was done for it"
            )
    return [r for uid, r in seen.items() if uid not in ambiguous], ambiguous


def _device(pb: Any, d: Device) -> Any:
    msg = pb.Device(
        request_names=d.request_names,
        pool_name=d.pool_name,
        device_name=d.device_name,
        cdi_device_ids=d.cdi_device_ids,
    )
    if d.share_id is not None and pb is v1_pb:
        msg.share_id = d.share_id  # v1beta1 has no share_id
    return msg


class DraV1Service(v1_grpc.DRAPluginServicer):  # type: ignore[misc]
    def __init__(self, node: NodeService) -> None:
        self.node = node

    async def NodePrepareResources(self, request: Any, context: Any) -> Any:
        return await self.node.prepare(request, v1_pb)

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        return await self.node.unprepare(request, v1_pb)


class DraV1beta1Service(v1beta1_grpc.DRAPluginServicer):  # type: ignore[misc]
    def __init__(self, node: NodeService) -> None:
        self.node = node

    async def NodePrepareResources(self, request: Any, context: Any) -> Any:
        return await self.node.prepare(request, v1beta1_pb)

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        return await self.node.unprepare(request, v1beta1_pb)
