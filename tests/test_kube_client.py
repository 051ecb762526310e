"""dra_gpu.kube.official_client: the kubelet plugin loads only the parts of the Kubernetes client it calls.

Each check runs in a fresh interpreter: this test process has imported the whole client already.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# What `import kubernetes.aio.client` used to bring into the plugin without any of it being used.
NOT_IN_THE_PLUGIN = (
    "kubernetes.client",
    "kubernetes.config",
    "kubernetes.watch",
    "kubernetes.aio.client.api.",
    "kubernetes.aio.client.models.",
    "kubernetes.aio.dynamic",
    "kubernetes.aio.stream",
    "kubernetes.aio.watch",
    "requests",
    "oauthlib",
    "urllib3",
    "websocket",
)

# The plugin's imports, then one real request through Kube (kubeconfig, ApiClient, aiohttp) to an
# HTTP server in the same process, with a response body like the apiserver's.
PLUGIN_AND_ONE_REQUEST = """
import asyncio, json, os, sys, tempfile

import dra_gpu.cli
import dra_gpu.plugin.server
from aiohttp import web

from dra_gpu.kube.api import Kube

CLAIM = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
         "metadata": {"name": "c", "namespace": "ns", "uid": "u-1"}}


async def main():
    seen = []

    async def claim(request):
        seen.append((request.method, request.path, request.headers.get("Authorization")))
        return web.json_response(CLAIM)

    app = web.Application()
    app.router.add_get("/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c", claim)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        json.dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "t",
            "clusters": [{"name": "t", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
            "users": [{"name": "t", "user": {"token": "secret-token"}}],
            "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}],
        }, f)
    kube = await Kube.connect(f.name)
    try:
        got = await kube.get_claim("ns", "c")
    finally:
        await kube.close()
        await runner.cleanup()
        os.unlink(f.name)
    print(json.dumps({"claim": got, "seen": seen, "modules": sorted(sys.modules)}))


asyncio.run(main())
"""


def run_python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_plugin_makes_a_request_without_the_generated_client_or_the_sync_one() -> None:
    out = json.loads(run_python(PLUGIN_AND_ONE_REQUEST))
    assert out["claim"]["metadata"]["uid"] == "u-1"
    assert out["seen"] == [
        ["GET", "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c", "Bearer secret-token"]
    ]
    loaded = [m for m in out["modules"] if m.startswith(NOT_IN_THE_PLUGIN)]
    assert loaded == []
    assert "kubernetes.aio.client.api_client" in out["modules"]


def test_other_code_in_the_process_still_gets_the_whole_client() -> None:
    out = run_python(
        """
        import dra_gpu.kube.official_client
        import kubernetes
        from kubernetes import client, config
        from kubernetes.aio.client import ApiClient, CoreV1Api, V1ObjectMeta
        import kubernetes.aio

        assert ApiClient is dra_gpu.kube.official_client.ApiClient
        assert client.CoreV1Api.__module__ == "kubernetes.client.api.core_v1_api"
        assert callable(config.load_kube_config)
        assert V1ObjectMeta(name="x").name == "x" and CoreV1Api.__name__ == "CoreV1Api"
        assert kubernetes.aio.watch.Watch
        print(kubernetes.__version__)
        """
    )
    assert out.strip().startswith("37.")


def test_a_client_imported_first_is_left_as_it_is() -> None:
    out = run_python(
        """
        import kubernetes.aio.client
        before = kubernetes.aio.client
        import dra_gpu.kube.official_client
        assert kubernetes.aio.client is before
        assert dra_gpu.kube.official_client.ApiClient is kubernetes.aio.client.ApiClient
        print("ok")
        """
    )
    assert out.strip() == "ok"
