"""The few Kubernetes API calls the driver makes, on the official async client (kubernetes.aio).

The connection, TLS and credentials come from the client's Configuration and ApiClient
(kubeconfig or in-cluster). Requests go through the ApiClient's generic request path rather than
the generated per-resource API classes: objects stay plain JSON dicts (the driver builds and
compares raw API objects), and the prepare path skips a model layer it does not need. Every call
has a timeout.

It lives here, not in dra_gpu.kubeletplugin, because the controller uses it too and must not import
the node side. `list_watch` is the one list+watch loop of the driver (slice publisher, webhook caches).

Every object read passes the bounds of dra_gpu.kube.bounds: one that is over them (a tenant's claim
nested 1,500 levels deep) is left out of a list or watch and reported, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import contextlib
import datetime
import hashlib
import itertools
import json
import logging
import os
import random
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)
from tenacity.wait import wait_base

from dra_gpu.kube.bounds import (
    LineSplitter,
    ObjectRejected,
    Rejected,
    Rejections,
    decode_event,
    decode_object,
    resource_of,
)
from dra_gpu.kube.list_decoder import Keep, ListDecoder, Transform
from dra_gpu.kube.official_client import ApiClient, Configuration, load_incluster_config, load_kube_config

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 10.0
MAX_CONNECTIONS = 16
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
RESOURCE_V1 = "/apis/resource.k8s.io/v1"
EVENTS_V1 = "/apis/events.k8s.io/v1"
HTTP_FORBIDDEN = 403
HTTP_CONFLICT = 409
HTTP_GONE = 410
# The watch event that stands for an object over the bounds (dra_gpu.kube.bounds): it carries only the
# object's metadata (namespace, name, uid as far as they could be read); a view drops its copy.
REJECTED = "REJECTED"
# The kinds of the collections the driver reads, for the Events on rejected objects.
KINDS = {
    "resourceclaims": ("resource.k8s.io/v1", "ResourceClaim"),
    "resourceclaimtemplates": ("resource.k8s.io/v1", "ResourceClaimTemplate"),
    "resourceslices": ("resource.k8s.io/v1", "ResourceSlice"),
    "deviceclasses": ("resource.k8s.io/v1", "DeviceClass"),
    "devicetaintrules": ("resource.k8s.io/v1", "DeviceTaintRule"),
    "pods": ("v1", "Pod"),
    "nodes": ("v1", "Node"),
}
# Lists are read in pages of this many objects (`limit` / `continue`), each decoded as it arrives
# (list_decoder.py): a page of the largest claims the apiserver stores (~1.5 MiB each) is ~150 MB on
# the wire, which a page's deadline still allows on a slow link.
LIST_PAGE = 100
LIST_PAGE_TIMEOUT = 60.0
LIST_RESTARTS = 5  # lists begun again after their continue token expired, before giving up
READ_CHUNK = 64 * 1024


TLS_READ_BUFFER = 64 * 1024


def small_tls_read_buffers(size: int = TLS_READ_BUFFER) -> None:
    """asyncio gives each TLS connection a read buffer of 256 KiB, kept while it is open: the
    kubelet plugin keeps a connection per watch and per claim status in flight (~1.5 MB after a
    burst, bench/RESULTS.md) for answers of a few KB. A larger answer (a claims list) is read in
    more pieces. Process-wide: call it in a process of its own (the kubelet plugin's)."""
    protocol = asyncio.sslproto.SSLProtocol
    if getattr(protocol, "max_size", 0) > size:
        protocol.max_size = size


MAX_RETRY_AFTER = 60.0  # seconds: a Retry-After beyond this is taken as this


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.retry_after = retry_after  # the answer's Retry-After (429, 503), in seconds


def _retry_after(resp: Any) -> float | None:
    """The Retry-After header's seconds (the apiserver's 429s send a number), bounded; None
    without one or in the HTTP-date form."""
    value = str((getattr(resp, "headers", None) or {}).get("Retry-After") or "").strip()
    return min(float(value), MAX_RETRY_AFTER) if value.isdigit() else None


class wait_retry_after(wait_base):  # named like tenacity's waits
    """`wait`, or longer when the failed answer asked to be retried later (Retry-After)."""

    def __init__(self, wait: wait_base) -> None:
        self.wait = wait

    def __call__(self, retry_state: RetryCallState) -> float:
        error = retry_state.outcome.exception() if retry_state.outcome else None
        asked = getattr(error, "retry_after", None) or 0.0
        return max(self.wait(retry_state), asked)


class ContinueExpired(KubeError):
    """410 Gone for a list's next page: its snapshot was compacted; the list must begin again."""


async def _json(resp: Any, what: str, resource: str = "") -> dict[str, Any]:
    """The answer's object (ObjectRejected when it is over the bounds), or KubeError."""
    try:
        body = await resp.read()
    finally:
        resp.release()
    if resp.status >= 400:
        try:
            message = json.loads(body).get("message", body.decode(errors="replace"))
        except (ValueError, RecursionError, AttributeError):
            message = body[:1000].decode(errors="replace")
        raise KubeError(resp.status, f"{what}: {message}", _retry_after(resp))
    data: dict[str, Any] = decode_object(body, resource or what)
    return data


class Kube:
    """An API connection: from a kubeconfig file, or in-cluster when none is given."""

    def __init__(self, api_client: Any, rejections: Rejections | None = None) -> None:
        self.api_client = api_client
        # Objects left out for their bounds; a process serves its counter with its metrics.
        self.rejections = rejections or Rejections()

    @classmethod
    async def connect(cls, kubeconfig: str | None = None) -> Kube:
        configuration = Configuration()
        if kubeconfig or os.environ.get("KUBECONFIG"):
            await load_kube_config(
                config_file=kubeconfig or os.environ["KUBECONFIG"],
                client_configuration=configuration,
            )
        else:
            load_incluster_config(client_configuration=configuration)
        # A burst of prepares queues on a few warm connections instead of opening (and TLS
        # handshaking) one per request; the long watches hold one each.
        configuration.connection_pool_maxsize = MAX_CONNECTIONS
        if not any(os.environ.get(v) for v in PROXY_VARIABLES):
            # Without a proxy to take from the environment, trust_env only makes aiohttp read
            # ~/.netrc in a worker thread before every request (not a Kubernetes credential).
            configuration.client_session_kwargs = {"trust_env": False}
        return cls(ApiClient(configuration))

    async def close(self) -> None:
        await self.api_client.close()

    async def _request(
        self,
        method: str,
        path: str,
        query: dict[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float = REQUEST_TIMEOUT,
    ) -> Any:
        """The raw aiohttp response of one authenticated request (the caller releases it)."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        params = await self.api_client.param_serialize(
            method=method,
            resource_path=path,
            query_params=list((query or {}).items()),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = await self.api_client.call_api(*params, _request_timeout=timeout, _preload_content=False)
        return response.response

    async def get_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The ResourceClaim, or None when it does not exist."""
        resp = await self._request("GET", f"{RESOURCE_V1}/namespaces/{namespace}/resourceclaims/{name}")
        if resp.status == 404:
            resp.release()
            return None
        try:
            return await _json(resp, f"get resourceclaim {namespace}/{name}", "resourceclaims")
        except ObjectRejected as exc:
            self.rejections.report(exc.rejected)
            raise

    async def list_claims(self, keep: Keep | None = None) -> list[dict[str, Any]]:
        """The ResourceClaims `keep` accepts (default: all); no field selector names an
        allocation's node, so every claim of the cluster is read, page by page, and dropped unless
        kept."""
        items, _ = await self.list_objects(f"{RESOURCE_V1}/resourceclaims", keep=keep)
        return items

    async def apply_slice(self, body: dict[str, Any], field_manager: str) -> dict[str, Any]:
        """Server-side apply of a ResourceSlice; returns what the apiserver stored."""
        name = body["metadata"]["name"]
        resp = await self._request(
            "PATCH",
            f"{RESOURCE_V1}/resourceslices/{name}",
            {"fieldManager": field_manager, "force": "true"},
            body,
            content_type="application/apply-patch+yaml",
        )
        return await _json(resp, f"apply resourceslice {name}")

    async def apply_claim_status(
        self, namespace: str, name: str, body: dict[str, Any], field_manager: str
    ) -> dict[str, Any]:
        """Server-side apply to a ResourceClaim's status (the driver's `status.devices` entries)."""
        resp = await self._request(
            "PATCH",
            f"{RESOURCE_V1}/namespaces/{namespace}/resourceclaims/{name}/status",
            {"fieldManager": field_manager, "force": "true"},
            body,
            content_type="application/apply-patch+yaml",
        )
        return await _json(resp, f"apply resourceclaim {namespace}/{name} status")

    async def delete_slice(self, name: str) -> None:
        resp = await self._request("DELETE", f"{RESOURCE_V1}/resourceslices/{name}")
        if resp.status == 404:
            resp.release()
            return
        await _json(resp, f"delete resourceslice {name}")

    async def list_objects(
        self,
        path: str,
        field_selector: str | None = None,
        *,
        keep: Keep | None = None,
        limit: int = LIST_PAGE,
        backoff: Backoff | None = None,
        transform: Transform | None = None,
    ) -> tuple[list[Any], str]:
        """The objects of a collection (e.g. RESOURCE_V1 + "/resourceclaims") that `keep` accepts
        (default: all), each as `transform` makes it (default: whole), and the list's
        resourceVersion (its last page's: where a watch begins).

        Read in pages of `limit`, each decoded one object at a time, so that only the kept objects
        are held, whatever the collection's size. A continue token that expired between pages
        (410 Gone) begins the list again, after a backoff, up to LIST_RESTARTS times."""
        async for attempt in AsyncRetrying(
            wait=(backoff or Backoff()).wait(),
            retry=retry_if_exception_type(ContinueExpired),
            stop=stop_after_attempt(1 + LIST_RESTARTS),
            before_sleep=_log_relist(path),
            reraise=True,
        ):
            with attempt:
                return await self._list_pages(path, field_selector, keep, limit, transform)
        raise AssertionError("unreachable: the last attempt's error is raised")

    async def _list_pages(
        self,
        path: str,
        field_selector: str | None,
        keep: Keep | None,
        limit: int,
        transform: Transform | None,
    ) -> tuple[list[Any], str]:
        kept: list[Any] = []
        token = ""
        while True:
            query = {"limit": str(limit)}
            if field_selector:
                query["fieldSelector"] = field_selector
            if token:
                query["continue"] = token
            page = await self._list_page(path, query, keep, transform, continued=bool(token))
            kept += page.items
            token = str(page.metadata.get("continue") or "")
            if not token:
                return kept, str(page.metadata.get("resourceVersion", ""))

    async def _list_page(
        self,
        path: str,
        query: dict[str, str],
        keep: Keep | None,
        transform: Transform | None,
        continued: bool,
    ) -> ListDecoder:
        resp = await self._request("GET", path, query, timeout=LIST_PAGE_TIMEOUT)
        if resp.status >= 400:
            try:
                await _json(resp, f"list {path}")
            except KubeError as exc:
                if continued and exc.status == HTTP_GONE:
                    raise ContinueExpired(exc.status, exc.message) from exc
                raise
        page = ListDecoder(keep, resource_of(path), self.rejections.report, transform)
        try:
            async for chunk in resp.content.iter_chunked(READ_CHUNK):
                page.feed(chunk)
            page.close()
        finally:
            resp.release()
        return page

    async def watch_objects(
        self,
        path: str,
        resource_version: str,
        timeout_seconds: int,
        field_selector: str | None = None,
    ) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        """Watch events (type, object) until the server ends the watch after `timeout_seconds`."""
        query = {
            "resourceVersion": resource_version,
            "watch": "true",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_seconds),
        }
        if field_selector:
            query["fieldSelector"] = field_selector
        resp = await self._request("GET", path, query, timeout=timeout_seconds + REQUEST_TIMEOUT)
        if resp.status >= 400:
            await _json(resp, f"watch {path}")
        resource = resource_of(path)
        lines = LineSplitter()
        try:
            # One event a line; a line over the bounds is dropped as it arrives and stands for a
            # REJECTED event: the watch goes on (no list again, which the same object would fail).
            async for chunk in resp.content.iter_any():
                for line in lines.feed(chunk):
                    yield self._event(line, resource)
            for line in lines.close():
                yield self._event(line, resource)
        finally:
            resp.release()

    def _event(self, line: Any, resource: str) -> tuple[str, dict[str, Any]]:
        event = decode_event(line, resource)
        if isinstance(event, Rejected):
            self.rejections.report(event)
            return REJECTED, {"metadata": event.metadata()}
        return event

    async def post_rejection_events(self, instance: str | None = None) -> None:
        """An Event on each object rejected lately (Rejections.take_events), as `instance`
        (default: this node, or this pod or host). The
        Event's name is derived from the object's, so every replica and node posts the same one
        (the apiserver keeps the first: 409); without RBAC for Events, none is tried again."""
        for rejected in self.rejections.take_events():
            if not self.rejections.events_allowed:
                return
            try:
                await self.create(
                    f"{EVENTS_V1}/namespaces/{rejected.namespace or 'default'}/events",
                    rejection_event(rejected, instance or _instance()),
                )
            except KubeError as exc:
                if exc.status == HTTP_FORBIDDEN:
                    self.rejections.events_allowed = False
                    log.warning("no Events on rejected objects: %s", exc.message[:200])
                elif exc.status != HTTP_CONFLICT:
                    log.warning("Event on a rejected object not posted error=%r", str(exc)[:200])
            except (OSError, TimeoutError) as exc:
                log.warning("Event on a rejected object not posted error=%r", str(exc)[:200])

    async def get_json(self, path: str) -> dict[str, Any] | None:
        """Any GET (an object, an API group's discovery document); None when it does not exist."""
        resp = await self._request("GET", path)
        if resp.status == 404:
            resp.release()
            return None
        return await _json(resp, f"get {path}")

    async def create(self, path: str, body: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        """POST an object to a collection; with `dry_run` the apiserver validates it and stores nothing."""
        resp = await self._request("POST", path, {"dryRun": "All"} if dry_run else None, body)
        return await _json(resp, f"create in {path}")

    async def delete(self, path: str, grace_period_seconds: int | None = None) -> bool:
        """DELETE an object; False when it was not there."""
        query = {} if grace_period_seconds is None else {"gracePeriodSeconds": str(grace_period_seconds)}
        resp = await self._request("DELETE", path, query)
        if resp.status == 404:
            resp.release()
            return False
        await _json(resp, f"delete {path}")
        return True

    async def replace_claim_status(self, namespace: str, name: str, claim: dict[str, Any]) -> dict[str, Any]:
        """PUT a ResourceClaim's status: `claim` as read and changed (its resourceVersion makes a 409
        of a concurrent change); returns the stored claim."""
        resp = await self._request(
            "PUT", f"{RESOURCE_V1}/namespaces/{namespace}/resourceclaims/{name}/status", body=claim
        )
        return await _json(resp, f"update resourceclaim {namespace}/{name} status")

    async def list_slices(self, field_selector: str) -> tuple[list[dict[str, Any]], str]:
        return await self.list_objects(f"{RESOURCE_V1}/resourceslices", field_selector)


def rejection_event(rejected: Rejected, instance: str) -> dict[str, Any]:
    """An events.k8s.io/v1 Warning on the object that was left out, named after it."""
    api_version, kind = KINDS.get(rejected.resource, ("", rejected.resource))
    digest = hashlib.sha256(
        f"{rejected.resource}/{rejected.namespace}/{rejected.name}/{rejected.uid}".encode()
    )
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {
            "name": f"{(rejected.name or 'unnamed')[:200]}.dra-gpu-{digest.hexdigest()[:16]}",
            "namespace": rejected.namespace or "default",
        },
        "eventTime": now,
        "type": "Warning",
        "reason": "ObjectRejected",
        "action": "Decode",
        "reportingController": "dra-gpu.io/driver",
        "reportingInstance": instance[:128] or "dra-gpu",
        "note": f"left out of the GPU driver's view: {rejected.reason}"[:1000],
        "regarding": {
            "apiVersion": api_version,
            "kind": kind,
            "namespace": rejected.namespace,
            "name": rejected.name,
            "uid": rejected.uid,
        },
    }


# ---------------------------------------------------------------- list + watch


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff from `initial` up to `maximum`, plus up to `initial` of random jitter so
    that a fleet of nodes does not retry in step."""

    initial: float = 1.0
    maximum: float = 30.0

    def wait(self) -> wait_base:
        return wait_exponential(multiplier=self.initial, max=self.maximum) + wait_random(0, self.initial)


ListHandler = Callable[[list[Any], str], Awaitable[None]]
EventHandler = Callable[[str, dict[str, Any]], Awaitable[bool]]


async def list_watch(
    kube: Kube,
    path: str,
    on_list: ListHandler,
    on_event: EventHandler,
    *,
    field_selector: str | None = None,
    keep: Keep | None = None,
    watch_seconds: int = 300,
    backoff: Backoff = Backoff(),
    transform: Transform | None = None,
) -> None:
    """List a collection, then watch it from the list's resourceVersion, forever (cancel to stop).

    `on_list(items, resourceVersion)` gets every full list (of the objects `keep` accepts, when
    given: the others are dropped as each page is decoded; each as `transform` makes it, when
    given, so that a list holds what the view keeps); `on_event(type, object)` every ADDED,
    MODIFIED or DELETED event and returns False to have the collection listed again at once. An
    object over the bounds (dra_gpu.kube.bounds) is left out of a list and is a REJECTED event in a watch
    (its metadata only: drop the copy held); each is reported (Kube.rejections, an Event). A new
    list also follows the end of each watch and a 410 Gone (the resourceVersion is too old). Any
    other failure is retried after a backoff that grows until a round (list, then watch to its end)
    succeeds. The watch has a deadline of its own, so a stalled connection cannot hang the loop.
    """
    while True:
        async for attempt in AsyncRetrying(
            wait=backoff.wait(),
            retry=retry_if_exception_type(Exception),
            before_sleep=_log_retry(path),
        ):
            with attempt:
                await _list_then_watch(
                    kube,
                    path,
                    on_list,
                    on_event,
                    field_selector,
                    keep,
                    watch_seconds,
                    backoff,
                    transform,
                )


async def _list_then_watch(
    kube: Kube,
    path: str,
    on_list: ListHandler,
    on_event: EventHandler,
    field_selector: str | None,
    keep: Keep | None,
    watch_seconds: int,
    backoff: Backoff,
    transform: Transform | None,
) -> None:
    items, version = await kube.list_objects(
        path, field_selector, keep=keep, backoff=backoff, transform=transform
    )
    await on_list(items, version)
    await kube.post_rejection_events()
    # Each watch (and so each list after it) lasts between one and two `watch_seconds`, like
    # client-go's reflectors: a fleet started together does not list again in step.
    seconds = random.randint(watch_seconds, 2 * watch_seconds)
    try:
        async with (
            asyncio.timeout(seconds + REQUEST_TIMEOUT),
            contextlib.aclosing(kube.watch_objects(path, version, seconds, field_selector)) as events,
        ):
            async for kind, obj in events:
                if kind == "BOOKMARK":
                    continue
                if kind == "ERROR":
                    code = int(obj.get("code") or 0)
                    if code == HTTP_GONE:
                        log.info("watch expired, listing again path=%s", path)
                        return
                    raise KubeError(code, f"watch {path}: {obj.get('message') or obj}")
                if kind == REJECTED:
                    await kube.post_rejection_events()
                if not await on_event(kind, obj):
                    return
    except KubeError as exc:
        if exc.status != HTTP_GONE:
            raise
        log.info("watch expired, listing again path=%s", path)


def _instance() -> str:
    """Who reports: the node (the plugin's NODE_NAME) or the pod / host name."""
    return os.environ.get("NODE_NAME") or os.environ.get("POD_NAME") or os.uname().nodename


def _log_relist(path: str) -> Callable[[RetryCallState], None]:
    def log_it(state: RetryCallState) -> None:
        delay = state.next_action.sleep if state.next_action else 0.0
        log.info("list's continue token expired, listing again in %.2fs path=%s", delay, path)

    return log_it


def _log_retry(path: str) -> Callable[[RetryCallState], None]:
    def log_it(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        delay = state.next_action.sleep if state.next_action else 0.0
        log.warning("list+watch failed, retrying in %.2fs path=%s error=%r", delay, path, str(error)[:200])

    return log_it


async def server_minor_version(kube: Kube) -> int | None:
    """The apiserver's minor version (/version; "34+" as some distributions write it is 34), or
    None when it does not say."""
    doc = await kube.get_json("/version") or {}
    digits = "".join(itertools.takewhile(str.isdigit, str(doc.get("minor") or "")))
    return int(digits) if digits else None
