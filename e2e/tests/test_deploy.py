"""The Helm chart and the examples against the real apiserver of the e2e cluster.

- every object the chart renders (default values, a simulated node, cert-manager's own kinds left
  out as their CRDs are not installed) is accepted by a server-side dry-run apply;
- the node-scoped ValidatingAdmissionPolicy, proven: acting as node A's kubelet-plugin service
  account with a token bound to a pod on node A, writing node A's ResourceSlice succeeds and
  writing node B's is denied (and RBAC keeps the account away from everything else);
- every example is accepted by the apiserver (dry-run: schema, CEL selectors compile);
- every example runs as it is (its public image, served locally under that name) with the plugin
  serving a simulated node, and its pods' nvidia-smi lists exactly the devices of their claims.
"""

from __future__ import annotations

import copy
import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml
from support import helm_binary

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "dra-gpu"
EXAMPLES = ROOT / "deploy" / "examples"
MANAGER = "dra-gpu-e2e"
TEST_DRIVER = "vap-test.dra-gpu.io"  # slices of fake nodes must not be mistaken for real ones


@pytest.fixture(scope="session")
def helm():
    return helm_binary()


def render(helm, namespace, release, *sets):
    cmd = [helm, "template", release, str(CHART), "-n", namespace, "--kube-version", "1.37.2"]
    cmd += ["--set", "image.registry=registry.example.com/gpu"]  # the chart has none; sets below win
    for s in sets:
        cmd += ["--set", s]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def apply(dyn, obj, namespace=None, dry_run=True):
    api = dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
    kw = {"dry_run": "All"} if dry_run else {}
    return api.server_side_apply(
        body=obj,
        namespace=namespace if api.namespaced else None,
        field_manager=MANAGER,
        force_conflicts=True,
        **kw,
    )


def error_text(exc):
    return f"{getattr(exc, 'status', '?')} {getattr(exc, 'reason', '')}: {getattr(exc, 'body', exc)}"


VARIANTS = {
    "defaults": (),
    "simulated-node": (
        "simulatedProfile=dgx-a100-mig",
        "kubeletPlugin.claimStatusWrites=true",
        "verbose=true",
    ),
    "cert-manager": ("controller.tls.certManager.enabled=true",),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_chart_accepted_by_apiserver(helm, dyn, namespace, variant):
    objs = render(helm, namespace, "e2e-" + uuid.uuid4().hex[:6], *VARIANTS[variant])
    failures, applied = [], 0
    for obj in objs:
        if obj["apiVersion"].startswith("cert-manager.io/"):
            continue  # cert-manager's CRDs are not installed here; the unit tests check these
        try:
            apply(dyn, obj, namespace)
            applied += 1
        except Exception as exc:
            failures.append(f"{obj['kind']}/{obj['metadata']['name']}: {error_text(exc)}")
    assert not failures, "\n".join(failures)
    assert applied >= 15


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_accepted_by_apiserver(dyn, namespace, path):
    failures = []
    for obj in yaml.safe_load_all(path.read_text()):
        if not obj:
            continue
        try:
            apply(dyn, obj, namespace)
        except Exception as exc:
            failures.append(f"{obj['kind']}/{obj['metadata']['name']}: {error_text(exc)}")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- node-scoped slice policy


def as_token(api_client, token):
    """An API client that authenticates with a bearer token only (no admin client certificate)."""
    from kubernetes import client

    cfg = copy.copy(api_client.configuration)
    cfg.cert_file = cfg.key_file = None
    cfg.api_key = {"authorization": token}
    cfg.api_key_prefix = {"authorization": "Bearer"}
    return client.ApiClient(cfg)


def pod_bound_token(core, ident) -> str:
    """A token of the plugin's account bound to its pod (so to its node), as the kubelet mounts it."""
    from kubernetes import client

    pod = ident["pod"]
    req = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(
            audiences=[],
            expiration_seconds=600,
            bound_object_ref=client.V1BoundObjectReference(
                api_version="v1", kind="Pod", name=pod.metadata.name, uid=pod.metadata.uid
            ),
        )
    )
    return str(
        core.create_namespaced_service_account_token(ident["sa"], ident["namespace"], req).status.token
    )


