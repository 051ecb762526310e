"""The plugin's self-check behind /healthz and /readyz: both sockets called as the kubelet calls them.

Probes arrive from the kubelet, from monitoring and from anyone who can reach the port, so a check
must not cost a connection each: the two channels are opened once and closed on stop, at most one
check runs at a time (concurrent probes await the same one), and a result younger than `max_age`
is answered from memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from pathlib import Path
from typing import Any

import grpc

from dra_gpu.kubeletplugin._proto import dra_v1_pb2 as v1_pb
from dra_gpu.kubeletplugin._proto import dra_v1_pb2_grpc as v1_grpc
from dra_gpu.kubeletplugin._proto import pluginregistration_v1_pb2 as reg_pb
from dra_gpu.kubeletplugin._proto import pluginregistration_v1_pb2_grpc as reg_grpc

MAX_AGE_SECONDS = 1.0
STOPPED = "the kubelet plugin is stopping"
# A long-lived channel that lost its socket reconnects with gRPC's backoff (up to 120 s by
# default): capped so a socket served again is seen healthy within about a second.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


class SelfCheck:
    """`check()`: None when the registration socket answers GetInfo for `driver_name` and the DRA
    socket answers an empty NodePrepareResources, else what failed."""

    def __init__(
        self, registration: Path, dra: Path, driver_name: str, max_age: float = MAX_AGE_SECONDS
    ) -> None:
        self.registration = registration
        self.dra = dra
        self.driver_name = driver_name
        self.max_age = max_age
        self._channels: tuple[Any, Any] | None = None
        self._identity: list[tuple[int, int]] = []  # (device, inode) of the sockets the channels reach
        self._running: asyncio.Task[str | None] | None = None
        self._last: tuple[float, str | None] | None = None  # (loop time it finished, result)
        self._closed = False

    async def check(self, timeout: float = 2.0) -> str | None:
        if self._closed:
            return STOPPED
        # The socket files every time (two stats): a kept "ok" never outlives a socket removed
        # or replaced since; only the RPCs' answer is kept.
        problem, identity = self._sockets()
        if problem is not None:
            return problem
        loop = asyncio.get_running_loop()
        fresh = self._last is not None and loop.time() - self._last[0] < self.max_age
        if self._last is not None and fresh and identity == self._identity:
            return self._last[1]
        if self._running is None:
            self._running = asyncio.create_task(self._run(timeout), name="self-check")
        try:
            # Shielded: a probe whose client went away must not cancel the check the others await.
            return await asyncio.wait_for(asyncio.shield(self._running), timeout)
        except TimeoutError:
            return f"self-check did not finish within {timeout:g}s"

    def _sockets(self) -> tuple[str | None, list[tuple[int, int]]]:
        """What is wrong with the socket files (None: nothing), and their (device, inode)."""
        identity = []
        for path in (self.registration, self.dra):
            try:
                st = os.stat(path)
            except OSError as exc:
                return f"socket {path}: {exc.strerror}", []
            if not stat.S_ISSOCK(st.st_mode):
                return f"socket {path}: not a socket", []
            identity.append((st.st_dev, st.st_ino))
        return None, identity

    async def close(self) -> None:
        """Stops answering from the sockets (every later check says STOPPED) and closes the channels."""
        self._closed = True
        if self._running is not None:
            self._running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._running
        await self._close_channels()

    async def _close_channels(self) -> None:
        if self._channels is not None:
            channels, self._channels = self._channels, None
            for channel in channels:
                await channel.close()

    async def _run(self, timeout: float) -> str | None:
        try:
            async with asyncio.timeout(timeout):
                result = await self._probe(timeout)
        except TimeoutError:
            result = f"self-check did not finish within {timeout:g}s"
        finally:
            self._running = None
        self._last = (asyncio.get_running_loop().time(), result)
        return result

    async def _probe(self, timeout: float) -> str | None:
        # The kubelet connects by path: a socket file removed fails the check, one replaced gets
        # fresh channels (those open still reach the socket that was there).
        problem, identity = self._sockets()
        if problem is not None:
            return problem
        if self._identity != identity:
            await self._close_channels()
            self._identity = identity
        registration, dra = self._open()
        try:
            info = await reg_grpc.RegistrationStub(registration).GetInfo(
                reg_pb.InfoRequest(), timeout=timeout
            )
            if info.name != self.driver_name:
                return f"registration socket answers for driver {info.name!r}"
            await v1_grpc.DRAPluginStub(dra).NodePrepareResources(
                v1_pb.NodePrepareResourcesRequest(), timeout=timeout
            )
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        return None

    def _open(self) -> tuple[Any, Any]:
        if self._channels is None:
            self._channels = (_channel(self.registration), _channel(self.dra))
        return self._channels


def _channel(path: Path) -> Any:
    return grpc.aio.insecure_channel(f"unix://{path}", options=CHANNEL_OPTIONS)
