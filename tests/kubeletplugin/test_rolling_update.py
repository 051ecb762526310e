"""Two instances of one driver on a node (a DaemonSet rolling update with maxSurge): sockets named
after each pod's UID, their calls serialised on the plugin directory's lock, stale sockets of a
gone instance removed, and a stopping instance that waits for its successor."""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from fake_kube import FakeApiServer

from dra_gpu.kubeletplugin._proto import dra_v1_pb2 as v1_pb
from dra_gpu.kubeletplugin._proto import dra_v1_pb2_grpc as v1_grpc
from dra_gpu.kubeletplugin.claims import ClaimFetcher
from dra_gpu.kubeletplugin.helper import SOCKET_PATH_MAX, KubeletPluginHelper, Sockets
from dra_gpu.kubeletplugin.instance_lock import LOCK_FILE, InstanceLock, InstanceLockTimeout
from dra_gpu.kubeletplugin.metrics import PluginMetrics

from .conftest import DRIVER, NODE, FakeClaims, FakeDriver

UID_A = "0b6f3c1e-1111-4a4a-9c9c-aaaaaaaaaaaa"
UID_B = "0b6f3c1e-2222-4b4b-9d9d-bbbbbbbbbbbb"


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A short directory: a pod UID in a socket name leaves little of a unix path's 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="ru"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_socket_names_carry_the_pod_uid() -> None:
    plug, reg = Path("/var/lib/kubelet/plugins") / DRIVER, Path("/var/lib/kubelet/plugins_registry")
    fixed = Sockets.for_instance(DRIVER, plug, reg, "")
    assert (fixed.dra.name, fixed.registration.name, fixed.rolling) == (
        "dra.sock",
        f"{DRIVER}-reg.sock",
        False,
    )
    a = Sockets.for_instance(DRIVER, plug, reg, UID_A)
    assert (a.dra.name, a.registration.name, a.rolling) == (
        f"dra-{UID_A}.sock",
        f"{DRIVER}-{UID_A}-reg.sock",
        True,
    )
    b = Sockets.for_instance(DRIVER, plug, reg, UID_B)
    assert {a.dra, a.registration}.isdisjoint({b.dra, b.registration})


def test_a_long_registry_path_gets_a_hashed_name(tmp_path: Path) -> None:
    deep = tmp_path / ("r" * (SOCKET_PATH_MAX + 1 - len(str(tmp_path)) - len(DRIVER) - 30))
    s = Sockets.for_instance(DRIVER, tmp_path / "p", deep, UID_A)
    assert len(str(s.registration)) <= SOCKET_PATH_MAX
    assert s.registration.name.endswith("-reg.sock") and UID_A not in s.registration.name
    assert s.registration == Sockets.for_instance(DRIVER, tmp_path / "p", deep, UID_A).registration  # stable


def _listening(path: Path) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(1)
    return s


def _dead(path: Path) -> None:
    _listening(path).close()  # the file stays, nobody listens


def test_the_sockets_of_gone_instances_are_removed_live_ones_kept(tmp_path: Path) -> None:
    me = Sockets.for_instance(DRIVER, tmp_path / "plug", tmp_path / "reg", UID_A)
    other = Sockets.for_instance(DRIVER, tmp_path / "plug", tmp_path / "reg", UID_B)
    gone = Sockets.for_instance(DRIVER, tmp_path / "plug", tmp_path / "reg", "0b6f3c1e-dead")
    live = [_listening(other.dra), _listening(other.registration)]
    try:
        _dead(gone.dra)
        _dead(gone.registration)
        _dead(tmp_path / "reg" / "other.driver.io-reg.sock")  # another driver's: not ours to judge
        (tmp_path / "plug" / "dra-notes.sock").write_text("not a socket")
        removed = me.remove_stale(DRIVER)
        assert sorted(removed) == sorted([gone.dra, gone.registration])
        assert other.dra.exists() and other.registration.exists()
        assert (tmp_path / "reg" / "other.driver.io-reg.sock").exists()
        assert (tmp_path / "plug" / "dra-notes.sock").exists()
    finally:
        for s in live:
            s.close()


# -- the lock ------------------------------------------------------------------------------------


