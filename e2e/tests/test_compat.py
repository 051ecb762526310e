"""Compatibility with the Kubernetes release the e2e cluster runs (`e2e/cluster up --kube-version V
[--kubelet-version V] [--dra-gates default|all|pinned]`; e2e/compat.sh runs it on every release).

First the core path, which must work on every release: slices, a claim for 4 NVLink-connected
GPUs prepared into a pod, a plugin restart while it is prepared, unprepare. Then each gated
feature: where the apiserver has its gate on, it works; where it is off, the driver says exactly
why (the plugin's log line naming the dropped field, and `dra-gpu doctor`'s row naming the gate).
Which gates are on is read from the apiserver itself (its `kubernetes_feature_enabled` metric),
not assumed from the version.

Each test records what it found in $DRA_GPU_COMPAT_RESULTS (a directory), one JSON file a
cluster, from which e2e/compat_table.py writes the table of docs/development.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import wait_for
from test_kubelet_plugin import (
    CDI_DIR,
    DRIVER,
    MIG_CLASS,
    PLUGIN_DIR,
    SIM_DEV,
    Plugin,
    allocated,
    claim_pod,
    ensure_device_classes,
    fresh_gpus,
    our_slices,
    template,
)

pytestmark = pytest.mark.e2e

# feature -> (the apiserver gate that keeps its fields, the slice field that shows it)
FEATURES = {
    "device taints (GPU health)": ("DRADeviceTaints", "taints"),
    "memory shares": ("DRAConsumableCapacity", "allowMultipleAllocations"),
    "dynamic MIG": ("DRAPartitionableDevices", "consumesCounters"),
}
# The minor release from which each gate is on by default (Kubernetes' kube_features.go: alpha,
# off, before; beta, on, from 1.36).
ON_BY_DEFAULT_FROM = {"DRADeviceTaints": 36, "DRAConsumableCapacity": 36, "DRAPartitionableDevices": 36}


def get_raw(core, path: str) -> str:
    """GET `path` of the apiserver with the test's credentials (`kubectl get --raw`)."""
    api = core.api_client
    method, url, headers, body, _ = api.param_serialize("GET", path, auth_settings=["BearerToken"])
    resp = api.call_api(method, url, header_params=headers, body=body, _request_timeout=30)
    resp.read()
    return resp.data.decode()


def apiserver_gates(core) -> dict[str, bool]:
    """The apiserver's feature gates as it reports them (kubernetes_feature_enabled, a stable metric)."""
    text = get_raw(core, "/metrics")
    found = re.findall(r'^kubernetes_feature_enabled\{name="(\w+)"[^}]*\} (\d)', text, re.M)
    return {name: value == "1" for name, value in found}


def versions(core) -> tuple[str, str]:
    """(the apiserver's version, the kubelet's version), as the cluster reports them."""
    (node,) = core.list_node().items
    return json.loads(get_raw(core, "/version"))["gitVersion"], node.status.node_info.kubelet_version


def cluster_gates_mode() -> str:
    """How `e2e/cluster up` set the DRA gates (pinned, default, all), as it recorded it."""
    state = Path(os.environ.get("DRA_GPU_E2E_STATE", "/var/lib/dra-gpu-e2e"))
    try:
        recorded = dict(line.split("=", 1) for line in (state / "versions").read_text().split())
    except OSError:
        recorded = {}
    return os.environ.get("DRA_GPU_E2E_DRA_GATES") or recorded.get("gates", "")


def expected_gates(kube: str, mode: str) -> dict[str, bool] | None:
    """Each feature's gate as the cluster's gate mode says the apiserver must have it; None where
    the mode says nothing (gates set by hand, or a cluster e2e/cluster did not bring up)."""
    gates = [gate for gate, _ in FEATURES.values()]
    if "DRA_GPU_E2E_FEATURE_GATES" in os.environ:
        return None
    if mode in ("all", "pinned"):  # pinned: e2e/harness/config.py's list turns all three on
        return dict.fromkeys(gates, True)
    if mode == "default":
        version = re.match(r"v?(\d+)\.(\d+)", kube)
        assert version, f"the apiserver's version {kube!r}: no major.minor"
        return {gate: int(version[2]) >= ON_BY_DEFAULT_FROM[gate] for gate in gates}
    return None


