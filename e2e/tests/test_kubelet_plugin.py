"""dra-gpu's kubelet plugin in the real cluster: registration with the real kubelet, slices kept
true against deletion and edits, allocation by the real scheduler, CDI injection by containerd
into a container that sees the simulated GPUs' device nodes, unprepare, restarts."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from simnode.inject import set_gpu_lost
from simnode.state import reboot
from support import ROOT, sim_driver_root, wait_for

pytestmark = pytest.mark.e2e

DRIVER = "gpu.dra-gpu.io"
PROFILE = "hgx-2x4"
HTTP = "127.0.0.1:51517"
KUBELET_ROOT = Path(os.environ.get("DRA_GPU_E2E_KUBELET_ROOT", "/var/lib/kubelet"))
PLUGIN_DIR = KUBELET_ROOT / "plugins" / DRIVER
CDI_DIR = Path("/var/run/cdi")
MIG_CLASS = "mig.dra-gpu.io"
SIM_DEV = PLUGIN_DIR / "simulated-root" / "dev"  # the simulated kernel's state is kept there


def fresh_gpus(dev: Path) -> None:
    """The simulated node as after a reboot, every GPU found: no MIG instance, no lost GPU that
    another test's simulated fault left."""
    reboot(dev)
    lost = dev / ".nvidia-sim" / "lost"
    for entry in lost.iterdir() if lost.is_dir() else ():
        set_gpu_lost(dev, entry.name, lost=False)


