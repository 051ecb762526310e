"""dra_gpu.kube.api against the in-memory API (tests/fake_kube.py): requests, errors, list_watch."""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import logging
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from controller.test_webhook import make_cert, serve_tls
from fake_kube import FakeApiServer, until

from dra_gpu.kube import api as kube_module
from dra_gpu.kube.api import (
    RESOURCE_V1,
    TLS_READ_BUFFER,
    Backoff,
    Kube,
    KubeError,
    list_watch,
    small_tls_read_buffers,
)

CLASSES = f"{RESOURCE_V1}/deviceclasses"
FAST = Backoff(initial=0.01, maximum=0.04)


def device_class(name: str, selector: str = "true") -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": selector}}]},
    }


def test_requests_and_their_errors() -> None:
    async def body() -> None:
        api = FakeApiServer()
        kube = api.kube()
        claim = {"metadata": {"name": "c", "namespace": "ns"}, "spec": {}}
        api.put("resourceclaims", claim)
        assert (await kube.get_claim("ns", "c") or {})["metadata"]["name"] == "c"
        assert await kube.get_claim("ns", "missing") is None
        stored = await kube.apply_slice({"metadata": {"name": "s"}, "spec": {"x": 1}}, field_manager="me")
        assert stored["metadata"]["resourceVersion"] == "2"
        assert api.requests[-1].query == {"fieldManager": "me", "force": "true"}
        items, version = await kube.list_objects(f"{RESOURCE_V1}/resourceslices")
        assert [i["metadata"]["name"] for i in items] == ["s"] and version == "2"
        await kube.delete_slice("s")
        await kube.delete_slice("s")  # already gone: fine
        assert api.items("resourceslices") == []
        api.fail(method="GET", status=403)
        with pytest.raises(KubeError) as exc:
            await kube.get_claim("ns", "c")
        assert exc.value.status == 403
        assert str(exc.value) == "HTTP 403: get resourceclaim ns/c: injected failure of GET " + (
            f"{RESOURCE_V1}/namespaces/ns/resourceclaims/c"
        )
        api.fail(method="GET", watch=True, status=500)
        with pytest.raises(KubeError, match="HTTP 500: watch"):
            async for _ in kube.watch_objects(CLASSES, "0", 1):
                pass
        await kube.close()
        assert kube.api_client.closed

    asyncio.run(body())


def test_error_body_that_is_not_json() -> None:
    from fake_kube import FakeResponse

    async def body() -> None:
        with pytest.raises(KubeError, match="HTTP 502: list x: <html>bad gateway"):
            await kube_module._json(FakeResponse(502, b"<html>bad gateway"), "list x")

    asyncio.run(body())


class Recorder:
    """list_watch's handlers, recording what they got; `keep_watching` decides what on_event returns."""

    def __init__(self, keep_watching: Callable[[str, dict[str, Any]], bool] = lambda k, o: True) -> None:
        self.lists: list[list[str]] = []
        self.events: list[tuple[str, str]] = []
        self.keep_watching = keep_watching
        self.changed = asyncio.Event()

    async def on_list(self, items: list[dict[str, Any]], version: str) -> None:
        self.lists.append(sorted(i["metadata"]["name"] for i in items))
        self.changed.set()

    async def on_event(self, kind: str, obj: dict[str, Any]) -> bool:
        self.events.append((kind, obj["metadata"]["name"]))
        self.changed.set()
        return self.keep_watching(kind, obj)


async def running(
    api: FakeApiServer, rec: Recorder, test: Callable[[], Awaitable[None]], **kwargs: Any
) -> None:
    kwargs.setdefault("backoff", FAST)
    task = asyncio.create_task(list_watch(api.kube(), CLASSES, rec.on_list, rec.on_event, **kwargs))
    try:
        await test()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_lists_then_delivers_events_in_order() -> None:
    async def body() -> None:
        api = FakeApiServer()
        api.put("deviceclasses", device_class("a"))
        rec = Recorder()

        async def test() -> None:
            await until(lambda: rec.lists == [["a"]])
            api.put("deviceclasses", device_class("b"))
            api.put("deviceclasses", device_class("a", "false"))
            api.put("deviceclasses", device_class("a", "false"))  # no-op: no event
            api.remove("deviceclasses", "b")
            await until(lambda: len(rec.events) == 3)
            assert rec.events == [("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b")]
            assert rec.lists == [["a"]]

        await running(api, rec, test)

    asyncio.run(body())


