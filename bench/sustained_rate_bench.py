"""Sustained pod-start rate: an open-loop stream of real pods, one GPU claim each, through the real
scheduler, kubelet and containerd, with dra-gpu's plugin or NVIDIA's own (gpu-kubelet-plugin, the
pin of e2e/node/versions.sh) on the same simulated node.

Needs what bench/nvidia_peer_bench.py needs (the local e2e cluster, `eval "$(e2e/cluster env)"`,
root, `e2e/node/build.sh nvidia-dra toolkit`) and uses its node and its plugin launchers: a node of
`--gpus` whole H100s, dra-gpu with `--nvidia-compatible`, so both plugins are driver gpu.nvidia.com
and the same pods (a ResourceClaimTemplate of NVIDIA's DeviceClass `gpu.nvidia.com`, one GPU) run
on either. Only one plugin runs at a time; phases in a seeded random order per run.

After 3 s of pods at 1/s, not counted (each plugin's first prepares after its start), a phase
steps through `--rates` (pods a second, ascending). A step creates pods for `--step-s` seconds,
pod i due at start + i / rate whatever happened before it (open loop: a stall delays the pods due
during it, and that delay counts). Each pod's start is its due time to the moment the bench's pod
watch sees its container running; a pod is deleted (gracefully: it exits on SIGTERM) `--hold-s`
after that, so its claim is unprepared and freed while the stream goes on. The step is counted
until every pod and claim is gone, the plugin's process tree and containerd are idle again
(dra-gpu's deferred claim-status writes included). A step passes when every pod started and the
p99 start is under `--p99-limit` seconds; the phase stops at the first step that fails. The
sustained rate of a phase is its highest passing rate.

Per step: p50 / p99 / max start, pods that never started within `--start-timeout` after the step's
end, the pods with a prepare the plugin refused (their retry's delay is in the p99), the pods whose
claim the kubelet itself could not yet read (the node authorizer's race with the pod's claim, before
any plugin is called: the same for both plugins, retried 10-15 s later; listed apart, not in the
p99), the pods' rate as achieved (pods / first due to last start), the drain (last start to idle),
the plugin's and containerd's CPU per pod over the step and its drain, and the bench's own CPU (it
runs on the same cores).

Run: .venv/bin/python bench/sustained_rate_bench.py [--runs 3] [--rates 1,2,3,4,6,8] [--step-s 30]
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import os
import random
import resource
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.nvidia_peer_bench import NVIDIA, Bench, Phase, Running, cpu_seconds, pct, tree_cpu_seconds  # noqa: E402
from bench.prepare_bench import pid_of, runtime_cpu, settle_runtime  # noqa: E402
from dra_gpu.model.device_classes import chart_device_classes  # noqa: E402

# `e2e/cluster up` imports it into containerd
BUSYBOX_IMAGE = os.environ.get("E2E_BUSYBOX_IMAGE", "localhost/dra-gpu-e2e/busybox:1")
TEMPLATE = "one-gpu"
PLUGINS = ("dra-gpu", "nvidia")
PLUGIN_IDLE_CPU_S = 0.05  # the plugin's tree below this over a second: idle
DRAIN_TIMEOUT_S = 180.0
WARM_UP_S = 3.0  # pods at 1/s before the steps
# Pods are deleted as a user deletes them, gracefully: the kubelet stops the container (it exits on
# SIGTERM), unprepares its claim and only then removes the pod, whose claim is then deleted and its
# GPU free again. A forced deletion (grace 0) removes the pod at once, so the scheduler can give
# its GPU to the next pod while the node still holds the old claim: NVIDIA's plugin refuses that
# prepare ("already allocated to different claim") until the kubelet's retry 10-15 s later.
GRACE_S = 5
WATCH_TIMEOUT_S = 300  # the apiserver ends a watch after this; the bench resumes it
CREATE_WORKERS = 8
DELETE_WORKERS = 4


def parse_rates(text: str) -> list[float]:
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or any(r <= 0 for r in rates) or rates != sorted(set(rates)):
        raise ValueError(f"--rates {text!r}: positive pods-a-second values in ascending order, no repeats")
    return rates


def phase_orders(seed: int, runs: int) -> list[list[str]]:
    rng = random.Random(seed)
    return [rng.sample(PLUGINS, len(PLUGINS)) for _ in range(runs)]


def pod_body(name: str, step: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"bench-step": step}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "terminationGracePeriodSeconds": GRACE_S,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "containers": [
                {
                    "name": "c",
                    "image": BUSYBOX_IMAGE,
                    "imagePullPolicy": "Never",
                    # PID 1 ignores SIGTERM unless it handles it: exit at once on it
                    "command": ["sh", "-c", "trap 'exit 0' TERM; sleep 3600 & wait"],
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": TEMPLATE}],
        },
    }


def claim_template() -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": TEMPLATE},
        "spec": {
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": NVIDIA}}]}}
        },
    }


def running_since(pod: dict[str, Any]) -> bool:
    """Whether the pod's container runs (what a user waits for)."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return bool(statuses) and all("running" in (s.get("state") or {}) for s in statuses)


