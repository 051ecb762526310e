"""Whole NVLink domains for the jobs that need them: a seeded job trace through the real scheduler.

    bash e2e/node/build.sh kubernetes && bash e2e/node/build.sh etcd && bash e2e/node/build.sh kwok   # cached
    .venv/bin/python bench/nvlink_placement_bench.py [--nodes 32] [--jobs 600] [--seeds 1,2,3] \\
        [--load 0.9] [--topologies hgx-2x4,dgx-h100] [--variants today,domain-slices,rank8,rank4] \\
        [--json FILE]
    .venv/bin/python bench/nvlink_placement_bench.py --oracle-only ...   # traces and oracle, no cluster
    .venv/bin/python bench/nvlink_placement_bench.py --report RUN.json ...  # earlier runs' table

The trace (`trace`): one job arrives per step, asking for 1, 2, 4 or 8 whole GPUs (MIX); an
allocated job leaves after a geometric lifetime whose mean makes the offered load `--load` of the
cluster's GPUs (mean GPUs a job x mean life = load x GPUs). A job that cannot be placed when it
arrives is refused and dropped, so every placement strategy sees the same arrivals. Claims: a job
of N GPUs is one request of `count: N` on the GPU class; when N fits in one NVLink domain of the
topology, with `matchAttribute: gpu.dra-gpu.io/nvlinkDomain` (deploy/examples/four-nvlink-gpus.yaml);
8 GPUs on hgx-2x4 (domains of 4) is the whole node, without the constraint. A job's pod requests
`--cpu-per-gpu` CPUs (default 7) and 8 GiB of memory a CPU for each of its GPUs, as real jobs
request CPU and memory: kube-scheduler's default scoring (NodeResourcesFit, LeastAllocated) then
prefers the emptiest node. With no requests (0) every node scores the same until it holds 6 pods,
and kube-scheduler 1.37 breaks ties by the order the nodes passed the filters (its random
tie-breaker is drawn only where an extender scores, pkg/scheduler/schedule_one.go:1045): a first
fit over the nodes.

Replayed through the real kube-scheduler (v1.37.2, the e2e DRA gates) on a control plane of its
own (bench/scale_bench.py's: etcd, kube-apiserver, kube-scheduler, KWOK nodes; no kubelet, no
controller-manager: the bench deletes what leaves, as the resource-claim controller would). Each
node's ResourceSlices are dra-gpu's slice builder's (dra_gpu.node.slices.build_slices) for a
simulated node of the topology's profile: `hgx-2x4` (2 NVLink domains of 4 H100s) or `dgx-h100`
(8 H100s on NVSwitch, one domain). Jobs one at a time: a job's claim and pod are created, then the
bench waits until the pod is bound or the scheduler marks it Unschedulable (and stays so for
`--confirm` seconds: a pod tried against a view that had not yet seen a departure is tried again
on that event); a refused job's pod and claim are deleted.

Variants (what the driver can do; no scheduler plugin of our own):
- today: dra-gpu's slices as published (one slice a node, GPUs in index order), the claims above.
- domain-slices: one slice per NVLink domain (the allocator walks slices by name, then their
  devices in order), the same claims.
- rank8 / rank4: the slices as published, which carry `packingRank` (0..7, a hash of the node's
  name); claims of less than a node list the ranks lowest first in a prioritized list
  (`firstAvailable`: packingRank < 1, < 2, ..., < 7, then any GPU for rank8; < 2, < 4, < 6, any
  for rank4). kube-scheduler's DRA
  Score gives a node more the earlier the subrequest that fits there.

The oracle (`Oracle`): the same trace placed with full knowledge of every node's free GPUs per
NVLink domain at each arrival (none of the future; nothing that runs is moved): N GPUs that must
share a domain go to the feasible domain with the fewest GPUs left free after the placement (best
fit), ties to the node with the fewest free GPUs, then by node name and domain; a whole-node job
to the first fully free node. It is a reference, not a proven optimum.

Figures, over the arrivals after the warm-up (`--warmup`, default two mean lives): 4- and 8-GPU
jobs refused while the cluster had at least as many GPUs free in total ("fragmented": the
refusals a better placement could have avoided), all refusals by size, the mean fill seen by the
arrivals, the scheduler's CPU per scheduling attempt, and the wall time of a run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DRIVER = "gpu.dra-gpu.io"
NS = "default"
# (GPUs a job, share of the jobs)
MIX = ((1, 0.50), (2, 0.25), (4, 0.15), (8, 0.10))
LARGE = (4, 8)
# simulated profile -> the GPU indexes of each NVLink domain (what its slices publish; checked
# against the slices at publication)
TOPOLOGIES = {"hgx-2x4": ((0, 1, 2, 3), (4, 5, 6, 7)), "dgx-h100": (tuple(range(8)),)}
GPUS_A_NODE = 8
VARIANTS = {
    "today": "dra-gpu's slices as published, claims with count and the nvlinkDomain constraint",
    "domain-slices": "a slice per NVLink domain, the same claims",
    "rank8": "claims below a node: firstAvailable over packingRank < 1, < 2, ..., < 7, any (8 subrequests)",
    "rank4": "claims below a node: firstAvailable over packingRank < 2, < 4, < 6, any (4 subrequests)",
}
# variant -> the subrequests' bounds, in order: packingRank < bound (then one for any GPU); the first
# that fits on a node is taken there, so each holds the ranks from the previous bound up
RANK_BOUNDS = {"rank8": (1, 2, 3, 4, 5, 6, 7), "rank4": (2, 4, 6)}


# ---------------------------------------------------------------- the trace


@dataclass(frozen=True)
class Job:
    step: int
    gpus: int
    leaves: int  # the step it departs at, if placed


def mean_gpus() -> float:
    return sum(n * p for n, p in MIX)


def mean_life(nodes: int, load: float) -> float:
    """Steps a placed job stays so that the offered load is `load` of the nodes' GPUs."""
    return load * GPUS_A_NODE * nodes / mean_gpus()


