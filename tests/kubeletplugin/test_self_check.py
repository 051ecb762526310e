"""The self-check behind /healthz: a flood of probes costs two channels in all and one check a
second, and a socket the kubelet could no longer use still fails it."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from dra_gpu.kubeletplugin._proto import pluginregistration_v1_pb2_grpc as reg_grpc
from dra_gpu.kubeletplugin.helper import serve_unix

from .test_helper import Running, run_plugin


class Counted:
    """grpc.aio.insecure_channel, counting the channels opened and the calls made on them."""

    def __init__(self) -> None:
        self.real = grpc.aio.insecure_channel
        self.opened: list[str] = []
        self.channels: list[Any] = []
        self.calls: list[str] = []

    def __call__(self, target: str, options: Any = None, **kw: Any) -> Any:
        self.opened.append(target)
        self.channels.append(self.real(target, options=options, interceptors=[CountCalls(self.calls)]))
        return self.channels[-1]


class CountCalls(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        self.calls.append(method.rsplit("/", 1)[-1])
        return await continuation(details, request)


def with_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, test: Callable[[Running, Counted], Awaitable[None]]
) -> None:
    async def body(p: Running) -> None:
        counted = Counted()  # after run_plugin opened the test's own two channels
        monkeypatch.setattr(grpc.aio, "insecure_channel", counted)
        await test(p, counted)

    run_plugin(tmp_path, body)


async def flood(p: Running, n: int = 200) -> list[str | None]:
    return list(await asyncio.gather(*(p.helper.self_check() for _ in range(n))))


def test_concurrent_probes_share_two_channels_and_one_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def test(p: Running, counted: Counted) -> None:
        sockets = p.helper.sockets
        assert await flood(p) == [None] * 200
        assert sorted(counted.opened) == sorted([f"unix://{sockets.registration}", f"unix://{sockets.dra}"])
        assert counted.calls == ["GetInfo", "NodePrepareResources"]
        assert await flood(p) == [None] * 200  # within a second: the result in memory
        assert counted.calls == ["GetInfo", "NodePrepareResources"]
        await asyncio.sleep(1.1)
        assert await flood(p) == [None] * 200  # one new check, on the same channels
        assert counted.calls == ["GetInfo", "NodePrepareResources"] * 2
        assert len(counted.opened) == 2

    with_counted(tmp_path, monkeypatch, test)


def test_a_socket_removed_or_replaced_fails_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def test(p: Running, counted: Counted) -> None:
        dra = p.helper.sockets.dra
        assert await p.helper.self_check() is None
        # Seen at once, although an "ok" younger than the cache's second is kept: the socket
        # files are looked at on every probe.
        dra.rename(dra.with_name("moved.sock"))  # the server still listens, the path is gone
        assert await p.helper.self_check() == f"socket {dra}: No such file or directory"
        # A socket nobody listens on at the path: the open channels still reach the moved one,
        # the kubelet would not, so the check opens fresh ones and fails as the kubelet would.
        with socket.socket(socket.AF_UNIX) as dead:
            dead.bind(str(dra))
            problem = await p.helper.self_check(timeout=1)
        assert problem is not None and problem.startswith("UNAVAILABLE"), problem
        assert len(counted.opened) == 4
        dra.unlink()
        dra.with_name("moved.sock").rename(dra)
        assert await p.helper.self_check(timeout=2) is None  # served again: healthy again

    with_counted(tmp_path, monkeypatch, test)


class Hangs(reg_grpc.RegistrationServicer):  # type: ignore[misc]
    async def GetInfo(self, request: Any, context: Any) -> Any:
        await asyncio.Event().wait()


def test_a_check_that_hangs_times_out_for_every_waiting_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def test(p: Running, counted: Counted) -> None:
        hanging = await serve_unix(
            p.helper.sockets.registration, [(reg_grpc.add_RegistrationServicer_to_server, Hangs())]
        )
        try:
            started = asyncio.get_running_loop().time()
            answers = await asyncio.gather(*(p.helper.self_check(timeout=0.3) for _ in range(50)))
            took = asyncio.get_running_loop().time() - started
        finally:
            await hanging.stop(grace=0)
        assert len(set(answers)) == 1 and took < 1.5, (answers[0], took)  # one check for all
        assert answers[0] in ("self-check did not finish within 0.3s", "DEADLINE_EXCEEDED: Deadline Exceeded")
        assert counted.calls == ["GetInfo"]

    with_counted(tmp_path, monkeypatch, test)


def test_stopped_plugin_says_so_and_closes_its_channels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def test(p: Running, counted: Counted) -> None:
        assert await p.helper.self_check() is None
        await p.helper.stop()
        assert [ch.get_state() for ch in counted.channels] == [grpc.ChannelConnectivity.SHUTDOWN] * 2
        assert await p.helper.self_check() == "the kubelet plugin is stopping"  # not the cached "ok"

    with_counted(tmp_path, monkeypatch, test)
