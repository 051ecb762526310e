"""Scale on the real control plane: KWOK nodes, dra-gpu's publishers and webhook, the real scheduler.

    bash e2e/node/build.sh kubernetes && bash e2e/node/build.sh etcd && bash e2e/node/build.sh kwok   # cached
    .venv/bin/python bench/scale_bench.py --nodes 50,100,250,500 [--claims 1000] [--json FILE]

For each node count N, a fresh control plane of its own (etcd, kube-apiserver, kube-scheduler from
e2e/node/build.sh's cache, the e2e DRA feature gates) in a temporary state dir on ports of its own, so it
runs beside the e2e cluster; no kubelet, no controller-manager, no containers. (e2e/ci.sh's last
check takes any process of the cache's programs for a cluster leftover: an e2e run that ends while
this bench runs fails that check, so run them one after the other.)

1. N nodes registered with KWOK (`kwok` controller, upstream's node-initialize, lease heartbeat and
   pod-ready stages), each with the capacity for 110 pods.
2. dra-gpu's slice publisher (dra_gpu.kubeletplugin.publisher.SlicePublisher, the kubelet plugin's
   code) once per node, all N in one process (`--publishers-for`), publishing the slices of the
   simulated hgx-2x4 node (8 H100, NVLink domains {0-3} {4-7}) and then watching them, as the plugin
   does; one HTTP connection per node, like N plugins. The slices are what the GPU driver's
   resource_slices() builds (slices.build_slices over the node's inventory; no health taints, no
   memory shares); the driver itself is not made, as it needs a preparer with its node's dirs.
3. `dra-gpu controller` (the webhook) watching slices, classes and claims of the cluster.
4. The bench creates `--claims` ResourceClaims, each followed by a Pod that uses it: claim i asks for
   1, 2, 4 or 8 GPUs (i mod 4), every other pair of four with a matchAttribute nvlinkDomain
   constraint, so an eighth of the claims (8 NVLink GPUs; hgx-2x4's domains have 4) can never be
   allocated. The real kube-scheduler allocates; a watch in the bench times each allocation.
5. When no allocation came for `--settle` seconds (or all are allocated): scheduling throughput,
   claim-created-to-allocated p50/p99, RSS and CPU of every process (from /proc), the apiserver's
   request counts (`apiserver_request_total` from /metrics) while publishing and while scheduling.
6. `explain` agreement, in-process against the final cluster state (see bench/RESULTS.md): an
   allocated claim agrees when dra-gpu's allocator accepts exactly the scheduler's devices (on its
   node, with every other device of that node taken); a pending claim agrees when explain finds no
   placement anywhere with every allocated device in use.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dra_gpu.common.durable import replace_atomically  # noqa: E402
from dra_gpu.kube.api import RESOURCE_V1, Kube, list_watch  # noqa: E402
from dra_gpu.model import nvidia_compat  # noqa: E402
from dra_gpu.model.device_classes import chart_device_classes  # noqa: E402

DRIVER = "gpu.dra-gpu.io"
PROFILE = "hgx-2x4"
NS = "default"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
COUNTS = (1, 2, 4, 8)
NVLINK = [{"matchAttribute": f"{DRIVER}/nvlinkDomain"}]
MIG_CLASS_NAME = "mig." + DRIVER.removeprefix("gpu.")  # the chart's MIG class
# Publishers that start at once: a cluster's plugins do not all start in the same second, and 500
# first publications of dynamic-MIG slices at once (98 MB) kept one apiserver on 2 cores past every
# publisher's start deadline.
PUBLISH_CONCURRENCY = 16


def device_class(name: str, device_type: str) -> dict[str, Any]:
    """A DeviceClass of this driver's devices of one type, as the chart installs it."""
    expression = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "{device_type}"'
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }


GPU_CLASS = device_class(DRIVER, "gpu")
MIG_CLASS = device_class(MIG_CLASS_NAME, "mig")
# The peer: upstream's DRA test driver (test/e2e/dra/test-driver), e2e's peer-driver name.
PEER_DRIVER = "gpu.example.com"
PEER_CLASS = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": PEER_DRIVER},
    "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{PEER_DRIVER}"'}}]},
}
# MIG-heavy mix, claim i: (profile, count) by i mod 4; every other pair of four with all its
# devices on one GPU (matchAttribute parentUUID), as the plain mix's NVLink constraint.
MIG_MIX = (("1g.10gb", 1), ("2g.20gb", 2), ("3g.40gb", 1), ("1g.10gb", 4))
MIX_PROFILES = tuple(dict.fromkeys(p for p, _ in MIG_MIX))
MIG_CASES = ("mig", "mig-mix")
SAME_GPU = [{"matchAttribute": f"{DRIVER}/parentUUID"}]
# Equal fill against NVIDIA's gpu-kubelet-plugin v0.5.0: the same nodes, claims and DeviceClasses
# (the chart's classes as gpu.nvidia.com: NVIDIA's names and CEL selectors) for NVIDIA's slices and
# for dra-gpu's in NVIDIA-compatible mode. case -> (simulated profile, dynamic MIG, whose slices).
NVIDIA_DRIVER = nvidia_compat.DRIVER_NAME
NVIDIA_MIG_CLASS = nvidia_compat.MIG_CLASS
EQUAL_FILL = {
    "nvidia-static-mig": ("dgx-a100-mig", False, "nvidia"),
    "compat-static-mig": ("dgx-a100-mig", False, "dra-gpu"),
    "nvidia-dynamic-mig": ("dgx-h100-mig", True, "nvidia"),
    "compat-dynamic-mig": ("dgx-h100-mig", True, "dra-gpu"),
}
# The mig mix with its last request halved: dgx-a100-mig's MIG devices made beforehand are, a node,
# GPU 0: 2x 3g.40gb; GPU 1: 2x 2g.20gb, 3x 1g.10gb; GPU 2: 3g.40gb, 2g.20gb, 1g.10gb; so four
# 1g.10gb on one GPU never fit. Both drivers publish these profiles with the same `profile` and
# `parentUUID` attributes (e2e/tests/test_nvidia_dropin.py's judge), so the same-GPU constraint is
# NVIDIA's own demo's (gpu-test4: matchAttribute gpu.nvidia.com/parentUUID). A node holds one
# claim of two 2g.20gb at most: all claims fit while claims <= 4 x nodes; at 3 x nodes (a quarter
# of that spare) a simulation of random node choice left none pending, in either device order.
EQUAL_FILL_MIX = (("1g.10gb", 1), ("2g.20gb", 2), ("3g.40gb", 1), ("1g.10gb", 2))
NVIDIA_SAME_GPU = [{"matchAttribute": f"{NVIDIA_DRIVER}/parentUUID"}]
NVIDIA_START_WAIT = 120.0  # seconds for NVIDIA's plugin to publish its pool
# Components of each run, as (pid file name, program); all are stopped after each size.
PROCS = ("etcd", "kube-apiserver", "kube-scheduler", "kwok", "publishers", "webhook")
# What the scheduler is measured against (issue 30 part 1): the node's slices and the claim mix.
CASES = {
    "plain": "dra-gpu, whole GPUs (hgx-2x4: 8 devices a node)",
    "mig": "dra-gpu, dynamic MIG (dgx-h100-mig: every placement, counter sets), MIG-heavy mix",
    "mig-mix": "as mig, offering only the mix's profiles (--mig-profiles " + ",".join(MIX_PROFILES) + ")",
    "share": "dra-gpu, memory shares (hgx-2x4, allowMultipleAllocations)",
    "peer": "upstream DRA test driver's slices (8 devices a node, its own code), no constraints",
    "nvidia-static-mig": "NVIDIA's gpu-kubelet-plugin v0.5.0's slices (its binary, node 0's cloned), "
    "dgx-a100-mig's MIG devices made beforehand, the equal-fill mix",
    "compat-static-mig": "dra-gpu as gpu.nvidia.com on dgx-a100-mig, the same claims and classes",
    "nvidia-dynamic-mig": "as nvidia-static-mig with DynamicMIG=true on dgx-h100-mig",
    "compat-dynamic-mig": "dra-gpu as gpu.nvidia.com, dynamic MIG on dgx-h100-mig, the same claims",
}


