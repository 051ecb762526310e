"""A GPU and a NIC on one PCIe root (GPUDirect RDMA), allocated together by the real scheduler
from two drivers: dra-gpu serving the pcie-pairs node (4 A100s on roots pci0000:16, :30, :b0 and
:c9) and a network DRA driver (nic_driver.py, on dra-gpu's GPU-free kubelet-plugin layer) with
NICs on :16, :b0 and :e1 (a root without a GPU). A claim asks for a GPU and a NIC with
`matchAttribute: resource.kubernetes.io/pcieRoot`: two such pairs fit, the third claim waits (the
scheduler says so), and `dra-gpu explain` on the live cluster names the root it would use, or the
roots that have a free GPU and those that have a free NIC. The GPU + NIC example runs here too
(it needs the NIC driver, so e2e/tests/test_deploy.py leaves it out)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from support import ROOT, wait_for
from test_kubelet_plugin import KUBELET_ROOT, Plugin, ensure_device_classes

pytestmark = pytest.mark.e2e

RESOURCE = "resource.k8s.io/v1"
GPU_DRIVER = "gpu.dra-gpu.io"
NIC_DRIVER = "nic.example.com"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
PROFILE = "pcie-pairs"
GPU_ROOTS = ["pci0000:16", "pci0000:30", "pci0000:b0", "pci0000:c9"]  # the profile's, GPU 0..3
NICS = {"nic0": "pci0000:16", "nic1": "pci0000:b0", "nic2": "pci0000:e1"}
NIC_PLUGIN_DIR = KUBELET_ROOT / "plugins" / NIC_DRIVER
CDI_DIR = Path("/var/run/cdi")
EXAMPLE = ROOT / "deploy" / "examples" / "gpu-and-nic-same-pcie-root.yaml"


class NicDriver:
    """nic_driver.py as a host process, as a network driver's DaemonSet would run it."""

    def __init__(self, kubeconfig: str, node: str, log_path: Path) -> None:
        self.kubeconfig, self.node, self.log_path = kubeconfig, node, log_path
        self.pid_file = NIC_PLUGIN_DIR / "nic-driver.pid"
        self.ready_file = NIC_PLUGIN_DIR / "registered"
        self.proc: subprocess.Popen | None = None

    def stop_stray(self) -> None:
        """A driver an earlier run left (its pytest killed): it would hold the sockets."""
        with contextlib.suppress(OSError, ValueError):
            pid = int(self.pid_file.read_text())
            if b"nic_driver.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
                print(f"\n[e2e] stopped a NIC driver (pid {pid}) an earlier run left")

    def start(self) -> None:
        NIC_PLUGIN_DIR.mkdir(parents=True, exist_ok=True)
        self.stop_stray()
        self.ready_file.unlink(missing_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps writing to it
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).with_name("nic_driver.py")),
                "--node-name",
                self.node,
                "--kubeconfig",
                self.kubeconfig,
                "--plugin-dir",
                str(NIC_PLUGIN_DIR),
                "--registry-dir",
                str(KUBELET_ROOT / "plugins_registry"),
                "--cdi-dir",
                str(CDI_DIR),
                "--ready-file",
                str(self.ready_file),
                *[f"--nic={name}={root}" for name, root in NICS.items()],
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        log.close()
        self.pid_file.write_text(str(self.proc.pid))
        wait_for("the kubelet to confirm the NIC driver's registration", self.ready, timeout=60)

    def ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"NIC driver exited {self.proc.returncode}:\n{self.log_tail()}")
        return self.ready_file.exists()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.pid_file.unlink(missing_ok=True)
        for spec in CDI_DIR.glob(f"{NIC_DRIVER}-*.json"):
            spec.unlink(missing_ok=True)

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def slices_of(dyn, driver):
    api = dyn.resources.get(api_version=RESOURCE, kind="ResourceSlice")
    return api, api.get(field_selector=f"spec.driver={driver}").to_dict()["items"]


