"""Helpers shared by the e2e scenario files, and the chart-install helpers of the files that run
the plugin from the image (test_deploy_daemonset.py, test_real_node.py)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "dra-gpu"
CLUSTER = ROOT / "e2e" / "cluster"


def cluster(*args: str, timeout: float = 240) -> str:
    """Run `e2e/cluster ARGS` (the harness: stop, start or restart a part of the local cluster); its
    output. Fails the test when the command fails."""
    r = subprocess.run([sys.executable, str(CLUSTER), *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"e2e/cluster {' '.join(args)}:\n{r.stdout}{r.stderr}"
    return r.stdout + r.stderr


def own_mount_view(script: str) -> list[str]:
    """A command prefix that runs a program in a mount namespace of its own, made by the shell
    `script` first (which ends in `exec "$@"`): every mount keeps the host's propagation (the
    plugin's MPS tmpfs mounts reach containerd) unless the script makes one private."""
    return ["unshare", "--mount", "--propagation", "unchanged", "sh", "-c", script, "sh"]


def wait_for(what, check, timeout=30.0, interval=0.1):
    """Poll `check` until it returns something truthy (returned); fail after `timeout` seconds."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def never(what: str, check: Callable[[], object], window: float, interval: float = 0.1) -> None:
    """Poll `check` for the whole `window` seconds (and once more at its end); fail at the first
    truthy result, naming `what` and when it happened. For a negative no event settles: the
    caller says in a comment which latency the window covers."""
    start = time.monotonic()
    deadline = start + window
    while True:
        got = check()
        if got:
            took = time.monotonic() - start
            raise AssertionError(f"{what} after {took:.1f}s of a {window:.1f}s window: {got!r}")
        now = time.monotonic()
        if now >= deadline:
            return
        time.sleep(min(interval, deadline - now))


@functools.cache
def helm_binary() -> str:
    """$DRA_GPU_HELM, or the pinned Helm that deploy/build-helm.sh builds (and caches)."""
    if os.environ.get("DRA_GPU_HELM"):
        return os.environ["DRA_GPU_HELM"]
    r = subprocess.run(["bash", str(ROOT / "deploy" / "build-helm.sh")], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail("deploy/build-helm.sh failed:\n" + r.stderr[-3000:])
    return r.stdout.strip().splitlines()[-1]


CACHE = Path(os.environ.get("DRA_GPU_CACHE", Path.home() / ".cache" / "dra-gpu"))


@functools.cache
def sim_driver_root(profile: str, version: str | None = None) -> str:
    """The simulated NVIDIA driver installation of a profile's node (e2e/node/simdriver, cached):
    real ELF libraries, nvidia-smi and firmware of the profile's driver version (or `version`)."""
    cmd = [sys.executable, str(ROOT / "e2e" / "node" / "simdriver" / "build.py"), "--profile", profile]
    cmd += ["--cache", str(CACHE)] + (["--version", version] if version else [])
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        pytest.fail(f"e2e/node/simdriver/build.py failed:\n{r.stderr[-3000:]}")
    return r.stdout.strip().splitlines()[-1]


KLOG_TIME = "%m%d %H:%M:%S"
DRA_WORDS = ("DRA", "dra-", "Regist", "WatchResources", "health", "prepare")


def kubelet_excerpt(log: Path, start: float, stop: float, limit: int = 60, width: int = 360) -> str:
    """The kubelet's DRA lines and its warnings and errors between two times (the last `limit`),
    for a failed test's report: a failure in the cluster is then readable from CI's output."""
    if not log.is_file():
        return ""
    lo = time.strftime(KLOG_TIME, time.localtime(start - 2))
    hi = time.strftime(KLOG_TIME, time.localtime(stop + 1))
    picked: list[str] = []
    with log.open(errors="replace") as f:
        for line in f:
            # klog: "E1201 21:32:04.418100 ..."; the severity letter, then month, day and time.
            when = line[1:14]
            if len(line) < 15 or line[0] not in "IWE" or not lo <= when <= hi:
                continue
            if line[0] != "I" or any(w in line for w in DRA_WORDS):
                picked.append(line.rstrip("\n")[:width])
    return "\n".join(picked[-limit:])


