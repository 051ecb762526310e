"""The chart's real-node mode in the real cluster: the kubelet-plugin DaemonSet as the chart renders
it for a node with NVIDIA's driver installed (no `simulatedProfile`: no `--profile`, privileged,
`NVIDIA_VISIBLE_DEVICES=void`, the driver root read-only at /driver-root), run from the image of
deploy/Dockerfile, against the host-like driver root of e2e/node/host_like_root.py mounted at the
chart's driver-root path: Debian trixie with NVIDIA's real 550.163.01 user space (libcuda, the MPS
control daemon and server, nvidia-smi, firmware) and its own glibc 2.41, whose libnvidia-ml.so.1
is the simulated NVML (NVIDIA's C interface) reporting 550.163.01 for a profile.

The plugin finds that NVML exactly as on a GPU node, by full path under the driver root. What the
test changes on the rendered DaemonSet, besides what test_deploy_daemonset.py changes (host
network, the apiserver's address):
- the simulated NVML's own knobs, `DRA_GPU_SIM_DEV_DIR` and `DRA_GPU_SIM_PROC_DIR`: where the
  library finds its GPUs' character devices (195:minor, made with mknod by the test), its
  kernel-side state and the MIG capability files (what a real library gets from the kernel);
- the device root: the chart mounts the host's /dev at /dev (the plugin's dev root "/"); here the
  simulated node's dev root (its `dev/` and `proc/devices`) is mounted at its host path and named
  by `DRA_GPU_DEV_ROOT` (the plugin's `--dev-root`), so the CDI specs name device nodes that
  containerd finds on the host. The container's /dev is then the runtime's own: whatever NVIDIA's
  code run by the plugin (the MPS daemon) makes there never reaches the host's /dev.

Two installs, one after the other (the DaemonSet serves the one node): `hgx-2x4` (start-up,
slices, a 4-NVLink-GPU claim, an MPS claim, an injected XID 79), then `dgx-h100-mig` with
`kubeletPlugin.dynamicMig=true` (a MIG instance made at prepare, its capability nodes by number)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import time
import uuid
from pathlib import Path

import pytest
import yaml
from real_userspace import e2e_script
from simnode.inject import inject_xid
from simnode.node import make_kernel_files
from simnode.profiles import load_profile
from simnode.state import read_state
from support import (
    apply_all,
    container_process,
    delete_all,
    exec_in,
    reach_apiserver,
    render,
    wait_for,
    wait_ready_pod,
)
from test_driver_userspace import DEBIAN_IMAGE, glibc_images, gpu_pod  # noqa: F401 - a fixture
from test_kubelet_plugin import (
    CDI_DIR,
    DRIVER,
    MIG_CLASS,
    PLUGIN_DIR,
    allocated,
    device_attrs,
    our_slices,
    template,
)
from test_sharing import mps_config

pytestmark = pytest.mark.e2e

LABEL = "nvidia.com/gpu.present"
HGX, MIG = "hgx-2x4", "dgx-h100-mig"
CONTAINER_DRIVER_ROOT = "/driver-root"  # where the chart mounts nvidiaDriverRoot's parent


def in_container(host_root: Path | str) -> str:
    """Where the plugin's container finds a driver root: the chart mounts its parent at
    CONTAINER_DRIVER_ROOT (the root itself for "/")."""
    name = Path(host_root).name
    return f"{CONTAINER_DRIVER_ROOT}/{name}" if name else CONTAINER_DRIVER_ROOT


NVML_FILE = "usr/lib/x86_64-linux-gnu/nvidia/current/libnvidia-ml.so.550.163.01"
TAINT_KEY = f"{DRIVER}/unhealthy"
CAPS_MAJOR = 508  # nvidia-caps in the simulated node's proc/devices
# A container's view: its GPU nodes, where its loader finds NVIDIA's libcuda.so.1, and that file's
# md5 (compared with Debian's package), the GPUs it was given.
SHOW_GPUS = (
    "ls -l /dev/nvidia[0-9]*; "
    'python3 -c \'import ctypes; ctypes.CDLL("libcuda.so.1"); '
    'p = next(l.split()[-1] for l in open("/proc/self/maps") if "libcuda" in l); '
    'print("libcuda.so.1 resolved to", p)\' ; '
    'md5sum "$(python3 -c \'import ctypes; ctypes.CDLL("libcuda.so.1"); '
    'print(next(l.split()[-1] for l in open("/proc/self/maps") if "libcuda" in l))\')"; '
    "env | grep ^DRA_GPU_VISIBLE_DEVICES=; echo done; sleep 3600"
)


def dpkg_md5(root: Path, package: str, rel: str) -> str:
    """The md5 Debian's package records for a file of the root (dpkg's md5sums)."""
    for line in (root / "var/lib/dpkg/info" / f"{package}.md5sums").read_text().splitlines():
        digest, path = line.split(None, 1)
        if path.strip() == rel:
            return digest
    raise AssertionError(f"{rel} is not a file of {package}")


class RealNode:
    """One install of the chart's real-node DaemonSet over a host-like root of a profile."""

    def __init__(self, profile, root, dev_root, release, namespace, objs, pod):
        self.profile, self.root, self.dev_root = profile, root, dev_root
        self.container_root = in_container(root)  # the root as the plugin's container sees it
        self.release, self.namespace, self.objs, self.pod = release, namespace, objs, pod
        self.ready_s = 0.0

    @property
    def dev_dir(self) -> Path:
        return self.dev_root / "dev"

    def log(self, core) -> str:
        return core.read_namespaced_pod_log(self.pod.metadata.name, self.namespace) or ""