def roots_of(dyn, driver):
    """Device name -> its PCIe root, as the driver published it."""
    _, items = slices_of(dyn, driver)
    return {
        d["name"]: d["attributes"][PCIE_ROOT]["string"]
        for s in items
        for d in s["spec"]["devices"]
        if PCIE_ROOT in d.get("attributes", {})
    }


def nic_class():
    return {
        "apiVersion": RESOURCE,
        "kind": "DeviceClass",
        "metadata": {"name": NIC_DRIVER},
        "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{NIC_DRIVER}'"}}]},
    }


@pytest.fixture(scope="module")
def two_drivers(target, core, dyn, tmp_path_factory):
    """dra-gpu serving pcie-pairs and the NIC driver beside it, with both classes."""
    if not target.local:
        pytest.skip("both plugins run as host processes only on the local e2e cluster")
    node = core.list_node().items[0].metadata.name
    logs = tmp_path_factory.mktemp("gpu-nic")
    gpu = Plugin(target.kubeconfig, node, logs / "plugin.log")
    gpu.profile = PROFILE
    nic = NicDriver(target.kubeconfig, node, logs / "nic-driver.log")
    classes = dyn.resources.get(api_version=RESOURCE, kind="DeviceClass")
    ensure_device_classes(dyn)
    with contextlib.suppress(Exception):  # one an earlier run left
        classes.delete(name=NIC_DRIVER)
    classes.create(body=nic_class())
    try:
        gpu.start()
        wait_for("dra-gpu's pcie-pairs GPUs", lambda: sorted(roots_of(dyn, GPU_DRIVER).values()) == GPU_ROOTS)
        nic.start()
        wait_for("the NIC driver's slice", lambda: roots_of(dyn, NIC_DRIVER) == NICS)
        yield node
    finally:
        nic.stop()
        gpu.stop()
        print(f"\n[e2e] NIC driver log tail:\n{nic.log_tail(12)}")
        for driver in (NIC_DRIVER, GPU_DRIVER):
            api, items = slices_of(dyn, driver)
            for s in items:
                with contextlib.suppress(Exception):
                    api.delete(name=s["metadata"]["name"])
        with contextlib.suppress(Exception):
            classes.delete(name=NIC_DRIVER)


def explain(target, *files, output="text"):
    r = subprocess.run(
        [sys.executable, "-m", "dra_gpu.cli", "explain", "--kubeconfig", target.kubeconfig, "-o", output]
        + [a for f in files for a in ("-f", str(f))],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    return r


def pair_template(dyn, namespace, name="pair"):
    dyn.resources.get(api_version=RESOURCE, kind="ResourceClaimTemplate").create(
        namespace=namespace,
        body={
            "apiVersion": RESOURCE,
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": name},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [
                            {"name": "gpu", "exactly": {"deviceClassName": GPU_DRIVER}},
                            {"name": "nic", "exactly": {"deviceClassName": NIC_DRIVER}},
                        ],
                        "constraints": [{"requests": ["gpu", "nic"], "matchAttribute": PCIE_ROOT}],
                    }
                }
            },
        },
    )


def pair_pod(name, busybox_image, template="pair"):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "resourceClaims": [{"name": "rdma", "resourceClaimTemplateName": template}],
            "containers": [
                {
                    "name": "main",
                    "image": busybox_image,
                    "imagePullPolicy": "Never",
                    # The GPU's UUID from dra-gpu's CDI spec, the NIC's root from the NIC driver's.
                    "command": [
                        "sh",
                        "-c",
                        "env | grep -e ^DRA_GPU_VISIBLE -e ^NIC_ | sort; echo READY; sleep 3600",
                    ],
                    "resources": {"claims": [{"name": "rdma"}]},
                }
            ],
        },
    }


