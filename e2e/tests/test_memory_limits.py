"""Memory shares held to their size by the driver (issue 26 item 2), with NVIDIA's real
`apply-cuda-memory-limits` hook (nvidia-cdi-hook v1.20.2, e2e/node/build.sh toolkit) and the simulated
driver of an A100 node at 580 (which has NVML 13's per-cgroup limits) or 570 (which has not).

The hook needs cgroup v2. On a node whose kubelet and containerd run cgroup v1 with the unified
hierarchy beside it (this project's CI machines), the plugin runs in a mount namespace of its own
where that hierarchy is /sys/fs/cgroup, so that it decides as on a cgroup v2 node and writes the
hook into the share's CDI device; containerd's runc then runs NVIDIA's hook, which refuses
("only supported in cgroup v2"): that proves the spec's hook reaches the runtime and the hook takes
its arguments and environment. The same spec is then run by runc on cgroup v2 (cgroup2_runc.py):
the simulated driver holds the container's cgroup to the share's size while it runs, and the limit
is gone with the cgroup. On a cgroup v2 node the pod itself runs and is checked the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException
from real_userspace import install_cdi_hook
from simnode.state import read_state
from support import CACHE, ROOT, own_mount_view, wait_for
from test_driver_userspace import DEBIAN_IMAGE, glibc_images, gpu_pod, hgx  # noqa: F401 - fixtures
from test_kubelet_plugin import CDI_DIR, DRIVER, PROFILE, SIM_DEV, our_slices
from test_sharing import memory_template, pod_log, wait_for_shareable_gpus

from dra_gpu.plugin.memory_limits import cgroup_v2

pytestmark = pytest.mark.e2e

CGROUP = Path("/sys/fs/cgroup")
UNIFIED = CGROUP / "unified"  # systemd's place for the v2 hierarchy on a hybrid (v1) node
SHARE = 40 << 30
NOT_V2 = "setting GPU memory limits is only supported in cgroup v2"  # NVIDIA's hook, on cgroup v1
# A mount namespace whose /sys/fs/cgroup is the unified hierarchy: that mount private to it, every
# other mount still shared with the node's (the plugin's MPS tmpfs mounts reach containerd).
V2_VIEW = own_mount_view(f'mount --make-private {CGROUP} && mount --bind {UNIFIED} {CGROUP} && exec "$@"')
BASE_PROFILE = "dgx-a100-mig"


def node_cgroups() -> str:
    if cgroup_v2(CGROUP):
        return "v2"
    if cgroup_v2(UNIFIED):
        return "hybrid"
    return "v1"


def profile_at(version: str, where: Path) -> str:
    """The A100 node's profile with another driver (libraries and kernel module alike)."""
    text = (ROOT / "sim" / "simnode" / "profiles" / f"{BASE_PROFILE}.yaml").read_text()
    path = where / f"{BASE_PROFILE}-{version}.yaml"
    path.write_text(re.sub(r"(?m)^driverVersion: .*$", f"driverVersion: {version}", text))
    return str(path)


@pytest.fixture
def limits_plugin(hgx, dyn, request, tmp_path):  # noqa: F811 - the fixture imported above
    """The plugin restarted on an A100 node of driver `request.param`, publishing memory shares,
    with NVIDIA's hook program, seeing cgroup v2 (switched back to the module's plugin after)."""
    cgroups = node_cgroups()
    if cgroups == "v1":
        pytest.skip("the node has no cgroup v2 hierarchy: NVIDIA's hook cannot set a limit on it")
    hook = install_cdi_hook()
    hgx.stop()
    hgx.profile = profile_at(request.param, tmp_path)
    hgx.extra_args = ["--memory-shares", "--cdi-hook-path", str(hook)]
    hgx.wrapper = V2_VIEW if cgroups == "hybrid" else []
    try:
        hgx.start()
        wait_for_shareable_gpus(dyn)
        yield hgx, hook, cgroups
    finally:
        # Its claims unprepared by it (the test's namespace is gone by now), not left to a plugin
        # of other GPUs.
        with contextlib.suppress(AssertionError):
            wait_for("claims unprepared", lambda: not list(CDI_DIR.glob(f"k8s.{DRIVER}-claim_*")), timeout=90)
        hgx.stop()
        hgx.profile, hgx.extra_args, hgx.wrapper = PROFILE, [], []
        hgx.start()