def case_driver(case: str) -> str:
    """The driver name of a case's slices."""
    if case == "peer":
        return PEER_DRIVER
    return NVIDIA_DRIVER if case in EQUAL_FILL else DRIVER


def counterpart(case: str) -> str | None:
    """The NVIDIA case a compat case is compared with (and back); None outside EQUAL_FILL."""
    if case.startswith("compat-"):
        return "nvidia-" + case.removeprefix("compat-")
    if case.startswith("nvidia-"):
        return "compat-" + case.removeprefix("nvidia-")
    return None


def node_name(i: int) -> str:
    return f"gpu-{i:03d}"


def mig_request(driver: str, device_class: str, profile: str, count: int) -> dict[str, Any]:
    """`count` MIG devices of `profile` from `device_class` (the request's `exactly`)."""
    sel = f'device.attributes["{driver}"].profile == "{profile}"'
    return {"deviceClassName": device_class, "count": count, "selectors": [{"cel": {"expression": sel}}]}


def claim_body(i: int, case: str = "plain") -> dict[str, Any]:
    """Claim i of the mix: 1, 2, 4 or 8 whole GPUs, every other pair of four NVLink-connected (the
    peer's devices have no attributes: no constraint); for `mig`, MIG_MIX; for the EQUAL_FILL
    cases, EQUAL_FILL_MIX on NVIDIA's MIG class, the same body for both drivers."""
    constrained = (i // 4) % 2 == 0
    exactly: dict[str, Any] = {"deviceClassName": DRIVER, "count": COUNTS[i % 4]}
    constraints = NVLINK
    if case in MIG_CASES:
        exactly, constraints = mig_request(DRIVER, MIG_CLASS_NAME, *MIG_MIX[i % 4]), SAME_GPU
    elif case in EQUAL_FILL:
        exactly = mig_request(NVIDIA_DRIVER, NVIDIA_MIG_CLASS, *EQUAL_FILL_MIX[i % 4])
        constraints = NVIDIA_SAME_GPU
    elif case == "peer":
        exactly["deviceClassName"] = PEER_DRIVER
        constrained = False
    devices: dict[str, Any] = {"requests": [{"name": "gpus", "exactly": exactly}]}
    if constrained:
        devices["constraints"] = constraints
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": f"claim-{i:04d}", "namespace": NS},
        "spec": {"devices": devices},
    }


def pod_body(i: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"job-{i:04d}", "namespace": NS},
        "spec": {
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "fake", "resources": {"claims": [{"name": "gpus"}]}}],
            "resourceClaims": [{"name": "gpus", "resourceClaimName": f"claim-{i:04d}"}],
        },
    }


def node_body(i: int) -> dict[str, Any]:
    name = node_name(i)
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION: "fake"},
            "labels": {"kubernetes.io/hostname": name, "type": "kwok"},
        },
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))] if s else float("nan")


# ---------------------------------------------------------------- /proc and /metrics


def proc_stats(pid: int | None) -> dict[str, float]:
    """CPU seconds (user + system) so far, current and peak RSS in MiB; zeros for no process."""
    if pid is None:
        return {"cpu_s": 0.0, "rss_mib": 0.0, "hwm_mib": 0.0}
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return {"cpu_s": 0.0, "rss_mib": 0.0, "hwm_mib": 0.0}
    tick = os.sysconf("SC_CLK_TCK")
    return {
        "cpu_s": (int(fields[11]) + int(fields[12])) / tick,
        "rss_mib": int(status["VmRSS"].split()[0]) / 1024,
        "hwm_mib": int(status["VmHWM"].split()[0]) / 1024,
    }


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


