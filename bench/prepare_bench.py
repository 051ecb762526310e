"""NodePrepareResources latency and throughput, driven over dra.sock as the kubelet does, against the
peer driver (upstream's DRA test driver, `e2e/cluster peer-driver start`) on equal terms.

Needs the local e2e cluster (`e2e/cluster up`, root; under the e2e lock). Each run is four phases,
interleaved, each with only its driver running (started for the phase, stopped after it):
dra-gpu reading claims from its claim watch, the peer, dra-gpu with a GET per claim
(`--no-claim-watch`, as the peer reads them), the peer again. Each dra-gpu phase is compared with
the peer phase that follows it. The peer's client rate limit never binds (`peer-driver start`'s
default; `--peer-client-defaults` runs it with client-go's 50 QPS / burst 100 instead).

Per phase:
  - one-claim prepare latency, p50/p99 over `--rounds` (default 2,000) sequential prepares, in
    batches of `--inflight` claims that stay prepared until every dra-gpu claim-status write of the
    batch has reached the apiserver (its status writes are deferred until no prepare has been in
    flight for 0.1 s, and skipped for a claim unprepared before then; holding the claims makes the
    plugin pay for them, between batches as it would between pod starts), then unprepared one at a
    time (latency reported too);
  - throughput: `--inflight` concurrent one-claim prepares (median of `--bursts`), held the same way,
    then unprepared concurrently;
  - every answer checked: an error in any prepare or unprepare answer fails the run;
  - the plugin's CPU per claim over the bursts, and containerd's per claim over the whole phase
    until it is idle again (its CDI cache reads every spec file again on each one written or
    removed); each phase starts once containerd is idle, so no phase pays for the one before;
  - dra-gpu: start-up to slices published, RSS right after the phase and after 3 s without requests;
    the peer: RSS after the phase. Load average at the phase's start and end.
Claims are real ResourceClaims in the apiserver, pre-allocated and reserved for a (never scheduled)
pod through their status, as the scheduler leaves them, so both plugins do their real claim read
and prepare work.

Run: .venv/bin/python bench/prepare_bench.py [--runs 7] [--rounds 2000] [--inflight 100] [--bursts 3]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
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


def status_applies(api: client.ApiClient) -> int:
    """Successful server-side applies to resourceclaims/status the apiserver has served so far (its
    `apiserver_request_total`): how many claim-status writes have landed."""
    method, url, headers, body, post = api.param_serialize("GET", "/metrics", auth_settings=["BearerToken"])
    resp = api.call_api(method, url, headers, body, post, _request_timeout=30)
    resp.read()
    total = 0
    for line in resp.data.decode().splitlines():
        if (
            line.startswith("apiserver_request_total{")
            and 'resource="resourceclaims"' in line
            and 'subresource="status"' in line
            and 'verb="APPLY"' in line
            and 'code="2' in line
        ):
            total += int(float(line.split()[-1]))
    return total


class StatusWrites:
    """Waits, with claims held prepared, until the plugin's claim-status writes for them landed."""

    def __init__(self, api: client.ApiClient, writes: bool) -> None:
        self.api = api
        self.writes = writes  # the peer writes no claim status: nothing to wait for
        self.base = status_applies(api)
        self.expected = 0

    def restart(self) -> None:
        self.base = status_applies(self.api)

    def landed(self) -> int:
        return status_applies(self.api) - self.base

    def hold(self, claims: int) -> None:
        if not self.writes:
            return
        self.expected += claims
        time.sleep(0.3)  # the plugin defers its writes by 0.2 s, then 0.1 s without calls
        deadline = time.monotonic() + STATUS_WAIT_S
        while self.landed() < self.expected:
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"{self.landed()} of {self.expected} claim-status writes landed "
                    f"within {STATUS_WAIT_S:.0f} s"
                )
            time.sleep(0.1)