def dra_gpu_image(target, image: str = "dra-gpu") -> tuple[str, ...]:
    """An image built (or found cached) by e2e/node/image_build.sh and imported into the local cluster's
    containerd: `dra-gpu`, the driver's (the `image` fixture of conftest.py), whose rootfs and
    Python distributions are checked to hold nothing of the simulator, or `dra-gpu-simnode`, the
    driver's plus the simulator (`simnode_image`, for the chart's simulatedProfile). Returns the
    `--set` values that make the chart use it."""
    if not target.local:
        pytest.skip("the image is imported into the local e2e cluster's containerd")
    t0 = time.time()
    r = subprocess.run(
        ["bash", str(ROOT / "e2e" / "node" / "image_build.sh")], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.fail(f"e2e/node/image_build.sh failed:\n{r.stderr[-4000:]}")
    sys.path.insert(0, str(ROOT / "e2e"))
    from harness.components import CACHE, import_dra_gpu_image

    name = import_dra_gpu_image(image)
    assert name, f"e2e/node/image_build.sh wrote no {image} image archive"
    with open(os.path.join(CACHE, "images", f"{image}.json")) as f:
        meta = json.load(f)
    if image == "dra-gpu":
        # The driver's image carries no simulator: not its package, not its C sources.
        assert meta["simulator_files"] == 0, meta
        assert not [p for p in meta["packages"] if p.startswith("dra-gpu-simnode")], meta["packages"]
        print(
            f"\n[image] {name}: rootfs {meta['rootfs_bytes'] / 1e6:.0f} MB, archive "
            f"{meta['archive_bytes'] / 1e6:.0f} MB, {len(meta['packages'])} Python distributions, "
            f"no simulator; build + import {time.time() - t0:.1f} s"
        )
    else:
        print(f"\n[image] {name}: profiles {meta['profiles']}; build + import {time.time() - t0:.1f} s")
    repository, tag = name.rsplit(":", 1)
    return (f"image.repository={repository}", f"image.tag={tag}", "image.pullPolicy=Never")


def reach_apiserver(workload, apiserver_port):
    """Host network and the apiserver's address: the e2e cluster has no kube-proxy."""
    spec = workload["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert "command" not in c, "the image's entrypoint runs"
    c.setdefault("env", [])
    c["env"] += [
        {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
        {"name": "KUBERNETES_SERVICE_PORT", "value": str(apiserver_port)},
    ]
    spec["hostNetwork"] = True


def apiserver_port() -> int:
    return int(os.environ.get("DRA_GPU_E2E_APISERVER_PORT", "6443"))


def simulated_node_chart(prefix: str, namespace: str, simnode_image, profile: str = "hgx-2x4"):
    """The chart rendered for a simulated node of `profile` (the simulator's image, no controller)
    as release `<prefix>-<random>`: (release, its objects, the kubelet plugin's DaemonSet)."""
    release = f"{prefix}-{uuid.uuid4().hex[:6]}"
    objs = render(
        release,
        namespace,
        *simnode_image,
        f"simulatedProfile={profile}",
        f"kubeletPlugin.nvidiaDriverRoot={sim_driver_root(profile)}",
        "controller.enabled=false",
    )
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
    return release, objs, ds


def render(release, namespace, *sets):
    cmd = [helm_binary(), "template", release, str(CHART), "-n", namespace, "--kube-version", "1.37.2"]
    cmd += ["--set", "image.registry=registry.example.com/gpu"]  # the chart has none; sets below win
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return [o for o in yaml.safe_load_all(out) if o]


def container_process(pod):
    """What runs in the pod's container, seen from the host: its pid, user, effective
    capabilities, root mount options and command line (containerd's task of the container)."""
    from harness.processes import ctr

    cid = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    tasks = ctr("-n", "k8s.io", "tasks", "ls").stdout.splitlines()[1:]
    (pid,) = [int(t.split()[1]) for t in tasks if t.split()[0] == cid]
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    root = next(
        line.split()
        for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        if line.split()[4] == "/"
    )
    return {
        "cid": cid,
        "uid": int(status["Uid"].split()[1]),
        "cap_eff": int(status["CapEff"].strip(), 16),
        "root_options": root[5].split(","),
        "cmdline": Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1],
        "environ": dict(
            e.decode().split("=", 1)
            for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if b"=" in e
        ),
        "pid": pid,
    }


def exec_in(cid, *argv):
    """Run a command in a running container (containerd's exec, as the container's user)."""
    from harness.processes import ctr

    r = ctr("-n", "k8s.io", "tasks", "exec", "--exec-id", "e2e-" + uuid.uuid4().hex[:6], cid, *argv)
    return r.stdout.strip()


def assert_runs_the_image(proc, cid):
    """The image's own interpreter and package: its entrypoint's venv, nothing from the host."""
    assert proc["cmdline"][:2] == [b"/opt/dra-gpu/bin/python3", b"/opt/dra-gpu/bin/dra-gpu"], proc
    assert "ro" in proc["root_options"], proc  # readOnlyRootFilesystem
    assert exec_in(cid, "dra-gpu", "--version") == "dra-gpu 0.1.0"
    where = exec_in(cid, "python3", "-c", "import dra_gpu, sys; print(dra_gpu.__file__, sys.prefix)")
    assert where == "/opt/dra-gpu/lib/python3.11/site-packages/dra_gpu/__init__.py /opt/dra-gpu", where


def api_for(dyn, o):
    return dyn.resources.get(api_version=o["apiVersion"], kind=o["kind"])


def apply_all(dyn, objs, namespace, applied):
    """Server-side apply each rendered object, recording it in `applied` for delete_all."""
    for o in objs:
        api = api_for(dyn, o)
        api.server_side_apply(
            body=o,
            namespace=namespace if api.namespaced else None,
            field_manager="dra-gpu-e2e",
            force_conflicts=True,
        )
        applied.append(o)


def delete_all(dyn, applied, namespace):
    from kubernetes.client.exceptions import ApiException

    for o in reversed(applied):
        api = api_for(dyn, o)
        with contextlib.suppress(ApiException):
            api.delete(name=o["metadata"]["name"], namespace=namespace if api.namespaced else None)


def wait_ready_pod(core, namespace, selector, timeout, what):
    """The first pod matching `selector` once Ready; fails with its status, log tail and events."""
    from kubernetes.client.exceptions import ApiException

    deadline, pod = time.time() + timeout, None
    while time.time() < deadline:
        pods = core.list_namespaced_pod(namespace, label_selector=selector).items
        pod = pods[0] if pods else None
        if pod and any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or []):
            return pod
        time.sleep(1)
    log = ""
    if pod:
        try:
            log = core.read_namespaced_pod_log(pod.metadata.name, namespace, tail_lines=40)
        except ApiException as exc:
            log = str(exc)
    events = core.list_namespaced_event(namespace).items
    pytest.fail(
        f"{what} pod not Ready: {pod.status if pod else None}\nlog:\n{log}\nevents:\n"
        + "\n".join(f"{e.reason}: {e.message}" for e in events)
    )
