"""A node reboot and a drain in the real cluster: the power goes, the node boots, the pods come back
with their devices; the node is drained and nothing of theirs is left.

The reboot (`e2e/cluster node stop|start`, harness cleanup.power_off_node): the plugin, its MPS
daemons, the kubelet, containerd and every container are SIGKILLed at once (a power loss: nothing
cleans up); what a real node keeps in memory is gone: containerd's and runc's state, every mount
under the kubelet's root (the pods' volumes, the MPS daemons' tmpfs), the CDI specs in /var/run/cdi,
and the simulated kernel's state (MIG instances made since boot, compute modes, time-slice levels:
simnode.state.reboot). The disk stays: the kubelet's checkpoints, the plugin's checkpoint file and
directories, /etc/cdi. Then containerd and the kubelet start, and the plugin with them.

Before the reboot the plugin alone is SIGKILLed and started again: every pod keeps its container,
its devices, its daemon, instance and time slice.

The plugin reads the boot ID where a real node's plugin does (/proc/sys/kernel/random/boot_id); a
process cannot change the kernel's, so the rebooted plugin runs in a mount namespace of its own in
which a file with a new ID is bound over that path (BOOT_VIEW). The kernel's own file is unchanged.

What must hold: the kubelet prepares every pod's claim again (its DRA checkpoint survives, the
plugin's records of the old boot are discarded); each pod runs again (a new container: restartCount
went up) with the same allocation and the same devices in the container; what the reboot erased is
made again (a time slice set anew, an MPS daemon answering the claim's limits, a dynamic MIG
instance at the claim's placement); a claim whose pod was deleted while the node was down gets
nothing. Then an operator drains the node (`kubectl drain`): every pod is evicted and nothing of
their claims is left (CDI spec, checkpoint entry, MPS daemon and directory, MIG instance, time
slice)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from simnode.state import reboot
from support import cluster, own_mount_view, wait_for
from test_dynamic_mig import instances, profile_is
from test_faults import CHECKPOINT, checkpoint_claims, spec_uids
from test_kubelet_plugin import (
    MIG_CLASS,
    SIM_DEV,
    Plugin,
    allocated,
    claim_pod,
    device_attrs,
    ensure_device_classes,
    fresh_gpus,
    our_slices,
    template,
)
from test_sharing import (
    MPS_ROOT,
    TIME_SLICED_LONG,
    alive,
    ask,
    daemons,
    memory_template,
    mps_config,
    share_of,
    time_slice,
    wait_for_shareable_gpus,
)

pytestmark = pytest.mark.e2e

# The plugin's own view of the kernel's boot ID: /proc made private in its mount namespace (so that
# nothing propagates to the host), then the file bound over the kernel's; every other mount keeps
# the host's propagation, so the MPS daemons' tmpfs mounts reach containerd as on a real node.
BOOT_VIEW = (
    'mount --make-rprivate /proc && mount --bind "$1" /proc/sys/kernel/random/boot_id && shift && exec "$@"'
)
SHOW = (
    "ls /dev/nvidia[0-9]* /dev/nvidia-caps/ 2>&1 | sort; env | grep ^DRA_GPU_VISIBLE_DEVICES=; "
    "echo shown; sleep 3600"
)


@pytest.fixture
def node_plugin(target, core, dyn, tmp_path):
    if not target.local:
        pytest.skip("powers off the local e2e cluster's node")
    fresh_gpus(SIM_DEV)
    p = Plugin(target.kubeconfig, core.list_node().items[0].metadata.name, tmp_path / "plugin.log")
    ensure_device_classes(dyn)
    yield p
    p.stop()
    p.wrapper = []
    api, items = our_slices(dyn)
    for s in items:
        api.delete(name=s["metadata"]["name"])
    print(f"\n[e2e] plugin log tail:\n{p.log_tail(12)}")


def claim_uids(dyn, namespace) -> dict[str, str]:
    """Pod name -> the uid of the claim made for it."""
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    out = {}
    for c in claims.get(namespace=namespace).to_dict()["items"]:
        for owner in c["metadata"].get("ownerReferences") or []:
            out[owner["name"]] = c["metadata"]["uid"]
    return out


def shown(core, namespace, pod, restarted: bool = False) -> list[str] | None:
    """What the pod's running container printed of its devices (its first container, or with
    `restarted` one started after it); None until then."""
    p = core.read_namespaced_pod(pod, namespace)
    statuses = p.status.container_statuses or []
    if p.status.phase != "Running" or not statuses or not statuses[0].state.running:
        return None
    if restarted != (statuses[0].restart_count > 0):
        return None
    try:
        log = core.read_namespaced_pod_log(pod, namespace)
    except Exception:
        return None
    lines = log.splitlines()
    return lines[: lines.index("shown")] if "shown" in lines else None


def run_pods(core, namespace, pods: dict[str, str], busybox_image) -> dict[str, list[str]]:
    """Start a pod per template (restartPolicy Always: a reboot starts its container again); what
    each one's container saw of its devices."""
    for pod, tmpl in pods.items():
        claim_pod(
            core,
            namespace,
            pod,
            {"resource_claim_template_name": tmpl},
            SHOW,
            busybox_image,
            restart_policy="Always",
        )
    return {
        pod: wait_for(
            f"pod {pod} to show its devices", lambda pod=pod: shown(core, namespace, pod), timeout=120
        )
        for pod in pods
    }


