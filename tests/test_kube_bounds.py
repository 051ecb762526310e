"""One tenant's object cannot stop a list or watch: dra_gpu.kube.bounds, the list decoder and
list_watch against the in-memory API with a claim nested 1,500 levels deep (the apiserver stores
it: its own decoder allows 10,000) and one larger than an object may be."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import pytest
from fake_kube import FakeApiServer, deep_objects, until
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from dra_gpu.kube.api import REJECTED, RESOURCE_V1, Backoff, list_watch
from dra_gpu.kube.bounds import (
    EVENTS_PER_MINUTE,
    MAX_OBJECT_BYTES,
    LineSplitter,
    LongLine,
    Rejected,
    Rejections,
    ValueSkipper,
    decode_event,
)
from dra_gpu.kube.list_decoder import ListDecoder

CLAIMS = f"{RESOURCE_V1}/resourceclaims"
FAST = Backoff(initial=0.01, maximum=0.04)


def nested(depth: int) -> Any:
    value: Any = "bottom"
    for i in range(depth):
        value = {"n": value} if i % 2 else [value]
    return value


def claim(name: str, parameters: Any = None, annotation: str = "", node: str = "here") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "tenant"}
    if annotation:
        meta["annotations"] = {"a": annotation}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": meta,
        "spec": {"devices": {"config": [{"opaque": {"driver": "gpu.dra-gpu.io", "parameters": parameters}}]}},
        "status": {"allocation": {"devices": {"results": [{"pool": node, "device": "gpu-0"}]}}},
    }


POISONED = claim("poisoned", nested(1500))  # 9 kB; RecursionError in json.loads
DEEP = claim("deep", nested(100))  # decodes, but deeper than any object the driver reads
# More than an object may be, in few bytes on the wire per byte held: escapes of control characters.
OVERSIZED = claim("oversized", annotation="\x01" * (MAX_OBJECT_BYTES // 6 + 1000))


def body_of(items: list[dict[str, Any]]) -> bytes:
    with deep_objects():
        return json.dumps({"kind": "List", "metadata": {"resourceVersion": "7"}, "items": items}).encode()


def decode(body: bytes, chunk: int = 997, keep: Any = None) -> tuple[ListDecoder, list[Rejected]]:
    rejected: list[Rejected] = []
    decoder = ListDecoder(keep, "resourceclaims", rejected.append)
    for start in range(0, len(body), chunk):
        decoder.feed(body[start : start + chunk])
    decoder.close()
    return decoder, rejected


# ---------------------------------------------------------------- the list decoder


@pytest.mark.parametrize("chunk", [997, 65536, 10**9])
def test_a_list_with_bad_items_yields_every_good_one_and_names_the_bad(chunk: int) -> None:
    items = [claim("a"), POISONED, claim("b"), OVERSIZED, DEEP, claim("c")]
    decoder, rejected = decode(body_of(items), chunk)
    assert [i["metadata"]["name"] for i in decoder.items] == ["a", "b", "c"]
    assert decoder.seen == 6 and decoder.rejected == 3
    assert decoder.metadata == {"resourceVersion": "7"}
    assert [(r.resource, r.namespace, r.name) for r in rejected] == [
        ("resourceclaims", "tenant", "poisoned"),
        ("resourceclaims", "tenant", "oversized"),
        ("resourceclaims", "tenant", "deep"),
    ]
    assert "nested more than 64 levels" in rejected[0].reason
    assert "more than the 4194304 accepted" in rejected[1].reason
    assert "nested more than 64 levels" in rejected[2].reason


def test_an_item_keep_drops_is_not_checked_and_an_oversized_one_is_never_held_whole() -> None:
    """A deep item of another node is dropped unseen; the oversized one is skipped as it arrives:
    the decoder holds little more than the bound, not the object."""
    huge = claim("oversized", annotation="\x01" * (MAX_OBJECT_BYTES // 3))  # 2x the bound as JSON
    items = [claim("deep-elsewhere", nested(100), node="there"), huge, claim("a")]
    body = body_of(items)
    rejected: list[Rejected] = []
    decoder = ListDecoder(
        lambda c: c["status"]["allocation"]["devices"]["results"][0]["pool"] == "here",
        "resourceclaims",
        rejected.append,
    )
    held = 0
    for start in range(0, len(body), 65536):
        decoder.feed(body[start : start + 65536])
        held = max(held, len(decoder._text) - decoder._pos)
    decoder.close()
    assert [i["metadata"]["name"] for i in decoder.items] == ["a"]
    assert [r.name for r in rejected] == ["oversized"]
    assert len(body) > 2 * MAX_OBJECT_BYTES and held < MAX_OBJECT_BYTES + 2 * 65536


def test_a_megabyte_of_brackets_is_skipped_in_bounded_time() -> None:
    bomb = '{"metadata":{"name":"bomb","namespace":"t"},"spec":' + "[" * 1_000_000 + "]" * 1_000_000 + "}"
    body = ('{"metadata":{},"items":[' + bomb + ',{"metadata":{"name":"a"}}]}').encode()
    started = time.perf_counter()
    decoder, rejected = decode(body, 65536)
    assert time.perf_counter() - started < 2.0
    assert [i["metadata"]["name"] for i in decoder.items] == ["a"]
    assert [r.name for r in rejected] == ["bomb"]


VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab"\\[]{}\n é', max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='k"\\[]{', max_size=3), inner)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    value=VALUES.filter(lambda v: isinstance(v, list | dict)), cuts=st.lists(st.integers(0, 400), max_size=8)
)
def test_the_skipper_finds_the_end_of_any_value_cut_anywhere(value: Any, cuts: list[int]) -> None:
    text = json.dumps(value, ensure_ascii=False) + ' , {"next": 1}'
    end = len(json.dumps(value, ensure_ascii=False))
    skipper, pos, buffer = ValueSkipper(), 0, ""
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {len(text)})
    start = 0
    for cut in bounds:
        buffer += text[start:cut]
        start = cut
        pos, ended = skipper.advance(buffer, pos)
        if ended:
            assert pos == end
            return
    raise AssertionError("the value's end was not found")


# ---------------------------------------------------------------- watch lines


def test_lines_are_split_across_pieces_and_a_long_line_is_dropped_as_it_arrives() -> None:
    splitter = LineSplitter(limit=100)
    long_line = (
        b'{"type":"ADDED","object":{"metadata":{"name":"big","namespace":"t"},"x":"' + b"y" * 500 + b'"}}'
    )
    stream = b'{"a":1}\n' + long_line + b'\n{"b":2}\n\n'
    got: list[bytes | LongLine] = []
    for start in range(0, len(stream), 7):
        got += splitter.feed(stream[start : start + 7])
    got += splitter.close()
    assert got[0] == b'{"a":1}' and got[2] == b'{"b":2}' and len(got) == 3
    assert isinstance(got[1], LongLine) and got[1].length == len(long_line)
    assert len(splitter._buffer) == 0
    event = decode_event(got[1], "resourceclaims")
    assert isinstance(event, Rejected) and (event.namespace, event.name) == ("t", "big")


def test_a_poisoned_watch_line_is_a_rejection_with_its_identity() -> None:
    with deep_objects():
        line = json.dumps(
            {
                "type": "MODIFIED",
                "object": {**POISONED, "metadata": {"name": "poisoned", "namespace": "tenant", "uid": "u-1"}},
            }
        ).encode()
    event = decode_event(line, "resourceclaims")
    assert isinstance(event, Rejected)
    assert (event.namespace, event.name, event.uid) == ("tenant", "poisoned", "u-1")
    assert decode_event(b'{"type":"ADDED","object":{"metadata":{"name":"ok"}}}', "r") == (
        "ADDED",
        {"metadata": {"name": "ok"}},
    )


# ---------------------------------------------------------------- list_watch


class View:
    """A cache as the driver's are: objects by name, dropped on DELETED and REJECTED."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.lists = 0

    async def on_list(self, items: list[dict[str, Any]], _version: str) -> None:
        self.objects = {i["metadata"]["name"]: i for i in items}
        self.lists += 1

    async def on_event(self, kind: str, obj: dict[str, Any]) -> bool:
        if kind in ("DELETED", REJECTED):
            self.objects.pop(obj["metadata"].get("name", ""), None)
        else:
            self.objects[obj["metadata"]["name"]] = obj
        return True