class ControlPlane:
    """The harness of e2e/ pointed at a state dir and ports of this bench's own."""

    def __init__(self, state: str, port_base: int, scheduler_qps: float | None = None) -> None:
        os.environ.update(
            DRA_GPU_E2E_STATE=state,
            DRA_GPU_E2E_APISERVER_PORT=str(port_base + 443),
            DRA_GPU_E2E_ETCD_PORT=str(port_base + 10),
            DRA_GPU_E2E_SCHEDULER_PORT=str(port_base + 259),
        )
        # The harness reads its settings from the environment at import.
        from e2e.harness import certs, components, config, processes

        self.certs, self.components, self.config, self.processes = certs, components, config, processes
        self.state = state
        # kube-scheduler's client rate limit (upstream default: 50 QPS, burst 100)
        self.scheduler_flags = (
            [f"--kube-api-qps={scheduler_qps:g}", f"--kube-api-burst={2 * scheduler_qps:g}"]
            if scheduler_qps
            else []
        )
        self.webhook_port = port_base + 843
        self.kwok_dir = os.path.join(config.CACHE, "bin", "kwok-" + config.V["KWOK_VERSION"])
        self.ip = components.node_ip()
        certs.make_pki(self.ip)
        for user in ("admin", "scheduler"):
            certs.kubeconfig(os.path.join(state, user + ".kubeconfig"), user)
        self.admin = config.ADMIN_KUBECONFIG

    def check_binaries(self) -> None:
        need = [
            os.path.join(self.config.BIN_K8S, "kube-apiserver"),
            os.path.join(self.config.BIN_K8S, "kube-scheduler"),
            os.path.join(self.config.BIN_ETCD, "etcd"),
            os.path.join(self.kwok_dir, "kwok"),
        ]
        missing = [b for b in need if not os.access(b, os.X_OK)]
        if missing:
            sys.exit(f"missing {', '.join(missing)}: run e2e/node/build.sh kubernetes, etcd and kwok first")

    def up(self) -> None:
        shutil.rmtree(os.path.join(self.state, "etcd"), ignore_errors=True)
        self.components.start_etcd()
        self.components.start_apiserver(self.ip)
        self.components.start_scheduler(self.scheduler_flags)

    def start_kwok(self) -> None:
        self.processes.start(
            "kwok",
            [
                os.path.join(self.kwok_dir, "kwok"),
                "--kubeconfig",
                self.admin,
                "--config",
                os.path.join(self.kwok_dir, "stages.yaml"),
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
                "--node-lease-duration-seconds=40",
                "--cidr=10.0.0.0/16",
                "--node-ip=10.254.0.1",
            ],
        )

    def start_publishers(self, nodes: int, ready: str, claim_watch: bool, case: str = "plain") -> None:
        self.processes.start(
            "publishers",
            [
                sys.executable,
                os.path.abspath(__file__),
                "--publishers-for",
                str(nodes),
                "--kubeconfig",
                self.admin,
                "--ready-file",
                ready,
                *(["--claim-watch"] if claim_watch else []),
                "--case",
                case,
            ],
        )

    def publish_peer(self, template_node: str) -> None:
        """Upstream's DRA test driver as a kubelet plugin of `template_node` (its dirs in the state
        dir), stopped once it has published that node's slice; the slice stays (its helper does not
        delete on stop)."""
        binary = os.path.join(self.config.BIN_K8S, "dra-test-driver")
        if not os.access(binary, os.X_OK):
            sys.exit(f"missing {binary}: run e2e/node/build.sh kubernetes first")
        dirs = {d: os.path.join(self.state, "peer", d) for d in ("plugins", "registry", "cdi")}
        for d in dirs.values():
            os.makedirs(d, exist_ok=True)
        # the driver makes only the parent of its socket's directory
        os.makedirs(os.path.join(dirs["plugins"], PEER_DRIVER), exist_ok=True)
        self.processes.start(
            "peer-driver",
            [
                binary,
                "--kubeconfig",
                self.admin,
                "--drivername",
                PEER_DRIVER,
                "kubelet-plugin",
                "--node-name",
                template_node,
                "--cdi-dir",
                dirs["cdi"],
                "--datadir",
                dirs["plugins"],
                "--plugin-registration-path",
                dirs["registry"],
                "--num-devices",
                "8",
            ],
        )

        def published() -> bool:
            out = subprocess.run(
                [
                    os.path.join(self.config.BIN_K8S, "kubectl"),
                    "--kubeconfig",
                    self.admin,
                    "get",
                    "resourceslices",
                    f"--field-selector=spec.driver={PEER_DRIVER}",
                    "-o",
                    "name",
                ],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            return bool(out.stdout.strip())

        try:
            self.processes.wait_for("peer-driver", published, timeout=60, what="publishing its slice")
        finally:
            pid = self.pid("peer-driver")
            if pid is not None:
                self.processes.stop_pid("peer-driver", pid)

    def start_webhook(self, cert: str, key: str, nvidia_compatible: bool = False) -> None:
        # `dra-gpu controller`, started through the interpreter: the harness knows a process by
        # its program (/proc/PID/exe), which for the console script is Python
        self.processes.start(
            "webhook",
            [
                sys.executable,
                "-m",
                "dra_gpu.cli",
                "controller",
                "--cert",
                cert,
                "--key",
                key,
                "--address",
                "127.0.0.1",
                "--port",
                str(self.webhook_port),
                "--kubeconfig",
                self.admin,
                *(["--nvidia-compatible"] if nvidia_compatible else []),
            ],
        )

        def ready() -> bool:
            ctx = ssl.create_default_context()
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
            url = f"https://127.0.0.1:{self.webhook_port}/readyz"
            with urllib.request.urlopen(url, context=ctx, timeout=3) as r:
                return bool(r.status == 200)

        self.processes.wait_for("webhook", ready, timeout=120, what="ready (caches listed)")

    def pid(self, name: str) -> int | None:
        return self.processes.read_pid(name)

    def stats(self) -> dict[str, dict[str, float]]:
        return {name: proc_stats(self.pid(name)) for name in PROCS}

    def down(self) -> None:
        for name in ("peer-driver", *reversed(PROCS)):
            pid = self.pid(name)
            if pid is not None:
                self.processes.stop_pid(name, pid)

    def _scheduler_get(self, path: str, timeout: float) -> bytes:
        """GET from kube-scheduler's secure port as the bench's admin (delegated authn/authz);
        its serving certificate is self-signed."""
        pki = self.config.PKI
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        ctx.load_cert_chain(os.path.join(pki, "admin.crt"), os.path.join(pki, "admin.key"))
        url = f"https://127.0.0.1:{self.config.SCHEDULER_PORT}{path}"
        with urllib.request.urlopen(url, context=ctx, timeout=timeout) as r:
            return bytes(r.read())

    def scheduler_attempts(self) -> dict[str, float]:
        """kube-scheduler's scheduling attempts so far by result (scheduled, unschedulable, error)
        and the seconds they took (`<result>_s`), from its /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        text = self._scheduler_get("/metrics", 30).decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sm in family.samples:
                result = sm.labels.get("result", "")
                if sm.name == "scheduler_schedule_attempts_total":
                    out[result] = out.get(result, 0.0) + sm.value
                elif sm.name == "scheduler_scheduling_attempt_duration_seconds_sum":
                    out[result + "_s"] = out.get(result + "_s", 0.0) + sm.value
        return out

    def scheduler_profile(self, seconds: int, path: str) -> None:
        """kube-scheduler's CPU profile (its built-in pprof) over the next `seconds`, to `path`."""
        data = self._scheduler_get(f"/debug/pprof/profile?seconds={seconds}", seconds + 60)
        replace_atomically(Path(path), data)

    def request_counts(self) -> dict[str, float]:
        """apiserver_request_total summed per "resource[/subresource] VERB"."""
        from prometheus_client.parser import text_string_to_metric_families

        pki = self.config.PKI
        ctx = ssl.create_default_context(cafile=os.path.join(pki, "ca.crt"))
        ctx.load_cert_chain(os.path.join(pki, "admin.crt"), os.path.join(pki, "admin.key"))
        url = f"https://127.0.0.1:{self.config.APISERVER_PORT}/metrics"
        with urllib.request.urlopen(url, context=ctx, timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            if family.name != "apiserver_request":
                continue
            for s in family.samples:
                if not s.name.endswith("_total"):
                    continue
                res = s.labels.get("resource", "")
                if s.labels.get("subresource"):
                    res += "/" + s.labels["subresource"]
                k = f"{res} {s.labels.get('verb', '')}"
                out[k] = out.get(k, 0.0) + s.value
        return out


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    d = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return {k: v for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if v > 0}


# ---------------------------------------------------------------- the publishers' process


async def run_publishers(
    nodes: int, kubeconfig: str, ready_file: str, claim_watch: bool, case: str = "plain"
) -> None:
    """dra-gpu's SlicePublisher for each simulated node, all in this process, until killed; with
    `claim_watch`, each node's claim watch too (the prepare path's, dra_gpu.plugin.claim_cache).
    `case`: mig, the dgx-h100-mig profile with dynamic MIG on; share, memory shares on; compat-*,
    as gpu.nvidia.com (NVIDIA-compatible mode: only the driver name differs) on EQUAL_FILL's profile."""
    from kubernetes.aio import client as kclient
    from kubernetes.aio import config as kconfig
    from simnode.fake import discover_node

    from dra_gpu.kubeletplugin.metrics import PluginMetrics
    from dra_gpu.kubeletplugin.publisher import SlicePublisher
    from dra_gpu.node.slices import build_slices
    from dra_gpu.plugin.claim_cache import ClaimCache

    configuration = kclient.Configuration()
    await kconfig.load_kube_config(  # type: ignore[no-untyped-call]
        config_file=kubeconfig, client_configuration=configuration
    )
    # One connection per node and watch, as N plugins would hold.
    configuration.connection_pool_maxsize = nodes * (2 if claim_watch else 1) + 16
    kube = Kube(kclient.ApiClient(configuration))
    publishers = []
    profile, dynamic_mig = "dgx-h100-mig" if case in MIG_CASES else PROFILE, case in MIG_CASES
    if case in EQUAL_FILL:
        profile, dynamic_mig, _ = EQUAL_FILL[case]
    driver = case_driver(case)
    offered = MIX_PROFILES if case == "mig-mix" else ()
    for i in range(nodes):
        inventory = discover_node(node_name(i), profile, dynamic_mig=dynamic_mig)

        def build(generation: int, inventory: Any = inventory) -> list[dict[str, Any]]:
            return build_slices(
                inventory, driver, generation, memory_shares=case == "share", mig_profiles=offered
            )

        publishers.append(SlicePublisher(kube, driver, node_name(i), build, PluginMetrics()))
    t0 = time.monotonic()
    starting = asyncio.Semaphore(PUBLISH_CONCURRENCY)

    async def start(publisher: SlicePublisher) -> None:
        async with starting:
            await publisher.start()

    await asyncio.gather(*(start(p) for p in publishers))
    caches = [ClaimCache(kube, driver, node_name(i)) for i in range(nodes)] if claim_watch else []
    watching = [asyncio.create_task(c.run()) for c in caches]

    async def listed() -> bool:
        return all(c.listed for c in caches)

    await wait_until("claim watches listed", listed, timeout=300)
    replace_atomically(Path(ready_file), json.dumps({"publish_s": time.monotonic() - t0}).encode())
    await asyncio.gather(*(p.run() for p in publishers), *watching)


# ---------------------------------------------------------------- one size


async def wait_until(what: str, check: Any, timeout: float, interval: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(interval)
    raise TimeoutError(f"{what}: not after {timeout:.0f} s")


async def untaint(kube: Kube, nodes: int, sem: asyncio.Semaphore) -> None:
    """Lift the node.kubernetes.io/not-ready taint the apiserver puts on a new node: the node
    lifecycle controller's job once the node is Ready (no controller-manager runs here)."""
    from kubernetes.aio import client as kclient

    core = kclient.CoreV1Api(kube.api_client)

    async def one(i: int) -> None:
        async with sem:
            await core.patch_node(node_name(i), {"spec": {"taints": None}})

    await asyncio.gather(*(one(i) for i in range(nodes)))


class InstantInstances:
    """The node side of dynamic MIG's binding conditions for the bench: each node's MigBinder
    (the plugin's code, which reports MigInstanceReady in the claim's status) over a preparer
    stand-in whose instances are made at once; the scheduler binds a pod once that is reported."""

    def __init__(self, kube: Kube, nodes: int, driver: str = DRIVER) -> None:
        from dra_gpu.plugin.mig_binding import MigBinder
        from dra_gpu.plugin.prepare import Preparer

        self.binders = {
            node_name(i): MigBinder(driver, node_name(i), cast(Preparer, self), kube) for i in range(nodes)
        }

    async def bind(self, _ref: Any, claim: dict[str, Any]) -> dict[str, Any]:
        from dra_gpu.model.inventory import MigDevice

        results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results")
        made = {}
        for r in results or []:
            uid = str(claim["metadata"]["uid"])
            made[str(r["device"])] = MigDevice(f"MIG-{uid}-{r['device']}", "", 0, 0, 0, 0, 0, 0, 0)
        return made

    async def see(self, claim: dict[str, Any]) -> None:
        """Hand an allocated claim to its node's binder (dra-gpu's pool is named after its node)."""
        results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results")
        if results and results[0].get("pool") in self.binders:
            await self.binders[str(results[0]["pool"])].on_event("MODIFIED", claim)

    async def stop(self) -> None:
        for b in self.binders.values():
            await b.stop()


class Tracker:
    """Creation and first-seen-allocated times of the claims, from a watch; `instances`: dynamic
    MIG's binding conditions reported for what is allocated."""

    def __init__(self, instances: InstantInstances | None = None) -> None:
        self.created: dict[str, float] = {}
        self.allocated: dict[str, float] = {}
        self.objects: dict[str, dict[str, Any]] = {}
        self.instances = instances

    def see(self, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        self.objects[name] = obj
        if (obj.get("status") or {}).get("allocation") and name not in self.allocated:
            self.allocated[name] = time.monotonic()

    async def on_list(self, items: list[dict[str, Any]], _version: str) -> None:
        for o in items:
            self.see(o)
            if self.instances is not None:
                await self.instances.see(o)

    async def on_event(self, kind: str, obj: dict[str, Any]) -> bool:
        if kind in ("ADDED", "MODIFIED"):
            self.see(obj)
            if self.instances is not None:
                await self.instances.see(obj)
        return True


def cloned_slice(template: dict[str, Any], node: str, index: int) -> dict[str, Any]:
    """A slice of `template`'s pool for `node`: the spec as it is but for the node and pool name
    (devices, counter sets, the pool's generation and slice count unchanged), a name of its own."""
    spec = json.loads(json.dumps(template["spec"]))
    spec["nodeName"] = spec["pool"]["name"] = node
    return {
        "apiVersion": template.get("apiVersion", "resource.k8s.io/v1"),
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{spec['driver']}-{index}"},
        "spec": spec,
    }


async def clone_pool(kube: Kube, templates: list[dict[str, Any]], nodes: int, sem: asyncio.Semaphore) -> None:
    """node_name(0)'s slices, published by a driver's own binary, copied to every other node
    (N such processes would not fit on the bench's machine)."""
    order = sorted(templates, key=lambda t: str(t["metadata"]["name"]))

    async def clone(i: int, k: int, template: dict[str, Any]) -> None:
        async with sem:
            await kube.create(f"{RESOURCE_V1}/resourceslices", cloned_slice(template, node_name(i), k))

    await asyncio.gather(*(clone(i, k, t) for i in range(1, nodes) for k, t in enumerate(order)))


async def publish_peer(cp: ControlPlane, kube: Kube, nodes: int, sem: asyncio.Semaphore) -> None:
    """The peer's slices: its own binary publishes the first node's, the bench copies that slice
    to every other node."""
    cp.publish_peer(node_name(0))
    templates, _ = await kube.list_slices(f"spec.driver={PEER_DRIVER}")
    if len(templates) != 1:
        raise RuntimeError(f"peer driver {PEER_DRIVER}: {len(templates)} slices of node 0, not 1")
    await clone_pool(kube, templates, nodes, sem)


def pool_complete(slices: list[dict[str, Any]]) -> bool:
    """The slices hold one whole pool: all of its newest generation, as many as its
    resourceSliceCount says."""
    if not slices:
        return False
    newest = max(int(s["spec"]["pool"]["generation"]) for s in slices)
    current = [s for s in slices if int(s["spec"]["pool"]["generation"]) == newest]
    return len(current) == len(slices) == int(current[0]["spec"]["pool"]["resourceSliceCount"])


async def publish_nvidia(cp: ControlPlane, kube: Kube, nodes: int, sem: asyncio.Semaphore, case: str) -> None:
    """NVIDIA's slices: its gpu-kubelet-plugin (e2e/node/nvidia_plugin.py) on a simulated node of
    the case's profile publishes node_name(0)'s pool against the bench's apiserver (no kubelet:
    its slice controller needs only the Node object, which KWOK's node is); once the pool is whole
    and has stayed the same for 3 s the plugin is stopped (it deletes nothing) and the pool is
    cloned to every other node."""
    from e2e.node.nvidia_plugin import NvidiaPlugin

    profile, dynamic_mig, _ = EQUAL_FILL[case]
    root = Path(cp.state) / "nvidia"
    shutil.rmtree(root, ignore_errors=True)  # a fresh simulated node: DynamicMIG changes its MIG state
    plugin = NvidiaPlugin.on_profile(
        profile,
        root / "node",
        cp.admin,
        node_name(0),
        root / "plugins",
        root / "plugins_registry",
        root / "cdi",
        feature_gates=["DynamicMIG=true"] if dynamic_mig else [],
        log_path=root / "nvidia-plugin.log",
    )
    selector = f"spec.driver={NVIDIA_DRIVER},spec.nodeName={node_name(0)}"
    plugin.start()
    try:
        deadline = time.monotonic() + NVIDIA_START_WAIT
        seen: list[str] = []
        stable_since = time.monotonic()
        while True:
            if not plugin.running:
                raise RuntimeError(
                    f"NVIDIA's plugin for node {node_name(0)} exited {plugin.returncode}:\n"
                    + plugin.log()[-3000:]
                )
            templates, _ = await kube.list_slices(selector)
            versions = sorted(str(t["metadata"]["resourceVersion"]) for t in templates)
            if versions != seen:
                seen, stable_since = versions, time.monotonic()
            elif pool_complete(templates) and time.monotonic() - stable_since >= 3:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"NVIDIA's plugin for node {node_name(0)}: no whole pool in {NVIDIA_START_WAIT:.0f} s "
                    f"({len(templates)} slices):\n{plugin.log()[-3000:]}"
                )
            await asyncio.sleep(0.5)
    finally:
        plugin.stop()
    templates, _ = await kube.list_slices(selector)
    if not pool_complete(templates):
        raise RuntimeError(f"NVIDIA's slices of node {node_name(0)} changed as its plugin stopped")
    await clone_pool(kube, templates, nodes, sem)


async def one_size(
    cp: ControlPlane,
    nodes: int,
    claims: int,
    settle: float,
    cert: tuple[str, str],
    claim_watch: bool = False,
    case: str = "plain",
    pprof: tuple[int, str] | None = None,
) -> dict[str, Any]:
    """One run; `pprof`: (seconds, file) of a kube-scheduler CPU profile from the first claim on."""
    out: dict[str, Any] = {
        "case": case,
        "nodes": nodes,
        "claims": claims,
        "devices": nodes * 8,
        "claim_watch": claim_watch,
    }
    t_up = time.monotonic()
    cp.up()
    out["control_plane_up_s"] = time.monotonic() - t_up
    kube = await Kube.connect(cp.admin)
    try:
        # NVIDIA's classes only where used: a class with an extendedResourceName is the
        # scheduler's to look at for every pod, and the other cases' figures stay comparable.
        nvidia_classes = chart_device_classes(NVIDIA_DRIVER) if case in EQUAL_FILL else []
        for cls in (GPU_CLASS, MIG_CLASS, PEER_CLASS, *nvidia_classes):
            await kube.create(f"{RESOURCE_V1}/deviceclasses", cls)
        await kube.create(f"/api/v1/namespaces/{NS}/serviceaccounts", {"metadata": {"name": "default"}})
        cp.start_kwok()
        sem = asyncio.Semaphore(16)

        async def create(path: str, body: dict[str, Any]) -> dict[str, Any]:
            async with sem:
                return await kube.create(path, body)

        await asyncio.gather(*(create("/api/v1/nodes", node_body(i)) for i in range(nodes)))

        async def all_ready() -> bool:
            items, _ = await kube.list_objects("/api/v1/nodes", None)
            ready = [
                n
                for n in items
                if any(
                    c.get("type") == "Ready" and c.get("status") == "True"
                    for c in (n.get("status") or {}).get("conditions") or []
                )
            ]
            return len(ready) >= nodes

        await wait_until("nodes Ready (kwok)", all_ready, 180)
        await untaint(kube, nodes, sem)
        before_publish = cp.request_counts()
        ready_file = os.path.join(cp.state, "publishers.ready")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ready_file)
        t_pub = time.monotonic()
        if case == "peer":
            await publish_peer(cp, kube, nodes, sem)
            out["publish_s"] = out["publish_wall_s"] = time.monotonic() - t_pub
        elif EQUAL_FILL.get(case, ("", False, ""))[2] == "nvidia":
            await publish_nvidia(cp, kube, nodes, sem, case)
            out["publish_s"] = out["publish_wall_s"] = time.monotonic() - t_pub
        else:
            cp.start_publishers(nodes, ready_file, claim_watch, case)
            cp.processes.wait_for(
                "publishers", lambda: os.path.exists(ready_file), timeout=600, what="published"
            )
            out["publish_wall_s"] = time.monotonic() - t_pub
            with open(ready_file) as f:
                out["publish_s"] = json.load(f)["publish_s"]
        driver = case_driver(case)
        slices, _ = await kube.list_slices(f"spec.driver={driver}")
        out["slice_bytes"] = sum(len(json.dumps(s["spec"])) for s in slices)
        out["slices"] = len(slices)
        out["published_devices"] = sum(len(s["spec"].get("devices") or []) for s in slices)
        out["devices_by_type"] = devices_by_type(slices, driver)
        out["nodes_with_slices"] = len({s["spec"].get("nodeName") for s in slices})
        cp.start_webhook(*cert, nvidia_compatible=driver == NVIDIA_DRIVER)
        # let the publishers' watches settle before the scheduling phase is measured
        await asyncio.sleep(2)
        out["requests_publish"] = diff(cp.request_counts(), before_publish)
        stats0 = cp.stats()
        before_claims = cp.request_counts()
        attempts0 = cp.scheduler_attempts()
        out["load_before"] = loadavg()

        # dynamic MIG's binding conditions: dra-gpu's (NVIDIA's driver publishes none)
        binding = case in MIG_CASES or case == "compat-dynamic-mig"
        instances = InstantInstances(kube, nodes, driver) if binding else None
        tracker = Tracker(instances)
        watch = asyncio.create_task(
            list_watch(
                kube, f"{RESOURCE_V1}/namespaces/{NS}/resourceclaims", tracker.on_list, tracker.on_event
            )
        )

        async def claim_and_pod(i: int) -> None:
            async with sem:
                c = await kube.create(f"{RESOURCE_V1}/namespaces/{NS}/resourceclaims", claim_body(i, case))
                tracker.created[c["metadata"]["name"]] = time.monotonic()
                await kube.create(f"/api/v1/namespaces/{NS}/pods", pod_body(i))

        profiling = asyncio.create_task(asyncio.to_thread(cp.scheduler_profile, *pprof)) if pprof else None
        t0 = time.monotonic()
        await asyncio.gather(*(claim_and_pod(i) for i in range(claims)))
        out["create_s"] = time.monotonic() - t0
        # settled: all allocated, or no new allocation for `settle` seconds (capped at 15 min)
        last, seen = time.monotonic(), -1
        while len(tracker.allocated) < claims and time.monotonic() - t0 < 900:
            if len(tracker.allocated) != seen:
                last, seen = time.monotonic(), len(tracker.allocated)
            elif time.monotonic() - last > settle:
                break
            await asyncio.sleep(0.5)
        # ...and the allocated claims' pods bound: a dynamic-MIG pod waits in PreBind for its binding
        # condition, which the scheduler looks at every 5 s; the phase's CPU includes the binding
        bound_by = time.monotonic() + 120
        while time.monotonic() < bound_by:
            scheduled = cp.scheduler_attempts().get("scheduled", 0.0) - attempts0.get("scheduled", 0.0)
            if scheduled >= len(tracker.allocated):
                break
            await asyncio.sleep(1)
        out["bound_s"] = time.monotonic() - t0
        out["load_after"] = loadavg()
        stats1 = cp.stats()
        out["requests_claims"] = diff(cp.request_counts(), before_claims)
        out["scheduler_attempts"] = diff(cp.scheduler_attempts(), attempts0)
        if profiling is not None and pprof is not None:
            await profiling
            out["pprof_top"] = pprof_top(pprof[1])
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
        if instances is not None:
            await instances.stop()

        lat = [tracker.allocated[n] - tracker.created[n] for n in tracker.allocated if n in tracker.created]
        last_alloc = max(tracker.allocated.values(), default=t0)
        out["allocated"] = len(tracker.allocated)
        out["alloc_span_s"] = last_alloc - t0
        out["throughput_per_s"] = len(tracker.allocated) / (last_alloc - t0) if tracker.allocated else 0.0
        out["latency_p50_s"] = pct(lat, 50)
        out["latency_p99_s"] = pct(lat, 99)
        out["procs"] = {
            name: {
                "cpu_publish_s": stats0[name]["cpu_s"],
                "cpu_claims_s": stats1[name]["cpu_s"] - stats0[name]["cpu_s"],
                "rss_mib": stats1[name]["rss_mib"],
                "hwm_mib": stats1[name]["hwm_mib"],
            }
            for name in PROCS
        }
        if case == "plain":  # explain's agreement and `top` are measured on the plain case
            final_claims, _ = await kube.list_objects(f"{RESOURCE_V1}/namespaces/{NS}/resourceclaims", None)
            slices, _ = await kube.list_slices(f"spec.driver={DRIVER}")
            t_ex = time.monotonic()
            out["explain"] = agreement(slices, final_claims)
            out["explain"]["seconds"] = time.monotonic() - t_ex
            out["top"] = top_timings(cp.admin)
        return out
    finally:
        await kube.close()
        cp.down()


def devices_by_type(slices: list[dict[str, Any]], driver: str) -> dict[str, int]:
    """Published devices by their `type` attribute (the driver's own, unqualified or qualified;
    "-" for none, as the peer's)."""
    out: dict[str, int] = {}
    for s in slices:
        for d in s["spec"].get("devices") or []:
            attrs = d.get("attributes") or {}
            value = (attrs.get("type") or attrs.get(f"{driver}/type") or {}).get("string", "-")
            out[str(value)] = out.get(str(value), 0) + 1
    return dict(sorted(out.items()))


def pprof_top(profile: str, lines: int = 25) -> list[str]:
    """`go tool pprof -top` of a CPU profile (the Go toolchain's), its first `lines` lines."""
    go = shutil.which("go")
    if go is None:
        return ["(no go toolchain: pprof -top not run)"]
    proc = subprocess.run(
        [go, "tool", "pprof", "-top", f"-nodecount={lines}", profile],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return (proc.stdout or proc.stderr).splitlines()[: lines + 6]


# ---------------------------------------------------------------- dra-gpu top
def top_timings(kubeconfig: str) -> dict[str, Any]:
    """`dra-gpu top` of the final cluster as an operator runs it (a fresh process: start, list
    slices, claims, pods and taint rules, decode, render), as JSON and as the 80-column text."""
    out: dict[str, Any] = {}
    for output in ("json", "text"):
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "dra_gpu.cli", "top", "--kubeconfig", kubeconfig, "-o", output],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "COLUMNS": "80"},
            check=False,
        )
        out[f"{output}_s"] = time.monotonic() - t0
        if proc.returncode != 0:
            out[f"{output}_error"] = proc.stderr[-500:]
        elif output == "json":
            view = json.loads(proc.stdout)
            out["nodes"] = len(view.get("nodes") or [])
        else:
            out["text_lines"] = len(proc.stdout.splitlines())
    return out


