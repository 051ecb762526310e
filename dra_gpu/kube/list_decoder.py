"""A Kubernetes list response decoded as its bytes arrive, one item at a time.

`json.loads` of a page needs the whole body and then every decoded item at once: a page of 100
claims of the largest size the apiserver stores (~1.5 MiB each, etcd's request limit) is ~150 MB
of bytes plus as much again of objects. Here each item is decoded as soon as its last byte is in,
handed to `keep`, and dropped unless kept: what is held beyond the kept items is one item and one
read chunk, whatever the page holds.

The body is a JSON object (`{"kind": ..., "metadata": {...}, "items": [...]}`, members in any
order). Its members other than `items` are decoded whole (`metadata` is the list's: a
resourceVersion and a continue token); each element of `items` on its own with the standard
library's decoder. An incomplete value is tried again only once the text after it has doubled (or
the body has ended), so a large item costs a few passes, not one per chunk.

An item over the bounds of dra_gpu.kube.bounds (too deep for the decoder, or more text than an
object may have) is not decoded: `ValueSkipper` finds its end, `on_rejected` gets its identity and
the rest of the list is decoded as usual. A kept item is checked against the same bounds before it
is kept (an item dropped by `keep` is not: nothing holds it).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable
from typing import Any

from dra_gpu.kube.bounds import (
    IDENTITY_PREFIX,
    MAX_OBJECT_BYTES,
    TOO_DEEP,
    Rejected,
    ValueSkipper,
    identify,
    over_bounds,
    reject,
    too_large,
)

Keep = Callable[[dict[str, Any]], bool]
# What is held of a kept item (None: nothing): a view that keeps a few fields of every object
# holds those, never the list's objects whole.
Transform = Callable[[dict[str, Any]], Any]
OnRejected = Callable[[Rejected], None]

_WHITESPACE = " \t\n\r"


class ListDecodeError(ValueError):
    """The body is not a JSON object with an `items` array of objects."""


class ListDecoder:
    """`feed` the body's bytes, then `close`; `items` are the kept items, `metadata` the list's."""

    def __init__(
        self,
        keep: Keep | None = None,
        resource: str = "",
        on_rejected: OnRejected | None = None,
        transform: Transform | None = None,
    ) -> None:
        self.keep = keep
        self.transform = transform
        self.resource = resource
        self.on_rejected = on_rejected
        self.rejected = 0  # items left out for their bounds
        self._skipper = ValueSkipper()
        self.items: list[Any] = []
        self.metadata: dict[str, Any] = {}
        self.seen = 0  # items decoded, kept or not
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self._text = ""
        self._pos = 0
        self._pending: list[str] = []  # text not yet appended to _text (joined once, when tried)
        self._pending_length = 0
        self._retry_at = 0  # length of the undecoded text at which to try a value again
        self._state = _START
        self._key = ""
        self._first = True  # the next member / item is the first of its object / array
        self._decoder = json.JSONDecoder()
        self._ended = False

    def feed(self, chunk: bytes) -> None:
        self._add(self._utf8.decode(chunk))

    def close(self) -> None:
        self._ended = True
        self._add(self._utf8.decode(b"", final=True))
        if self._state != _DONE:
            raise ListDecodeError("the list ended early")
        if self._rest().strip(_WHITESPACE):
            raise ListDecodeError("text after the list")

    # ------------------------------------------------------------------ the states

    def _add(self, text: str) -> None:
        if (
            self._pos > len(self._text) // 2
        ):  # drop what was decoded (amortized: each char moved once or twice)
            self._text = self._text[self._pos :]
            self._pos = 0
        self._text += text
        if len(self._text) - self._pos < self._retry_at and not self._ended:
            return
        self._retry_at = 0
        while self._state != _DONE and self._step():
            pass

    def _step(self) -> bool:
        """One token or value; False when more text is needed."""
        if self._state == _SKIP:  # inside an item (maybe inside a string): no whitespace skipped
            self._pos, ended = self._skipper.advance(self._text, self._pos)
            if ended:
                self._state, self._first = _ITEM, False
            return ended
        char = self._next_char()
        if char is None:
            return False
        if self._state == _START:
            self._expect(char, "{")
            self._state, self._first = _MEMBER, True
        elif self._state == _MEMBER:
            if char == "}":
                self._pos += 1
                self._state = _DONE
            elif not self._first:
                self._expect(char, ",")
                self._first = True
            else:
                key = self._value()
                if key is _MORE:
                    return False
                if not isinstance(key, str):
                    raise ListDecodeError("a member name is not a string")
                self._key, self._state = key, _COLON
        elif self._state == _COLON:
            self._expect(char, ":")
            self._state = _ITEMS_OPEN if self._key == "items" else _VALUE
        elif self._state == _VALUE:
            value = self._value()
            if value is _MORE:
                return False
            if self._key == "metadata":
                if not isinstance(value, dict):
                    raise ListDecodeError("metadata is not an object")
                self.metadata = value
            self._state, self._first = _MEMBER, False
        elif self._state == _ITEMS_OPEN:
            self._expect(char, "[")
            self._state, self._first = _ITEM, True
        elif self._state == _ITEM:
            if char == "]":
                self._pos += 1
                self._state, self._first = _MEMBER, False
            elif not self._first:
                self._expect(char, ",")
                self._first = True
            else:
                start = self._pos
                item = self._item()
                if item is _MORE:
                    return False
                self.seen += 1
                if item is _SKIPPED:
                    return True
                if not isinstance(item, dict):
                    raise ListDecodeError("an item is not an object")
                if self.keep is None or self.keep(item):
                    reason = over_bounds(item, self._pos - start)
                    if reason:
                        self._reject(reject(self.resource, item, reason))
                    elif self.transform is None:
                        self.items.append(item)
                    elif (held := self.transform(item)) is not None:
                        self.items.append(held)
                self._first = False
        return True

    def _item(self) -> Any:
        """The item at the position; _MORE when its text is not all in yet; _SKIPPED when it is
        over a bound before it could be decoded (the _SKIP state then finds its end)."""
        start = self._pos
        try:
            value = self._value()
        except RecursionError:
            reason = TOO_DEEP
        else:
            if value is not _MORE:
                return value
            if len(self._text) - start <= MAX_OBJECT_BYTES:
                # Decided by the time a little more than an object's largest text is in.
                self._retry_at = min(self._retry_at, MAX_OBJECT_BYTES + 1)
                return _MORE
            reason = too_large(len(self._text) - start, at_least=True)
        self._retry_at = 0
        self._reject(identify(self.resource, self._text[start : start + IDENTITY_PREFIX], reason))
        self._skipper = ValueSkipper()
        self._state = _SKIP
        return _SKIPPED

    def _reject(self, rejected: Rejected) -> None:
        self.rejected += 1
        if self.on_rejected is not None:
            self.on_rejected(rejected)

    # ------------------------------------------------------------------ the text

    def _rest(self) -> str:
        return self._text[self._pos :]

    def _next_char(self) -> str | None:
        text, pos = self._text, self._pos
        while pos < len(text) and text[pos] in _WHITESPACE:
            pos += 1
        self._pos = pos
        return text[pos] if pos < len(text) else None

    def _expect(self, char: str, want: str) -> None:
        if char != want:
            raise ListDecodeError(f"expected {want!r} at {char!r}")
        self._pos += 1

    def _value(self) -> Any:
        """The JSON value at the position, or _MORE when its text is not all in yet."""
        try:
            value, end = self._decoder.raw_decode(self._text, self._pos)
        except json.JSONDecodeError as exc:
            if self._ended:
                raise ListDecodeError(str(exc)) from exc
            self._retry_at = 2 * (len(self._text) - self._pos)
            return _MORE
        if end == len(self._text) and not self._ended and type(value) in (int, float):
            self._retry_at = len(self._text) - self._pos + 1  # a number may go on in the next chunk
            return _MORE
        self._pos = end
        return value


_START, _MEMBER, _COLON, _VALUE, _ITEMS_OPEN, _ITEM, _SKIP, _DONE = range(8)
_MORE = object()
_SKIPPED = object()
