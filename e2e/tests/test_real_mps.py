"""NVIDIA's real MPS control daemon, both Debian versions (535.261.03 from bookworm, 550.163.01 from
trixie), run by the chart's real-node DaemonSet over the host-like root of each (test_real_node.py's
install: the plugin in a container with its own /dev, each daemon in a pod of its own; NVIDIA's
daemon never runs in the host's mount namespace).

For an MPS claim the plugin creates the daemon's pod (hostPID, its own cgroup, made from the
plugin's pod) running the root's `nvidia-cuda-mps-control -f` with only the root's libcuda
preloaded and the root's MPS binaries on PATH; the daemon lives on its own tmpfs under the plugin's
directory (the chart's mps.shmSize, 64Mi here), with its own /dev/shm that the claim's containers
share; the container's pipe directory is read-only and holds only the `control` socket; the limits
the claim set are what the daemon answers; the daemon is found without its pid file (535 writes
none); it outlives the plugin killed, OOM-killed and rolled out (the same process, a tenant's
client connected throughout; on 550); a non-root tenant's server runs; after the pod nothing is left: no
process, no pod, no mount, no directory."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from support import container_process, exec_in, wait_for, wait_ready_pod
from test_driver_userspace import DEBIAN_IMAGE, glibc_images, gpu_pod  # noqa: F401 - a fixture
from test_kubelet_plugin import DRIVER, PLUGIN_DIR, template
from test_real_node import HGX, Installs, finish, running_log

pytestmark = pytest.mark.e2e

MPS_ROOT = PLUGIN_DIR / "mps"
PID_FILE = "nvidia-cuda-mps-control.pid"
SUITES = {"bookworm": "535.261.03", "trixie": "550.163.01"}
LIBCUDA = "usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.1"  # in the driver root
SWEEP_S = 2  # the chart's kubeletPlugin.sweepInterval here: the plugin checks the limits this often
TMPFS_KIB = 64 << 10  # the install's kubeletPlugin.mps.shmSize
DAEMON_PODS = "app.kubernetes.io/component=mps-control-daemon"


def mps_config(pct: int, memory: str | None = None) -> dict:
    mps: dict = {"defaultActiveThreadPercentage": pct}
    if memory:
        mps["defaultPinnedDeviceMemoryLimit"] = memory
    return {
        "apiVersion": f"{DRIVER}/v1alpha1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mps": mps},
    }


class RealMps:
    """One install of the real-node plugin over the host-like root of one Debian suite."""

    def __init__(self, installs: Installs, suite: str, core):
        self.installs, self.suite, self.core = installs, suite, core
        self.node = installs.get(HGX)

    @property
    def version(self) -> str:
        return SUITES[self.suite]

    def plugin_pod(self):
        sel = f"app.kubernetes.io/instance={self.node.release},app.kubernetes.io/component=kubelet-plugin"
        return wait_ready_pod(self.core, self.node.namespace, sel, 180, "plugin")

    def plugin_log(self) -> str:
        pod = self.plugin_pod()
        return self.core.read_namespaced_pod_log(pod.metadata.name, self.node.namespace) or ""

    def ask(self, daemon_id: str, *commands: str) -> list[str]:
        """What the daemon answers the plugin (as root, from the plugin's container: NVIDIA's
        client never runs on the host)."""
        cid = container_process(self.plugin_pod())["cid"]
        script = (
            f"printf '%s\\n' {' '.join(repr(c) for c in commands)} | "
            f"env CUDA_MPS_PIPE_DIRECTORY={MPS_ROOT}/{daemon_id}/pipe "
            f"LD_PRELOAD={self.node.container_root}/{LIBCUDA} "
            f"{self.node.container_root}/usr/bin/nvidia-cuda-mps-control"
        )
        return exec_in(cid, "sh", "-c", script).splitlines()


@pytest.fixture(scope="module", params=sorted(SUITES))
def real_mps(request, image, glibc_images, core, dyn):  # noqa: F811 - the fixture imported above
    base = Path(os.environ.get("DRA_GPU_E2E_STATE", "/var/lib/dra-gpu-e2e")) / "real-mps"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    t0 = time.time()
    installs = Installs(
        image,
        core,
        dyn,
        base,
        suite=request.param,
        sets=(f"kubeletPlugin.sweepInterval={SWEEP_S}", "kubeletPlugin.mps.shmSize=64Mi"),
    )
    try:
        yield RealMps(installs, request.param, core)
        # The last test's claims are gone from the API before the kubelet's unprepare has ended.
        wait_for("the last claims unprepared", lambda: not mps_mounts() and not daemons(), timeout=60)
    finally:
        installs.uninstall()
        print(f"\n[real-mps] {request.param}: {time.time() - t0:.0f} s")
        shutil.rmtree(base, ignore_errors=True)
    host_dev = sorted(p.name for p in Path("/dev").glob("nvidia*"))
    assert not host_dev, f"NVIDIA device nodes appeared in the host's /dev: {host_dev}"
    assert not daemons(), f"MPS daemons left: {daemons()}"
    assert not mps_mounts(), f"MPS mounts left: {mps_mounts()}"


def daemon_pods(core) -> list:
    return core.list_pod_for_all_namespaces(label_selector=DAEMON_PODS).items


def daemons() -> dict[str, int]:
    """Daemon id -> host pid of every MPS control daemon (`-f` in its pod, `-d` as a process of
    the node) of the plugin, from /proc."""
    found = {}
    prefix = f"CUDA_MPS_PIPE_DIRECTORY={MPS_ROOT}/".encode()
    for p in Path("/proc").iterdir():
        try:
            if not p.name.isdigit() or not (p / "comm").read_text().startswith("nvidia-cuda-mps"):
                continue
            env = (p / "environ").read_bytes().split(b"\0")
            argv = (p / "cmdline").read_bytes().split(b"\0")
            if (p / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
        except OSError:
            continue
        pipe = next((e[len(prefix) :] for e in env if e.startswith(prefix)), None)
        if pipe and (b"-f" in argv or b"-d" in argv):
            found[pipe.decode().split("/")[0]] = int(p.name)
    return found


def mps_processes() -> list[int]:
    """Every process (daemon or server) whose pipe directory is under the plugin's MPS root."""
    prefix = f"CUDA_MPS_PIPE_DIRECTORY={MPS_ROOT}/".encode()
    found = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and any(
                e.startswith(prefix) for e in (p / "environ").read_bytes().split(b"\0")
            ):
                found.append(int(p.name))
        except OSError:
            continue
    return found