def stop_stray_plugins() -> int:
    """SIGKILL every host-process plugin on this file's HTTP address (what `Plugin` starts); the
    number killed."""
    out = subprocess.run(
        ["pgrep", "-f", f"dra_gpu.cli kubelet-plugin .*--http-address {HTTP}"], capture_output=True, text=True
    )
    pids = [int(p) for p in out.stdout.split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


class Plugin:
    """`dra-gpu kubelet-plugin` as a host process, the way the DaemonSet runs it."""

    def __init__(self, kubeconfig: str, node: str, log_path: Path) -> None:
        self.kubeconfig, self.node, self.log_path = kubeconfig, node, log_path
        self.proc: subprocess.Popen | None = None
        self.profile = PROFILE
        self.driver_version: str | None = None  # None: the profile's own (no mismatch)
        self.driver_root: str | None = None  # None: the simulated root of driver_version
        self.extra_args: list[str] = []  # more kubelet-plugin flags (e.g. --memory-shares)
        self.env: dict[str, str] = {}  # more environment (e.g. DRA_GPU_FAILPOINTS, with --enable-failpoints)
        self.wrapper: list[str] = []  # a command the plugin runs under (e.g. `unshare ...`)

    def node_args(self) -> list[str]:
        """The flags that say which node this is: a simulated one of the profile."""
        return [
            "--profile",
            self.profile,
            "--driver-root",
            self.driver_root or sim_driver_root(self.profile, self.driver_version),
        ]

    def environment(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps writing to it
        self.proc = subprocess.Popen(
            [
                *self.wrapper,
                sys.executable,
                "-m",
                "dra_gpu.cli",
                "kubelet-plugin",
                "--node-name",
                self.node,
                *self.node_args(),
                "--kubeconfig",
                self.kubeconfig,
                "--plugin-dir",
                str(PLUGIN_DIR),
                "--registry-dir",
                str(KUBELET_ROOT / "plugins_registry"),
                "--cdi-dir",
                str(CDI_DIR),
                "--http-address",
                HTTP,
                "--sweep-interval",
                "2",
                "--sweep-grace",
                "3",
                *self.extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            cwd=ROOT,
        )
        log.close()
        # Ready: the kubelet confirmed the registration, so a pod made now is not refused with
        # "driver not registered" (and retried only after the kubelet's 10 s back-off).
        wait_for("the kubelet to confirm the plugin's registration (/readyz)", self.ready, timeout=60)

    def healthy(self, path: str = "/healthz") -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"plugin exited {self.proc.returncode}:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"http://{HTTP}{path}", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def ready(self) -> bool:
        return self.healthy("/readyz")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://{HTTP}/metrics", timeout=2) as r:
            return r.read().decode()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # never left running for the next test to find
                self.proc.wait(timeout=10)
                raise AssertionError(
                    f"the plugin did not stop within 20 s of SIGTERM:\n{self.log_tail()}"
                ) from None

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()  # SIGKILL: no clean-up at all
        self.proc.wait(timeout=10)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def ensure_device_classes(dyn):
    """The driver's two DeviceClasses (whole GPUs, MIG devices), as the chart installs them."""
    classes = dyn.resources.get(api_version="resource.k8s.io/v1", kind="DeviceClass")
    for name, kind in ((DRIVER, "gpu"), (MIG_CLASS, "mig")):
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": name},
            "spec": {
                "selectors": [
                    {
                        "cel": {
                            "expression": (
                                f"device.driver == '{DRIVER}' && "
                                f"device.attributes['{DRIVER}'].type == '{kind}'"
                            )
                        }
                    }
                ]
            },
        }
        try:
            classes.create(body=body)
        except Exception as e:
            if getattr(e, "status", None) != 409:
                raise


@pytest.fixture(scope="module")
def plugin(target, core, dyn, tmp_path_factory):
    if not target.local:
        pytest.skip(
            "the plugin runs as a host process only on the local e2e cluster; on kind "
            "install the chart (deploy/) first"
        )
    node = core.list_node().items[0].metadata.name
    p = Plugin(target.kubeconfig, node, tmp_path_factory.mktemp("plugin") / "plugin.log")
    ensure_device_classes(dyn)
    p.start()
    yield p
    p.stop()
    slices = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceSlice")
    for s in slices.get(field_selector=f"spec.driver={DRIVER}").to_dict()["items"]:
        slices.delete(name=s["metadata"]["name"])


def our_slices(dyn):
    api = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceSlice")
    return api, api.get(field_selector=f"spec.driver={DRIVER}").to_dict()["items"]


def claim_pod(core, namespace, name, claim_source, command, busybox_image, restart_policy="Never"):
    """A pod whose one container uses the claim `gpus` (`claim_source`: resource_claim_name or
    resource_claim_template_name)."""
    ((key, value),) = claim_source.items()
    source = {
        "resource_claim_name": "resourceClaimName",
        "resource_claim_template_name": "resourceClaimTemplateName",
    }[key]
    core.create_namespaced_pod(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "restartPolicy": restart_policy,
                "terminationGracePeriodSeconds": 0,
                "resourceClaims": [{"name": "gpus", source: value}],
                "containers": [
                    {
                        "name": "main",
                        "image": busybox_image,
                        "imagePullPolicy": "Never",
                        "command": ["sh", "-c", command],
                        "resources": {"claims": [{"name": "gpus"}]},
                    }
                ],
            },
        },
    )


def template(dyn, namespace, name, count=1, nvlink=False, selectors=(), device_class=DRIVER, config=None):
    devices = {
        "requests": [
            {
                "name": "gpus",
                "exactly": {
                    "deviceClassName": device_class,
                    "count": count,
                    "selectors": [{"cel": {"expression": e}} for e in selectors],
                },
            }
        ]
    }
    if nvlink:
        devices["constraints"] = [{"matchAttribute": f"{DRIVER}/nvlinkDomain"}]
    if config is not None:
        devices["config"] = [{"opaque": {"driver": DRIVER, "parameters": config}}]
    api = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaimTemplate")
    api.create(
        namespace=namespace,
        body={
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": name},
            "spec": {"spec": {"devices": devices}},
        },
    )


def nvlink_template(dyn, namespace, name="four-nvlink", count=4):
    template(dyn, namespace, name, count=count, nvlink=True)


