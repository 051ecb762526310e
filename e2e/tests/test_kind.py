"""The user's path on kind, for real: a kind cluster on a private Docker daemon, from
e2e/kind/kind-config.yaml (plus e2e/kind/here.yaml) and a node image built here
(e2e/harness/kind_node.py); `scripts/release` of the images and the chart to a real OCI registry
(go-containerregistry's, behind TLS with a CA of its own: e2e/harness/release_registry.py); the
README's install commands run as written (`helm install oci://...`, the node pulling the images by
digest from that registry), with a simulated node; the README's first claim (the four-NVLink-GPUs
example); a bad claim denied by the webhook through its Service; `helm uninstall` leaving nothing;
then the cluster and the daemon go, leaving no container, bridge, iptables chain or mount.

What the README's commands get beyond their text: $REGISTRY and $VERSION (the README asks the user
to set them), SSL_CERT_FILE (the registry's CA, as a user of a private registry sets it), and the
simulated node's values added to `helm install` by a shell function (this node has no GPU).

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
from harness.release_registry import ReleaseRegistry  # noqa: E402

# The nodes' containerd reads a registry's hosts.toml (its CA) from here, as kind's docs set it up
# for a local registry.
CERTS_D = "/etc/containerd/certs.d"
REGISTRY_PATCH = f"""[plugins."io.containerd.grpc.v1.cri".registry]
  config_path = "{CERTS_D}"
"""
PUBLIC_EXAMPLE_IMAGE = "docker.io/library/debian:bookworm-slim"

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

    def on_node(self, *argv, check=True, input=None):
        stdin = ["-i"] if input is not None else []
        env = kind_engine.env()
        return run("docker", "exec", *stdin, self.node, *argv, check=check, env=env, input=input)


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
            kubeconfig = timed(
                "kind create cluster",
                kind_cluster.create,
                image,
                extra_mounts=[sim],
                containerd_patches=[REGISTRY_PATCH],
            )
        except RuntimeError as exc:
            node = f"{kind_cluster.NAME}-control-plane"
            logs = kind_engine.docker("exec", node, "journalctl", "--no-pager", "-n", "80", check=False)
            pytest.fail(f"{exc}\nthe node's journal:\n{logs.stdout[-6000:]}")
        yield Kind(kubeconfig), sim
    finally:
        timed("kind delete cluster", kind_cluster.delete)
        left = kind_engine.docker("ps", "-aq").stdout.split()
        assert not left, f"containers left after kind delete cluster: {left}"


def readme_block(marker: str) -> str:
    """The fenced block under `<!-- {marker}: ... -->` in README.md, as a user copies it."""
    text = (ROOT / "README.md").read_text()
    after = text.split(f"<!-- {marker}:", 1)[1]
    return after.split("```sh\n", 1)[1].split("```", 1)[0]


def kind_gateway() -> str:
    """The host's address on the kind network: where the nodes reach the release registry."""
    r = kind_engine.docker("network", "inspect", "kind", "-f", "{{range .IPAM.Config}}{{.Gateway}} {{end}}")
    return next(a for a in r.stdout.split() if a.count(".") == 3)


def release_to(registry: ReleaseRegistry, out: Path) -> dict:
    """scripts/release, as a maintainer runs it, to the test's registry."""
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    run(str(ROOT / "scripts" / "release"), version, "--registry", f"{registry.name}/dra-gpu",
        "--ca-file", str(registry.ca_file), "--out", str(out), timeout=1800)  # fmt: skip
    with open(out / version / "release.json") as f:
        return json.load(f)


def trust_registry(k: Kind, registry: ReleaseRegistry) -> None:
    """The node's containerd trusts the registry's CA (hosts.toml), as a user's nodes would."""
    d = f"{CERTS_D}/{registry.name}"
    hosts = f'server = "https://{registry.name}"\n[host."https://{registry.name}"]\n'
    hosts += f'  capabilities = ["pull", "resolve"]\n  ca = "{d}/ca.crt"\n'
    k.on_node("mkdir", "-p", d)
    k.on_node("sh", "-c", f"cat > {d}/ca.crt", input=registry.ca_file.read_text())
    k.on_node("sh", "-c", f"cat > {d}/hosts.toml", input=hosts)


def run_readme(k: Kind, marker: str, env: dict[str, str], prelude: str = "") -> str:
    block = readme_block(marker)
    r = run("bash", "-euo", "pipefail", "-c", prelude + block, env=env, cwd=str(ROOT), timeout=600)
    print(f"[kind] README {marker}:\n{block}{r.stdout[-3000:]}", file=sys.stderr)
    return r.stdout


