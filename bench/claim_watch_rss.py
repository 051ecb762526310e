"""The kubelet plugin's memory against the cluster's ResourceClaims: the real `dra-gpu kubelet-plugin`
process (the claim watch on, as by default) lists N claims of the largest size the apiserver
stores, all but 8 of them allocated on other nodes.

What is measured: the plugin process's resident memory (/proc/PID/status), not an estimate of the
claim cache's: VmRSS once its slices are published and before the claim list is answered (the
floor), the peak while it lists (VmHWM, reset with /proc/PID/clear_refs when the list begins), and
VmRSS once it logged `claims listed`. A plugin whose RSS passes --cap-mb is killed there (so that
today's main, which reads the whole list at once, does not take the machine down): its peak is
then "over the cap". Its list must also end within --list-timeout seconds.

The claims: a ResourceClaim is bounded by etcd's request limit (1.5 MiB by default) long before
its validation limits (32 requests x 32 selectors x 10 KiB of CEL alone is 10 MiB). The claim
here is ~1.47 MB of JSON: 32 requests with 4 CEL selectors of 10,000 characters each, 8 opaque
configs of 10,000 bytes (copied into status.allocation, as the scheduler does), 32 results and 32
reservedFor entries. One pre-encoded claim is copied for each (name, uid and node substituted),
so the stand-in's own cost stays small.

The stand-in apiserver (HTTPS on 127.0.0.1, bench/plugin_rss.py's, in this process) pages the claim
list as the apiserver does when asked (`limit` / `continue`) and sends it whole otherwise, streamed.

Run (root: the simulated node's device nodes): .venv/bin/python bench/claim_watch_rss.py
[--counts 1000,5000,20000] [--cap-mb 4096]. The plugin runs from the current directory's
`dra_gpu` (`python -m`), so the same script and .venv measure another checkout (e.g. main's:
`git archive main | tar -x -C DIR`, its gRPC stubs made with `python -m
dra_gpu.kubeletplugin.gen_protos`, then `cd DIR && /path/to/.venv/bin/python /path/to/bench/...`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
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

from bench.plugin_rss import StandInApiServer, bench_node, start_plugin  # noqa: E402
from bench.prepare_bench import OURS  # noqa: E402
from tests.controller.test_webhook import make_cert, serve_tls  # noqa: E402

NODE = "bench-node"
MINE = 8  # claims allocated on the bench node, whatever the cluster's size
REQUESTS, SELECTORS, CEL_CHARS = 32, 4, 10_000
CONFIGS, PARAMETER_BYTES = 8, 10_000


def largest_claim() -> bytes:
    """One claim of about the largest size the apiserver stores, with @@NAME@@, @@UID@@ and
    @@NODE@@ to substitute."""
    requests = [
        {
            "name": f"request-{r}",
            "exactly": {
                "deviceClassName": OURS,
                "selectors": [
                    {"cel": {"expression": f'device.attributes["{OURS}"].productName == "{pad}"'}}
                    for pad in (f"{r}-{s}-".ljust(CEL_CHARS - 60, "x") for s in range(SELECTORS))
                ],
                "allocationMode": "ExactCount",
                "count": 1,
            },
        }
        for r in range(REQUESTS)
    ]
    configs = [
        {
            "requests": [f"request-{c}"],
            "opaque": {
                "driver": "other.example.com",
                "parameters": {
                    "apiVersion": "example.com/v1",
                    "kind": "Config",
                    "pad": "p" * PARAMETER_BYTES,
                },
            },
        }
        for c in range(CONFIGS)
    ]
    node = "@@NODE@@"
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": "@@NAME@@",
            "namespace": "tenant",
            "uid": "@@UID@@",
            "resourceVersion": "7",
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {"devices": {"requests": requests, "config": configs}},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": f"request-{r}", "driver": OURS, "pool": node, "device": f"gpu-{r}"}
                        for r in range(REQUESTS)
                    ],
                    "config": [{**c, "source": "FromClaim"} for c in configs],
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                    ]
                },
                "allocationTimestamp": "2026-01-01T00:00:01Z",
            },
            "reservedFor": [
                {"resource": "pods", "name": f"pod-{p}", "uid": f"00000000-0000-0000-0000-{p:012d}"}
                for p in range(32)
            ],
        },
    }
    return json.dumps(claim, separators=(",", ":")).encode()


class ClusterOfClaims(StandInApiServer):
    """The stand-in with `count` large claims, `MINE` of them on the bench node; the claim list is
    answered once `release` is set."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count
        self.template = largest_claim()
        self.release = asyncio.Event()
        self.bytes_sent = 0
        self.pages = 0
        self._mine = {i * count // MINE for i in range(MINE)} if count >= MINE else set(range(count))

    def claim(self, i: int) -> bytes:
        node = NODE if i in self._mine else f"node-{i % 500}"
        return (
            self.template.replace(b"@@NAME@@", f"claim-{i:06d}".encode())
            .replace(b"@@UID@@", str(uuid.UUID(int=i)).encode())
            .replace(b"@@NODE@@", node.encode())
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        listing = request.method == "GET" and request.query.get("watch") != "true"
        if listing and request.path.endswith("/resourceclaims"):
            return await self.list_claims(request)
        return await super().handle(request)

    async def list_claims(self, request: web.Request) -> web.StreamResponse:
        await self.release.wait()
        self.pages += 1
        start = int(request.query.get("continue") or 0)
        limit = int(request.query.get("limit") or 0)
        end = min(self.count, start + limit) if limit else self.count
        meta: dict[str, Any] = {"resourceVersion": "1000"}
        if end < self.count:
            meta["continue"] = str(end)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        head = {"kind": "ResourceClaimList", "apiVersion": "resource.k8s.io/v1", "metadata": meta}
        with contextlib.suppress(ConnectionResetError):  # the plugin gave up (its deadline)
            await self._send(response, json.dumps(head).encode()[:-1] + b',"items":[')
            for i in range(start, end):
                await self._send(response, (b"," if i > start else b"") + self.claim(i))
            await self._send(response, b"]}")
            await response.write_eof()
        return response

    async def _send(self, response: web.StreamResponse, data: bytes) -> None:
        self.bytes_sent += len(data)
        await response.write(data)


@dataclass(frozen=True)
class Result:
    claims: int
    served_mb: float
    pages: int
    floor_mb: float
    peak_mb: float | None  # None: killed at the cap
    after_mb: float | None
    seconds: float
    outcome: str


def status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


async def one_run(
    tmp: Path, driver_root: str, profile: Path, count: int, cap_mb: float, list_timeout: float
) -> Result:
    cert, key = make_cert(tmp, "stand-in-apiserver")
    api = ClusterOfClaims(count)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", api.handle)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1)
    port = await serve_tls(runner, cert, key)
    log_path = tmp / "plugin.log"
    log_path.unlink(missing_ok=True)
    proc, plugin_dir, log = await start_plugin(tmp, port, cert, driver_root, profile)
    try:
        t0 = time.monotonic()
        while api.slices_applied == 0 or not (plugin_dir / "dra.sock").exists():
            if proc.returncode is not None or time.monotonic() - t0 > 60:
                raise SystemExit(log_path.read_text()[-4000:])
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.0)  # the start-up's garbage collected, the threads started
        floor = status_kb(proc.pid, "VmRSS") / 1024
        Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM from here on
        api.release.set()
        start = time.monotonic()
        outcome = "listed"
        while "claims listed allocated_here=" not in log_path.read_text(errors="replace"):
            if proc.returncode is not None:
                raise SystemExit(log_path.read_text()[-4000:])
            if status_kb(proc.pid, "VmRSS") / 1024 > cap_mb:
                outcome = f"killed over the {cap_mb:.0f} MB cap"
                break
            if time.monotonic() - start > list_timeout:
                outcome = f"not listed in {list_timeout:.0f} s"
                break
            await asyncio.sleep(0.1)
        seconds = time.monotonic() - start
        over = outcome.startswith("killed")
        peak = None if over else status_kb(proc.pid, "VmHWM") / 1024
        after = None if over else status_kb(proc.pid, "VmRSS") / 1024
        kept = re.findall(r"claims listed allocated_here=(\d+)", log_path.read_text(errors="replace"))
        if kept and kept[-1] != str(min(MINE, count)):
            raise SystemExit(f"the plugin kept {kept[-1]} claims, not the node's {min(MINE, count)}")
        return Result(count, api.bytes_sent / 1e6, api.pages, floor, peak, after, seconds, outcome)
    finally:
        proc.kill()
        await asyncio.wait_for(proc.wait(), timeout=20)
        log.close()
        with contextlib.suppress(Exception):
            await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--counts", default="1000,5000,20000", help="claims in the cluster, comma-separated")
    parser.add_argument("--cap-mb", type=float, default=4096, help="kill the plugin over this RSS")
    parser.add_argument("--list-timeout", type=float, default=900, help="seconds for the claim list")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dra-claim-rss-"))
    driver_root, profile = bench_node(tmp)
    print(f"one claim: {len(largest_claim()) / 1e6:.2f} MB of JSON; {MINE} claims on this node", flush=True)
    print("claims  served MB  pages  floor MB  peak MB  after MB  seconds  outcome", flush=True)
    for count in (int(c) for c in args.counts.split(",")):
        r = asyncio.run(one_run(tmp, driver_root, profile, count, args.cap_mb, args.list_timeout))
        peak = f"{r.peak_mb:7.1f}" if r.peak_mb is not None else f">{args.cap_mb:6.0f}"
        after = f"{r.after_mb:8.1f}" if r.after_mb is not None else "       -"
        print(
            f"{r.claims:6d}  {r.served_mb:9.0f}  {r.pages:5d}  {r.floor_mb:8.1f}  {peak}  {after}  "
            f"{r.seconds:7.1f}  {r.outcome}",
            flush=True,
        )


if __name__ == "__main__":
    main()
