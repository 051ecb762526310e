"""Outages around dra-gpu's kubelet plugin on the real cluster: the apiserver stopped for 30 s
while pods come and go, containerd restarted under a running GPU pod, and a CDI directory that is
full or read-only. Each prints what it measured ("[e2e] outage ...") for docs/operations.md, "Outages"."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest
from support import cluster, never, wait_for
from test_kubelet_plugin import (
    CDI_DIR,
    DRIVER,
    HTTP,
    PLUGIN_DIR,
    Plugin,
    allocated,
    claim_pod,
    ensure_device_classes,
    our_slices,
    template,
)

pytestmark = pytest.mark.e2e

OUTAGE_S = 30
RECOVERY_S = 10  # everything of the plugin's is back within this of the apiserver's return


@pytest.fixture(scope="module")
def plugin(target, core, dyn, tmp_path_factory):
    if not target.local:
        pytest.skip("stops and starts the local e2e cluster's own processes")
    node = core.list_node().items[0].metadata.name
    p = Plugin(target.kubeconfig, node, tmp_path_factory.mktemp("plugin") / "plugin.log")
    ensure_device_classes(dyn)
    p.start()
    yield p
    p.stop()
    api, items = our_slices(dyn)
    for s in items:
        api.delete(name=s["metadata"]["name"])


def running(core, namespace, pod):
    p = core.read_namespaced_pod(pod, namespace)
    return p if p.status.phase == "Running" and p.status.container_statuses else None


def claim_uid(dyn, namespace, pod):
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    for c in claims.get(namespace=namespace).to_dict()["items"]:
        if pod in [o.get("name") for o in c["metadata"].get("ownerReferences") or []]:
            return c["metadata"]["uid"]
    return None


def spec_file(uid: str) -> Path:
    return CDI_DIR / f"k8s.{DRIVER}-claim_{uid}.json"


def recorded(uid: str) -> bool:
    doc = json.loads((PLUGIN_DIR / "checkpoint.json").read_text())
    return uid in doc["data"]["claims"]


def logged_at(line: str) -> float:
    """The time of a plugin log line (logfmt: `time=2026-12-01T14:14:09.295Z`, RFC 3339 UTC)."""
    stamp = re.search(r"time=(\S+)", line)
    return datetime.fromisoformat(stamp[1]).timestamp() if stamp else 0.0


def plugin_healthy() -> bool:
    """The plugin's /healthz: it calls its own registration and DRA sockets as the kubelet does."""
    try:
        with urllib.request.urlopen(f"http://{HTTP}/healthz", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_apiserver_outage_of_30s_while_pods_come_and_go(plugin, core, dyn, namespace, busybox_image):
    # Both pods want GPU 0: the arriving one can be allocated only once the leaving one's claim
    # is released, which needs the apiserver, so its whole path runs after the return.
    template(dyn, namespace, "gpu-zero", selectors=[f"device.attributes['{DRIVER}'].index == 0"])
    src = {"resource_claim_template_name": "gpu-zero"}
    wait_for("earlier claims unprepared", lambda: not list(CDI_DIR.glob(f"k8s.{DRIVER}-claim_*")), timeout=90)
    claim_pod(core, namespace, "leaving", src, "sleep 3600", busybox_image)
    wait_for("the leaving pod to run", lambda: running(core, namespace, "leaving"), timeout=90)
    leaving = spec_file(claim_uid(dyn, namespace, "leaving"))
    assert leaving.exists()
    pid = plugin.proc.pid
    log_from = plugin.log_path.stat().st_size

    # One pod goes and one comes just as the apiserver stops.
    core.delete_namespaced_pod("leaving", namespace, grace_period_seconds=0)
    claim_pod(core, namespace, "arriving", src, "sleep 3600", busybox_image)
    cluster("apiserver", "stop")
    stopped = time.time()
    try:
        served = 0
        while time.time() - stopped < OUTAGE_S:
            assert plugin.proc.poll() is None, f"the plugin exited during the outage:\n{plugin.log_tail()}"
            served += plugin_healthy()
            time.sleep(1)
        unprepared_during = not leaving.exists()
    finally:
        cluster("apiserver", "start")
    back = time.time()
    outage = back - stopped

    # Slices: deleted right at the return, so only a plugin whose watch is back restores them.
    api, items = our_slices(dyn)
    for s in items:
        api.delete(name=s["metadata"]["name"])
    # When each step of the cluster's recovery is first seen (seconds after the return).
    seen: dict[str, float] = {}
    checks = {
        "slices": lambda: len(our_slices(dyn)[1]) == 1,
        "allocated": lambda: allocated(dyn, namespace, "arriving"),
        "bound": lambda: core.read_namespaced_pod("arriving", namespace).spec.node_name,
        "running": lambda: running(core, namespace, "arriving"),
    }
    deadline = back + 90
    while len(seen) < len(checks) and time.time() < deadline:
        for what, check in checks.items():
            if what not in seen and check():
                seen[what] = time.time() - back
        time.sleep(0.1)
    assert set(seen) == set(checks), f"not back 90 s after the apiserver's return: {seen}"
    slices_s, pod_s = seen["slices"], seen["running"]
    assert slices_s <= RECOVERY_S, seen
    # The pending claim: the plugin prepared it at the kubelet's first call after the return (no
    # failed try). When the kubelet calls is the kubelet's: its own watches come back on their
    # own backoff, so the pod's time is recorded, bounded only by the 90 s above.
    with open(plugin.log_path, "rb") as f:
        f.seek(log_from)
        after = f.read().decode(errors="replace")
    arriving_uid = claim_uid(dyn, namespace, "arriving")
    lines = [(logged_at(line) - back, line) for line in after.splitlines() if arriving_uid in line]
    prepared = [t for t, line in lines if "claim prepared" in line]
    failed_after_return = [line for t, line in lines if t > 0 and "prepare failed" in line]
    assert prepared and not failed_after_return, after[-3000:]
    prepared_s = prepared[0]
    arriving = spec_file(claim_uid(dyn, namespace, "arriving"))
    assert arriving.exists()
    wait_for("the leaving pod's claim unprepared", lambda: not leaving.exists(), timeout=RECOVERY_S)

    assert plugin.proc.poll() is None and plugin.proc.pid == pid
    assert served >= OUTAGE_S - 5, f"/healthz answered only {served} times in {OUTAGE_S} s"
    # The plugin's retries backed off (tenacity: exponential with jitter, capped).
    with open(plugin.log_path, "rb") as f:
        f.seek(log_from)
        text = f.read().decode(errors="replace")
    delays = [float(d) for d in re.findall(r"list\+watch failed, retrying in ([0-9.]+)s", text)]
    assert len(delays) >= 3, text[-3000:]
    assert max(delays) >= 4 * min(delays) and max(delays) <= 5.0 + 0.2 + 0.01, delays
    assert len(delays) <= 25, f"{len(delays)} retries in {outage:.0f} s: no backoff"
    # The controller-manager is back too (its service-account controller), for the next tests.
    probe = f"{namespace}-after"
    core.create_namespace({"metadata": {"name": probe}})
    wait_for(
        "the controller-manager after the outage",
        lambda: core.list_namespaced_service_account(probe).items,
        timeout=120,
        interval=0.5,
    )
    controllers_s = time.time() - back
    core.delete_namespace(probe)
    print(
        f"\n[e2e] outage apiserver down {outage:.1f} s: plugin kept serving (/healthz {served}/{OUTAGE_S}), "
        f"unprepared during the outage: {unprepared_during}; {len(delays)} list+watch retries, delays "
        f"{min(delays):.2f}..{max(delays):.2f} s; after the return: slices republished in {slices_s:.1f} s, "
        f"pending claim allocated in {seen['allocated']:.1f} s, pod bound in {seen['bound']:.1f} s, "
        f"prepared by the plugin at {prepared_s:.1f} s (the kubelet's first call), Running in {pod_s:.1f} s; "
        f"controller-manager serving new namespaces in {controllers_s:.1f} s"
    )
    core.delete_namespaced_pod("arriving", namespace, grace_period_seconds=0)
    wait_for("the arriving claim unprepared", lambda: not arriving.exists(), timeout=90)


def test_containerd_restart_leaves_running_pods_alone(plugin, core, dyn, namespace, busybox_image):
    template(dyn, namespace, "one-gpu")
    src = {"resource_claim_template_name": "one-gpu"}
    claim_pod(core, namespace, "steady", src, "sleep 3600", busybox_image)
    before = wait_for("the steady pod to run", lambda: running(core, namespace, "steady"), timeout=90)
    container_id = before.status.container_statuses[0].container_id
    t0 = time.time()
    cluster("restart-containerd")  # returns once the new containerd answers
    restart_s = time.time() - t0

    def replaced() -> str | None:
        """What the kubelet did to the steady pod's container, once it did something."""
        pod = core.read_namespaced_pod("steady", namespace)
        s = (pod.status.container_statuses or [None])[0]
        if s is None or s.container_id != container_id or s.restart_count != 0 or not s.state.running:
            return f"phase {pod.status.phase}, container {s}"
        return None

    # The event that shows the kubelet has looked at the runtime again: a new GPU pod runs to
    # completion, which takes the kubelet's calls to the new containerd (sandbox, container) and
    # a relist of every container (PLEG: that is how it sees the pod's container exit), the steady
    # one's included. A replaced container (new ID, restart count) never changes back, so the
    # steady pod is watched throughout, from the restart to the fresh pod's end.
    t0 = time.time()
    claim_pod(core, namespace, "fresh", src, "env | grep ^DRA_GPU_VISIBLE", busybox_image)

    def fresh_done() -> str | None:
        if why := replaced():
            raise AssertionError(f"the kubelet replaced the steady pod's container: {why}")
        phase = core.read_namespaced_pod("fresh", namespace).status.phase
        return phase if phase in ("Succeeded", "Failed") else None

    phase = wait_for("the fresh pod to finish", fresh_done, timeout=120, interval=0.5)
    assert phase == "Succeeded", core.read_namespaced_pod_log("fresh", namespace)
    fresh_s = time.time() - t0
    # The steady pod's status, if that relist changed it, is written by the kubelet's status
    # manager at once (a changed status is not batched), as the fresh pod's was: 2 s cover that
    # write's round trip.
    never("the kubelet to replace the steady pod's container", replaced, window=2, interval=0.2)
    assert plugin.proc.poll() is None
    assert "DRA_GPU_VISIBLE_DEVICES=GPU-" in core.read_namespaced_pod_log("fresh", namespace)
    print(
        f"\n[e2e] outage containerd restarted in {restart_s:.1f} s: running pod kept its container "
        f"(restartCount 0); a new GPU pod ran to completion in {fresh_s:.1f} s"
    )
    for pod in ("steady", "fresh"):
        core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0)
    wait_for("the claims unprepared", lambda: not list(CDI_DIR.glob(f"k8s.{DRIVER}-claim_*")), timeout=90)


