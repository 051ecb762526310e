"""The user's path on kind, for real: a kind cluster on a private Docker daemon, from
e2e/kind/kind-config.yaml (plus e2e/kind/here.yaml) and a node image built here
(e2e/harness/kind_node.py); `kind load image-archive` of the driver image, `helm install` of the
chart with a simulated node, the four-NVLink-GPUs example pod, a bad claim denied by the webhook
through its Service, `helm uninstall` leaving nothing; then the cluster and the daemon go, leaving
no container, bridge, iptables chain or mount.

Marked `kind`, not `e2e`: it runs in its own step (`e2e/kind/test.sh`), holding the e2e lock, as
root (dockerd). Timings of each step are printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from support import helm_binary, sim_driver_root, wait_for

pytestmark = pytest.mark.kind

ROOT = Path(__file__).resolve().parents[2]
E2E = ROOT / "e2e"
CHART = ROOT / "deploy" / "helm" / "dra-gpu"
EXAMPLES = ROOT / "deploy" / "examples"
DRIVER = "gpu.dra-gpu.io"
PROFILE = "hgx-2x4"
RELEASE = "dra-gpu"
NS = "dra-gpu"
# Valid CEL for the apiserver; the webhook knows the driver's attributes (productName).
TYPO_CEL = 'device.attributes["gpu.dra-gpu.io"].prodcutName == "NVIDIA H100 80GB HBM3"'

sys.path.insert(0, str(E2E))
from harness import kind_cluster, kind_engine, kind_node  # noqa: E402
from harness.config import BIN_K8S, CACHE  # noqa: E402

TIMES: dict[str, float] = {}


def timed(step, fn, *args, **kw):
    t0 = time.monotonic()
    out = fn(*args, **kw)
    TIMES[step] = time.monotonic() - t0
    print(f"[kind] {step}: {TIMES[step]:.1f} s", file=sys.stderr, flush=True)
    return out


def run(*cmd, check=True, timeout=600, **kw):
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        pytest.fail(
            f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
    return r


class Kind:
    def __init__(self, kubeconfig: str):
        self.kubeconfig = kubeconfig
        self.node = f"{kind_cluster.NAME}-control-plane"

    def kubectl(self, *args, check=True, **kw):
        return run(
            os.path.join(BIN_K8S, "kubectl"), "--kubeconfig", self.kubeconfig, *args, check=check, **kw
        )

    def helm(self, *args, check=True):
        return run(helm_binary(), "--kubeconfig", self.kubeconfig, *args, check=check)

    def kind(self, *args):
        r = kind_cluster.kind(*args)
        if r.returncode != 0:
            pytest.fail(f"kind {' '.join(args)} failed:\n{r.stderr[-3000:]}")
        return r

    def on_node(self, *argv, check=True):
        return run("docker", "exec", self.node, *argv, check=check, env=kind_engine.env())


@pytest.fixture(scope="module")
def engine():
    if os.geteuid() != 0:
        pytest.skip("the kind test starts a Docker daemon: root needed")
    timed("docker daemon up", kind_engine.up)
    yield
    left = timed("docker daemon down", kind_engine.down)
    assert not left, f"left behind by the docker daemon: {left}"


@pytest.fixture(scope="module")
def cluster(engine):
    image = timed("node image (build or cache)", kind_node.ensure_image)
    sim = sim_driver_root(PROFILE)
    try:
        # --retain: a failed create leaves its node for the logs below; deleted in any case.
        try:
            kubeconfig = timed("kind create cluster", kind_cluster.create, image, extra_mounts=[sim])
        except RuntimeError as exc:
            node = f"{kind_cluster.NAME}-control-plane"
            logs = kind_engine.docker("exec", node, "journalctl", "--no-pager", "-n", "80", check=False)
            pytest.fail(f"{exc}\nthe node's journal:\n{logs.stdout[-6000:]}")
        yield Kind(kubeconfig), sim
    finally:
        timed("kind delete cluster", kind_cluster.delete)
        left = kind_engine.docker("ps", "-aq").stdout.split()
        assert not left, f"containers left after kind delete cluster: {left}"


def driver_image() -> str:
    """The image archive of e2e/node/image_build.sh (built when its inputs changed) that serves a
    simulated node: the driver's image plus the simulator, `dra-gpu-simnode`."""
    run("bash", str(E2E / "node" / "image_build.sh"))
    with open(os.path.join(CACHE, "images", "dra-gpu-simnode.json")) as f:
        return json.load(f)["name"]