def allocated(dyn, namespace, pod):
    """Device names allocated to the claim made for `pod` (None once the claim is gone)."""
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    for c in claims.get(namespace=namespace).to_dict()["items"]:
        owners = [o.get("name") for o in c["metadata"].get("ownerReferences") or []]
        alloc = (c.get("status") or {}).get("allocation")
        if pod in owners and alloc:
            return [r["device"] for r in alloc["devices"]["results"]]
    return None


def visible_devices(dyn, log):
    """Device names of the UUIDs the container saw in DRA_GPU_VISIBLE_DEVICES."""
    line = next(x for x in log.splitlines() if x.startswith("DRA_GPU_VISIBLE_DEVICES="))
    by_uuid = {a["uuid"]: name for name, a in device_attrs(dyn).items()}
    return [by_uuid[u] for u in line.split("=", 1)[1].split(",")]


def device_attrs(dyn):
    _, items = our_slices(dyn)
    return {
        d["name"]: {k: next(iter(v.values())) for k, v in d["attributes"].items()}
        for s in items
        for d in s["spec"]["devices"]
    }


def link_cost(dyn, devices):
    attrs = device_attrs(dyn)
    doms = [attrs[d]["nvlinkDomain"] for d in devices]
    return sum(1 if doms[i] == doms[j] else 4 for i in range(len(doms)) for j in range(i + 1, len(doms)))


def test_registered_and_slices_published(plugin, dyn):
    _, items = our_slices(dyn)
    assert len(items) == 1
    spec = items[0]["spec"]
    assert spec["nodeName"] == plugin.node and spec["pool"]["name"] == plugin.node
    assert len(spec["devices"]) == 8
    domains = [d["attributes"]["nvlinkDomain"]["string"] for d in spec["devices"]]
    assert len(set(domains)) == 2
    # Registration reached the kubelet: its registry holds our socket and we answered health.
    assert (KUBELET_ROOT / "plugins_registry" / f"{DRIVER}-reg.sock").exists()
    assert "dra_gpu_published_devices 8.0" in plugin.metrics()


def test_deleted_and_edited_slices_are_restored_within_5s(plugin, dyn):
    api, items = our_slices(dyn)
    name = items[0]["metadata"]["name"]
    api.delete(name=name)
    t0 = time.time()
    wait_for("the slice to come back", lambda: our_slices(dyn)[1], timeout=5)
    restored_after = time.time() - t0
    # An operator drops a device from the slice: the plugin puts it back.
    current = our_slices(dyn)[1][0]
    current["spec"]["devices"] = current["spec"]["devices"][1:]
    api.replace(body=current)
    t0 = time.time()
    wait_for(
        "the edited slice to be restored",
        lambda: len(our_slices(dyn)[1][0]["spec"]["devices"]) == 8,
        timeout=5,
    )
    print(
        f"\n[e2e] slice restored {restored_after:.2f}s after deletion, {time.time() - t0:.2f}s after an edit"
    )


def test_explain_answers_for_the_four_nvlink_example_as_it_is(plugin, target, dyn):
    """`dra-gpu explain` on the example a user applies (a Pod and its ResourceClaimTemplate), the
    devices read from the live cluster as docs/claims-and-examples.md says: one NVLink domain of the node."""
    example = ROOT / "deploy" / "examples" / "four-nvlink-gpus.yaml"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dra_gpu.cli",
            "explain",
            "-f",
            str(example),
            "--kubeconfig",
            target.kubeconfig,
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (entry,) = json.loads(r.stdout)["claims"]
    print(f"\n[e2e] explain {example.name}: {entry['node']} {entry['devices']} link cost {entry['linkCost']}")
    attrs = device_attrs(dyn)
    assert entry["source"] == "Pod/four-nvlink-gpus, claim gpus: ResourceClaimTemplate/four-nvlink-gpus"
    assert len(entry["devices"]) == 4 and len({attrs[d]["nvlinkDomain"] for d in entry["devices"]}) == 1


