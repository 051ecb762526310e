"""The slice publisher: what it compares, and how it keeps a node's slices true (in-memory API)."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from fake_kube import FakeApiServer, until
from simnode.fake import discover_node

from dra_gpu.kube.api import Backoff, KubeError
from dra_gpu.kubeletplugin.metrics import PluginMetrics
from dra_gpu.kubeletplugin.publisher import SlicePublisher, missing_fields
from dra_gpu.node.slices import build_slices

from .conftest import DRIVER, NODE, FakeDriver, slice_of


def test_stored_defaults_are_fine_but_dropped_or_changed_fields_are_found() -> None:
    (want,) = build_slices(discover_node("node-a", "hgx-2x4"))
    stored = {**want["spec"], "extra": "defaulted by the apiserver"}
    assert missing_fields(want["spec"], stored) == []
    dropped = {**want["spec"], "devices": [dict(d) for d in want["spec"]["devices"]]}
    dropped["devices"][3] = {k: v for k, v in dropped["devices"][3].items() if k != "capacity"}
    assert missing_fields(want["spec"], dropped) == ["devices[3].capacity"]
    edited = {**want["spec"], "devices": want["spec"]["devices"][1:]}
    assert missing_fields(want["spec"], edited) == ["devices"]
    changed = {**want["spec"], "pool": {**want["spec"]["pool"], "generation": 9}}
    assert missing_fields(want["spec"], changed) == ["pool.generation"]


# ---------------------------------------------------------------- against the in-memory API


def publisher(api: FakeApiServer, driver: FakeDriver) -> SlicePublisher:
    return SlicePublisher(api.kube(), DRIVER, NODE, driver.resource_slices, PluginMetrics())


def generations(api: FakeApiServer) -> list[int]:
    return [s["spec"]["pool"]["generation"] for s in api.items("resourceslices")]


def test_first_publication_creates_the_slices() -> None:
    async def body() -> None:
        api = FakeApiServer()
        api.put("resourceslices", {**slice_of("other-node-slice", ["x"], 7), "spec": {"nodeName": "node-b"}})
        pub = publisher(api, FakeDriver(slices_per_node=2))
        await pub.start()
        mine = [s for s in api.items("resourceslices") if s["spec"].get("nodeName") == NODE]
        assert sorted(s["metadata"]["name"] for s in mine) == [f"{NODE}-{DRIVER}-0", f"{NODE}-{DRIVER}-1"]
        assert {s["spec"]["pool"]["generation"] for s in mine} == {1}
        assert sorted(pub.device_names()) == ["dev-0", "dev-1", "dev-2"]
        assert pub.metrics.published_devices._value.get() == 3
        assert pub.synced.is_set()
        assert api.requests[-1].method == "PATCH" and api.requests[-1].query["fieldManager"] == DRIVER

    asyncio.run(body())


def test_generation_is_kept_while_unchanged_and_bumped_on_change() -> None:
    async def body() -> None:
        api = FakeApiServer()
        await publisher(api, FakeDriver(slices_per_node=2)).start()
        writes = api.count("PATCH", "resourceslices")
        await publisher(api, FakeDriver(slices_per_node=2)).start()  # a restart, same devices
        assert api.count("PATCH", "resourceslices") == writes and generations(api) == [1, 1]
        await publisher(api, FakeDriver(["dev-0", "dev-1"], slices_per_node=2)).start()  # one device gone
        assert generations(api) == [2, 2]
        await publisher(api, FakeDriver(["dev-0", "dev-1"])).start()  # now in one slice: the other goes
        assert generations(api) == [3] and api.count("DELETE", "resourceslices") == 1

    asyncio.run(body())


def test_start_retries_until_the_apiserver_answers() -> None:
    async def body() -> None:
        api = FakeApiServer()
        api.fail(method="GET", status=503, count=2)
        api.fail(method="PATCH", error=ConnectionRefusedError("connection refused"))
        await publisher(api, FakeDriver()).start()
        assert generations(api) == [1]
        api.fail(method="GET", status=403, count=1000)
        with pytest.raises(KubeError, match="HTTP 403"):
            await publisher(api, FakeDriver()).start(timeout=0.5)

    asyncio.run(body())


def test_a_slice_the_apiserver_refuses_as_invalid_is_said_at_once_not_retried() -> None:
    """A 1.34 apiserver refuses a slice laid out for 1.35+ (422): no point in two minutes of tries."""

    async def body() -> None:
        api = FakeApiServer()
        api.fail(method="PATCH", status=422, count=1000)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(KubeError, match="HTTP 422"):
            await publisher(api, FakeDriver()).start(timeout=30)
        assert loop.time() - t0 < 5 and api.count("PATCH", "resourceslices") == 1

    asyncio.run(body())


async def running(pub: SlicePublisher, test: Callable[[], Awaitable[None]]) -> None:
    await pub.start()
    task = asyncio.create_task(pub.run(Backoff(initial=0.01, maximum=0.05)))
    try:
        await test()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_deleted_or_edited_slices_are_restored() -> None:
    async def body() -> None:
        api = FakeApiServer()
        pub = publisher(api, FakeDriver())
        (name,) = (s["metadata"]["name"] for s in pub.build(1))

        def stored() -> dict[str, Any] | None:
            return api.objects["resourceslices"].get(f"/{name}")

        async def test() -> None:
            await until(lambda: api.count("GET", "resourceslices", watch=True) == 1)
            api.remove("resourceslices", name)  # as the kubelet does when it starts
            await until(lambda: stored() is not None)
            assert pub.metrics.slice_restores._value.get() == 1
            edited = copy.deepcopy(stored())
            assert edited is not None
            edited["spec"]["devices"] = edited["spec"]["devices"][:1]
            api.put("resourceslices", edited)
            await until(lambda: len((stored() or {})["spec"]["devices"]) == 3)
            assert pub.metrics.slice_restores._value.get() == 2
            defaulted = copy.deepcopy(stored())
            assert defaulted is not None
            defaulted["spec"]["perDeviceNodeSelection"] = None  # a field we never set: left alone
            writes = api.count("PATCH", "resourceslices")
            api.put("resourceslices", defaulted)
            lists = api.count("GET", "resourceslices")
            await asyncio.sleep(0.1)
            assert api.count("GET", "resourceslices") == lists
            assert api.count("PATCH", "resourceslices") == writes
            assert generations(api) == [1]

        await running(pub, test)

    asyncio.run(body())


def test_an_expired_watch_lists_again() -> None:
    async def body() -> None:
        api = FakeApiServer()
        pub = publisher(api, FakeDriver())

        async def test() -> None:
            await until(lambda: api.count("GET", "resourceslices", watch=True) == 1)
            lists = api.count("GET", "resourceslices")
            api.expire_watches = 1
            api.remove("resourceslices", f"{NODE}-{DRIVER}-0")  # ends the first watch: relist, restore
            await until(lambda: api.count("GET", "resourceslices", watch=True) == 3)
            assert api.count("GET", "resourceslices") == lists + 2  # after the deletion, after the 410
            assert generations(api) == [1]

        await running(pub, test)

    asyncio.run(body())


def test_failures_are_retried_with_backoff(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)

    async def body() -> None:
        api = FakeApiServer()
        pub = publisher(api, FakeDriver())

        async def test() -> None:
            await until(lambda: api.count("GET", "resourceslices", watch=True) == 1)
            api.fail(method="PATCH", status=500, count=3)
            api.remove("resourceslices", f"{NODE}-{DRIVER}-0")
            await until(lambda: generations(api) == [1])
            assert caplog.text.count("list+watch failed, retrying") == 3
            assert pub.metrics.slice_restores._value.get() == 1

        await running(pub, test)

    asyncio.run(body())


def test_a_field_the_apiserver_drops_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    def drop_capacity(obj: dict[str, Any]) -> None:
        for device in obj.get("spec", {}).get("devices", []):
            device.pop("capacity", None)

    async def body() -> SlicePublisher:
        api = FakeApiServer(on_write=drop_capacity)
        pub = publisher(api, FakeDriver())
        await pub.start()
        return pub

    pub = asyncio.run(body())
    dropped = [r.getMessage() for r in caplog.records if "dropped a field" in r.getMessage()]
    assert dropped == [
        f"apiserver dropped a field of ResourceSlice {NODE}-{DRIVER}-0: spec.devices[0].capacity; "
        "is the feature gate for it off?"
    ]
    assert pub.metrics.dropped_slice_fields.labels("other")._value.get() == 1


def test_a_gated_field_dropped_names_its_gate_and_what_is_lost(caplog: pytest.LogCaptureFixture) -> None:
    """A 1.34 or 1.35 apiserver, DRADeviceTaints off: the taints go, silently; the plugin says so."""

    def taint_first(obj: dict[str, Any]) -> None:  # what the plugin sends: a tainted device
        obj["spec"]["devices"][0]["taints"] = [{"key": f"{DRIVER}/unhealthy", "effect": "NoExecute"}]

    def drop_taints(obj: dict[str, Any]) -> None:
        for device in obj.get("spec", {}).get("devices", []):
            device.pop("taints", None)

    told: list[frozenset[str]] = []

    def tainted_slices(generation: int) -> list[dict[str, Any]]:
        """The tainted device, or, once told the taints are dropped, the slices without it."""
        slices = FakeDriver().resource_slices(generation)
        if told:
            slices[0]["spec"]["devices"] = slices[0]["spec"]["devices"][1:]
        else:
            taint_first(slices[0])
        return slices

    async def body() -> tuple[SlicePublisher, FakeApiServer]:
        api = FakeApiServer(on_write=drop_taints)
        pub = SlicePublisher(
            api.kube(), DRIVER, NODE, tainted_slices, PluginMetrics(), on_dropped=told.append
        )
        await pub.start()
        return pub, api

    pub, api = asyncio.run(body())
    (line,) = [r.getMessage() for r in caplog.records if "dropped a field" in r.getMessage()]
    assert "spec.devices[0].taints" in line and "taints are lost: a failed device is not isolated" in line
    assert "turn on the DRADeviceTaints feature gate" in line
    assert pub.metrics.dropped_slice_fields.labels("taints")._value.get() == 1
    # The driver was told once, and what it built then is what the apiserver holds: no failed device.
    assert told == [frozenset({"taints"})]
    (stored,) = api.items("resourceslices")
    assert [d["name"] for d in stored["spec"]["devices"]] == ["dev-1", "dev-2"]
    assert stored["spec"]["pool"]["generation"] == 1 and pub.device_names() == ["dev-1", "dev-2"]


def test_refresh_applies_only_the_changed_slice_and_bumps_when_several_change() -> None:
    async def body() -> None:
        api = FakeApiServer()
        driver = FakeDriver(slices_per_node=2)
        pub = publisher(api, driver)
        await pub.start()
        writes = api.count("PATCH", "resourceslices")
        assert await pub.refresh() == 0  # nothing changed: nothing written
        inner = driver.resource_slices

        def tainted(generation: int) -> list[dict[str, Any]]:
            out = inner(generation)
            out[0]["spec"]["devices"][0]["taints"] = [{"key": "d.io/x", "value": "y", "effect": "NoSchedule"}]
            return out

        pub.build = tainted
        assert await pub.refresh() == 1
        assert api.count("PATCH", "resourceslices") == writes + 1 and generations(api) == [1, 1]
        stored = api.objects["resourceslices"][f"/{NODE}-{DRIVER}-0"]
        assert stored["spec"]["devices"][0]["taints"][0]["effect"] == "NoSchedule"

        def both(generation: int) -> list[dict[str, Any]]:
            out = tainted(generation)
            out[0]["spec"]["devices"][0]["taints"][0]["value"] = "w"
            out[1]["spec"]["devices"][0]["taints"] = [{"key": "d.io/x", "value": "z", "effect": "NoExecute"}]
            return out

        pub.build = both
        assert await pub.refresh() == 2
        assert generations(api) == [2, 2]

    asyncio.run(body())