def test_the_lock_is_shared_in_a_process_and_exclusive_between_two(tmp_path: Path) -> None:
    async def body() -> None:
        acquired: list[str] = []

        async def on_a() -> None:
            acquired.append("a")

        a = InstanceLock(tmp_path / LOCK_FILE, timeout=5, on_acquired=on_a)
        b = InstanceLock(tmp_path / LOCK_FILE, timeout=0.3)  # another open file: another instance
        inside = asyncio.Event()
        release = asyncio.Event()

        async def holder() -> None:
            async with a.hold("one"):
                inside.set()
                await release.wait()

        first = asyncio.create_task(holder())
        await inside.wait()
        async with a.hold("two"):  # joins the first holder at once
            assert a.held
        with pytest.raises(InstanceLockTimeout, match=r"held .*serialize\.lock for more than 0\.3s"):
            async with b.hold("prepare"):
                pass
        release.set()
        await first
        assert acquired == ["a"]  # one acquisition for both holders
        start = time.monotonic()
        async with b.hold("prepare"):
            assert time.monotonic() - start < 0.2
        # b has let go: a takes it anew and runs its hook again.
        async with a.hold("three"):
            pass
        assert acquired == ["a", "a"]
        a.close()
        b.close()

    asyncio.run(body())


def test_a_waiting_instance_gets_the_lock_when_the_other_lets_go(tmp_path: Path) -> None:
    async def body() -> None:
        a = InstanceLock(tmp_path / LOCK_FILE)
        b = InstanceLock(tmp_path / LOCK_FILE, timeout=5)
        order: list[str] = []

        async def hold_a() -> None:
            async with a.hold():
                order.append("a in")
                await asyncio.sleep(0.3)
                order.append("a out")

        task = asyncio.create_task(hold_a())
        await asyncio.sleep(0.05)
        async with b.hold():
            order.append("b in")
        await task
        assert order == ["a in", "a out", "b in"]

    asyncio.run(body())


def test_a_failing_hook_releases_the_lock(tmp_path: Path) -> None:
    async def body() -> None:
        async def broken() -> None:
            raise ValueError("checkpoint does not verify")

        a = InstanceLock(tmp_path / LOCK_FILE, on_acquired=broken)
        with pytest.raises(ValueError):
            async with a.hold():
                pass
        b = InstanceLock(tmp_path / LOCK_FILE, timeout=0.1)
        async with b.hold():
            pass

    asyncio.run(body())


def test_without_a_path_no_file_is_made(tmp_path: Path) -> None:
    async def body() -> None:
        lock = InstanceLock.in_dir(tmp_path, rolling=False)
        async with lock.hold():
            assert lock.held
        assert not lock.held and not (tmp_path / LOCK_FILE).exists()

    asyncio.run(body())


# -- two helpers ---------------------------------------------------------------------------------


@asynccontextmanager
async def instance(
    tmp_path: Path, uid: str, api: FakeApiServer, timeout: float = 5
) -> AsyncIterator[KubeletPluginHelper]:
    sockets = Sockets.for_instance(DRIVER, tmp_path / "plug", tmp_path / "reg", uid)
    lock = InstanceLock.in_dir(tmp_path / "plug", rolling=True, timeout=timeout)
    helper = KubeletPluginHelper(
        DRIVER,
        NODE,
        FakeDriver(),
        api.kube(),
        sockets,
        PluginMetrics(),
        claims=ClaimFetcher(FakeClaims()),
        lock=lock,
    )
    await helper.start()
    try:
        yield helper
    finally:
        await helper.stop()
        lock.close()


def _prepare(*names: str) -> v1_pb.NodePrepareResourcesRequest:
    return v1_pb.NodePrepareResourcesRequest(
        claims=[v1_pb.Claim(namespace="default", uid=f"uid-{n}", name=n) for n in names]
    )


