"""GPU health in the real cluster: an XID injected into the simulated node's NVML (through
`dra-gpu health simulate`, as a user would) becomes a device taint in the ResourceSlice, the pod's
status shows the device unhealthy, NoExecute evicts the pod, the scheduler avoids the GPU, and the
taint goes by itself after the recovery and the hold-down."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import pytest
from support import never, wait_for
from test_dynamic_mig import unschedulable
from test_kubelet_plugin import (
    DRIVER,
    HTTP,
    PLUGIN_DIR,
    Plugin,
    allocated,
    ensure_device_classes,
    our_slices,
    template,
)

from dra_gpu.common.exit_codes import EXIT_UNALLOCATABLE

pytestmark = pytest.mark.e2e

KEY = f"{DRIVER}/unhealthy"
HOLD_DOWN = 3.0


def health(*args: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "dra_gpu.cli", "health", "--plugin-dir", str(PLUGIN_DIR), *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def hplugin(target, core, dyn, tmp_path_factory):
    if not target.local:
        pytest.skip("the plugin runs as a host process only on the local e2e cluster")
    node = core.list_node().items[0].metadata.name
    p = Plugin(target.kubeconfig, node, tmp_path_factory.mktemp("health") / "plugin.log")
    p.extra_args = ["--health-hold-down", str(HOLD_DOWN), "--health-check-interval", "0.2"]
    (PLUGIN_DIR / "health-taints.json").unlink(missing_ok=True)
    ensure_device_classes(dyn)
    p.start()
    yield p
    p.stop()
    (PLUGIN_DIR / "health-taints.json").unlink(missing_ok=True)
    api, items = our_slices(dyn)
    for s in items:
        api.delete(name=s["metadata"]["name"])


def devices(dyn) -> dict[str, dict]:
    return {d["name"]: d for s in our_slices(dyn)[1] for d in s["spec"]["devices"]}


def index_of(dyn) -> dict[str, int]:
    return {name: d["attributes"]["index"]["int"] for name, d in devices(dyn).items()}


def taints(dyn) -> dict[str, list[dict]]:
    return {name: d["taints"] for name, d in devices(dyn).items() if d.get("taints")}


def gpu_pod(core, namespace, name, template_name, image, grace=30):
    """A pod holding the claim `gpus` from a template; busybox `sh -c` execs `sleep`, the container's
    PID 1 with no handler, so SIGTERM is ignored: with a grace period an evicted pod stays
    Terminating for a while and its status can still be read."""
    core.create_namespaced_pod(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": grace,
                "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template_name}],
                "containers": [
                    {
                        "name": "main",
                        "image": image,
                        "imagePullPolicy": "Never",
                        "command": ["sh", "-c", "sleep 3600"],
                        "resources": {"claims": [{"name": "gpus"}]},
                    }
                ],
            },
        },
    )


def pod_json(dyn, namespace, name):
    api = dyn.resources.get(api_version="v1", kind="Pod")
    try:
        return api.get(namespace=namespace, name=name).to_dict()
    except Exception as exc:
        if getattr(exc, "status", None) == 404:
            return None
        raise


def unhealthy_resources(pod) -> list[dict]:
    out = []
    for cs in (pod or {}).get("status", {}).get("containerStatuses") or []:
        for entry in cs.get("allocatedResourcesStatus") or []:
            out += [r for r in entry.get("resources") or [] if r.get("health") == "Unhealthy"]
    return out


def resources_status(pod) -> str:
    """Where the pod is and what its containers' allocatedResourcesStatus says, for a failure
    message: gone, or evicted (deletionTimestamp) before the kubelet wrote the device's health."""
    if pod is None:
        return "the pod is gone"
    status = pod.get("status") or {}
    conditions = {c["type"]: c.get("lastTransitionTime") for c in status.get("conditions") or []}
    return (
        f"phase={status.get('phase')} deletionTimestamp={pod['metadata'].get('deletionTimestamp')} "
        f"DisruptionTarget={conditions.get('DisruptionTarget')} allocatedResourcesStatus="
        f"{[cs.get('allocatedResourcesStatus') for cs in status.get('containerStatuses') or []]}"
    )