def trace(seed: int, jobs: int, nodes: int, load: float) -> list[Job]:
    """`jobs` arrivals, one a step, sizes drawn from MIX, lifetimes geometric with mean_life."""
    rng = random.Random(seed)
    sizes, weights = zip(*MIX, strict=True)
    p_leave = 1 / mean_life(nodes, load)
    out = []
    for step in range(jobs):
        gpus = rng.choices(sizes, weights)[0]
        life = 1
        while rng.random() > p_leave:
            life += 1
        out.append(Job(step, gpus, step + life))
    return out


def default_warmup(nodes: int, load: float) -> int:
    return math.ceil(2 * mean_life(nodes, load))


# ---------------------------------------------------------------- the oracle and the book


def needs_domain(gpus: int, topology: str) -> bool:
    """A job's GPUs must share an NVLink domain when it fits in one; else it takes the node."""
    return gpus <= max(len(d) for d in TOPOLOGIES[topology])


@dataclass
class Outcome:
    """One arrival: where it went (None: refused) and what the cluster had free when it came."""

    job: Job
    node: str | None
    gpus: tuple[int, ...] = ()
    free_before: int = 0


@dataclass
class Book:
    """Which GPUs of which node each running job holds; the departures due."""

    topology: str
    nodes: list[str]
    free: dict[str, set[int]] = field(default_factory=dict)
    running: dict[int, tuple[str, tuple[int, ...], int]] = field(default_factory=dict)  # step -> ...

    def __post_init__(self) -> None:
        self.free = {n: set(range(GPUS_A_NODE)) for n in self.nodes}

    @property
    def capacity(self) -> int:
        return GPUS_A_NODE * len(self.nodes)

    def free_total(self) -> int:
        return sum(len(f) for f in self.free.values())

    def due(self, step: int) -> list[int]:
        return sorted(s for s, (_, _, leaves) in self.running.items() if leaves <= step)

    def take(self, job: Job, node: str, gpus: tuple[int, ...]) -> None:
        if not set(gpus) <= self.free[node]:
            raise RuntimeError(f"job {job.step}: GPUs {gpus} of {node} are not free")
        self.free[node] -= set(gpus)
        self.running[job.step] = (node, gpus, job.leaves)

    def release(self, step: int) -> None:
        node, gpus, _ = self.running.pop(step)
        self.free[node] |= set(gpus)