def mps_mounts() -> list[str]:
    """The host's mounts under the plugin's MPS root (`<mount point> <type> <options>`)."""
    return [
        " ".join(line.split()[1:4])
        for line in Path("/proc/self/mounts").read_text().splitlines()
        if line.split()[1].startswith(f"{MPS_ROOT}/")
    ]


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


PROBE = (
    "echo pipe=$(ls -A /tmp/nvidia-mps | tr '\\n' ' '); "
    "echo get_default_active_thread_percentage | nvidia-cuda-mps-control; "
    'python3 -c \'import ctypes; print("cuInit", ctypes.CDLL("libcuda.so.1").cuInit(0))\'; '
    "echo from-the-pod > /dev/shm/probe; echo done; sleep 3600"
)


def new_daemon(before: dict[str, int]) -> tuple[str, int]:
    fresh = wait_for("the claim's daemon", lambda: {k: v for k, v in daemons().items() if k not in before})
    ((daemon_id, pid),) = fresh.items()
    return daemon_id, pid


def daemon_pod_of(core, daemon_id: str):
    (pod,) = [p for p in daemon_pods(core) if p.metadata.labels.get("dra-gpu.io/mps-daemon") == daemon_id]
    return pod


def cgroup(pid: int) -> str:
    return Path(f"/proc/{pid}/cgroup").read_text().strip()