def test_four_nvlink_gpus_are_injected_into_the_container(plugin, core, dyn, namespace, busybox_image):
    nvlink_template(dyn, namespace)
    claim_pod(
        core,
        namespace,
        "nvlink4",
        {"resource_claim_template_name": "four-nvlink"},
        "ls -l /dev/nvidia*; env | grep -e ^NVIDIA -e ^DRA_GPU; sleep 3600",
        busybox_image,
    )

    def log_when_running():
        if core.read_namespaced_pod("nvlink4", namespace).status.phase != "Running":
            return None
        log = core.read_namespaced_pod_log("nvlink4", namespace)
        return log if "DRA_GPU_VISIBLE_DEVICES=" in log else None

    log = wait_for("the pod to run and print its devices", log_when_running, timeout=120)
    nodes = [line for line in log.splitlines() if line.startswith("c")]
    gpu_nodes = [line for line in nodes if line.split()[-1][len("/dev/nvidia") :].isdigit()]
    assert len(gpu_nodes) == 4, log
    assert all(" 195, " in line for line in gpu_nodes), log  # real char devices, NVIDIA major
    assert any(line.endswith("/dev/nvidiactl") for line in nodes), log
    # NVIDIA's "no devices": an NVIDIA runtime on the node would inject nothing a second time.
    assert "NVIDIA_VISIBLE_DEVICES=void" in log.splitlines(), log
    devices = visible_devices(dyn, log)
    attrs = device_attrs(dyn)
    assert len(devices) == 4 and len({attrs[d]["nvlinkDomain"] for d in devices}) == 1
    assert sorted(allocated(dyn, namespace, "nvlink4")) == sorted(devices)

    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    (claim,) = claims.get(namespace=namespace).to_dict()["items"]
    uid = claim["metadata"]["uid"]
    spec_file = CDI_DIR / f"k8s.{DRIVER}-claim_{uid}.json"
    assert spec_file.exists()
    checkpoint = json.loads((PLUGIN_DIR / "checkpoint.json").read_text())
    assert checkpoint["data"]["claims"][uid]["state"] == "completed"

    core.delete_namespaced_pod("nvlink4", namespace, grace_period_seconds=0)
    # Unprepare removes the spec and the record concurrently (either order is safe): wait for both.
    wait_for(
        "the claim to be unprepared (CDI spec and record removed)",
        lambda: (
            not spec_file.exists()
            and uid not in json.loads((PLUGIN_DIR / "checkpoint.json").read_text())["data"]["claims"]
        ),
        timeout=90,
    )
    # The GPUs go to the next claim.
    claim_pod(
        core,
        namespace,
        "next",
        {"resource_claim_template_name": "four-nvlink"},
        "env | grep ^DRA_GPU_VISIBLE; sleep 3600",
        busybox_image,
    )
    wait_for("the next pod to get GPUs", lambda: allocated(dyn, namespace, "next"), timeout=60)
    core.delete_namespaced_pod("next", namespace, grace_period_seconds=0)


def test_shared_claim_and_plugin_restart(plugin, core, dyn, namespace, busybox_image, wait_pod):
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    claims.create(
        namespace=namespace,
        body={
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "shared"},
            "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER}}]}},
        },
    )
    claim_pod(
        core,
        namespace,
        "first",
        {"resource_claim_name": "shared"},
        "env | grep ^DRA_GPU_VISIBLE",
        busybox_image,
    )
    assert wait_pod(core, namespace, "first", timeout=120) == "Succeeded"
    first = core.read_namespaced_pod_log("first", namespace).strip()
    # Restart the plugin while the claim is prepared: the checkpoint keeps it.
    plugin.stop()
    plugin.start()
    claim_pod(
        core,
        namespace,
        "second",
        {"resource_claim_name": "shared"},
        "env | grep ^DRA_GPU_VISIBLE",
        busybox_image,
    )
    assert wait_pod(core, namespace, "second", timeout=120) == "Succeeded"
    assert core.read_namespaced_pod_log("second", namespace).strip() == first
    uid = claims.get(namespace=namespace, name="shared").to_dict()["metadata"]["uid"]
    spec_file = CDI_DIR / f"k8s.{DRIVER}-claim_{uid}.json"
    for pod in ("first", "second"):
        core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0)
    wait_for("the shared claim to be unprepared", lambda: not spec_file.exists(), timeout=90)