# ---------------------------------------------------------------- explain agreement


def agreement(slices: list[dict[str, Any]], claims: list[dict[str, Any]]) -> dict[str, Any]:
    """Compare each claim's outcome in the scheduler with dra-gpu's explain (module docstring)."""
    from dra_gpu.controller.allocator import place
    from dra_gpu.controller.allocator_view import Cluster, allocated_devices
    from dra_gpu.controller.explain import explain
    from dra_gpu.controller.rules import Validator

    validator = Validator(DRIVER, slices, [GPU_CLASS])
    allocated = [c for c in claims if (c.get("status") or {}).get("allocation")]
    cluster = Cluster(validator.env, slices, {DRIVER: GPU_CLASS}, allocated_devices(allocated))
    domain = {
        (s["spec"]["pool"]["name"], d["name"]): (d.get("attributes") or {})
        .get("nvlinkDomain", {})
        .get("string")
        for s in slices
        for d in s["spec"].get("devices") or []
    }
    res: dict[str, Any] = {
        "allocated": len(allocated),
        "allocated_agree": 0,
        "pending": len(claims) - len(allocated),
        "pending_agree": 0,
        "same_domain_count": 0,
        "disagreements": [],
    }
    for c in claims:
        name = c["metadata"]["name"]
        results = (((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get(
            "results"
        ) or []
        if results:
            node = str(results[0]["pool"])  # dra-gpu's pool is named after its node
            mine = allocated_devices([c])
            others = cluster.in_use - mine
            try:
                # explain's own choice on that node, every other allocation in use
                cluster.in_use = others
                free_choice = place(cluster, c["spec"], node)
                # the scheduler's exact devices: every other device of the node taken
                cluster.in_use = others | ({d.key for d in cluster.devices(node)} - mine)
                exact = place(cluster, c["spec"], node)
            finally:
                cluster.in_use = others | mine
            if exact is None:
                res["disagreements"].append(
                    f"{name}: scheduler allocated {sorted(d for _, _, d in mine)} on {node}, "
                    "explain finds no placement there with exactly those devices"
                )
                continue
            res["allocated_agree"] += 1
            theirs = {domain.get((node, d)) for _, _, d in mine}
            ours = {domain.get((node, d)) for d in (free_choice or exact).devices}
            res["same_domain_count"] += len(theirs) == len(ours)
        else:
            e = explain(cluster, c["spec"])
            if e.allocatable and e.placement is not None:
                res["disagreements"].append(f"{name}: pending, explain places it on {e.placement.node}")
            else:
                res["pending_agree"] += 1
    total = len(claims)
    res["agree_pct"] = 100.0 * (res["allocated_agree"] + res["pending_agree"]) / total if total else 100.0
    res["disagreements"] = res["disagreements"][:20]
    return res


# ---------------------------------------------------------------- report


def report(r: dict[str, Any]) -> str:
    p = r["procs"]
    ex = r.get("explain")
    case = r.get("case", "plain")
    lines = [
        f"== {r['nodes']} nodes, case {case}: {r['devices']} GPUs published in {r['slices']} slices "
        f"({r['published_devices']} devices, {r.get('slice_bytes', 0) / 1e6:.1f} MB of specs), "
        f"{r['claims']} claims" + (", every node with its claim watch" if r.get("claim_watch") else ""),
        "  devices a node by type: "
        + (", ".join(f"{t} {n / r['nodes']:g}" for t, n in (r.get("devices_by_type") or {}).items()) or "-")
        + f"; nodes with slices: {r.get('nodes_with_slices', '?')}/{r['nodes']}",
        f"  control plane up {r['control_plane_up_s']:.1f} s; publishers: all {r['nodes']} synced in "
        f"{r['publish_s']:.2f} s (process start to ready {r['publish_wall_s']:.2f} s)",
        f"  claims+pods created in {r['create_s']:.1f} s; allocated {r['allocated']}/{r['claims']} in "
        f"{r['alloc_span_s']:.1f} s: {r['throughput_per_s']:.1f} claims/s; created->allocated "
        f"p50 {r['latency_p50_s']:.2f} s, p99 {r['latency_p99_s']:.2f} s",
        f"  all allocated claims' pods bound {r.get('bound_s', float('nan')):.1f} s after the first claim; "
        f"load average before/after: {r['load_before']} / {r['load_after']}",
        "  process          RSS MiB  peak MiB  CPU s (publish+setup)  CPU s (claims phase)",
    ]
    for name, s in p.items():
        lines.append(
            f"  {name:<15} {s['rss_mib']:8.1f} {s['hwm_mib']:9.1f} "
            f"{s['cpu_publish_s']:22.1f} {s['cpu_claims_s']:21.1f}"
        )
    for phase in ("publish", "claims"):
        req = r[f"requests_{phase}"]
        busiest = ", ".join(f"{k} {v:.0f}" for k, v in list(req.items())[:8])
        lines.append(f"  apiserver requests ({phase} phase): {sum(req.values()):.0f}: {busiest}")
    att = r.get("scheduler_attempts")
    if att is not None:
        cpu = p["kube-scheduler"]["cpu_claims_s"]
        lines.append(
            f"  kube-scheduler: {cpu:.1f} CPU s in the claims phase, "
            f"{1000 * cpu / max(1, r['allocated']):.1f} ms per allocated claim, "
            f"{sched_ms_per_attempt(r):.1f} ms per attempt; attempts: "
            + ", ".join(f"{k} {v:.0f}" for k, v in att.items() if not k.endswith("_s"))
            + "; attempt seconds: "
            + ", ".join(f"{k[:-2]} {v:.1f}" for k, v in att.items() if k.endswith("_s"))
        )
    if ex is None:
        lines += [f"  pprof: {x}" for x in r.get("pprof_top") or []]
        return "\n".join(lines)
    lines.append(
        f"  explain agrees on {ex['allocated_agree']}/{ex['allocated']} allocated and "
        f"{ex['pending_agree']}/{ex['pending']} pending claims: {ex['agree_pct']:.1f} % "
        f"(same NVLink-domain count as the scheduler's devices: {ex['same_domain_count']}/{ex['allocated']}; "
        f"{ex['seconds']:.1f} s)"
    )
    top = r.get("top") or {}
    if top:
        errors = "; ".join(f"{k}: {v}" for k, v in top.items() if k.endswith("_error"))
        lines.append(
            f"  dra-gpu top (a fresh process: list, decode, render): -o json {top['json_s']:.2f} s "
            f"({top.get('nodes', '?')} nodes), text {top['text_s']:.2f} s "
            f"({top.get('text_lines', '?')} lines)" + (f"; FAILED {errors}" if errors else "")
        )
    for d in ex["disagreements"]:
        lines.append(f"    disagrees: {d}")
    lines += [f"  pprof: {x}" for x in r.get("pprof_top") or []]
    return "\n".join(lines)


# (column title, how to get it from one size's figures)
SUMMARY: list[tuple[str, Any]] = [
    ("allocated", lambda r: r["allocated"]),
    ("claims/s", lambda r: r["throughput_per_s"]),
    ("p50 s", lambda r: r["latency_p50_s"]),
    ("p99 s", lambda r: r["latency_p99_s"]),
    ("pub MiB", lambda r: r["procs"]["publishers"]["rss_mib"]),
    (
        "pub CPU s",
        lambda r: r["procs"]["publishers"]["cpu_publish_s"] + r["procs"]["publishers"]["cpu_claims_s"],
    ),
    ("hook MiB", lambda r: r["procs"]["webhook"]["rss_mib"]),
    ("hook CPU s", lambda r: r["procs"]["webhook"]["cpu_publish_s"] + r["procs"]["webhook"]["cpu_claims_s"]),
    ("sched CPU s", lambda r: r["procs"]["kube-scheduler"]["cpu_claims_s"]),
    ("api CPU s", lambda r: r["procs"]["kube-apiserver"]["cpu_claims_s"]),
    ("slice req", lambda r: slice_requests(r["requests_publish"])),
    ("req claims", lambda r: sum(r["requests_claims"].values())),
    ("explain %", lambda r: r["explain"]["agree_pct"] if r.get("explain") else float("nan")),
]


def slice_requests(counts: dict[str, float]) -> float:
    """Requests on ResourceSlices: the publishers' (and one list each of the webhook and the bench)."""
    return float(sum(v for k, v in counts.items() if k.startswith("resourceslices ")))


def summary(results: list[dict[str, Any]]) -> str:
    """One row per size, then each figure's growth from the smallest size to the largest."""
    lines = ["nodes " + " ".join(f"{t:>11}" for t, _ in SUMMARY)]
    for r in results:
        lines.append(f"{r['nodes']:>5} " + " ".join(f"{get(r):>11.5g}" for _, get in SUMMARY))
    if len(results) > 1:
        a, b = results[0], results[-1]
        growth = []
        for _, get in SUMMARY:
            x, y = float(get(a)), float(get(b))
            growth.append(f"x{y / x:.2f}" if x else "-")
        lines.append(f"growth from {a['nodes']} to {b['nodes']} nodes (x{b['nodes'] / a['nodes']:.1f}):")
        lines.append("      " + " ".join(f"{g:>11}" for g in growth))
    return "\n".join(lines)


def sched_ms_per_claim(r: dict[str, Any]) -> float:
    return 1000 * float(r["procs"]["kube-scheduler"]["cpu_claims_s"]) / max(1, int(r["allocated"]))


def sched_ms_per_attempt(r: dict[str, Any]) -> float:
    tries = sum(v for k, v in (r.get("scheduler_attempts") or {}).items() if not k.endswith("_s"))
    return 1000 * float(r["procs"]["kube-scheduler"]["cpu_claims_s"]) / tries if tries else float("nan")


def case_table(results: list[dict[str, Any]]) -> str:
    """Per size, each case's scheduling figures and its ratios to the plain and peer cases of the
    same run (CPU per allocated claim, per attempt; throughput)."""
    lines = [
        "nodes case               devices alloc  claims/s  p50 s  p99 s sched CPU s ms/claim ms/attempt"
        "  xplain(claim,attempt,tput)  xpeer(claim,attempt,tput)"
    ]
    for n in sorted({r["nodes"] for r in results}):
        by_case = {r.get("case", "plain"): r for r in results if r["nodes"] == n}

        def ratios(r: dict[str, Any], base: dict[str, Any] | None) -> str:
            if base is None:
                return f"{'-':>26}"
            f = [
                sched_ms_per_claim(r) / sched_ms_per_claim(base),
                sched_ms_per_attempt(r) / sched_ms_per_attempt(base),
                r["throughput_per_s"] / base["throughput_per_s"]
                if base["throughput_per_s"]
                else float("nan"),
            ]
            return f"{' '.join(f'{x:6.2f}' for x in f):>26}"

        for case, r in by_case.items():
            lines.append(
                f"{n:>5} {case:<18} {r['published_devices']:>7} {r['allocated']:>5} "
                f"{r['throughput_per_s']:>9.1f} {r['latency_p50_s']:>6.2f} {r['latency_p99_s']:>6.2f} "
                f"{r['procs']['kube-scheduler']['cpu_claims_s']:>11.1f} {sched_ms_per_claim(r):>8.1f} "
                f"{sched_ms_per_attempt(r):>10.1f}  {ratios(r, by_case.get('plain'))}  "
                f"{ratios(r, by_case.get('peer'))}"
            )
    return "\n".join(lines)


def equal_fill_table(results: list[dict[str, Any]]) -> str:
    """Per size, each compat case against its NVIDIA counterpart of the same run: devices a node,
    claims allocated, kube-scheduler CPU per allocated claim and per attempt, and compat's ratio to
    NVIDIA's. A pair whose claims were not all allocated by both is flagged: its per-claim figures
    compare unlike loads."""
    lines = [
        f"{'nodes':>5} {'pair':<13} {'driver':<7} {'dev/node':>8} {'mig/node':>9} {'alloc/claims':<12} "
        f"{'ms/claim':>8} {'ms/attempt':>10}  {'compat/nvidia(claim,attempt)':>28}"
    ]
    for n in sorted({r["nodes"] for r in results}):
        by_case = {r.get("case", "plain"): r for r in results if r["nodes"] == n}
        for case, compat in by_case.items():
            nvidia = by_case.get(counterpart(case) or "")
            if not case.startswith("compat-") or nvidia is None:
                continue
            pair = case.removeprefix("compat-")
            for who, r in (("nvidia", nvidia), ("compat", compat)):
                mig = (r.get("devices_by_type") or {}).get("mig", 0)
                ratio = ""
                if who == "compat":
                    ratio = (
                        f"{sched_ms_per_claim(compat) / sched_ms_per_claim(nvidia):6.2f} "
                        f"{sched_ms_per_attempt(compat) / sched_ms_per_attempt(nvidia):6.2f}"
                    )
                lines.append(
                    f"{n:>5} {pair:<13} {who:<7} {r['published_devices'] / n:>8g} {mig / n:>9g} "
                    f"{r['allocated']:>5}/{r['claims']:<6} {sched_ms_per_claim(r):>8.1f} "
                    f"{sched_ms_per_attempt(r):>10.1f}  {ratio:>28}"
                )
            problem = unequal_fill(nvidia, compat)
            if problem:
                lines.append(f"      !!! UNEQUAL FILL ({pair}, {n} nodes): {problem}")
    return "\n".join(lines)


def unequal_fill(nvidia: dict[str, Any], compat: dict[str, Any]) -> str | None:
    """Why a compat/NVIDIA pair's per-claim figures do not compare like with like, else None."""
    problems = []
    for who, r in (("NVIDIA", nvidia), ("compat", compat)):
        if r["allocated"] != r["claims"]:
            problems.append(f"{who} allocated {r['allocated']} of {r['claims']} claims")
        if r.get("nodes_with_slices", r["nodes"]) != r["nodes"]:
            problems.append(f"{who}'s slices on {r.get('nodes_with_slices')} of {r['nodes']} nodes")
    if (nvidia["nodes"], nvidia["claims"]) != (compat["nodes"], compat["claims"]):
        problems.append(
            f"NVIDIA {nvidia['nodes']} nodes, {nvidia['claims']} claims; "
            f"compat {compat['nodes']} nodes, {compat['claims']} claims"
        )
    return "; ".join(problems) or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="50,100", help="comma-separated node counts")
    ap.add_argument("--claims", type=int, default=1000)
    ap.add_argument("--settle", type=float, default=30.0, help="seconds without an allocation that end a run")
    ap.add_argument("--port-base", type=int, default=26000, help="ports used: base+10..12, +259, +443, +843")
    ap.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the state dir (logs) at the end")
    ap.add_argument(
        "--scheduler-qps",
        type=float,
        help="kube-scheduler's client QPS (burst twice that); default: upstream's 50",
    )
    ap.add_argument(
        "--claim-watch",
        action="store_true",
        help="each node also keeps the kubelet plugin's claim watch (every claim event to every node)",
    )
    ap.add_argument(
        "--cases",
        default="plain",
        help="comma-separated, each size runs each in turn: "
        + "; ".join(f"{k}: {v}" for k, v in CASES.items()),
    )
    ap.add_argument(
        "--pprof-seconds", type=int, default=0, help="profile kube-scheduler this long from the first claim"
    )
    ap.add_argument("--pprof-dir", default=".", help="where the profiles go (scheduler-<case>-<nodes>.pprof)")
    ap.add_argument("--case", default="plain", help=argparse.SUPPRESS)
    ap.add_argument("--publishers-for", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--kubeconfig", help=argparse.SUPPRESS)
    ap.add_argument("--ready-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.publishers_for:
        asyncio.run(
            run_publishers(args.publishers_for, args.kubeconfig, args.ready_file, args.claim_watch, args.case)
        )
        return
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        sys.exit(f"unknown case(s) {', '.join(unknown)}: one of {', '.join(CASES)}")

    from tests.controller.test_webhook import make_cert

    state = tempfile.mkdtemp(prefix="dra-gpu-scale-")
    results = []
    cp = ControlPlane(state, args.port_base, args.scheduler_qps)
    try:
        cp.check_binaries()
        cert, key = make_cert(Path(state), "scale-bench-webhook")
        qps = f"{args.scheduler_qps:g}" if args.scheduler_qps else "50 (default)"
        print(
            f"machine: {os.cpu_count()} CPUs, load average {loadavg()}; kube-scheduler QPS {qps}", flush=True
        )
        for n in (int(x) for x in args.nodes.split(",")):
            for case in cases:
                pprof = (
                    (args.pprof_seconds, os.path.join(args.pprof_dir, f"scheduler-{case}-{n}.pprof"))
                    if args.pprof_seconds
                    else None
                )
                r = asyncio.run(
                    one_size(
                        cp, n, args.claims, args.settle, (str(cert), str(key)), args.claim_watch, case, pprof
                    )
                )
                results.append(r)
                print(report(r), flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=1))
        if cases == ["plain"]:
            print(summary(results), flush=True)
        else:
            print(case_table(results), flush=True)
        if any(counterpart(c) in cases for c in cases):
            print(equal_fill_table(results), flush=True)
    except Exception:
        for name in PROCS:
            print(f"---- last lines of {name}'s log ----\n{cp.processes.log_tail(name, 15)}", file=sys.stderr)
        raise
    finally:
        if args.keep:
            print(f"state, logs: {state}", file=sys.stderr)
        else:
            shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()
