"""The webhook's watch caches (against the in-memory API), /readyz, and its graceful stop on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from fake_kube import FakeApiServer, until

from dra_gpu.controller import webhook
from dra_gpu.controller.webhook import ClusterState, Metrics, WebhookConfig, serve, watch_resource
from dra_gpu.kube.api import RESOURCE_V1, Backoff, Kube

from .objects import GPU_CLASS, claim, node_slices
from .test_cli_controller import DRA_GPU
from .test_webhook import make_cert


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_watch_keeps_a_store_current_and_lists_again_when_expired() -> None:
    async def body() -> None:
        api = FakeApiServer()
        slices = node_slices("node-a") + node_slices("node-b")
        api.put("resourceslices", slices[0])
        state, metrics = ClusterState("gpu.dra-gpu.io"), Metrics()
        path = f"{RESOURCE_V1}/resourceslices"
        task = asyncio.create_task(
            watch_resource(state, "slices", api.kube(), path, metrics, Backoff(0.01, 0.05))
        )
        await until(lambda: "slices" in state.synced and len(state.stores["slices"]) == 1)
        for s in slices[1:]:
            api.put("resourceslices", s)
        await until(lambda: len(state.stores["slices"]) == len(slices))
        api.remove("resourceslices", slices[0]["metadata"]["name"])
        await until(lambda: len(state.stores["slices"]) == len(slices) - 1)
        assert metrics.watch_events.labels("slices")._value.get() == len(slices)
        api.fail(method="GET", watch=False, status=500)
        api.expire_watches = 1
        api.end_watches()  # then: a failed list, a good one, an expired watch, a list again
        api.put("resourceslices", slices[0])  # no watch sees this: the next list brings it
        await until(lambda: api.count("GET", "resourceslices") == 4)
        await until(lambda: api.count("GET", "resourceslices", watch=True) == 3)
        assert len(state.stores["slices"]) == len(slices)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(body())


def webhook_config(tmp_path: Path, watch: bool, files: tuple[str, ...] = ()) -> WebhookConfig:
    cert, key = make_cert(tmp_path, "webhook")
    return WebhookConfig(
        cert=str(cert), key=str(key), address="127.0.0.1", port=free_port(), watch=watch, files=files
    )


async def serving(
    config: WebhookConfig, test: Callable[[Callable[[str], Awaitable[tuple[int, str]]]], Awaitable[None]]
) -> None:
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(serve(config, ready, reload_interval=60, stop=stop))
    await asyncio.wait_for(ready.wait(), 20)
    context = ssl.create_default_context(cafile=config.cert)
    async with aiohttp.ClientSession() as session:

        async def get(path: str) -> tuple[int, str]:
            url = f"https://127.0.0.1:{config.port}{path}"
            async with session.get(url, ssl=context, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                return resp.status, await resp.text()

        try:
            await test(get)
        finally:
            stop.set()
            await asyncio.wait_for(task, 20)


def test_readyz_waits_for_the_first_list_of_every_watched_resource(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body() -> None:
        api = FakeApiServer()
        for s in node_slices():
            api.put("resourceslices", s)
        api.gates["resourceclaims"] = claims_listed = asyncio.Event()
        kube = api.kube()

        async def connect(cls: type[Kube], kubeconfig: str | None = None) -> Kube:
            return kube

        monkeypatch.setattr(webhook.Kube, "connect", classmethod(connect))
        # Files loaded beside the watches do not make it ready: only the watches' lists do.
        cluster = tmp_path / "cluster.yaml"
        cluster.write_text(yaml.safe_dump_all([GPU_CLASS, claim("x")]))
        config = webhook_config(tmp_path, watch=True, files=(str(cluster),))

        async def test(get: Callable[[str], Awaitable[tuple[int, str]]]) -> None:
            await until(lambda: api.count("GET", "deviceclasses") == 1)
            assert await get("/readyz") == (503, "not ready: waiting for the first list of ['claims']\n")
            assert await get("/healthz") == (200, "ok\n")  # alive all the same
            claims_listed.set()
            await until(lambda: api.count("GET", "resourceclaims", watch=True) == 1)
            assert await get("/readyz") == (200, "ok\n")
            status, metrics = await get("/metrics")
            assert status == 200 and "dra_gpu_webhook_watched_devices 8.0" in metrics

        await serving(config, test)
        assert kube.api_client.closed  # the watches' connection is closed on the way out

    asyncio.run(body())


def test_readyz_without_watches_is_ready_at_once(tmp_path: Path) -> None:
    async def test(get: Callable[[str], Awaitable[tuple[int, str]]]) -> None:
        assert await get("/readyz") == (200, "ok\n")

    asyncio.run(serving(webhook_config(tmp_path, watch=False), test))


def test_sigterm_finishes_the_review_in_flight_and_exits_0(tmp_path: Path) -> None:
    port = free_port()
    cert, key = make_cert(tmp_path, "localhost")
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump_all([*node_slices(), GPU_CLASS]))
    proc = subprocess.Popen(
        [
            *(DRA_GPU, "controller", "--no-watch", "--cert", str(cert), "--key", str(key)),
            *("--address", "127.0.0.1", "--port", str(port), "-f", str(cluster)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        context = ssl.create_default_context(cafile=str(cert))
        deadline = time.monotonic() + 30
        while get_status(port, context, "/readyz") != 200:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "controller did not become ready"
            time.sleep(0.1)

        review = json.dumps(
            {
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "request": {
                    "uid": "in-flight",
                    "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"},
                    "operation": "CREATE",
                    "object": claim("two", 2),
                },
            }
        ).encode()
        with context.wrap_socket(
            socket.create_connection(("127.0.0.1", port)), server_hostname="localhost"
        ) as s:
            head = (
                f"POST /validate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(review)}\r\n\r\n"
            ).encode()
            s.sendall(head + review[:100])  # the review is in flight: its body half sent
            time.sleep(1.5)  # the server has read the head and started the handler
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while True:  # new connections are refused at once...
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                except ConnectionRefusedError:
                    break
                assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
                time.sleep(0.05)
            s.sendall(review[100:])  # ...while the one in flight is answered
            try:
                response = read_http_response(s)
            except AssertionError as exc:
                proc.wait(20)
                raise AssertionError(f"{exc}; controller's stderr: {proc.communicate()[1]}") from None
        assert response.startswith(b"HTTP/1.1 200"), response[:200]
        answer: dict[str, Any] = json.loads(response.split(b"\r\n\r\n", 1)[1])
        assert answer["response"] == {"uid": "in-flight", "allowed": True}
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert "Traceback" not in err and "event=stopping" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def get_status(port: int, context: ssl.SSLContext, path: str) -> int | None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"https://localhost:{port}{path}", context=context, timeout=2) as r:
            status: int = r.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def read_http_response(s: ssl.SSLSocket) -> bytes:
    s.settimeout(20)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"connection closed without an answer; got {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    while len(rest) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        rest += chunk
    return head + b"\r\n\r\n" + rest
