"""NVIDIA's real MPS control daemon, both Debian versions (535.261.03 from bookworm, 550.163.01 from
trixie), run by the chart's real-node DaemonSet over the host-like root of each (test_real_node.py's
install: the plugin, and the daemons it starts, in a container with its own /dev; NVIDIA's daemon
never runs in the host's mount namespace).

For an MPS claim the plugin starts the root's `nvidia-cuda-mps-control -d` with only the root's
libcuda preloaded and the root's MPS binaries on PATH; the daemon lives on its own 64 MiB tmpfs
under the plugin's directory, with its own /dev/shm that the claim's containers share; the
container's pipe directory is read-only and holds only the `control` socket; the limits the claim
set are what the daemon answers; the daemon is found without its pid file (535 writes none), is
started again in place when the plugin's pod is replaced, and after the pod nothing is left: no
process, no mount, no directory."""

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
TMPFS_KIB = 64 << 10


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
        image, core, dyn, base, suite=request.param, sets=(f"kubeletPlugin.sweepInterval={SWEEP_S}",)
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


def daemons() -> dict[str, int]:
    """Daemon id -> host pid of every MPS control daemon (`-d`) of the plugin, from /proc."""
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
        if pipe and b"-d" in argv:
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


def test_real_daemon_runs_with_its_limits_its_shm_and_leaves_nothing(real_mps, core, dyn, namespace):
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
        # NVIDIA's binary of the driver root, only libcuda preloaded, its server's directory on PATH.
        env = environ(pid)
        root = real_mps.node.container_root
        assert os.readlink(f"/proc/{pid}/exe") == f"{root}/usr/bin/nvidia-cuda-mps-control"
        assert "LD_LIBRARY_PATH" not in env and "libcuda.so" in env["LD_PRELOAD"], env
        path = env["PATH"].split(":")
        assert path[0] == f"{root}/usr/bin" and f"{root}/usr/sbin" in path, path
        control_log = (top / "log" / "control.log").read_text(errors="replace")
        assert "Starting new server" in control_log, control_log[-2000:]
        # Its own tmpfs; one /dev/shm for the daemon and the pod.
        (mount,) = [m for m in mps_mounts() if m.startswith(f"{top} ")]
        assert mount.split()[1] == "tmpfs" and f"size={TMPFS_KIB}k" in mount, mount
        assert (top / "shm" / "probe").read_text() == "from-the-pod\n"
        assert Path(f"/proc/{pid}/root/dev/shm/probe").read_text() == "from-the-pod\n"  # the daemon's view
        # 550 writes a pid file, 535 none: the plugin found the daemon either way (it never reads it).
        has_pid_file = (top / "pipe" / PID_FILE).exists()
        assert has_pid_file == (real_mps.suite == "trixie"), sorted(os.listdir(top / "pipe"))
        assert f"MPS daemon ready id={daemon_id} pid=" in real_mps.plugin_log()
        # The limits in the daemon's own words, read back by root through its privileged socket.
        answers = real_mps.ask(daemon_id, "get_default_active_thread_percentage")
        assert answers == ["25.0"], answers
        print(
            f"[real-mps] {real_mps.version}: daemon pid {pid} ({'with' if has_pid_file else 'no'} pid file), "
            f"{mount}; pipe dir {sorted(os.listdir(top / 'pipe'))}; answers {answers}"
        )
    finally:
        t0 = time.time()
        finish(core, dyn, namespace)
    wait_for(
        "no process, mount or directory of the daemon",
        lambda: not mps_processes() and not mps_mounts() and not (MPS_ROOT / daemon_id).exists(),
        timeout=30,
    )
    print(f"[real-mps] {real_mps.version}: unprepared and cleaned in {time.time() - t0:.1f} s")


def test_the_daemon_is_back_in_place_after_the_plugin_pod_is_replaced(real_mps, core, dyn, namespace):
    before = daemons()
    template(dyn, namespace, "gpus", config=mps_config(40))
    gpu_pod(core, namespace, "mps", DEBIAN_IMAGE, PROBE)
    try:
        running_log(core, namespace, "mps")
        daemon_id, pid = new_daemon(before)
        tenant = container_process(core.read_namespaced_pod("mps", namespace))["cid"]
        old = real_mps.plugin_pod()
        t0 = time.time()
        core.delete_namespaced_pod(old.metadata.name, real_mps.node.namespace, grace_period_seconds=0)
        wait_for(
            "a new plugin pod",
            lambda: real_mps.plugin_pod().metadata.uid != old.metadata.uid,
            timeout=120,
            interval=0.5,
        )
        # The daemon died with the old pod's processes; the new plugin starts it again in the same
        # directory (the running container's bind mounts), once.
        new_pid = wait_for("the daemon again", lambda: daemons().get(daemon_id), timeout=60)
        took = time.time() - t0
        assert len([d for d in daemons() if d == daemon_id]) == 1
        asked = exec_in(
            tenant, "sh", "-c", "echo get_default_active_thread_percentage | nvidia-cuda-mps-control"
        )
        assert asked == "40.0", asked
        assert exec_in(tenant, "ls", "-A", "/tmp/nvidia-mps") == "control"
        print(
            f"\n[real-mps] {real_mps.version}: plugin pod replaced; daemon {pid} -> {new_pid} "
            f"in {took:.1f} s, the running container asks it: {asked}"
        )
    finally:
        finish(core, dyn, namespace)
    wait_for("nothing of the daemon", lambda: not mps_processes() and not mps_mounts(), timeout=30)
