"""Reading what `dra-gpu top` shows from the API: once (list calls, paged and decoded as they
arrive: dra_gpu.kube.api), or kept current by watches (`watch`: dra_gpu.kube.api.list_watch, which lists
again when a watch ends or expires) that call back on every change.

Five collections: the driver's ResourceSlices (field selector on the driver, and the node with
--node), every ResourceClaim (a shared GPU's free memory counts all its shares), the pods that
use claims (of --namespace only, when given), the DeviceTaintRules, when the API serves them, and
the DeviceClasses (explain needs them for a Pending pod's claims).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from dra_gpu.fleet.snapshot import COLLECTIONS, Record, Snapshot, assemble, parse_object
from dra_gpu.kube.api import REJECTED, RESOURCE_V1, Kube, list_watch
from dra_gpu.model.mps_daemon_pods import DAEMON_LABEL

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scope:
    driver: str
    node: str | None = None
    namespace: str | None = None

    def path(self, collection: str) -> str:
        if collection == "slices":
            return f"{RESOURCE_V1}/resourceslices"
        if collection == "claims":
            return f"{RESOURCE_V1}/resourceclaims"
        if collection == "rules":
            return f"{RESOURCE_V1}/devicetaintrules"
        if collection == "classes":
            return f"{RESOURCE_V1}/deviceclasses"
        return f"/api/v1/namespaces/{self.namespace}/pods" if self.namespace else "/api/v1/pods"

    def field_selector(self, collection: str) -> str | None:
        if collection == "slices":
            return f"spec.driver={self.driver}" + (f",spec.nodeName={self.node}" if self.node else "")
        if collection == "pods" and self.node:
            return f"spec.nodeName={self.node}"
        return None


def _uses_claims(pod: dict[str, Any]) -> bool:
    """Only pods with resource claims (and the plugin's MPS daemon pods, shown with their claims)
    are kept: the rest of a large cluster's pods are dropped as each page is decoded."""
    if (pod.get("spec") or {}).get("resourceClaims"):
        return True
    labels = (pod.get("metadata") or {}).get("labels")
    return isinstance(labels, dict) and labels.get(DAEMON_LABEL) is not None


def _keep(collection: str) -> Callable[[dict[str, Any]], bool] | None:
    return _uses_claims if collection == "pods" else None


Parsed = tuple[Record | None, str | None]  # parse_object's answer


class Stores:
    """The collections as last listed or watched, each object parsed once when it arrives: a
    redraw after one change re-parses that object only."""

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.parsed: dict[str, dict[tuple[str, str], Parsed]] = {c: {} for c in COLLECTIONS}
        self.notes: list[str] = []  # what could not be read, and why

    @staticmethod
    def _key(obj: dict[str, Any]) -> tuple[str, str]:
        meta = obj.get("metadata") or {}
        return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))

    def _parse(self, collection: str, obj: dict[str, Any]) -> Parsed:
        return parse_object(collection, self.scope.driver, obj)

    def replace(self, collection: str, items: list[dict[str, Any]]) -> None:
        self.parsed[collection] = {self._key(o): self._parse(collection, o) for o in items}

    def apply(self, collection: str, event: str, obj: dict[str, Any]) -> bool:
        """Apply a watch event; True when it changed what is stored."""
        if event in ("DELETED", REJECTED):  # an object over the bounds leaves the view
            return self.parsed[collection].pop(self._key(obj), None) is not None
        if event in ("ADDED", "MODIFIED"):
            self.parsed[collection][self._key(obj)] = self._parse(collection, obj)
            return True
        return False

    def snapshot(self) -> Snapshot:
        entries = [e for store in self.parsed.values() for e in store.values()]
        return assemble(
            self.scope.driver,
            (record for record, _ in entries if record is not None),
            [*self.notes, *(problem for _, problem in entries if problem)],
        )


async def _rules_served(kube: Kube, timeout: float) -> bool:
    """Whether the API serves DeviceTaintRules (resource.k8s.io/v1 from Kubernetes 1.37), from the
    group version's discovery document."""
    doc = await asyncio.wait_for(kube.get_json(RESOURCE_V1), timeout)
    return any(r.get("name") == "devicetaintrules" for r in (doc or {}).get("resources") or [])


async def read_once(kube: Kube, scope: Scope, timeout: float) -> Snapshot:
    """One list of each collection, each within `timeout` seconds."""
    stores = Stores(scope)
    served = await _rules_served(kube, timeout)
    if not served:
        stores.notes.append("DeviceTaintRules: not served by this API server (taints in slices only)")

    async def one(collection: str) -> None:
        items, _ = await asyncio.wait_for(
            kube.list_objects(
                scope.path(collection), scope.field_selector(collection), keep=_keep(collection)
            ),
            timeout,
        )
        stores.replace(collection, items)

    await asyncio.gather(*(one(c) for c in COLLECTIONS if c != "rules" or served))
    return stores.snapshot()


async def watch(
    kube: Kube,
    scope: Scope,
    draw: Callable[[Snapshot], Awaitable[None] | None],
    *,
    timeout: float,
    settle: float = 0.2,
    watch_seconds: int = 300,
) -> None:
    """Draw once everything is listed, then again after each change (changes that come within
    `settle` seconds of each other are drawn once), until cancelled. No polling: each collection
    is one list + watch, listed again when its watch ends (after `watch_seconds` to twice that)."""
    stores = Stores(scope)
    served = await _rules_served(kube, timeout)
    if not served:
        stores.notes.append("DeviceTaintRules: not served by this API server (taints in slices only)")
    collections = [c for c in COLLECTIONS if c != "rules" or served]
    listed: set[str] = set()
    changed = asyncio.Event()

    def handlers(collection: str) -> tuple[Any, Any]:
        async def on_list(items: list[dict[str, Any]], _version: str) -> None:
            stores.replace(collection, items)
            listed.add(collection)
            changed.set()

        async def on_event(event: str, obj: dict[str, Any]) -> bool:
            if stores.apply(collection, event, obj):
                changed.set()
            return True

        return on_list, on_event

    tasks = [
        asyncio.create_task(
            list_watch(
                kube,
                scope.path(c),
                *handlers(c),
                field_selector=scope.field_selector(c),
                keep=_keep(c),
                watch_seconds=watch_seconds,
            ),
            name=f"dra-gpu-top-{c}",
        )
        for c in collections
    ]
    try:
        async with asyncio.timeout(timeout):  # the first lists: an unreachable API is an error
            while len(listed) < len(collections):
                changed.clear()
                await changed.wait()
        while True:
            changed.clear()
            drawn = draw(stores.snapshot())
            if drawn is not None:  # a drawing that explains Pending pods first
                await drawn
            await changed.wait()
            await asyncio.sleep(settle)  # a burst of events (a job of 100 pods) is one redraw
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
