"""Bounds on what is decoded from the apiserver: one object a tenant made can never stop a loop.

The apiserver stores what its own decoder accepts: a ResourceClaim whose opaque parameters nest
1,500 levels deep (9 KB) is created without complaint, and Python's JSON decoder raises
`RecursionError` on it. Decoded as part of a claims list or a watch line, such an object used to
fail the whole list-then-watch round for ever, on every node and in the webhook. So every object
read from the apiserver passes here:

- its text is at most MAX_OBJECT_BYTES characters (a watch line at most that plus the event's
  envelope), and it nests at most MAX_DEPTH levels (dra_gpu.common.decoding's bound for files too);
- an object over a bound is a `Rejected` record, never an exception that ends a loop: the list or
  watch goes on without it, and `Rejections` counts it (a metric labelled by resource only), logs
  it once with its namespace and name, and queues an Event on it;
- an object too deep for the decoder, or too large to be held, is skipped by `ValueSkipper`, which
  finds where it ends without decoding it (no recursion, no objects built); its identity is read
  from its first bytes (the apiserver writes `metadata` before `spec` and `status`).
"""

from __future__ import annotations

import collections
import json
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from dra_gpu.common.decoding import MAX_DEPTH

log = logging.getLogger(__name__)

# An object the apiserver stores is at most ~1.5 MiB (etcd's request limit); its JSON can be ~6x
# that when every byte of a string is written as a \u escape. 4 MiB of JSON holds any object a
# user makes on purpose and bounds what one object costs to hold.
MAX_OBJECT_BYTES = 4 * 1024 * 1024
ENVELOPE_BYTES = 64 * 1024  # a watch event's {"type": ..., "object": ...} around its object
MAX_LINE_BYTES = MAX_OBJECT_BYTES + ENVELOPE_BYTES
IDENTITY_PREFIX = 64 * 1024  # where an object's metadata.name, namespace and uid are looked for
REMEMBERED = 4096  # rejections logged once each; past that, the oldest may be logged again
EVENTS_PER_MINUTE = 10  # Events posted at most, per process: a flood of bad objects is counted


@dataclass(frozen=True)
class Rejected:
    """An object left out of the driver's view, and why."""

    resource: str  # the collection's plural name ("resourceclaims"): a closed set, the metric label
    namespace: str
    name: str
    uid: str
    reason: str

    def describe(self) -> str:
        where = f"{self.namespace}/{self.name}" if self.namespace else self.name
        return f"{self.resource} {where or '(name unreadable)'}: {self.reason}"

    def metadata(self) -> dict[str, str]:
        """What a cache needs to drop its copy: the object's namespace, name and uid."""
        return {k: v for k, v in (("namespace", self.namespace), ("name", self.name), ("uid", self.uid)) if v}


class ObjectRejected(ValueError):
    """One object read on its own (a GET) is over a bound."""

    def __init__(self, rejected: Rejected) -> None:
        super().__init__(rejected.describe())
        self.rejected = rejected


# ---------------------------------------------------------------- one object


def resource_of(collection: str) -> str:
    """The plural resource name of a collection's path (…/v1/resourceclaims → resourceclaims)."""
    return collection.rstrip("/").rsplit("/", 1)[-1]


def reject(resource: str, obj: Any, reason: str) -> Rejected:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    return Rejected(
        resource,
        str(meta.get("namespace") or ""),
        str(meta.get("name") or ""),
        str(meta.get("uid") or ""),
        reason,
    )


TOO_DEEP = f"nested more than {MAX_DEPTH} levels deep"


def too_large(size: int, at_least: bool = False) -> str:
    size_text = f"more than {size}" if at_least else str(size)
    return f"its JSON is {size_text} bytes, more than the {MAX_OBJECT_BYTES} accepted"


def over_bounds(obj: Any, size: int) -> str | None:
    """Why a decoded object of `size` characters is refused, or None."""
    if size > MAX_OBJECT_BYTES:
        return too_large(size)
    if isinstance(obj, dict | list) and nested_deeper(obj, MAX_DEPTH):
        return TOO_DEEP
    return None


