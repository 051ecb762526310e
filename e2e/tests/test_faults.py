"""Crash safety of the kubelet plugin in the real cluster.

Failpoints: the plugin is SIGKILLed at each failpoint in turn (DRA_GPU_FAILPOINTS=<name>=kill
with --enable-failpoints) while the kubelet prepares (or unprepares) a claim, started again without
it, and the kubelet's
retry finishes the job. Checked from outside: the pod runs and its container sees its devices; the
CDI dir holds exactly the specs of live claims and the plugin dir nothing but what lives there
(`PLUGIN_DIR_ENTRIES`): no temp file, no stray; a kill inside a write (between its temp file and
the rename) leaves the temp file, and the next start removes it; no device is in two claims' records; no MPS
daemon runs that no claim records, no MIG instance exists that no claim records; and after the
pod is deleted nothing is left (specs, records, daemons, instances, compute modes).

Corrupt checkpoint: with pods running, the checkpoint is truncated, bit-flipped and replaced by
garbage, one after the other, each time with the plugin killed and started again; the records are
rebuilt from the CDI specs and the API, and the pods' containers, restarted by the kubelet (no pod
deleted), still get their devices."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
from simnode.state import read_state, reboot
from support import wait_for
from test_dynamic_mig import SIM_DEV, instances, profile_is, running_log, visible
from test_kubelet_plugin import (
    CDI_DIR,
    DRIVER,
    MIG_CLASS,
    PLUGIN_DIR,
    PROFILE,
    Plugin,
    allocated,
    claim_pod,
    device_attrs,
    ensure_device_classes,
    our_slices,
    template,
)
from test_sharing import MPS_ROOT, mps_config

pytestmark = pytest.mark.e2e

ENV = "DRA_GPU_FAILPOINTS"
CHECKPOINT = PLUGIN_DIR / "checkpoint.json"
SPEC_PREFIX = f"k8s.{DRIVER}-claim_"
MIG_PROFILE = "dgx-h100-mig"
SHOW = "ls -l /dev/nvidia*; env | grep -E '^(NVIDIA|DRA_GPU|CUDA_MPS)'; sleep 3600"

# (failpoint, claim kind), the names as in dra_gpu/common/failpoints.py (the e2e tier does not import
# the package). Every failpoint once at least; the MIG cases last (another node profile).
CASES = [
    ("checkpoint-after-temp", "gpu"),
    ("cdi-spec-after-temp", "gpu"),
    ("prepare-after-started", "gpu"),
    ("prepare-after-cdi-spec", "gpu"),
    ("prepare-after-completed", "gpu"),
    ("mps-after-compute-mode", "mps"),
    ("mps-after-daemon-start", "mps"),
    ("unprepare-after-sharing", "mps"),
    ("mig-after-gpu-instance", "mig"),
    ("mig-after-compute-instance", "mig"),
    ("prepare-after-cdi-spec", "mig"),
    ("unprepare-after-instances", "mig"),
]
UNPREPARE = ("unprepare-after-sharing", "unprepare-after-instances")
# A kill inside a write: the temp file it leaves, in which directory.
IN_A_WRITE = {"checkpoint-after-temp": PLUGIN_DIR, "cdi-spec-after-temp": CDI_DIR}
# What lives in the plugin dir besides the checkpoint and its boot mark: the gRPC and health
# sockets, the health taint book, the MPS daemons' root, the simulated node (--profile); and
# checkpoints moved aside as corrupt, kept for the operator (`checkpoint.json.corrupt-<time>`);
# the instances' lock of a rolling update (`serialize.lock`, kept: removing a lock file races).
PLUGIN_DIR_ENTRIES = {
    "serialize.lock",
    "checkpoint.json",
    "checkpoint.json.boot",
    "dra-device-metadata",
    "dra.sock",
    "health.sock",
    "health-taints.json",
    "mps",
    "simulated-root",
}
CORRUPT_PREFIX = "checkpoint.json.corrupt-"
TEMPS_REMOVED = "temp files of writes a kill interrupted removed"  # the plugin's log line


# ------------------------------------------------------------------ what the node holds


def checkpoint_claims() -> dict[str, dict]:
    try:
        return json.loads(CHECKPOINT.read_text())["data"]["claims"]
    except FileNotFoundError:
        return {}


def spec_uids() -> set[str]:
    return {p.name[len(SPEC_PREFIX) : -len(".json")] for p in CDI_DIR.glob(f"{SPEC_PREFIX}*.json")}


def mps_daemon_dirs() -> set[str]:
    """Daemon ids (pipe dirs under the plugin's MPS root) of every MPS process on the host, found
    by their environment, so a daemon whose directory is gone still counts."""
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if not (proc / "comm").read_text().startswith("nvidia-cuda-mps"):
                continue
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"CUDA_MPS_PIPE_DIRECTORY="):
                pipe = Path(item.split(b"=", 1)[1].decode())
                if MPS_ROOT in pipe.parents:
                    found.add(pipe.relative_to(MPS_ROOT).parts[0])
    return found


def live_claim_uids(dyn) -> set[str]:
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    out = set()
    for c in claims.get().to_dict()["items"]:
        results = (((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results")
        if any(r.get("driver") == DRIVER for r in results or []):
            out.add(c["metadata"]["uid"])
    return out


def temp_files(directory: Path) -> list[str]:
    """The plugin's temp files (`.<target>.<8 random>.tmp`) in `directory`."""
    return sorted(n for n in os.listdir(directory) if n.startswith(".") and n.endswith(".tmp"))


def assert_no_strays(records: dict[str, dict]) -> None:
    """The CDI dir holds, of this driver's files, exactly the completed claims' specs and their
    device metadata's; the plugin dir nothing but what lives there, and device metadata only of
    completed claims. (Other drivers' CDI files are theirs.)"""
    completed = {uid for uid, r in records.items() if r.get("state") == "completed"}
    ours = sorted(n for n in os.listdir(CDI_DIR) if f"k8s.{DRIVER}" in n)
    assert ours == sorted(f"{SPEC_PREFIX}{uid}.json" for uid in completed), f"{CDI_DIR}: {ours}"
    with_metadata = {uid: r for uid, r in records.items() if uid in completed and r.get("deviceMetadata")}
    metadata_specs = sorted(n for n in os.listdir(CDI_DIR) if n.startswith(f"{DRIVER}_metadata_"))
    assert metadata_specs == sorted(
        f"{DRIVER}_metadata_{uid}_{request.split('/')[0]}.json"
        for uid, r in with_metadata.items()
        for request in r["deviceMetadata"]["requests"]
    ), f"{CDI_DIR}: {metadata_specs}"
    metadata_dir = PLUGIN_DIR / "dra-device-metadata"
    claim_dirs = sorted(os.listdir(metadata_dir)) if metadata_dir.is_dir() else []
    assert claim_dirs == sorted({f"{r['namespace']}_{r['name']}" for r in with_metadata.values()}), claim_dirs
    strays = sorted(
        n for n in os.listdir(PLUGIN_DIR) if n not in PLUGIN_DIR_ENTRIES and not n.startswith(CORRUPT_PREFIX)
    )
    assert not strays, f"{PLUGIN_DIR}: strays {strays}"


def assert_consistent(dyn) -> dict[str, int]:
    """The node's invariants; returns counts for the report."""
    records = checkpoint_claims()
    specs = spec_uids()
    assert_no_strays(records)
    leaked = specs - live_claim_uids(dyn)
    assert not leaked, f"CDI specs of no live claim: {leaked}"
    completed = {uid for uid, r in records.items() if r.get("state") == "completed"}
    assert specs == completed, f"specs {specs} vs completed records {completed}"
    held = Counter(
        d["deviceName"]
        for r in records.values()
        for d in r.get("devices") or []
        if not d.get("adminAccess") and not d.get("shareId")
    )
    twice = {d for d, n in held.items() if n > 1}
    assert not twice, f"devices in two claims' records: {twice}"
    recorded_daemons = {d["id"] for r in records.values() for d in (r.get("sharing") or {}).get("mps") or []}
    running = mps_daemon_dirs()
    assert running <= recorded_daemons, f"MPS daemons no claim records: {running - recorded_daemons}"
    recorded_instances = {
        (m["parentUUID"], m["giId"]) for r in records.values() for m in r.get("migInstances") or []
    }
    live = {(gpu, i["giId"]) for gpu, insts in mig_state().items() for i in insts}
    assert live <= recorded_instances, f"MIG instances no claim records: {live - recorded_instances}"
    return {"specs": len(specs), "daemons": len(running), "instances": len(live)}


def mig_state() -> dict[str, list[dict]]:
    return read_state(SIM_DEV).instances


def nothing_left(uid: str) -> bool:
    modes = read_state(SIM_DEV).compute_modes
    return (
        uid not in spec_uids()
        and uid not in checkpoint_claims()
        and not mps_daemon_dirs()
        and not instances()
        and all(int(m) == 0 for m in modes.values())  # DEFAULT again
    )


def claim_uid(dyn, namespace) -> str:
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    (c,) = claims.get(namespace=namespace).to_dict()["items"]
    return c["metadata"]["uid"]


# ------------------------------------------------------------------ the plugin under test


@pytest.fixture(scope="module")
def faulty(target, core, dyn, tmp_path_factory):
    if not target.local:
        pytest.skip("the plugin runs as a host process only on the local e2e cluster")
    node = core.list_node().items[0].metadata.name
    reboot(SIM_DEV)  # fresh GPUs, as after a reboot
    p = Plugin(target.kubeconfig, node, tmp_path_factory.mktemp("plugin") / "plugin.log")
    ensure_device_classes(dyn)
    yield p
    p.stop()
    api, items = our_slices(dyn)
    for s in items:
        api.delete(name=s["metadata"]["name"])
    print(f"\n[e2e] plugin log tail:\n{p.log_tail(10)}")


def restart(plugin: Plugin, dyn, kind: str, failpoint: str | None) -> None:
    """(Re)start the plugin on the node profile the claim kind needs, with or without a failpoint."""
    if plugin.proc is not None and plugin.proc.poll() is None:
        plugin.stop()
    mig = kind == "mig"
    plugin.profile = MIG_PROFILE if mig else PROFILE
    plugin.extra_args = (["--dynamic-mig"] if mig else []) + (["--enable-failpoints"] if failpoint else [])
    plugin.env = {ENV: f"{failpoint}=kill"} if failpoint else {}
    plugin.start()
    want = 4 if mig else 1
    wait_for("the node's slices", lambda: len(our_slices(dyn)[1]) == want, timeout=60)


def make_claim_template(dyn, namespace, kind: str) -> None:
    if kind == "mig":
        template(dyn, namespace, "t", device_class=MIG_CLASS, selectors=[profile_is("1g.10gb")])
    else:
        template(dyn, namespace, "t", config=mps_config(50) if kind == "mps" else None)


def assert_sees_its_devices(dyn, namespace, pod, kind, log) -> None:
    (device,) = allocated(dyn, namespace, pod)
    if kind == "mig":
        assert visible(log) in {i["uuid"] for insts in mig_state().values() for i in insts}, log
    else:
        assert visible(log) == device_attrs(dyn)[device]["uuid"], log
    assert any(
        line.split()[-1][len("/dev/nvidia") :].isdigit() for line in log.splitlines() if "/dev/nvidia" in line
    )
    if kind == "mps":
        assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in log, log


@pytest.mark.parametrize(("failpoint", "kind"), CASES, ids=[f"{fp}-{k}" for fp, k in CASES])
def test_plugin_killed_at_a_failpoint_recovers_and_leaves_nothing(
    failpoint, kind, faulty, core, dyn, namespace, busybox_image
):
    restart(faulty, dyn, kind, failpoint)
    proc = faulty.proc
    assert proc is not None
    make_claim_template(dyn, namespace, kind)
    claim_pod(core, namespace, "victim", {"resource_claim_template_name": "t"}, SHOW, busybox_image)
    if failpoint in UNPREPARE:
        running_log(core, namespace, "victim")
        uid = claim_uid(dyn, namespace)
        core.delete_namespaced_pod("victim", namespace, grace_period_seconds=0)
    wait_for(f"the plugin to die at {failpoint}", lambda: proc.poll() is not None, timeout=120)
    assert proc.returncode == -9, faulty.log_tail()
    assert f"failpoint hit name={failpoint} action=kill" in faulty.log_tail(50)
    if failpoint in IN_A_WRITE:  # the kill interrupted a write: its temp file is there
        left = temp_files(IN_A_WRITE[failpoint])
        assert left, f"no temp file in {IN_A_WRITE[failpoint]}"
        removals = faulty.log_path.read_text().count(TEMPS_REMOVED)

    restart(faulty, dyn, kind, None)
    if failpoint in IN_A_WRITE:  # ... and the start removed it
        assert not set(left) & set(temp_files(IN_A_WRITE[failpoint]))
        assert faulty.log_path.read_text().count(TEMPS_REMOVED) == removals + 1
    if failpoint not in UNPREPARE:
        log = running_log(core, namespace, "victim")
        assert_sees_its_devices(dyn, namespace, "victim", kind, log)
        uid = claim_uid(dyn, namespace)
        assert uid in spec_uids()
        counts = assert_consistent(dyn)
        print(f"\n[e2e] {failpoint} ({kind}): the pod runs after restart and retry; node holds {counts}")
        core.delete_namespaced_pod("victim", namespace, grace_period_seconds=0)
    wait_for(
        "the claim's spec, record, daemons, instances and compute modes to go",
        lambda: nothing_left(uid),
        timeout=90,
    )
    assert_consistent(dyn)


# ------------------------------------------------------------------ a corrupt checkpoint

RESTARTABLE = (
    "echo started; ls -l /dev/nvidia*; env | grep -E '^(NVIDIA|DRA_GPU|CUDA_MPS)'; "
    "while [ ! -e /tmp/restart-me ]; do sleep 0.2; done; exit 1"
)


def restartable_pod(core, namespace, name, template_name, busybox_image) -> None:
    """A pod whose container exits when told (a file in its own filesystem): the kubelet then
    starts a new container in the same pod, which needs the claim's CDI devices again."""
    core.create_namespaced_pod(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "restartPolicy": "Always",
                "terminationGracePeriodSeconds": 0,
                "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template_name}],
                "containers": [
                    {
                        "name": "main",
                        "image": busybox_image,
                        "imagePullPolicy": "Never",
                        "command": ["sh", "-c", RESTARTABLE],
                        "resources": {"claims": [{"name": "gpus"}]},
                    }
                ],
            },
        },
    )


