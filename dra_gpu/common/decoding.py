"""Decoding untrusted input before any logic sees it: bounded reading, bounded YAML, bounded values
and a small typed schema walker.

Every object the tools accept (DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
AdmissionReview, node profiles, opaque configs) goes through here first, so the rules behind it can
rely on types and sizes instead of re-checking them, and no input costs more than a bounded amount of
time or memory. One mechanism: a file is read with `read_bounded`, parsed with `load_yaml_all`
(aliases refused: "billion laughs"), walked once by `check_bounds` (depth, sizes, string lengths,
numbers) and then by a `Shape` (types, field by field). Problems come back as `(path, message)`
pairs; callers prefix them with `<Kind>/<name>:`.

Libraries considered: jsonschema (already a dev dependency) validates types, but its error paths
need translating, it neither bounds depth nor cost, and it would be a runtime dependency for one
walk; pydantic would replace the plain dicts the rules work on. A walker of ~150 lines keeps the
messages in the project's words ("must be a list, got a string").
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

MAX_FILE_BYTES = 64 * 1024 * 1024
MAX_DEPTH = 64  # nesting of mappings and lists
MAX_ITEMS = 100_000  # entries of one list or mapping
MAX_STRING = 3 * 1024 * 1024  # characters of one string (the apiserver's request limit)
MAX_INT = (1 << 63) - 1  # Kubernetes integers are int64

Problems = list[tuple[str, str]]


class DecodeError(ValueError):
    """Input that cannot be decoded at all (unreadable, too large, not YAML)."""


# ---------------------------------------------------------------- reading


def read_bounded(path: str, limit: int = MAX_FILE_BYTES) -> str:
    """The text of a regular file of at most `limit` bytes.

    Special files are refused: /dev/zero never ends and a FIFO blocks until a writer comes; stat
    first, then open without blocking and read at most limit+1 bytes, so a file that grows while
    being read is caught too.
    """
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise DecodeError(f"{path}: not a regular file")
        if st.st_size > limit:
            raise DecodeError(f"{path}: larger than {limit} bytes")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # swapped between stat and open
                raise DecodeError(f"{path}: not a regular file")
            data = f.read(limit + 1)
    except OSError as exc:
        raise DecodeError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if len(data) > limit:
        raise DecodeError(f"{path}: larger than {limit} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError(f"cannot read {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


# ---------------------------------------------------------------- YAML


class NoAliasSafeLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases: `*ref` can expand a small file into billions of nodes."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise yaml.composer.ComposerError(
                None,
                None,
                "YAML aliases (*name) are not accepted",
                event.start_mark,
            )
        return super().compose_node(parent, index)


_OPEN = (yaml.SequenceStartEvent, yaml.MappingStartEvent)
_CLOSE = (yaml.SequenceEndEvent, yaml.MappingEndEvent)
_FAST = getattr(yaml, "__with_libyaml__", False)


def _scan(text: str) -> None:
    """One pass over libyaml's events: aliases and nesting are refused before anything is built
    (libyaml's composer would expand the aliases, and recurse in C on the nesting)."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.CSafeLoader):
        if isinstance(event, yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None,
                None,
                "YAML aliases (*name) are not accepted",
                event.start_mark,  # type: ignore[arg-type]
            )
        if isinstance(event, _OPEN):
            depth += 1
            if depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"nested more than {MAX_DEPTH} levels deep",
                    event.start_mark,  # type: ignore[arg-type]
                )
        elif isinstance(event, _CLOSE):
            depth -= 1


_TAG = "tag:yaml.org,2002:"
_STR, _MAP, _SEQ = f"{_TAG}str", f"{_TAG}map", f"{_TAG}seq"
_SCALARS: dict[str, Callable[[Any, Any], Any]] = {
    f"{_TAG}int": yaml.SafeLoader.construct_yaml_int,
    f"{_TAG}bool": yaml.SafeLoader.construct_yaml_bool,
    f"{_TAG}null": yaml.SafeLoader.construct_yaml_null,
    f"{_TAG}float": yaml.SafeLoader.construct_yaml_float,
}


