"""Sharing that really shares, in the real cluster: an MPS claim gets a control daemon on the host
(the simulated driver's `nvidia-cuda-mps-control`, a real process speaking the real command
interface on its pipe), up before the container starts, answering the claim's limits inside the
container through the pipe dir the CDI spec mounts; it survives a SIGKILLed plugin and is gone
after the pod."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from simnode.state import read_state
from support import sim_driver_root, wait_for
from test_driver_userspace import DEBIAN_IMAGE, glibc_images, gpu_pod, hgx  # noqa: F401 - fixtures
from test_kubelet_plugin import (
    DRIVER,
    PLUGIN_DIR,
    PROFILE,
    SIM_DEV,
    allocated,
    claim_pod,
    device_attrs,
    our_slices,
    template,
)

pytestmark = pytest.mark.e2e

MPS_ROOT = PLUGIN_DIR / "mps"
EXCLUSIVE_PROCESS, DEFAULT = 3, 0


TIME_SLICED_LONG = {
    "apiVersion": "gpu.dra-gpu.io/v1alpha1",
    "kind": "GpuConfig",
    "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}},
}


def time_sliced_claim(name: str, request: str) -> dict:
    """A ResourceClaim of one whole GPU (request `request`) time-sliced Long."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {
                "requests": [{"name": request, "exactly": {"deviceClassName": DRIVER}}],
                "config": [{"opaque": {"driver": DRIVER, "parameters": TIME_SLICED_LONG}}],
            }
        },
    }


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
    """What the simulated kernel keeps (the plugin set it through NVML)."""
    return read_state(SIM_DEV).compute_modes.get(uuid, DEFAULT)


def pod_log(core, namespace, name) -> str:
    try:
        return core.read_namespaced_pod_log(name, namespace) or ""
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
    # Unprepare stops the daemon first, then restores the compute mode: wait for both.
    wait_for(
        "the daemon to stop and the compute mode to be restored",
        lambda: not alive(pid) and pipe not in daemons() and compute_mode(uuid) == DEFAULT,
        timeout=90,
    )
    print(f"[e2e] MPS daemon {pid} on {device} stopped after the pod; compute mode {compute_mode(uuid)}")
    assert compute_mode(uuid) == DEFAULT
    assert set(daemons()) <= before  # nothing orphaned


