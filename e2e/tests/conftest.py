"""Session fixtures for the e2e tier (pytest -m e2e e2e/tests).

Target cluster:
- KUBECONFIG set: that cluster is used as it is (kind, or `eval "$(e2e/cluster env)"`), and left
  running.
- otherwise the local cluster from e2e/cluster: reused when it already runs (and left running),
  else brought up once for the session (root needed) and brought down at its end.
"""

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from controller_support import (
    A100_CLASS,
    ANY_CLASS,
    GPU_CLASS,
    HGX,
    MIG,
    MIG_CLASS,
    PROFILES,
    RESOURCE,
    TAINT,
    TAINT_CLASS,
    TAINTS,
    device_class,
    ignore_404,
)
from support import CACHE, dra_gpu_image, kubelet_excerpt

E2E_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, E2E_DIR)  # the harness, as e2e/cluster imports it
from harness import shuffle, skips  # noqa: E402

CLUSTER = os.path.join(E2E_DIR, "cluster")
MANIFESTS = os.path.join(E2E_DIR, "manifests")

BUSYBOX_IMAGE = os.environ.get("E2E_BUSYBOX_IMAGE", "localhost/dra-gpu-e2e/busybox:1")
PEER_DRIVER = os.environ.get("DRA_GPU_E2E_PEER_DRIVER_NAME", "gpu.example.com")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries the kubelet's lines of its time (local cluster only)."""
    report = yield
    if report.when == "call" and report.failed:
        state = os.environ.get("DRA_GPU_E2E_STATE", "/var/lib/dra-gpu-e2e")
        excerpt = kubelet_excerpt(Path(state) / "logs" / "kubelet.log", call.start, call.stop)
        if excerpt:
            report.sections.append(("kubelet log (DRA lines, warnings, errors)", excerpt))
    return report


def pytest_configure(config):
    config.addinivalue_line("markers", "e2e: end-to-end test against a real Kubernetes cluster")
    config.addinivalue_line("markers", "kind: the kind cluster of e2e/kind/ on a private Docker daemon")
    # A skip (e.g. every test, run as non-root without KUBECONFIG) fails the tier unless declared.
    skips.register(config)


def pytest_collection_modifyitems(config, items):
    """DRA_GPU_TEST_SHUFFLE=<seed>: the tests in a shuffled order (harness/shuffle.py), said
    with its seed so that a failing order can be run again."""
    seed = os.environ.get("DRA_GPU_TEST_SHUFFLE")
    if seed:
        items[:] = shuffle.shuffled(items, lambda item: str(item.fspath), seed)
        print(f"\n[e2e] shuffled order, seed {seed}: {', '.join(i.nodeid.split('/')[-1] for i in items)}")


def _cluster(*args, check=True):
    return subprocess.run([sys.executable, CLUSTER, *args], check=check, text=True, capture_output=True)


def _cluster_env():
    out = _cluster("env").stdout
    env = {}
    for line in out.splitlines():
        k, v = line[len("export ") :].split("=", 1)
        env[k] = v.strip('"')
    return env


class Target:
    """What the tests run against."""

    def __init__(self, kubeconfig, local):
        self.kubeconfig = kubeconfig
        self.local = local  # our e2e/cluster (host-process peer driver possible)


@pytest.fixture(scope="session")
def target():
    started = False
    if os.environ.get("KUBECONFIG"):
        t = Target(os.environ["KUBECONFIG"], local=False)
    else:
        if _cluster("status", check=False).returncode != 0:
            if os.geteuid() != 0:
                pytest.skip("no KUBECONFIG and not root: cannot start the local e2e cluster")
            t0 = time.time()
            r = subprocess.run([sys.executable, CLUSTER, "up"], text=True)
            if r.returncode != 0:
                pytest.fail("e2e/cluster up failed (see its output above)")
            started = True
            print("\n[e2e] cluster up in %.1f s" % (time.time() - t0), file=sys.stderr)
        t = Target(_cluster_env()["KUBECONFIG"], local=True)
    yield t
    if started and os.environ.get("DRA_GPU_E2E_KEEP") != "1":
        subprocess.run([sys.executable, CLUSTER, "down"], text=True)


