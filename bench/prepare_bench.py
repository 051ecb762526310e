"""NodePrepareResources latency and throughput, driven over dra.sock as the kubelet does.

Needs the local e2e cluster (`e2e/cluster up`, root). For dra-gpu and for the peer driver
(upstream's DRA test driver, `e2e/cluster peer-driver start`) in the same run:
  - p50/p99 of NodePrepareResources for one claim (each followed by its unprepare),
  - throughput with 100 claims in flight (100 concurrent one-claim calls),
  - plugin RSS after the run (right after it, and for dra-gpu also after 3 s without requests),
    and (dra-gpu) start-up to slices published.
Claims are real ResourceClaims in the apiserver, pre-allocated and reserved for a (never
scheduled) pod through their status, as the scheduler leaves them, so both plugins do their real
claim read (a GET, or dra-gpu's claim watch) and prepare work.

Run: .venv/bin/python bench/prepare_bench.py [--rounds 200] [--inflight 100] [--bursts 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import yaml
from kubernetes import client, config

from dra_gpu.kubeletplugin._proto import dra_v1_pb2 as pb
from dra_gpu.kubeletplugin._proto import dra_v1_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.process_memory import memory  # noqa: E402

KUBELET_ROOT = Path(os.environ.get("DRA_GPU_E2E_KUBELET_ROOT", "/var/lib/kubelet"))
OURS, PEER = "gpu.dra-gpu.io", "gpu.example.com"
IDLE_SECONDS = 3.0
GROUP, VERSION = "resource.k8s.io", "v1"


def bench_profile(path: Path, gpus: int = 16) -> None:
    """A node with `gpus` A100s split into seven 1g.10gb MIG devices each (112 devices)."""
    profile = {
        "name": "bench",
        "driverVersion": "570.124.06",
        "cudaDriverVersion": 12080,
        "migProfiles": [
            {"name": "1g.10gb", "id": 19, "index": 0, "slices": 1, "memoryMiB": 9856, "multiprocessors": 14}
        ],
        "defaults": {
            "name": "NVIDIA A100-SXM4-80GB",
            "brand": "nvidia",
            "architecture": "ampere",
            "computeCapability": "8.0",
            "memoryMiB": 81920,
        },
        "gpus": [
            {
                "index": i,
                "uuid": f"GPU-{i:08x}-0000-4000-8000-{i:012x}",
                "pciBusId": f"00000000:{0x10 + i:02X}:00.0",
                "mig": {
                    "enabled": True,
                    "instances": [{"profile": "1g.10gb", "placement": p} for p in range(7)],
                },
            }
            for i in range(gpus)
        ],
    }
    path.write_text(yaml.safe_dump(profile))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User + system CPU so far of a process and its threads, or of one of its threads."""
    stat = Path(f"/proc/{pid}/task/{thread}/stat" if thread else f"/proc/{pid}/stat")
    fields = stat.read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pid_of(pattern: str) -> int:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    if not out:
        raise SystemExit(f"no process matches {pattern!r}")
    return int(out[0])