@contextlib.contextmanager
def tiny_tmpfs_over_cdi_dir():
    """A 64 KiB tmpfs over the CDI dir holding what the dir held, unmounted at the end."""
    held = {p.name: p.read_bytes() for p in CDI_DIR.iterdir() if p.is_file()}
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=755", "tmpfs", str(CDI_DIR)], check=True)
    try:
        for name, data in held.items():
            (CDI_DIR / name).write_bytes(data)
        # containerd's CDI cache watches the directory it found at start: restarted, it watches
        # the tmpfs (and after the unmount, the directory again).
        cluster("restart-containerd")
        yield
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(CDI_DIR)], check=False)
        subprocess.run(["umount", "-l", str(CDI_DIR)], check=False)
        cluster("restart-containerd")


def fill(directory: Path) -> Path:
    filler = directory / "filler"
    for chunk in (4096, 1):
        with contextlib.suppress(OSError), open(filler, "ab") as f:
            while True:
                f.write(b"\0" * chunk)
                f.flush()
    return filler


def prepare_failure(core, namespace, pod):
    events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={pod}").items
    return next((e.message for e in events if e.reason == "FailedPrepareDynamicResources"), None)


@pytest.mark.parametrize("condition", ["full", "read-only"])
def test_cdi_dir_full_or_read_only(plugin, core, dyn, namespace, busybox_image, condition):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs over the CDI dir needs root")
    template(dyn, namespace, "one-gpu")
    wait_for("earlier claims unprepared", lambda: not list(CDI_DIR.glob(f"k8s.{DRIVER}-claim_*")), timeout=90)
    with tiny_tmpfs_over_cdi_dir():
        if condition == "full":
            filler = fill(CDI_DIR)
            expected = "No space left on device"
        else:
            subprocess.run(["mount", "-o", "remount,ro", str(CDI_DIR)], check=True)
            expected = "Read-only file system"
        claim_pod(
            core,
            namespace,
            "blocked",
            {"resource_claim_template_name": "one-gpu"},
            "sleep 3600",
            busybox_image,
        )
        message = wait_for(
            "the prepare failure event", lambda: prepare_failure(core, namespace, "blocked"), timeout=90
        )
        uid = claim_uid(dyn, namespace, "blocked")
        assert str(spec_file(uid)) in message and expected in message, message
        # Nothing half-written: no spec, no temporary file, no checkpoint record.
        assert sorted(p.name for p in CDI_DIR.iterdir() if uid in p.name or p.name.startswith(".")) == []
        assert not recorded(uid)
        assert core.read_namespaced_pod("blocked", namespace).status.phase == "Pending"
        if condition == "full":
            filler.unlink()
        else:
            subprocess.run(["mount", "-o", "remount,rw", str(CDI_DIR)], check=True)
        cleared = time.time()
        wait_for("the blocked pod to run", lambda: running(core, namespace, "blocked"), timeout=120)
        retry_s = time.time() - cleared
        assert spec_file(uid).exists() and recorded(uid)
        print(
            f"\n[e2e] outage CDI dir {condition}: prepare failed with {message!r}; "
            f"Running {retry_s:.1f} s after the condition cleared (the kubelet's retry)"
        )
        core.delete_namespaced_pod("blocked", namespace, grace_period_seconds=0)
        wait_for("the claim unprepared", lambda: not spec_file(uid).exists(), timeout=90)