def in_pod_cgroup(pid: int, pod_uid: str) -> bool:
    """Whether the process is in the pod's cgroup (cgroupfs: pod<uid>; systemd: pod<uid_>.slice)."""
    text = cgroup(pid)
    return f"pod{pod_uid}" in text or f"pod{pod_uid.replace('-', '_')}" in text


def test_real_daemon_runs_in_its_own_pod_with_its_limits_its_shm_and_leaves_nothing(
    real_mps, core, dyn, namespace
):
    before = daemons()
    template(dyn, namespace, "gpus", config=mps_config(25, "10Gi"))
    gpu_pod(core, namespace, "mps", DEBIAN_IMAGE, PROBE)
    try:
        log = running_log(core, namespace, "mps")
        print(f"\n[real-mps] {real_mps.version}: the container:\n{log}")
        daemon_id, pid = new_daemon(before)
        top = MPS_ROOT / daemon_id
        # The container: a read-only view holding the control socket only, its limit, a CUDA client
        # (NVIDIA's libcuda) reaching the daemon (805: its server then finds no GPU; 100 without MPS).
        assert "pipe=control" in log.splitlines(), log
        assert "25.0" in log and "cuInit 805" in log, log
        # A pod of its own, as operators see it: on the node, in the host's PID namespace, in its
        # own cgroup (not the plugin's), made from the plugin's image.
        pod = daemon_pod_of(core, daemon_id)
        plugin = real_mps.plugin_pod()
        assert pod.metadata.name.endswith(f"-mps-{daemon_id}") and pod.status.phase == "Running"
        assert pod.metadata.namespace == plugin.metadata.namespace and pod.spec.host_pid is True
        assert pod.spec.node_name == plugin.spec.node_name
        assert pod.spec.containers[0].image == plugin.spec.containers[0].image
        assert [(o.kind, o.controller) for o in pod.metadata.owner_references] == [("Node", True)]
        assert in_pod_cgroup(pid, pod.metadata.uid), cgroup(pid)
        assert not in_pod_cgroup(pid, plugin.metadata.uid), cgroup(pid)
        # NVIDIA's binary of the driver root, only libcuda preloaded, its server's directory on PATH.
        env = environ(pid)
        root = real_mps.node.container_root
        assert os.readlink(f"/proc/{pid}/exe") == f"{root}/usr/bin/nvidia-cuda-mps-control"
        assert "LD_LIBRARY_PATH" not in env and "libcuda.so" in env["LD_PRELOAD"], env
        path = env["PATH"].split(":")
        assert path[0] == f"{root}/usr/bin" and f"{root}/usr/sbin" in path, path
        # Its log is the pod's (the daemon runs in the foreground).
        daemon_log = core.read_namespaced_pod_log(pod.metadata.name, pod.metadata.namespace)
        assert "Starting new server" in daemon_log, daemon_log[-2000:]
        # Its own tmpfs (the chart's size); one /dev/shm for the daemon and the pod.
        (mount,) = [m for m in mps_mounts() if m.startswith(f"{top} ")]
        assert mount.split()[1] == "tmpfs" and f"size={TMPFS_KIB}k" in mount, mount
        assert (top / "shm" / "probe").read_text() == "from-the-pod\n"
        assert Path(f"/proc/{pid}/root/dev/shm/probe").read_text() == "from-the-pod\n"  # the daemon's view
        # 550 writes a pid file, 535 none: the plugin found the daemon either way (it never reads it).
        has_pid_file = (top / "pipe" / PID_FILE).exists()
        assert has_pid_file == (real_mps.suite == "trixie"), sorted(os.listdir(top / "pipe"))
        assert f"MPS daemon ready id={daemon_id} pod={pod.metadata.name}" in real_mps.plugin_log()
        # The limits in the daemon's own words, read back by root through its privileged socket.
        answers = real_mps.ask(daemon_id, "get_default_active_thread_percentage")
        assert answers == ["25.0"], answers
        print(
            f"[real-mps] {real_mps.version}: daemon pod {pod.metadata.name}, pid {pid} "
            f"({'with' if has_pid_file else 'no'} pid file), {mount}; "
            f"pipe dir {sorted(os.listdir(top / 'pipe'))}; answers {answers}"
        )
    finally:
        t0 = time.time()
        finish(core, dyn, namespace)
    wait_for(
        "no process, pod, mount or directory of the daemon",
        lambda: (
            not mps_processes()
            and not daemon_pods(core)
            and not mps_mounts()
            and not (MPS_ROOT / daemon_id).exists()
        ),
        timeout=30,
    )
    print(f"[real-mps] {real_mps.version}: unprepared and cleaned in {time.time() - t0:.1f} s")


