"""NodePrepareResources against NVIDIA's own DRA kubelet plugin (gpu-kubelet-plugin of
sigs.k8s.io/dra-driver-nvidia-gpu, the pin of e2e/node/versions.sh), driven over dra.sock as the
kubelet does; upstream's DRA test driver (`e2e/cluster peer-driver start`) only as a floor.

Needs the local e2e cluster (`e2e/cluster up`, root, `eval "$(e2e/cluster env)"`) and NVIDIA's
binaries (`e2e/node/build.sh nvidia-dra toolkit`). Both plugins run as host processes on one
simulated node made once for the bench (its device nodes, kernel files and driver under a
scratch directory): a bench profile of `--gpus` whole H100s (default 56, so that 56 claims in
flight hold 56 GPUs, each claim one GPU exclusively). dra-gpu runs with `--nvidia-compatible`,
so both are driver gpu.nvidia.com, publish pool = the node's name, and get identical claims: a
claim per GPU, allocated (as the scheduler leaves it, through the claim's status) to the device
that plugin publishes for that GPU (NVIDIA's `gpu-<minor>`, dra-gpu's PCI-derived names; matched
by the GPU's `uuid` attribute, which both publish). Both register with the real kubelet, write
their CDI specs where containerd reads them, and are never running at the same time.

Phases, each with only its plugin running (started for the phase, stopped after, its slices
deleted before the next starts), in a random order per run (`--seed`, printed):
  - dra-gpu / NVIDIA, exclusive whole GPUs (no config);
  - dra-gpu / NVIDIA, time-sliced (`--sharing exclusive,timeslice`): NVIDIA's
    resource.nvidia.com/v1beta1 GpuConfig, strategy TimeSlicing, in every claim (NVIDIA's plugin
    with `--feature-gates TimeSlicingSettings=true`);
  - the floor: upstream's test driver (4 devices, no real prepare work) on the same claims' shape.
Per phase, for each of `--levels` (claims in flight, default 1, 8, 56), `--batches` batches of
one claim per GPU: the claims prepared one-claim NodePrepareResources call each, that many calls
in flight at a time (a worker per call in flight), then held until the plugin's claim-status
writes reached the apiserver (dra-gpu writes status.devices; NVIDIA's plugin writes none: the
count is printed), then unprepared the same way. Reported:
  - prepare latency (call -> reply) p50 / p99 per level, unprepare p50 per level;
  - every answer checked: a prepare must name exactly the claim's allocated pool and device with a
    CDI device; an error in any prepare or unprepare answer fails the run;
  - the plugin's CPU per claim over the levels (its process tree: itself, its reaped children,
    such as nvidia-smi, and any still running), and containerd's CPU per claim from the phase's
    start until it is idle again (each phase starts once containerd is idle);
  - plugin RSS at rest (slices published, 2 s without requests), right after the run and 3 s after;
    start to slices published; load average at the phase's start and end.
NVIDIA's client rate limit (client-go QPS 5 / burst 10 by default; its chart sets none) is raised
so that it never binds, as the floor's is (`--nvidia-client-defaults` runs it as shipped).

`--probe` first prepares one time-sliced and one MPS claim (NVIDIA's GpuConfig, gates
TimeSlicingSettings and MPSSupport) on each plugin and prints each answer as it came: whether
NVIDIA's sharing paths can run on this node at all. Static MIG is not benched: NVIDIA's MIG prepare
reads the host's own /proc/driver/nvidia/capabilities (no override), which a simulated node has not.

Run: .venv/bin/python bench/nvidia_peer_bench.py [--runs 7] [--batches 4] [--levels 1,8,56]
     [--gpus 56] [--sharing exclusive[,timeslice]] [--no-floor] [--seed N] [--probe]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import grpc
import yaml
from kubernetes import client, config

from dra_gpu.kubeletplugin._proto import dra_v1_pb2 as pb
from dra_gpu.kubeletplugin._proto import dra_v1_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.prepare_bench import pid_of, runtime_cpu, settle_runtime, status_applies  # noqa: E402
from bench.process_memory import memory  # noqa: E402

KUBELET_ROOT = Path(os.environ.get("DRA_GPU_E2E_KUBELET_ROOT", "/var/lib/kubelet"))
CDI_DIR = Path("/var/run/cdi")  # where containerd reads CDI specs (both plugins write there)
NVIDIA = "gpu.nvidia.com"  # the driver name of both plugins
FLOOR = "gpu.example.com"  # upstream's test driver (`e2e/cluster peer-driver start`)
GROUP, VERSION = "resource.k8s.io", "v1"
CONFIG_API = "resource.nvidia.com/v1beta1"
REQUEST = "gpu"
PLUGINS = ("dra-gpu", "nvidia", "floor")
SHARINGS = ("exclusive", "timeslice")
REST_S = 2.0  # RSS "at rest": this long after the slices are published, before any request
IDLE_S = 3.0  # RSS again this long after the run (dra-gpu gives a burst's memory back after 1 s)
WARM_UP_CLAIMS = 5
START_TIMEOUT_S = 120.0
STATUS_WAIT_S = 30.0
CALL_TIMEOUT_S = 60.0
NVIDIA_UNBOUND_CLIENT = ["--kube-api-qps", "100000", "--kube-api-burst", "100000"]


# ---- pure helpers (tests/test_nvidia_peer_bench.py) ------------------------------------------


def bench_profile(gpus: int) -> dict[str, Any]:
    """A simulated node of `gpus` whole H100 80GB (dgx-h100's GPU, MIG off), two NUMA nodes, four
    GPUs a PCIe root; no NVLinks (no claim here asks for them)."""
    return {
        "name": f"bench-{gpus}x-h100",
        "description": f"{gpus} whole H100 80GB HBM3 (nvidia_peer_bench)",
        "driverVersion": "570.133.20",
        "cudaDriverVersion": 12080,
        "defaults": {
            "name": "NVIDIA H100 80GB HBM3",
            "brand": "nvidia",
            "architecture": "hopper",
            "computeCapability": "9.0",
            "memoryMiB": 81559,
        },
        "gpus": [
            {
                "index": i,
                "uuid": f"GPU-{i:08x}-b3c4-4d5e-8f60-{i:012x}",
                "pciBusId": f"00000000:{0x10 + i:02X}:00.0",
                "numaNode": 0 if i < (gpus + 1) // 2 else 1,
                "pcieRoot": f"pci0000:{0x10 + i // 4 * 4:02x}",
            }
            for i in range(gpus)
        ],
    }


def profile_uuids(profile: Mapping[str, Any]) -> list[str]:
    """The profile's GPU UUIDs in index order: the order claims are made and used in."""
    return [g["uuid"] for g in sorted(profile["gpus"], key=lambda g: g["index"])]


def device_uuid(device: Mapping[str, Any], driver: str = NVIDIA) -> str | None:
    """A published device's `uuid` attribute (unqualified, or qualified with the driver's name)."""
    attrs = device.get("attributes") or {}
    value = attrs.get("uuid") or attrs.get(f"{driver}/uuid")
    return None if value is None else str(value.get("string"))


def devices_by_uuid(slices: Iterable[Mapping[str, Any]], driver: str = NVIDIA) -> dict[str, str]:
    """GPU UUID -> device name over the driver's published devices; a device without a UUID, or a
    UUID published twice, is an error naming the device."""
    out: dict[str, str] = {}
    for s in slices:
        if s["spec"]["driver"] != driver:
            continue
        for d in s["spec"].get("devices") or []:
            u = device_uuid(d, driver)
            if u is None:
                raise ValueError(f"slice {s['metadata']['name']}: device {d['name']} has no uuid attribute")
            if u in out:
                raise ValueError(f"slice {s['metadata']['name']}: {u} published as {out[u]} and {d['name']}")
            out[u] = d["name"]
    return out


def sharing_config(sharing: str) -> dict[str, Any] | None:
    """NVIDIA's opaque GpuConfig for a sharing mode (None: exclusive, no config). The time-slice
    interval is gpu-test5's."""
    if sharing == "exclusive":
        return None
    if sharing == "timeslice":
        sharing_ = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}
    elif sharing == "mps":
        sharing_ = {
            "strategy": "MPS",
            "mpsConfig": {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi"},
        }
    else:
        raise ValueError(f"sharing {sharing!r}: not one of exclusive, timeslice, mps")
    return {"apiVersion": CONFIG_API, "kind": "GpuConfig", "sharing": sharing_}


def claim_body(name: str, device_class: str, parameters: Mapping[str, Any] | None) -> dict[str, Any]:
    """A ResourceClaim asking one device of the class, with the opaque config if any."""
    devices: dict[str, Any] = {"requests": [{"name": REQUEST, "exactly": {"deviceClassName": device_class}}]}
    if parameters is not None:
        devices["config"] = [
            {"requests": [REQUEST], "opaque": {"driver": NVIDIA, "parameters": dict(parameters)}}
        ]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": devices},
    }