@dataclass
class Step:
    plugin: str
    rate: float
    pods: int
    start_s: list[float] = field(default_factory=list)  # due -> container running
    # the starts of the pods whose claim the kubelet could not read (kubelet_fetch_refused): not
    # the plugin's doing, counted apart
    kubelet_raced_s: list[float] = field(default_factory=list)
    plugin_refused: int = 0  # pods with a prepare the plugin refused (the kubelet retried it)
    never: int = 0
    achieved: float = float("nan")  # pods / (first due -> last start)
    drain_s: float = float("nan")  # last start -> pods and claims gone, plugin and containerd idle
    plugin_cpu_ms: float = float("nan")  # per pod, the step and its drain
    runtime_cpu_ms: float = float("nan")
    bench_cpu_ms: float = float("nan")
    busy: float = float("nan")  # the machine's CPUs busy while the pods were created, 0..1
    others_ms: dict[str, float] = field(default_factory=dict)  # the cluster's processes, CPU per pod
    limit_s: float = 2.0
    settled: bool = True  # the plugin came back to its idle floor after the step

    @property
    def p99(self) -> float:
        return pct(self.start_s, 99) if self.start_s else float("inf")

    @property
    def passed(self) -> bool:
        return self.never == 0 and self.p99 < self.limit_s

    def line(self, run: int) -> str:
        s = self.start_s or [float("nan")]
        return (
            f"run {run} {self.plugin:<8} {self.rate:5.2f} pods/s x {self.pods}: start p50 "
            f"{pct(s, 50):.2f} p99 {self.p99:.2f} max {max(s):.2f} s; never started {self.never}; "
            f"prepares refused by the plugin {self.plugin_refused}; claim reads refused to the kubelet "
            f"{len(self.kubelet_raced_s)} (started "
            f"{', '.join(f'{x:.1f}' for x in self.kubelet_raced_s) or '-'} s, not in the p99); "
            f"achieved {self.achieved:.2f}/s; drain {self.drain_s:.1f} s; CPU/pod plugin "
            f"{self.plugin_cpu_ms:.1f} ms, containerd {self.runtime_cpu_ms:.1f} ms, bench "
            f"{self.bench_cpu_ms:.1f} ms{'' if self.settled else ' (plugin not idle after it)'}"
            + "".join(f", {k} {v:.1f} ms" for k, v in self.others_ms.items())
            + f"; CPUs busy {100 * self.busy:.0f} % while created; "
            f"{'pass' if self.passed else 'FAIL'}"
        )


# The cluster's own processes on this machine (the e2e cluster runs them as host processes), by a
# pattern of their command line: what else a pod's start costs the node.
CLUSTER_PROCESSES = {
    "kubelet": "/kubelet --",
    "apiserver": "/kube-apiserver ",
    "etcd": "/etcd ",
    "scheduler": "/kube-scheduler ",
    "controllers": "/kube-controller-manager ",
}