# No CUDA client can stay connected here: its server needs a GPU (cuInit answers 805 when the server
# finds none). Nor can a control client: NVIDIA's daemon serves one such client at a time, and one
# that holds its connection leaves the next unanswered (measured), the plugin's checks included.
# So "the same daemon" is what the tenant keeps: the same process in the same pod, never restarted,
# answering the claim's limits to every new client of the tenant.


def squeeze_memory(pid: int) -> None:
    """Make the kernel OOM-kill the process's container: its memory limit set under what it uses
    (cgroup v2), or a little over it (v1 refuses a limit it cannot reclaim down to; the plugin's
    next allocation, its sweep every SWEEP_S, goes over)."""
    lines = cgroup(pid).splitlines()
    v1 = [line.split(":", 2)[2] for line in lines if line.split(":", 2)[1].split(",").count("memory")]
    if not v1:
        path = Path("/sys/fs/cgroup" + lines[0].split("::", 1)[1])
        (path / "memory.max").write_text(str(16 << 20))
        return
    path = Path("/sys/fs/cgroup/memory" + v1[0])
    used = int((path / "memory.usage_in_bytes").read_text())
    for extra in range(0, 64 << 20, 1 << 20):
        try:
            (path / "memory.limit_in_bytes").write_text(str(used + extra))
            return
        except OSError:  # EBUSY: cannot reclaim down to it
            continue
    raise AssertionError(f"no memory limit close to {used} bytes accepted for pid {pid}")


def plugin_container(real_mps):
    pod = real_mps.plugin_pod()
    (status,) = pod.status.container_statuses
    return pod, status


def wait_plugin_back(real_mps, uid: str, restarts: int):
    """The plugin's pod `uid` Ready again after its container restarted `restarts` times."""

    def back():
        pod, status = plugin_container(real_mps)
        return (
            status if pod.metadata.uid == uid and status.restart_count >= restarts and status.ready else None
        )

    return wait_for("the plugin back", back, timeout=120, interval=0.5)