def slice_body(name, node=None, all_nodes=False):
    spec = {
        "driver": TEST_DRIVER,
        "pool": {"name": node or "cluster", "generation": 1, "resourceSliceCount": 1},
        "devices": [],
    }
    if all_nodes:
        spec["allNodes"] = True
    else:
        spec["nodeName"] = node
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": spec,
    }


def status_of(fn):
    """HTTP status of a call: 2xx as 200, else the ApiException's status and message."""
    from kubernetes.client.exceptions import ApiException

    try:
        fn()
        return 200, ""
    except ApiException as exc:
        return exc.status, exc.body or ""


@pytest.fixture
def plugin_identity(helm, dyn, core, namespace):
    """The chart's plugin SA, ClusterRole(+Binding) and node-scoped policy, applied for real, plus
    two Node objects and a pod bound to the first (no kubelet runs them: they only anchor tokens)."""
    from kubernetes import client

    tag = uuid.uuid4().hex[:6]
    release = "vap-" + tag
    objs = render(
        helm,
        namespace,
        release,
        f"driverName={TEST_DRIVER}",  # the slice policy admits only the chart's own driver
        "controller.enabled=false",
        "deviceClasses.gpu.enabled=false",
        "deviceClasses.mig.enabled=false",
    )
    keep = (
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    )
    objs = [o for o in objs if o["kind"] in keep]
    assert {o["kind"] for o in objs} == set(keep)
    nodes = [f"fake-node-a-{tag}", f"fake-node-b-{tag}"]
    cluster_scoped = []
    try:
        for obj in objs:
            apply(dyn, obj, namespace, dry_run=False)
            if obj["kind"] != "ServiceAccount":
                cluster_scoped.append(obj)
        for n in nodes:
            core.create_node(
                client.V1Node(metadata=client.V1ObjectMeta(name=n, labels={"dra-gpu.io/e2e-fake": "true"}))
            )
        sa = next(o for o in objs if o["kind"] == "ServiceAccount")["metadata"]["name"]
        pod = core.create_namespaced_pod(
            namespace,
            client.V1Pod(
                metadata=client.V1ObjectMeta(name="plugin-on-a"),
                spec=client.V1PodSpec(
                    node_name=nodes[0],
                    service_account_name=sa,
                    restart_policy="Never",
                    tolerations=[client.V1Toleration(operator="Exists")],
                    containers=[
                        client.V1Container(
                            name="c",
                            image="localhost/dra-gpu-e2e/busybox:1",
                            image_pull_policy="Never",
                            command=["true"],
                        )
                    ],
                ),
            ),
        )
        yield {"sa": sa, "pod": pod, "nodes": nodes, "namespace": namespace}
    finally:
        resource = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceSlice")
        for s in resource.get(field_selector=f"spec.driver={TEST_DRIVER}").items:
            status_of(lambda s=s: resource.delete(name=s.metadata.name))
        for obj in reversed(cluster_scoped):
            api = dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
            status_of(lambda api=api, obj=obj: api.delete(name=obj["metadata"]["name"]))
        for n in nodes:
            status_of(lambda n=n: core.delete_node(n))


