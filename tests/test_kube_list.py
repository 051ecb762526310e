"""dra_gpu.kube.list_decoder: a list response decoded one item at a time, as its bytes arrive."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dra_gpu.kube.list_decoder import ListDecodeError, ListDecoder

SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
ITEMS = st.lists(st.dictionaries(st.text(max_size=5), VALUES, max_size=4), max_size=6)


def decode(body: bytes, cuts: list[int], keep: Any = None) -> ListDecoder:
    decoder = ListDecoder(keep)
    start = 0
    for cut in sorted(c % (len(body) + 1) for c in cuts):
        decoder.feed(body[start:cut])
        start = max(start, cut)
    decoder.feed(body[start:])
    decoder.close()
    return decoder


@settings(max_examples=200, deadline=None)
@given(
    items=ITEMS,
    metadata=st.dictionaries(st.text(max_size=6), VALUES, max_size=3),
    items_first=st.booleans(),
    indent=st.sampled_from([None, 1]),
    cuts=st.lists(st.integers(min_value=0), max_size=12),
)
def test_any_split_of_the_body_decodes_as_json_loads_does(
    items: list[dict[str, Any]],
    metadata: dict[str, Any],
    items_first: bool,
    indent: int | None,
    cuts: list[int],
) -> None:
    members: dict[str, Any] = {"kind": "List", "metadata": metadata, "items": items}
    if items_first:
        members = {"items": items, "kind": "List", "metadata": metadata}
    body = json.dumps(members, indent=indent, ensure_ascii=False).encode()
    decoder = decode(body, cuts)
    assert decoder.items == items
    assert decoder.metadata == metadata
    assert decoder.seen == len(items)


def test_only_the_kept_items_are_held_and_keep_sees_each_item_once() -> None:
    items = [{"metadata": {"name": f"c{i}"}, "node": "here" if i % 3 == 0 else "there"} for i in range(30)]
    body = json.dumps({"metadata": {"resourceVersion": "9", "continue": "t"}, "items": items}).encode()
    asked: list[str] = []

    def here(item: dict[str, Any]) -> bool:
        asked.append(item["metadata"]["name"])
        return bool(item["node"] == "here")

    decoder = decode(body, list(range(0, len(body), 7)), keep=here)
    assert [i["metadata"]["name"] for i in decoder.items] == [f"c{i}" for i in range(0, 30, 3)]
    assert asked == [f"c{i}" for i in range(30)]
    assert decoder.metadata == {"resourceVersion": "9", "continue": "t"}


def test_a_large_item_arriving_in_small_chunks_is_decoded_a_few_times_not_once_a_chunk() -> None:
    class Counting(json.JSONDecoder):
        calls = 0

        def raw_decode(self, s: str, idx: int = 0) -> tuple[Any, int]:
            Counting.calls += 1
            return super().raw_decode(s, idx)

    big = {"spec": {"selectors": ["x" * 1000] * 1000}}  # ~1 MB, in 1,000-byte chunks
    body = json.dumps({"metadata": {}, "items": [big, {"small": 1}]}).encode()
    decoder = ListDecoder()
    decoder._decoder = Counting()
    for start in range(0, len(body), 1000):
        decoder.feed(body[start : start + 1000])
    decoder.close()
    assert decoder.items == [big, {"small": 1}]
    assert Counting.calls < 30, Counting.calls  # the pending text doubles between tries: ~log2(1000)


def test_a_number_at_the_end_of_a_chunk_waits_for_the_next() -> None:
    decoder = ListDecoder()
    decoder.feed(b'{"items": [], "count": 12')
    decoder.feed(b'34, "metadata": {"remainingItemCount": 5')
    decoder.feed(b"6}}")
    decoder.close()
    assert decoder.metadata == {"remainingItemCount": 56}


def test_a_multibyte_character_split_between_chunks() -> None:
    body = json.dumps({"items": [{"name": "gpu-\u00e9\u4e2d\U0001f600"}]}, ensure_ascii=False).encode()
    for cut in range(len(body)):
        assert decode(body, [cut]).items == [{"name": "gpu-\u00e9\u4e2d\U0001f600"}]


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"", "ended early"),
        (b'{"items": [{"a": 1}', "ended early"),
        (b'{"items": [{"a": 1]}', "Expecting"),
        (b'{"items": [1]}', "an item is not an object"),
        (b'{"items": {"a": 1}}', "expected '\\['"),
        (b'{"metadata": [], "items": []}', "metadata is not an object"),
        (b'{"items": []} {}', "text after the list"),
        (b'[{"items": []}]', "expected '{'"),
        (b'{"items" [] }', "expected ':'"),
        (b'{"items": [] "kind": "x"}', "expected ','"),
    ],
)
def test_a_body_that_is_not_a_list_is_an_error(body: bytes, error: str) -> None:
    with pytest.raises(ListDecodeError, match=error):
        decode(body, [3, 9])
