"""Turns the monitor's observations into device taints and kubelet health, on the event loop.

Observations come from the monitor's threads through a queue; each is mapped to the published
devices it concerns (the node's DeviceCatalog says which: a whole GPU; for a GPU in MIG mode, the
MIG device or dynamic-MIG placement its GPU/compute-instance IDs name, or all of its MIG devices
or placements for a parent-level event), classified, and recorded in the taint book. A change
notifies the subscribers (the slice publisher, the health stream). A periodic tick clears the
taints whose hold-down has passed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from dra_gpu.health.classification import Classifier, Effect, EventKind, Verdict
from dra_gpu.health.monitor import NO_ID, Observation, Seen
from dra_gpu.health.taint_book import TaintBook
from dra_gpu.node.catalog import DeviceCatalog, MadeInstances

log = logging.getLogger(__name__)

RECOVERY_ACTIONS = {
    0: "none",
    1: "gpu-reset",
    2: "node-reboot",
    3: "drain-p2p",
    4: "drain-and-reset",
    5: "recover-imex-domain",
    6: "bus-reset",
    7: "system-reboot",
}


class HealthMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.healthy = Gauge(
            "dra_gpu_device_healthy",
            "1 when the device is untainted and answers its checks, 0 when tainted or lost.",
            ["device"],
            registry=registry,
        )
        self.xids = Counter("dra_gpu_xid_events", "XID events seen, by XID.", ["xid"], registry=registry)
        self.events = Counter(
            "dra_gpu_health_events", "Health events seen, by kind.", ["kind"], registry=registry
        )
        self.nvml_errors = Counter(
            "dra_gpu_health_nvml_errors",
            "Failed NVML calls of the health monitor that were retried (not a lost GPU), by call and error.",
            ["call", "error"],
            registry=registry,
        )
        self.transitions = Counter(
            "dra_gpu_taint_transitions",
            "Device taints added and removed, by effect and cause.",
            ["device", "action", "effect"],
            registry=registry,
        )


class HealthManager:
    def __init__(
        self,
        catalog: DeviceCatalog,
        taint_key: str,
        book: TaintBook,
        classifier: Classifier,
        registry: CollectorRegistry,
        tick: float = 1.0,
        made_instances: Callable[[], MadeInstances] | None = None,
    ) -> None:
        """`made_instances`: the dynamic-MIG instances claims hold now (GPU UUID, GPU-instance
        ID) -> placement device; None: none are made on this node."""
        self.catalog = catalog
        self.made_instances = made_instances
        self.taint_key = taint_key
        self.book = book
        self.classifier = classifier
        self.metrics = HealthMetrics(registry)
        self.tick = tick
        self.lost: set[str] = set()  # GPU UUIDs
        self.unmonitored: set[str] = set()
        self.failing: set[tuple[str, str]] = set()  # (GPU UUID, call) failing since its last answer
        self.queue: asyncio.Queue[Observation] = asyncio.Queue()
        self.subscribers: list[Callable[[], Awaitable[object]]] = []
        self.last_change = 0.0  # monotonic, for the benchmark
        self._loop: asyncio.AbstractEventLoop | None = None
        for name in self.device_names():
            self.metrics.healthy.labels(name).set(0 if name in book.tainted() else 1)

    def device_names(self) -> list[str]:
        return self.catalog.names()

    def gpu_uuids(self) -> list[str]:
        return [g.uuid for g in self.catalog.gpus]

    # -- input ---------------------------------------------------------------------------------

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def sink(self, obs: Observation) -> None:
        """Thread-safe entry for the monitor's threads."""
        assert self._loop is not None, "bind() the manager to the event loop first"
        self._loop.call_soon_threadsafe(self.queue.put_nowait, obs)

    def devices_of(self, obs: Observation) -> list[str]:
        """The devices an observation concerns (DeviceCatalog.reached_by)."""
        gi = None if obs.gpu_instance == NO_ID else obs.gpu_instance
        ci = None if obs.compute_instance == NO_ID else obs.compute_instance
        made = self.made_instances() if gi is not None and self.made_instances is not None else None
        return self.catalog.reached_by(obs.gpu_uuid, gi, ci, made)

    def handle(self, obs: Observation) -> bool:
        """Apply one observation; True when the taints changed."""
        devices = self.devices_of(obs)
        changed = False
        if obs.seen is Seen.EVENT and obs.kind is not None:
            self.metrics.events.labels(obs.kind.value).inc()
            if obs.kind is EventKind.XID:
                self.metrics.xids.labels(str(obs.data)).inc()
            if obs.kind is EventKind.RECOVERY_ACTION:
                if obs.data == 0:
                    return False
                verdict = Verdict(Effect.NO_SCHEDULE, f"recovery-{RECOVERY_ACTIONS.get(obs.data, obs.data)}")
            else:
                verdict = self.classifier.classify(obs.kind, obs.data)
            message = self._message(obs, verdict)
            log.warning(
                "gpu event gpu=%s kind=%s data=%d gi=%s ci=%s devices=%s effect=%s",
                obs.gpu_uuid,
                obs.kind.value,
                obs.data,
                _id(obs.gpu_instance),
                _id(obs.compute_instance),
                ",".join(devices),
                verdict.effect.api,
            )
            for d in devices:
                changed |= self._record(d, verdict, message)
        elif obs.seen is Seen.LOST:
            if obs.gpu_uuid not in self.lost:
                log.error("gpu lost gpu=%s devices=%s detail=%r", obs.gpu_uuid, ",".join(devices), obs.detail)
                self.metrics.events.labels("gpu-lost").inc()
            self.lost.add(obs.gpu_uuid)
            verdict = self.classifier.classify(EventKind.GPU_LOST)
            for d in devices:
                changed |= self._record(d, verdict, f"GPU {obs.gpu_uuid} is lost: {obs.detail}")
        elif obs.seen is Seen.ERROR:
            # Transient (retried by the monitor): counted and logged once per streak, no taint.
            self.metrics.nvml_errors.labels(obs.call, obs.error).inc()
            if (obs.gpu_uuid, obs.call) not in self.failing:
                self.failing.add((obs.gpu_uuid, obs.call))
                log.warning(
                    "nvml call failed, retrying gpu=%s call=%s error=%s detail=%r",
                    obs.gpu_uuid,
                    obs.call,
                    obs.error,
                    obs.detail,
                )
        elif obs.seen is Seen.ALIVE:
            self.failing = {f for f in self.failing if f[0] != obs.gpu_uuid}
            if obs.gpu_uuid in self.lost:
                log.info("gpu answers again gpu=%s", obs.gpu_uuid)
                self.lost.discard(obs.gpu_uuid)
            ok = obs.recovery_action in (None, 0)
            for d in devices:
                (self.book.healthy if ok else self.book.unhealthy)(d)
        elif obs.seen is Seen.UNMONITORED:
            self.unmonitored.add(obs.gpu_uuid)
            log.warning(
                "gpu events unavailable, liveness checks only gpu=%s detail=%r", obs.gpu_uuid, obs.detail
            )
        return changed

    def _message(self, obs: Observation, verdict: Verdict) -> str:
        what = {
            EventKind.XID: f"XID {obs.data}",
            EventKind.DOUBLE_BIT_ECC: "uncorrectable (double-bit) ECC error",
            EventKind.GPU_UNAVAILABLE: "GPU unavailable",
            EventKind.RECOVERY_ACTION: f"NVML recovery action {RECOVERY_ACTIONS.get(obs.data, obs.data)}",
        }.get(obs.kind or EventKind.XID, str(obs.kind))
        return f"{what} on GPU {obs.gpu_uuid}: {verdict.effect.api}"

    def _record(self, device: str, verdict: Verdict, message: str) -> bool:
        if not self.book.record(device, verdict, message):
            return False
        log.warning("device tainted device=%s cause=%s effect=%s", device, verdict.cause, verdict.effect.api)
        self.metrics.transitions.labels(device, "added", verdict.effect.api).inc()
        self.metrics.healthy.labels(device).set(0)
        return True

    def expire(self) -> bool:
        cleared = self.book.expire()
        for d in cleared:
            log.info("device taint removed after hold-down device=%s", d)
            self.metrics.transitions.labels(d, "removed", "").inc()
            self.metrics.healthy.labels(d).set(1)
        return bool(cleared)

    # -- operator overrides --------------------------------------------------------------------

    async def force(self, device: str, effect: Effect, cause: str) -> None:
        self.book.force(device, effect, cause)
        log.warning("device tainted by an operator device=%s cause=%s effect=%s", device, cause, effect.api)
        self.metrics.transitions.labels(device, "forced", effect.api).inc()
        self.metrics.healthy.labels(device).set(0)
        await self.notify()

    async def clear(self, device: str) -> bool:
        was = self.book.clear(device)
        log.warning("device taint cleared by an operator device=%s was_tainted=%s", device, was)
        if was:
            self.metrics.transitions.labels(device, "cleared", "").inc()
        self.metrics.healthy.labels(device).set(1)
        await self.notify()
        return was

    # -- output --------------------------------------------------------------------------------

    def slice_taints(self) -> dict[str, list[dict[str, object]]]:
        return self.book.slice_taints(self.taint_key)

    def health(self) -> dict[str, tuple[bool, str]]:
        """device -> (healthy, message)."""
        out: dict[str, tuple[bool, str]] = {}
        lost_devices = {d.name for u in self.lost for d in self.catalog.of_gpu(u)}
        for name in self.device_names():
            state = self.book.devices[name]
            if state.tainted:
                out[name] = (False, state.message or f"{self.taint_key}={state.cause}:{state.effect.api}")
            elif name in lost_devices:
                out[name] = (False, "GPU lost")
            else:
                out[name] = (True, "")
        return out

    async def notify(self) -> None:
        self.last_change = time.monotonic()
        for subscriber in self.subscribers:
            try:
                await subscriber()
            except Exception as exc:
                log.error("health change not delivered subscriber=%r error=%r", subscriber, str(exc))

    async def run(self) -> None:
        """Consume observations and expire taints until cancelled."""
        self.bind(asyncio.get_running_loop())
        while True:
            changed = False
            try:
                async with asyncio.timeout(self.tick):
                    obs = await self.queue.get()
                    changed |= self.handle(obs)
                    while not self.queue.empty():  # a burst: one publication
                        changed |= self.handle(self.queue.get_nowait())
            except TimeoutError:
                pass
            changed |= self.expire()
            if changed:
                await self.notify()


def _id(value: int) -> str:
    return "-" if value == NO_ID else str(value)
