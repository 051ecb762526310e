"""Sharing that really shares, in the real cluster: an MPS claim gets a control daemon on the host
(the simulated driver's `nvidia-cuda-mps-control`, a real process speaking the real command
interface on its pipe), up before the container starts, answering the claim's limits inside the
container through the pipe dir the CDI spec mounts; it survives a SIGKILLed plugin and is gone
after the pod."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from support import sim_driver_root, wait_for
from test_driver_userspace import DEBIAN_IMAGE, glibc_images, gpu_pod, hgx  # noqa: F401 - fixtures
from test_kubelet_plugin import DRIVER, PLUGIN_DIR, PROFILE, allocated, claim_pod, device_attrs, template

pytestmark = pytest.mark.e2e

MPS_ROOT = PLUGIN_DIR / "mps"
COMPUTE_MODES = PLUGIN_DIR / "simulated-root" / "nvidia-state.json"
SIM_DEV = PLUGIN_DIR / "simulated-root" / "dev"
EXCLUSIVE_PROCESS, DEFAULT = 3, 0


def mps_config(pct: int) -> dict:
    return {
        "apiVersion": "gpu.dra-gpu.io/v1alpha1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": pct}},
    }


def ask(pipe_dir: Path, *commands: str) -> list[str]:
    """Ask a daemon through its pipe, as a client on the host would."""
    binary = Path(sim_driver_root(PROFILE)) / "usr" / "bin" / "nvidia-cuda-mps-control"
    out = subprocess.run(
        [str(binary)],
        input="".join(f"{c}\n" for c in commands),
        env={"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)},
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    return out.stdout.splitlines()


def daemons() -> dict[Path, int]:
    """Pipe dir -> pid of every daemon the plugin has on the host."""
    return {
        p.parent: int(p.read_text())
        for p in MPS_ROOT.glob("*/pipe/nvidia-cuda-mps-control.pid")
        if p.read_text().strip()
    }


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def compute_mode(uuid: str) -> int:
    if not COMPUTE_MODES.exists():
        return DEFAULT
    return int(json.loads(COMPUTE_MODES.read_text())["computeModes"].get(uuid, DEFAULT))


def pod_log(core, namespace, name) -> str:
    try:
        return core.read_namespaced_pod_log(name, namespace)
    except Exception:
        return ""


def test_mps_daemon_answers_the_claims_limits_survives_a_sigkilled_plugin_and_is_stopped(
    hgx,  # noqa: F811 - the fixture imported above
    glibc_images,  # noqa: F811
    core,
    dyn,
    namespace,
):
    before = set(daemons())
    template(dyn, namespace, "gpus", count=1, config=mps_config(50))
    # The container asks the daemon first thing: it answers only if it was up before the start.
    gpu_pod(
        core,
        namespace,
        "mps",
        DEBIAN_IMAGE,
        'echo "pipe=$CUDA_MPS_PIPE_DIRECTORY"; echo get_default_active_thread_percentage | '
        "nvidia-cuda-mps-control; echo asked; sleep 3600",
    )
    log = wait_for(
        "the container's answer",
        lambda: "asked" in pod_log(core, namespace, "mps") and pod_log(core, namespace, "mps"),
        timeout=120,
    )
    print(f"\n[e2e] MPS container:\n{log}")
    assert "pipe=/tmp/nvidia-mps" in log and "50.0" in log, log
    (device,) = allocated(dyn, namespace, "mps")
    uuid = device_attrs(dyn)[device]["uuid"]
    (pipe, pid), *_ = [(p, pid) for p, pid in daemons().items() if p not in before]
    assert alive(pid) and ask(pipe, "get_default_active_thread_percentage") == ["50.0"]
    assert compute_mode(uuid) == EXCLUSIVE_PROCESS

    hgx.kill()  # SIGKILL: the daemon is detached from the plugin and keeps serving
    assert alive(pid) and ask(pipe, "get_default_active_thread_percentage") == ["50.0"]
    hgx.start()
    assert "re-adopted" in hgx.log_tail(200)
    assert daemons().get(pipe) == pid and alive(pid)  # the same daemon, not a new one

    core.delete_namespaced_pod("mps", namespace, grace_period_seconds=0)
    wait_for("the daemon to stop", lambda: not alive(pid) and pipe not in daemons(), timeout=90)
    print(f"[e2e] MPS daemon {pid} on {device} stopped after the pod; compute mode {compute_mode(uuid)}")
    assert compute_mode(uuid) == DEFAULT
    assert set(daemons()) <= before  # nothing orphaned


def time_slice(uuid: str) -> str:
    """What the simulated driver's nvidia-smi says about a GPU's time slice on the host."""
    root = Path(sim_driver_root(PROFILE))
    libdir = next(p.parent for p in root.glob("usr/lib/*/libnvidia-ml.so.1"))
    out = subprocess.run(
        [str(root / "usr/bin/nvidia-smi"), "compute-policy", "-l", "-i", uuid],
        env={"DRA_GPU_SIM_DEV_DIR": str(SIM_DEV), "LD_LIBRARY_PATH": str(libdir)},
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )
    return out.stdout.strip()


def test_time_slicing_long_on_a_gpu_shared_by_two_pods_is_set_while_they_run_and_restored(
    hgx,  # noqa: F811 - the fixture imported above
    core,
    dyn,
    namespace,
    busybox_image,
):
    params = {
        "apiVersion": "gpu.dra-gpu.io/v1alpha1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}},
    }
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    claims.create(
        namespace=namespace,
        body={
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "sliced"},
            "spec": {
                "devices": {
                    "requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER}}],
                    "config": [{"opaque": {"driver": DRIVER, "parameters": params}}],
                }
            },
        },
    )
    for pod in ("one", "two"):
        claim_pod(core, namespace, pod, {"resource_claim_name": "sliced"}, "sleep 3600", busybox_image)
    for pod in ("one", "two"):
        wait_for(
            f"pod {pod} to run",
            lambda pod=pod: core.read_namespaced_pod(pod, namespace).status.phase == "Running",
            timeout=120,
        )
    claim = claims.get(namespace=namespace, name="sliced").to_dict()
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    uuid = device_attrs(dyn)[result["device"]]["uuid"]
    running = time_slice(uuid)
    print(f"\n[e2e] while both pods run: {running}; compute mode {compute_mode(uuid)}")
    assert "Timeslice 3 (LONG)" in running and compute_mode(uuid) == DEFAULT
    for pod in ("one", "two"):
        core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0)
    wait_for("the time slice to be restored", lambda: "Timeslice 0 (DEFAULT)" in time_slice(uuid), timeout=90)
    print(f"[e2e] after the pods: {time_slice(uuid)}")