class Oracle:
    """Best fit by NVLink domain with full knowledge of the present (module docstring)."""

    def __init__(self, topology: str, nodes: list[str]) -> None:
        self.book = Book(topology, nodes)
        self.domains = TOPOLOGIES[topology]

    def place(self, job: Job) -> tuple[str, tuple[int, ...]] | None:
        book = self.book
        if not needs_domain(job.gpus, book.topology):
            for node in book.nodes:
                if len(book.free[node]) == GPUS_A_NODE:
                    return node, tuple(range(GPUS_A_NODE))
            return None
        best: tuple[tuple[int, int, int, int], str, tuple[int, ...]] | None = None
        for n, node in enumerate(book.nodes):
            for d, domain in enumerate(self.domains):
                free = sorted(g for g in domain if g in book.free[node])
                if len(free) < job.gpus:
                    continue
                key = (len(free) - job.gpus, len(book.free[node]) - job.gpus, n, d)
                if best is None or key < best[0]:
                    best = (key, node, tuple(free[: job.gpus]))
        return None if best is None else (best[1], best[2])


def run_oracle(topology: str, nodes: list[str], jobs: list[Job]) -> list[Outcome]:
    oracle = Oracle(topology, nodes)
    out = []
    for job in jobs:
        for step in oracle.book.due(job.step):
            oracle.book.release(step)
        free = oracle.book.free_total()
        got = oracle.place(job)
        if got is None:
            out.append(Outcome(job, None, free_before=free))
            continue
        oracle.book.take(job, *got)
        out.append(Outcome(job, got[0], got[1], free))
    return out


def figures(outcomes: list[Outcome], capacity: int, warmup: int) -> dict[str, Any]:
    """Refusals by size, the 4-/8-GPU ones while enough GPUs were free, and the mean fill the
    arrivals after the warm-up saw."""
    measured = [o for o in outcomes if o.job.step >= warmup]
    by_size: dict[str, dict[str, int]] = {}
    for o in measured:
        s = by_size.setdefault(str(o.job.gpus), {"jobs": 0, "refused": 0, "fragmented": 0})
        s["jobs"] += 1
        if o.node is None:
            s["refused"] += 1
            s["fragmented"] += o.free_before >= o.job.gpus
    large = [by_size.get(str(n), {"jobs": 0, "refused": 0, "fragmented": 0}) for n in LARGE]
    fill = [1 - o.free_before / capacity for o in measured]
    return {
        "measured": len(measured),
        "by_size": dict(sorted(by_size.items(), key=lambda kv: int(kv[0]))),
        "large_jobs": sum(s["jobs"] for s in large),
        "large_refused": sum(s["refused"] for s in large),
        "large_fragmented": sum(s["fragmented"] for s in large),
        "refused": sum(s["refused"] for s in by_size.values()),
        "fill": sum(fill) / len(fill) if fill else float("nan"),
    }


# ---------------------------------------------------------------- slices and claims


def node_slices(topology: str, node: str, variant: str, generation: int) -> list[dict[str, Any]]:
    """dra-gpu's slices of a simulated node of the topology's profile (the slice builder's own),
    regrouped one slice per NVLink domain for `domain-slices`."""
    from simnode.fake import discover_node

    from dra_gpu.node.slices import build_slices

    slices = build_slices(discover_node(node, topology), DRIVER, generation)
    check_domains(topology, slices)
    if variant != "domain-slices":
        return slices
    (only,) = slices
    groups: dict[str, list[dict[str, Any]]] = {}
    for dev in only["spec"]["devices"]:
        groups.setdefault(dev["attributes"]["nvlinkDomain"]["string"], []).append(dev)
    out = []
    for k, devices in enumerate(groups.values()):
        s = json.loads(json.dumps(only))
        s["metadata"]["name"] = f"{node}-{DRIVER}-{k}"
        s["spec"]["devices"] = devices
        s["spec"]["pool"]["resourceSliceCount"] = len(groups)
        out.append(s)
    return out