def restarts(core, namespace, pod) -> int:
    statuses = core.read_namespaced_pod(pod, namespace).status.container_statuses or []
    return statuses[0].restart_count if statuses else 0


def running_again(core, namespace, pod, count):
    def check():
        p = core.read_namespaced_pod(pod, namespace)
        (status,) = p.status.container_statuses or [None]
        if status is None or status.restart_count < count or not status.state.running:
            return None
        log = core.read_namespaced_pod_log(pod, namespace)
        return log if "DRA_GPU_VISIBLE_DEVICES=" in log else None

    return check


def exec_in(core, namespace, pod, *argv) -> None:
    from kubernetes.stream import stream

    stream(
        core.connect_get_namespaced_pod_exec,
        pod,
        namespace,
        command=list(argv),
        stderr=True,
        stdin=False,
        stdout=True,
        tty=False,
    )


def corrupt(how: str) -> None:
    data = CHECKPOINT.read_bytes()
    if how == "truncated":
        CHECKPOINT.write_bytes(data[: len(data) // 2])
    elif how == "bytes-flipped":
        flipped = bytearray(data)
        for i in range(len(flipped) // 3, len(flipped) // 3 + 8):
            flipped[i] ^= 0x20
        CHECKPOINT.write_bytes(bytes(flipped))
    else:
        CHECKPOINT.write_bytes(b"\x00\xff garbage \x13" * 40)


def test_a_corrupt_checkpoint_is_rebuilt_and_running_pods_keep_their_devices(
    faulty, core, dyn, namespace, busybox_image
):
    restart(faulty, dyn, "gpu", None)
    template(dyn, namespace, "one")
    template(dyn, namespace, "mps", config=mps_config(50))
    pods = {"whole": "one", "shared": "mps"}
    for pod, tmpl in pods.items():
        restartable_pod(core, namespace, pod, tmpl, busybox_image)
    first = {
        pod: wait_for(f"{pod} to run", running_again(core, namespace, pod, 0), timeout=120) for pod in pods
    }
    specs = {uid: (CDI_DIR / f"{SPEC_PREFIX}{uid}.json").read_bytes() for uid in spec_uids()}
    assert len(specs) == 2
    daemons = mps_daemon_dirs()
    assert len(daemons) == 1

    for n, how in enumerate(("truncated", "bytes-flipped", "garbage"), start=1):
        faulty.kill()
        corrupt(how)
        faulty.start()
        assert "checkpoint rebuilt from the CDI specs and the API" in faulty.log_tail(200)
        assert "rebuiltClaims=2" in faulty.log_tail(200)
        # Nothing a running pod needs was removed: the same spec files, the same daemon.
        assert {u: (CDI_DIR / f"{SPEC_PREFIX}{u}.json").read_bytes() for u in spec_uids()} == specs
        assert mps_daemon_dirs() == daemons
        assert_consistent(dyn)
        # The kubelet starts a new container in each pod: it gets the claim's devices again.
        for pod in pods:
            exec_in(core, namespace, pod, "touch", "/tmp/restart-me")
        for pod in pods:
            log = wait_for(
                f"{pod}'s container to be restarted with its devices",
                running_again(core, namespace, pod, n),
                timeout=150,
            )
            assert visible(log) == visible(first[pod]), log
            assert_sees_its_devices(dyn, namespace, pod, "mps" if pod == "shared" else "gpu", log)
        print(f"\n[e2e] checkpoint {how}: rebuilt, specs byte-identical, containers restarted with devices")
    aside = list(PLUGIN_DIR.glob("checkpoint.json.corrupt-*"))
    assert len(aside) >= 3
    for pod in pods:
        core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0)
    for uid in specs:
        wait_for("the claims to be unprepared", lambda uid=uid: nothing_left(uid), timeout=90)
    for path in aside:  # the kept files are for the operator; this test's are cleaned up
        path.unlink()