class Cluster:
    def __init__(self) -> None:
        config.load_kube_config()
        self.api = client.ApiClient()
        self.custom = client.CustomObjectsApi(self.api)
        self.core = client.CoreV1Api(self.api)
        self.node = self.core.list_node().items[0].metadata.name
        self.holder: dict[str, str] = {}

    def hold(self, ns: str) -> None:
        """A pod for the claims' `reservedFor`, as the scheduler reserves a claim for its pod before
        the kubelet prepares it. It is never scheduled (no scheduler has its name), so nothing but
        the bench prepares the claims; it exists, so the claim controller keeps the reservations."""
        deadline = time.monotonic() + 30  # a new namespace's default service account comes a moment later
        while not self.core.list_namespaced_service_account(ns, field_selector="metadata.name=default").items:
            if time.monotonic() > deadline:
                raise SystemExit(f"namespace {ns}: no default service account after 30 s")
            time.sleep(0.1)
        pod = self.core.create_namespaced_pod(
            ns,
            client.V1Pod(
                metadata=client.V1ObjectMeta(name="bench-holder"),
                spec=client.V1PodSpec(
                    scheduler_name="bench-never-scheduled",
                    containers=[client.V1Container(name="c", image="registry.k8s.io/pause:3.10")],
                ),
            ),
        )
        self.holder = {"resource": "pods", "name": pod.metadata.name, "uid": pod.metadata.uid}

    def devices(self, driver: str) -> list[str]:
        slices = self.custom.list_cluster_custom_object(
            GROUP, VERSION, "resourceslices", field_selector=f"spec.driver={driver}"
        )["items"]
        return [d["name"] for s in slices for d in s["spec"]["devices"]]

    def allocated_claim(self, ns: str, driver: str, device: str, pool: str) -> tuple[str, str]:
        name = f"bench-{uuid.uuid4().hex[:10]}"
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {
                "devices": {
                    "requests": [{"name": "gpu", "exactly": {"deviceClassName": "bench.example.com"}}]
                }
            },
        }
        claim = self.custom.create_namespaced_custom_object(GROUP, VERSION, ns, "resourceclaims", body)
        claim["status"] = {
            "allocation": {
                "devices": {
                    "results": [{"request": "gpu", "driver": driver, "pool": pool, "device": device}]
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [self.node]}]}
                    ]
                },
            },
            "reservedFor": [self.holder],
        }
        self.custom.replace_namespaced_custom_object_status(GROUP, VERSION, ns, "resourceclaims", name, claim)
        return name, claim["metadata"]["uid"]