def allocated_status(
    driver: str,
    node: str,
    device: str,
    holder: Mapping[str, str],
    parameters: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The status the scheduler leaves on such a claim: the device allocated on `node` (pool =
    node name), the claim's config copied into the allocation (source FromClaim), reserved for
    `holder`."""
    devices: dict[str, Any] = {
        "results": [{"request": REQUEST, "driver": driver, "pool": node, "device": device}]
    }
    if parameters is not None:
        devices["config"] = [
            {
                "source": "FromClaim",
                "requests": [REQUEST],
                "opaque": {"driver": driver, "parameters": dict(parameters)},
            }
        ]
    return {
        "allocation": {
            "devices": devices,
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]
            },
        },
        "reservedFor": [dict(holder)],
    }


def refusal_kind(error: str) -> str:
    """A refused prepare's error without what differs claim by claim (names, UIDs, paths'
    directories), so that equal causes count together."""
    text = re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "<uid>", error)
    text = re.sub(r"bench-[0-9a-z-]+/bench-[0-9a-f]+", "<claim>", text)
    return re.sub(r"/tmp/[^ )]*/", ".../", text)[:300]


def prepare_error(answer: Any, pool: str, device: str) -> str | None:
    """What is wrong with one claim's NodePrepareResources answer (None: nothing): an error, or
    devices other than exactly the allocated one with at least one CDI device."""
    if answer is None:
        return "no answer for the claim"
    if answer.error:
        return f"error: {answer.error}"
    got = [(d.pool_name, d.device_name, list(d.request_names), len(d.cdi_device_ids)) for d in answer.devices]
    if len(got) != 1 or got[0][:2] != (pool, device) or got[0][2] != [REQUEST] or not got[0][3]:
        return f"devices {got}, want [({pool!r}, {device!r}, [{REQUEST!r}], >= 1 CDI device)]"
    return None


@dataclass(frozen=True)
class ProcStat:
    ppid: int
    own: int  # clock ticks: user + system
    children: int  # clock ticks of its reaped children: cutime + cstime


def parse_stat(text: str) -> ProcStat:
    """/proc/<pid>/stat (the command name may hold spaces and parentheses)."""
    fields = text.rpartition(")")[2].split()
    return ProcStat(int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14]))


def tree_ticks(stats: Mapping[int, ProcStat], root: int) -> int:
    """CPU ticks of `root`'s process tree: every live process under it, each with the children it
    has reaped (an exited child's CPU lands in its parent's cutime/cstime when it is waited for)."""
    kids: dict[int, list[int]] = {}
    for pid, st in stats.items():
        kids.setdefault(st.ppid, []).append(pid)
    total, todo, seen = 0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in stats:
            continue
        seen.add(pid)
        total += stats[pid].own + stats[pid].children
        todo.extend(kids.get(pid, ()))
    return total


def pct(values: Sequence[float], p: float) -> float:
    """The p-th percentile, nearest rank."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))]


