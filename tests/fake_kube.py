"""An in-memory Kubernetes API behind the `ApiClient` interface that `dra_gpu.kube.api.Kube` calls.

It answers the few requests the driver makes (list, get, server-side apply, delete, watch) the way
the apiserver does: resourceVersions, field selectors, lists in pages (`limit` / `continue`, 410
Gone for an expired continue token), ADDED/MODIFIED/DELETED events, watches that end after
timeoutSeconds, 410 Gone for an expired watch, Status bodies on errors. Bodies are read in small
odd-sized chunks, as from a network, so that decoding across chunk boundaries is exercised. Tests also use it
to inject failures and hold requests. The real apiserver is exercised by the e2e tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dra_gpu.kube.api import Kube

_PATH = re.compile(
    r"^/(?:apis/[^/]+|api)/[^/]+/(?:namespaces/(?P<ns>[^/]+)/)?(?P<plural>[a-z]+)(?:/(?P<name>[^/]+))?$"
)
_SERVER_SET = ("resourceVersion", "uid", "creationTimestamp", "generation")
_META_ORDER = {k: i for i, k in enumerate(("name", "generateName", "namespace", "uid", "resourceVersion"))}
BODY_CHUNK = 997  # bytes a body is read in, at most


@dataclass
class Failure:
    """Answer the next `count` matching requests with `status` (or raise `error`)."""

    method: str | None = None
    plural: str | None = None
    watch: bool | None = None
    status: int = 500
    error: BaseException | None = None
    count: int = 1
    retry_after: int | None = None  # seconds, sent as the answer's Retry-After header

    def matches(self, method: str, plural: str, watch: bool) -> bool:
        return (
            (self.method is None or self.method == method)
            and (self.plural is None or self.plural == plural)
            and (self.watch is None or self.watch == watch)
        )


@dataclass
class Event:
    version: int
    plural: str
    type: str
    object: dict[str, Any]


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    body: Any = None

    @property
    def watch(self) -> bool:
        return self.query.get("watch") == "true"


@dataclass
class FakeApiServer:
    objects: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # plural -> key -> obj
    events: list[Event] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    expire_watches: int = 0  # the next N watches end at once with a 410 Gone ERROR event
    expire_continues: int = 0  # the next N list requests with a continue token get 410 Gone
    stall_watches: bool = False  # watches never end, as over a connection that went silent
    gates: dict[str, asyncio.Event] = field(default_factory=dict)  # plural -> list/watch wait for it
    on_write: Callable[[dict[str, Any]], None] | None = None  # e.g. drop a field, as a gate that is off
    version: int = 0
    streams: list[WatchStream] = field(default_factory=list)
    _changed: asyncio.Event | None = None

    def kube(self) -> Kube:
        return Kube(FakeApiClient(self))

    # -------------------------------------------------------------- what tests call directly

    def put(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace an object (as another client would); returns what is stored."""
        with deep_objects():
            obj = copy.deepcopy(obj)
        if self.on_write is not None:
            self.on_write(obj)
        key = _key(obj)
        store = self.objects.setdefault(plural, {})
        old = store.get(key)
        with deep_objects():
            unchanged = old is not None and _content(old) == _content(obj)
        if old is not None and unchanged:
            return old  # a no-op write changes nothing and sends no event
        self.version += 1
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = str(self.version)
        meta["uid"] = (old or {}).get("metadata", {}).get("uid") or f"uid-{self.version}"
        # In the apiserver's order: identity first, then labels, annotations, managedFields.
        obj["metadata"] = dict(sorted(meta.items(), key=lambda kv: _META_ORDER.get(kv[0], len(_META_ORDER))))
        store[key] = obj
        self._emit(plural, "ADDED" if old is None else "MODIFIED", obj)
        return obj

    def remove(self, plural: str, name: str, namespace: str = "") -> bool:
        obj = self.objects.get(plural, {}).pop(f"{namespace}/{name}", None)
        if obj is None:
            return False
        self.version += 1
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.version)}}
        self._emit(plural, "DELETED", obj)
        return True

    def end_watches(self) -> None:
        """End every open watch, as an apiserver restart does."""
        for stream in self.streams:
            stream.closed = True
        self.changed().set()
        self._changed = None

    def items(self, plural: str) -> list[dict[str, Any]]:
        return list(self.objects.get(plural, {}).values())

    def fail(self, **kwargs: Any) -> None:
        self.failures.append(Failure(**kwargs))

    def count(self, method: str, plural: str, watch: bool = False) -> int:
        return sum(
            1 for r in self.requests if (r.method, _plural(r.path), r.watch) == (method, plural, watch)
        )

    # -------------------------------------------------------------- the API

    async def handle(self, req: Request, timeout: float | None) -> FakeResponse:
        self.requests.append(req)
        m = _PATH.match(req.path)
        if m is None:
            return _status(404, f"no such path {req.path}")
        ns, plural, name = m["ns"] or "", m["plural"], m["name"]
        for failure in self.failures:
            if failure.count > 0 and failure.matches(req.method, plural, req.watch):
                failure.count -= 1
                if failure.error is not None:
                    raise failure.error
                answer = _status(failure.status, f"injected failure of {req.method} {req.path}")
                if failure.retry_after is not None:
                    answer.headers["Retry-After"] = str(failure.retry_after)
                return answer
        gate = self.gates.get(plural)
        if gate is not None and req.method == "GET":
            async with asyncio.timeout(timeout):
                await gate.wait()
        if req.method == "GET" and name:
            obj = self.objects.get(plural, {}).get(f"{ns}/{name}")
            return _json(200, obj) if obj is not None else _status(404, f'{plural} "{name}" not found')
        if req.method == "GET" and req.watch:
            return FakeResponse(200, stream=self._watch(plural, ns, req.query))
        if req.method == "GET":
            return self._list(plural, ns, req.query)
        if req.method == "POST" and not name:
            body = copy.deepcopy(req.body)
            if ns:
                body.setdefault("metadata", {})["namespace"] = ns
            if _key(body) in self.objects.get(plural, {}):
                return _status(409, f'{plural} "{_key(body)}" already exists', reason="AlreadyExists")
            return _json(201, self.put(plural, body))
        if req.method == "PATCH":
            if req.query.get("fieldManager") is None:
                return _status(422, "fieldManager is required for apply")
            return _json(200, self.put(plural, req.body))
        if req.method == "DELETE":
            if not self.remove(plural, name, ns):
                return _status(404, f'{plural} "{name}" not found')
            return _json(200, {"kind": "Status", "status": "Success"})
        return _status(405, f"method {req.method} not allowed")

    def _list(self, plural: str, ns: str, query: dict[str, str]) -> FakeResponse:
        """A list, or its page after the continue token's key; the token carries the first page's
        resourceVersion (the apiserver serves every page from that snapshot; this store has only the
        present, so a page shows objects as they are now)."""
        selected = sorted(
            (o for o in self.items(plural) if _selected(o, ns, query.get("fieldSelector"))), key=_key
        )
        version, after = self.version, ""
        if query.get("continue"):
            if self.expire_continues > 0:
                self.expire_continues -= 1
                return _status(410, "The provided continue parameter is too old", reason="Expired")
            version, after = json.loads(query["continue"])
            selected = [o for o in selected if _key(o) > after]
        meta: dict[str, Any] = {"resourceVersion": str(version)}
        limit = int(query.get("limit") or 0)
        if 0 < limit < len(selected):
            selected = selected[:limit]
            meta["continue"] = json.dumps([version, _key(selected[-1])])
        return _json(200, {"kind": "List", "metadata": meta, "items": selected})

    def _emit(self, plural: str, kind: str, obj: dict[str, Any]) -> None:
        with deep_objects():
            self.events.append(Event(self.version, plural, kind, copy.deepcopy(obj)))
        if self._changed is not None:
            self._changed.set()
        self._changed = None

    def _watch(self, plural: str, ns: str, query: dict[str, str]) -> WatchStream:
        if self.expire_watches > 0:
            self.expire_watches -= 1
            gone = {"kind": "Status", "status": "Failure", "reason": "Expired", "code": 410}
            return WatchStream(self, plural, ns, None, 0, 0.0, [{"type": "ERROR", "object": gone}])
        seconds = float("inf") if self.stall_watches else float(query.get("timeoutSeconds", "300"))
        deadline = asyncio.get_running_loop().time() + seconds
        after = int(query["resourceVersion"])
        stream = WatchStream(self, plural, ns, query.get("fieldSelector"), after, deadline)
        self.streams.append(stream)
        return stream

    def changed(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed


class WatchStream:
    """The body of a watch response: one JSON event a line, until the server-side timeout."""

    def __init__(
        self,
        server: FakeApiServer,
        plural: str,
        namespace: str,
        selector: str | None,
        after: int,
        deadline: float,
        preset: list[dict[str, Any]] | None = None,
    ) -> None:
        self.server, self.plural, self.namespace, self.selector = server, plural, namespace, selector
        self.cursor, self.deadline = after, deadline
        self.preset = preset
        self.closed = False

    def __aiter__(self) -> WatchStream:
        return self

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The lines in pieces of at most BODY_CHUNK bytes, as from a network."""
        async for line in self:
            for start in range(0, len(line), BODY_CHUNK):
                yield line[start : start + BODY_CHUNK]

    async def __anext__(self) -> bytes:
        if self.preset is not None:
            if not self.preset:
                raise StopAsyncIteration
            return _dumps(self.preset.pop(0)) + b"\n"
        loop = asyncio.get_running_loop()
        while not self.closed:
            for ev in self.server.events:
                if ev.version > self.cursor and ev.plural == self.plural:
                    self.cursor = ev.version
                    if _selected(ev.object, self.namespace, self.selector):
                        return _dumps({"type": ev.type, "object": ev.object}) + b"\n"
            remaining = self.deadline - loop.time()
            if remaining <= 0:
                break
            try:
                async with asyncio.timeout(None if remaining == float("inf") else remaining):
                    await self.server.changed().wait()
            except TimeoutError:
                break
        raise StopAsyncIteration


class FakeResponse:
    """What `Kube` reads of an aiohttp response: status, read(), release(), content."""

    def __init__(self, status: int, body: bytes = b"", stream: WatchStream | None = None) -> None:
        self.status = status
        self.body = body
        self.content: WatchStream | Body = stream or Body(body)
        self.released = False
        self.headers: dict[str, str] = {}

    async def read(self) -> bytes:
        return self.body

    def release(self) -> None:
        self.released = True
        self.content.closed = True


class Body:
    """A whole body, streamed in chunks of at most BODY_CHUNK bytes."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.closed = False

    async def iter_chunked(self, n: int) -> AsyncIterator[bytes]:
        step = min(n, BODY_CHUNK)
        for start in range(0, len(self.body), step):
            yield self.body[start : start + step]


@dataclass
class _RestResponse:
    response: FakeResponse


class FakeApiClient:
    """Stands in for kubernetes.aio's ApiClient: the two calls `Kube._request` makes, and close()."""

    def __init__(self, server: FakeApiServer) -> None:
        self.server = server
        self.closed = False

    async def param_serialize(
        self,
        method: str,
        resource_path: str,
        query_params: list[tuple[str, Any]] | None = None,
        header_params: dict[str, str] | None = None,
        body: Any = None,
        **_: Any,
    ) -> tuple[Any, ...]:
        query = {k: str(v) for k, v in query_params or []}
        return Request(method, resource_path, query, copy.deepcopy(body)), header_params or {}

    async def call_api(
        self, req: Request, _headers: dict[str, str], _request_timeout: float | None = None, **_: Any
    ) -> _RestResponse:
        return _RestResponse(await self.server.handle(req, _request_timeout))

    async def close(self) -> None:
        self.closed = True


def _plural(path: str) -> str | None:
    m = _PATH.match(path)
    return m["plural"] if m else None


def _key(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or ''}/{meta['name']}"


def _content(obj: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k not in _SERVER_SET}
    return {**obj, "metadata": meta}


def _selected(obj: dict[str, Any], namespace: str, selector: str | None) -> bool:
    if namespace and (obj.get("metadata") or {}).get("namespace") != namespace:
        return False
    for term in (selector or "").split(","):
        if not term:
            continue
        path, _, want = term.partition("=")
        value: Any = obj
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if str(value) != want:
            return False
    return True


@contextlib.contextmanager
def deep_objects() -> Iterator[None]:
    """The apiserver stores and serves objects nested up to 10,000 levels (its decoder's bound);
    the fake handles them too, with the interpreter's recursion limit raised meanwhile (copying,
    comparing and encoding recurse). The code under test runs with the usual limit."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000))
    try:
        yield
    finally:
        sys.setrecursionlimit(limit)


def _dumps(obj: Any) -> bytes:
    with deep_objects():
        return json.dumps(obj).encode()


def _json(status: int, obj: Any) -> FakeResponse:
    return FakeResponse(status, _dumps(obj))


def _status(code: int, message: str, reason: str = "") -> FakeResponse:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": code}
    if reason:
        body["reason"] = reason
    return _json(code, body)


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait until `check()` holds, as the loop runs the code under test; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)
