"""The kubelet plugin's memory floor without a cluster: the real `dra-gpu kubelet-plugin` process on
the prepare bench's node (112 MIG devices, bench/prepare_bench.py's profile), its slices published,
before any claim (prepare_bench.py's RSS0).

Its apiserver is a stand-in on 127.0.0.1 (HTTPS, aiohttp.web, in this process) that answers
what the plugin asks at start: lists are empty, watches stay open and quiet, applies are echoed
back with a resourceVersion. Prints VmRSS, its anonymous and file-backed parts (/proc/PID/smaps,
see bench/process_memory.py), the largest mappings and the plugin's thread count.

The plugin runs from the current directory's `dra_gpu` (`python -m`), so the same script and
.venv measure another checkout: `cd ../other && /path/to/.venv/bin/python /path/to/bench/plugin_rss.py`.

With --burst it then drives prepare_bench.py's load over dra.sock (one-claim rounds, then bursts of
100 concurrent prepares and unprepares) with the claims served by the stand-in's claim list and
watch (status writes come back as MODIFIED events, over TLS as from an apiserver), and prints RSS
right after the run and after 3 s without requests: prepare_bench.py's "RSS after the run".

Run: .venv/bin/python bench/plugin_rss.py [--runs 3] [--settle 2] [--top 8] [--burst [--rounds 200]]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.prepare_bench import IDLE_SECONDS, OURS, bench_profile, measure  # noqa: E402
from bench.process_memory import Memory, memory  # noqa: E402
from tests.controller.test_webhook import make_cert, serve_tls  # noqa: E402


class StandInApiServer:
    """Just enough of an apiserver for the plugin to start, publish its slices and, for a burst,
    read its claims from its claim watch: `add_claims` sends them to the open claim watches."""

    def __init__(self) -> None:
        self.version = 1
        self.slices_applied = 0
        self.devices: list[str] = []  # those of the applied slices
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self._claim_watches: list[asyncio.Queue[dict[str, Any]]] = []

    def add_claims(self, claims: list[dict[str, Any]]) -> None:
        for claim in claims:
            meta = claim["metadata"]
            self.claims[meta["namespace"], meta["name"]] = claim
            for queue in self._claim_watches:
                queue.put_nowait({"type": "ADDED", "object": claim})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.version += 1
        claims = request.path.endswith("/resourceclaims")
        if request.method == "GET" and request.query.get("watch") == "true":
            response = web.StreamResponse()
            await response.prepare(request)
            queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
            if claims:
                self._claim_watches.append(queue)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(float(request.query.get("timeoutSeconds", "300"))):
                    while True:
                        await response.write(json.dumps(await queue.get()).encode() + b"\n")
            return response
        if request.method == "GET":
            if claims:
                items = list(self.claims.values())
                return web.json_response({"items": items, "metadata": {"resourceVersion": str(self.version)}})
            if re.search(r"/(namespaces/[^/]+/)?[a-z]+$", request.path):
                return web.json_response({"items": [], "metadata": {"resourceVersion": str(self.version)}})
            found = re.search(r"/namespaces/([^/]+)/resourceclaims/([^/]+)$", request.path)
            if found and (found[1], found[2]) in self.claims:
                return web.json_response(self.claims[found[1], found[2]])
            return web.json_response({"kind": "Status", "code": 404, "message": "not found"}, status=404)
        if request.method in ("PATCH", "POST", "PUT"):
            body: dict[str, Any] = json.loads(await request.read() or b"{}")
            body.setdefault("metadata", {})["resourceVersion"] = str(self.version)
            if "/resourceslices/" in request.path:
                self.slices_applied += 1
                self.devices += [d["name"] for d in body.get("spec", {}).get("devices", [])]
            found = re.search(r"/namespaces/([^/]+)/resourceclaims/([^/]+)/status$", request.path)
            if found and (found[1], found[2]) in self.claims:
                # A status write changes the claim: the watches get it back, as from an apiserver.
                claim = self.claims[found[1], found[2]]
                claim = {**claim, "status": {**claim["status"], **body.get("status", {})}}
                claim["metadata"] = {**claim["metadata"], "resourceVersion": str(self.version)}
                self.claims[found[1], found[2]] = claim
                for queue in self._claim_watches:
                    queue.put_nowait({"type": "MODIFIED", "object": claim})
                return web.json_response(claim)
            return web.json_response(body)
        return web.json_response({"kind": "Status", "status": "Success"})


def allocated_claims(devices: list[str], node: str, driver: str) -> list[dict[str, Any]]:
    """One claim per device, allocated on `node` and reserved for a pod, as the scheduler leaves it."""
    return [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": f"bench-{i}", "namespace": "bench", "uid": str(uuid.uuid4())},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": driver}}]}},
            "status": {
                "allocation": {
                    "devices": {"results": [{"request": "gpu", "driver": driver, "pool": node, "device": d}]},
                    "nodeSelector": {
                        "nodeSelectorTerms": [
                            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                        ]
                    },
                },
                "reservedFor": [{"resource": "pods", "name": "bench-holder", "uid": str(uuid.uuid4())}],
            },
        }
        for i, d in enumerate(devices)
    ]


@dataclass(frozen=True)
class Burst:
    rounds: int
    inflight: int
    bursts: int


@dataclass(frozen=True)
class RunMemory:
    floor: Memory
    after: Memory | None = None  # right after the burst's last request
    idle: Memory | None = None  # after IDLE_SECONDS without requests
    timing: dict[str, float] | None = None


async def start_plugin(
    tmp: Path, port: int, cert: Path, driver_root: str, profile: Path, *extra: str
) -> tuple[asyncio.subprocess.Process, Path, Any]:
    """`dra-gpu kubelet-plugin` (of the current directory's `dra_gpu`) on the bench node, talking to
    the stand-in apiserver on `port`; its process, plugin directory and open log (tmp/plugin.log)."""
    kubeconfig = tmp / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "bench",
                "clusters": [
                    {
                        "name": "bench",
                        "cluster": {
                            "server": f"https://127.0.0.1:{port}",
                            "certificate-authority": str(cert),
                        },
                    }
                ],
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
        *extra,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return proc, plugin_dir, log


def bench_node(tmp: Path) -> tuple[str, Path]:
    """The bench node's profile (prepare_bench.py's) in `tmp` and its simulated driver root (built
    once, cached)."""
    profile = tmp / "bench-node.yaml"
    bench_profile(profile)
    cache = Path(os.environ.get("DRA_GPU_CACHE", Path.home() / ".cache" / "dra-gpu"))
    simdriver = [
        sys.executable,
        str(ROOT / "e2e" / "node" / "simdriver" / "build.py"),
        "--profile",
        str(profile),
    ]
    driver_root = subprocess.run(
        [*simdriver, "--cache", str(cache)], check=True, capture_output=True, text=True
    ).stdout.split()[-1]
    return driver_root, profile


async def one_run(
    tmp: Path, driver_root: str, profile: Path, settle: float, top: int, burst: Burst | None
) -> RunMemory:
    cert, key = make_cert(tmp, "stand-in-apiserver")
    api = StandInApiServer()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", api.handle)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1)  # the watches end at once
    # TLS as from an apiserver: each connection's TLS buffers are part of what a burst leaves.
    port = await serve_tls(runner, cert, key)
    proc, plugin_dir, log = await start_plugin(tmp, port, cert, driver_root, profile)
    try:
        t0 = time.monotonic()
        while api.slices_applied == 0 or not (plugin_dir / "dra.sock").exists():
            if proc.returncode is not None or time.monotonic() - t0 > 60:
                raise SystemExit((tmp / "plugin.log").read_text()[-4000:])
            await asyncio.sleep(0.05)
        await asyncio.sleep(settle)  # the start-up's garbage collected, the threads started
        floor = memory(proc.pid, top)
        if burst is None:
            return RunMemory(floor)
        claims = allocated_claims(api.devices, "bench-node", OURS)
        api.add_claims(claims)
        refs = [(c["metadata"]["name"], c["metadata"]["uid"]) for c in claims]
        timing = await measure(
            plugin_dir / "dra.sock", "bench", refs, burst.rounds, burst.inflight, None, burst.bursts
        )
        after = memory(proc.pid, top)
        await asyncio.sleep(IDLE_SECONDS)  # the plugin gives a burst's memory back when idle
        return RunMemory(floor, after, memory(proc.pid, top), timing)
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
    parser.add_argument("--burst", action="store_true", help="then prepare_bench.py's rounds and bursts")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--inflight", type=int, default=100)
    parser.add_argument("--bursts", type=int, default=3)
    args = parser.parse_args()
    burst = Burst(args.rounds, args.inflight, args.bursts) if args.burst else None
    tmp = Path(tempfile.mkdtemp(prefix="dra-rss-"))
    driver_root, profile = bench_node(tmp)
    runs = [
        asyncio.run(one_run(tmp, driver_root, profile, args.settle, args.top, burst))
        for _ in range(args.runs)
    ]
    for r in runs:
        print(f"plugin RSS once its slices were published: {r.floor}, {r.floor.threads} threads")
        if r.after is not None and r.idle is not None and r.timing is not None:
            t = r.timing
            print(
                f"  prepare p50 {t['p50_ms']:.2f} ms, p99 {t['p99_ms']:.2f} ms, "
                f"{t['throughput']:.0f} claims/s ({t['inflight']:.0f} in flight)"
            )
            print(f"  right after the run: {r.after}, {r.after.threads} threads")
            print(f"  after {IDLE_SECONDS:.0f} s without requests: {r.idle}, {r.idle.threads} threads")
    last = runs[-1].idle or runs[-1].floor
    print(f"median {statistics.median(r.floor.rss_mb for r in runs):.1f} MB at the floor", end="")
    if burst is not None:
        print(
            f", {statistics.median(r.idle.rss_mb for r in runs if r.idle):.1f} MB after the run and idle",
            end="",
        )
    print("; largest mappings of the last run, at its end:")
    for name, mb in last.by_mapping:
        print(f"  {mb:6.1f} MB  {name}")


if __name__ == "__main__":
    main()