def device_index(dev: dict[str, Any]) -> int:
    return int(dev["attributes"]["index"]["int"])


def check_domains(topology: str, slices: list[dict[str, Any]]) -> None:
    """The published nvlinkDomain values group the GPUs as TOPOLOGIES says (the oracle's model)."""
    groups: dict[str, set[int]] = {}
    for s in slices:
        for dev in s["spec"].get("devices") or []:
            groups.setdefault(dev["attributes"]["nvlinkDomain"]["string"], set()).add(device_index(dev))
    if sorted(map(sorted, groups.values())) != sorted(map(list, TOPOLOGIES[topology])):
        raise RuntimeError(f"{topology}: published NVLink domains {groups} are not {TOPOLOGIES[topology]}")


def rank_selector(bound: int) -> dict[str, Any]:
    """GPUs of a node ranked below `bound`; a GPU without the attribute (a node whose dra-gpu
    predates it) counts as the last rank rather than failing the selector."""
    return {"cel": {"expression": f'device.attributes["{DRIVER}"].?packingRank.orValue(7) < {bound}'}}


def claim_spec(gpus: int, topology: str, variant: str) -> dict[str, Any]:
    """What a user writes for a job of `gpus` GPUs under the variant (module docstring)."""
    request: dict[str, Any] = {"name": "gpus"}
    bounds = RANK_BOUNDS.get(variant)
    if bounds and gpus < GPUS_A_NODE:
        subs: list[dict[str, Any]] = [
            {
                "name": f"below{bound}",
                "deviceClassName": DRIVER,
                "count": gpus,
                "selectors": [rank_selector(bound)],
            }
            for bound in bounds
        ]
        subs.append({"name": "any", "deviceClassName": DRIVER, "count": gpus})
        request["firstAvailable"] = subs
    else:
        request["exactly"] = {"deviceClassName": DRIVER, "count": gpus}
    devices: dict[str, Any] = {"requests": [request]}
    if needs_domain(gpus, topology) and gpus > 1:
        devices["constraints"] = [{"requests": ["gpus"], "matchAttribute": f"{DRIVER}/nvlinkDomain"}]
    return {"devices": devices}


def claim_body(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    }


def pod_body(name: str, gpus: int, cpu_per_gpu: int) -> dict[str, Any]:
    """The job's pod; with `cpu_per_gpu`, requesting that many CPUs and 8 GiB of memory a CPU for
    each of its GPUs (a KWOK node has 64 CPUs and 512 GiB: 8 GPUs' worth at 8 CPUs a GPU)."""
    container: dict[str, Any] = {"name": "main", "image": "fake", "resources": {"claims": [{"name": "gpus"}]}}
    if cpu_per_gpu:
        cpus = cpu_per_gpu * gpus
        container["resources"]["requests"] = {"cpu": str(cpus), "memory": f"{8 * cpus}Gi"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 0,
            "containers": [container],
            "resourceClaims": [{"name": "gpus", "resourceClaimName": name}],
        },
    }