# On 550 only: what outlives the plugin is the daemon's pod (Kubernetes' doing, the same for both
# versions) and its re-adoption asks what both answer alike (the other tests run both); the second
# version's 45 s bought back the gate's minutes for the reboot and upgrade scenarios.
@pytest.mark.parametrize("real_mps", ["trixie"], indirect=True)
def test_the_daemon_outlives_the_plugin_killed_oom_killed_and_rolled_out(real_mps, core, dyn, namespace):
    from kubernetes import client

    before = daemons()
    template(dyn, namespace, "gpus", config=mps_config(40))
    gpu_pod(core, namespace, "mps", DEBIAN_IMAGE, "echo done; sleep 3600")
    try:
        running_log(core, namespace, "mps")
        daemon_id, pid = new_daemon(before)
        daemon = daemon_pod_of(core, daemon_id)
        tenant = container_process(core.read_namespaced_pod("mps", namespace))["cid"]
        ask = "echo get_default_active_thread_percentage | nvidia-cuda-mps-control"
        seen = []

        def unchanged(event: str, t0: float) -> None:
            if daemons().get(daemon_id) != pid:
                print(real_mps.plugin_log()[-6000:])
            assert daemons().get(daemon_id) == pid, f"{event}: the daemon is not the same process"
            now = daemon_pod_of(core, daemon_id)
            assert now.metadata.uid == daemon.metadata.uid and now.status.phase == "Running", event
            assert now.status.container_statuses[0].restart_count == 0, event
            assert exec_in(tenant, "sh", "-c", ask) == "40.0", event  # a new client, same limits
            seen.append(f"{event} {time.time() - t0:.1f} s")

        # 1. The plugin's process SIGKILLed: its container restarts in the same pod.
        pod, status = plugin_container(real_mps)
        t0 = time.time()
        os.kill(container_process(pod)["pid"], 9)  # SIGKILL
        wait_plugin_back(real_mps, pod.metadata.uid, status.restart_count + 1)
        unchanged("killed", t0)
        # 2. OOM-killed by the kernel: its container's memory.max set under what it uses.
        pod, status = plugin_container(real_mps)
        t0 = time.time()
        squeeze_memory(container_process(pod)["pid"])
        back = wait_plugin_back(real_mps, pod.metadata.uid, status.restart_count + 1)
        assert back.last_state.terminated.reason == "OOMKilled", back.last_state
        unchanged("OOM-killed", t0)
        # 3. A rollout: a new pod of the DaemonSet replaces the old one (one at a time: this
        # cluster's plugin pods use the host's network, where two cannot bind one port).
        ds_name = real_mps.plugin_pod().metadata.owner_references[0].name
        apps = client.AppsV1Api(core.api_client)
        t0 = time.time()
        apps.patch_namespaced_daemon_set(
            ds_name,
            real_mps.node.namespace,
            {
                "spec": {
                    "updateStrategy": {"rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
                    "template": {"metadata": {"annotations": {"e2e/rollout": str(t0)}}},
                }
            },
        )
        old = pod.metadata.uid

        def rolled():
            pods = core.list_namespaced_pod(
                real_mps.node.namespace, label_selector="app.kubernetes.io/component=kubelet-plugin"
            ).items
            ready = [
                p
                for p in pods
                if p.metadata.uid != old
                and p.status.container_statuses
                and p.status.container_statuses[0].ready
            ]
            return ready if ready and all(p.metadata.uid != old for p in pods) else None

        wait_for("the rolled-out plugin", rolled, timeout=180, interval=0.5)
        unchanged("rolled out", t0)
        assert "MPS daemons of a prepared claim re-adopted" in real_mps.plugin_log()
        daemon_log = core.read_namespaced_pod_log(daemon.metadata.name, daemon.metadata.namespace)
        assert daemon_log.count("Starting control daemon") == 1, daemon_log  # started once
        print(
            f"\n[real-mps] {real_mps.version}: daemon {daemon.metadata.name} pid {pid} through: "
            f"{'; '.join(seen)}; clients served in its log: {daemon_log.count('NEW UI')}"
        )
    finally:
        finish(core, dyn, namespace)
    wait_for("nothing of the daemon", lambda: not mps_processes() and not mps_mounts(), timeout=30)


def test_a_non_root_pods_server_runs(real_mps, core, dyn, namespace):
    """NVIDIA's daemon starts each client's server as the client's user: a pod with runAsNonRoot
    gets one (with root-only pipe and log directories its server exits at once, again and again)."""
    before = daemons()
    template(dyn, namespace, "gpus", config=mps_config(50))
    container = {
        "name": "main",
        "image": DEBIAN_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", PROBE],
        "securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True},
        "resources": {"claims": [{"name": "gpus"}]},
    }
    spec = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 0,
        "containers": [container],
        "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "gpus"}],
    }
    core.create_namespaced_pod(
        namespace, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "mps"}, "spec": spec}
    )
    try:
        log = running_log(core, namespace, "mps")
        daemon_id, _ = new_daemon(before)
        assert "cuInit 805" in log, log  # NVIDIA's libcuda reached the daemon as uid 1000
        pod = daemon_pod_of(core, daemon_id)
        daemon_log = core.read_namespaced_pod_log(pod.metadata.name, pod.metadata.namespace)
        server = [line for line in daemon_log.splitlines() if "Other" in line or "for user" in line]
        print(f"\n[real-mps] {real_mps.version}: a uid-1000 client: {log!r}; the daemon: {server[:6]}")
        assert any("Starting new server" in line and "for user 1000" in line for line in server), daemon_log
        assert any("Initializing server process" in line for line in server), daemon_log
    finally:
        finish(core, dyn, namespace)