class _Unusual(Exception):
    """A node _BoundedCLoader.build leaves to SafeConstructor (merge keys, other tags, odd keys)."""


class _BoundedCLoader(yaml.CSafeLoader):
    """libyaml's loader for text without aliases: the nesting is bounded while libyaml's composer
    recurses (in C) through the node it calls this back for, a scalar's tag is resolved once
    per distinct text (PyYAML's resolver is Python, called for every scalar), and documents of
    plain maps, lists and scalars are built directly (SafeConstructor's generators cost ~10x)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self._depth = 0
        self._tags: dict[tuple[str, Any], str] = {}

    def descend_resolver(self, current_node: Any, current_index: Any) -> None:
        self._depth += 1
        if self._depth > MAX_DEPTH + 1:  # a node inside more than MAX_DEPTH collections
            raise yaml.composer.ComposerError(
                None, None, f"nested more than {MAX_DEPTH} levels deep", current_node.start_mark
            )
        if self.yaml_path_resolvers:  # none in SafeLoader; kept for a subclass that adds some
            super().descend_resolver(current_node, current_index)

    def ascend_resolver(self) -> None:
        self._depth -= 1
        if self.yaml_path_resolvers:
            super().ascend_resolver()

    def build_document(self, node: Any) -> Any:
        """What construct_document builds from `node`."""
        try:
            return self._build(node)
        except _Unusual:
            return self.construct_document(node)

    def _build(self, node: Any) -> Any:
        kind, tag = type(node), node.tag
        if kind is yaml.ScalarNode:
            if tag == _STR:
                return node.value
            scalar = _SCALARS.get(tag)
            if scalar is None:
                raise _Unusual
            return scalar(self, node)
        if kind is yaml.MappingNode and tag == _MAP:
            out = {}
            for key, value in node.value:
                if type(key) is not yaml.ScalarNode or key.tag not in (_STR, *_SCALARS):
                    raise _Unusual  # a merge key (<<), a collection as key: SafeConstructor's words
                out[self._build(key)] = self._build(value)  # recursion: the nesting is bounded
            return out
        if kind is yaml.SequenceNode and tag == _SEQ:
            return [self._build(item) for item in node.value]
        raise _Unusual

    def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
        if kind is not yaml.ScalarNode or len(value) > 64:
            return super().resolve(kind, value, implicit)  # type: ignore[no-untyped-call]
        key = (value, implicit)
        tag = self._tags.get(key)
        if tag is None:
            tag = super().resolve(kind, value, implicit)  # type: ignore[no-untyped-call]
            if len(self._tags) < 4096:
                self._tags[key] = tag
        return tag


def load_yaml_all(text: str) -> Iterator[Any]:
    """The documents of a YAML (or JSON) stream, without aliases; yaml.YAMLError when it is not YAML.

    With libyaml (the usual case) ~5x faster than PyYAML's own parser, which matters for a file of
    megabytes. Text without a `*` can hold no alias: libyaml's loader then bounds the nesting as it
    goes; otherwise a scan of libyaml's events refuses aliases and nesting before anything is
    built. Either way every document is built before the first is given out, so a stream that is
    not YAML further on gives no documents at all.

    A JSON document (`kubectl get -o json`, `dra-gpu top`'s explanations: megabytes) is read by
    the json module, ~10x faster than libyaml; JSON has no aliases, and its nesting is bounded by
    the interpreter's recursion limit here and to MAX_DEPTH by `check_bounds`, which every
    document passes before it is read (dra_gpu.controller.schemas.decode_object)."""
    if text.lstrip()[:1] in ("{", "["):  # JSON (kubectl -o json, dra-gpu top): its own parser, ~20x faster
        try:
            doc = json.loads(text)
        except RecursionError:
            raise yaml.YAMLError(f"nested deeper than {MAX_DEPTH} levels") from None
        except ValueError:
            pass  # YAML in flow style, not JSON: read as YAML below
        else:
            yield doc
            return
    if _FAST and "*" not in text:
        bounded = _BoundedCLoader(text)
        try:
            docs = []
            while bounded.check_node():
                docs.append(bounded.build_document(bounded.get_node()))
        finally:
            bounded.dispose()
        yield from docs
        return
    if _FAST:
        _scan(text)
        yield from yaml.load_all(text, Loader=yaml.CSafeLoader)
        return
    loader = NoAliasSafeLoader(text)
    try:
        while loader.check_data():  # type: ignore[no-untyped-call]
            yield loader.get_data()
    finally:
        loader.dispose()


def load_yaml(text: str) -> Any:
    """One YAML document, without aliases."""
    if _FAST and "*" not in text:
        bounded = _BoundedCLoader(text)
        try:
            node = bounded.get_single_node()
            return None if node is None else bounded.build_document(node)
        finally:
            bounded.dispose()
    if _FAST:
        _scan(text)
        return yaml.load(text, Loader=yaml.CSafeLoader)
    loader = NoAliasSafeLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def yaml_problem(exc: yaml.YAMLError | RecursionError) -> str:
    """A YAML error as `:<line>: not valid YAML: <problem>` (the file name goes before it)."""
    if isinstance(exc, RecursionError):
        return ": not valid YAML: nested too deeply"
    mark = getattr(exc, "problem_mark", None)
    line = f":{mark.line + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"{line}: not valid YAML: {problem}"


# ---------------------------------------------------------------- bounds


_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def join(path: str, key: Any) -> str:
    """`spec.devices` + `requests` -> `spec.devices.requests`; an int key gives `[i]`; a key that is
    not a plain name is quoted: `capacity["gpu.dra-gpu.io/memory"]`."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    text = str(key)
    if _plain(text) if len(text) <= 64 else _PLAIN_NAME.fullmatch(text):
        return f"{path}.{text}" if path else text
    return f"{path}[{text[:64]!r}]".replace("'", '"')


@functools.lru_cache(maxsize=4096)
def _plain(text: str) -> bool:
    """A plain name (shown after a dot in a path); cached: objects repeat their field names."""
    return _PLAIN_NAME.fullmatch(text) is not None


def _path(at: Any) -> str:
    """The path of a place check_bounds passed: a str, or (the parent's place, key)."""
    keys = []
    while isinstance(at, tuple):
        at, key = at
        keys.append(key)
    path: str = at
    for key in reversed(keys):
        path = join(path, key)
    return path


def _where(at: Any) -> str:
    return _path(at) or "(document)"


def check_bounds(value: Any, path: str = "", depth_limit: int = MAX_DEPTH) -> Problems:
    """Sizes, nesting and numbers of a decoded document, iteratively (no recursion to exhaust).

    Stops at the first problem: past one, the rest may be arbitrarily large. A value's place is
    kept as (parent's place, key) and spelt out only for the problem: most values have none.
    """
    stack: list[tuple[Any, Any, int]] = [(value, path, 0)]
    while stack:
        v, at, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth >= depth_limit:
                return [(_where(at), f"nested more than {depth_limit} levels deep")]
            if len(v) > MAX_ITEMS:
                return [(_where(at), f"has {len(v)} entries, at most {MAX_ITEMS} are accepted")]
            if isinstance(v, dict):
                for k, item in v.items():
                    if not isinstance(k, str):
                        return [(join(_path(at), str(k)), f"key {k!r} must be a string")]
                    if len(k) > MAX_STRING:
                        return [(_where(at), f"has a key of {len(k)} characters")]
                    stack.append((item, (at, k), depth + 1))
            else:
                stack.extend((item, (at, i), depth + 1) for i, item in enumerate(v))
        elif isinstance(v, str):
            if len(v) > MAX_STRING:
                return [
                    (
                        _where(at),
                        f"is {len(v)} characters long; the apiserver accepts at most {MAX_STRING} bytes",
                    )
                ]
        elif isinstance(v, bool) or v is None:
            continue
        elif isinstance(v, int):
            if abs(v) > MAX_INT:
                return [(_where(at), f"integer out of range (at most {MAX_INT} in magnitude)")]
        elif isinstance(v, float):
            if not math.isfinite(v):
                return [
                    (
                        _where(at),
                        f"{v!r} is not a number (NaN and infinities are not accepted)",
                    )
                ]
        else:  # YAML timestamps, binary, sets: not JSON, so never part of a Kubernetes object
            return [(_where(at), f"{type_name(v)} is not accepted (quote it to make it a string)")]
    return []


def type_name(value: Any) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }.get(type(value), f"a {type(value).__name__}")