def unschedulable(pod: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def allocated_devices(claim: dict[str, Any]) -> list[tuple[str, str]]:
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results")
    return [(str(r["pool"]), str(r["device"])) for r in results or []]


# ---------------------------------------------------------------- the replay


class View:
    """The bench's pods and claims, from watches; `changed` wakes whoever waits on them."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, dict[str, Any]]] = {"pods": {}, "claims": {}}
        self.changed = asyncio.Condition()

    def handlers(self, kind: str) -> tuple[Any, Any]:
        async def on_list(items: list[dict[str, Any]], _version: str) -> None:
            async with self.changed:
                self.objects[kind] = {o["metadata"]["name"]: o for o in items}
                self.changed.notify_all()

        async def on_event(event: str, obj: dict[str, Any]) -> bool:
            async with self.changed:
                name = obj["metadata"]["name"]
                if event == "DELETED":
                    self.objects[kind].pop(name, None)
                elif event in ("ADDED", "MODIFIED"):
                    self.objects[kind][name] = obj
                self.changed.notify_all()
            return True

        return on_list, on_event

    async def wait(self, check: Callable[[], bool], timeout: float) -> bool:
        async with self.changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait_for(check), timeout)
            return check()


class Replay:
    """One control plane: slices switched per topology and variant, traces replayed in turn."""

    def __init__(self, cp: Any, kube: Any, nodes: list[str], confirm: float, cpu_per_gpu: int) -> None:
        from kubernetes.aio import client as kclient

        self.cp, self.kube, self.nodes, self.confirm = cp, kube, nodes, confirm
        self.cpu_per_gpu = cpu_per_gpu
        self.core = kclient.CoreV1Api(kube.api_client)
        self.custom = kclient.CustomObjectsApi(kube.api_client)
        self.view = View()
        self.generation = 0
        self.index_of: dict[tuple[str, str], int] = {}

    async def publish(self, topology: str, variant: str) -> int:
        """Replace every node's slices with the variant's; the number of slices published."""
        from dra_gpu.kube.api import RESOURCE_V1

        old, _ = await self.kube.list_slices(f"spec.driver={DRIVER}")
        for s in old:
            await self.kube.delete_slice(s["metadata"]["name"])
        self.generation += 1
        self.index_of = {}
        count = 0
        sem = asyncio.Semaphore(16)

        async def create(body: dict[str, Any]) -> None:
            async with sem:
                await self.kube.create(f"{RESOURCE_V1}/resourceslices", body)

        bodies = []
        for node in self.nodes:
            for s in node_slices(topology, node, variant, self.generation):
                bodies.append(s)
                for dev in s["spec"].get("devices") or []:
                    self.index_of[(node, dev["name"])] = device_index(dev)
        await asyncio.gather(*(create(b) for b in bodies))
        count = len(bodies)
        await asyncio.sleep(2)  # the scheduler's informer
        return count

    async def delete_job(self, name: str) -> None:
        """The pod at once, then the claim (its allocation's finalizer taken off, as the
        resource-claim controller does once no pod uses it)."""
        from kubernetes.aio.client.exceptions import ApiException

        with contextlib.suppress(ApiException):
            await self.core.delete_namespaced_pod(name, NS, grace_period_seconds=0)
        with contextlib.suppress(ApiException):
            await self.custom.delete_namespaced_custom_object(
                "resource.k8s.io", "v1", NS, "resourceclaims", name
            )
        with contextlib.suppress(ApiException):
            await self.custom.patch_namespaced_custom_object(
                "resource.k8s.io",
                "v1",
                NS,
                "resourceclaims",
                name,
                [{"op": "remove", "path": "/metadata/finalizers"}],
                _content_type="application/json-patch+json",
            )

    async def gone(self, names: list[str]) -> None:
        view = self.view

        def check() -> bool:
            return not any(n in view.objects["claims"] or n in view.objects["pods"] for n in names)

        if not await view.wait(check, 60):
            raise TimeoutError(f"jobs {names[:5]}... not deleted after 60 s")

    async def run(self, topology: str, variant: str, run_id: str, jobs: list[Job]) -> dict[str, Any]:
        from dra_gpu.kube.api import RESOURCE_V1

        book = Book(topology, self.nodes)
        outcomes: list[Outcome] = []
        names: dict[int, str] = {}
        view = self.view
        stats0 = self.cp.stats()["kube-scheduler"]["cpu_s"]
        attempts0 = self.cp.scheduler_attempts()
        t0 = time.monotonic()
        for job in jobs:
            leaving = book.due(job.step)
            if leaving:
                await asyncio.gather(*(self.delete_job(names[s]) for s in leaving))
                await self.gone([names[s] for s in leaving])
                for s in leaving:
                    book.release(s)
            name = f"{run_id}-{job.step:05d}"
            names[job.step] = name
            free = book.free_total()
            await self.kube.create(
                f"{RESOURCE_V1}/namespaces/{NS}/resourceclaims",
                claim_body(name, claim_spec(job.gpus, topology, variant)),
            )
            pod = pod_body(name, job.gpus, self.cpu_per_gpu)
            await self.kube.create(f"/api/v1/namespaces/{NS}/pods", pod)

            def bound(name: str = name) -> bool:
                pod = view.objects["pods"].get(name) or {}
                claim = view.objects["claims"].get(name) or {}
                return bool((pod.get("spec") or {}).get("nodeName")) and bool(allocated_devices(claim))

            def decided(name: str = name) -> bool:
                return bound() or unschedulable(view.objects["pods"].get(name) or {})

            if not await view.wait(decided, 120):
                raise TimeoutError(f"job {name}: neither bound nor unschedulable after 120 s")
            if not bound() and not await view.wait(bound, self.confirm):
                await self.delete_job(name)
                await self.gone([name])
                outcomes.append(Outcome(job, None, free_before=free))
                continue
            devices = allocated_devices(view.objects["claims"][name])
            node = devices[0][0]
            gpus = tuple(sorted(self.index_of[(pool, dev)] for pool, dev in devices))
            book.take(job, node, gpus)
            outcomes.append(Outcome(job, node, gpus, free))
        wall = time.monotonic() - t0
        cpu = self.cp.stats()["kube-scheduler"]["cpu_s"] - stats0
        attempts = {k: v - attempts0.get(k, 0.0) for k, v in self.cp.scheduler_attempts().items()}
        tries = sum(v for k, v in attempts.items() if not k.endswith("_s"))
        await asyncio.gather(*(self.delete_job(names[s]) for s in list(book.running)))
        await self.gone([names[s] for s in list(book.running)])
        return {
            "outcomes": outcomes,
            "wall_s": wall,
            "scheduler_cpu_s": cpu,
            "attempts": tries,
            "scheduler_ms_per_attempt": 1000 * cpu / tries if tries else float("nan"),
        }


async def replay_all(args: argparse.Namespace, traces: dict[int, list[Job]]) -> list[dict[str, Any]]:
    from bench.scale_bench import GPU_CLASS, ControlPlane, node_body, node_name, untaint, wait_until
    from dra_gpu.kube.api import RESOURCE_V1, Kube, list_watch

    state = tempfile.mkdtemp(prefix="dra-gpu-nvlink-")
    cp = ControlPlane(state, args.port_base)
    cp.check_binaries()
    results: list[dict[str, Any]] = []
    try:
        cp.up()
        kube = await Kube.connect(cp.admin)
        try:
            await kube.create(f"{RESOURCE_V1}/deviceclasses", GPU_CLASS)
            await kube.create(f"/api/v1/namespaces/{NS}/serviceaccounts", {"metadata": {"name": "default"}})
            cp.start_kwok()
            nodes = [node_name(i) for i in range(args.nodes)]
            for i in range(args.nodes):
                await kube.create("/api/v1/nodes", node_body(i))

            async def all_ready() -> bool:
                items, _ = await kube.list_objects("/api/v1/nodes", None)
                return (
                    sum(
                        any(
                            c.get("type") == "Ready" and c.get("status") == "True"
                            for c in (n.get("status") or {}).get("conditions") or []
                        )
                        for n in items
                    )
                    >= args.nodes
                )

            await wait_until("nodes Ready (kwok)", all_ready, 180)
            await untaint(kube, args.nodes, asyncio.Semaphore(16))
            replay = Replay(cp, kube, nodes, args.confirm, args.cpu_per_gpu)
            watches = [
                asyncio.create_task(
                    list_watch(kube, f"/api/v1/namespaces/{NS}/pods", *replay.view.handlers("pods"))
                ),
                asyncio.create_task(
                    list_watch(
                        kube, f"{RESOURCE_V1}/namespaces/{NS}/resourceclaims", *replay.view.handlers("claims")
                    )
                ),
            ]
            try:
                run = 0
                for topology in args.topologies:
                    for variant in args.variants:
                        if variant == "domain-slices" and len(TOPOLOGIES[topology]) == 1:
                            continue  # one domain: the same slice as today's
                        slices = await replay.publish(topology, variant)
                        for seed, jobs in traces.items():
                            run += 1
                            r = await replay.run(topology, variant, f"r{run}", jobs)
                            outcomes = r.pop("outcomes")
                            result = {
                                "topology": topology,
                                "variant": variant,
                                "seed": seed,
                                "slices_a_node": slices / args.nodes,
                                "cpu_per_gpu": args.cpu_per_gpu,
                                **r,
                                **figures(outcomes, GPUS_A_NODE * args.nodes, args.warmup),
                                "placements": [
                                    [o.job.step, o.job.gpus, o.node, list(o.gpus)] for o in outcomes
                                ],
                            }
                            results.append(result)
                            print(row(result), flush=True)
                            if args.json:
                                Path(args.json).write_text(json.dumps(results, indent=1))
            finally:
                for w in watches:
                    w.cancel()
                for w in watches:
                    with contextlib.suppress(asyncio.CancelledError):
                        await w
        finally:
            await kube.close()
    except Exception:
        for name in ("kube-scheduler", "kube-apiserver", "kwok"):
            print(f"---- last lines of {name}'s log ----\n{cp.processes.log_tail(name, 15)}", file=sys.stderr)
        raise
    finally:
        cp.down()
        if args.keep:
            print(f"state, logs: {state}", file=sys.stderr)
        else:
            shutil.rmtree(state, ignore_errors=True)
    return results


# ---------------------------------------------------------------- report

HEADER = (
    f"{'topology':<9} {'variant':<13} {'seed':>4} {'4-GPU refused/jobs (enough free)':>32} "
    f"{'8-GPU refused/jobs (enough free)':>32} {'4+8 frag':>8} {'1+2 refused':>11} {'fill':>5} "
    f"{'sched ms/try':>12} {'wall s':>7}"
)


def row(r: dict[str, Any]) -> str:
    def size(n: int) -> str:
        s = r["by_size"].get(str(n), {"jobs": 0, "refused": 0, "fragmented": 0})
        return f"{s['refused']}/{s['jobs']} ({s['fragmented']})"

    small = sum(r["by_size"].get(str(n), {}).get("refused", 0) for n in (1, 2))
    ms = r.get("scheduler_ms_per_attempt")
    wall = r.get("wall_s")
    return (
        f"{r['topology']:<9} {r['variant']:<13} {r['seed']:>4} {size(4):>32} {size(8):>32} "
        f"{r['large_fragmented']:>8} {small:>11} {r['fill']:>5.2f} "
        f"{'-' if ms is None else f'{ms:.1f}':>12} {'-' if wall is None else f'{wall:.0f}':>7}"
    )


def summary(results: list[dict[str, Any]]) -> str:
    """Per topology and variant: the fragmented 4+8 refusals over the seeds, their sum, and the
    ratio to today's and to the oracle's over the same seeds."""
    lines = [
        f"{'topology':<9} {'variant':<13} {'4+8 fragmented per seed':<24} {'sum':>5} {'x today':>8} "
        f"{'fill':>10} {'sched ms/try':>13}"
    ]
    keys = list(dict.fromkeys((r["topology"], r["variant"]) for r in results))
    for topology, variant in keys:
        rs = [r for r in results if (r["topology"], r["variant"]) == (topology, variant)]
        seeds = [r["seed"] for r in rs]
        today = [
            r for r in results if r["topology"] == topology and r["variant"] == "today" and r["seed"] in seeds
        ]
        total = sum(r["large_fragmented"] for r in rs)
        base = sum(r["large_fragmented"] for r in today)
        ratio = f"{total / base:.2f}" if today and base else "-"
        fills = [r["fill"] for r in rs]
        ms = [r["scheduler_ms_per_attempt"] for r in rs if r.get("scheduler_ms_per_attempt") is not None]
        lines.append(
            f"{topology:<9} {variant:<13} {', '.join(str(r['large_fragmented']) for r in rs):<24} {total:>5} "
            f"{ratio:>8} {min(fills):.2f}-{max(fills):.2f} "
            + (f"{min(ms):>6.1f}-{max(ms):<6.1f}" if ms else f"{'-':>13}")
        )
    return "\n".join(lines)


def report(files: list[str]) -> int:
    """Every run of the files (each oracle row once), its rows, then the summary."""
    results: list[dict[str, Any]] = []
    seen = set()
    for f in files:
        for r in json.loads(Path(f).read_text()):
            key = (
                r["topology"],
                r["variant"],
                r["seed"],
                r.get("cpu_per_gpu"),
                f if r["variant"] != "oracle" else "",
            )
            if key not in seen:
                seen.add(key)
                results.append(r)
    results.sort(
        key=lambda r: (
            r["topology"],
            list(VARIANTS).index(r["variant"]) if r["variant"] in VARIANTS else 99,
            r["seed"],
        )
    )
    print(HEADER)
    for r in results:
        print(row(r))
    print(
        summary(
            [r for r in results if r["variant"] != "oracle"]
            + [r for r in results if r["variant"] == "oracle"]
        )
    )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--jobs", type=int, default=600, help="arrivals a trace")
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated trace seeds")
    ap.add_argument("--load", type=float, default=0.9, help="offered load: mean GPUs in use / all GPUs")
    ap.add_argument("--warmup", type=int, help="arrivals left out of the figures (default: 2 mean lives)")
    ap.add_argument("--topologies", default="hgx-2x4,dgx-h100", help=f"of {', '.join(TOPOLOGIES)}")
    ap.add_argument(
        "--variants", default="today,rank8", help="; ".join(f"{k}: {v}" for k, v in VARIANTS.items())
    )
    ap.add_argument(
        "--cpu-per-gpu",
        type=int,
        default=7,
        help="each pod requests this many CPUs and 8 GiB a CPU for each of its GPUs; 0: no requests",
    )
    ap.add_argument("--confirm", type=float, default=1.5, help="seconds an Unschedulable pod must stay so")
    ap.add_argument("--oracle-only", action="store_true", help="the traces and the oracle only, no cluster")
    ap.add_argument(
        "--report",
        nargs="+",
        metavar="JSON",
        help="print the rows and the summary of earlier runs' --json files",
    )
    ap.add_argument("--port-base", type=int, default=28000, help="ports used: base+10..12, +259, +443")
    ap.add_argument("--json", metavar="FILE", help="also write every figure (and placement) as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the state dir (logs) at the end")
    args = ap.parse_args()
    if args.report:
        return report(args.report)
    args.topologies = args.topologies.split(",")
    args.variants = args.variants.split(",")
    unknown = [t for t in args.topologies if t not in TOPOLOGIES] + [
        v for v in args.variants if v not in VARIANTS
    ]
    if unknown:
        sys.exit(f"unknown topology or variant: {', '.join(unknown)}")
    if args.warmup is None:
        args.warmup = default_warmup(args.nodes, args.load)
    seeds = [int(s) for s in args.seeds.split(",")]
    traces = {s: trace(s, args.jobs, args.nodes, args.load) for s in seeds}
    print(
        f"{args.nodes} KWOK nodes x {GPUS_A_NODE} GPUs; {args.jobs} jobs a trace, seeds {args.seeds}; mix "
        + ", ".join(f"{n} GPU {p:.0%}" for n, p in MIX)
        + f"; pods request {args.cpu_per_gpu} CPUs and {8 * args.cpu_per_gpu} GiB a GPU"
        + f"; offered load {args.load:g} (mean life {mean_life(args.nodes, args.load):.1f} steps); "
        f"figures from step {args.warmup} on; machine: {os.cpu_count()} CPUs",
        flush=True,
    )
    print(HEADER, flush=True)
    results: list[dict[str, Any]] = []
    for topology in args.topologies:
        nodes = [f"gpu-{i:03d}" for i in range(args.nodes)]
        for seed, jobs in traces.items():
            outcomes = run_oracle(topology, nodes, jobs)
            r = {
                "topology": topology,
                "variant": "oracle",
                "seed": seed,
                **figures(outcomes, GPUS_A_NODE * args.nodes, args.warmup),
            }
            results.append(r)
            print(row(r), flush=True)
    if not args.oracle_only:
        results += asyncio.run(replay_all(args, traces))
    print(
        summary(
            [r for r in results if r["variant"] != "oracle"]
            + [r for r in results if r["variant"] == "oracle"]
        )
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