def why(core, dyn, namespace, pod) -> str:
    """The pod's events and its claims, for a failure message."""
    events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={pod}").items
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    out = [f"event {e.reason}: {e.message}" for e in events]
    for c in claims.get(namespace=namespace).to_dict()["items"]:
        out.append(f"claim {c['metadata']['name']}: spec={c['spec']} status={c.get('status')}")
    return "\n".join(out)


def metrics() -> str:
    with urllib.request.urlopen(f"http://{HTTP}/metrics", timeout=2) as r:
        return r.read().decode()


def evicted(dyn, namespace, pod) -> bool:
    """The pod is being deleted (evicted) or gone."""
    p = pod_json(dyn, namespace, pod)
    return p is None or bool(p["metadata"].get("deletionTimestamp"))


def added_taints(text: str) -> list[str]:
    """The plugin's counters of taints added (its decisions), from a /metrics scrape."""
    return sorted(
        line
        for line in text.splitlines()
        if line.startswith('dra_gpu_taint_transitions_total{action="added"')
    )


def test_xid_79_taints_evicts_avoids_and_recovers(hplugin, core, dyn, namespace, busybox_image):
    template(dyn, namespace, "four-nvlink", count=4, nvlink=True)
    gpu_pod(core, namespace, "victim", "four-nvlink", busybox_image)
    wait_for(
        "the victim to run",
        lambda: core.read_namespaced_pod("victim", namespace).status.phase == "Running",
        timeout=120,
    )
    mine = allocated(dyn, namespace, "victim")
    idx = index_of(dyn)
    by_index = {i: n for n, i in idx.items()}
    target = by_index[2] if by_index[2] in mine else mine[0]
    others = sorted(i for i in idx.values() if i not in {idx[d] for d in mine})

    t0 = time.monotonic()
    health("simulate", "xid", "--xid", "79", "--gpu", target)
    got = wait_for(
        "the NoExecute taint in the slice", lambda: taints(dyn).get(target), timeout=2, interval=0.02
    )
    latency = time.monotonic() - t0
    assert got[0]["key"] == KEY and got[0]["value"] == "xid-79" and got[0]["effect"] == "NoExecute"
    assert got[0].get("timeAdded")
    assert list(taints(dyn)) == [target]
    print(f"\n[e2e] XID 79 -> taint in the apiserver: {latency * 1000:.0f} ms")

    # The claim's status.devices: the plugin's data and a Healthy condition that follows the monitor.
    def claim_status():
        claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
        for c in claims.get(namespace=namespace).to_dict()["items"]:
            if "victim" in [o.get("name") for o in c["metadata"].get("ownerReferences") or []]:
                return {d["device"]: d for d in (c.get("status") or {}).get("devices") or []}
        return {}

    entry = wait_for(
        "the claim's status to show the device unhealthy",
        lambda: (
            (e := claim_status().get(target))
            and {c["type"]: c["status"] for c in e.get("conditions") or []}.get("Healthy") == "False"
            and e
        ),
        timeout=10,
    )
    assert entry["data"]["index"] == idx[target] and entry["data"]["uuid"].startswith("GPU-")
    assert {c["type"]: c["status"] for c in entry["conditions"]}["Ready"] == "True"
    assert sorted(claim_status()) == sorted(mine)

    # The kubelet's health stream: the pod's status names the device unhealthy. The kubelet writes
    # it only when it syncs the pod, and an evicted pod is synced once before its containers are
    # killed and next after its claims are unprepared: the plugin tells the kubelet before it
    # publishes the taint, so the status shows it whether or not the eviction has begun.
    seen: dict = {}

    def victim_unhealthy():
        seen["pod"] = pod_json(dyn, namespace, "victim")
        return unhealthy_resources(seen["pod"])

    try:
        bad = wait_for("allocatedResourcesStatus to show the device unhealthy", victim_unhealthy, timeout=30)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{resources_status(seen.get('pod'))}") from None
    evicting = bool(seen["pod"]["metadata"].get("deletionTimestamp"))
    print(
        f"[e2e] pod status after {time.monotonic() - t0:.1f} s (evicted yet: {evicting}): "
        f"allocatedResourcesStatus {bad}"
    )
    # NoExecute: the controller-manager evicts the pod.
    wait_for(
        "the victim to be evicted",
        lambda: (pod_json(dyn, namespace, "victim") or {"metadata": {"deletionTimestamp": "gone"}})[
            "metadata"
        ].get("deletionTimestamp"),
        timeout=30,
    )
    print(f"[e2e] victim evicted {time.monotonic() - t0:.1f} s after the XID")
    core.delete_namespaced_pod("victim", namespace, grace_period_seconds=0)
    wait_for(
        "the victim's claim to be released", lambda: allocated(dyn, namespace, "victim") is None, timeout=60
    )

    # A new 4-NVLink claim avoids the tainted GPU: it gets the other group.
    gpu_pod(core, namespace, "next", "four-nvlink", busybox_image, grace=0)
    got_next = wait_for("the next pod's GPUs", lambda: allocated(dyn, namespace, "next"), timeout=60)
    assert sorted(idx[d] for d in got_next) == others
    assert target not in got_next

    # Still lost: the taint stays past the hold-down; after the recovery it goes. No event says
    # "the plugin kept the taint", so a window, watched throughout: the taint was added before the
    # eviction and the next pod's allocation (seconds ago) and the plugin checks every 0.2 s, so a
    # taint expiring while its GPU is still lost (the hold-down counted from the taint, not from
    # the recovery) would go within one more hold-down plus a check; HOLD_DOWN + 1 s covers that.
    # A taint removed and set again meanwhile shows in the plugin's own counter of removals.
    def taint_gone() -> str | None:
        if target not in taints(dyn):
            return f"the slice lost the taint of {target}"
        removed = [x for x in metrics().splitlines() if f'action="removed",device="{target}"' in x]
        return f"the plugin counted a removal: {removed}" if removed else None

    never(f"the taint of the still-lost {target} to go", taint_gone, window=HOLD_DOWN + 1, interval=0.2)
    health("simulate", "recover", "--gpu", target)
    wait_for("the taint to go after the hold-down", lambda: target not in taints(dyn), timeout=HOLD_DOWN + 10)
    core.delete_namespaced_pod("next", namespace, grace_period_seconds=0)
    template(dyn, namespace, "that-gpu", selectors=[f"device.attributes['{DRIVER}'].index == {idx[target]}"])
    gpu_pod(core, namespace, "again", "that-gpu", busybox_image, grace=0)
    assert wait_for(
        "GPU 2 to be allocatable again", lambda: allocated(dyn, namespace, "again"), timeout=60
    ) == [target]
    core.delete_namespaced_pod("again", namespace, grace_period_seconds=0)
    assert 'dra_gpu_taint_transitions_total{action="removed"' in metrics()