def checkpoint() -> dict:
    """The checkpoint's data: its boot ID and claims, read at once."""
    return json.loads(CHECKPOINT.read_text())["data"]


def crash(plugin: Plugin, core, namespace, before: dict[str, list[str]]) -> None:
    """The plugin alone is SIGKILLed and started again (same boot): every pod keeps its container
    (never restarted) and its devices, and the checkpoint keeps every record."""
    records = set(checkpoint_claims())
    t0 = time.time()
    plugin.kill()
    plugin.start()
    for pod, seen in before.items():
        status = core.read_namespaced_pod(pod, namespace).status
        assert status.phase == "Running" and status.container_statuses[0].restart_count == 0, (pod, status)
        assert shown(core, namespace, pod) == seen, pod
    assert set(checkpoint_claims()) == records
    print(f"[e2e] plugin SIGKILLed and back in {time.time() - t0:.1f} s: every pod kept")


def power_loss(plugin: Plugin) -> float:
    """The power goes: the plugin and its MPS daemons die with everything else of the node."""
    t0 = time.time()
    victims = list(daemons().values())
    plugin.kill()
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    print(f"[e2e] {cluster('node', 'stop').strip()}")
    reboot(SIM_DEV)  # the kernel's state is gone with the power
    wait_for("the MPS daemons to be gone", lambda: not any(alive(p) for p in victims), timeout=10)
    return t0


def boot(plugin: Plugin, tmp_path: Path) -> str:
    """The node boots with a new boot ID: containerd and the kubelet, then the plugin."""
    boot_id = str(uuid.uuid4())
    boot_file = tmp_path / "boot_id"
    boot_file.write_text(boot_id + "\n")
    print(f"[e2e] {cluster('node', 'start').strip()}")
    plugin.wrapper = [*own_mount_view(BOOT_VIEW), str(boot_file)]
    plugin.start()
    return boot_id


def came_back(core, namespace, before: dict[str, list[str]], t0: float) -> None:
    """Every pod runs again in a new container that sees exactly the devices it saw before."""
    for pod, seen in before.items():
        again = wait_for(
            f"pod {pod} to run again after the reboot",
            lambda pod=pod: shown(core, namespace, pod, restarted=True),
            timeout=150,
        )
        assert again == seen, (pod, seen, again)
    print(f"[e2e] every pod ran again {time.time() - t0:.1f} s after the power loss")


