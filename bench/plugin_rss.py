"""The kubelet plugin's memory floor without a cluster: the real `dra-gpu kubelet-plugin` process on
the prepare bench's node (112 MIG devices, bench/prepare_bench.py's profile), its slices published,
before any claim (prepare_bench.py's RSS0).

Its apiserver is a stand-in on 127.0.0.1 (plain HTTP, aiohttp.web, in this process) that answers
what the plugin asks at start: lists are empty, watches stay open and quiet, applies are echoed
back with a resourceVersion. Prints VmRSS, its anonymous and file-backed parts (/proc/PID/smaps,
see bench/process_memory.py), the largest mappings and the plugin's thread count.

The plugin runs from the current directory's `dra_gpu` (`python -m`), so the same script and
.venv measure another checkout: `cd ../other && /path/to/.venv/bin/python /path/to/bench/plugin_rss.py`.

Run: .venv/bin/python bench/plugin_rss.py [--runs 3] [--settle 2] [--top 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.prepare_bench import bench_profile  # noqa: E402
from bench.process_memory import Memory, memory  # noqa: E402


class StandInApiServer:
    """Just enough of an apiserver for the plugin to start and publish its slices."""

    def __init__(self) -> None:
        self.version = 1
        self.slices_applied = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.version += 1
        if request.method == "GET" and request.query.get("watch") == "true":
            response = web.StreamResponse()
            await response.prepare(request)
            await asyncio.sleep(float(request.query.get("timeoutSeconds", "300")))
            return response
        if request.method == "GET":
            if re.search(r"/(namespaces/[^/]+/)?[a-z]+$", request.path):
                return web.json_response({"items": [], "metadata": {"resourceVersion": str(self.version)}})
            return web.json_response({"kind": "Status", "code": 404, "message": "not found"}, status=404)
        if request.method in ("PATCH", "POST", "PUT"):
            body: dict[str, Any] = json.loads(await request.read() or b"{}")
            body.setdefault("metadata", {})["resourceVersion"] = str(self.version)
            if "/resourceslices/" in request.path:
                self.slices_applied += 1
            return web.json_response(body)
        return web.json_response({"kind": "Status", "status": "Success"})


async def one_run(tmp: Path, driver_root: str, profile: Path, settle: float, top: int) -> Memory:
    api = StandInApiServer()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", api.handle)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    kubeconfig = tmp / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "bench",
                "clusters": [{"name": "bench", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "bench", "user": {"token": "bench"}}],
                "contexts": [{"name": "bench", "context": {"cluster": "bench", "user": "bench"}}],
            }
        )
    )
    plugin_dir = Path(tempfile.mkdtemp(prefix="plugin-", dir=tmp))
    log = open(tmp / "plugin.log", "ab")  # noqa: SIM115 - the child writes it until it ends
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "dra_gpu.cli",
        "kubelet-plugin",
        "--kubeconfig",
        str(kubeconfig),
        "--node-name",
        "bench-node",
        "--profile",
        str(profile),
        "--driver-root",
        driver_root,
        "--cdi-dir",
        str(plugin_dir / "cdi"),
        "--plugin-dir",
        str(plugin_dir),
        "--registry-dir",
        str(plugin_dir / "registry"),
        "--http-address",
        "",
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        t0 = time.monotonic()
        while api.slices_applied == 0 or not (plugin_dir / "dra.sock").exists():
            if proc.returncode is not None or time.monotonic() - t0 > 60:
                raise SystemExit((tmp / "plugin.log").read_text()[-4000:])
            await asyncio.sleep(0.05)
        await asyncio.sleep(settle)  # the start-up's garbage collected, the threads started
        return memory(proc.pid, top)
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), timeout=20)
        log.close()
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--settle", type=float, default=2.0, help="seconds after the slices are published")
    parser.add_argument("--top", type=int, default=8, help="largest mappings to print")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dra-rss-"))
    profile = tmp / "bench-node.yaml"
    bench_profile(profile)
    cache = Path(os.environ.get("DRA_GPU_CACHE", Path.home() / ".cache" / "dra-gpu"))
    simdriver = [sys.executable, str(ROOT / "e2e" / "simdriver" / "build.py"), "--profile", str(profile)]
    driver_root = subprocess.run(
        [*simdriver, "--cache", str(cache)], check=True, capture_output=True, text=True
    ).stdout.split()[-1]
    runs = [asyncio.run(one_run(tmp, driver_root, profile, args.settle, args.top)) for _ in range(args.runs)]
    for r in runs:
        print(f"plugin RSS once its slices were published: {r}, {r.threads} threads")
    print(f"median {statistics.median(r.rss_mb for r in runs):.1f} MB; largest mappings of the last run:")
    for name, mb in runs[-1].by_mapping:
        print(f"  {mb:6.1f} MB  {name}")


if __name__ == "__main__":
    main()
