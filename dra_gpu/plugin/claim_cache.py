"""The ResourceClaims allocated to this node, from one list+watch, so that a prepare reads its claim
from memory instead of a GET on the kubelet's call path.

Only claims with a device of this driver and node in their allocation are kept (the watch sees
every claim in the cluster: no field selector names an allocation's node). The list is read in
pages and each claim decoded on its own and dropped at once unless it is this node's
(kube.list_objects): the plugin's memory does not grow with the cluster's claims, of which a
namespace user can create many of the largest size the apiserver stores. A claim the cache does
not answer for (not seen yet, not listed yet, another UID, not reserved) is read from the
apiserver, as is every read of the stale-claim sweeper, which must see a deletion as it is.

Why a cached claim can be trusted for a prepare: its UID is the kubelet's, and a claim keeps its
allocation until it is deallocated, which needs its `reservedFor` emptied first; the kubelet
prepares a claim only after the scheduler allocated and reserved it and bound the pod, writes the
watch delivers in practice before the kubelet sees the pod.

Of a claim only what prepare reads is kept (its name, namespace and UID, the annotation naming it
in its pod, for its device metadata's path, `status.allocation` and `status.reservedFor`), as
JSON, decoded again by its prepare: managedFields, spec and the devices' status were most of each
claim's memory, and a claim kept as objects left ~25 small long-lived objects among a burst's
garbage, holding CPython's memory arenas after it (bench/RESULTS.md).

Other parts that need this node's claims (dynamic MIG's binding conditions) subscribe to the same
watch instead of opening their own: they get the list's claims of this node, and the events of
claims that are, or until then were, this node's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from dra_gpu.kube.api import REJECTED, RESOURCE_V1, Backoff, Kube, list_watch
from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.plugin.allocation import Allocation
from dra_gpu.plugin.device_metadata import POD_CLAIM_NAME_ANNOTATION, pod_claim_name

log = logging.getLogger(__name__)

ListHandler = Callable[[list[dict[str, Any]], str], Awaitable[None]]
EventHandler = Callable[[str, dict[str, Any]], Awaitable[bool]]


class ClaimCache:
    """`lookup` for the prepare path; `run` keeps it current (cancel to stop)."""

    def __init__(self, kube: Kube, driver: str, node: str, backoff: Backoff | None = None) -> None:
        self.kube = kube
        self.driver = driver
        self.node = node
        self.backoff = backoff or Backoff()
        self.listed = False
        self._claims: dict[tuple[str, str], _Kept] = {}
        self._subscribers: list[tuple[ListHandler, EventHandler]] = []
        self.hits = 0  # prepares answered from the watch

    def subscribe(self, on_list: ListHandler, on_event: EventHandler) -> None:
        """Have every list and event of the claims passed on (call before `run`)."""
        self._subscribers.append((on_list, on_event))

    def __len__(self) -> int:
        return len(self._claims)

    def lookup(self, ref: ClaimRef) -> dict[str, Any] | None:
        """The claim, when the cache holds it with the kubelet's UID, reserved and allocated here;
        None means: ask the apiserver."""
        kept = self._claims.get((ref.namespace, ref.name))
        if kept is not None and kept.uid == ref.uid and kept.reserved:
            self.hits += 1
            claim: dict[str, Any] = json.loads(kept.claim)
            return claim
        return None

    def _allocated_here(self, claim: dict[str, Any]) -> bool:
        return bool(Allocation.of(claim).results_for(self.driver, self.node))

    @staticmethod
    def _key(claim: dict[str, Any]) -> tuple[str, str]:
        meta = claim.get("metadata") or {}
        return str(meta.get("namespace", "")), str(meta.get("name", ""))

    def _keep(self, claim: dict[str, Any]) -> None:
        key = self._key(claim)
        if self._allocated_here(claim):
            self._claims[key] = _Kept.of(claim)
        else:
            self._claims.pop(key, None)

    async def _on_list(self, items: list[dict[str, Any]], version: str) -> None:
        """`items` are this node's claims: list_watch dropped the others as it decoded them."""
        self._claims = {}
        for claim in items:
            self._keep(claim)
        self.listed = True
        log.info("claims listed allocated_here=%d", len(self._claims))
        for on_list, _ in self._subscribers:
            await on_list(items, version)

    async def _on_event(self, kind: str, claim: dict[str, Any]) -> bool:
        key = self._key(claim)
        was_here = key in self._claims
        if kind in ("DELETED", REJECTED):  # a claim over the bounds is prepared from a GET: refused
            self._claims.pop(key, None)
        elif kind in ("ADDED", "MODIFIED"):
            self._keep(claim)
        if not (was_here or key in self._claims):
            return True  # another node's claim: no subscriber's business
        relist = False
        for _, on_event in self._subscribers:
            relist = not await on_event(kind, claim) or relist
        return not relist

    async def run(self) -> None:
        await list_watch(
            self.kube,
            f"{RESOURCE_V1}/resourceclaims",
            self._on_list,
            self._on_event,
            keep=self._allocated_here,
            backoff=self.backoff,
        )


@dataclass(frozen=True, slots=True)
class _Kept:
    uid: str
    reserved: bool
    claim: bytes  # what prepare reads, as JSON

    @classmethod
    def of(cls, claim: dict[str, Any]) -> _Kept:
        meta = claim.get("metadata") or {}
        status = claim.get("status") or {}
        kept_meta = {k: meta[k] for k in ("name", "namespace", "uid") if k in meta}
        pod_claim = pod_claim_name(claim)  # its device metadata's path
        if pod_claim is not None:
            kept_meta["annotations"] = {POD_CLAIM_NAME_ANNOTATION: pod_claim}
        slim = {
            "metadata": kept_meta,
            "status": {k: status[k] for k in ("allocation", "reservedFor") if k in status},
        }
        return cls(str(meta.get("uid", "")), bool(status.get("reservedFor")), json.dumps(slim).encode())