def split_workers(items: Sequence[Any], inflight: int) -> list[list[Any]]:
    """`inflight` workers' shares of the items, round robin: worker k takes items k, k+n, ..."""
    n = max(1, min(inflight, len(items)))
    return [list(items[k::n]) for k in range(n)]


def phase_orders(seed: int, runs: int, phases: Sequence[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """Each run's phases in a random order, reproducible from the seed."""
    rng = random.Random(seed)
    return [rng.sample(list(phases), len(phases)) for _ in range(runs)]


def parse_levels(text: str, gpus: int) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or any(c < 1 or c > gpus for c in levels):
        raise ValueError(f"--levels {text!r}: each between 1 and --gpus ({gpus})")
    return levels


# ---- the phase's record -------------------------------------------------------------------


@dataclass
class Phase:
    plugin: str
    sharing: str
    levels: list[int]
    prepare_ms: dict[int, list[float]] = field(default_factory=dict)
    unprepare_ms: dict[int, list[float]] = field(default_factory=dict)
    claims_timed: int = 0
    cpu_ms: float = float("nan")  # the plugin's process tree, per claim prepared and unprepared
    runtime_cpu_ms: float = float("nan")  # containerd's per claim, phase start until idle after it
    runtime_settle_s: float = float("nan")
    status_writes: int = 0
    rss_rest_mb: float = float("nan")
    rss_after_mb: float = float("nan")
    rss_idle_mb: float = float("nan")
    startup_s: float = float("nan")
    load: tuple[float, float] = (float("nan"), float("nan"))
    # Prepares the plugin answered with an error (the kubelet retries them): per level, and the
    # first answer of each kind. Left out of the latencies; a wrong device still ends the run.
    refused: dict[int, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.plugin} {self.sharing}"

    def p50(self, level: int) -> float:
        return pct(self.prepare_ms.get(level, []), 50)

    def p99(self, level: int) -> float:
        return pct(self.prepare_ms.get(level, []), 99)

    def line(self, run: int) -> str:
        lat = "; ".join(
            f"{c} in flight p50 {self.p50(c):.2f} p99 {self.p99(c):.2f} ms (n={len(self.prepare_ms[c])})"
            for c in self.levels
        )
        unprep = " ".join(f"{c}: {pct(self.unprepare_ms[c], 50):.2f}" for c in self.levels)
        refused = ""
        if any(self.refused.values()):
            counts = ", ".join(f"{self.refused.get(c, 0)} at {c} in flight" for c in self.levels)
            refused = f"; REFUSED {counts} ({'; '.join(f'{n}x {m}' for m, n in self.refusals.items())})"
        return (
            f"run {run} {self.label:<20} prepare {lat}{refused}; unprepare p50 {unprep} ms; "
            f"CPU/claim {self.cpu_ms:.2f} ms, containerd's {self.runtime_cpu_ms:.2f} ms "
            f"(busy {self.runtime_settle_s:.1f} s after); status writes {self.status_writes}; "
            f"RSS at rest {self.rss_rest_mb:.1f} MB, after {self.rss_after_mb:.1f} MB, "
            f"{IDLE_S:.0f} s after {self.rss_idle_mb:.1f} MB; start {self.startup_s:.2f} s; "
            f"load {self.load[0]:.2f}->{self.load[1]:.2f}"
        )


def span(values: Iterable[float]) -> str:
    v = [x for x in values if x == x]
    if not v:
        return "-"
    return f"{min(v):.2f}" if min(v) == max(v) else f"{min(v):.2f}-{max(v):.2f}"


def summary(phases: Sequence[tuple[int, Phase]], levels: Sequence[int]) -> list[str]:
    """Per plugin and sharing mode, each figure's range over the runs; then dra-gpu / NVIDIA per
    run (the same run's phases)."""
    out = []
    keys = sorted({(p.plugin, p.sharing) for _, p in phases}, key=lambda k: (k[1], PLUGINS.index(k[0])))
    for plugin, sharing in keys:
        mine = [p for _, p in phases if (p.plugin, p.sharing) == (plugin, sharing)]
        lat = "; ".join(
            f"{c} in flight p50 {span(p.p50(c) for p in mine)} p99 {span(p.p99(c) for p in mine)} ms"
            for c in levels
        )
        out.append(
            f"{plugin} {sharing} ({len(mine)} runs): {lat}; CPU/claim {span(p.cpu_ms for p in mine)} ms; "
            f"containerd's {span(p.runtime_cpu_ms for p in mine)} ms; "
            f"RSS at rest {span(p.rss_rest_mb for p in mine)} MB, "
            f"after {span(p.rss_after_mb for p in mine)} MB, "
            f"{IDLE_S:.0f} s after {span(p.rss_idle_mb for p in mine)} MB; "
            f"start {span(p.startup_s for p in mine)} s"
        )
    for sharing in SHARINGS:
        by_run: dict[int, dict[str, Phase]] = {}
        for run, p in phases:
            if p.sharing == sharing:
                by_run.setdefault(run, {})[p.plugin] = p
        pairs = [
            (r, d["dra-gpu"], d["nvidia"])
            for r, d in sorted(by_run.items())
            if {"dra-gpu", "nvidia"} <= set(d)
        ]
        if not pairs:
            continue
        ratios = []
        for c in levels:
            p50 = " ".join(f"{o.p50(c) / n.p50(c):.2f}" for _, o, n in pairs)
            p99 = " ".join(f"{o.p99(c) / n.p99(c):.2f}" for _, o, n in pairs)
            ratios.append(f"{c} in flight p50 {p50}, p99 {p99}")
        cpu = " ".join(f"{o.cpu_ms / n.cpu_ms:.2f}" for _, o, n in pairs)
        out.append(f"dra-gpu / NVIDIA, {sharing}, run by run: {'; '.join(ratios)}; CPU/claim {cpu}")
    return out


# ---- the node's processes -------------------------------------------------------------------


def proc_stats() -> dict[int, ProcStat]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):  # gone meanwhile
                out[int(entry.name)] = parse_stat((entry / "stat").read_text())
    return out


PROFILE_HZ = 200
# Where a sample's time went: the first part, in this order, with a frame anywhere in the sample's
# stack that names one of its files or functions; so a prepare's checkpoint write counts as
# checkpoint, not as prepare or gRPC, and a profile reads as a breakdown of the prepare path.
PROFILE_PARTS = (
    ("gc / heap trim", ("heap_trim.py",)),
    ("claim-status writes", ("write_rounds.py", "status_write", "apply_status")),
    ("checkpoint", ("checkpoint.py", "journal.py", "durable.py")),
    ("CDI spec", ("cdi.py",)),
    ("prepare / unprepare", ("prepare.py", "plan.py", "allocation.py", "record.py")),
    ("claim watch / cache", ("claim_cache.py", "list_watch")),
    ("gRPC server", ("grpc/", "node_service.py")),
    ("HTTP client (aiohttp, TLS)", ("aiohttp", "ssl.py", "kubernetes/")),
    ("asyncio", ("asyncio/",)),
)


def profile_samples(collapsed: str) -> Iterator[tuple[list[str], int]]:
    """py-spy's collapsed stacks ("frame;frame;... count", the outermost frame first) as (frames,
    count); other lines skipped."""
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            yield stack.split(";"), int(count)


def profile_parts(collapsed: str) -> dict[str, int]:
    """Samples by PROFILE_PARTS; the rest "other"."""
    parts: dict[str, int] = {}
    for frames, count in profile_samples(collapsed):
        part = next(
            (name for name, marks in PROFILE_PARTS if any(m in frame for frame in frames for m in marks)),
            "other",
        )
        parts[part] = parts.get(part, 0) + count
    return parts


def profile_top(collapsed: str, lines: int = 12) -> list[str]:
    """The parts of a profile, then its busiest innermost frames, as percentages of its samples."""
    parts = profile_parts(collapsed)
    total = sum(parts.values()) or 1
    leaves: dict[str, int] = {}
    for frames, count in profile_samples(collapsed):
        leaves[frames[-1]] = leaves.get(frames[-1], 0) + count
    out = [
        f"{total} samples: "
        + ", ".join(f"{k} {100 * v / total:.0f} %" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
    ]
    for leaf, n in sorted(leaves.items(), key=lambda kv: -kv[1])[:lines]:
        out.append(f"{100 * n / total:5.1f} % {leaf}")
    return out


def tree_cpu_seconds(pid: int) -> float:
    return tree_ticks(proc_stats(), pid) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    st = parse_stat(Path(f"/proc/{pid}/stat").read_text())
    return st.own / os.sysconf("SC_CLK_TCK")


def load_nvidia_launcher() -> ModuleType:
    """e2e/node/nvidia_plugin.py (a script of the e2e, not a package)."""
    if "nvidia_plugin" in sys.modules:
        return sys.modules["nvidia_plugin"]
    spec = importlib.util.spec_from_file_location("nvidia_plugin", ROOT / "e2e" / "node" / "nvidia_plugin.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["nvidia_plugin"] = mod
    spec.loader.exec_module(mod)
    return mod


# ---- the cluster ----------------------------------------------------------------------------


class StatusWrites:
    """Holds prepared claims until the plugin's claim-status writes for them have landed."""

    def __init__(self, api: Any, waits: bool) -> None:
        self.api = api
        self.waits = waits  # dra-gpu writes status.devices (deferred 0.2 s, then 0.1 s without calls)
        self.base = status_applies(api)
        self.expected = 0

    def restart(self) -> None:
        self.base = status_applies(self.api)
        self.expected = 0

    def landed(self) -> int:
        return status_applies(self.api) - self.base

    async def hold(self, claims: int) -> None:
        if not self.waits:
            return
        self.expected += claims
        await asyncio.sleep(0.3)
        deadline = time.monotonic() + STATUS_WAIT_S
        while self.landed() < self.expected:
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"{self.landed()} of {self.expected} claim-status writes landed "
                    f"within {STATUS_WAIT_S:.0f} s"
                )
            await asyncio.sleep(0.1)


Claim = tuple[str, str, str]  # name, uid, allocated device


class Cluster:
    def __init__(self) -> None:
        load: Any = config.load_kube_config  # $KUBECONFIG (the kubernetes client's API is untyped here)
        load()
        self.api = cast(Any, client.ApiClient())
        self.custom = cast(Any, client.CustomObjectsApi(self.api))
        self.core = cast(Any, client.CoreV1Api(self.api))
        self.apps = cast(Any, client.AppsV1Api(self.api))
        real = [
            n
            for n in self.core.list_node().items
            if (n.metadata.labels or {}).get("dra-gpu.io/e2e-fake") != "true"
        ]
        if not real:
            raise SystemExit("no node without the label dra-gpu.io/e2e-fake: is the e2e cluster up?")
        self.node: str = real[0].metadata.name
        self.holder: dict[str, str] = {}

    def hold(self, ns: str) -> None:
        """A pod for the claims' `reservedFor`, never scheduled (no scheduler has its name), so that
        nothing but the bench prepares the claims and the claim controller keeps the reservations."""
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

    def slices(self, driver: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.custom.list_cluster_custom_object(
            GROUP, VERSION, "resourceslices", field_selector=f"spec.driver={driver},spec.nodeName={self.node}"
        )["items"]
        return items

    def drop_slices(self, driver: str, timeout: float = 30.0) -> None:
        """Delete the node's slices of `driver` (a stopped plugin's, which NVIDIA's leaves) and wait
        until none is left: a plugin that still publishes them fails the bench."""
        deadline = time.monotonic() + timeout
        while items := self.slices(driver):
            for s in items:
                with contextlib.suppress(client.ApiException):  # gone meanwhile
                    self.custom.delete_cluster_custom_object(
                        GROUP, VERSION, "resourceslices", s["metadata"]["name"]
                    )
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"slices of {driver} on node {self.node} keep coming back after {timeout:.0f} s: "
                    "is another plugin of that driver running?"
                )
            time.sleep(0.2)

    def allocated_claim(
        self, ns: str, driver: str, device: str, parameters: Mapping[str, Any] | None
    ) -> Claim:
        name = f"bench-{uuid.uuid4().hex[:10]}"
        body = claim_body(name, NVIDIA if driver == NVIDIA else "bench.example.com", parameters)
        claim = self.custom.create_namespaced_custom_object(GROUP, VERSION, ns, "resourceclaims", body)
        claim["status"] = allocated_status(driver, self.node, device, self.holder, parameters)
        self.custom.replace_namespaced_custom_object_status(GROUP, VERSION, ns, "resourceclaims", name, claim)
        return name, claim["metadata"]["uid"], device


# ---- the bench ------------------------------------------------------------------------------


async def drive(
    sock: Path,
    ns: str,
    pool: str,
    claims: Sequence[Claim],
    phase: Phase,
    batches: int,
    writes: StatusWrites,
    cpu: Callable[[], float],
) -> None:
    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
        stub = pb_grpc.DRAPluginStub(ch)

        def req(c: Claim) -> list[Any]:
            return [pb.Claim(namespace=ns, name=c[0], uid=c[1])]

        async def prepare(c: Claim, inflight: int = 0) -> float | None:
            t = time.perf_counter()
            resp = await stub.NodePrepareResources(
                pb.NodePrepareResourcesRequest(claims=req(c)), timeout=CALL_TIMEOUT_S
            )
            took = time.perf_counter() - t
            answer = resp.claims.get(c[1])
            if answer is not None and answer.error and inflight:  # refused: counted, not timed
                phase.refused[inflight] = phase.refused.get(inflight, 0) + 1
                kind = refusal_kind(answer.error)
                phase.refusals[kind] = phase.refusals.get(kind, 0) + 1
                return None
            wrong = prepare_error(answer, pool, c[2])
            if wrong:
                raise SystemExit(f"{phase.label}: prepare of claim {ns}/{c[0]} ({c[2]}): {wrong}")
            return took * 1e3

        async def unprepare(c: Claim, inflight: int = 0) -> float:
            t = time.perf_counter()
            resp = await stub.NodeUnprepareResources(
                pb.NodeUnprepareResourcesRequest(claims=req(c)), timeout=CALL_TIMEOUT_S
            )
            took = time.perf_counter() - t
            answer = resp.claims.get(c[1])
            if answer is None or answer.error:
                raise SystemExit(f"{phase.label}: unprepare of claim {ns}/{c[0]} ({c[2]}): {answer}")
            return took * 1e3

        async def at(inflight: int, fn: Callable[[Claim, int], Any], out: list[float]) -> None:
            async def worker(share: list[Claim]) -> None:
                for c in share:
                    took = await fn(c, inflight)
                    if took is not None:
                        out.append(took)

            await asyncio.gather(*(worker(s) for s in split_workers(claims, inflight)))

        for c in claims[:WARM_UP_CLAIMS]:  # connections, caches (their status writes not waited for)
            await prepare(c)
            await unprepare(c)
        await asyncio.sleep(0.5)
        writes.restart()  # a warm-up write still on the wire does not count
        cpu_before = cpu()
        try:
            for inflight in phase.levels:
                prep = phase.prepare_ms.setdefault(inflight, [])
                unprep = phase.unprepare_ms.setdefault(inflight, [])
                for _ in range(batches):
                    refused = phase.refused.get(inflight, 0)
                    await at(inflight, prepare, prep)
                    await writes.hold(len(claims) - (phase.refused.get(inflight, 0) - refused))
                    await at(inflight, unprepare, unprep)
                    phase.claims_timed += len(claims)
        except BaseException:
            # Nothing left prepared: each claim's CDI spec would stay in containerd's directory.
            for c in claims:
                with contextlib.suppress(Exception):
                    await stub.NodeUnprepareResources(
                        pb.NodeUnprepareResourcesRequest(claims=req(c)), timeout=10
                    )
            raise
        phase.cpu_ms = (cpu() - cpu_before) / phase.claims_timed * 1e3
        phase.status_writes = writes.landed()


class Running:
    """A plugin process started for a phase."""

    def __init__(self, pid: int, sock: Path, stop: Callable[[], None], log: Path) -> None:
        self.pid, self.sock, self.stop, self.log = pid, sock, stop, log


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        kubeconfig = os.environ.get("KUBECONFIG")
        if not kubeconfig:
            raise SystemExit('KUBECONFIG is not set: eval "$(e2e/cluster env)" first')
        self.kubeconfig = kubeconfig
        self.cluster = Cluster()
        self.ns = f"bench-nv-{uuid.uuid4().hex[:6]}"
        # One scratch directory for both plugins' own directories: their checkpoints on one disk.
        self.tmp = Path(tempfile.mkdtemp(prefix="dra-nvidia-bench-"))
        self.profile_doc = bench_profile(args.gpus)
        self.uuids = profile_uuids(self.profile_doc)
        self.profile = self.tmp / "bench-node.yaml"
        self.profile.write_text(yaml.safe_dump(self.profile_doc, sort_keys=False))
        self.launcher = load_nvidia_launcher()
        # The node once, for both: its device nodes, kernel files, driver (built on first use).
        self.node = self.launcher.prepare_node(self.profile, self.tmp / "node")
        self.claims: dict[tuple[str, str], list[Claim]] = {}
        self.floor_devices: list[str] = []

    # -- starting and stopping each plugin --

    def wait_published(self, proc_alive: Callable[[], bool], log: Path, t0: float) -> dict[str, str]:
        """The plugin's GPUs once it has published every one of the profile's (UUID -> device)."""
        while True:
            if not proc_alive():
                raise SystemExit(
                    f"the plugin exited; its log ({log}):\n{log.read_text(errors='replace')[-4000:]}"
                )
            by_uuid = devices_by_uuid(self.cluster.slices(NVIDIA))
            if len(by_uuid) >= len(self.uuids):
                missing = sorted(set(self.uuids) - set(by_uuid))
                extra = sorted(set(by_uuid) - set(self.uuids))
                if missing or extra:
                    raise SystemExit(
                        f"published GPUs differ from the profile's: missing {missing}, extra {extra}"
                    )
                return by_uuid
            if time.perf_counter() - t0 > START_TIMEOUT_S:
                raise SystemExit(
                    f"{len(by_uuid)} of {len(self.uuids)} GPUs published after {START_TIMEOUT_S:.0f} s; "
                    f"log {log}"
                )
            time.sleep(0.05)

    def start_ours(self, phase: Phase, run: int) -> tuple[Running, dict[str, str]]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        plugin_dir = self.tmp / "dra-gpu-plugin"
        log = self.tmp / f"dra-gpu-{run}-{phase.sharing}.log"
        argv = [
            sys.executable, "-m", "dra_gpu.cli", "kubelet-plugin",
            "--nvidia-compatible",
            "--node-name", self.cluster.node,
            "--profile", str(self.profile),
            "--dev-root", str(self.node.dev_root),
            "--driver-root", str(self.node.driver_root),
            "--plugin-dir", str(plugin_dir),
            "--registry-dir", str(KUBELET_ROOT / "plugins_registry"),
            "--cdi-dir", str(CDI_DIR),
            "--kubeconfig", self.kubeconfig,
            "--http-address", f"127.0.0.1:{port}",
        ]  # fmt: skip
        t0 = time.perf_counter()
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT
            )

        def stop() -> None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

        try:
            by_uuid = self.wait_published(lambda: proc.poll() is None, log, t0)
            phase.startup_s = time.perf_counter() - t0
            sock = plugin_dir / "dra.sock"
            while not sock.exists():
                if time.perf_counter() - t0 > START_TIMEOUT_S:
                    raise SystemExit(f"{sock}: not there {START_TIMEOUT_S:.0f} s after the start")
                time.sleep(0.05)
        except BaseException:
            stop()
            raise
        return Running(proc.pid, sock, stop, log), by_uuid

    def start_nvidia(self, phase: Phase, run: int, gates: Sequence[str]) -> tuple[Running, dict[str, str]]:
        log = self.tmp / f"nvidia-{run}-{phase.sharing}.log"
        extra = [] if self.args.nvidia_client_defaults else NVIDIA_UNBOUND_CLIENT
        plugin = self.launcher.NvidiaPlugin(
            self.node,
            self.kubeconfig,
            self.cluster.node,
            self.tmp / "nvidia-plugins",  # its own dir is <this>/gpu.nvidia.com
            KUBELET_ROOT / "plugins_registry",
            CDI_DIR,
            feature_gates=list(gates),
            extra_args=extra,
            log_path=log,
        )
        t0 = time.perf_counter()
        plugin.start()
        try:
            by_uuid = self.wait_published(lambda: bool(plugin.running), log, t0)
            phase.startup_s = time.perf_counter() - t0
            sock = plugin.driver_dir / "dra.sock"
            while not sock.exists():
                if time.perf_counter() - t0 > START_TIMEOUT_S:
                    raise SystemExit(f"{sock}: not there {START_TIMEOUT_S:.0f} s after the start")
                time.sleep(0.05)
        except BaseException:
            plugin.stop()
            raise
        return Running(plugin.proc.pid, sock, plugin.stop, log), by_uuid

    def peer_driver(self, action: str) -> None:
        cmd = [sys.executable, str(ROOT / "e2e" / "cluster"), "peer-driver", action]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode and action == "start":
            raise SystemExit(f"peer-driver start failed: {r.stdout}{r.stderr}")

    def start_floor(self, phase: Phase) -> Running:
        t0 = time.perf_counter()
        self.peer_driver("start")
        phase.startup_s = time.perf_counter() - t0  # `peer-driver start` returns once it published
        if not self.floor_devices:
            self.floor_devices = [d["name"] for s in self.cluster.slices(FLOOR) for d in s["spec"]["devices"]]
        return Running(
            pid_of("dra-test-driver"),
            KUBELET_ROOT / "plugins" / FLOOR / "dra.sock",
            lambda: self.peer_driver("stop"),
            Path("-"),
        )

    # -- claims --

    def claims_for(self, plugin: str, sharing: str, by_uuid: Mapping[str, str]) -> list[Claim]:
        """One claim per GPU in the profile's order, allocated to the device this plugin publishes
        for it (made once per plugin and sharing mode, used in every run)."""
        key = (plugin, sharing)
        if key not in self.claims:
            params = sharing_config(sharing)
            if plugin == "floor":
                devs = [self.floor_devices[i % len(self.floor_devices)] for i in range(len(self.uuids))]
                self.claims[key] = [self.cluster.allocated_claim(self.ns, FLOOR, d, None) for d in devs]
            else:
                self.claims[key] = [
                    self.cluster.allocated_claim(self.ns, NVIDIA, by_uuid[u], params) for u in self.uuids
                ]
        return self.claims[key]

    # -- one phase --

    def run_phase(self, run: int, plugin: str, sharing: str) -> Phase:
        phase = Phase(plugin, sharing, self.levels)
        settle_runtime()
        runtime_start = runtime_cpu()
        phase.load = (os.getloadavg()[0], float("nan"))
        by_uuid: dict[str, str] = {}
        if plugin == "floor":
            running = self.start_floor(phase)
        else:
            self.cluster.drop_slices(NVIDIA)  # the last phase's: start from none
            if plugin == "dra-gpu":
                running, by_uuid = self.start_ours(phase, run)
            else:
                gates = ["TimeSlicingSettings=true"] if sharing == "timeslice" else []
                running, by_uuid = self.start_nvidia(phase, run, gates)
        try:
            claims = self.claims_for(plugin, sharing, by_uuid)
            time.sleep(REST_S)  # dra-gpu's claim watch has the claims made just now
            phase.rss_rest_mb = memory(running.pid).rss_mb
            writes = StatusWrites(self.cluster.api, waits=plugin == "dra-gpu")
            profiler = self.start_profile(run, plugin, sharing, running.pid)
            asyncio.run(
                drive(
                    running.sock,
                    self.ns,
                    self.cluster.node,
                    claims,
                    phase,
                    self.args.batches,
                    writes,
                    lambda: tree_cpu_seconds(running.pid),
                )
            )
            phase.rss_after_mb = memory(running.pid).rss_mb
            if profiler is not None:
                self.stop_profile(*profiler)
            time.sleep(IDLE_S)
            phase.rss_idle_mb = memory(running.pid).rss_mb
        finally:
            running.stop()
            if plugin != "floor":
                self.cluster.drop_slices(NVIDIA)
        phase.load = (phase.load[0], os.getloadavg()[0])
        phase.runtime_settle_s = settle_runtime()
        prepared = WARM_UP_CLAIMS + phase.claims_timed
        phase.runtime_cpu_ms = (runtime_cpu() - runtime_start) / prepared * 1e3
        return phase

    def start_profile(
        self, run: int, plugin: str, sharing: str, pid: int
    ) -> tuple[subprocess.Popen[bytes], Path] | None:
        """With --profile, py-spy sampling dra-gpu's plugin (its Python threads, not idle ones)
        through the phase's levels, as collapsed stacks."""
        if not self.args.profile or plugin != "dra-gpu":
            return None
        out = Path(self.args.profile) / f"run{run}-{plugin}-{sharing}.collapsed"
        out.parent.mkdir(parents=True, exist_ok=True)
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        cmd = [
            spy,
            "record",
            "-p",
            str(pid),
            "-r",
            str(PROFILE_HZ),
            "-f",
            "raw",
            "-o",
            str(out),
            "--nonblocking",
        ]
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), out

    def stop_profile(self, spy: subprocess.Popen[bytes], out: Path) -> None:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        try:
            _, err = spy.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            spy.kill()
            raise SystemExit(f"py-spy did not stop in 30 s ({out})") from None
        if not out.is_file():
            raise SystemExit(f"py-spy wrote no profile ({out}): {err.decode(errors='replace')[-500:]}")
        for line in profile_top(out.read_text()):
            print(f"  profile {out.name}: {line}", flush=True)

    @property
    def levels(self) -> list[int]:
        return parse_levels(self.args.levels, self.args.gpus)

    # -- the probe of NVIDIA's sharing paths --

    def probe(self) -> list[str]:
        """One time-sliced and one MPS claim prepared by each plugin (GPUs 0 and 1): each answer as
        it came. NVIDIA's with gates TimeSlicingSettings and MPSSupport."""
        out = []
        for plugin in ("nvidia", "dra-gpu"):
            phase = Phase(plugin, "probe", [])
            self.cluster.drop_slices(NVIDIA)
            if plugin == "nvidia":
                running, by_uuid = self.start_nvidia(
                    phase, 0, ["TimeSlicingSettings=true", "MPSSupport=true"]
                )
            else:
                running, by_uuid = self.start_ours(phase, 0)
            try:
                for sharing, gpu in (("timeslice", 0), ("mps", 1)):
                    c = self.cluster.allocated_claim(
                        self.ns, NVIDIA, by_uuid[self.uuids[gpu]], sharing_config(sharing)
                    )
                    time.sleep(1.0)
                    out.append(
                        f"probe {plugin} {sharing} ({c[2]}): {asyncio.run(self.probe_one(running.sock, c))}"
                    )
            finally:
                running.stop()
                self.cluster.drop_slices(NVIDIA)
        # NVIDIA's MPS prepare makes a Deployment in --namespace (default) once past its template.
        for d in self.cluster.apps.list_namespaced_deployment("default").items:
            if d.metadata.name.startswith("mps-control-daemon"):
                out.append(f"probe: deleting NVIDIA's MPS Deployment default/{d.metadata.name}")
                self.cluster.apps.delete_namespaced_deployment(d.metadata.name, "default")
        return out

    async def probe_one(self, sock: Path, c: Claim) -> str:
        async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
            stub = pb_grpc.DRAPluginStub(ch)
            req = [pb.Claim(namespace=self.ns, name=c[0], uid=c[1])]
            t = time.perf_counter()
            try:
                resp = await stub.NodePrepareResources(
                    pb.NodePrepareResourcesRequest(claims=req), timeout=120
                )
            except grpc.aio.AioRpcError as exc:
                return f"gRPC {exc.code().name}: {exc.details()}"
            took = (time.perf_counter() - t) * 1e3
            wrong = prepare_error(resp.claims.get(c[1]), self.cluster.node, c[2])
            un = await stub.NodeUnprepareResources(pb.NodeUnprepareResourcesRequest(claims=req), timeout=120)
            answer = un.claims.get(c[1])
            unprep = "unprepared" if answer is not None and not answer.error else f"unprepare: {answer}"
            return f"{'prepared' if wrong is None else wrong} in {took:.1f} ms; {unprep}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--batches", type=int, default=4, help="batches of one claim per GPU, per level")
    parser.add_argument("--levels", default="1,8,56", help="claims in flight, each a figure")
    parser.add_argument(
        "--gpus", type=int, default=56, help="whole GPUs of the bench node (claims per batch)"
    )
    parser.add_argument("--sharing", default="exclusive", help="exclusive, timeslice or both")
    parser.add_argument("--no-floor", action="store_true", help="leave out upstream's test driver")
    parser.add_argument("--seed", type=int, default=None, help="the phases' order (default: from the clock)")
    parser.add_argument(
        "--probe", action="store_true", help="first try NVIDIA's time-slicing and MPS prepares"
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help=f"py-spy dra-gpu's plugin during each of its phases ({PROFILE_HZ} Hz, collapsed stacks in DIR)",
    )
    parser.add_argument(
        "--nvidia-client-defaults",
        action="store_true",
        help="NVIDIA's plugin with its shipped client rate limit (QPS 5, burst 10)",
    )
    args = parser.parse_args()
    sharings = [s.strip() for s in args.sharing.split(",") if s.strip()]
    if not sharings or any(s not in SHARINGS for s in sharings):
        parser.error("--sharing: exclusive, timeslice or exclusive,timeslice")
    try:
        levels = parse_levels(args.levels, args.gpus)
    except ValueError as exc:
        parser.error(str(exc))
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    phases = [(p, s) for s in sharings for p in ("dra-gpu", "nvidia")]
    if not args.no_floor:
        phases.append(("floor", "exclusive"))
    orders = phase_orders(seed, args.runs, phases)
    bench = Bench(args)
    cluster = bench.cluster
    print(
        f"seed {seed}; {args.runs} runs x {len(phases)} phases in random order; node {cluster.node}, "
        f"{args.gpus} whole GPUs ({bench.profile_doc['name']}); per level ({', '.join(map(str, levels))} in "
        f"flight) {args.batches} batches of {args.gpus} one-claim prepares, held until their status writes "
        f"landed, then unprepared; NVIDIA's client limit "
        f"{'as shipped (5/10)' if args.nvidia_client_defaults else 'never binds'}; {os.cpu_count()} CPUs; "
        f"scratch {bench.tmp}",
        flush=True,
    )
    bench.peer_driver("stop")  # only the measured plugin runs
    cluster.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=bench.ns)))
    done: list[tuple[int, Phase]] = []
    try:
        cluster.hold(bench.ns)
        if args.probe:
            for line in bench.probe():
                print(line, flush=True)
        for run, order in enumerate(orders, 1):
            print(f"run {run} order: {', '.join(f'{p} {s}' for p, s in order)}", flush=True)
            for plugin, sharing in order:
                phase = bench.run_phase(run, plugin, sharing)
                print(phase.line(run), flush=True)
                done.append((run, phase))
    finally:
        bench.peer_driver("stop")
        with contextlib.suppress(Exception):
            cluster.drop_slices(NVIDIA)
        cluster.core.delete_namespace(bench.ns)
        # The node's device nodes and driver copy; the logs stay.
        shutil.rmtree(bench.tmp / "node", ignore_errors=True)
    for line in summary(done, levels):
        print(line)


if __name__ == "__main__":
    main()
