"""The plugin's /healthz under a flood of probes: every probe answered, two gRPC channels in all;
a DRA socket gone still answers 503."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import grpc
import pytest

from dra_gpu.node.settings import NodeSettings
from dra_gpu.plugin.server import NOT_REGISTERED, KubeletPlugin, PluginConfig
from tests.kubeletplugin.conftest import DRIVER, NODE
from tests.kubeletplugin.test_helper import Running, run_plugin
from tests.kubeletplugin.test_self_check import Counted


def test_healthz_flood_shares_the_self_checks_channels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = NodeSettings(
        NODE, DRIVER, None, tmp_path / "plug", tmp_path / "reg", tmp_path / "cdi", Path("/dev"), None
    )
    plugin = KubeletPlugin(PluginConfig(node=node, http_address="127.0.0.1:0"))

    async def test(p: Running) -> None:
        counted = Counted()
        monkeypatch.setattr(grpc.aio, "insecure_channel", counted)
        runner = await plugin._start_http(p.helper)
        assert runner is not None
        host, port = runner.addresses[0][:2]
        try:
            async with aiohttp.ClientSession(
                f"http://{host}:{port}", timeout=aiohttp.ClientTimeout(total=10)
            ) as http:

                async def get(path: str) -> tuple[int, str]:
                    async with http.get(path) as resp:
                        return resp.status, await resp.text()

                for _ in range(2):  # the second a second later: a new check, on the same channels
                    answers = await asyncio.gather(*(get("/healthz") for _ in range(200)))
                    assert answers == [(200, "ok\n")] * 200
                    await asyncio.sleep(1.1)
                assert len(counted.opened) == 2
                assert counted.calls == ["GetInfo", "NodePrepareResources"] * 2
                assert await get("/readyz") == (503, NOT_REGISTERED)

                dra = p.helper.sockets.dra
                dra.rename(dra.with_name("moved.sock"))
                await asyncio.sleep(1.1)  # past the result kept in memory
                assert await get("/healthz") == (503, f"unhealthy: socket {dra}: No such file or directory\n")
                dra.with_name("moved.sock").rename(dra)
                assert len(counted.opened) == 2
        finally:
            await runner.cleanup()

    run_plugin(tmp_path, test)