def test_the_status_of_a_claim_with_a_config_is_written(hplugin, core, dyn, namespace, busybox_image):
    """A time-sliced claim: the scheduler copies its opaque config into the allocation, and the
    apiserver (1.37.2) refuses every patch of such a claim's status, server-side apply included
    (`status.allocation: ... field cannot be modified once set`); the plugin writes its entry by an
    update of the claim as read."""
    config = {
        "apiVersion": "gpu.dra-gpu.io/v1alpha1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}},
    }
    template(dyn, namespace, "time-sliced", config=config)
    gpu_pod(core, namespace, "sliced", "time-sliced", busybox_image, grace=0)

    def entry():
        claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
        for c in claims.get(namespace=namespace).to_dict()["items"]:
            alloc = (c.get("status") or {}).get("allocation") or {}
            if alloc.get("devices", {}).get("config") and (c["status"].get("devices") or []):
                return c["status"]["devices"][0]
        return None

    got = wait_for("the time-sliced claim's status.devices", entry, timeout=30)
    assert {c["type"]: c["status"] for c in got["conditions"]}["Ready"] == "True"
    assert got["driver"] == DRIVER and got["data"]["uuid"].startswith("GPU-")
    core.delete_namespaced_pod("sliced", namespace, grace_period_seconds=0)