def test_sweeper_unprepares_a_claim_deleted_behind_the_kubelets_back(
    plugin, core, dyn, namespace, busybox_image, wait_pod
):
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    claims.create(
        namespace=namespace,
        body={
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "orphan"},
            "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER}}]}},
        },
    )
    claim_pod(core, namespace, "holder", {"resource_claim_name": "orphan"}, "sleep 3600", busybox_image)
    uid = wait_for(
        "the claim to be allocated and prepared",
        lambda: next(
            (
                c["metadata"]["uid"]
                for c in claims.get(namespace=namespace).to_dict()["items"]
                if (CDI_DIR / f"k8s.{DRIVER}-claim_{c['metadata']['uid']}.json").exists()
            ),
            None,
        ),
        timeout=90,
    )
    spec_file = CDI_DIR / f"k8s.{DRIVER}-claim_{uid}.json"
    # Force the claim away (as a force-deleted namespace would) while the plugin has it prepared.
    claims.patch(
        namespace=namespace,
        name="orphan",
        body={"metadata": {"finalizers": None}},
        content_type="application/merge-patch+json",
    )
    claims.delete(namespace=namespace, name="orphan")
    wait_for("the sweeper to unprepare the vanished claim", lambda: not spec_file.exists(), timeout=30)
    core.delete_namespaced_pod("holder", namespace, grace_period_seconds=0)


def test_one_gpu_claim_sees_its_uuid_and_device_node(plugin, core, dyn, namespace, busybox_image, wait_pod):
    template(dyn, namespace, "one")
    claim_pod(
        core,
        namespace,
        "one",
        {"resource_claim_template_name": "one"},
        "env | grep ^DRA_GPU_VISIBLE; ls /dev/ | grep nvidia",
        busybox_image,
    )
    assert wait_pod(core, namespace, "one", timeout=120) == "Succeeded"
    log = core.read_namespaced_pod_log("one", namespace)
    (device,) = visible_devices(dyn, log)
    attrs = device_attrs(dyn)[device]
    assert f"DRA_GPU_VISIBLE_DEVICES={attrs['uuid']}" in log.splitlines(), log
    assert f"nvidia{attrs['minor']}" in log.split(), log