def test_plugin_writes_only_its_own_nodes_slices(api_client, core, dyn, plugin_identity):
    from kubernetes import client

    ident = plugin_identity
    node_a, node_b = ident["nodes"]
    token = pod_bound_token(core, ident)
    plugin = client.ResourceV1Api(as_token(api_client, token))
    admin = client.ResourceV1Api(api_client)

    # The policy is enforced once the apiserver has loaded it (an informer): wait for the first
    # denial of node B's slice, removing any that got in before.
    b_name = f"{node_b}-slice"
    deadline, code, msg = time.time() + 60, 0, ""
    while time.time() < deadline:
        code, msg = status_of(lambda: plugin.create_resource_slice(slice_body(b_name, node_b)))
        if code != 200:
            break
        status_of(lambda: admin.delete_resource_slice(b_name))
        time.sleep(0.5)
    assert code == 403, (code, msg)
    assert f"the kubelet plugin on node '{node_a}'" in msg, msg  # the node came from the token
    assert f"of node '{node_b}'" in msg, msg

    # Node A's own slice: create, apply (patch), update, delete all pass.
    a_name = f"{node_a}-slice"
    assert status_of(lambda: plugin.create_resource_slice(slice_body(a_name, node_a))) == (200, "")
    body = slice_body(a_name, node_a)
    body["spec"]["pool"]["generation"] = 2
    assert status_of(
        lambda: plugin.patch_resource_slice(
            a_name, body, field_manager=TEST_DRIVER, force=True, _content_type="application/apply-patch+yaml"
        )
    ) == (200, "")
    assert status_of(lambda: plugin.delete_resource_slice(a_name)) == (200, "")

    # Node B's slice made by someone else: the plugin of node A can neither change nor delete it.
    admin.create_resource_slice(slice_body(b_name, node_b))
    body = slice_body(b_name, node_b)
    body["spec"]["pool"]["generation"] = 7
    code, msg = status_of(
        lambda: plugin.patch_resource_slice(
            b_name, body, field_manager=TEST_DRIVER, force=True, _content_type="application/apply-patch+yaml"
        )
    )
    assert code == 403 and f"of node '{node_b}'" in msg, (code, msg)
    code, msg = status_of(lambda: plugin.delete_resource_slice(b_name))
    assert code == 403 and f"of node '{node_b}'" in msg, (code, msg)
    # Nor publish slices for all nodes.
    code, msg = status_of(
        lambda: plugin.create_resource_slice(slice_body(f"{node_a}-everywhere", all_nodes=True))
    )
    assert code == 403 and "without spec.nodeName" in msg, (code, msg)

    # Least privilege: RBAC keeps the account away from everything else.
    assert (
        status_of(
            lambda: client.CoreV1Api(as_token(api_client, token)).list_namespaced_secret(ident["namespace"])
        )[0]
        == 403
    )
    assert (
        status_of(
            lambda: plugin.create_device_class(
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "DeviceClass",
                    "metadata": {"name": f"x.{node_a}"},
                    "spec": {},
                }
            )
        )[0]
        == 403
    )
    # Claims: read only (listed to rebuild a corrupt checkpoint), never written.
    assert status_of(lambda: plugin.list_resource_claim_for_all_namespaces())[0] == 200
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": f"x-{node_a}"},
        "spec": {"devices": {"requests": []}},
    }
    assert status_of(lambda: plugin.create_namespaced_resource_claim(ident["namespace"], claim))[0] == 403


def test_token_without_node_is_denied(api_client, core, plugin_identity):
    """A token of the plugin's account not bound to a pod (no node in it) writes no slice at all."""
    from kubernetes import client

    ident = plugin_identity
    req = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=600)
    )
    token = core.create_namespaced_service_account_token(ident["sa"], ident["namespace"], req).status.token
    plugin = client.ResourceV1Api(as_token(api_client, token))
    node_a = ident["nodes"][0]
    deadline, code, msg = time.time() + 60, 0, ""
    while time.time() < deadline:
        code, msg = status_of(lambda: plugin.create_resource_slice(slice_body(f"{node_a}-nt", node_a)))
        if code != 200:
            break
        status_of(lambda: client.ResourceV1Api(api_client).delete_resource_slice(f"{node_a}-nt"))
        time.sleep(0.5)
    assert code == 403 and "no node in the user's token" in msg, (code, msg)


# ---------------------------------------------------------------- the examples, run