def test_application_xid_13_is_counted_not_tainted(hplugin, dyn):
    before = taints(dyn)
    added = added_taints(metrics())
    health("simulate", "xid", "--xid", "13", "--gpu", "1")

    # The plugin handles an event in one step of its event loop, which also serves /metrics: the
    # scrape that counts the XID shows the decision made for it, so no window is needed.
    def counted() -> str | None:
        scrape = metrics()
        return scrape if 'dra_gpu_xid_events_total{xid="13"} 1.0' in scrape else None

    after = wait_for("the XID 13 count", counted, timeout=5)
    assert added_taints(after) == added  # no taint decided
    assert taints(dyn) == before


def test_a_claim_that_tolerates_the_taint_gets_the_device_with_admin_access(
    hplugin, core, dyn, namespace, busybox_image
):
    idx = index_of(dyn)
    target = next(n for n, i in idx.items() if i == 5)
    health("taint", target, "--effect", "NoExecute", "--cause", "diagnosis")
    wait_for("the forced taint", lambda: taints(dyn).get(target), timeout=5)
    try:
        core.patch_namespace(
            namespace, {"metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}}
        )
        selector = f"device.attributes['{DRIVER}'].index == 5"
        template(dyn, namespace, "plain", selectors=[selector])
        api = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaimTemplate")

        def admin_template(name: str, tolerations: list[dict]) -> None:
            request = {"deviceClassName": DRIVER, "adminAccess": True, "tolerations": tolerations}
            request["selectors"] = [{"cel": {"expression": selector}}]
            api.create(
                namespace=namespace,
                body={
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaimTemplate",
                    "metadata": {"name": name},
                    "spec": {"spec": {"devices": {"requests": [{"name": "gpus", "exactly": request}]}}},
                },
            )

        # The eviction controller honours only tolerations that name NoExecute; an effect-less one
        # would be evicted.
        admin_template(
            "diag",
            [
                {"key": KEY, "operator": "Exists", "effect": "NoExecute"},
                {"key": KEY, "operator": "Exists", "effect": "NoSchedule"},
            ],
        )
        gpu_pod(core, namespace, "plain", "plain", busybox_image, grace=0)
        gpu_pod(core, namespace, "diag", "diag", busybox_image, grace=0)
        try:
            got = wait_for("the diagnostic claim", lambda: allocated(dyn, namespace, "diag"), timeout=60)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{why(core, dyn, namespace, 'diag')}") from None
        assert got == [target]
        # The untolerated claim: the scheduler's verdict, not a window.
        wait_for("the scheduler to refuse the plain pod", lambda: unschedulable(core, namespace, "plain"))
        assert allocated(dyn, namespace, "plain") is None
        # Not evicted: a witness allocated after it, tolerating the taint for scheduling only (no
        # effect named), is evicted at once by the same controller, which sees the claims in
        # order: once the witness is gone, the diagnostic claim's turn has come and gone.
        admin_template("witness", [{"key": KEY, "operator": "Exists"}])
        gpu_pod(core, namespace, "witness", "witness", busybox_image, grace=0)
        wait_for("the witness to be evicted", lambda: evicted(dyn, namespace, "witness"), timeout=60)
        assert core.read_namespaced_pod("diag", namespace).metadata.deletion_timestamp is None  # not evicted
        assert core.read_namespaced_pod("plain", namespace).status.phase == "Pending"
    finally:
        health("clear", target)
    wait_for("the taint to be cleared", lambda: target not in taints(dyn), timeout=5)
    assert wait_for(
        "the plain claim after the clear", lambda: allocated(dyn, namespace, "plain"), timeout=60
    ) == [target]
    for pod in ("plain", "diag"):
        core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0)