def test_list_watch_goes_on_past_bad_objects_and_reports_each_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)

    async def body() -> None:
        api = FakeApiServer()
        api.put("resourceclaims", claim("before"))
        api.put("resourceclaims", POISONED)
        kube = api.kube()
        registry = CollectorRegistry()
        kube.rejections.register(registry)
        view = View()
        task = asyncio.create_task(list_watch(kube, CLAIMS, view.on_list, view.on_event, backoff=FAST))
        try:
            await until(lambda: view.lists == 1)
            assert set(view.objects) == {"before"}
            # A claim that was fine and is now poisoned leaves the view; later claims flow.
            api.put("resourceclaims", claim("victim"))
            await until(lambda: "victim" in view.objects)
            api.put("resourceclaims", claim("victim", nested(1500)))
            api.put("resourceclaims", OVERSIZED)
            api.put("resourceclaims", claim("after"))
            await until(lambda: "after" in view.objects)
            assert set(view.objects) == {"before", "after"}
            assert view.lists == 1  # no list again: the watch went on
            count = registry.get_sample_value(
                "dra_gpu_apiserver_objects_rejected_total", {"resource": "resourceclaims"}
            )
            assert count == 3
            # An Event on each, named after the object (so every node posts the same one).
            await until(lambda: len(api.items("events")) == 3)
            events = {e["regarding"]["name"]: e for e in api.items("events")}
            assert set(events) == {"poisoned", "victim", "oversized"}
            assert events["poisoned"]["regarding"]["kind"] == "ResourceClaim"
            assert events["poisoned"]["metadata"]["namespace"] == "tenant"
            assert "nested more than 64 levels deep" in events["poisoned"]["note"]
            # A list again (a watch ended) rejects the same objects without logging them again.
            api.end_watches()
            await until(lambda: view.lists == 2)
            assert set(view.objects) == {"before", "after"}
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        logged = [r.getMessage() for r in caplog.records if "left out of the view" in r.getMessage()]
        assert len(logged) == 3 and any("name=poisoned" in m for m in logged)
        assert "list+watch failed" not in caplog.text

    asyncio.run(body())