def claim_of(dyn, namespace, pod) -> dict | None:
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    for c in claims.get(namespace=namespace).to_dict()["items"]:
        owners = [o.get("name") for o in c["metadata"].get("ownerReferences") or []]
        if pod in owners and (c.get("status") or {}).get("allocation"):
            return c
    return None


def memory_condition(dyn, namespace, pod) -> dict | None:
    """The share's MemoryLimitEnforced condition in its claim's status, once written."""
    claim = claim_of(dyn, namespace, pod) or {}
    for d in (claim.get("status") or {}).get("devices") or []:
        for c in d.get("conditions") or []:
            if c["type"] == "MemoryLimitEnforced":
                return c
    return None


def share_device(claim: dict) -> tuple[Path, str, dict]:
    """(the claim's CDI spec file, its share's CDI device name, that device's edits)."""
    uid = claim["metadata"]["uid"]
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    name = f"{uid}-{result['device']}-{result['shareID']}"
    path = CDI_DIR / f"k8s.{DRIVER}-claim_{uid}.json"
    spec = wait_for(f"the CDI spec of claim {uid}", lambda: path.is_file() and json.loads(path.read_text()))
    (edits,) = [d["containerEdits"] for d in spec["devices"] if d["name"] == name]
    return path, name, edits


def gpu_uuid(dyn, device: str) -> str:
    for s in our_slices(dyn)[1]:
        for d in s["spec"]["devices"]:
            if d["name"] == device:
                return d["attributes"]["uuid"]["string"]
    raise AssertionError(f"device {device} is not published")


def start_error(core, namespace, pod) -> str:
    """What the runtime answered the start of the pod's container (waiting or terminated)."""
    statuses = core.read_namespaced_pod(pod, namespace).status.container_statuses or []
    states = [st for s in statuses for st in (s.state, s.last_state) if st is not None]
    found = [x.message or "" for st in states for x in (st.waiting, st.terminated) if x is not None]
    return " ".join(found)


def cgroup_of_process_with(marker: str) -> str | None:
    """The cgroup (v2 path under /sys/fs/cgroup) of the host process whose environment has `marker`."""
    for p in Path("/proc").iterdir():
        try:
            if marker.encode() in (p / "environ").read_bytes().split(b"\0"):
                for line in (p / "cgroup").read_text().splitlines():
                    if line.startswith("0::"):
                        return str(CGROUP) + line[3:]
        except OSError:
            continue
    return None


def unprepared(core, namespace: str, pod: str, spec: Path) -> None:
    """The pod deleted and its claim unprepared by this plugin (its spec gone), before the fixture
    switches the plugin back to another node's GPUs."""
    with contextlib.suppress(ApiException):
        core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0)
    wait_for(f"claim spec {spec.name} removed (unprepared)", lambda: not spec.exists(), timeout=90)


def run_on_cgroup_v2(spec: Path, device: str, tmp_path: Path) -> dict:
    """The device run by runc on cgroup v2 (cgroup2_runc.py) in a namespace of its own."""
    work = tmp_path / f"runc-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    script = str(ROOT / "e2e" / "tests" / "cgroup2_runc.py")
    image = str(CACHE / "images" / "debian.tar")
    cmd = [*V2_VIEW, sys.executable, script, str(spec), device, image, str(SIM_DEV), str(work)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout))