def time_slice(uuid: str, profile: str = PROFILE) -> str:
    """What the simulated driver's nvidia-smi says about a GPU's time slice on the host."""
    root = Path(sim_driver_root(profile))
    nvml = next(root.glob("usr/lib/*/libnvidia-ml.so.1"))
    out = subprocess.run(
        [str(root / "usr/bin/nvidia-smi"), "compute-policy", "-l", "-i", uuid],
        env={"DRA_GPU_SIM_DEV_DIR": str(SIM_DEV), "LD_PRELOAD": str(nvml)},  # as the plugin runs it
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
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    claims.create(namespace=namespace, body=time_sliced_claim("sliced", "gpus"))
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


def wait_for_shareable_gpus(dyn) -> None:
    """The plugin publishes its GPUs as memory shares (allowMultipleAllocations)."""

    def shareable() -> bool:
        devices = [d for s in our_slices(dyn)[1] for d in s["spec"]["devices"]]
        return any(d.get("allowMultipleAllocations") for d in devices)

    wait_for("shareable GPUs", shareable, timeout=30)


@pytest.fixture
def shares(hgx, dyn):  # noqa: F811 - the fixture imported above
    """The same plugin restarted on an A100 node (80Gi GPUs) publishing its whole GPUs as memory
    shares (one plugin per node: the fixture switches it and switches it back)."""
    hgx.stop()
    hgx.profile, hgx.extra_args = "dgx-a100-mig", ["--memory-shares"]
    try:
        hgx.start()
        wait_for_shareable_gpus(dyn)
        yield hgx
    finally:
        hgx.stop()
        hgx.profile, hgx.extra_args = PROFILE, []
        hgx.start()


def memory_template(dyn, namespace, name, memory):
    api = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaimTemplate")
    request = {"deviceClassName": DRIVER, "capacity": {"requests": {"memory": memory}}}
    api.create(
        namespace=namespace,
        body={
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpus", "exactly": request}]}}},
        },
    )


def share_of(dyn, namespace, pod):
    """(device, shareID, consumedCapacity) of the claim made for `pod`."""
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    for c in claims.get(namespace=namespace).to_dict()["items"]:
        owners = [o.get("name") for o in c["metadata"].get("ownerReferences") or []]
        alloc = (c.get("status") or {}).get("allocation")
        if pod in owners and alloc:
            (r,) = alloc["devices"]["results"]
            return r["device"], r.get("shareID"), r.get("consumedCapacity")
    return None


SHARE_PROBE = (
    'echo "pipe=$CUDA_MPS_PIPE_DIRECTORY"; '
    'echo "get_default_device_pinned_mem_limit $DRA_GPU_VISIBLE_DEVICES" | nvidia-cuda-mps-control; '
    "echo asked; sleep 3600"
)


def test_memory_shares_pack_two_40gi_claims_on_one_gpu_each_enforced_by_its_own_daemon(
    shares,
    glibc_images,  # noqa: F811 - the fixture imported above
    core,
    dyn,
    namespace,
):
    before = set(daemons())
    for name, memory in (("forty", "40Gi"), ("fortyeight", "48Gi")):
        memory_template(dyn, namespace, name, memory)
    pods = {"a": "forty", "b": "forty", "c": "fortyeight"}
    for pod, tmpl in pods.items():
        gpu_pod(core, namespace, pod, DEBIAN_IMAGE, SHARE_PROBE, template=tmpl)
    logs = {}
    for pod in pods:
        logs[pod] = wait_for(
            f"pod {pod}'s answer",
            lambda pod=pod: "asked" in pod_log(core, namespace, pod) and pod_log(core, namespace, pod),
            timeout=120,
        )
    got = {pod: share_of(dyn, namespace, pod) for pod in pods}
    print(f"\n[e2e] memory shares: {got}")
    for pod, log in logs.items():
        print(f"[e2e] {pod}: {' | '.join(log.splitlines())}")
    (dev_a, share_a, _), (dev_b, share_b, _), (dev_c, _, _) = got["a"], got["b"], got["c"]
    assert dev_a == dev_b and share_a and share_b and share_a != share_b  # one GPU, two shares
    assert dev_c != dev_a  # 48Gi does not fit next to 2 x 40Gi on an 80Gi GPU
    assert "pipe=/tmp/nvidia-mps" in logs["a"]
    assert "40960M" in logs["a"] and "40960M" in logs["b"] and "49152M" in logs["c"]
    assert len(set(daemons()) - before) == 3  # a daemon per share
    for pod in pods:
        core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0)
    wait_for("the shares' daemons to stop", lambda: set(daemons()) <= before, timeout=90)


def test_a_memory_share_no_gpu_can_ever_give_is_denied_by_the_webhook(
    shares, target, dyn, namespace, tmp_path
):
    from test_controller_webhook import Controller, _denied, _webhook_config

    claims_api = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    hooks_api = dyn.resources.get(
        api_version="admissionregistration.k8s.io/v1", kind="ValidatingWebhookConfiguration"
    )
    request = {"deviceClassName": DRIVER, "capacity": {"requests": {"memory": "90Gi"}}}
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "ninety"},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": request}]}},
    }
    ctl = Controller(target.kubeconfig, tmp_path, driver=DRIVER)
    hook = f"dra-gpu-e2e-shares-{namespace}"
    try:
        wait_for("the controller to serve and list the cluster", ctl.ready, timeout=60, interval=0.2)
        hooks_api.create(body=_webhook_config(hook, ctl, namespace))

        def denied():
            try:
                return _denied(claims_api.create, body=body, namespace=namespace)
            except AssertionError:  # admitted: the apiserver has not picked the webhook up yet
                claims_api.delete(name="ninety", namespace=namespace)
                return None

        msg = wait_for("the webhook to deny 90Gi", denied, timeout=30, interval=0.5)
        print(f"\n[e2e] 90Gi share: {msg}")
        assert "no GPU can ever give memory 90Gi" in msg, msg
    finally:
        try:
            hooks_api.delete(name=hook)
        except Exception as exc:
            if getattr(exc, "status", None) != 404:
                raise
        ctl.stop()