def cluster_cpu() -> dict[str, float]:
    """CPU seconds so far of each of CLUSTER_PROCESSES that runs (those that do not are left out)."""
    out = {}
    for name, pattern in CLUSTER_PROCESSES.items():
        with contextlib.suppress(SystemExit, FileNotFoundError):
            out[name] = cpu_seconds(pid_of(pattern))
    return out


def machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the machine so far, from /proc/stat's first line."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_fraction(before: tuple[int, int], after: tuple[int, int]) -> float:
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else float("nan")


def kubelet_fetch_refused(message: str) -> bool:
    """A FailedPrepareDynamicResources event of the kubelet's own read of the claim refused by the
    node authorizer ("fetch ResourceClaim ...: forbidden ... no relationship found between node
    and this object"): the authorizer's graph has not yet seen the pod's claim, an upstream race
    the kubelet retries 10-15 s later; no plugin was called."""
    return "fetch ResourceClaim" in message and "forbidden" in message


def sustained(steps: Sequence[Step]) -> float:
    """The highest rate whose step passed (stepping stops at the first failure); 0 if none did."""
    best = 0.0
    for st in steps:
        if not st.passed:
            break
        best = st.rate
    return best


class PodStream:
    """One step's pods: the open-loop creator, the watch that times them, the delayed deleter."""

    def __init__(self, core: Any, ns: str, node: str, tag: str, hold_s: float) -> None:
        self.core, self.ns, self.node, self.tag, self.hold_s = core, ns, node, tag, hold_s
        self.due: dict[str, float] = {}
        self.started: dict[str, float] = {}
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.deletions: list[tuple[float, str]] = []
        self.deletion_ready = threading.Condition(self.lock)
        self.creators = ThreadPoolExecutor(CREATE_WORKERS, thread_name_prefix="create")
        self.deleters = ThreadPoolExecutor(DELETE_WORKERS, thread_name_prefix="delete")
        self.threads = [
            threading.Thread(target=self._watch, daemon=True),
            threading.Thread(target=self._delete_loop, daemon=True),
        ]

    def __enter__(self) -> PodStream:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        with self.lock:
            self.deletion_ready.notify_all()
        self.creators.shutdown(wait=True)
        self.deleters.shutdown(wait=True)

    def _events(self, version: str) -> Iterator[dict[str, Any]]:
        resp = self.core.list_namespaced_pod(
            self.ns,
            label_selector=f"bench-step={self.tag}",
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_TIMEOUT_S,
            _preload_content=False,
            _request_timeout=WATCH_TIMEOUT_S + 30,
        )
        try:
            for line in resp:
                if line.strip():
                    yield json.loads(line)
        finally:
            resp.release_conn()

    def _watch(self) -> None:
        try:
            self._watch_pods()
        except Exception as exc:  # the step fails, naming why, instead of timing out
            self.errors.append(f"pod watch: {exc!r}")

    def _watch_pods(self) -> None:
        version = self.core.list_namespaced_pod(
            self.ns, label_selector=f"bench-step={self.tag}", _preload_content=False
        )
        version = json.loads(version.data)["metadata"]["resourceVersion"]
        while not self.stop.is_set():
            for ev in self._events(version):
                seen = time.monotonic()
                obj = ev["object"]
                version = obj["metadata"].get("resourceVersion", version)
                if ev["type"] == "ERROR":
                    self.errors.append(f"pod watch: {obj.get('message')}")
                    return
                if ev["type"] == "BOOKMARK":
                    continue
                name = obj["metadata"]["name"]
                if ev["type"] in ("ADDED", "MODIFIED") and name not in self.started and running_since(obj):
                    with self.lock:
                        self.started[name] = seen
                        heapq.heappush(self.deletions, (seen + self.hold_s, name))
                        self.deletion_ready.notify()
                if self.stop.is_set():
                    return

    def _delete_loop(self) -> None:
        with self.lock:
            while not self.stop.is_set():
                if not self.deletions:
                    self.deletion_ready.wait(timeout=0.5)
                    continue
                at, name = self.deletions[0]
                wait = at - time.monotonic()
                if wait > 0:
                    self.deletion_ready.wait(timeout=min(wait, 0.5))
                    continue
                heapq.heappop(self.deletions)
                self.deleters.submit(self.delete, name)

    def delete(self, name: str) -> None:
        try:
            self.core.delete_namespaced_pod(name, self.ns, _preload_content=False)
        except client.ApiException as exc:
            if exc.status != 404:
                self.errors.append(f"delete {name}: {exc.status} {exc.reason}")

    def _create(self, name: str) -> None:
        try:
            self.core.create_namespaced_pod(
                self.ns, pod_body(name, self.tag, self.node), _preload_content=False
            )
        except client.ApiException as exc:
            self.errors.append(f"create {name}: {exc.status} {exc.reason}")

    def run(self, rate: float, seconds: float) -> float:
        """Create the step's pods at `rate`; returns the first due time (monotonic)."""
        n = max(1, round(rate * seconds))
        t0 = time.monotonic() + 0.2
        for i in range(n):
            name = f"{self.tag}-{i:04d}"
            due = t0 + i / rate
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            self.due[name] = due
            self.creators.submit(self._create, name)
        return t0

    def wait_started(self, deadline: float) -> None:
        while len(self.started) < len(self.due) and time.monotonic() < deadline and not self.errors:
            time.sleep(0.1)