def test_nvlink_constraint_avoids_the_cross_domain_set(plugin, core, dyn, namespace, busybox_image, wait_pod):
    template(dyn, namespace, "first-two", count=2, selectors=[f"device.attributes['{DRIVER}'].index <= 1"])
    claim_pod(
        core, namespace, "holder", {"resource_claim_template_name": "first-two"}, "sleep 3600", busybox_image
    )
    wait_for(
        "the holder to run",
        lambda: core.read_namespaced_pod("holder", namespace).status.phase == "Running",
        timeout=90,
    )
    attrs = device_attrs(dyn)
    held = allocated(dyn, namespace, "holder")
    assert sorted(attrs[d]["index"] for d in held) == [0, 1]

    nvlink_template(dyn, namespace)
    claim_pod(
        core,
        namespace,
        "nvlink",
        {"resource_claim_template_name": "four-nvlink"},
        "env | grep ^DRA_GPU_VISIBLE",
        busybox_image,
    )
    assert wait_pod(core, namespace, "nvlink", timeout=120) == "Succeeded"
    with_constraint = visible_devices(dyn, core.read_namespaced_pod_log("nvlink", namespace))
    core.delete_namespaced_pod("nvlink", namespace, grace_period_seconds=0)
    wait_for(
        "the nvlink claim to be released", lambda: allocated(dyn, namespace, "nvlink") is None, timeout=60
    )

    template(dyn, namespace, "any-four", count=4)
    claim_pod(
        core,
        namespace,
        "anyfour",
        {"resource_claim_template_name": "any-four"},
        "env | grep ^DRA_GPU_VISIBLE",
        busybox_image,
    )
    assert wait_pod(core, namespace, "anyfour", timeout=120) == "Succeeded"
    without = visible_devices(dyn, core.read_namespaced_pod_log("anyfour", namespace))
    idx_with = sorted(attrs[d]["index"] for d in with_constraint)
    idx_without = sorted(attrs[d]["index"] for d in without)
    cost_with, cost_without = link_cost(dyn, with_constraint), link_cost(dyn, without)
    print(
        f"\n[e2e] GPUs 0,1 held; 4 NVLink-connected -> GPUs {idx_with} link cost {cost_with}; "
        f"without the constraint -> GPUs {idx_without} link cost {cost_without}"
    )
    assert idx_with == [4, 5, 6, 7] and cost_with == 6
    assert cost_without == 18 and not set(idx_without) & {0, 1}
    core.delete_namespaced_pod("holder", namespace, grace_period_seconds=0)


def test_sigkill_restart_keeps_running_pods_and_never_gives_a_device_twice(
    plugin, core, dyn, namespace, busybox_image, wait_pod
):
    template(dyn, namespace, "two", count=2)
    claim_pod(
        core, namespace, "running", {"resource_claim_template_name": "two"}, "sleep 3600", busybox_image
    )
    wait_for(
        "the pod to run",
        lambda: core.read_namespaced_pod("running", namespace).status.phase == "Running",
        timeout=90,
    )
    held = allocated(dyn, namespace, "running")
    plugin.kill()
    plugin.start()
    wait_for("slices back", lambda: our_slices(dyn)[1], timeout=10)
    assert core.read_namespaced_pod("running", namespace).status.phase == "Running"
    template(dyn, namespace, "six", count=6)
    claim_pod(
        core,
        namespace,
        "after",
        {"resource_claim_template_name": "six"},
        "env | grep ^DRA_GPU_VISIBLE",
        busybox_image,
    )
    assert wait_pod(core, namespace, "after", timeout=120) == "Succeeded"
    got = visible_devices(dyn, core.read_namespaced_pod_log("after", namespace))
    assert not set(got) & set(held) and len(got) == 6
    checkpoint = json.loads((PLUGIN_DIR / "checkpoint.json").read_text())
    prepared = [d["deviceName"] for c in checkpoint["data"]["claims"].values() for d in c["devices"]]
    assert len(prepared) == len(set(prepared))
    for pod in ("running", "after"):
        core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0)


def test_bad_opaque_config_fails_prepare_with_the_field_and_writes_nothing(
    plugin, core, dyn, namespace, busybox_image
):
    before = set(CDI_DIR.glob(f"k8s.{DRIVER}-claim_*"))
    template(
        dyn,
        namespace,
        "bad",
        config={
            "apiVersion": "gpu.dra-gpu.io/v1alpha1",
            "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 150}},
        },
    )
    claim_pod(core, namespace, "bad", {"resource_claim_template_name": "bad"}, "true", busybox_image)

    def failed_event():
        events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=bad")
        return next((e.message for e in events.items if e.reason == "FailedPrepareDynamicResources"), None)

    message = wait_for("FailedPrepareDynamicResources", failed_event, timeout=90)
    assert "sharing.mps.defaultActiveThreadPercentage" in message, message
    assert core.read_namespaced_pod("bad", namespace).status.phase == "Pending"
    # Nothing written for the bad claim; an earlier test's pods may still be unprepared meanwhile.
    assert set(CDI_DIR.glob(f"k8s.{DRIVER}-claim_*")) <= before
    core.delete_namespaced_pod("bad", namespace, grace_period_seconds=0)