def test_a_drained_node_keeps_no_daemon_spec_or_checkpoint_entry(real_mps, core, dyn, namespace):
    """`kubectl drain` as an operator runs it: the claims' pods and the MPS daemon's pod are evicted
    (the daemon's pod without --force: its controller is the Node), the plugin's stays, and nothing
    of the claims is left on the node."""
    import json

    from harness.processes import kubectl

    before = daemons()
    template(dyn, namespace, "gpus", config=mps_config(30))
    template(dyn, namespace, "whole")
    gpu_pod(core, namespace, "mps", DEBIAN_IMAGE, PROBE)
    gpu_pod(core, namespace, "whole", DEBIAN_IMAGE, "echo done; sleep 3600", template="whole")
    node = real_mps.plugin_pod().spec.node_name
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    try:
        running_log(core, namespace, "mps")
        running_log(core, namespace, "whole")
        daemon_id, _ = new_daemon(before)
        uids = [c["metadata"]["uid"] for c in claims.get(namespace=namespace).to_dict()["items"]]
        specs = [Path(f"/var/run/cdi/k8s.{DRIVER}-claim_{uid}.json") for uid in uids]
        assert len(uids) == 2 and all(s.exists() for s in specs), specs
        t0 = time.time()
        # --force for the test's bare pods (a workload's have a controller); the daemon's pod needs
        # none: drain names it neither among those nor as an error.
        drained = kubectl(
            "drain",
            node,
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--force",
            "--timeout=120s",
            check=False,
        )
        took = time.time() - t0
        assert drained.returncode == 0, drained.stdout + drained.stderr
        unmanaged = [line for line in drained.stderr.splitlines() if "declare no controller" in line]
        assert unmanaged and daemon_id not in " ".join(unmanaged), drained.stderr
        assert f"pod/{daemon_pod_name(real_mps, daemon_id)}" in drained.stdout, drained.stdout
        wait_for(
            "nothing of the claims on the node",
            lambda: (
                not daemon_pods(core)
                and not mps_processes()
                and not mps_mounts()
                and not (MPS_ROOT / daemon_id).exists()
                and not any(s.exists() for s in specs)
                and not json.loads((PLUGIN_DIR / "checkpoint.json").read_text())["data"]["claims"]
            ),
            timeout=60,
        )
        plugin = real_mps.plugin_pod()  # the DaemonSet's pod stays (--ignore-daemonsets)
        assert plugin.status.container_statuses[0].ready
        print(
            f"\n[real-mps] {real_mps.version}: drained in {took:.1f} s; evicted: "
            f"{[line for line in drained.stdout.splitlines() if 'evicted' in line]}; "
            "no daemon pod, process, mount, directory, CDI spec or checkpoint entry left"
        )
    finally:
        kubectl("uncordon", node, check=False)
        finish(core, dyn, namespace)


def daemon_pod_name(real_mps, daemon_id: str) -> str:
    return f"{real_mps.plugin_pod().metadata.owner_references[0].name}-mps-{daemon_id}"