def nested_deeper(value: Any, limit: int) -> bool:
    """Whether lists and mappings nest more than `limit` levels, found without recursion. Only the
    nesting: the values themselves are the apiserver's, valid JSON of Kubernetes types."""
    stack = [(value, 1)]
    while stack:
        container, depth = stack.pop()
        children = container.values() if isinstance(container, dict) else container
        for child in children:
            if isinstance(child, dict | list):
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


def decode_object(raw: bytes, resource: str) -> Any:
    """A JSON document from the apiserver, or ObjectRejected when it is over a bound."""
    if len(raw) > MAX_LINE_BYTES:
        text = raw[:IDENTITY_PREFIX].decode(errors="replace")
        raise ObjectRejected(identify(resource, text, too_large(len(raw))))
    try:
        obj = json.loads(raw)
    except RecursionError:
        text = raw[:IDENTITY_PREFIX].decode(errors="replace")
        raise ObjectRejected(identify(resource, text, TOO_DEEP)) from None
    reason = over_bounds(obj, len(raw))
    if reason:
        raise ObjectRejected(reject(resource, obj, reason))
    return obj


# The first "name", "namespace" and "uid" members after "metadata": the apiserver writes ObjectMeta
# with these before managedFields (the only part of metadata that nests).
_METADATA = re.compile(r'"metadata"\s*:\s*\{')
_STRING = r'"((?:[^"\\]|\\.){0,1024})"'
_MEMBERS = {key: re.compile(rf'"{key}"\s*:\s*{_STRING}', re.S) for key in ("name", "namespace", "uid")}


def identify(resource: str, prefix: str, reason: str) -> Rejected:
    """A Rejected whose identity is read from the first bytes of an object that is not decoded."""
    found = {"name": "", "namespace": "", "uid": ""}
    meta = _METADATA.search(prefix)
    if meta:
        for key, pattern in _MEMBERS.items():
            match = pattern.search(prefix, meta.end())
            if match:
                try:
                    found[key] = str(json.loads(f'"{match.group(1)}"'))
                except ValueError:
                    found[key] = match.group(1)
    return Rejected(resource, found["namespace"], found["name"], found["uid"], reason)


# ---------------------------------------------------------------- skipping a value

_TOKEN = re.compile(r'"|[\[{]+|[\]}]+')  # a string's start, or a run of opening or closing brackets
_STRING_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.S)  # up to a string's end (or a split escape)