def allocation_of(dyn, namespace, pod):
    """{request: (driver, device)} of the claim made for `pod`, once allocated."""
    claims = dyn.resources.get(api_version=RESOURCE, kind="ResourceClaim")
    for c in claims.get(namespace=namespace).to_dict()["items"]:
        owners = [o.get("name") for o in c["metadata"].get("ownerReferences") or []]
        alloc = (c.get("status") or {}).get("allocation")
        if pod in owners and alloc:
            return {r["request"]: (r["driver"], r["device"]) for r in alloc["devices"]["results"]}
    return None


def pair_roots(dyn, allocation):
    """The GPU's and the NIC's PCIe roots, read from the slices each driver published."""
    (gpu_driver, gpu), (nic_driver, nic) = allocation["gpu"], allocation["nic"]
    assert (gpu_driver, nic_driver) == (GPU_DRIVER, NIC_DRIVER), allocation
    return roots_of(dyn, GPU_DRIVER)[gpu], roots_of(dyn, NIC_DRIVER)[nic]


def running_log(core, namespace, pod):
    if core.read_namespaced_pod(pod, namespace).status.phase != "Running":
        return None
    log = core.read_namespaced_pod_log(pod, namespace)
    return log if "READY" in log else None


def wait_unprepared_by_both(dyn, namespace):
    """The claims gone, and the kubelet has unprepared them with the NIC driver too (its CDI specs
    gone), not only with dra-gpu."""
    claims = dyn.resources.get(api_version=RESOURCE, kind="ResourceClaim")
    wait_for(
        "the claims to be gone", lambda: not claims.get(namespace=namespace).to_dict()["items"], timeout=60
    )
    wait_for(
        "the NIC driver's CDI specs to be gone",
        lambda: not list(CDI_DIR.glob(f"{NIC_DRIVER}-*.json")),
        timeout=60,
    )


def test_both_drivers_publish_their_devices_on_known_roots(two_drivers, dyn):
    gpus, nics = roots_of(dyn, GPU_DRIVER), roots_of(dyn, NIC_DRIVER)
    assert sorted(gpus.values()) == GPU_ROOTS and nics == NICS
    print(f"\n[e2e] GPU roots {sorted(gpus.items())}; NIC roots {sorted(nics.items())}")