@dataclass
class Phase:
    name: str
    inflight: int
    prepare_ms: list[float] = field(default_factory=list)
    unprepare_ms: list[float] = field(default_factory=list)
    bursts: list[float] = field(default_factory=list)  # claims/s of each burst
    cpu_ms: float = float("nan")  # the plugin's CPU per claim over the bursts (prepare, status, unprepare)
    # containerd's CPU per claim prepared, from the phase's start until it is idle again after it:
    # its CDI cache reads every spec file of the node again on each spec written or removed, so it
    # pays for the size of the specs the driver writes, and may still be at it when the phase ends.
    runtime_cpu_ms: float = float("nan")
    runtime_settle_s: float = float("nan")  # how long containerd stayed busy after the phase
    status_writes: int = 0
    rss_mb: float = float("nan")
    rss_idle_mb: float = float("nan")
    startup_s: float = float("nan")
    load: tuple[float, float] = (float("nan"), float("nan"))

    @property
    def p50(self) -> float:
        return pct(self.prepare_ms, 50)

    @property
    def p99(self) -> float:
        return pct(self.prepare_ms, 99)

    @property
    def throughput(self) -> float:
        return statistics.median(self.bursts)

    def line(self, run: int) -> str:
        idle = (
            f", after {IDLE_SECONDS:.0f} s idle {self.rss_idle_mb:.1f} MB"
            if self.rss_idle_mb == self.rss_idle_mb
            else ""
        )
        start = f"; start {self.startup_s:.2f} s" if self.startup_s == self.startup_s else ""
        return (
            f"run {run} {self.name:<13} prepare p50 {self.p50:.2f} p99 {self.p99:.2f} "
            f"mean {statistics.mean(self.prepare_ms):.2f} ms (n={len(self.prepare_ms)}); "
            f"unprepare p50 {pct(self.unprepare_ms, 50):.2f} p99 {pct(self.unprepare_ms, 99):.2f} ms; "
            f"{self.inflight} in flight {self.throughput:.0f}/s "
            f"(bursts {' '.join(f'{b:.0f}' for b in self.bursts)}); CPU/claim {self.cpu_ms:.2f} ms, "
            f"containerd's {self.runtime_cpu_ms:.2f} ms (busy {self.runtime_settle_s:.1f} s after); "
            f"status writes {self.status_writes}; RSS {self.rss_mb:.1f} MB{idle}{start}; "
            f"load {self.load[0]:.2f}->{self.load[1]:.2f}"
        )


STATUS_WAIT_S = 20.0
WARM_UP_CLAIMS = 5