# (profile the plugin serves and any more plugin flags, example file). Not here:
# gpu-and-nic-same-pcie-root.yaml, which needs a network driver's NICs beside the GPUs: it runs in
# test_gpu_nic_pairing.py, with the NIC driver there.
RUNS = [
    ("hgx-2x4", "one-gpu.yaml"),
    ("hgx-2x4", "four-nvlink-gpus.yaml"),
    ("hgx-2x4", "two-nvlink-gpus-packed.yaml"),
    ("hgx-2x4", "gpu-by-product-name.yaml"),
    ("hgx-2x4", "gpu-memory-40gi.yaml"),
    ("hgx-2x4", "gpu-driver-550.yaml"),
    ("hgx-2x4", "prioritized-h100-else-a100.yaml"),
    ("hgx-2x4", "shared-gpu-two-pods.yaml"),
    ("hgx-2x4", "classic-nvidia-gpu.yaml"),
    ("hgx-2x4", "mps-gpu.yaml"),
    ("hgx-2x4", "time-sliced-gpu.yaml"),
    ("dgx-a100-mig", "mig-3g40gb.yaml"),
    ("dgx-a100-mig", "prioritized-h100-else-a100.yaml"),
    ("hgx-2x4 --memory-shares", "gpu-memory-share-20gi.yaml"),  # the plugin's memory shares
]


class SimulatedNode:
    """`dra-gpu kubelet-plugin` as a host process (as in test_kubelet_plugin.py) serving one
    simulated profile at a time, with the chart's DeviceClasses installed."""

    def __init__(self, target, dyn, core, log_dir):
        from test_kubelet_plugin import Plugin

        node = core.list_node().items[0].metadata.name
        self.plugin = Plugin(target.kubeconfig, node, log_dir / "plugin.log")
        self.plugin.profile = ""
        self.dyn = dyn

    def serve(self, spec):
        """`spec`: a profile, then any more kubelet-plugin flags (`--memory-shares`)."""
        profile, *args = spec.split()
        plugin = self.plugin
        running = plugin.proc is not None and plugin.proc.poll() is None
        if running and (plugin.profile, plugin.extra_args) == (profile, args):
            return
        plugin.stop()
        plugin.profile, plugin.extra_args = profile, args
        plugin.start()
        want = {"hgx-2x4": "NVIDIA H100 80GB HBM3", "dgx-a100-mig": "NVIDIA A100-SXM4-80GB"}[profile]
        shares = "--memory-shares" in args
        deadline = time.time() + 30
        while time.time() < deadline:  # the old profile's slices replaced by the new one's
            devices = self.slice_devices()
            names = {next(iter(d["attributes"]["productName"].values())) for d in devices}
            if names == {want} and any(d.get("allowMultipleAllocations") for d in devices) == shares:
                return
            time.sleep(0.3)
        raise AssertionError(f"slices of {spec} not published: {self.devices()}")

    def slice_devices(self):
        api = self.dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceSlice")
        items = api.get(field_selector="spec.driver=gpu.dra-gpu.io").to_dict()["items"]
        return [d for s in items for d in s["spec"]["devices"]]

    def devices(self):
        return {
            d["name"]: {k: next(iter(v.values())) for k, v in d["attributes"].items()}
            for d in self.slice_devices()
        }

    def by_uuid(self):
        return {a["uuid"]: a for a in self.devices().values()}


@pytest.fixture(scope="module")
def simulated_node(target, helm, dyn, core, tmp_path_factory):
    if not target.local:
        pytest.skip("the plugin runs as a host process only on the local e2e cluster")
    for obj in render(helm, "default", "examples", "controller.enabled=false", "kubeletPlugin.enabled=false"):
        assert obj["kind"] == "DeviceClass"
        apply(dyn, obj, dry_run=False)  # the chart's classes, extendedResourceName included
    node = SimulatedNode(target, dyn, core, tmp_path_factory.mktemp("examples"))
    yield node
    node.plugin.stop()
    api = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceSlice")
    for s in api.get(field_selector="spec.driver=gpu.dra-gpu.io").to_dict()["items"]:
        status_of(lambda s=s: api.delete(name=s["metadata"]["name"]))