def test_users_path_on_kind(cluster, tmp_path):
    k, sim = cluster
    # The node is Ready (kind waited) and runs 1.37 with the control plane from the node image.
    nodes = json.loads(k.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    assert [n["metadata"]["name"] for n in nodes] == [k.node]
    assert nodes[0]["status"]["nodeInfo"]["kubeletVersion"] == kind_node.K8S_VERSION

    # 1. The release: images and chart pushed to a real registry, the chart pinning the images.
    registry = ReleaseRegistry(
        run("bash", str(ROOT / "deploy" / "build-crane.sh")).stdout.split()[-1], kind_gateway()
    )
    try:
        released = timed("scripts/release", release_to, registry, tmp_path / "dist")
        print(f"[kind] released: {json.dumps(released)}", file=sys.stderr)
        images = released["images"]
        assert all("@sha256:" in ref for ref in images.values()), released
        sbom = json.loads((tmp_path / "dist" / released["version"] / released["sbom"]).read_text())
        names = {p["name"] for p in sbom["packages"]}
        assert {"dra-gpu", "grpcio", "python3.11"} <= names, sorted(names)[:50]
        trust_registry(k, registry)

        # 2. The example's public image, served locally under its name (no registry reachable).
        run(sys.executable, str(E2E / "node" / "images.py"), os.path.join(CACHE, "images"), "--debian")
        k.kind(
            "load", "image-archive", "--name", kind_cluster.NAME, os.path.join(CACHE, "images", "debian.tar")
        )
        assert PUBLIC_EXAMPLE_IMAGE in k.on_node("crictl", "images", "-o", "json").stdout

        # 3. The README's install, as written, on a GPU node (label: the README's prerequisite).
        k.kubectl("label", "node", k.node, "nvidia.com/gpu.present=true")
        tools = os.pathsep.join([os.path.dirname(helm_binary()), BIN_K8S, os.environ["PATH"]])
        env = dict(registry.env(), PATH=tools, KUBECONFIG=k.kubeconfig,
                   REGISTRY=f"{registry.name}/dra-gpu", VERSION=released["version"])  # fmt: skip
        simulated = (
            "helm() { if [ \"$1\" = install ]; then command helm \"$@\" --set simulatedProfile=" + PROFILE
            + f" --set kubeletPlugin.nvidiaDriverRoot={sim} --set controller.replicas=1;"
            + " else command helm \"$@\"; fi; }\n"
        )  # fmt: skip
        timed("README install", run_readme, k, "install", env, simulated)
    finally:
        registry.close()
    # The pods run the released images, pulled by digest from the registry.
    pods = json.loads(k.kubectl("get", "pods", "-n", NS, "-o", "json").stdout)["items"]
    running = {c["image"] for p in pods for c in p["spec"]["containers"]}
    assert running == {images["dra-gpu-simnode"]}, (running, images)
    on_node = json.loads(k.on_node("crictl", "images", "-o", "json").stdout)["images"]
    pulled = {d for i in on_node for d in i.get("repoDigests") or [] if d.startswith(registry.name)}
    name, digest = images["dra-gpu-simnode"].split("@")
    assert pulled == {name.rsplit(":", 1)[0] + "@" + digest}, pulled
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

    # 4. The README's first claim: four NVLink-connected GPUs; the pod lists them.
    t0 = time.monotonic()
    log = run_readme(k, "first-claim", dict(os.environ, KUBECONFIG=k.kubeconfig,
                     PATH=os.pathsep.join([BIN_K8S, os.environ["PATH"]])))  # fmt: skip
    TIMES["example pod"] = time.monotonic() - t0
    print(f"[kind] example pod done in {TIMES['example pod']:.1f} s; its output:\n{log}", file=sys.stderr)
    visible = log.split("DRA_GPU_VISIBLE_DEVICES=", 1)[1].split()[0].split(",")
    assert len(visible) == 4 and all(v.startswith("GPU-") for v in visible), log
    listed = [line.split("(UUID: ", 1)[1].rstrip(")") for line in log.splitlines() if line.startswith("GPU ")]
    assert sorted(listed) == sorted(visible), log  # nvidia-smi -L: exactly the claim's GPUs
    minors = sorted(line for line in log.splitlines() if line.startswith("nvidia") and line[6:].isdigit())
    # The four are one NVLink domain of the profile: GPUs 0-3 or 4-7.
    assert minors in (
        ["nvidia0", "nvidia1", "nvidia2", "nvidia3"],
        ["nvidia4", "nvidia5", "nvidia6", "nvidia7"],
    ), log
    k.kubectl("delete", "-f", str(EXAMPLES / "four-nvlink-gpus.yaml"), "--wait", "--timeout", "120s")
    k.kubectl("create", "namespace", "demo")

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