def pct(values: list[float], p: float) -> float:
    """The p-th percentile, nearest rank."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))]


async def measure(
    sock: Path,
    ns: str,
    claims: list[tuple[str, str]],
    phase: Phase,
    rounds: int,
    bursts: int,
    writes: StatusWrites,
    cpu: Callable[[], float],
) -> None:
    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
        stub = pb_grpc.DRAPluginStub(ch)

        def req(c: tuple[str, str]) -> Any:
            return [pb.Claim(namespace=ns, name=c[0], uid=c[1])]

        async def prepare(c: tuple[str, str]) -> float:
            t = time.perf_counter()
            resp = await stub.NodePrepareResources(pb.NodePrepareResourcesRequest(claims=req(c)), timeout=45)
            took = time.perf_counter() - t
            if c[1] not in resp.claims or resp.claims[c[1]].error:
                raise SystemExit(f"{phase.name}: prepare of {c[0]} failed: {resp}")
            return took * 1e3

        async def unprepare(c: tuple[str, str]) -> float:
            t = time.perf_counter()
            resp = await stub.NodeUnprepareResources(
                pb.NodeUnprepareResourcesRequest(claims=req(c)), timeout=45
            )
            took = time.perf_counter() - t
            if c[1] not in resp.claims or resp.claims[c[1]].error:
                raise SystemExit(f"{phase.name}: unprepare of {c[0]} failed: {resp}")
            return took * 1e3

        for c in claims[:WARM_UP_CLAIMS]:  # connections, caches (their status writes are skipped)
            await prepare(c)
            await unprepare(c)
        await asyncio.sleep(0.5)
        writes.restart()  # a warm-up write that was already on the wire does not count
        done = 0
        while done < rounds:
            batch = claims[: min(len(claims), rounds - done)]
            for c in batch:
                phase.prepare_ms.append(await prepare(c))
            writes.hold(len(batch))
            for c in batch:
                phase.unprepare_ms.append(await unprepare(c))
            done += len(batch)
        cpu_before = cpu()
        for _ in range(bursts):
            t = time.perf_counter()
            await asyncio.gather(*(prepare(c) for c in claims))
            phase.bursts.append(len(claims) / (time.perf_counter() - t))
            writes.hold(len(claims))
            await asyncio.gather(*(unprepare(c) for c in claims))
        phase.cpu_ms = (cpu() - cpu_before) / (bursts * len(claims)) * 1e3
        phase.status_writes = writes.landed()


RUNTIME_IDLE_CPU = 0.05  # containerd is idle below this share of a core (its housekeeping)
RUNTIME_SETTLE_TIMEOUT_S = 300.0


def runtime_cpu() -> float:
    return cpu_seconds(pid_of("/containerd --config"))


def runtime_before() -> float:
    """containerd's CPU so far, once it is idle: a phase's starting point."""
    settle_runtime()
    return runtime_cpu()


def settle_runtime() -> float:
    """Wait until containerd is idle (below RUNTIME_IDLE_CPU over a second); the seconds it took."""
    t0 = time.monotonic()
    last = runtime_cpu()
    while True:
        time.sleep(1.0)
        now = runtime_cpu()
        if now - last < RUNTIME_IDLE_CPU:
            return time.monotonic() - t0
        if time.monotonic() - t0 > RUNTIME_SETTLE_TIMEOUT_S:
            raise SystemExit(f"containerd still busy after {RUNTIME_SETTLE_TIMEOUT_S:.0f} s")
        last = now


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cluster = Cluster()
        self.ns = f"bench-{uuid.uuid4().hex[:6]}"
        self.tmp = Path(tempfile.mkdtemp(prefix="dra-bench-"))
        self.profile = self.tmp / "bench-node.yaml"
        bench_profile(self.profile)
        self.plugin_dir = KUBELET_ROOT / "plugins" / OURS
        # The node's (simulated) driver installation: every claim's spec carries its user space.
        cache = Path(os.environ.get("DRA_GPU_CACHE", Path.home() / ".cache" / "dra-gpu"))
        simdriver = [
            sys.executable,
            str(ROOT / "e2e" / "node" / "simdriver" / "build.py"),
            "--profile",
            str(self.profile),
        ]
        self.driver_root = subprocess.run(
            [*simdriver, "--cache", str(cache)], check=True, capture_output=True, text=True
        ).stdout.split()[-1]
        self.ours: list[tuple[str, str]] = []
        self.peer: list[tuple[str, str]] = []

    def runtime_after(self, phase: Phase, runtime_start: float) -> None:
        """containerd's CPU per claim the phase prepared (its warm-up's too), until it is idle."""
        phase.runtime_settle_s = settle_runtime()
        prepared = WARM_UP_CLAIMS + len(phase.prepare_ms) + len(phase.bursts) * phase.inflight
        phase.runtime_cpu_ms = (runtime_cpu() - runtime_start) / prepared * 1e3

    def peer_driver(self, action: str) -> None:
        cmd = [sys.executable, str(ROOT / "e2e" / "cluster"), "peer-driver", action]
        if action == "start" and self.args.peer_client_defaults:
            cmd += ["--kube-api-qps", "default", "--kube-api-burst", "default"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode and action == "start":
            raise SystemExit(f"peer-driver start failed: {r.stdout}{r.stderr}")

    def run_ours(self, run: int, claim_watch: bool) -> Phase:
        name = "dra-gpu watch" if claim_watch else "dra-gpu GET"
        runtime_start = runtime_before()
        phase = Phase(name, self.args.inflight, load=(os.getloadavg()[0], 0.0))
        cluster = self.cluster
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            metrics_port = sock.getsockname()[1]
        # Slices an earlier phase published would make the start-up time 0: start from none.
        for s in cluster.custom.list_cluster_custom_object(
            GROUP, VERSION, "resourceslices", field_selector=f"spec.driver={OURS}"
        )["items"]:
            cluster.custom.delete_cluster_custom_object(
                GROUP, VERSION, "resourceslices", s["metadata"]["name"]
            )
        while cluster.devices(OURS):
            time.sleep(0.05)
        log = self.tmp / f"plugin-{run}-{'watch' if claim_watch else 'get'}.log"
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
                str(self.profile),
                "--driver-root",
                self.driver_root,
                "--plugin-dir",
                str(self.plugin_dir),
                "--http-address",
                f"127.0.0.1:{metrics_port}",
                "--registry-dir",
                str(KUBELET_ROOT / "plugins_registry"),
                "--claim-watch" if claim_watch else "--no-claim-watch",
            ],
            stdout=open(log, "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )
        try:
            while len(cluster.devices(OURS)) < 112:
                if proc.poll() is not None or time.perf_counter() - t0 > 60:
                    raise SystemExit(log.read_text())
                time.sleep(0.05)
            phase.startup_s = time.perf_counter() - t0
            while not (self.plugin_dir / "dra.sock").exists():
                time.sleep(0.05)
            if not self.ours:
                devices = cluster.devices(OURS)[: self.args.inflight]
                self.ours = [cluster.allocated_claim(self.ns, OURS, d, cluster.node) for d in devices]
                time.sleep(1)  # the claim watch has them
            writes = StatusWrites(cluster.api, writes=True)
            asyncio.run(
                measure(
                    self.plugin_dir / "dra.sock",
                    self.ns,
                    self.ours,
                    phase,
                    self.args.rounds,
                    self.args.bursts,
                    writes,
                    lambda: cpu_seconds(proc.pid),
                )
            )
            phase.rss_mb = memory(proc.pid).rss_mb
            # The plugin gives a burst's memory back after a second without requests (heap_trim.py).
            time.sleep(IDLE_SECONDS)
            phase.rss_idle_mb = memory(proc.pid).rss_mb
        finally:
            proc.terminate()
            proc.wait(timeout=20)
        phase.load = (phase.load[0], os.getloadavg()[0])
        self.runtime_after(phase, runtime_start)
        return phase

    def run_peer(self) -> Phase:
        runtime_start = runtime_before()
        phase = Phase(
            "peer" + (" (50/100)" if self.args.peer_client_defaults else ""),
            self.args.inflight,
            load=(os.getloadavg()[0], 0.0),
        )
        cluster = self.cluster
        self.peer_driver("start")
        try:
            peer_pid = pid_of("dra-test-driver")
            if not self.peer:
                devices = cluster.devices(PEER)
                self.peer = [
                    cluster.allocated_claim(self.ns, PEER, devices[i % len(devices)], cluster.node)
                    for i in range(self.args.inflight)
                ]
            writes = StatusWrites(cluster.api, writes=False)
            asyncio.run(
                measure(
                    KUBELET_ROOT / "plugins" / PEER / "dra.sock",
                    self.ns,
                    self.peer,
                    phase,
                    self.args.rounds,
                    self.args.bursts,
                    writes,
                    lambda: cpu_seconds(peer_pid),
                )
            )
            phase.rss_mb = rss_mb(peer_pid)
        finally:
            self.peer_driver("stop")
        phase.load = (phase.load[0], os.getloadavg()[0])
        self.runtime_after(phase, runtime_start)
        return phase


def ratios(run: int, ours: Phase, peer: Phase) -> str:
    return (
        f"run {run} {ours.name} / {peer.name} (the phase after it): p50 {ours.p50 / peer.p50:.2f}, "
        f"p99 {ours.p99 / peer.p99:.2f}, throughput {ours.throughput / peer.throughput:.2f}"
    )


def summary(pairs: list[tuple[Phase, Phase]]) -> list[str]:
    """The targets per claim-read mode: in how many runs each held."""
    out = []
    for mode in ("dra-gpu watch", "dra-gpu GET"):
        mine = [(o, p) for o, p in pairs if o.name == mode]
        if not mine:
            continue
        n = len(mine)
        p50 = sum(o.p50 <= 0.8 * p.p50 for o, p in mine)
        p99 = sum(o.p99 <= 0.8 * p.p99 for o, p in mine)
        tput = sum(o.throughput >= 1.25 * p.throughput and o.throughput >= 500 for o, p in mine)
        rss = sum(o.rss_idle_mb <= 80 for o, _ in mine)
        out.append(
            f"{mode}: p50 <= 0.8x peer in {p50} of {n}; p99 <= 0.8x peer in {p99} of {n}; "
            f"throughput >= 1.25x peer and >= 500/s in {tput} of {n}; "
            f"RSS {IDLE_SECONDS:.0f} s after <= 80 MB in {rss} of {n} "
            f"(ratios p50 {' '.join(f'{o.p50 / p.p50:.2f}' for o, p in mine)}; "
            f"p99 {' '.join(f'{o.p99 / p.p99:.2f}' for o, p in mine)}; "
            f"throughput {' '.join(f'{o.throughput / p.throughput:.2f}' for o, p in mine)})"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=1, help="runs of four interleaved phases")
    parser.add_argument("--rounds", type=int, default=2000, help="one-claim prepares per phase")
    parser.add_argument("--inflight", type=int, default=100)
    parser.add_argument("--bursts", type=int, default=3, help="throughput: the median of this many bursts")
    parser.add_argument(
        "--modes",
        default="watch,get",
        help="dra-gpu's claim reads: watch, get or both (each before a peer phase)",
    )
    parser.add_argument(
        "--peer-client-defaults",
        action="store_true",
        help="the peer with client-go's default rate limit (50 QPS, burst 100), as the benches ran it before",
    )
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("watch", "get") for m in modes):
        parser.error("--modes: watch, get or watch,get")
    bench = Bench(args)
    cluster = bench.cluster
    bench.peer_driver("stop")  # only the measured driver runs
    cluster.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=bench.ns)))
    pairs: list[tuple[Phase, Phase]] = []
    print(
        f"{args.runs} runs x ({', '.join(f'dra-gpu {m}, peer' for m in modes)}); {args.rounds} one-claim "
        f"prepares per phase in batches of {args.inflight}, held until their status writes landed; "
        f"{args.inflight} in flight, median of {args.bursts} bursts; {os.cpu_count()} CPUs",
        flush=True,
    )
    try:
        cluster.hold(bench.ns)
        for run in range(1, args.runs + 1):
            for mode in modes:
                ours = bench.run_ours(run, claim_watch=mode == "watch")
                print(ours.line(run), flush=True)
                peer = bench.run_peer()
                print(peer.line(run), flush=True)
                print(ratios(run, ours, peer), flush=True)
                pairs.append((ours, peer))
    finally:
        bench.peer_driver("stop")
        cluster.core.delete_namespace(bench.ns)
    for line in summary(pairs):
        print(line)


if __name__ == "__main__":
    main()
