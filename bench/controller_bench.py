"""Controller benchmarks: webhook latency at a fixed arrival rate, and `explain` on a large cluster.

    .venv/bin/python bench/controller_bench.py [--rate 200] [--seconds 15] [--nodes 125,500] [--exe PATH]

1. Webhook: `dra-gpu controller --no-watch -f cluster.yaml` runs as its own process over HTTPS with
   1,000 published devices (125 hgx-2x4 nodes; every GPU of the first half of the nodes in use),
   and again with 4,000 (500 nodes). AdmissionReviews for a claim with three selectors (memory,
   driver version, product) plus an NVLink constraint arrive open-loop (bench/open_loop.py): request
   i is due at i / rate whatever came before it, goes out on an idle keep-alive connection (a new one
   when none is idle), and its latency runs from its due time to its answer, so a stall counts for
   every request that arrives during it (no coordinated omission). The first (cold) request is
   reported on its own, and so is a warm-up second at the same rate (`--warmup`): the new
   connections, and each review worker's first evaluation of the claim's selectors (tens of ms at
   4,000 devices), are a start-up cost, not the steady rate's. A 429 (the webhook shedding reviews
   over its in-flight limit; the apiserver retries them) is counted, not an error. The CPU per
   review of the webhook's main process (event loop, HTTP, TLS) and of its other processes (the
   review workers) is measured over the timed requests: unlike latency it hardly depends on what
   else the machine runs. `--exe` runs another checkout's `dra-gpu` (a before/after pair).
2. explain: 100 nodes x 8 GPUs, 20 claims, in-process and through the CLI.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import resource
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simnode.fake import discover_node  # noqa: E402

from bench.open_loop import open_loop  # noqa: E402
from dra_gpu.node.slices import build_slices  # noqa: E402
from tests.controller.objects import GPU_CLASS, NVLINK, allocated, claim  # noqa: E402
from tests.controller.test_webhook import make_cert  # noqa: E402

D = 'device.attributes["gpu.dra-gpu.io"]'
C = 'device.capacity["gpu.dra-gpu.io"]'
SELECTORS = [
    f'{C}.memory.compareTo(quantity("40Gi")) >= 0',
    f'{D}.driverVersion.isGreaterThan(semver("550.0.0"))',
    f'{D}.productName.startsWith("NVIDIA H100")',
]


def cluster(nodes: int, busy_nodes: int) -> list[dict[str, Any]]:
    base = build_slices(discover_node("node-000", "hgx-2x4"))
    docs: list[dict[str, Any]] = []
    text = json.dumps(base)
    for i in range(nodes):
        node = f"node-{i:03d}"
        slices = json.loads(text.replace("node-000", node))
        docs += slices
        if i < busy_nodes:
            docs.append(allocated(f"busy-{i}", node, [d["name"] for d in slices[0]["spec"]["devices"]]))
    return [*docs, GPU_CLASS]


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def cpu_s(pid: int) -> float:
    """User + system CPU of one process, in seconds (/proc/<pid>/stat); 0 once it has gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (the fork server, the review template and its workers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def tree_cpu(pid: int) -> tuple[float, dict[int, float]]:
    """CPU of the main process, and of each of its descendants."""
    return cpu_s(pid), {p: cpu_s(p) for p in descendants(pid)}


def connect_when_healthy(port: int, ctx: ssl.SSLContext, timeout: float) -> http.client.HTTPSConnection:
    """A keep-alive connection to the webhook on 127.0.0.1:port once its /healthz answers (60 s)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=timeout)
            conn.request("GET", "/healthz")
            conn.getresponse().read()
            return conn
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def bench_webhook(rate: int, seconds: int, nodes: int, exe: str, warmup_s: float) -> None:
    tmp = Path(tempfile.mkdtemp())
    cert, key = make_cert(tmp, "bench")
    docs = cluster(nodes, nodes // 2)
    (tmp / "cluster.yaml").write_text(yaml.safe_dump_all(docs))
    devices = sum(len(d["spec"]["devices"]) for d in docs if d.get("kind") == "ResourceSlice")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            exe,
            "controller",
            "--cert",
            str(cert),
            "--key",
            str(key),
            "--address",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-watch",
            "-f",
            str(tmp / "cluster.yaml"),
        ],
        stderr=subprocess.DEVNULL,
    )
    try:
        ctx = ssl.create_default_context(cafile=str(cert))
        conn = connect_when_healthy(port, ctx, timeout=10)
        obj = claim("bench", 2, selectors=SELECTORS, constraints=NVLINK)
        body = json.dumps(
            {
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "request": {
                    "uid": "bench",
                    "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"},
                    "operation": "CREATE",
                    "object": obj,
                },
            }
        ).encode()

        t0 = time.perf_counter()
        conn.request("POST", "/validate", body, {"Content-Type": "application/json"})
        first = json.loads(conn.getresponse().read())["response"]
        cold = (time.perf_counter() - t0) * 1000
        assert first["allowed"], first
        conn.close()

        def allowed(i: int, status: int, payload: bytes) -> None:
            # 429: the webhook shed the review (max_in_flight); the apiserver would retry it. Counted.
            if status == 429:
                return
            if status != 200 or not json.loads(payload)["response"]["allowed"]:
                raise SystemExit(f"review {i}: HTTP {status}: {payload[:500]!r}")

        main_before, others_before = tree_cpu(proc.pid)
        result = asyncio.run(
            open_loop(
                "127.0.0.1",
                port,
                ctx,
                rate,
                seconds,
                lambda i: ("POST", "/validate", body),
                allowed,
                warmup_s=warmup_s,
            )
        )
        main_after, others_after = tree_cpu(proc.pid)
        lat = result.latency_ms["/validate"]
        main_ms = (main_after - main_before) * 1000 / len(lat)
        # Processes that went during the run (a replaced worker) are not counted.
        others = sum(cpu - others_before.get(p, 0.0) for p, cpu in others_after.items())
        workers_ms = others * 1000 / len(lat)
        load = os.getloadavg()
        print(
            f"webhook: {devices} devices on {nodes} nodes ({nodes // 2} fully in use), claim with "
            f"{len(SELECTORS)} selectors + NVLink constraint; load average {load[0]:.2f} {load[1]:.2f}"
        )
        print(f"  cold first request: {cold:.2f} ms")
        if warmup_s:
            warm = result.warmup_ms.get("/validate", [0.0])
            print(
                f"  warm-up, {rate}/s for {warmup_s:g} s (not in the figures below): {len(warm)} reviews, "
                f"p99 {pct(warm, 99):.2f} ms, max {max(warm):.2f} ms"
            )
        shed = result.statuses[("/validate", 429)]
        print(
            f"  open loop, {rate}/s for {seconds} s: {len(lat)} reviews in {result.elapsed_s:.1f} s, "
            f"latency from the intended send time: p50 {pct(lat, 50):.2f} ms, p90 {pct(lat, 90):.2f} ms, "
            f"p99 {pct(lat, 99):.2f} ms, max {max(lat):.2f} ms; {result.connections} connections; "
            f"the client sent at most {result.max_send_lag_ms:.2f} ms late; {shed} answered 429 (shed)"
        )
        print(f"  CPU per review: main process {main_ms:.2f} ms, review workers {workers_ms:.2f} ms")
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def explain_claims() -> list[dict[str, Any]]:
    """The 20 claims of the explain bench: 4 kinds, the fourth never fits."""
    claims = []
    for i in range(20):
        kind = i % 4
        if kind == 0:
            claims.append(claim(f"c{i}", 4, constraints=NVLINK))
        elif kind == 1:
            claims.append(claim(f"c{i}", 4))
        elif kind == 2:
            claims.append(claim(f"c{i}", 2, selectors=SELECTORS, constraints=NVLINK))
        else:
            claims.append(claim(f"c{i}", 5, constraints=NVLINK))  # never fits: scans every node
    return claims


def bench_explain(nodes: int) -> None:
    from dra_gpu.controller.commands import explain_inputs
    from dra_gpu.controller.inputs import Inputs

    docs = cluster(nodes, nodes // 2)
    claims = explain_claims()
    inputs = Inputs()
    for d in [*docs, *claims]:
        inputs.add(d, "bench")
    t0, c0 = time.perf_counter(), time.process_time()
    result = explain_inputs(inputs)["claims"]
    in_process, in_process_cpu = time.perf_counter() - t0, time.process_time() - c0
    ok = sum(c["allocatable"] for c in result)
    tmp = Path(tempfile.mkdtemp())
    (tmp / "all.yaml").write_text(yaml.safe_dump_all([*docs, *claims]))
    exe = shutil.which("dra-gpu") or str(Path(sys.executable).with_name("dra-gpu"))
    t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        [exe, "explain", "-f", str(tmp / "all.yaml"), "-o", "json"],
        capture_output=True,
        check=True,
        text=True,
    )
    cli = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cli_cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)  # the CLI and its forks
    assert len(json.loads(out.stdout)["claims"]) == 20
    shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"explain: {nodes} nodes x 8 GPUs ({nodes // 2} nodes fully in use), 20 claims ({ok} allocatable): "
        f"in-process {in_process * 1000:.0f} ms ({in_process * 1000 / 20:.1f} ms/claim, "
        f"CPU {in_process_cpu * 1000:.0f} ms); CLI incl. start-up and YAML parsing {cli:.2f} s "
        f"(CPU {cli_cpu:.2f} s)"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rate", type=int, default=200)
    p.add_argument("--seconds", type=int, default=15)
    p.add_argument(
        "--warmup", type=float, default=1.0, help="seconds at the rate before the timed ones (reported apart)"
    )
    p.add_argument("--nodes", default="125,500", help="webhook: one run per node count (8 devices a node)")
    p.add_argument("--explain-nodes", type=int, default=100)
    p.add_argument("--no-explain", action="store_true", help="the webhook only")
    p.add_argument(
        "--exe",
        default=shutil.which("dra-gpu") or str(Path(sys.executable).with_name("dra-gpu")),
        help="the dra-gpu to run (another checkout's, for a before/after pair)",
    )
    args = p.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    for nodes in args.nodes.split(","):
        bench_webhook(args.rate, args.seconds, int(nodes), args.exe, args.warmup)
    if args.no_explain:
        return
    bench_explain(args.explain_nodes)


if __name__ == "__main__":
    main()