class Record:
    """What the suite found on this cluster, written to $DRA_GPU_COMPAT_RESULTS/<versions>.json."""

    def __init__(self, core) -> None:
        self.kube, self.kubelet = versions(core)
        self.gates = apiserver_gates(core)
        self.mode = cluster_gates_mode()
        self.results: dict[str, dict[str, str]] = {}

    def add(self, feature: str, status: str, detail: str) -> None:
        self.results[feature] = {"status": status, "detail": detail}
        out = os.environ.get("DRA_GPU_COMPAT_RESULTS")
        if not out:
            return
        path = Path(out) / f"{self.kube}_kubelet-{self.kubelet}_{self.mode or 'gates-set'}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "kube": self.kube,
            "kubelet": self.kubelet,
            "gates": self.mode,
            "enabled": {g: on for g, on in sorted(self.gates.items()) if g.startswith("DRA")},
            "results": self.results,
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        tmp.replace(path)


@pytest.fixture(scope="module")
def record(core):
    r = Record(core)
    print(f"\n[e2e] compat: Kubernetes {r.kube}, kubelet {r.kubelet}, DRA gates {r.mode or '?'}")
    return r


@pytest.fixture
def node_plugin(target, core, dyn, tmp_path):
    """A plugin of the test's own (profile and flags set by the test, then `start()`), gone after."""
    if not target.local:
        pytest.skip("the plugin runs as a host process only on the local e2e cluster")
    node = core.list_node().items[0].metadata.name
    ensure_device_classes(dyn)
    fresh_gpus(SIM_DEV)
    p = Plugin(target.kubeconfig, node, tmp_path / "plugin.log")
    (PLUGIN_DIR / "health-taints.json").unlink(missing_ok=True)
    yield p
    p.stop()
    (PLUGIN_DIR / "health-taints.json").unlink(missing_ok=True)
    api, items = our_slices(dyn)
    for s in items:
        api.delete(name=s["metadata"]["name"])


def running(core, namespace, pod, timeout=120):
    def log():
        if core.read_namespaced_pod(pod, namespace).status.phase != "Running":
            return None
        text = core.read_namespaced_pod_log(pod, namespace)
        return text if "DRA_GPU_VISIBLE_DEVICES=" in text else None

    return wait_for(f"pod {pod} to run with its GPUs", log, timeout=timeout)


def claim_uids(dyn, namespace) -> list[str]:
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    return [c["metadata"]["uid"] for c in claims.get(namespace=namespace).to_dict()["items"]]


def delete_and_wait_unprepared(core, dyn, namespace, pods) -> None:
    specs = [CDI_DIR / f"k8s.{DRIVER}-claim_{uid}.json" for uid in claim_uids(dyn, namespace)]
    for pod in pods:
        core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0)
    wait_for("the claims to be unprepared", lambda: not any(p.exists() for p in specs), timeout=90)


