"""Keeps this node's ResourceSlices true for as long as the plugin runs.

The kubelet deletes a node's slices when it starts and 30 s after a plugin disconnects, and an
operator may edit them, so publishing once is not enough: the publisher watches this node's
slices of this driver and re-applies (server-side apply, field manager = driver name) whatever
was deleted or changed. The pool generation is kept while the devices stay the same and bumped
when they change. Fields the apiserver silently drops (a feature gate off) are logged once.
refresh() re-builds the slices when the driver's devices changed while running (e.g. a health
taint) and applies only what differs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay

from dra_gpu.kube.api import REJECTED, RESOURCE_V1, Backoff, Kube, KubeError, list_watch
from dra_gpu.kubeletplugin.metrics import PluginMetrics

log = logging.getLogger(__name__)

SLICES = f"{RESOURCE_V1}/resourceslices"
# Each watch ends with a new list (a consistent read of this node's slices): every 5-10 minutes, so
# that 500 nodes cost the apiserver ~1 list a second, not 17 (bench/scale_bench.py).
WATCH_SECONDS = 300
# Shorter than the webhook's: while this node's slices are gone, its devices cannot be allocated;
# capped at 5 s so the slices are back within a few seconds of an apiserver outage's end.
BACKOFF = Backoff(initial=0.2, maximum=5.0)


def _transient(exc: BaseException) -> bool:
    """Worth another try: the apiserver failed, throttled or could not be reached. A slice it
    refuses as invalid (400, 422) is refused again: that is said at once, not after `timeout`."""
    if isinstance(exc, KubeError):
        return exc.status not in (400, 422)
    return isinstance(exc, (OSError, asyncio.TimeoutError))


def _retrying(timeout: float) -> AsyncRetrying:
    """The publisher's writes: retried with BACKOFF while the apiserver fails or cannot be reached,
    for at most `timeout` seconds; then the last error is raised."""
    return AsyncRetrying(
        wait=BACKOFF.wait(),
        stop=stop_after_delay(timeout),
        retry=retry_if_exception(_transient),
        reraise=True,
    )


# Slice fields an apiserver drops, without an error, when the feature gate of their feature is off
# (the v1 type has them all from 1.34; the gates differ by release): field -> (gate, what is lost).
_COUNTERS = "counters are lost: partitions of one device could be allocated together"
_BINDING = "binding conditions are lost: a pod may start before its device is ready"
GATED_SLICE_FIELDS = {
    "taints": ("DRADeviceTaints", "taints are lost: a failed device is not isolated"),
    "consumesCounters": ("DRAPartitionableDevices", _COUNTERS),
    "sharedCounters": ("DRAPartitionableDevices", _COUNTERS),
    "allowMultipleAllocations": ("DRAConsumableCapacity", "sharing is lost: one claim at a time"),
    "bindingConditions": ("DRADeviceBindingConditions", _BINDING),
    "bindingFailureConditions": ("DRADeviceBindingConditions", _BINDING),
    "bindsToNode": ("DRADeviceBindingConditions", _BINDING),
}


def field_name(path: str) -> str:
    """The field of a path as the closed set of GATED_SLICE_FIELDS names it, else "other"
    ("devices[3].taints" -> "taints"; a metric label is never the slice's own text)."""
    for part in reversed(path.replace("]", "").split(".")):
        name = part.split("[", 1)[0]
        if name in GATED_SLICE_FIELDS:
            return name
    return "other"


def missing_fields(want: Any, have: Any, path: str = "") -> list[str]:
    """Paths of fields in `want` that `have` lacks or holds differently (defaults in `have` are fine)."""
    if isinstance(want, dict):
        if not isinstance(have, dict):
            return [path or "."]
        out = []
        for key, value in want.items():
            sub = f"{path}.{key}" if path else key
            if key not in have:
                out.append(sub)
            else:
                out += missing_fields(value, have[key], sub)
        return out
    if isinstance(want, list):
        if not isinstance(have, list) or len(have) != len(want):
            return [path]
        out = []
        for i, (w, h) in enumerate(zip(want, have, strict=True)):
            out += missing_fields(w, h, f"{path}[{i}]")
        return out
    return [] if want == have else [path]


class SlicePublisher:
    def __init__(
        self,
        kube: Kube,
        driver: str,
        node_name: str,
        build: Callable[[int], list[dict[str, Any]]],
        metrics: PluginMetrics,
        on_dropped: Callable[[frozenset[str]], None] | None = None,
    ) -> None:
        """`on_dropped`: told the gated fields the apiserver drops (GATED_SLICE_FIELDS names),
        each time one more is found; the slices are then built and applied again."""
        self.kube = kube
        self.on_dropped = on_dropped
        self.dropped_gated: set[str] = set()  # gated fields the apiserver dropped
        self._newly_dropped = False
        self.driver = driver
        self.node = node_name
        self.build = build
        self.metrics = metrics
        self.selector = f"spec.nodeName={node_name},spec.driver={driver}"
        self.generation = 0
        self.desired: dict[str, dict[str, Any]] = {}
        self._dropped_logged: set[str] = set()
        self.synced = asyncio.Event()
        self._lock = asyncio.Lock()  # sync() and refresh() never interleave their writes

    def device_names(self) -> list[str]:
        return [d["name"] for s in self.desired.values() for d in s["spec"].get("devices") or []]

    def _covers(self, stored: dict[str, Any]) -> bool:
        want = self.desired.get(stored["metadata"]["name"])
        return want is not None and not missing_fields(want["spec"], stored.get("spec", {}))

    async def start(self, timeout: float = 120.0) -> None:
        """First publication: keep the stored generation when nothing changed, else bump it."""
        async for attempt in _retrying(timeout):
            with attempt:
                existing, _ = await self.kube.list_slices(self.selector)
                stored_gen = max((int(s["spec"]["pool"].get("generation", 0)) for s in existing), default=0)
                self.generation = max(stored_gen, 1)
                self.desired = {s["metadata"]["name"]: s for s in self.build(self.generation)}
                unchanged = (
                    existing and len(existing) == len(self.desired) and all(self._covers(s) for s in existing)
                )
                if existing and not unchanged:
                    self.generation = stored_gen + 1
                    self.desired = {s["metadata"]["name"]: s for s in self.build(self.generation)}
                await self.sync(existing)
        log.info(
            "slices published node=%s generation=%d slices=%d devices=%d",
            self.node,
            self.generation,
            len(self.desired),
            len(self.device_names()),
        )

    async def sync(self, existing: list[dict[str, Any]]) -> int:
        """Apply what is missing or differs, delete what is not desired; returns slices applied."""
        async with self._lock:
            applied = await self._sync(existing)
        return applied + await self._degrade()

    async def _degrade(self) -> int:
        """When the last writes found a gated field dropped that was not before, tell the driver
        and publish what it builds without it; returns slices applied."""
        if not self._newly_dropped or self.on_dropped is None:
            return 0
        self._newly_dropped = False
        self.on_dropped(frozenset(self.dropped_gated))
        return await self.refresh()

    async def _sync(self, existing: list[dict[str, Any]]) -> int:
        by_name = {s["metadata"]["name"]: s for s in existing}
        applied = 0
        for name, body in self.desired.items():
            current = by_name.get(name)
            if current is not None and self._covers(current):
                continue
            stored = await self.kube.apply_slice(body, field_manager=self.driver)
            applied += 1
            self._check_dropped(body, stored)
        for name in by_name.keys() - self.desired.keys():
            await self.kube.delete_slice(name)
            log.info("stale slice deleted name=%s", name)
        self.metrics.published_devices.set(len(self.device_names()))
        self.synced.set()
        return applied

    async def refresh(self, timeout: float = 30.0) -> int:
        """Re-build the desired slices and apply those that changed; the generation is bumped when
        more than one slice (or the set of slices) changes. Returns the slices applied."""
        async with self._lock:
            old = self.desired
            new = {s["metadata"]["name"]: s for s in self.build(self.generation)}
            changed = [name for name, body in new.items() if old.get(name) != body]
            if new.keys() != old.keys() or len(changed) > 1:
                self.generation += 1
                new = {s["metadata"]["name"]: s for s in self.build(self.generation)}
                changed = list(new)
            self.desired = new
            async for attempt in _retrying(timeout):
                with attempt:
                    for name in changed:
                        self._check_dropped(new[name], await self.kube.apply_slice(new[name], self.driver))
                    for name in old.keys() - new.keys():
                        await self.kube.delete_slice(name)
            # What failed for longer than `timeout` the next list (at the latest 2 x WATCH_SECONDS) restores.
            self.metrics.published_devices.set(len(self.device_names()))
        return len(changed) + await self._degrade()

    def _check_dropped(self, sent: dict[str, Any], stored: dict[str, Any]) -> None:
        for path in missing_fields(sent["spec"], stored.get("spec", {})):
            key = path.split("[")[0] + path.split("]")[-1] if "[" in path else path
            field = field_name(path)
            self.metrics.dropped_slice_fields.labels(field).set(1)
            if field in GATED_SLICE_FIELDS and field not in self.dropped_gated:
                self.dropped_gated.add(field)
                self._newly_dropped = True
            if key in self._dropped_logged:
                continue
            self._dropped_logged.add(key)
            if field in GATED_SLICE_FIELDS:
                gate, lost = GATED_SLICE_FIELDS[field]
                log.error(
                    "apiserver dropped a field of ResourceSlice %s: spec.%s; %s; turn on the %s "
                    "feature gate (kube-apiserver, kube-scheduler, kube-controller-manager, kubelet)",
                    sent["metadata"]["name"],
                    path,
                    lost,
                    gate,
                )
            else:
                log.error(
                    "apiserver dropped a field of ResourceSlice %s: spec.%s; is the feature gate for it off?",
                    sent["metadata"]["name"],
                    path,
                )

    async def run(self, backoff: Backoff = BACKOFF) -> None:
        """Watch and restore until cancelled; a deleted or edited slice is re-applied after a new list."""
        await list_watch(
            self.kube,
            SLICES,
            self._restore,
            self._still_true,
            field_selector=self.selector,
            watch_seconds=WATCH_SECONDS,
            backoff=backoff,
        )

    async def _restore(self, existing: list[dict[str, Any]], _version: str) -> None:
        if await self.sync(existing):
            self.metrics.slice_restores.inc()
            log.warning("slices restored node=%s", self.node)

    async def _still_true(self, kind: str, obj: dict[str, Any]) -> bool:
        if kind in ("DELETED", REJECTED) or not self._covers(obj):
            log.warning(
                "slice %s by someone else: restoring name=%s", kind.lower(), obj["metadata"].get("name")
            )
            return False  # list again, then sync
        return True