def visible(log):
    line = next((x for x in log.splitlines() if x.startswith("DRA_GPU_VISIBLE_DEVICES=")), "")
    return [u for u in line.split("=", 1)[-1].split(",") if u]


SMI_GPU = re.compile(r"^GPU (\d+): (.+) \(UUID: (GPU-[0-9a-f-]+)\)$")
SMI_MIG = re.compile(r"^MIG (\S+) +Device +(\d+): \(UUID: (MIG-[0-9a-f-]+)\)$")


def nvidia_smi(log):
    """What `nvidia-smi -L` listed: {"GPU": {uuid: name}, "MIG": {uuid: profile}} (a real
    nvidia-smi lists a MIG device under its GPU's line; the simulated one lists the GPU alone)."""
    out = {"GPU": {}, "MIG": {}}
    for line in log.splitlines():
        if m := SMI_GPU.match(line.strip()):
            out["GPU"][m[3]] = m[2]
        elif m := SMI_MIG.match(line.strip()):
            out["MIG"][m[3]] = m[1]
    return out


def assert_smi_lists(log, uuids, devs):
    """nvidia-smi in the container lists exactly the claim's devices (`uuids`, from
    DRA_GPU_VISIBLE_DEVICES): the GPUs by UUID and product name, a MIG device by its parent GPU
    (and by itself where nvidia-smi lists MIG devices)."""
    smi = nvidia_smi(log)
    migs = [u for u in uuids if devs[u]["type"] == "mig"]
    gpus = {devs[u]["parentUUID"] if u in migs else u: devs[u]["productName"] for u in uuids}
    assert smi["GPU"] == gpus, f"nvidia-smi -L listed {smi}, the claim gave {uuids}:\n{log}"
    assert sorted(smi["MIG"]) in ([], sorted(migs)), f"nvidia-smi -L listed {smi}:\n{log}"
    assert all(smi["MIG"][u] == devs[u]["profile"] for u in smi["MIG"]), log


def claim_results(dyn, namespace):
    api = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    out = {}
    for c in api.get(namespace=namespace).to_dict()["items"]:
        alloc = (c.get("status") or {}).get("allocation")
        if alloc:
            out[c["metadata"]["name"]] = alloc["devices"]["results"]
    return out