def doctor_row(target) -> dict:
    """`dra-gpu doctor`'s cluster/dra-features row (the cluster checks only: no node flags)."""
    r = subprocess.run(
        [sys.executable, "-m", "dra_gpu.cli", "doctor", "--kubeconfig", target.kubeconfig, "-o", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in r.stderr, r.stderr
    return {c["check"]: c for c in json.loads(r.stdout)["checks"]}["cluster/dra-features"]


def test_the_apiserver_has_the_gates_the_run_claims(record):
    """The gates of the three features as the run's gate mode says (the apiserver's own metric):
    otherwise a run that claims a release's defaults, where they are off, would take (and record)
    the gate-on path of every feature and never check what the driver says with a gate off."""
    gates = [gate for gate, _ in FEATURES.values()]
    unlisted = [gate for gate in gates if gate not in record.gates]
    assert not unlisted, f"kubernetes_feature_enabled of {record.kube} lists no {unlisted}"
    want = expected_gates(record.kube, record.mode)
    if want is None:
        pytest.skip(f"gate mode {record.mode or 'unknown'!r}: no expectation (gates set by hand)")
    got = {gate: record.gates[gate] for gate in gates}
    assert got == want, f"Kubernetes {record.kube} with DRA gates {record.mode!r}: the apiserver has {got}"


def test_core_path_slices_prepare_restart_unprepare(node_plugin, record, core, dyn, namespace, busybox_image):
    node_plugin.start()
    wait_for("the node's slices", lambda: our_slices(dyn)[1], timeout=30)
    template(dyn, namespace, "four-nvlink", count=4, nvlink=True)
    show = "env | grep ^DRA_GPU_VISIBLE; ls /dev/nvidia*; sleep 3600"
    claim_pod(core, namespace, "core", {"resource_claim_template_name": "four-nvlink"}, show, busybox_image)
    log = running(core, namespace, "core")
    devices = allocated(dyn, namespace, "core")
    assert len(devices) == 4, log
    assert len([x for x in log.split() if re.fullmatch(r"/dev/nvidia\d+", x)]) == 4, log
    # Restarted while prepared: the claim stays prepared, and a second pod of the same claim is
    # not needed for the kubelet to unprepare it afterwards.
    node_plugin.stop()
    node_plugin.start()
    delete_and_wait_unprepared(core, dyn, namespace, ["core"])
    record.add("core path", "works", "slices, 4 NVLink GPUs prepared, plugin restart, unprepare")


def test_device_metadata_by_the_kubelets_version(node_plugin, record, core, dyn, namespace, busybox_image):
    """KEP-5304 device metadata: beta from 1.37, where the plugin writes it by default (auto) and
    a pod reads its GPUs from it; on an older kubelet it writes none (no file, no CDI spec, no
    mount) and its start-up line says so and why."""
    node_plugin.start()
    wait_for("the node's slices", lambda: our_slices(dyn)[1], timeout=30)
    version = re.match(r"v?(\d+)\.(\d+)", record.kubelet)
    assert version, f"the kubelet's version {record.kubelet!r}: no major.minor"
    said = wait_for(
        "the plugin's device metadata line",
        lambda: next(
            (
                x.split(" msg=", 1)[-1]
                for x in node_plugin.log_path.read_text(errors="replace").splitlines()
                if "device metadata (KEP-5304)" in x
            ),
            None,
        ),
        timeout=30,
    )
    template(dyn, namespace, "one")
    path = f"/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpus/gpus/{DRIVER}"
    path += "-metadata.json"
    show = f"cat {path} 2>&1; env | grep ^DRA_GPU_VISIBLE; sleep 3600"
    claim_pod(core, namespace, "metadata", {"resource_claim_template_name": "one"}, show, busybox_image)
    log = running(core, namespace, "metadata")
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    (meta,) = [c["metadata"] for c in claims.get(namespace=namespace).to_dict()["items"]]
    files = [
        *(PLUGIN_DIR / "dra-device-metadata" / f"{namespace}_{meta['name']}").rglob("*"),
        *CDI_DIR.glob(f"{DRIVER}_metadata_{meta['uid']}_*"),
    ]
    if (int(version[1]), int(version[2])) >= (1, 37):
        assert f"device metadata (KEP-5304) on: the kubelet is {record.kubelet}, beta from 1.37" in said, said
        assert '"kind": "DeviceMetadata"' in log and meta["uid"] in log, log
        assert len([f for f in files if f.is_file()]) == 2, files  # the file and its CDI spec
        record.add("device metadata (KEP-5304)", "works", "a pod reads its GPUs from the file")
    else:
        want = (
            f"device metadata (KEP-5304) off: the kubelet is {record.kubelet}; beta from 1.37; "
            "--device-metadata=on writes it anyway"
        )
        assert want in said, said
        assert f"cat: can't open '{path}': No such file or directory" in log, log
        assert files == [], files
    delete_and_wait_unprepared(core, dyn, namespace, ["metadata"])
    assert not any(f.exists() for f in files)
    if (int(version[1]), int(version[2])) < (1, 37):
        # --device-metadata=on writes it anyway: the kubelet only passes its CDI ID on.
        node_plugin.stop()
        node_plugin.extra_args = ["--device-metadata=on"]
        node_plugin.start()
        claim_pod(core, namespace, "forced", {"resource_claim_template_name": "one"}, show, busybox_image)
        log = running(core, namespace, "forced")
        assert '"kind": "DeviceMetadata"' in log, log
        delete_and_wait_unprepared(core, dyn, namespace, ["forced"])
        line = said.strip('"')
        record.add("device metadata (KEP-5304)", "off (kubelet before 1.37)", f"{line}; on: works")


def simulate_xid_79(dyn) -> str:
    """The first GPU falls off the bus (XID 79, through `dra-gpu health simulate` as a user would);
    its name."""
    _, items = our_slices(dyn)
    gpu = items[0]["spec"]["devices"][0]["name"]
    health = [sys.executable, "-m", "dra_gpu.cli", "health", "--plugin-dir", str(PLUGIN_DIR)]
    subprocess.run([*health, "simulate", "xid", "--xid", "79", "--gpu", gpu], check=True, timeout=30)
    return gpu


def slice_taints(dyn, gpu: str) -> list[dict]:
    return [
        t
        for s in our_slices(dyn)[1]
        for d in s["spec"]["devices"]
        if d["name"] == gpu
        for t in d.get("taints") or []
    ]


def use(feature: str, core, dyn, namespace, busybox_image, gpu: str | None) -> str:
    """Use the feature as a user would; what it did."""
    show = "env | grep ^DRA_GPU_VISIBLE; sleep 3600"
    if feature == "memory shares":
        from test_sharing import memory_template

        memory_template(dyn, namespace, "twenty", "20Gi")
        pods = ["share-a", "share-b"]
        for pod in pods:
            claim_pod(core, namespace, pod, {"resource_claim_template_name": "twenty"}, show, busybox_image)
        logs = [running(core, namespace, pod) for pod in pods]
        assert len({allocated(dyn, namespace, pod)[0] for pod in pods}) == 1, logs  # one GPU
        delete_and_wait_unprepared(core, dyn, namespace, pods)
        return "two 20Gi shares of one GPU, in two pods"
    if feature == "dynamic MIG":
        three_g = f"device.attributes['{DRIVER}'].profile == '3g.40gb'"
        template(dyn, namespace, "three-g", device_class=MIG_CLASS, selectors=[three_g])
        claim_pod(core, namespace, "mig", {"resource_claim_template_name": "three-g"}, show, busybox_image)
        running(core, namespace, "mig")
        (device,) = allocated(dyn, namespace, "mig")
        assert "-mig-3g40gb-" in device, device
        delete_and_wait_unprepared(core, dyn, namespace, ["mig"])
        return "a 3g.40gb MIG instance made at prepare, in a pod"
    assert gpu is not None
    (taint,) = wait_for("the GPU's taint in its slice", lambda: slice_taints(dyn, gpu), timeout=10)
    assert taint["effect"] == "NoExecute" and taint["value"] == "xid-79", taint
    return "an XID 79 taints the GPU in its slice (NoExecute)"


def degraded(feature: str, plugin, core, dyn, namespace, busybox_image, gpu: str | None) -> str:
    """What the plugin does instead when the apiserver drops the feature's fields; what it says.
    Only what the driver does is checked here: the fields the apiserver drops (counters,
    allowMultipleAllocations) are missing from the stored slices whatever the plugin sends."""
    gate, _ = FEATURES[feature]

    def devices():
        return [d for s in our_slices(dyn)[1] for d in s["spec"].get("devices") or []]

    def said(text):
        def line():
            lines = plugin.log_path.read_text(errors="replace").splitlines()
            return next((x for x in lines if text in x), None)

        words = wait_for(f"the plugin to say {text!r}", line, timeout=30).split(" msg=", 1)[-1]
        assert gate in words, f"the plugin's warning does not name {gate}: {words}"
        return words

    if feature == "device taints (GPU health)":
        # Nothing would keep new claims off the failed GPU: it is withdrawn from the slices.
        wait_for(
            "the failed GPU to leave the slices",
            lambda: gpu not in [d["name"] for d in devices()],
            timeout=30,
        )
        assert devices(), "only the failed GPU is withdrawn"
        return said("withdrawn from the slices instead")
    if feature == "dynamic MIG":
        # Overlapping placements would be allocated together: none is published. A placement (a
        # MIG device not made yet: no UUID) the plugin kept would still be listed, its counters
        # dropped; the plugin published some before it learnt of the drop (the line about the
        # dropped consumesCounters), so this waits for its new publication.
        words = said("placements are not published")

        def placements():
            return [
                d["name"]
                for d in devices()
                if (d.get("attributes") or {}).get("type", {}).get("string") == "mig"
                and "uuid" not in d["attributes"]
            ]

        wait_for("the placements to leave the slices", lambda: not placements(), timeout=30)
        return words
    # Memory shares: the GPUs stay published, whole (the apiserver also drops a claim's capacity
    # request): two claims of the shares' template get a GPU each, prepared into running pods.
    from test_sharing import memory_template

    memory_template(dyn, namespace, "twenty", "20Gi")
    pods = ["whole-a", "whole-b"]
    show = "env | grep ^DRA_GPU_VISIBLE; sleep 3600"
    for pod in pods:
        claim_pod(core, namespace, pod, {"resource_claim_template_name": "twenty"}, show, busybox_image)
    logs = [running(core, namespace, pod) for pod in pods]
    got = [allocated(dyn, namespace, pod) for pod in pods]
    assert all(len(g) == 1 for g in got) and got[0] != got[1], (got, logs)
    delete_and_wait_unprepared(core, dyn, namespace, pods)
    return f"GPUs published whole: two 20Gi claims got {got[0][0]} and {got[1][0]}, one each"


# feature -> the simulated node it needs (profile, plugin flags)
NODES = {
    "device taints (GPU health)": ("hgx-2x4", ["--health-check-interval", "0.2"]),
    "memory shares": ("hgx-2x4", ["--memory-shares"]),
    "dynamic MIG": ("dgx-h100-mig", ["--dynamic-mig"]),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_gated_feature_works_or_says_why(
    feature, node_plugin, record, target, core, dyn, namespace, busybox_image
):
    gate, field = FEATURES[feature]
    assert gate in record.gates, f"kubernetes_feature_enabled of {record.kube} lists no {gate}"
    on = record.gates[gate]
    # The path taken is the one the run's gate mode says (else a gate on where the mode says off
    # would skip every check below and record "works").
    want = expected_gates(record.kube, record.mode)
    if want is not None:
        assert on == want[gate], f"{gate} on: {on}, but {record.mode!r} on {record.kube} says {want[gate]}"
    node_plugin.profile, node_plugin.extra_args = NODES[feature]
    node_plugin.start()
    if on or feature != "dynamic MIG":
        # (Without counters a dynamic-MIG node may publish nothing at all: every GPU is in MIG mode.)
        wait_for("the node's slices", lambda: our_slices(dyn)[1], timeout=30)
    gpu = simulate_xid_79(dyn) if feature == "device taints (GPU health)" else None
    if on:
        record.add(feature, "works", use(feature, core, dyn, namespace, busybox_image, gpu))
        return
    # Gate off: the apiserver drops the field; the plugin logs it naming the gate, does what is
    # safe instead, and doctor names the gate.
    line = wait_for(
        f"the plugin's line about the dropped {field}",
        lambda: next(
            (
                x
                for x in node_plugin.log_path.read_text(errors="replace").splitlines()
                if "apiserver dropped a field of ResourceSlice" in x and field in x
            ),
            None,
        ),
        timeout=30,
    )
    said = line[line.index("apiserver dropped") :]
    assert f"turn on the {gate} feature gate" in said, said
    instead = degraded(feature, node_plugin, core, dyn, namespace, busybox_image, gpu)
    row = doctor_row(target)
    assert row["status"] == "WARN" and gate in row["detail"] and gate in row["fix"], row
    record.add(feature, f"needs {gate}", f"plugin: {said}; instead: {instead}; doctor: {row['detail']}")