class SustainedBench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        peer_args = argparse.Namespace(gpus=args.gpus, nvidia_client_defaults=False, levels="1")
        self.bench = Bench(peer_args)
        self.cluster = self.bench.cluster
        self.core = self.cluster.core
        self.ns = f"bench-rate-{uuid.uuid4().hex[:6]}"

    def setup(self) -> None:
        custom = self.cluster.custom
        for cls in chart_device_classes(NVIDIA):
            with contextlib.suppress(client.ApiException):  # there already: NVIDIA's and ours are the same
                custom.create_cluster_custom_object("resource.k8s.io", "v1", "deviceclasses", cls)
        self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=self.ns)))
        deadline = time.monotonic() + 30
        while not self.core.list_namespaced_service_account(
            self.ns, field_selector="metadata.name=default"
        ).items:
            if time.monotonic() > deadline:
                raise SystemExit(f"namespace {self.ns}: no default service account after 30 s")
            time.sleep(0.1)
        custom.create_namespaced_custom_object(
            "resource.k8s.io", "v1", self.ns, "resourceclaimtemplates", claim_template()
        )

    def teardown(self) -> None:
        with contextlib.suppress(Exception):
            self.cluster.drop_slices(NVIDIA)
        with contextlib.suppress(Exception):
            self.core.delete_namespace(self.ns)
        shutil.rmtree(self.bench.tmp / "node", ignore_errors=True)  # device nodes, driver copy; logs stay

    def start(self, plugin: str, run: int) -> Running:
        self.cluster.drop_slices(NVIDIA)
        phase = Phase(plugin, "exclusive", [1])
        if plugin == "dra-gpu":
            running, _ = self.bench.start_ours(phase, run)
        else:
            running, _ = self.bench.start_nvidia(phase, run, [])
        print(f"run {run} {plugin}: started, {phase.startup_s:.2f} s to slices published", flush=True)
        return running

    def drained(self, tag: str) -> bool:
        pods = self.core.list_namespaced_pod(self.ns, label_selector=f"bench-step={tag}", limit=1)
        if pods.items:
            return False
        claims = self.cluster.custom.list_namespaced_custom_object(
            "resource.k8s.io", "v1", self.ns, "resourceclaims", limit=1
        )
        return not claims["items"]

    def failed_prepares(self, pods: set[str]) -> tuple[set[str], int]:
        """The step's pods whose claim read the kubelet was refused, and how many pods had a
        prepare the plugin refused, from the namespace's FailedPrepareDynamicResources events."""
        events = self.core.list_namespaced_event(
            self.ns, field_selector="reason=FailedPrepareDynamicResources", _preload_content=False
        )
        raced: set[str] = set()
        refused: set[str] = set()
        for ev in json.loads(events.data)["items"]:
            pod = (ev.get("involvedObject") or {}).get("name", "")
            if pod in pods:
                (raced if kubelet_fetch_refused(ev.get("message", "")) else refused).add(pod)
        return raced, len(refused - raced)

    def idle_floor(self, pid: int, seconds: float = 5.0) -> float:
        """The plugin's CPU a second at rest (its health watches, its resyncs): what settle_plugin
        waits for it to come back down to."""
        t0, cpu0 = time.monotonic(), tree_cpu_seconds(pid)
        time.sleep(seconds)
        return (tree_cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)

    def settle_plugin(self, pid: int, floor: float) -> bool:
        """Waits until a second of the plugin's tree costs at most its idle floor (plus
        PLUGIN_IDLE_CPU_S); False, with a warning, when it is still above after DRAIN_TIMEOUT_S."""
        limit = floor + PLUGIN_IDLE_CPU_S
        last, busy = tree_cpu_seconds(pid), float("inf")
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline:
            time.sleep(1.0)
            now = tree_cpu_seconds(pid)
            busy, last = now - last, now
            if busy <= limit:
                return True
        print(
            f"warning: the plugin still busy ({busy:.3f} s CPU in its last second, idle floor {floor:.3f}) "
            f"{DRAIN_TIMEOUT_S:.0f} s after its step",
            flush=True,
        )
        return False

    def step(
        self, plugin: str, running: Running, run: int, rate: float, floor: float, seconds: float | None = None
    ) -> Step:
        settle_runtime()
        tag = f"r{run}-{plugin[:2]}-{int(rate * 100)}" + ("-warm" if seconds is not None else "")
        plugin_cpu0, runtime_cpu0 = tree_cpu_seconds(running.pid), runtime_cpu()
        bench_cpu0, others0 = time.process_time(), cluster_cpu()
        with PodStream(self.core, self.ns, self.cluster.node, tag, self.args.hold_s) as stream:
            machine0 = machine_ticks()
            t0 = stream.run(rate, self.args.step_s if seconds is None else seconds)
            busy = busy_fraction(machine0, machine_ticks())
            stream.wait_started(time.monotonic() + self.args.start_timeout)
            # pods that never started are deleted too, so that the next step starts clean
            for name in sorted(set(stream.due) - set(stream.started)):
                stream.delete(name)
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            while not stream.errors and not self.drained(tag):
                if time.monotonic() > deadline:
                    raise SystemExit(f"step {tag}: pods or claims left {DRAIN_TIMEOUT_S:.0f} s after it")
                time.sleep(0.5)
            if stream.errors:
                raise SystemExit(f"step {tag}: " + "; ".join(stream.errors[:5]))
        settled = self.settle_plugin(running.pid, floor)
        settle_runtime()
        idle = time.monotonic()
        st = Step(plugin, rate, len(stream.due), limit_s=self.args.p99_limit, settled=settled)
        raced, st.plugin_refused = self.failed_prepares(set(stream.due))
        starts = {n: stream.started[n] - stream.due[n] for n in stream.due if n in stream.started}
        st.start_s = [t for n, t in starts.items() if n not in raced]
        st.kubelet_raced_s = sorted(t for n, t in starts.items() if n in raced)
        st.never = len(stream.due) - len(starts)
        if stream.started:
            last = max(stream.started.values())
            st.achieved = len(stream.started) / max(last - t0, 1e-9)
            st.drain_s = idle - last
        pods = max(1, st.pods)
        st.plugin_cpu_ms = (tree_cpu_seconds(running.pid) - plugin_cpu0) / pods * 1e3
        st.runtime_cpu_ms = (runtime_cpu() - runtime_cpu0) / pods * 1e3
        st.bench_cpu_ms = (time.process_time() - bench_cpu0) / pods * 1e3
        st.busy = busy
        st.others_ms = {k: (v - others0[k]) / pods * 1e3 for k, v in cluster_cpu().items()}
        return st

    def phase(self, plugin: str, run: int) -> list[Step]:
        running = self.start(plugin, run)
        steps: list[Step] = []
        try:
            floor = self.idle_floor(running.pid)
            print(f"run {run} {plugin}: idle floor {floor * 1e3:.1f} ms CPU a second", flush=True)
            # a few pods first, not counted: each plugin's first prepares after its start (caches,
            # connections) are not what a node's steady stream pays
            warm = self.step(plugin, running, run, 1.0, floor, seconds=WARM_UP_S)
            print(f"warm-up: {warm.line(run)}", flush=True)
            for rate in self.args.rate_list:
                st = self.step(plugin, running, run, rate, floor)
                print(st.line(run), flush=True)
                steps.append(st)
                if not st.passed:
                    break
        finally:
            running.stop()
            self.cluster.drop_slices(NVIDIA)
        return steps