class Installs:
    """At most one install at a time; a test asks for the profile it needs."""

    def __init__(self, image, core, dyn, base: Path, suite: str = "trixie", sets: tuple[str, ...] = ()):
        self.image, self.core, self.dyn, self.base = image, core, dyn, base
        self.suite, self.sets = suite, sets  # the Debian suite of the root; more chart values
        self.node = core.list_node().items[0].metadata.name
        self.current: RealNode | None = None
        self.applied: list[dict] = []
        self.namespace: str | None = None
        self.host_like = e2e_script("host_like_root")

    def get(self, profile: str) -> RealNode:
        if self.current is not None and self.current.profile == profile:
            return self.current
        self.uninstall()
        return self.install(profile)

    def install(self, profile: str, root: Path | None = None, suite: str | None = None) -> RealNode:
        """`root`: the driver root (default: the suite's host-like root); `suite`: whose driver
        version the kernel module is (default: the suite these installs were made for)."""
        from kubernetes import client

        t0 = time.time()
        suite = suite or self.suite
        root = root or self.host_like.host_like_root(profile, suite=suite)
        dev_root = self.base / profile
        # The kernel's side of a loaded driver: nvidiactl, nvidia<minor>, uvm, modeset; proc/devices.
        make_kernel_files(self.host_like.node_profile(profile, suite), dev_root)
        (PLUGIN_DIR / "health-taints.json").unlink(missing_ok=True)  # an earlier install's
        self.namespace = "realnode-" + uuid.uuid4().hex[:6]
        self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=self.namespace)))
        wait_for(
            "the namespace's default service account",
            lambda: any(
                sa.metadata.name == "default"
                for sa in self.core.list_namespaced_service_account(self.namespace).items
            ),
        )
        release = "rn-" + uuid.uuid4().hex[:6]
        sets = [
            *self.image,
            f"kubeletPlugin.nvidiaDriverRoot={root}",
            "controller.enabled=false",
            "kubeletPlugin.health.holdDownSeconds=3600",
            *self.sets,
        ]
        if profile == MIG:
            sets.append("kubeletPlugin.dynamicMig=true")
        objs = render(release, self.namespace, *sets)
        (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
        self.simulate_only_the_kernel(ds, dev_root)
        reach_apiserver(ds, int(os.environ.get("DRA_GPU_E2E_APISERVER_PORT", "6443")))
        self.core.patch_node(self.node, {"metadata": {"labels": {LABEL: "true"}}})
        self.applied = []
        apply_all(self.dyn, objs, self.namespace, self.applied)
        sel = f"app.kubernetes.io/instance={release},app.kubernetes.io/component=kubelet-plugin"
        pod = wait_ready_pod(self.core, self.namespace, sel, 180, "plugin")
        self.current = RealNode(profile, root, dev_root, release, self.namespace, objs, pod)
        self.current.ready_s = time.time() - t0
        return self.current

    @staticmethod
    def simulate_only_the_kernel(ds: dict, dev_root: Path) -> None:
        """The only simulation knobs: the library's device and proc dirs, and the device root."""
        spec = ds["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        env = {e["name"] for e in c["env"]}
        assert "DRA_GPU_PROFILE" not in env and "LD_LIBRARY_PATH" not in env, env  # the real mode
        assert c["securityContext"]["privileged"] is True
        c["env"] += [
            {"name": "DRA_GPU_SIM_DEV_DIR", "value": str(dev_root / "dev")},
            {"name": "DRA_GPU_SIM_PROC_DIR", "value": str(dev_root / "proc")},
            {"name": "DRA_GPU_DEV_ROOT", "value": str(dev_root)},
        ]
        (dev,) = [v for v in spec["volumes"] if v["name"] == "dev"]
        assert dev["hostPath"]["path"] == "/dev"
        dev["hostPath"] = {"path": str(dev_root), "type": "Directory"}
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "dev"]
        assert mount["mountPath"] == "/dev"
        mount["mountPath"] = str(dev_root)

    def uninstall(self) -> None:
        from kubernetes.client.exceptions import ApiException

        if self.current is None:
            return
        ns = self.current.namespace
        # The MPS daemons' pods go when the plugin unprepares their claims (a test's pods and
        # claims may be gone from the API before that): the plugin must still be there to do it.
        wait_for(
            "the MPS daemons' pods to go",
            lambda: (
                not self.core.list_namespaced_pod(
                    ns, label_selector="app.kubernetes.io/component=mps-control-daemon"
                ).items
            ),
            timeout=60,
        )
        delete_all(self.dyn, self.applied, ns)
        wait_for("the plugin pod to go", lambda: not self.core.list_namespaced_pod(ns).items, timeout=90)
        self.core.delete_namespace(ns, grace_period_seconds=0)
        self.core.patch_node(self.node, {"metadata": {"labels": {LABEL: None}}})
        api, items = our_slices(self.dyn)
        for s in items:
            with contextlib.suppress(ApiException):
                api.delete(name=s["metadata"]["name"])
        (PLUGIN_DIR / "health-taints.json").unlink(missing_ok=True)
        self.current = None


@pytest.fixture(scope="module")
def installs(image, glibc_images, core, dyn):  # noqa: F811 - the fixture imported above
    # The simulated dev roots, at host paths outside /tmp (the chart gives the plugin its own /tmp).
    base = Path(os.environ.get("DRA_GPU_E2E_STATE", "/var/lib/dra-gpu-e2e")) / "real-node"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    t0 = time.time()
    inst = Installs(image, core, dyn, base)
    yield inst
    inst.uninstall()
    print(f"\n[real-node] module: {time.time() - t0:.0f} s")
    shutil.rmtree(base, ignore_errors=True)  # the simulated device nodes
    host_dev = sorted(p.name for p in Path("/dev").glob("nvidia*"))
    assert not host_dev, f"NVIDIA device nodes appeared in the host's /dev: {host_dev}"


def finish(core, dyn, namespace):
    """Delete the test's pods and wait for their claims to be unprepared and gone."""
    core.delete_collection_namespaced_pod(namespace, label_selector="!nonexistent", grace_period_seconds=0)
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    wait_for(
        "the test's pods and claims to be gone",
        lambda: (
            not core.list_namespaced_pod(namespace).items
            and not claims.get(namespace=namespace).to_dict()["items"]
        ),
        timeout=90,
        interval=0.5,
    )


def running_log(core, namespace, pod, done="done"):
    def check():
        p = core.read_namespaced_pod(pod, namespace)
        if p.status.phase != "Running":
            return None
        log = core.read_namespaced_pod_log(pod, namespace)
        return log if done in log else None

    return wait_for(f"pod {pod} to run and print what it sees", check, timeout=120, interval=0.5)


def slice_devices(dyn) -> dict[str, dict]:
    _, items = our_slices(dyn)
    return {d["name"]: d for s in items for d in s["spec"].get("devices") or []}


def test_plugin_starts_on_the_real_node_path_and_publishes_550(installs, core, dyn):
    node = installs.get(HGX)
    proc = container_process(node.pod)
    # The image's entrypoint, no simulated-node flag, privileged (all capabilities).
    assert proc["cmdline"][:2] == [b"/opt/dra-gpu/bin/python3", b"/opt/dra-gpu/bin/dra-gpu"], proc
    assert b"--profile" not in proc["cmdline"] and "DRA_GPU_PROFILE" not in proc["environ"], proc
    assert "LD_LIBRARY_PATH" not in proc["environ"], proc["environ"]
    assert proc["environ"]["NVIDIA_DRIVER_ROOT"] == node.container_root
    # NVML is the driver root's own file, loaded by its full path.
    log = node.log(core)
    (line,) = [x for x in log.splitlines() if "NVML loaded library=" in x]
    assert f"library={node.container_root}/{NVML_FILE} " in line, line
    maps = Path(f"/proc/{proc['pid']}/maps").read_text()
    assert f"{node.container_root}/{NVML_FILE}" in maps
    # Its own loader and C library are the image's, none of the driver root's glibc 2.41.
    libc = {x.split()[-1] for x in maps.splitlines() if re.search(r"/libc\.so\.6$", x)}
    assert libc and not any(p.startswith(CONTAINER_DRIVER_ROOT) for p in libc), libc
    assert exec_in(proc["cid"], "sh", "-c", "getconf GNU_LIBC_VERSION") == "glibc 2.36"

    devices = wait_for("the 8 GPUs", lambda: len(slice_devices(dyn)) == 8 and slice_devices(dyn))
    versions = {d["attributes"]["driverVersion"]["version"] for d in devices.values()}
    assert versions == {"550.163.1"}, versions
    cuda = {d["attributes"]["cudaDriverVersion"]["version"] for d in devices.values()}
    print(
        f"\n[real-node] {HGX}: plugin Ready {node.ready_s:.1f} s after install; {line.split('msg=')[-1]}; "
        f"driverVersion {versions}, cudaDriverVersion {cuda}; no LD_LIBRARY_PATH; libc {sorted(libc)}"
    )


def test_four_nvlink_gpus_with_nvidias_libcuda(installs, core, dyn, namespace):
    node = installs.get(HGX)
    template(dyn, namespace, "gpus", count=4, nvlink=True)
    gpu_pod(core, namespace, "four", DEBIAN_IMAGE, SHOW_GPUS)
    try:
        log = running_log(core, namespace, "four")
        print(f"\n[real-node] 4 NVLink GPUs, the container sees:\n{log}")
        devices = allocated(dyn, namespace, "four")
        attrs = device_attrs(dyn)
        assert len(devices) == 4 and len({attrs[d]["nvlinkDomain"] for d in devices}) == 1, devices
        minors = sorted(attrs[d]["minor"] for d in devices)
        nodes = re.findall(r"^c\S+\s+\d+\s+\S+\s+\S+\s+195,\s+(\d+) .* /dev/nvidia(\d+)$", log, re.M)
        assert sorted(int(m) for m, _ in nodes) == minors, log
        assert all(m == n for m, n in nodes), log
        visible = next(x for x in log.splitlines() if x.startswith("DRA_GPU_VISIBLE_DEVICES="))
        assert sorted(visible.split("=", 1)[1].split(",")) == sorted(attrs[d]["uuid"] for d in devices)
        # NVIDIA's libcuda of the driver root, found by the container's own loader under its SONAME.
        m = re.search(r"libcuda\.so\.1 resolved to (\S+)", log)
        assert m and m.group(1).endswith("/libcuda.so.1"), log  # NVIDIA's file at its SONAME
        rel = "usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.550.163.01"
        assert f"{dpkg_md5(node.root, 'libcuda1:amd64', rel)}  {m.group(1)}" in log, log
    finally:
        finish(core, dyn, namespace)


def mps_processes() -> list[int]:
    """Pids (host) of the MPS control daemons the plugin runs for claims (each in its own pod)."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if not (p / "comm").read_text().startswith("nvidia-cuda-mps"):
                continue
            env = (p / "environ").read_bytes()
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # The daemon (-f in its pod, -d as the node's process), not a control client the plugin
        # runs for a moment.
        if (b"-f" in argv or b"-d" in argv) and f"CUDA_MPS_PIPE_DIRECTORY={PLUGIN_DIR}/mps/".encode() in env:
            found.append(int(p.name))
    return found


def test_mps_claim_runs_nvidias_daemon_of_the_driver_root(installs, core, dyn, namespace):
    node = installs.get(HGX)
    before = set(mps_processes())
    template(dyn, namespace, "gpus", count=1, config=mps_config(50))
    gpu_pod(
        core,
        namespace,
        "mps",
        DEBIAN_IMAGE,
        'echo "pipe=$CUDA_MPS_PIPE_DIRECTORY"; echo get_default_active_thread_percentage | '
        "nvidia-cuda-mps-control; "
        # A CUDA client through the daemon (NVIDIA's libcuda): no GPU behind it, so 805
        # (CUDA_ERROR_MPS_CONNECTION_FAILED) once the daemon tried its server.
        'python3 -c \'import ctypes; print("cuInit", ctypes.CDLL("libcuda.so.1").cuInit(0))\'; '
        "echo done; sleep 3600",
    )
    try:
        try:
            log = running_log(core, namespace, "mps")
        except AssertionError:
            events = core.list_namespaced_event(namespace).items
            said = "\n".join(f"{e.reason}: {e.message}" for e in events)
            pytest.fail(f"the MPS pod did not start:\n{said}\nplugin log:\n{node.log(core)[-4000:]}")
        print(f"\n[real-node] MPS container:\n{log}")
        assert "pipe=/tmp/nvidia-mps" in log and "50.0" in log, log
        (pid,) = set(mps_processes()) - before
        environ = dict(
            e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e
        )
        exe = os.readlink(f"/proc/{pid}/exe")
        maps = Path(f"/proc/{pid}/maps").read_text()
        libc = {x.split()[-1] for x in maps.splitlines() if re.search(r"/libc\.so\.6$", x)}
        # NVIDIA's binary of the driver root, run with its libcuda preloaded and the image's glibc.
        assert exe == f"{node.container_root}/usr/bin/nvidia-cuda-mps-control", exe
        real = hashlib.md5(Path(f"/proc/{pid}/exe").read_bytes()).hexdigest()  # dpkg's md5sums
        assert real == dpkg_md5(node.root, "nvidia-cuda-mps", "usr/bin/nvidia-cuda-mps-control")
        assert "LD_LIBRARY_PATH" not in environ, environ
        assert environ["LD_PRELOAD"].startswith(f"{node.container_root}/"), environ
        assert "libcuda.so" in environ["LD_PRELOAD"], environ
        assert libc and not any(p.startswith(CONTAINER_DRIVER_ROOT) for p in libc), libc
        assert "cuInit 805" in log, log
        # Its log is its pod's (the daemon runs in the foreground in a pod of its own).
        (daemon,) = core.list_pod_for_all_namespaces(
            label_selector="app.kubernetes.io/component=mps-control-daemon"
        ).items
        said = core.read_namespaced_pod_log(daemon.metadata.name, daemon.metadata.namespace)
        print(f"[real-node] the daemon's log (tail):\n{said[-1200:]}")
        # It found its server on PATH and started it (the server then finds no GPU).
        assert "Starting new server" in said, said
        print(
            f"[real-node] MPS daemon pid {pid}: {exe}, LD_PRELOAD={environ['LD_PRELOAD']}, "
            f"libc {sorted(libc)}"
        )
    finally:
        finish(core, dyn, namespace)
    wait_for("the daemon to be stopped", lambda: pid not in mps_processes(), timeout=30)


def test_injected_xid_79_taints_the_device_in_the_slice(installs, core, dyn):
    node = installs.get(HGX)
    devices = slice_devices(dyn)
    name = sorted(devices)[-1]
    gpu = devices[name]["attributes"]["uuid"]["string"]
    t0 = time.time()
    inject_xid(node.dev_dir, gpu, 79)
    taints = wait_for(
        "the XID 79 taint in the slice",
        lambda: slice_devices(dyn)[name].get("taints"),
        timeout=30,
        interval=0.2,
    )
    assert [(t["key"], t["value"], t["effect"]) for t in taints] == [(TAINT_KEY, "xid-79", "NoExecute")]
    assert [n for n, d in slice_devices(dyn).items() if d.get("taints")] == [name]
    print(f"\n[real-node] XID 79 on {name} -> taint {TAINT_KEY}=xid-79:NoExecute in {time.time() - t0:.1f} s")


def test_dynamic_mig_instance_and_capability_nodes_by_number(installs, core, dyn, namespace):
    node = installs.get(MIG)
    wait_for("the dynamic MIG placements", lambda: len(slice_devices(dyn)) == 8 * 18, timeout=60)
    selector = f"device.attributes['{DRIVER}'].profile == '3g.40gb'"
    template(dyn, namespace, "mig", device_class=MIG_CLASS, selectors=[selector])
    gpu_pod(
        core,
        namespace,
        "mig",
        DEBIAN_IMAGE,
        "ls -l /dev/nvidia-caps/; env | grep ^DRA_GPU_VISIBLE_DEVICES=; echo done; sleep 3600",
        template="mig",
    )
    try:
        log = running_log(core, namespace, "mig")
        print(f"\n[real-node] {MIG} 3g.40gb, the container sees:\n{log}")
        (device,) = allocated(dyn, namespace, "mig")
        parent = slice_devices(dyn)[device]["attributes"]["parentUUID"]["string"]
        (inst,) = read_state(node.dev_dir, load_profile(MIG)).instances[parent]
        assert inst["profile"] == "3g.40gb" and inst["uuid"], inst
        visible = next(x for x in log.splitlines() if x.startswith("DRA_GPU_VISIBLE_DEVICES="))
        assert visible.split("=", 1)[1] == inst["uuid"], log
        # The claim's spec carries the GI's and CI's capability nodes by number (no host node).
        specs = [p for p in CDI_DIR.glob(f"k8s.{DRIVER}-claim_*") if inst["uuid"] in p.read_text()]
        assert len(specs) == 1, specs
        spec = yaml.safe_load(specs[0].read_text())
        edits = [spec.get("containerEdits") or {}] + [d.get("containerEdits") or {} for d in spec["devices"]]
        nodes = [n for e in edits for n in e.get("deviceNodes") or [] if "nvidia-caps" in n["path"]]
        assert len(nodes) == 2, spec
        for n in nodes:
            assert n["type"] == "c" and n["major"] == CAPS_MAJOR and "hostPath" not in n, n
            assert n["path"] == f"/dev/nvidia-caps/nvidia-cap{n['minor']}", n
        caps = sorted(str(n["minor"]) for n in nodes)
        seen = re.findall(rf"^c\S+\s+\d+\s+\S+\s+\S+\s+{CAPS_MAJOR},\s+(\d+) .* nvidia-cap(\d+)$", log, re.M)
        assert sorted(m for m, _ in seen) == caps and all(m == n for m, n in seen), log
        assert not Path("/dev/nvidia-caps").exists()
        print(f"[real-node] instance {inst['uuid']} on {parent}; capability nodes {caps}")
    finally:
        finish(core, dyn, namespace)
    wait_for("the instance to be destroyed", lambda: not read_state(node.dev_dir).instances.get(parent), 60)