@pytest.fixture(scope="module", autouse=True)
def node_as_after_a_reboot(request):
    """Each test file starts from a node as after a reboot: no host-process plugin left by an
    earlier file (it would hold the plugin's port), and the simulated GPUs all found, with no MIG
    instance. Without this one failed test (an XID fault it never cleared, a plugin its teardown
    could not stop) fails every later file that counts GPUs or starts a plugin."""
    if os.environ.get("KUBECONFIG") or os.geteuid() != 0:
        yield
        return
    from test_kubelet_plugin import SIM_DEV, fresh_gpus, stop_stray_plugins

    stray = stop_stray_plugins()
    if stray:
        print(f"\n[e2e] {request.node.name}: stopped {stray} plugin process(es) an earlier file left")
    if SIM_DEV.is_dir():
        fresh_gpus(SIM_DEV)
    yield


@pytest.fixture(scope="session")
def api_client(target):
    try:
        import kubernetes  # noqa: F401
    except ImportError:
        pytest.fail("the e2e tier needs the `kubernetes` Python package (pip install kubernetes)")
    from kubernetes import config

    return config.new_client_from_config(config_file=target.kubeconfig)


@pytest.fixture(scope="session")
def core(api_client):
    from kubernetes import client

    return client.CoreV1Api(api_client)


@pytest.fixture(scope="session")
def dyn(api_client):
    from kubernetes import dynamic

    return dynamic.DynamicClient(api_client)


@pytest.fixture
def namespace(core):
    from kubernetes import client

    name = "e2e-" + uuid.uuid4().hex[:8]
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    # The service-account controller creates "default"; pods cannot be created before it.
    deadline = time.time() + 30
    while time.time() < deadline:
        if any(sa.metadata.name == "default" for sa in core.list_namespaced_service_account(name).items):
            break
        time.sleep(0.2)
    yield name
    core.delete_namespace(name, grace_period_seconds=0)


@pytest.fixture(scope="session")
def busybox_image():
    return BUSYBOX_IMAGE


@pytest.fixture(scope="session")
def example_image(target):
    """The public image deploy/examples run (docker.io/library/debian:bookworm-slim), served by a
    local build under that name (e2e/node/images.py --debian: its debian.tar carries both names),
    imported into the local cluster's containerd; on another cluster whoever runs it loads that
    archive (`kind load image-archive`)."""
    name = "docker.io/library/debian:bookworm-slim"
    if target.local:
        env = _cluster_env()
        path = {**os.environ, "PATH": env["PATH"].replace("$PATH", os.environ["PATH"])}
        images = [sys.executable, os.path.join(E2E_DIR, "node", "images.py"), str(CACHE / "images")]
        subprocess.run([*images, "--debian", "--import-to", env["CONTAINERD_ADDRESS"]], env=path, check=True)
    return name


@pytest.fixture(scope="session")
def wait_pod():
    return wait_pod_done


def wait_pod_done(core, ns, name, timeout=90):
    """Wait for a pod to finish; returns its phase. Fails with its status on timeout."""
    deadline = time.time() + timeout
    pod = None
    while time.time() < deadline:
        pod = core.read_namespaced_pod(name, ns)
        if pod.status.phase in ("Succeeded", "Failed"):
            return pod.status.phase
        time.sleep(0.5)
    events = core.list_namespaced_event(ns, field_selector="involvedObject.name=" + name)
    lines = "\n".join(f"{e.type} {e.reason}: {e.message}" for e in events.items)
    raise AssertionError(
        f"pod {ns}/{name} not done after {timeout} s: {pod.status if pod else None}\nevents:\n{lines}"
    )


