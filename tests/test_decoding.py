"""The bounded decoder: files, YAML (both loaders), bounds and shapes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from dra_gpu.common import decoding
from dra_gpu.common.decoding import (
    MAX_DEPTH,
    DecodeError,
    Int,
    ListOf,
    NoAliasSafeLoader,
    Obj,
    Str,
    check_bounds,
    decode,
    load_yaml_all,
    read_bounded,
)
from dra_gpu.kube.values import Quantity


def test_read_bounded_refuses_special_and_large_files(tmp_path: Path) -> None:
    with pytest.raises(DecodeError, match="not a regular file"):
        read_bounded("/dev/zero")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(DecodeError, match="not a regular file"):
        read_bounded(str(tmp_path / "fifo"))
    (tmp_path / "big").write_bytes(b"x" * 101)
    with pytest.raises(DecodeError, match="larger than 100 bytes"):
        read_bounded(str(tmp_path / "big"), 100)
    (tmp_path / "bin").write_bytes(b"\xff\xfe")
    with pytest.raises(DecodeError, match="not UTF-8"):
        read_bounded(str(tmp_path / "bin"))
    assert read_bounded(str(tmp_path / "big")) == "x" * 101


@pytest.mark.parametrize("fast", [True, False])
def test_yaml_refuses_aliases_and_deep_nesting(monkeypatch: pytest.MonkeyPatch, fast: bool) -> None:
    monkeypatch.setattr(decoding, "_FAST", fast and decoding._FAST)
    assert list(load_yaml_all("a: 1\n---\nb: [1, 2]\n")) == [{"a": 1}, {"b": [1, 2]}]
    with pytest.raises(yaml.YAMLError, match="aliases"):
        list(load_yaml_all("a: &x [1]\nb: *x\n"))
    with pytest.raises((yaml.YAMLError, RecursionError)):
        list(load_yaml_all("a: " + "[" * 2000 + "]" * 2000))


@pytest.mark.parametrize("star", ["", "# a * in a comment: the event scan\n"])
def test_nesting_is_refused_at_the_collection_past_the_limit(star: str) -> None:
    """libyaml (both ways: bounded while composing, or the event scan when the text has a `*`)."""
    ok = "[" * MAX_DEPTH + "1" + "]" * MAX_DEPTH
    assert list(load_yaml_all(f"{star}a: 1\n---\n{ok}\n")) == [{"a": 1}, yaml.safe_load(ok)]
    # Block style, so that the line of the collection past the limit tells where it was found.
    deep = "".join(f"{'  ' * i}k{i}:\n" for i in range(MAX_DEPTH + 1)) + "  " * (MAX_DEPTH + 1) + "x: 1\n"
    with pytest.raises(yaml.YAMLError, match=f"nested more than {MAX_DEPTH} levels deep") as exc:
        list(load_yaml_all(f"{star}a: 1\n---\n" + deep))
    mark = getattr(exc.value, "problem_mark", None)
    assert mark is not None and mark.line == star.count("\n") + 2 + MAX_DEPTH  # the 65th mapping


def test_json_is_read_by_the_json_module_with_the_same_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A JSON document (kubectl -o json, dra-gpu top's explanations) is not given to libyaml; YAML
    in flow style that is not JSON still is; nesting is refused either way."""
    calls: list[str] = []
    monkeypatch.setattr(decoding, "_BoundedCLoader", lambda text: calls.append(text) or 1 / 0)
    doc = '{"kind": "List", "items": [{"a": 1.5, "b": null, "c": "x*y"}]}'
    assert list(load_yaml_all("  \n" + doc)) == [yaml.safe_load(doc)] and not calls
    monkeypatch.undo()
    assert list(load_yaml_all("[a, b]")) == [["a", "b"]]  # YAML, not JSON
    with pytest.raises(yaml.YAMLError, match="nested deeper"):
        list(load_yaml_all("[" * 100_000 + "]" * 100_000))
    (deep,) = load_yaml_all("[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5))
    assert any("nest" in message for _, message in check_bounds(deep))


def test_fast_loader_reads_what_libyaml_reads() -> None:
    """Without a `*` in the text the bounded libyaml loader is used: the same documents as
    libyaml's own loader, scalars typed by their text and style (a tag is cached per both)."""
    text = 'a: 1\nb: "1"\nc: 1\nd: \'1\'\ne: [true, "true", null, ~, 1.5, 0x10, 2026-01-01]\n---\n- {x: y}\n'
    assert "*" not in text
    assert list(load_yaml_all(text)) == list(yaml.load_all(text, Loader=yaml.SafeLoader))


@pytest.mark.parametrize(
    "text",
    [
        "d: {<<: {x: 1, y: 1}, y: 2}\n",  # a merge key
        "v: {=: 1}\n",  # a value key
        "s: !!set {a, b}\n",
        "t: 2026-01-01\n",
        "b: !!binary aGVsbG8=\n",
        "k: {1: a, true: b, null: c, 1.5: d, !!str 2: e}\n",
        "o: !!omap [a: 1]\n",
        "!!str [1]\n",  # errors from here on: the same error
        "!!map x\n",
        "!foo x\n",
        "[1, 2]: x\n",
        "{a: 1}: x\n",
    ],
)
def test_fast_loader_leaves_the_unusual_to_safe_constructor(text: str) -> None:
    try:
        expected: object = list(yaml.load_all(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError as exc:
        expected = type(exc)
    try:
        got: object = list(load_yaml_all(text))
    except yaml.YAMLError as exc:
        got = type(exc)
    assert got == expected
    if not isinstance(expected, type):
        assert decoding.load_yaml(text) == expected[0]  # type: ignore[index]


def test_a_stream_that_is_not_yaml_further_on_gives_no_documents() -> None:
    got: list[object] = []
    with pytest.raises(yaml.YAMLError):
        for doc in load_yaml_all("a: 1\n---\nb: [1\n"):
            got.append(doc)
    assert got == []


def test_no_alias_loader_directly() -> None:
    with pytest.raises(yaml.YAMLError, match="aliases"):
        yaml.load("a: &x 1\nb: *x\n", Loader=NoAliasSafeLoader)


def test_bounds() -> None:
    assert check_bounds({"a": [1, "x", 1.5, None, True]}) == []
    assert check_bounds({"a": float("nan")})[0][0] == "a"
    assert "integer out of range" in check_bounds([2**64])[0][1]
    deep: list[object] = []
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    assert "nested more than" in check_bounds(deep)[0][1]
    assert "must be a string" in check_bounds({1: "x"})[0][1]
    where = check_bounds({"spec": {"devices": [{}, {"capacity": {"gpu.dra-gpu.io/memory": float("inf")}}]}})
    assert where[0][0] == 'spec.devices[1].capacity["gpu.dra-gpu.io/memory"]'
    assert check_bounds({"a": {"b": [1, {"c": 2**64}]}}, "obj")[0][0] == "obj.a.b[1].c"


def test_shapes_name_the_field() -> None:
    shape = Obj({"spec": Obj({"items": ListOf(Obj({"n": Int(), "s": Str(), "q": Quantity()}))})})
    doc = {"spec": {"items": [{"n": "1", "s": 2, "q": "1e999"}, None]}}
    assert decode(doc, shape) == [
        ("spec.items[0].n", "must be an integer, got a string"),
        ("spec.items[0].s", "must be a string, got an integer"),
        ("spec.items[0].q", "'1e999': exponent out of range (at most +-64)"),
        ("spec.items[1]", "must not be null"),
    ]
    assert decode({"spec": None}, shape) == []