@pytest.mark.parametrize(
    ("profile", "example"), RUNS, ids=[f"{p.replace(' --', '-')}-{e[:-5]}" for p, e in RUNS]
)
def test_example_runs(simulated_node, example_image, dyn, core, namespace, wait_pod, profile, example):
    """Needs pods to run: on VMs without CAP_SYS_RESOURCE, containerd must restrict oom_score_adj.
    The example as it is: its public image (served locally under that name) and pull policy."""
    simulated_node.serve(profile)
    docs = [d for d in yaml.safe_load_all((EXAMPLES / example).read_text()) if d]
    images = {c["image"] for d in docs if d["kind"] == "Pod" for c in d["spec"]["containers"]}
    assert images == {example_image}, images
    for obj in docs:
        apply(dyn, obj, namespace, dry_run=False)
    pods = [d["metadata"]["name"] for d in docs if d["kind"] == "Pod"]
    logs, results = {}, {}
    try:
        # Claims made from templates are deleted once their pod is done: record allocations
        # while the pods run.
        deadline = time.time() + 120
        while time.time() < deadline:
            results.update(claim_results(dyn, namespace))
            phases = [core.read_namespaced_pod(p, namespace).status.phase for p in pods]
            if all(ph in ("Succeeded", "Failed") for ph in phases):
                break
            time.sleep(0.2)
        for pod in pods:
            phase = wait_pod(core, namespace, pod, timeout=10)
            logs[pod] = core.read_namespaced_pod_log(pod, namespace)
            assert phase == "Succeeded", f"{pod}: {phase}\n{logs[pod]}"
        extended = {
            p: core.read_namespaced_pod(p, namespace).status.extended_resource_claim_status for p in pods
        }
    finally:
        for pod in pods:
            status_of(lambda pod=pod: core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0))
        claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
        for c in claims.get(namespace=namespace).to_dict()["items"]:
            status_of(lambda c=c: claims.delete(name=c["metadata"]["name"], namespace=namespace))
        deadline = time.time() + 60  # devices free again before the next example
        while time.time() < deadline and claims.get(namespace=namespace).to_dict()["items"]:
            time.sleep(0.3)

    for pod, log in logs.items():
        print(f"\n[e2e] {example} on {profile}, pod {pod}:\n{log.rstrip()}")
    devs = simulated_node.by_uuid()
    seen = {p: visible(log) for p, log in logs.items()}
    for pod, uuids in seen.items():
        assert uuids and all(u in devs for u in uuids), f"{pod} saw {uuids}:\n{logs[pod]}"
        assert_smi_lists(logs[pod], uuids, devs)  # nvidia-smi from the claim's CDI spec
        assert "nvidia" in logs[pod]  # device nodes injected (ls /dev | grep nvidia)
    (first, *_) = seen.values()
    attrs = [devs[u] for u in first]
    if example == "four-nvlink-gpus.yaml":
        assert len(attrs) == 4 and len({a["nvlinkDomain"] for a in attrs}) == 1, attrs
    elif example == "two-nvlink-gpus-packed.yaml":  # one node: its rank's entry (or `any`) fits
        assert len(attrs) == 2 and len({a["nvlinkDomain"] for a in attrs}) == 1, attrs
        assert len({a["packingRank"] for a in attrs}) == 1, attrs
    elif example == "gpu-by-product-name.yaml":
        assert attrs[0]["productName"] == "NVIDIA H100 80GB HBM3"
    elif example == "gpu-driver-550.yaml":
        assert int(attrs[0]["driverVersion"].split(".")[0]) >= 550
    elif example == "mig-3g40gb.yaml":
        assert attrs[0]["type"] == "mig" and attrs[0]["profile"] == "3g.40gb", attrs
    elif example == "prioritized-h100-else-a100.yaml":
        (res,) = [r for rs in results.values() for r in rs]
        want = "gpu/h100" if profile == "hgx-2x4" else "gpu/a100"
        assert res["request"] == want, res
    elif example == "shared-gpu-two-pods.yaml":
        assert seen["shared-gpu-a"] == seen["shared-gpu-b"] and len(seen["shared-gpu-a"]) == 1
    elif example == "mps-gpu.yaml":  # the claim's daemon: its control socket, and nothing else of it
        log = logs["mps-gpu"]
        assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in log and "control" in log.splitlines(), log
        assert "nvidia-cuda-mps-control.pid" not in log and "control_privileged" not in log, log
    elif example == "time-sliced-gpu.yaml":
        assert seen["time-sliced-a"] == seen["time-sliced-b"] and len(seen["time-sliced-a"]) == 1
    elif example == "gpu-memory-share-20gi.yaml":  # two claims, two shares of one GPU
        shares = [r for rs in results.values() for r in rs]
        assert len(shares) == 2 and len({r.get("shareID") for r in shares} - {None}) == 2, shares
        assert all(r["consumedCapacity"]["memory"] == "20Gi" for r in shares), shares
        assert seen["memory-share-a"] == seen["memory-share-b"] and len(first) == 1, seen
        for pod in ("memory-share-a", "memory-share-b"):
            assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in logs[pod], logs[pod]
    elif example == "classic-nvidia-gpu.yaml":
        status = extended["classic-nvidia-gpu"]
        assert status is not None and status.resource_claim_name, status  # served through DRA
        assert len(first) == 1 and attrs[0]["type"] == "gpu"
    else:
        assert len(first) == 1 and attrs[0]["type"] == "gpu"