# ---------------------------------------------------------------- shapes


class Shape:
    """The expected type of one value. `check` appends problems; None (JSON null) means unset and
    is accepted wherever a field is optional, as the apiserver's decoder does."""

    description = "a value"

    def check(self, value: Any, path: str, problems: Problems) -> None:
        if not self.accepts(value):
            problems.append((path, f"must be {self.description}, got {type_name(value)}"))

    def accepts(self, value: Any) -> bool:
        return True


class Str(Shape):
    description = "a string"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str)


class Int(Shape):
    description = "an integer"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)


class Bool(Shape):
    description = "a boolean"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, bool)


@dataclass
class Obj(Shape):
    """A mapping with typed known fields; other fields are not checked here (the rules say which
    are allowed where it matters)."""

    fields: Mapping[str, Shape]
    description: str = "an object"
    required: tuple[str, ...] = ()  # fields that must be set (not null)
    one_of: tuple[str, ...] = ()  # exactly one of these must be set

    def check(self, value: Any, path: str, problems: Problems) -> None:
        if not isinstance(value, dict):
            problems.append((path or "(document)", f"must be {self.description}, got {type_name(value)}"))
            return
        for name in self.required:
            if value.get(name) is None:
                problems.append((join(path, name), "required"))
        if self.one_of:
            present = [name for name in self.one_of if value.get(name) is not None]
            if len(present) != 1:
                got = f"got {', '.join(present)}" if present else "got none"
                problems.append(
                    (path or "(document)", f"needs exactly one of {', '.join(self.one_of)}; {got}")
                )
        for name, shape in self.fields.items():
            item = value.get(name)
            if item is not None:
                shape.check(item, join(path, name), problems)