def test_relists_when_the_handler_asks_and_after_each_watch() -> None:
    async def body() -> None:
        api = FakeApiServer()
        rec = Recorder(keep_watching=lambda kind, obj: obj["metadata"]["name"] != "stop")

        async def test() -> None:
            await until(lambda: len(rec.lists) == 1)
            api.put("deviceclasses", device_class("go"))
            api.put("deviceclasses", device_class("stop"))
            await until(lambda: len(rec.lists) == 2)
            assert rec.lists[1] == ["go", "stop"]
            await until(lambda: len(rec.lists) >= 3)  # the 1 s watch ended: listed again

        await running(api, rec, test, watch_seconds=1)

    asyncio.run(body())


def test_watch_lengths_are_spread_between_one_and_two_watch_seconds() -> None:
    # A fleet of plugins started together must not list again in step.
    async def body() -> None:
        api = FakeApiServer()
        rec = Recorder()

        for n in range(1, 41):

            async def test(n: int = n) -> None:
                await until(lambda: api.count("GET", "deviceclasses", watch=True) >= n)

            await running(api, rec, test, watch_seconds=100)
        asked = {int(r.query["timeoutSeconds"]) for r in api.requests if r.watch}
        assert min(asked) >= 100 and max(asked) <= 200 and len(asked) > 10, sorted(asked)

    asyncio.run(body())


@pytest.mark.parametrize("how", ["error-event", "http-status"])
def test_relists_at_once_on_410_gone(how: str) -> None:
    async def body() -> None:
        api = FakeApiServer()
        if how == "error-event":
            api.expire_watches = 2
        else:
            api.fail(method="GET", watch=True, status=410, count=2)
        rec = Recorder()

        async def test() -> None:
            start = time.monotonic()
            await until(lambda: len(rec.lists) == 3)
            assert time.monotonic() - start < 2  # no backoff: a 410 is not a failure
            api.put("deviceclasses", device_class("after"))
            await until(lambda: rec.events == [("ADDED", "after")])

        await running(api, rec, test, backoff=Backoff(initial=5, maximum=5))

    asyncio.run(body())


def test_backs_off_on_failures_and_resets_after_a_good_round(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="dra_gpu.kube.api")

    async def body() -> None:
        api = FakeApiServer()
        api.fail(method="GET", watch=False, status=500, count=4)
        rec = Recorder()

        async def test() -> None:
            await until(lambda: len(rec.lists) == 1)
            delays = [float(d) for d in re.findall(r"retrying in ([\d.]+)s", caplog.text)]
            assert len(delays) == 4
            # 0.01, 0.02, 0.04, 0.04 (the cap), each plus up to 0.01 of jitter
            for delay, base in zip(delays, (0.01, 0.02, 0.04, 0.04), strict=True):
                assert base <= delay <= base + 0.01
            assert "injected failure of GET" in caplog.text
            caplog.clear()
            # The 1 s watch ends well, then the next list fails: the backoff starts from the bottom.
            api.fail(method="GET", watch=False, error=ConnectionResetError("reset by peer"))
            await until(lambda: len(rec.lists) >= 2)
            delays = [float(d) for d in re.findall(r"retrying in ([\d.]+)s", caplog.text)]
            assert len(delays) == 1 and 0.01 <= delays[0] <= 0.02
            assert "reset by peer" in caplog.text

        await running(api, rec, test, watch_seconds=1)

    asyncio.run(body())