def test_explain_and_validate_name_the_taint_of_the_live_slices(hplugin, dyn, tmp_path):
    """`dra-gpu explain` / `validate` on the slices the plugin published while a GPU is tainted."""
    import yaml

    idx = index_of(dyn)
    target = next(n for n, i in idx.items() if i == 6)
    health("taint", target, "--effect", "NoSchedule", "--cause", "xid-74")
    try:
        wait_for("the taint", lambda: taints(dyn).get(target), timeout=5)
        cls = (
            dyn.resources.get(api_version="resource.k8s.io/v1", kind="DeviceClass").get(name=DRIVER).to_dict()
        )
        claim = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "all-eight", "namespace": "default"},
            "spec": {
                "devices": {
                    "requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER, "count": 8}}]
                }
            },
        }
        files = tmp_path / "in.yaml"
        files.write_text(yaml.safe_dump_all([*our_slices(dyn)[1], cls, claim]))
        cli = [sys.executable, "-m", "dra_gpu.cli"]
        r = subprocess.run([*cli, "explain", "-f", str(files)], capture_output=True, text=True, timeout=60)
        print(f"\n[e2e] {r.stdout.strip()}")
        assert r.returncode == EXIT_UNALLOCATABLE, r.stderr
        assert "not allocatable" in r.stdout and f"{target} {KEY}=xid-74:NoSchedule" in r.stdout
        v = subprocess.run([*cli, "validate", "-f", str(files)], capture_output=True, text=True, timeout=60)
        out = v.stdout + v.stderr
        print(f"[e2e] validate (exit {v.returncode}): {out.strip()}")
        assert v.returncode == 0 and "right now (devices tainted)" in out and KEY in out
    finally:
        health("clear", target)


def test_mig_device_and_parent_events(hplugin, dyn):
    """Restarts the plugin on the dgx-a100-mig node, and on the module's hgx-2x4 node after it:
    the tests after it (in any order) find the node they were written for."""
    hplugin.stop()
    hplugin.profile = "dgx-a100-mig"
    try:
        hplugin.start()
        wait_for("the MIG node's slices", lambda: "gpu-0000-0f-00-0-mig-1g10gb-4" in devices(dyn), timeout=30)
        mig = "gpu-0000-0f-00-0-mig-1g10gb-4"
        health("simulate", "xid", "--xid", "74", "--gpu", mig)
        got = wait_for("the MIG device's taint", lambda: taints(dyn).get(mig), timeout=2, interval=0.02)
        assert got[0]["value"] == "xid-74" and got[0]["effect"] == "NoSchedule"
        assert list(taints(dyn)) == [mig]  # not its parent's other MIG devices
        health("simulate", "xid", "--xid", "79", "--gpu", "0")  # a parent-level event
        parent0 = {"gpu-0000-07-00-0-mig-3g40gb-0", "gpu-0000-07-00-0-mig-3g40gb-4"}
        wait_for("the parent's MIG devices", lambda: parent0 <= set(taints(dyn)), timeout=2, interval=0.02)
        assert set(taints(dyn)) == parent0 | {mig}
        assert all(taints(dyn)[d][0]["effect"] == "NoExecute" for d in parent0)
        health("simulate", "recover", "--gpu", "0")  # first: a lost GPU would be tainted again
        health("simulate", "recover", "--gpu", "1")
        for d in (*parent0, mig):
            health("clear", d)
        wait_for("the taints to be cleared", lambda: not taints(dyn), timeout=5)
    finally:
        hplugin.stop()
        hplugin.profile = "hgx-2x4"
        hplugin.start()
        wait_for(
            "the hgx-2x4 node's slices again",
            lambda: len(devices(dyn)) == 8 and not any("mig" in d for d in devices(dyn)),
            timeout=30,
        )