def test_mig_device_by_profile_on_dgx_a100_mig(plugin, core, dyn, namespace, busybox_image, wait_pod):
    before = our_slices(dyn)[1][0]["spec"]["pool"]["generation"]
    plugin.stop()
    plugin.profile = "dgx-a100-mig"
    try:
        plugin.start()
        wait_for(
            "MIG devices published",
            lambda: any(a.get("type") == "mig" for a in device_attrs(dyn).values()),
            timeout=10,
        )
        # Other devices than before: the pool's generation went up.
        assert our_slices(dyn)[1][0]["spec"]["pool"]["generation"] == before + 1
        template(
            dyn,
            namespace,
            "mig",
            device_class=MIG_CLASS,
            selectors=[f"device.attributes['{DRIVER}'].profile == '3g.40gb'"],
        )
        claim_pod(
            core,
            namespace,
            "mig",
            {"resource_claim_template_name": "mig"},
            "env | grep ^DRA_GPU_VISIBLE; ls -l /dev/nvidia-caps/",
            busybox_image,
        )
        assert wait_pod(core, namespace, "mig", timeout=120) == "Succeeded"
        log = core.read_namespaced_pod_log("mig", namespace)
        (device,) = visible_devices(dyn, log)
        attrs = device_attrs(dyn)[device]
        assert attrs["type"] == "mig" and attrs["profile"] == "3g.40gb"
        assert f"DRA_GPU_VISIBLE_DEVICES={attrs['uuid']}" in log.splitlines(), log
        caps = [line for line in log.splitlines() if "nvidia-cap" in line]
        assert len(caps) == 2 and all(line.startswith("c") for line in caps), log
    finally:
        core.delete_namespaced_pod("mig", namespace, grace_period_seconds=0)
        plugin.stop()
        plugin.profile = PROFILE
        plugin.start()


def test_kubelet_restart_reregisters_and_keeps_claims_prepared(
    plugin, target, core, dyn, namespace, busybox_image, wait_pod
):
    template(dyn, namespace, "one-gpu")
    claim_pod(
        core, namespace, "steady", {"resource_claim_template_name": "one-gpu"}, "sleep 3600", busybox_image
    )
    wait_for(
        "the pod to run",
        lambda: core.read_namespaced_pod("steady", namespace).status.phase == "Running",
        timeout=90,
    )
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    (claim,) = claims.get(namespace=namespace).to_dict()["items"]
    spec_file = CDI_DIR / f"k8s.{DRIVER}-claim_{claim['metadata']['uid']}.json"
    assert spec_file.exists()
    restarts = subprocess.run(
        [sys.executable, str(Path(__file__).parents[1] / "cluster"), "restart-kubelet"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert restarts.returncode == 0, restarts.stdout + restarts.stderr
    # The kubelet wiped the node's slices at start; the plugin put them back and re-registered.
    wait_for("slices back after the kubelet restart", lambda: our_slices(dyn)[1], timeout=10)
    assert spec_file.exists() and plugin.healthy()
    assert core.read_namespaced_pod("steady", namespace).status.phase == "Running"
    claim_pod(
        core,
        namespace,
        "fresh",
        {"resource_claim_template_name": "one-gpu"},
        "env | grep ^DRA_GPU_VISIBLE",
        busybox_image,
    )
    assert wait_pod(core, namespace, "fresh", timeout=120) == "Succeeded"
    fresh = visible_devices(dyn, core.read_namespaced_pod_log("fresh", namespace))
    assert not set(fresh) & set(allocated(dyn, namespace, "steady"))
    core.delete_namespaced_pod("steady", namespace, grace_period_seconds=0)
    wait_for("the steady claim to be unprepared", lambda: not spec_file.exists(), timeout=90)