def test_watch_error_event_other_than_410_is_retried_with_backoff(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="dra_gpu.kube.api")

    async def body() -> None:
        api = FakeApiServer()
        rec = Recorder()
        real_watch = api._watch

        def failing_watch(plural: str, ns: str, query: dict[str, str]) -> Any:
            stream = real_watch(plural, ns, query)
            if len(rec.lists) == 1:
                stream.preset = [{"type": "ERROR", "object": {"code": 500, "message": "etcd hiccup"}}]
            return stream

        api._watch = failing_watch  # type: ignore[method-assign]

        async def test() -> None:
            await until(lambda: len(rec.lists) == 2)
            assert "HTTP 500: watch" in caplog.text and "etcd hiccup" in caplog.text

        await running(api, rec, test)

    asyncio.run(body())


def test_a_stalled_watch_is_cut_by_its_deadline(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kube_module, "REQUEST_TIMEOUT", 0.2)  # the deadline: watch_seconds + this
    caplog.set_level(logging.WARNING, logger="dra_gpu.kube.api")

    async def body() -> None:
        api = FakeApiServer(stall_watches=True)
        rec = Recorder()

        async def test() -> None:
            start = time.monotonic()
            await until(lambda: len(rec.lists) == 2)
            assert 1.2 <= time.monotonic() - start < 4
            assert "list+watch failed, retrying" in caplog.text

        await running(api, rec, test, watch_seconds=1)

    asyncio.run(body())


def test_kube_connect_reads_a_kubeconfig(tmp_path: Any) -> None:
    config = tmp_path / "kubeconfig"
    config.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:6443'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )

    async def body() -> None:
        kube = await Kube.connect(str(config))
        assert kube.api_client.configuration.host == "https://127.0.0.1:6443"
        await kube.close()

    asyncio.run(body())