def test_users_path_on_kind(cluster):
    k, sim = cluster
    # The node is Ready (kind waited) and runs 1.37 with the control plane from the node image.
    nodes = json.loads(k.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    assert [n["metadata"]["name"] for n in nodes] == [k.node]
    assert nodes[0]["status"]["nodeInfo"]["kubeletVersion"] == kind_node.K8S_VERSION

    # 1. The images, as a user loads them: the driver's and the example pod's.
    name = timed("driver image (build or cache)", driver_image)
    timed("kind load image-archive", k.kind, "load", "image-archive", "--name", kind_cluster.NAME,
          os.path.join(CACHE, "images", "dra-gpu-simnode.tar"))  # fmt: skip
    run(sys.executable, str(E2E / "node" / "images.py"), os.path.join(CACHE, "images"))
    k.kind("load", "image-archive", "--name", kind_cluster.NAME, os.path.join(CACHE, "images", "busybox.tar"))
    images = k.on_node("crictl", "images", "-o", "json").stdout
    assert name in images and "localhost/dra-gpu-e2e/busybox:1" in images

    # 2. helm install with a simulated node (the plugin runs where nvidia.com/gpu.present=true).
    k.kubectl("label", "node", k.node, "nvidia.com/gpu.present=true")
    repository, tag = name.rsplit(":", 1)
    timed("helm install --wait", k.helm, "install", RELEASE, str(CHART), "-n", NS, "--create-namespace",
          "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
          "--set", "image.pullPolicy=Never", "--set", f"simulatedProfile={PROFILE}",
          "--set", f"kubeletPlugin.nvidiaDriverRoot={sim}", "--set", "controller.replicas=1",
          "--wait", "--timeout", "5m")  # fmt: skip
    slices = wait_for(
        "the node's 8 GPUs published",
        lambda: [
            s
            for s in json.loads(k.kubectl("get", "resourceslices", "-o", "json").stdout)["items"]
            if s["spec"]["driver"] == DRIVER and len(s["spec"].get("devices", [])) == 8
        ],
        timeout=120,
        interval=1,
    )
    assert slices[0]["spec"]["nodeName"] == k.node

    # 3. The four-NVLink-GPUs example: the pod runs and sees its four devices.
    k.kubectl("create", "namespace", "demo")
    k.kubectl("apply", "-n", "demo", "-f", str(EXAMPLES / "four-nvlink-gpus.yaml"))
    t0 = time.monotonic()

    def finished():
        pod = json.loads(k.kubectl("get", "pod", "-n", "demo", "four-nvlink-gpus", "-o", "json").stdout)
        return pod["status"].get("phase") in ("Succeeded", "Failed") and pod["status"]["phase"]

    phase = wait_for("the example pod to finish", finished, timeout=180, interval=1)
    TIMES["example pod"] = time.monotonic() - t0
    log = k.kubectl("logs", "-n", "demo", "four-nvlink-gpus").stdout
    print(f"[kind] example pod {phase} in {TIMES['example pod']:.1f} s; its output:\n{log}", file=sys.stderr)
    assert phase == "Succeeded", log
    visible = log.split("DRA_GPU_VISIBLE_DEVICES=", 1)[1].split()[0].split(",")
    assert len(visible) == 4 and all(v.startswith("GPU-") for v in visible), log
    minors = sorted(line for line in log.splitlines()[1:] if line.startswith("nvidia") and line[6:].isdigit())
    assert len(minors) == 4, log
    # The four are one NVLink domain of the profile: GPUs 0-3 or 4-7.
    assert minors in (
        ["nvidia0", "nvidia1", "nvidia2", "nvidia3"],
        ["nvidia4", "nvidia5", "nvidia6", "nvidia7"],
    )

    # 4. A claim with an attribute typo is denied by the webhook, which the apiserver reaches
    #    through its Service (failurePolicy Ignore: unreached, the claim would be created).
    bad = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "bad", "namespace": "demo"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": DRIVER,
                            "selectors": [{"cel": {"expression": TYPO_CEL}}],
                        },
                    }
                ]
            }
        },
    }

    def denied():
        r = k.kubectl("create", "-f", "-", input=yaml.safe_dump(bad), check=False)
        if r.returncode == 0:  # the apiserver may not call a new webhook yet: try again
            k.kubectl("delete", "resourceclaim", "-n", "demo", "bad")
            return None
        return r.stderr

    msg = wait_for("the webhook to deny the typo", denied, timeout=60, interval=1)
    assert "admission webhook" in msg and "denied the request" in msg, msg
    assert "unknown attribute" in msg and "'productName'" in msg, msg
    print(f"[kind] bad claim: {msg.strip()}", file=sys.stderr)

    # 5. Uninstall leaves nothing: the example first (its claim is unprepared), then the release.
    k.kubectl("delete", "namespace", "demo", "--wait", "--timeout", "120s")
    timed("helm uninstall --wait", k.helm, "uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "3m")
    k.kubectl("delete", "namespace", NS, "--wait", "--timeout", "120s")
    leftovers = {}
    for kind_ in ("deviceclasses", "validatingwebhookconfigurations", "validatingadmissionpolicies",
                  "clusterroles", "clusterrolebindings", "priorityclasses"):  # fmt: skip
        items = json.loads(k.kubectl("get", kind_, "-o", "json").stdout)["items"]
        named = [i["metadata"]["name"] for i in items if "dra-gpu" in i["metadata"]["name"]]
        if named:
            leftovers[kind_] = named
    assert not leftovers, leftovers
    wait_for(
        "the driver's ResourceSlices gone",
        lambda: (
            not [
                s
                for s in json.loads(k.kubectl("get", "resourceslices", "-o", "json").stdout)["items"]
                if s["spec"]["driver"] == DRIVER
            ]
        ),
        timeout=60,
        interval=1,
    )
    cdi = k.on_node("sh", "-c", "ls /var/run/cdi /etc/cdi 2>/dev/null || true").stdout
    assert DRIVER not in cdi, cdi
    print("[kind] times: " + ", ".join(f"{s} {t:.1f} s" for s, t in TIMES.items()), file=sys.stderr)