@dataclass
class ListOf(Shape):
    item: Shape
    description: str = "a list"

    def check(self, value: Any, path: str, problems: Problems) -> None:
        if not isinstance(value, list):
            problems.append((path, f"must be a list, got {type_name(value)}"))
            return
        for i, item in enumerate(value):
            if item is None:
                problems.append((join(path, i), "must not be null"))
            else:
                self.item.check(item, join(path, i), problems)


@dataclass
class MapOf(Shape):
    value: Shape
    description: str = "an object"

    def check(self, value: Any, path: str, problems: Problems) -> None:
        if not isinstance(value, dict):
            problems.append((path, f"must be an object, got {type_name(value)}"))
            return
        for k, item in value.items():
            if item is None:
                problems.append((join(path, k), "must not be null"))
            else:
                self.value.check(item, join(path, k), problems)


@dataclass
class Custom(Shape):
    """A value checked by a function returning the problem (or None); for one-off rules."""

    problem: Callable[[Any], str | None]

    def check(self, value: Any, path: str, problems: Problems) -> None:
        msg = self.problem(value)
        if msg:
            problems.append((path, msg))


ANY = Shape()


def decode(value: Any, shape: Shape, path: str = "") -> Problems:
    """Bounds first, then the shape: the problems of `value`, empty when it may be used."""
    problems = check_bounds(value, path)
    if problems:
        return problems
    shape.check(value, path, problems)
    return problems