def summary(done: Sequence[tuple[int, list[Step]]]) -> list[str]:
    lines = ["", "sustained rate (highest step with every pod started and p99 start under the limit):"]
    by_run: dict[int, dict[str, float]] = {}
    for run, steps in done:
        if steps:
            by_run.setdefault(run, {})[steps[0].plugin] = sustained(steps)
    for run, rates in sorted(by_run.items()):
        ours, theirs = rates.get("dra-gpu", float("nan")), rates.get("nvidia", float("nan"))
        ratio = ours / theirs if theirs else float("inf")
        lines.append(f"  run {run}: dra-gpu {ours:g}/s, NVIDIA {theirs:g}/s, ratio {ratio:.2f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rates", default="1,2,3,4,6,8", help="pods a second, ascending")
    parser.add_argument("--step-s", type=float, default=30.0, help="seconds of pod creation per step")
    parser.add_argument("--hold-s", type=float, default=1.0, help="a pod is deleted this long after it runs")
    parser.add_argument("--p99-limit", type=float, default=2.0, help="a step passes below this p99 start (s)")
    parser.add_argument(
        "--start-timeout", type=float, default=60.0, help="after the step, seconds a pod may still start"
    )
    parser.add_argument("--gpus", type=int, default=56, help="whole GPUs of the bench node")
    parser.add_argument("--plugins", default="dra-gpu,nvidia", help="which plugins' phases run")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    try:
        args.rate_list = parse_rates(args.rates)
    except ValueError as exc:
        parser.error(str(exc))
    plugins = [p for p in args.plugins.split(",") if p]
    if not plugins or any(p not in PLUGINS for p in plugins):
        parser.error(f"--plugins: a comma-separated subset of {', '.join(PLUGINS)}")
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    orders = [[p for p in order if p in plugins] for order in phase_orders(seed, args.runs)]
    bench = SustainedBench(args)
    print(
        f"seed {seed}; {args.runs} runs; node {bench.cluster.node}, {args.gpus} whole GPUs; rates "
        f"{args.rates} pods/s, {args.step_s:g} s a step, pods deleted {args.hold_s:g} s after they run; "
        f"pass: every pod started and p99 start < {args.p99_limit:g} s; {os.cpu_count()} CPUs; "
        f"load {os.getloadavg()[0]:.2f}; bench max RSS so far "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB",
        flush=True,
    )
    bench.bench.peer_driver("stop")
    done: list[tuple[int, list[Step]]] = []
    try:
        bench.setup()
        for run, order in enumerate(orders, 1):
            print(f"run {run} order: {', '.join(order)}", flush=True)
            for plugin in order:
                done.append((run, bench.phase(plugin, run)))
    finally:
        bench.teardown()
    for line in summary(done):
        print(line)


if __name__ == "__main__":
    main()