def prepare_seconds(port: int) -> tuple[float, float]:
    """(sum, count) of the plugin's own prepare latency histogram: the time inside the plugin."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        for key in ("_sum", "_count"):
            if line.startswith(f'dra_gpu_node_request_duration_seconds{key}{{operation="prepare"}}'):
                values[key] = float(line.split()[-1])
    return values["_sum"], values["_count"]


async def measure(
    sock: Path,
    ns: str,
    claims: list[tuple[str, str]],
    rounds: int,
    inflight: int,
    inside: Callable[[], tuple[float, float]] | None = None,
    bursts: int = 1,
    cpu: Callable[[], float] | None = None,
    loop_cpu: Callable[[], float] | None = None,
) -> dict[str, float]:
    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
        stub = pb_grpc.DRAPluginStub(ch)

        def req(c: tuple[str, str]) -> Any:
            return [pb.Claim(namespace=ns, name=c[0], uid=c[1])]

        async def prepare(c: tuple[str, str]) -> float:
            t = time.perf_counter()
            resp = await stub.NodePrepareResources(pb.NodePrepareResourcesRequest(claims=req(c)), timeout=45)
            took = time.perf_counter() - t
            err = resp.claims[c[1]].error
            if err:
                raise SystemExit(f"prepare failed: {err}")
            return took

        async def unprepare(c: tuple[str, str]) -> None:
            await stub.NodeUnprepareResources(pb.NodeUnprepareResourcesRequest(claims=req(c)), timeout=45)

        for c in claims[:5]:  # warm-up
            await prepare(c)
            await unprepare(c)
        lat = []
        before = inside() if inside else (0.0, 0.0)
        for i in range(rounds):
            c = claims[i % len(claims)]
            lat.append(await prepare(c))
            await unprepare(c)
        after = inside() if inside else (0.0, 0.0)
        lat.sort()
        batch = claims[:inflight]
        walls = []
        cpu_before = cpu() if cpu else 0.0
        loop_before = loop_cpu() if loop_cpu else 0.0
        client_before = time.process_time()
        for _ in range(bursts):
            t = time.perf_counter()
            await asyncio.gather(*(prepare(c) for c in batch))
            walls.append(time.perf_counter() - t)
            await asyncio.gather(*(unprepare(c) for c in batch))
        wall = statistics.median(walls)
        # The plugin's CPU per claim over the bursts (its prepare and its unprepare): what bounds
        # the throughput when the plugin has a core to itself, whatever else shares the machine.
        burst_cpu_ms = (cpu() - cpu_before) / (bursts * len(batch)) * 1e3 if cpu else float("nan")
        loop_cpu_ms = (loop_cpu() - loop_before) / (bursts * len(batch)) * 1e3 if loop_cpu else float("nan")
        client_cpu_ms = (time.process_time() - client_before) / (bursts * len(batch)) * 1e3
        inside_ms = (after[0] - before[0]) / max(after[1] - before[1], 1) * 1e3
        return {
            "mean_ms": statistics.mean(lat) * 1e3,
            "inside_mean_ms": inside_ms if inside else float("nan"),
            "p50_ms": statistics.median(lat) * 1e3,
            "p99_ms": lat[max(0, int(len(lat) * 0.99) - 1)] * 1e3,
            "throughput": len(batch) / wall,
            "inflight": len(batch),
            "burst_cpu_ms": burst_cpu_ms,
            "loop_cpu_ms": loop_cpu_ms,
            "client_cpu_ms": client_cpu_ms,
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--inflight", type=int, default=100)
    parser.add_argument("--bursts", type=int, default=3, help="throughput: the median of this many bursts")
    args = parser.parse_args()
    cluster = Cluster()
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    cluster.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    cluster.hold(ns)
    tmp = Path(tempfile.mkdtemp(prefix="dra-bench-"))
    profile = tmp / "bench-node.yaml"
    bench_profile(profile)
    plugin_dir = KUBELET_ROOT / "plugins" / OURS
    # The node's (simulated) driver installation: every claim's spec carries its user space.
    cache = Path(os.environ.get("DRA_GPU_CACHE", Path.home() / ".cache" / "dra-gpu"))
    simdriver = [sys.executable, str(ROOT / "e2e" / "simdriver" / "build.py"), "--profile", str(profile)]
    driver_root = subprocess.run(
        [*simdriver, "--cache", str(cache)], check=True, capture_output=True, text=True
    ).stdout.split()[-1]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        metrics_port = sock.getsockname()[1]
    # Slices an earlier run published would make the start-up time 0: start from none.
    for s in cluster.custom.list_cluster_custom_object(
        GROUP, VERSION, "resourceslices", field_selector=f"spec.driver={OURS}"
    )["items"]:
        cluster.custom.delete_cluster_custom_object(GROUP, VERSION, "resourceslices", s["metadata"]["name"])
    while cluster.devices(OURS):
        time.sleep(0.05)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dra_gpu.cli",
            "kubelet-plugin",
            "--node-name",
            cluster.node,
            "--profile",
            str(profile),
            "--driver-root",
            driver_root,
            "--plugin-dir",
            str(plugin_dir),
            "--http-address",
            f"127.0.0.1:{metrics_port}",
            "--registry-dir",
            str(KUBELET_ROOT / "plugins_registry"),
        ],
        stdout=open(tmp / "plugin.log", "wb"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
    )
    try:
        while len(cluster.devices(OURS)) < 112:
            if proc.poll() is not None or time.perf_counter() - t0 > 60:
                raise SystemExit((tmp / "plugin.log").read_text())
            time.sleep(0.05)
        startup = time.perf_counter() - t0
        memory_at_start = memory(proc.pid)  # imports, inventory and slices: the floor before any claim
        while not (plugin_dir / "dra.sock").exists():
            time.sleep(0.05)
        results = {}
        ours = [cluster.allocated_claim(ns, OURS, d, cluster.node) for d in cluster.devices(OURS)]
        results["dra-gpu"] = asyncio.run(
            measure(
                plugin_dir / "dra.sock",
                ns,
                ours,
                args.rounds,
                args.inflight,
                lambda: prepare_seconds(metrics_port),
                args.bursts,
                lambda: cpu_seconds(proc.pid),
                lambda: cpu_seconds(proc.pid, thread=proc.pid),  # the main thread runs the event loop
            )
        )
        memory_after = memory(proc.pid)
        results["dra-gpu"]["rss_mb"] = memory_after.rss_mb
        # The plugin gives a burst's memory back after a second without requests (heap_trim.py).
        time.sleep(IDLE_SECONDS)
        memory_idle = memory(proc.pid)
        results["dra-gpu"]["startup_s"] = startup
        results["dra-gpu"]["rss_start_mb"] = memory_at_start.rss_mb
        subprocess.run(
            [sys.executable, str(ROOT / "e2e" / "cluster"), "peer-driver", "start"],
            check=True,
            capture_output=True,
        )
        peer_devices = cluster.devices(PEER)
        peer_pid = pid_of("dra-test-driver")
        peer = [
            cluster.allocated_claim(ns, PEER, peer_devices[i % len(peer_devices)], cluster.node)
            for i in range(args.inflight)
        ]
        results["peer"] = asyncio.run(
            measure(
                KUBELET_ROOT / "plugins" / PEER / "dra.sock",
                ns,
                peer,
                args.rounds,
                args.inflight,
                bursts=args.bursts,
                cpu=lambda: cpu_seconds(peer_pid),
            )
        )
        results["peer"]["rss_mb"] = rss_mb(peer_pid)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        subprocess.run(
            [sys.executable, str(ROOT / "e2e" / "cluster"), "peer-driver", "stop"], capture_output=True
        )
        cluster.core.delete_namespace(ns)
    print(f"{'plugin':<10} {'p50 ms':>8} {'p99 ms':>8} {'claims/s':>9} {'RSS MB':>7} {'start s':>8}")
    for name, r in results.items():
        start = f"{r['startup_s']:.2f}" if "startup_s" in r else "-"
        print(
            f"{name:<10} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['throughput']:>9.0f} "
            f"{r['rss_mb']:>7.1f} {start:>8}"
        )
    o, p = results["dra-gpu"], results["peer"]
    print(f"dra-gpu RSS once its slices were published (before any claim): {memory_at_start}")
    print(f"dra-gpu RSS right after the run: {memory_after}, {memory_after.threads} threads")
    print(f"dra-gpu RSS after the run and {IDLE_SECONDS:.0f} s without requests: {memory_idle}")
    print(
        f"one-claim prepare, mean: {o['mean_ms']:.2f} ms at the client, {o['inside_mean_ms']:.2f} ms inside "
        f"the plugin (claim read, plan, durable writes; its latency histogram), the rest gRPC and "
        f"scheduling; peer at the client {p['mean_ms']:.2f} ms"
    )
    print(
        f"plugin CPU per claim in the bursts (its prepare and unprepare, all threads): "
        f"dra-gpu {o['burst_cpu_ms']:.2f} ms ({o['loop_cpu_ms']:.2f} ms of it on its event loop), "
        f"peer {p['burst_cpu_ms']:.2f} ms; this bench's client (Python gRPC, the same cores) "
        f"{o['client_cpu_ms']:.2f} ms"
    )
    print(
        f"ratios dra-gpu/peer: p50 {o['p50_ms'] / p['p50_ms']:.2f}, p99 {o['p99_ms'] / p['p99_ms']:.2f}, "
        f"throughput {o['throughput'] / p['throughput']:.2f}, RSS {o['rss_mb'] / p['rss_mb']:.2f}"
    )
    print(
        f"({args.rounds} one-claim rounds, {args.inflight} claims in flight (median of {args.bursts} "
        f"bursts); peer devices: "
        f"{len(peer_devices)}, its claims share them; ours are distinct MIG devices)"
    )


if __name__ == "__main__":
    main()