@pytest.mark.parametrize("limits_plugin", ["580.95.05"], indirect=True)
def test_a_share_is_held_to_its_size_by_the_driver_for_its_containers_cgroup(
    limits_plugin,
    glibc_images,  # noqa: F811 - the fixture imported above
    core,
    dyn,
    namespace,
    tmp_path,
):
    plugin, hook, cgroups = limits_plugin
    assert "memory shares enforced_by=driver" in plugin.log_tail()
    memory_template(dyn, namespace, "forty", "40Gi")
    marker = uuid.uuid4().hex
    # The tenant asks for more in its own environment: the share's CDI device replaces it.
    env = {"DRA_GPU_E2E_MARKER": marker, "NVIDIA_GPU_MEMORY_LIMIT": "999999"}
    gpu_pod(core, namespace, "a", DEBIAN_IMAGE, "exec sleep 3600", template="forty", env=env)
    claim = wait_for("the pod's claim", lambda: claim_of(dyn, namespace, "a"), timeout=60)
    spec_path, device, edits = share_device(claim)
    try:
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        gpu = gpu_uuid(dyn, result["device"])
        env = dict(e.split("=", 1) for e in edits["env"])
        assert env["NVIDIA_GPU_MEMORY_LIMIT"] == env["NVIDIA_GPU_MEMORY_REQUEST"] == str(SHARE >> 20)
        (limit_hook,) = [h for h in edits["hooks"] if "apply-cuda-memory-limits" in h["args"]]
        assert limit_hook["hookName"] == "createRuntime" and limit_hook["path"] == str(hook)
        assert limit_hook["args"][-2:] == ["--gpu-id", gpu]
        condition = wait_for("the share's memory condition", lambda: memory_condition(dyn, namespace, "a"))
        assert (condition["status"], condition["reason"]) == ("True", "DriverMemoryLimit")
        print(f"\n[e2e] node cgroups: {cgroups}; share hook: {limit_hook['args']}")

        if cgroups == "v2":
            found = lambda: cgroup_of_process_with(f"DRA_GPU_E2E_MARKER={marker}")  # noqa: E731
            path = wait_for("the pod's container", found, timeout=120)
            held = read_state(SIM_DEV).memory_limits
            assert held.get(gpu, {}).get(path) == (SHARE, SHARE), held
            unprepared(core, namespace, "a", spec_path)
            wait_for("the limit to go", lambda: path not in read_state(SIM_DEV).memory_limits.get(gpu, {}))
            return

        # cgroup v1 for containerd: NVIDIA's hook ran from the spec, and refused.
        refused = lambda: NOT_V2 in (m := start_error(core, namespace, "a")) and m  # noqa: E731
        message = wait_for("NVIDIA's hook to run", refused, timeout=120)
        print(f"[e2e] containerd on cgroup v1: {message[-300:]}")
        core.delete_namespaced_pod("a", namespace, grace_period_seconds=0)
        ran = run_on_cgroup_v2(spec_path, device, tmp_path)
        print(f"[e2e] the same spec on cgroup v2: rc={ran['rc']} during={ran['during']} after={ran['after']}")
        assert ran["rc"] == 0, ran["output"]
        assert ran["during"] == {gpu: {ran["cgroup"]: [SHARE, SHARE]}}
        assert ran["after"] == {}
    finally:
        unprepared(core, namespace, "a", spec_path)


@pytest.mark.parametrize("limits_plugin", ["570.124.06"], indirect=True)
def test_a_driver_without_cgroup_limits_leaves_the_share_cooperative_and_says_so(
    limits_plugin,
    glibc_images,  # noqa: F811 - the fixture imported above
    core,
    dyn,
    namespace,
):
    plugin, _, _ = limits_plugin
    assert "memory shares enforced_by=cooperative" in plugin.log_tail()
    memory_template(dyn, namespace, "forty", "40Gi")
    # A tenant's own value for a variable the share's CDI device sets is replaced (the mechanism
    # that keeps NVIDIA_GPU_MEMORY_LIMIT the share's where the driver holds it).
    command = 'echo "pipe=$CUDA_MPS_PIPE_DIRECTORY"; sleep 3600'
    env = {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/tenant-chose-this"}
    gpu_pod(core, namespace, "a", DEBIAN_IMAGE, command, template="forty", env=env)
    claim = wait_for("the pod's claim", lambda: claim_of(dyn, namespace, "a"), timeout=60)
    spec_path, _, edits = share_device(claim)
    try:
        assert "hooks" not in edits
        condition = wait_for("the share's memory condition", lambda: memory_condition(dyn, namespace, "a"))
        print(f"\n[e2e] 570: {condition['reason']}: {condition['message']}")
        assert (condition["status"], condition["reason"]) == ("False", "CooperativeMpsLimit")
        assert "driver 570.124.06 has no per-cgroup memory limits" in condition["message"]
        logged = wait_for(
            "the pod's output", lambda: "pipe=" in (log := pod_log(core, namespace, "a")) and log
        )
        assert "pipe=/tmp/nvidia-mps" in logged, logged
    finally:
        unprepared(core, namespace, "a", spec_path)