def drained(node: str, uids) -> float:
    """An operator drains the rebooted node (--force: the test's pods are bare): every pod is
    evicted and nothing of their claims is left, no CDI spec and no checkpoint entry (each test
    checks the rest: MIG instance, daemon, time slice). Returns how long the drain took."""
    from harness.processes import kubectl

    t0 = time.time()
    try:
        r = kubectl("drain", node, "--ignore-daemonsets", "--force", "--timeout=120s", check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        wait_for(
            "the claims to be unprepared",
            lambda: not (spec_uids() & set(uids)) and not (set(checkpoint_claims()) & set(uids)),
            timeout=90,
        )
        return time.time() - t0
    finally:
        kubectl("uncordon", node, check=False)


def test_reboot_brings_back_whole_gpu_static_mig_time_sliced_and_mps_pods(
    node_plugin, core, dyn, namespace, busybox_image, tmp_path
):
    plugin = node_plugin
    plugin.profile = "dgx-a100-mig"  # GPUs 0-2 in MIG mode with instances made at boot, 3-7 whole
    plugin.start()
    template(dyn, namespace, "whole")
    template(dyn, namespace, "mig", device_class=MIG_CLASS, selectors=[profile_is("3g.40gb")])
    template(dyn, namespace, "sliced", config=TIME_SLICED_LONG)
    template(dyn, namespace, "mps", config=mps_config(50))
    pods = {"whole": "whole", "mig": "mig", "sliced": "sliced", "mps": "mps"}
    before = run_pods(core, namespace, pods, busybox_image)
    uids = claim_uids(dyn, namespace)
    devices = {pod: allocated(dyn, namespace, pod) for pod in pods}
    attrs = device_attrs(dyn)
    sliced_uuid = attrs[devices["sliced"][0]]["uuid"]
    assert "Timeslice 3 (LONG)" in time_slice(sliced_uuid, plugin.profile)
    ((pipe, old_daemon),) = daemons().items()
    assert ask(pipe, "get_default_active_thread_percentage") == ["50.0"]
    assert spec_uids() == set(uids.values())
    crash(plugin, core, namespace, before)
    assert "Timeslice 3 (LONG)" in time_slice(sliced_uuid, plugin.profile)
    assert daemons() == {pipe: old_daemon} and ask(pipe, "get_default_active_thread_percentage") == ["50.0"]

    t0 = power_loss(plugin)
    # What the reboot took: the time slice, the daemon, the CDI specs.
    assert "Timeslice 0 (DEFAULT)" in time_slice(sliced_uuid, plugin.profile)
    assert not spec_uids() and not alive(old_daemon)
    boot_id = boot(plugin, tmp_path)

    came_back(core, namespace, before, t0)
    assert {pod: allocated(dyn, namespace, pod) for pod in pods} == devices  # the same allocation
    assert claim_uids(dyn, namespace) == uids  # the same claims
    assert "Timeslice 3 (LONG)" in time_slice(sliced_uuid, plugin.profile)  # set again
    ((pipe_now, daemon),) = daemons().items()
    assert daemon != old_daemon and alive(daemon)
    assert ask(pipe_now, "get_default_active_thread_percentage") == ["50.0"]
    data = checkpoint()
    assert data["bootId"] == boot_id and set(data["claims"]) == set(uids.values())
    assert spec_uids() == set(uids.values())
    assert "checkpoint from another boot discarded" in plugin.log_tail(400)
    print(f"[e2e] after the reboot: {devices}; MPS daemon {old_daemon} -> {daemon}; time slice set again")

    took = drained(plugin.node, uids.values())
    wait_for("the daemon to stop", lambda: not alive(daemon) and not daemons(), timeout=60)
    assert "Timeslice 0 (DEFAULT)" in time_slice(sliced_uuid, plugin.profile)
    assert not [d for d in MPS_ROOT.glob("*") if d.name.startswith(tuple(uids.values()))]  # its MPS dir too
    print(f"[e2e] drained in {took:.1f} s: no spec, checkpoint entry, daemon or time slice left")


def test_reboot_remakes_dynamic_mig_instances_of_claims_still_prepared_only(
    node_plugin, core, dyn, namespace, busybox_image, tmp_path
):
    plugin = node_plugin
    plugin.profile, plugin.extra_args = "dgx-h100-mig", ["--dynamic-mig"]
    plugin.start()
    template(dyn, namespace, "two-g", device_class=MIG_CLASS, selectors=[profile_is("2g.20gb")])
    template(dyn, namespace, "three-g", device_class=MIG_CLASS, selectors=[profile_is("3g.40gb")])
    before = run_pods(core, namespace, {"kept": "two-g", "gone": "three-g"}, busybox_image)
    uids = claim_uids(dyn, namespace)
    (kept_device,) = allocated(dyn, namespace, "kept")
    both = instances()
    assert len(both) == 2
    crash(plugin, core, namespace, before)
    assert instances() == both  # the same two, neither made again nor destroyed

    t0 = power_loss(plugin)
    assert not instances()  # a reboot destroys every MIG instance
    # While the node is down its user deletes a pod: its claim goes with it.
    core.delete_namespaced_pod("gone", namespace, grace_period_seconds=0)
    wait_for("the deleted pod's claim to go", lambda: "gone" not in claim_uids(dyn, namespace), timeout=60)
    boot_id = boot(plugin, tmp_path)

    again = wait_for(
        "pod kept to run again", lambda: shown(core, namespace, "kept", restarted=True), timeout=150
    )
    (made,) = instances()  # made again for the claim still prepared; none for the deleted one
    assert kept_device.endswith(f"-mig-{made['profile'].replace('.', '')}-{made['placement']}"), (
        kept_device,
        made,
    )
    # The new instance's UUID and its device nodes (a MIG device's two caps nodes).
    assert f"DRA_GPU_VISIBLE_DEVICES={made['uuid']}" in again
    assert (
        len([x for x in again if x.startswith("nvidia-cap")])
        == len([x for x in before["kept"] if x.startswith("nvidia-cap")])
        == 2
    )
    data = checkpoint()
    assert data["bootId"] == boot_id and set(data["claims"]) == {uids["kept"]}
    assert spec_uids() == {uids["kept"]}
    print(
        f"[e2e] after the reboot {time.time() - t0:.1f} s: {kept_device} made again as {made['uuid']}; "
        f"the deleted pod's claim got nothing"
    )

    took = drained(plugin.node, [uids["kept"]])
    wait_for("the instance to be destroyed", lambda: not instances(), timeout=60)
    print(f"[e2e] drained in {took:.1f} s: no spec, checkpoint entry or MIG instance left")


def share_limits(uuid: str) -> list[str]:
    """What each MPS daemon on the node answers as its client's pinned-memory limit on `uuid`."""
    return sorted(a for pipe in daemons() for a in ask(pipe, f"get_default_device_pinned_mem_limit {uuid}"))


def test_reboot_brings_back_memory_shares_each_with_its_daemon(
    node_plugin, core, dyn, namespace, busybox_image, tmp_path
):
    plugin = node_plugin
    plugin.profile, plugin.extra_args = "dgx-a100-mig", ["--memory-shares"]
    plugin.start()
    wait_for_shareable_gpus(dyn)
    memory_template(dyn, namespace, "forty", "40Gi")
    before = run_pods(core, namespace, {"a": "forty", "b": "forty"}, busybox_image)
    uids = claim_uids(dyn, namespace)
    shares = {pod: share_of(dyn, namespace, pod) for pod in before}
    (device,) = {s[0] for s in shares.values()}  # two shares of one GPU
    uuid = device_attrs(dyn)[device]["uuid"]
    old = set(daemons().values())
    assert share_limits(uuid) == ["40960M", "40960M"]
    crash(plugin, core, namespace, before)
    assert set(daemons().values()) == old and share_limits(uuid) == ["40960M", "40960M"]

    t0 = power_loss(plugin)
    boot(plugin, tmp_path)
    came_back(core, namespace, before, t0)
    assert {pod: share_of(dyn, namespace, pod) for pod in before} == shares  # the same shares
    assert not old & set(daemons().values()) and len(daemons()) == 2  # a new daemon per share
    assert share_limits(uuid) == ["40960M", "40960M"]
    print(f"[e2e] after the reboot: {shares}; each share's daemon answers its limit again")

    took = drained(plugin.node, uids.values())
    wait_for("the shares' daemons to stop", lambda: not daemons(), timeout=60)
    print(f"[e2e] drained in {took:.1f} s: no spec, checkpoint entry or daemon left")
