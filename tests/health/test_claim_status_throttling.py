"""A claim status write the apiserver throttles (429 Too Many Requests, API Priority and Fairness)
through Kube over the in-memory apiserver: retried with growing waits until it lands, given up
after the writer's deadline (logged, never raised), and written again by the next sync."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from fake_kube import FakeApiServer, FakeResponse, Request
from simnode.fake import discover_node

from dra_gpu.health import claim_status
from dra_gpu.health.claim_status import ClaimStatusWriter
from dra_gpu.node.catalog import DeviceCatalog

DRIVER = "gpu.dra-gpu.io"
INITIAL = 0.05  # the writer's first wait, seconds


@dataclass
class TimedServer(FakeApiServer):
    """The in-memory apiserver with the claims' status subresource (an apply sets the stored
    claim's status), noting when each status write came."""

    patched_at: list[float] = field(default_factory=list)

    async def handle(self, req: Request, timeout: float | None) -> FakeResponse:
        if req.method == "PATCH" and req.path.endswith("/status"):
            self.patched_at.append(time.monotonic())
            path = req.path.removesuffix("/status")
            meta = req.body["metadata"]
            stored = self.objects.get("resourceclaims", {}).get(f"{meta['namespace']}/{meta['name']}")
            if stored is not None:
                req = Request(req.method, path, req.query, {**stored, "status": req.body["status"]})
        return await super().handle(req, timeout)


def writer_for(server: FakeApiServer) -> tuple[ClaimStatusWriter, list[dict[str, Any]]]:
    server.put("resourceclaims", {"metadata": {"name": "c", "namespace": "ns"}, "spec": {}})
    inv = discover_node("node-a", "hgx-2x4")
    devices = [{"deviceName": inv.gpus[0].device_name, "poolName": "node-a"}]
    writer = ClaimStatusWriter(
        server.kube(),
        DRIVER,
        DeviceCatalog.build(inv),
        None,
        lambda: [("ns", "c", "uid-1", devices)],
        retry_initial=INITIAL,
    )
    return writer, devices


def stored_status(server: FakeApiServer) -> Any:
    claim = server.objects["resourceclaims"]["ns/c"]
    return claim["status"]["devices"][0]["device"] if "status" in claim else None


def test_a_throttled_status_write_is_retried_with_growing_waits_and_lands() -> None:
    async def body() -> None:
        server = TimedServer()
        server.fail(method="PATCH", plural="resourceclaims", status=429, count=4)
        writer, devices = writer_for(server)
        await asyncio.wait_for(writer.write("ns", "c", "uid-1", devices), timeout=10)
        assert stored_status(server) == devices[0]["deviceName"]
        at = server.patched_at
        assert len(at) == 5, at  # four answered 429, the fifth landed
        gaps = [b - a for a, b in itertools.pairwise(at)]
        # Exponential: the n-th wait is at least INITIAL * 2**n (plus up to INITIAL of jitter).
        for n, gap in enumerate(gaps):
            assert gap >= INITIAL * 2**n * 0.95, gaps
        assert gaps[-1] > 2 * gaps[0], gaps
        await writer.close()

    asyncio.run(body())


def test_a_status_write_throttled_past_its_deadline_is_given_up_then_written_by_the_next_sync(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(claim_status, "STATUS_RETRY_SECONDS", 0.5)

    async def body() -> None:
        server = TimedServer()
        server.fail(method="PATCH", plural="resourceclaims", status=429, count=1000)
        writer, devices = writer_for(server)
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="dra_gpu.health.claim_status"):
            await asyncio.wait_for(writer.write("ns", "c", "uid-1", devices), timeout=5)
        took = time.monotonic() - start
        # Tried until the deadline (waits 0.05, 0.1, 0.2, ...: 3 to 5 tries), then no more.
        assert 3 <= len(server.patched_at) <= 6, server.patched_at
        assert took < 0.5 + 0.4 + 2 * INITIAL, took  # the deadline plus at most one wait
        assert stored_status(server) is None
        (given_up,) = [r for r in caplog.records if "claim status not written" in r.getMessage()]
        assert "ns/c" in given_up.getMessage() and "429" in given_up.getMessage()
        # The apiserver has room again: the next sync writes it (it was not noted as written).
        server.failures.clear()
        await writer.sync()
        assert stored_status(server) == devices[0]["deviceName"]
        await writer.close()

    asyncio.run(body())


def test_a_status_write_refused_for_good_is_not_retried() -> None:
    """A 422 (the apiserver will never take this body) is tried once: no backoff spent on it."""

    async def body() -> None:
        server = TimedServer()
        server.fail(method="PATCH", plural="resourceclaims", status=422, count=1000)
        writer, devices = writer_for(server)
        await asyncio.wait_for(writer.write("ns", "c", "uid-1", devices), timeout=5)
        assert len(server.patched_at) == 1 and stored_status(server) is None
        await writer.close()

    asyncio.run(body())


def test_a_throttled_status_write_waits_as_long_as_retry_after_asks() -> None:
    """The apiserver's 429 says when to come back (Retry-After: 1): the next try is not before."""

    async def body() -> None:
        server = TimedServer()
        server.fail(method="PATCH", plural="resourceclaims", status=429, count=1, retry_after=1)
        writer, devices = writer_for(server)
        await asyncio.wait_for(writer.write("ns", "c", "uid-1", devices), timeout=10)
        assert stored_status(server) == devices[0]["deviceName"]
        (first, second) = server.patched_at
        assert second - first >= 0.95, server.patched_at  # the backoff alone would be ~INITIAL
        await writer.close()

    asyncio.run(body())
