"""Webhook latency while hostile reviews run: normal reviews and /healthz arriving open-loop at a
fixed rate (bench/open_loop.py: latency from each request's intended send time, so a stall counts
for every request due during it) while another connection sends, back to back, claims whose
selector doubles a string with `cel.bind` (seconds and gigabytes per device if evaluated to the end).

    .venv/bin/python bench/webhook_hostile_bench.py [--seconds 20] [--rate 100] [--nodes 8]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.controller_bench import SELECTORS, cluster, connect_when_healthy, pct  # noqa: E402
from bench.open_loop import open_loop  # noqa: E402
from tests.controller.objects import NVLINK, claim  # noqa: E402
from tests.controller.test_webhook import make_cert  # noqa: E402


def doubling_selector(levels: int) -> str:
    """`cel.bind(v0, device.driver + device.driver, cel.bind(v1, v0 + v0, ...)) .size() > 0`."""
    body = f"v{levels - 1}.size() > 0"
    for i in reversed(range(levels)):
        prev = "device.driver" if i == 0 else f"v{i - 1}"
        body = f"cel.bind(v{i}, {prev} + {prev}, {body})"
    return body


def cpu_s(pid: int) -> float:
    """User + system CPU of one process, in seconds (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def review(obj: dict[str, Any], uid: str) -> bytes:
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": uid,
                "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"},
                "operation": "CREATE",
                "object": obj,
            },
        }
    ).encode()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--rate", type=int, default=100)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--no-hostile", action="store_true", help="the baseline: normal reviews only")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    cert, key = make_cert(tmp, "bench")
    (tmp / "cluster.yaml").write_text(yaml.safe_dump_all(cluster(args.nodes, args.nodes // 2)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("dra-gpu") or str(Path(sys.executable).with_name("dra-gpu"))
    cmd = [exe, "controller", "--cert", str(cert), "--key", str(key), "--address", "127.0.0.1"]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--no-watch", "-f", str(tmp / "cluster.yaml")], stderr=subprocess.DEVNULL
    )
    ctx = ssl.create_default_context(cafile=str(cert))
    stop = threading.Event()
    hostile: list[tuple[float, str]] = []
    try:
        conn = connect_when_healthy(port, ctx, timeout=30)
        normal = review(claim("normal", 2, selectors=SELECTORS, constraints=NVLINK), "normal")
        bad = review(claim("hostile", selectors=[doubling_selector(26)]), "hostile")

        def attack() -> None:
            c = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=60)
            while not stop.is_set():
                t0 = time.perf_counter()
                c.request("POST", "/validate", bad, {"Content-Type": "application/json"})
                r = json.loads(c.getresponse().read())["response"]
                msg = "allowed" if r["allowed"] else r["status"]["message"]
                hostile.append(((time.perf_counter() - t0) * 1000, msg))

        conn.request("POST", "/validate", normal, {"Content-Type": "application/json"})
        assert json.loads(conn.getresponse().read())["response"]["allowed"]
        conn.close()

        def request(i: int) -> tuple[str, str, bytes | None]:
            return ("GET", "/healthz", None) if i % 10 == 9 else ("POST", "/validate", normal)

        def check(i: int, status: int, payload: bytes) -> None:
            if status != 200 or (i % 10 != 9 and not json.loads(payload)["response"]["allowed"]):
                raise SystemExit(f"request {i}: HTTP {status}: {payload[:500]!r}")

        cpu_before = cpu_s(proc.pid)
        attacker = threading.Thread(target=attack, daemon=True)
        if not args.no_hostile:
            attacker.start()
        time.sleep(0.5)  # the first hostile review is running
        result = asyncio.run(open_loop("127.0.0.1", port, ctx, args.rate, args.seconds, request, check))
        lat, health = result.latency_ms["/validate"], result.latency_ms["/healthz"]
        elapsed = result.elapsed_s
        cpu = cpu_s(proc.pid) - cpu_before
        stop.set()
        if attacker.is_alive():
            attacker.join(60)
        print(
            f"webhook under hostile reviews: {args.nodes} hgx-2x4 nodes, normal claim with "
            f"{len(SELECTORS)} selectors + NVLink, {args.rate}/s open-loop for {elapsed:.1f} s "
            f"({result.connections} connections); load average {os.getloadavg()[0]:.2f}"
        )
        print(
            f"  normal reviews: {len(lat)}, p50 {pct(lat, 50):.2f} ms, p99 {pct(lat, 99):.2f} ms, "
            f"max {max(lat):.2f} ms"
        )
        # The event loop's process only: what it spends on replacements is taken from normal reviews.
        print(f"  webhook main process CPU: {cpu:.2f} s ({cpu / elapsed * 100:.0f}% of a core)")
        print(f"  /healthz: {len(health)}, p99 {pct(health, 99):.2f} ms, max {max(health):.2f} ms")
        times = [t for t, _ in hostile] or [0.0]
        verdicts = sorted({m for _, m in hostile})
        print(f"  hostile reviews: {len(hostile)}, each answered in {min(times):.0f}-{max(times):.0f} ms")
        for v in verdicts:
            print(f"    {v}")
    finally:
        stop.set()
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