def test_two_instances_serve_side_by_side_and_take_turns(tmp_path: Path) -> None:
    async def body() -> None:
        api = FakeApiServer()
        async with instance(tmp_path, UID_A, api) as a, instance(tmp_path, UID_B, api, timeout=0.3) as b:
            assert {a.sockets.dra, b.sockets.dra} <= set((tmp_path / "plug").iterdir())
            other = InstanceLock(tmp_path / "plug" / LOCK_FILE)  # a third holder keeps it
            async with (
                other.hold(),
                grpc.aio.insecure_channel(f"unix://{b.sockets.dra}") as channel,
            ):
                stub = v1_grpc.DRAPluginStub(channel)
                # The self-check's empty call needs no lock.
                start = time.monotonic()
                await stub.NodePrepareResources(_prepare(), timeout=5)
                assert time.monotonic() - start < 0.2
                # A claim waits for the lock, then fails with a reason; the claim the apiserver
                # lacks fails with its own.
                response = await stub.NodePrepareResources(_prepare("c1", "gone-c2"), timeout=5)
                assert "held" in response.claims["uid-c1"].error
                assert "not found" in response.claims["uid-gone-c2"].error
            other.close()
            async with grpc.aio.insecure_channel(f"unix://{b.sockets.dra}") as channel:
                response = await v1_grpc.DRAPluginStub(channel).NodePrepareResources(
                    _prepare("c1"), timeout=5
                )
                assert not response.claims["uid-c1"].error and response.claims["uid-c1"].devices
            # Each finds the other as a successor.
            assert await a.wait_for_successor(1.0)
        # Both removed their own sockets at exit.
        assert not [p for p in (tmp_path / "plug").iterdir() if p.suffix == ".sock"]
        assert not list((tmp_path / "reg").iterdir())

    asyncio.run(body())


def test_a_stopping_instance_waits_for_its_successor_bounded(tmp_path: Path) -> None:
    async def body() -> None:
        api = FakeApiServer()
        async with instance(tmp_path, UID_A, api) as a:
            start = time.monotonic()
            assert not await a.wait_for_successor(0.5)  # nobody comes
            assert 0.4 < time.monotonic() - start < 2.0

            async def successor_later() -> None:
                await asyncio.sleep(0.4)
                async with instance(tmp_path, UID_B, api):
                    await asyncio.sleep(3.5)

            task = asyncio.create_task(successor_later())
            start = time.monotonic()
            assert await a.wait_for_successor(5.0)
            # The kubelet's watcher is given its time to register it.
            assert time.monotonic() - start >= 0.4 + 2.0
            await task

    asyncio.run(body())


def test_a_successor_under_a_hashed_name_is_found(tmp_path: Path) -> None:
    """A registry path so long that only the hashed `dra-<hash>-reg.sock` fits: the stopping
    instance finds its successor by asking (GetInfo), and a dead hashed socket (maybe another
    driver's) is neither taken for one nor removed."""
    hashed_name = len("dra-") + 22 + len("-reg.sock")  # 16 bytes base64url
    # The registry dir's path as long as a hashed name fits and `<driver>-<hash>-reg.sock` does not.
    deep = tmp_path / ("r" * (SOCKET_PATH_MAX - len(str(tmp_path)) - 1 - 1 - hashed_name))

    @asynccontextmanager
    async def hashed(uid: str, api: FakeApiServer) -> AsyncIterator[KubeletPluginHelper]:
        sockets = Sockets.for_instance(DRIVER, tmp_path / "plug", deep, uid)
        assert sockets.registration.name.startswith("dra-"), sockets.registration
        helper = KubeletPluginHelper(DRIVER, NODE, FakeDriver(), api.kube(), sockets, PluginMetrics())
        await helper.start()
        try:
            yield helper
        finally:
            await helper.stop()

    async def body() -> None:
        api = FakeApiServer()
        stranger = deep / "dra-AAAAAAAAAAAAAAAAAAAAAA-reg.sock"
        _dead(stranger)
        async with hashed(UID_A, api) as a:
            assert not await a.wait_for_successor(0.3)
            async with hashed(UID_B, api):
                assert await a.wait_for_successor(2.0)
        assert stranger.exists()

    asyncio.run(body())


def test_fixed_names_never_wait(tmp_path: Path) -> None:
    async def body() -> None:
        sockets = Sockets.for_driver(DRIVER, tmp_path / "plug", tmp_path / "reg")
        helper = KubeletPluginHelper(
            DRIVER, NODE, FakeDriver(), FakeApiServer().kube(), sockets, PluginMetrics()
        )
        start = time.monotonic()
        assert not await helper.wait_for_successor(5.0)
        assert time.monotonic() - start < 0.1

    asyncio.run(body())