@pytest.fixture(scope="session")
def peer_driver(target, dyn):
    """Upstream's DRA test driver as a host-process kubelet plugin named gpu.example.com.

    Local cluster: started here (and stopped at the end). Elsewhere (kind) only if
    DRA_GPU_E2E_PEER_DRIVER=external says it was deployed; otherwise the test is skipped."""
    started = False
    if target.local:
        r = _cluster("peer-driver", "start", check=False)
        if r.returncode != 0:
            pytest.fail("peer driver did not start:\n" + r.stderr)
        started = "already running" not in r.stderr
    elif os.environ.get("DRA_GPU_E2E_PEER_DRIVER") != "external":
        pytest.skip(
            "peer driver runs only on the local e2e cluster "
            "(set DRA_GPU_E2E_PEER_DRIVER=external if it is deployed)"
        )
    import yaml

    with open(os.path.join(MANIFESTS, "peer-deviceclass.yaml")) as f:
        dc = yaml.safe_load(f)
    api = dyn.resources.get(api_version="resource.k8s.io/v1", kind="DeviceClass")
    try:
        api.create(body=dc)
    except Exception as e:  # already there from an earlier session
        if getattr(e, "status", None) != 409:
            raise
    yield PEER_DRIVER
    if started:
        _cluster("peer-driver", "stop", check=False)


@pytest.fixture(scope="module")
def published(target, core, dyn):
    """Simulated slices of both profiles on the real node, and the classes for them (for the
    test_controller_*.py files; each publishes them for itself and removes them at its end)."""
    from simnode.fake import discover_node

    from dra_gpu.node.slices import build_slices

    node = core.list_node().items[0].metadata.name
    slices_api = dyn.resources.get(api_version=RESOURCE, kind="ResourceSlice")
    classes_api = dyn.resources.get(api_version=RESOURCE, kind="DeviceClass")

    def drop_slices():
        for driver in PROFILES:
            for s in slices_api.get(field_selector=f"spec.driver={driver}").to_dict()["items"]:
                ignore_404(slices_api.delete, name=s["metadata"]["name"])

    drop_slices()  # a crashed earlier run of this file
    any_gpu = device_class(ANY_CLASS, HGX, "gpu")
    any_gpu["spec"]["selectors"] = [
        {
            "cel": {
                "expression": f"device.driver in {json.dumps(list(PROFILES))} "
                '&& device.attributes[device.driver].type == "gpu"'
            }
        }
    ]
    classes = [
        device_class(GPU_CLASS, HGX, "gpu"),
        device_class(A100_CLASS, MIG, "gpu"),
        device_class(MIG_CLASS, MIG, "mig"),
        device_class(TAINT_CLASS, TAINT, "gpu"),
        any_gpu,
    ]
    try:
        for driver, profile in PROFILES.items():
            for s in build_slices(discover_node(node, profile), driver):
                if driver == TAINT:
                    for d in s["spec"]["devices"]:
                        taint = TAINTS.get(d["attributes"]["index"]["int"])
                        if taint:
                            d["taints"] = [taint]
                slices_api.create(body=s)
        for c in classes:
            classes_api.create(body=c)
        got = {d: slices_api.get(field_selector=f"spec.driver={d}").to_dict()["items"] for d in PROFILES}
        got["*"] = [x for d in PROFILES for x in got[d]]
        yield {
            "node": node,
            "slices": got,
            "classes": [classes_api.get(name=c["metadata"]["name"]).to_dict() for c in classes],
        }
    finally:
        for c in classes:
            ignore_404(classes_api.delete, name=c["metadata"]["name"])
        drop_slices()


@pytest.fixture(scope="module")
def image(target):
    """The `--set` values that make the chart use the dra-gpu image of deploy/Dockerfile, built
    (or found cached) and imported into the local cluster's containerd."""
    return dra_gpu_image(target)


@pytest.fixture(scope="session")
def simnode_image(target):
    """The `--set` values that make the chart use the driver's image plus the simulator
    (`localhost/dra-gpu-simnode`), which the chart's simulatedProfile needs."""
    return dra_gpu_image(target, "dra-gpu-simnode")