class ValueSkipper:
    """Finds the end of one JSON object or array in text that arrives in pieces, without decoding
    it: a run of brackets is one step, a string one regex match, so `[[[[…]]]]` of a megabyte
    costs two steps. The text must start at the value's first bracket (not checked: the list
    decoder has seen it)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False

    def advance(self, text: str, pos: int) -> tuple[int, bool]:
        """(where scanning stopped, whether the value ended there)."""
        end = len(text)
        while pos < end:
            if self.in_string:
                pos = _STRING_BODY.match(text, pos).end()  # type: ignore[union-attr]  # matches ""
                if pos >= end or text[pos] != '"':
                    return pos, False  # the string (or an escape) goes on in the next piece
                pos += 1
                self.in_string = False
                continue
            token = _TOKEN.search(text, pos)
            if token is None:
                return end, False
            run = token.group()
            if run == '"':
                self.in_string = True
            elif run[0] in "[{":
                self.depth += len(run)
            elif len(run) >= self.depth:
                return token.start() + self.depth, True
            else:
                self.depth -= len(run)
            pos = token.end()
        return pos, False


# ---------------------------------------------------------------- watch lines


@dataclass(frozen=True)
class LongLine:
    """A line longer than the limit: its first bytes (for its identity) and its length."""

    prefix: bytes
    length: int


class LineSplitter:
    """Splits a watch stream into lines of at most `limit` bytes; a longer line is given as a
    LongLine, its bytes past the prefix dropped as they arrive (never held whole)."""

    def __init__(self, limit: int = MAX_LINE_BYTES) -> None:
        self.limit = limit
        self._buffer = bytearray()
        self._long: tuple[bytes, int] | None = None  # (prefix, length so far) of a line being dropped

    def feed(self, chunk: bytes) -> Iterator[bytes | LongLine]:
        start = 0
        while start < len(chunk):
            newline = chunk.find(b"\n", start)
            piece = chunk[start:] if newline < 0 else chunk[start:newline]
            start = len(chunk) if newline < 0 else newline + 1
            if self._long is not None:
                self._long = (self._long[0], self._long[1] + len(piece))
            elif len(self._buffer) + len(piece) > self.limit:
                length = len(self._buffer) + len(piece)
                self._buffer += piece[: max(0, IDENTITY_PREFIX - len(self._buffer))]
                self._long = (bytes(self._buffer[:IDENTITY_PREFIX]), length)
                self._buffer.clear()
            else:
                self._buffer += piece
            if newline >= 0:
                yield from self._line_end()

    def close(self) -> Iterator[bytes | LongLine]:
        """What is left when the stream ends (the server ends a watch after a whole line)."""
        if self._buffer or self._long is not None:
            yield from self._line_end()

    def _line_end(self) -> Iterator[bytes | LongLine]:
        if self._long is not None:
            prefix, length = self._long
            self._long = None
            yield LongLine(prefix, length)
        elif self._buffer.strip():
            line = bytes(self._buffer)
            self._buffer.clear()
            yield line
        else:
            self._buffer.clear()


# ---------------------------------------------------------------- reporting


class Rejections:
    """Counts, logs once and queues an Event for each rejected object of one process."""

    def __init__(self) -> None:
        self.counter = Counter(
            "dra_gpu_apiserver_objects_rejected",
            "Objects read from the apiserver and left out of the view: nested too deep or too large "
            "(resource: the collection, e.g. resourceclaims).",
            ["resource"],
            registry=None,
        )
        self._seen: collections.OrderedDict[tuple[str, str, str, str], None] = collections.OrderedDict()
        self._events: collections.deque[Rejected] = collections.deque(maxlen=EVENTS_PER_MINUTE)
        self._event_times: collections.deque[float] = collections.deque(maxlen=EVENTS_PER_MINUTE)
        self.events_allowed = True  # False once the apiserver answered 403 (no RBAC for Events)

    def register(self, registry: CollectorRegistry) -> None:
        """Have the counter served with the process's other metrics."""
        registry.register(self.counter)

    def report(self, rejected: Rejected) -> None:
        self.counter.labels(rejected.resource).inc()
        key = (rejected.resource, rejected.namespace, rejected.name, rejected.uid)
        if key in self._seen:
            self._seen.move_to_end(key)
            return
        self._seen[key] = None
        if len(self._seen) > REMEMBERED:
            self._seen.popitem(last=False)
        log.error(
            "object left out of the view resource=%s namespace=%s name=%s uid=%s reason=%r",
            rejected.resource,
            rejected.namespace,
            rejected.name,
            rejected.uid,
            rejected.reason,
        )
        if self.events_allowed and (rejected.name or rejected.uid):
            self._events.append(rejected)

    def take_events(self, now: float | None = None) -> list[Rejected]:
        """The queued rejections to post as Events now: at most EVENTS_PER_MINUTE a minute."""
        now = time.monotonic() if now is None else now
        taken: list[Rejected] = []
        while self._events and (
            len(self._event_times) < EVENTS_PER_MINUTE or now - self._event_times[0] >= 60.0
        ):
            taken.append(self._events.popleft())
            self._event_times.append(now)
        return taken


def decode_event(line: bytes | LongLine, resource: str) -> tuple[str, Any] | Rejected:
    """A watch line's (type, object), or the Rejected that stands for its object."""
    if isinstance(line, LongLine):
        text = line.prefix.decode(errors="replace")
        return identify(resource, text, too_large(line.length))
    try:
        event = json.loads(line)
    except RecursionError:
        text = line[:IDENTITY_PREFIX].decode(errors="replace")
        return identify(resource, text, TOO_DEEP)
    obj = event.get("object") if isinstance(event, dict) else None
    if not isinstance(obj, dict):
        raise ValueError(f"watch {resource}: a line is not an event: {line[:200]!r}")
    kind = str(event.get("type") or "")
    if kind in ("BOOKMARK", "ERROR"):
        return kind, obj
    reason = over_bounds(obj, len(line))
    return reject(resource, obj, reason) if reason else (kind, obj)
