"""The claim watch on the prepare path (the kubelet-plugin layer's ClaimFetcher reads it): a prepare
of a claim the watch delivered makes no GET, and every case the cache cannot vouch for (another
node, another UID, not reserved, deleted, not listed yet) is read from the apiserver."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fake_kube import FakeApiServer, until

from dra_gpu.kube.api import Backoff
from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.plugin.claim_cache import ClaimCache

from .conftest import DRIVER, NODE, PluginCore, claim, gpu_names, prepare_claim

CLAIMS = "resourceclaims"


def reserved(c: dict[str, Any]) -> dict[str, Any]:
    c = copy.deepcopy(c)
    c["status"]["reservedFor"] = [{"resource": "pods", "name": "pod-1", "uid": "pod-uid-1"}]
    return c


def ref_of(stored: dict[str, Any]) -> ClaimRef:
    meta = stored["metadata"]
    return ClaimRef(meta["namespace"], meta["uid"], meta["name"])


async def watching(api: FakeApiServer, cache: ClaimCache, test: Callable[[], Awaitable[None]]) -> None:
    task = asyncio.create_task(cache.run())
    try:
        await until(lambda: cache.listed)
        await test()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_a_prepare_of_a_watched_claim_makes_no_get(core: PluginCore) -> None:
    async def body() -> None:
        api = FakeApiServer()
        cache = ClaimCache(api.kube(), DRIVER, NODE)
        core.preparer.claims = api.kube()
        gpu = gpu_names(core)[0]
        one = reserved(claim("ignored", [gpu], name="one"))
        # What an apiserver adds, which the cache does not keep: prepare does not read it.
        one["metadata"]["managedFields"] = [{"manager": "kube-scheduler", "fieldsV1": {"f:status": {}}}]
        one["status"]["devices"] = [{"driver": DRIVER, "pool": NODE, "device": gpu, "conditions": []}]
        stored = api.put(CLAIMS, one)

        async def test() -> None:
            await until(lambda: len(cache) == 1)
            devices = await prepare_claim(core.preparer, ref_of(stored), cache)
            assert [d.device_name for d in devices] == [gpu]
            assert api.count("GET", CLAIMS) == 1  # the list; no GET of the claim
            assert cache.hits == 1
            # The CDI spec is the claim's, as after a GET.
            assert core.cdi.path(stored["metadata"]["uid"]).exists()

        await watching(api, cache, test)

    asyncio.run(body())


def test_a_watched_claim_keeps_the_name_its_pod_gives_it_for_its_device_metadata(core: PluginCore) -> None:
    """A claim made from a template: its device metadata is mounted under the name the pod gives
    it (the annotation resource.kubernetes.io/pod-claim-name), which the cache keeps."""

    async def body() -> None:
        api = FakeApiServer()
        cache = ClaimCache(api.kube(), DRIVER, NODE)
        core.preparer.claims = api.kube()
        core.preparer.metadata.enabled = True
        one = reserved(claim("ignored", gpu_names(core)[:1], name="pod-gpus-abcde"))
        one["metadata"]["annotations"] = {
            "resource.kubernetes.io/pod-claim-name": "gpus",
            "other": "x" * 1000,
        }
        stored = api.put(CLAIMS, one)

        async def test() -> None:
            await until(lambda: len(cache) == 1)
            await prepare_claim(core.preparer, ref_of(stored), cache)
            assert cache.hits == 1
            uid = stored["metadata"]["uid"]
            spec = json.loads((core.cdi.dir / f"{DRIVER}_metadata_{uid}_gpu.json").read_text())
            (mount,) = spec["devices"][0]["containerEdits"]["mounts"]
            assert mount["containerPath"].endswith(f"/resourceclaimtemplates/gpus/gpu/{DRIVER}-metadata.json")
            kept = cache.lookup(ref_of(stored))
            assert kept is not None and kept["metadata"]["annotations"] == {
                "resource.kubernetes.io/pod-claim-name": "gpus"
            }

        await watching(api, cache, test)

    asyncio.run(body())


def test_what_the_cache_cannot_vouch_for_is_read_from_the_apiserver(core: PluginCore) -> None:
    async def body() -> None:
        api = FakeApiServer()
        cache = ClaimCache(api.kube(), DRIVER, NODE, backoff=Backoff(initial=0.01, maximum=0.05))
        core.preparer.claims = api.kube()
        a, b, c = gpu_names(core)[:3]
        elsewhere = api.put(CLAIMS, reserved(claim("x", [a], name="elsewhere", node="node-b")))
        unreserved = api.put(CLAIMS, claim("x", [b], name="unreserved"))
        replaced = api.put(CLAIMS, reserved(claim("x", [c], name="replaced")))

        async def test() -> None:
            await until(lambda: len(cache) == 2)  # elsewhere is another node's: not kept
            assert cache.lookup(ref_of(elsewhere)) is None
            assert cache.lookup(ref_of(unreserved)) is None
            # The kubelet names a newer claim of the same name: its UID is not the cached one.
            newer = ClaimRef("default", "uid-newer", "replaced")
            assert cache.lookup(newer) is None
            assert cache.lookup(ref_of(replaced)) is not None
            gets = api.count("GET", CLAIMS)
            devices = await prepare_claim(core.preparer, ref_of(unreserved), cache)  # read from the apiserver
            assert [d.device_name for d in devices] == [b]
            assert api.count("GET", CLAIMS) == gets + 1
            # Deallocated, then deleted: dropped at once.
            api.put(CLAIMS, {**replaced, "status": {}})
            await until(lambda: len(cache) == 1)
            api.remove(CLAIMS, "unreserved", "default")
            await until(lambda: len(cache) == 0)
            # A watch that ends (apiserver restart) is listed again, and the cache with it.
            again = api.put(CLAIMS, reserved(claim("x", [a], name="again")))
            api.end_watches()
            await until(lambda: cache.lookup(ref_of(again)) is not None)

        await watching(api, cache, test)

    asyncio.run(body())


def test_subscribers_see_this_nodes_claims_of_the_one_watch() -> None:
    async def body() -> None:
        api = FakeApiServer()
        cache = ClaimCache(api.kube(), DRIVER, NODE)
        lists: list[list[str]] = []
        events: list[tuple[str, str]] = []

        async def on_list(items: list[dict[str, Any]], _version: str) -> None:
            lists.append([i["metadata"]["name"] for i in items])

        async def on_event(kind: str, obj: dict[str, Any]) -> bool:
            events.append((kind, obj["metadata"]["name"]))
            return True

        cache.subscribe(on_list, on_event)
        api.put(CLAIMS, claim("x", ["gpu-0"], name="first", node="node-b"))
        api.put(CLAIMS, claim("y", ["gpu-0"], name="mine"))

        async def test() -> None:
            api.put(CLAIMS, claim("x", ["gpu-1"], name="second", node="node-c"))
            api.put(CLAIMS, claim("z", ["gpu-1"], name="mine-too"))
            api.put(CLAIMS, {**claim("y", ["gpu-0"], name="mine"), "status": {}})  # deallocated
            await until(lambda: len(events) == 2)
            assert lists == [["mine"]]
            assert events == [("ADDED", "mine-too"), ("MODIFIED", "mine")]
            assert api.count("GET", CLAIMS, watch=True) == 1  # one watch for all

        await watching(api, cache, test)

    asyncio.run(body())


def test_the_claims_are_listed_in_pages_and_other_nodes_claims_are_not_kept() -> None:
    """250 claims of the cluster, 1 in 25 on this node (or of another driver on it): the list is
    read 100 at a time, and only this node's claims of this driver are held, as their slim copy."""

    async def body() -> None:
        api = FakeApiServer()
        for i in range(250):
            node, driver = (NODE, DRIVER) if i % 25 == 0 else ("node-b", DRIVER)
            if i % 25 == 1:
                node, driver = NODE, "other.example.com"
            c = claim(f"uid-{i}", [f"gpu-{i}"], name=f"claim-{i:03d}", node=node, driver=driver)
            c["spec"] = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x"}}]}}
            api.put(CLAIMS, c)
        cache = ClaimCache(api.kube(), DRIVER, NODE)
        listed: list[list[dict[str, Any]]] = []

        async def on_list(items: list[dict[str, Any]], _version: str) -> None:
            listed.append(items)

        async def on_event(_kind: str, _obj: dict[str, Any]) -> bool:
            return True

        cache.subscribe(on_list, on_event)

        async def test() -> None:
            pages = [r.query for r in api.requests if r.method == "GET" and not r.watch]
            assert [q["limit"] for q in pages] == ["100", "100", "100"]
            assert [bool(q.get("continue")) for q in pages] == [False, True, True]
            here = [f"claim-{i:03d}" for i in range(0, 250, 25)]
            assert [i["metadata"]["name"] for i in listed[0]] == here
            assert sorted(name for _, name in cache._claims) == here
            kept = [json.loads(k.claim) for k in cache._claims.values()]
            assert all(set(k) == {"metadata", "status"} for k in kept)  # no spec kept
            # The watch begins at the list's resourceVersion: a later change arrives, once.
            watch = next(r for r in api.requests if r.watch)
            assert watch.query["resourceVersion"] == str(api.version)
            api.put(CLAIMS, claim("uid-new", ["gpu-x"], name="claim-new"))
            await until(lambda: len(cache) == 11)

        await watching(api, cache, test)

    asyncio.run(body())