def test_the_example_runs_on_a_gpu_and_a_nic_of_one_root(
    two_drivers, target, core, dyn, namespace, example_image
):
    """deploy/examples/gpu-and-nic-same-pcie-root.yaml as it is: explain names the root first, the
    real scheduler then picks the same pair, and the pod runs with the GPU."""
    r = explain(target, EXAMPLE)
    print(f"\n[e2e] dra-gpu explain -f {EXAMPLE.name} --kubeconfig ...:\n{r.stdout.rstrip()}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[1:] == ["  gpu and nic on pcieRoot pci0000:16"], r.stdout
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    assert {c["image"] for d in docs if d["kind"] == "Pod" for c in d["spec"]["containers"]} == {
        example_image
    }
    for obj in docs:
        api = dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        api.create(namespace=namespace, body=obj)
    allocation, deadline = None, time.time() + 120
    while time.time() < deadline:  # the claim goes with the pod once it is done: read it meanwhile
        allocation = allocation or allocation_of(dyn, namespace, "gpu-and-nic")
        phase = core.read_namespaced_pod("gpu-and-nic", namespace).status.phase
        if phase in ("Succeeded", "Failed"):
            break
        time.sleep(0.2)
    log = core.read_namespaced_pod_log("gpu-and-nic", namespace)
    print(f"[e2e] pod gpu-and-nic ({phase}), allocation {allocation}:\n{log.rstrip()}")
    assert phase == "Succeeded", log
    assert allocation is not None
    assert pair_roots(dyn, allocation) == ("pci0000:16", "pci0000:16")
    explained = json.loads(explain(target, EXAMPLE, output="json").stdout)["claims"][0]
    assert [(r["driver"], r["device"]) for r in explained["results"]] == [
        allocation["gpu"],
        allocation["nic"],
    ]
    uuid = next(
        line.split("=", 1)[1] for line in log.splitlines() if line.startswith("DRA_GPU_VISIBLE_DEVICES=")
    )
    assert f"(UUID: {uuid})" in log  # nvidia-smi -L, from the claim's CDI spec, lists that GPU
    core.delete_namespaced_pod("gpu-and-nic", namespace, grace_period_seconds=0)
    wait_unprepared_by_both(dyn, namespace)


def test_pairs_until_no_root_has_both_then_the_claim_waits(
    two_drivers, target, core, dyn, namespace, busybox_image, tmp_path
):
    node = two_drivers
    pair_template(dyn, namespace)
    for pod in ("pair-1", "pair-2"):
        core.create_namespaced_pod(namespace, pair_pod(pod, busybox_image))
    roots = {}
    for pod in ("pair-1", "pair-2"):
        log = wait_for(f"{pod} to run", lambda pod=pod: running_log(core, namespace, pod), timeout=120)
        gpu_root, nic_root = pair_roots(dyn, allocation_of(dyn, namespace, pod))
        assert gpu_root == nic_root, (pod, gpu_root, nic_root)
        # The NIC driver prepared its part (its CDI spec's env): the pod started with both.
        nic = allocation_of(dyn, namespace, pod)["nic"][1]
        assert f"NIC_PCIE_ROOT_{nic}={nic_root}" in log.splitlines(), log
        roots[pod] = gpu_root
        print(f"\n[e2e] {pod}: GPU and NIC on {gpu_root}\n{log.rstrip()}")
    assert sorted(roots.values()) == ["pci0000:16", "pci0000:b0"]

    # The third claim: the GPUs left (:30, :c9) have no NIC beside them, the NIC left (:e1) no GPU.
    third = pair_pod("pair-3", busybox_image)
    third["metadata"]["namespace"] = namespace
    core.create_namespaced_pod(namespace, third)

    def refused():
        events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=pair-3").items
        return [e.message for e in events if e.reason == "FailedScheduling"]

    (message, *_) = wait_for("the scheduler to say why pair-3 waits", refused, timeout=60)
    print(f"[e2e] pair-3 FailedScheduling: {message}")
    assert "cannot allocate all claims" in message, message
    assert core.read_namespaced_pod("pair-3", namespace).status.phase == "Pending"

    manifest = tmp_path / "pair-3.yaml"
    manifest.write_text(yaml.safe_dump(third))
    r = explain(target, manifest)
    print(f"[e2e] dra-gpu explain -f pair-3.yaml --kubeconfig ...:\n{r.stdout.rstrip()}")
    assert r.returncode == 5, r.stdout + r.stderr  # valid, not allocatable
    assert r.stdout.rstrip().endswith(
        f"not allocatable: no pcieRoot on {node} has both a free {GPU_DRIVER} device (request 'gpu') "
        f"and a free {NIC_DRIVER} device (request 'nic'): roots with a free {GPU_DRIVER} device: "
        f"pci0000:30, pci0000:c9; with a free {NIC_DRIVER} device: pci0000:e1"
    ), r.stdout

    # A pair freed is taken: the waiting claim gets the root pair-1 held.
    core.delete_namespaced_pod("pair-1", namespace, grace_period_seconds=0)
    log = wait_for(
        "pair-3 to run once pair-1 is gone", lambda: running_log(core, namespace, "pair-3"), timeout=120
    )
    assert pair_roots(dyn, allocation_of(dyn, namespace, "pair-3")) == (roots["pair-1"], roots["pair-1"])
    print(f"[e2e] pair-3 ran on {roots['pair-1']} after pair-1 was deleted")
    for pod in ("pair-2", "pair-3"):
        core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0)
    wait_unprepared_by_both(dyn, namespace)