def test_a_get_of_a_poisoned_claim_is_a_clear_error() -> None:
    async def body() -> None:
        api = FakeApiServer()
        api.put("resourceclaims", POISONED)
        kube = api.kube()
        with pytest.raises(ValueError, match="resourceclaims tenant/poisoned: nested more than 64"):
            await kube.get_claim("tenant", "poisoned")

    asyncio.run(body())


def test_events_are_rate_limited_and_stop_without_rbac() -> None:
    rejections = Rejections()

    def report(first: int) -> None:
        for i in range(first, first + EVENTS_PER_MINUTE):
            rejections.report(Rejected("resourceclaims", "t", f"c{i}", f"u{i}", "deep"))
            rejections.report(Rejected("resourceclaims", "t", f"c{i}", f"u{i}", "deep"))  # queued once

    report(0)
    assert [r.name for r in rejections.take_events(now=100.0)] == [f"c{i}" for i in range(EVENTS_PER_MINUTE)]
    report(EVENTS_PER_MINUTE)
    assert rejections.take_events(now=130.0) == []  # a minute's worth already posted
    assert len(rejections.take_events(now=161.0)) == EVENTS_PER_MINUTE

    async def body() -> None:
        api = FakeApiServer()
        api.fail(method="POST", status=403, count=1)
        kube = api.kube()
        kube.rejections.report(Rejected("resourceclaims", "t", "a", "u", "deep"))
        kube.rejections.report(Rejected("resourceclaims", "t", "b", "v", "deep"))
        await kube.post_rejection_events("node-1")
        assert not kube.rejections.events_allowed and api.items("events") == []
        assert api.count("POST", "events") == 1

    asyncio.run(body())