def test_small_tls_read_buffers_still_read_a_large_list_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plugin reads its TLS connections in 64 KiB pieces instead of asyncio's 256 KiB: a list
    of a few MB (claims with their managedFields) arrives whole, over a real TLS connection."""
    monkeypatch.setattr(asyncio.sslproto.SSLProtocol, "max_size", asyncio.sslproto.SSLProtocol.max_size)
    small_tls_read_buffers()
    assert asyncio.sslproto.SSLProtocol.max_size == TLS_READ_BUFFER
    cert, key = make_cert(tmp_path, "apiserver")
    items = [{"metadata": {"name": f"claim-{i}"}, "data": "x" * 3000} for i in range(1000)]

    async def body() -> None:
        async def claims(_request: web.Request) -> web.Response:
            return web.json_response({"items": items, "metadata": {"resourceVersion": "7"}})

        app = web.Application()
        app.router.add_get(f"{RESOURCE_V1}/resourceclaims", claims)
        runner = web.AppRunner(app)
        port = await serve_tls(runner, cert, key)
        config = tmp_path / "kubeconfig"
        config.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
            f"clusters: [{{name: k, cluster: {{server: 'https://127.0.0.1:{port}',\n"
            f"  certificate-authority: '{cert}'}}}}]\n"
            "users: [{name: u, user: {token: t}}]\n"
            "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
        )
        kube = await Kube.connect(str(config))
        try:
            got, version = await kube.list_objects(f"{RESOURCE_V1}/resourceclaims")
            assert (got, version) == (items, "7")
        finally:
            await kube.close()
            await runner.cleanup()

    asyncio.run(body())


def claims_in(api: FakeApiServer, count: int, here_every: int = 10, size: int = 0) -> None:
    """`count` claims, every `here_every`th allocated in pool "here", the others in "there"."""
    for i in range(count):
        pool = "here" if i % here_every == 0 else "there"
        api.put(
            "resourceclaims",
            {
                "metadata": {"name": f"claim-{i:05d}", "namespace": "ns"},
                "spec": {"devices": {"requests": [{"name": "r", "selector": "x" * size}]}},
                "status": {"allocation": {"devices": {"results": [{"pool": pool, "device": "gpu-0"}]}}},
            },
        )


def here(claim: dict[str, Any]) -> bool:
    return bool(claim["status"]["allocation"]["devices"]["results"][0]["pool"] == "here")


def test_lists_in_pages_and_keeps_only_what_keep_accepts() -> None:
    async def body() -> None:
        api = FakeApiServer()
        claims_in(api, 250)
        version = api.version
        items, got_version = await api.kube().list_objects(
            f"{RESOURCE_V1}/resourceclaims", keep=here, limit=100
        )
        assert [i["metadata"]["name"] for i in items] == [f"claim-{i:05d}" for i in range(0, 250, 10)]
        pages = [r.query for r in api.requests]
        assert [q["limit"] for q in pages] == ["100", "100", "100"]
        assert "continue" not in pages[0] and all(q.get("continue") for q in pages[1:])
        assert got_version == str(version)  # the last page's: where the watch begins

    asyncio.run(body())


def test_an_expired_continue_token_begins_the_list_again_after_a_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="dra_gpu.kube.api")

    async def body() -> None:
        api = FakeApiServer()
        claims_in(api, 250)
        api.expire_continues = 2
        kube = api.kube()
        path = f"{RESOURCE_V1}/resourceclaims"
        items, _ = await kube.list_objects(path, keep=here, limit=100, backoff=FAST)
        # Whole and once each: what the expired attempts kept was dropped with them.
        assert [i["metadata"]["name"] for i in items] == [f"claim-{i:05d}" for i in range(0, 250, 10)]
        firsts = [r for r in api.requests if "continue" not in r.query]
        assert len(firsts) == 3 and len(api.requests) == 3 + 2 + 2  # 2 expired pages, then 2 good ones
        assert caplog.text.count("continue token expired, listing again") == 2
        # Expired every time: given up after LIST_RESTARTS more lists, as a 410 of the last page.
        api.expire_continues = 1000
        with pytest.raises(kube_module.ContinueExpired, match="HTTP 410"):
            await kube.list_objects(path, limit=100, backoff=FAST)
        assert 1000 - api.expire_continues == 1 + kube_module.LIST_RESTARTS

    asyncio.run(body())


def test_a_list_of_large_foreign_objects_is_never_held_whole() -> None:
    """200 claims of 100 kB (20 MB), one in ten kept: the peak of what is allocated while listing
    stays near one page's body (which the in-memory API makes) and the kept tenth."""
    import tracemalloc

    async def body() -> int:
        api = FakeApiServer()
        claims_in(api, 200, size=100_000)
        tracemalloc.start()
        try:
            items, _ = await api.kube().list_objects(f"{RESOURCE_V1}/resourceclaims", keep=here, limit=10)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            assert len(items) == 20

    peak = asyncio.run(body())
    assert peak < 6_000_000, f"peak {peak / 1e6:.1f} MB while listing 20 MB"


def test_a_transformed_list_holds_what_the_view_keeps_of_every_object() -> None:
    """Every one of 200 claims of 100 kB is kept (a webhook's view) as a few fields: the peak
    while listing stays near one page, not the 20 MB of claims; None drops an object."""
    import tracemalloc

    def slim(claim: dict[str, Any]) -> tuple[str, str] | None:
        pool = claim["status"]["allocation"]["devices"]["results"][0]["pool"]
        return None if claim["metadata"]["name"].endswith("7") else (claim["metadata"]["name"], pool)

    async def body() -> tuple[list[Any], int]:
        api = FakeApiServer()
        claims_in(api, 200, size=100_000)
        tracemalloc.start()
        try:
            items, _ = await api.kube().list_objects(
                f"{RESOURCE_V1}/resourceclaims", limit=10, transform=slim
            )
            return items, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    items, peak = asyncio.run(body())
    assert items[:2] == [("claim-00000", "here"), ("claim-00001", "there")] and len(items) == 180
    assert peak < 6_000_000, f"peak {peak / 1e6:.1f} MB while listing 20 MB"
