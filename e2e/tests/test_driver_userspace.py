"""The driver's user space in the container: a pod with a GPU claim gets the node's NVIDIA
libraries, binaries and firmware through its CDI spec, and its own loader resolves them.

The node's driver installation is simulated (e2e/node/simdriver: real ELF libraries with the real
SONAMEs, an `nvidia-smi` linked against libnvidia-ml.so.1 that lists the GPUs whose device nodes
the container has); the images have no NVIDIA files at all (e2e/node/images.py --debian)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import CACHE, ROOT, sim_driver_root, wait_for
from test_kubelet_plugin import (
    CDI_DIR,
    DRIVER,
    PLUGIN_DIR,
    Plugin,
    allocated,
    device_attrs,
    ensure_device_classes,
    our_slices,
    template,
)

pytestmark = pytest.mark.e2e

DEBIAN_IMAGE = os.environ.get("E2E_DEBIAN_IMAGE", "localhost/dra-gpu-e2e/debian:1")
CUDA_STYLE_IMAGE = os.environ.get("E2E_CUDA_STYLE_IMAGE", "localhost/dra-gpu-e2e/cuda-style:1")
# What a user would run: load both libraries by SONAME, say where the loader found libcuda.so.1,
# then list the GPUs with nvidia-smi from PATH.
PROBE = (
    'python3 -c \'import ctypes; ctypes.CDLL("libcuda.so.1"); ctypes.CDLL("libnvidia-ml.so.1"); '
    'print("libcuda.so.1 resolved to", next(l.split()[-1] for l in open("/proc/self/maps") '
    'if "libcuda" in l))\' && echo "nvidia-smi is $(command -v nvidia-smi)" && nvidia-smi -L'
)


@pytest.fixture(scope="module")
def glibc_images(target):
    """The Debian images (plain glibc, and CUDA-style), built from Debian packages and imported."""
    if not target.local:
        return  # on another cluster the images are loaded by whoever runs it (kind load)
    from conftest import _cluster_env

    env = _cluster_env()
    path = {**os.environ, "PATH": env["PATH"].replace("$PATH", os.environ["PATH"])}
    images = [sys.executable, str(ROOT / "e2e" / "node" / "images.py"), str(CACHE / "images"), "--debian"]
    subprocess.run([*images, "--import-to", env["CONTAINERD_ADDRESS"]], env=path, check=True)


@pytest.fixture(scope="module")
def hgx(target, core, dyn, tmp_path_factory):
    if not target.local:
        pytest.skip("the plugin runs as a host process only on the local e2e cluster")
    node = core.list_node().items[0].metadata.name
    p = Plugin(target.kubeconfig, node, tmp_path_factory.mktemp("plugin") / "plugin.log")
    ensure_device_classes(dyn)
    p.start()
    wait_for("the node's 8 GPUs", lambda: len(device_attrs(dyn)) == 8, timeout=30)
    yield p
    p.stop()
    api, items = our_slices(dyn)
    for s in items:
        api.delete(name=s["metadata"]["name"])


def gpu_pod(core, namespace, name, image, command, claim=True, template="gpus", env=None):
    container = {"name": "main", "image": image, "imagePullPolicy": "Never", "command": ["sh", "-c", command]}
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    spec = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0, "containers": [container]}
    if claim:
        spec["resourceClaims"] = [{"name": "gpus", "resourceClaimTemplateName": template}]
        container["resources"] = {"claims": [{"name": "gpus"}]}
    core.create_namespaced_pod(
        namespace, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}
    )


def finished_log(core, namespace, name, wait_pod):
    phase = wait_pod(core, namespace, name, timeout=120)
    return phase, core.read_namespaced_pod_log(name, namespace)


def listed_uuids(log: str) -> list[str]:
    return [line.split("(UUID: ")[1].rstrip(")") for line in log.splitlines() if line.startswith("GPU ")]


def test_plain_glibc_image_loads_the_driver_and_lists_exactly_its_gpus(
    hgx, glibc_images, core, dyn, namespace, wait_pod
):
    template(dyn, namespace, "gpus", count=2)
    gpu_pod(core, namespace, "glibc", DEBIAN_IMAGE, PROBE)
    # Read while the pod lives: its template claim is deallocated once it is done.
    devices = wait_for("the claim's allocation", lambda: allocated(dyn, namespace, "glibc"), timeout=60)
    phase, log = finished_log(core, namespace, "glibc", wait_pod)
    print(f"\n[e2e] plain glibc image:\n{log}")
    assert phase == "Succeeded", log
    # No LD_LIBRARY_PATH, no ld cache update: the SONAME mounted in the default search path.
    assert "libcuda.so.1 resolved to /usr/lib/x86_64-linux-gnu/libcuda.so.1" in log, log
    assert "nvidia-smi is /usr/bin/nvidia-smi" in log, log
    attrs = device_attrs(dyn)
    want = sorted(attrs[d]["uuid"] for d in devices)
    assert sorted(listed_uuids(log)) == want, log


def test_cuda_style_image_finds_them_under_usr_local_nvidia(
    hgx, glibc_images, core, dyn, namespace, wait_pod
):
    template(dyn, namespace, "gpus", count=1)
    gpu_pod(core, namespace, "cuda", CUDA_STYLE_IMAGE, PROBE)
    phase, log = finished_log(core, namespace, "cuda", wait_pod)
    print(f"\n[e2e] CUDA-style image:\n{log}")
    assert phase == "Succeeded", log
    assert "libcuda.so.1 resolved to /usr/local/nvidia/lib64/libcuda.so.1" in log, log
    assert "nvidia-smi is /usr/local/nvidia/bin/nvidia-smi" in log, log
    assert len(listed_uuids(log)) == 1, log


def test_the_same_image_without_a_claim_has_no_driver(hgx, glibc_images, core, namespace, wait_pod):
    gpu_pod(
        core,
        namespace,
        "noclaim",
        DEBIAN_IMAGE,
        "python3 -c 'import ctypes; ctypes.CDLL(\"libcuda.so.1\")' || echo NO-LIBCUDA; "
        "command -v nvidia-smi || echo NO-NVIDIA-SMI",
        claim=False,
    )
    phase, log = finished_log(core, namespace, "noclaim", wait_pod)
    assert phase == "Succeeded", log
    assert "NO-LIBCUDA" in log and "NO-NVIDIA-SMI" in log, log


def failed_prepare(core, namespace, pod, needle):
    """The pod's FailedPrepareDynamicResources event that says `needle` (a plugin just restarted
    may first be reported as not registered yet)."""

    def event():
        events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={pod}")
        return next(
            (
                e.message
                for e in events.items
                if e.reason == "FailedPrepareDynamicResources" and needle in e.message
            ),
            None,
        )

    return wait_for(f"FailedPrepareDynamicResources saying {needle!r}", event, timeout=90)


def our_specs() -> set[Path]:
    return set(CDI_DIR.glob(f"k8s.{DRIVER}-claim_*"))


def test_nvidia_uvm_not_loaded_fails_prepare_naming_the_host_fix_until_it_is(
    hgx, glibc_images, core, dyn, namespace, wait_pod
):
    """No nvidia-uvm in the kernel's device list (the module not loaded, which no container can
    change): prepare fails saying to load it on the host. Once the kernel lists it the same pod
    starts, although the host still has no /dev/nvidia-uvm: the spec carries it by number."""
    root = PLUGIN_DIR / "simulated-root"
    uvm, proc = root / "dev" / "nvidia-uvm", root / "proc" / "devices"
    st, listed = uvm.stat(), proc.read_text()
    before = our_specs()
    uvm.unlink()
    proc.write_text("".join(line for line in listed.splitlines(True) if "nvidia-uvm" not in line))
    try:
        template(dyn, namespace, "gpus", count=1)
        gpu_pod(core, namespace, "nouvm", DEBIAN_IMAGE, "nvidia-smi -L; ls -l /dev/nvidia-uvm")
        message = failed_prepare(core, namespace, "nouvm", "is not loaded")
        print(f"\n[e2e] event: {message}")
        assert "the nvidia-uvm kernel module is not loaded" in message, message
        assert "modprobe nvidia-uvm" in message, message
        assert our_specs() == before  # nothing written
        assert core.read_namespaced_pod("nouvm", namespace).status.phase == "Pending"
    finally:
        proc.write_text(listed)  # the module loaded; its node still missing on the host
    # The kubelet retries; now the same pod starts, its /dev/nvidia-uvm made by the runtime.
    try:
        phase, log = finished_log(core, namespace, "nouvm", wait_pod)
        assert phase == "Succeeded" and len(listed_uuids(log)) == 1, log
        assert re.search(rf"\b{os.major(st.st_rdev)},\s+{os.minor(st.st_rdev)}\b", log), log  # ls -l
    finally:
        if not uvm.exists():
            os.mknod(uvm, st.st_mode, st.st_rdev)


def test_another_drivers_libraries_keep_the_plugin_from_starting_naming_both_versions(hgx, dyn):
    """The libraries of another driver than the loaded kernel module's (upgraded on disk, the old
    module still loaded; or a driver root that is not the loaded driver's): NVML refuses to
    initialise (NVML_ERROR_LIB_RM_VERSION_MISMATCH), so the plugin does not start; its log names
    both versions and what to do, and no spec is written."""
    hgx.stop()
    hgx.driver_version = "550.54.15"  # the libraries; the simulated kernel module is 570.133.20
    before = our_specs()
    try:
        with pytest.raises(AssertionError, match="plugin exited") as refused:
            hgx.start()
        assert hgx.proc is not None and hgx.proc.returncode not in (0, None)
        log = hgx.log_tail(20)
        print(f"\n[e2e] plugin refused to start:\n{log}")
        assert "driver version mismatch" in log and "550.54.15" in log and "570.133.20" in log, log
        assert "reboot" in log and "--driver-root" in log, log
        assert "plugin exited" in str(refused.value)
        assert our_specs() == before
    finally:
        hgx.driver_version = None
        hgx.start()
    wait_for("the node's 8 GPUs again", lambda: len(device_attrs(dyn)) == 8, timeout=30)


def test_libraries_on_disk_of_another_version_than_nvmls_fail_prepare_naming_both_versions(
    hgx, glibc_images, core, dyn, namespace, wait_pod, tmp_path
):
    """NVML works (its library and the kernel module agree), but the driver root's other libraries
    are another driver's (a half-finished upgrade: libcuda.so.570.133.20 replaced by 550.54.15):
    the plugin starts and says so, and prepare fails naming both versions."""
    root = tmp_path / "driver-root"
    shutil.copytree(sim_driver_root(hgx.profile), root, symlinks=True)
    (ours,) = root.glob("usr/lib/*/libcuda.so.570.133.20")
    (other,) = Path(sim_driver_root(hgx.profile, "550.54.15")).glob("usr/lib/*/libcuda.so.550.54.15")
    ours.unlink()
    shutil.copy2(other, ours.parent / other.name)
    (ours.parent / "libcuda.so.1").unlink()
    (ours.parent / "libcuda.so.1").symlink_to(other.name)
    hgx.stop()
    hgx.driver_root = str(root)
    try:
        hgx.start()
        before = our_specs()
        template(dyn, namespace, "gpus", count=1)
        gpu_pod(core, namespace, "mismatch", DEBIAN_IMAGE, "nvidia-smi -L")
        message = failed_prepare(core, namespace, "mismatch", "driver version mismatch")
        print(f"\n[e2e] event: {message}")
        assert "driver version mismatch" in message and "570.133.20" in message and "550.54.15" in message
        assert our_specs() == before
        assert "driver installation unusable" in hgx.log_tail(200)  # said at start, too
    finally:
        core.delete_namespaced_pod("mismatch", namespace, grace_period_seconds=0)
        hgx.stop()
        hgx.driver_root = None
        hgx.start()
