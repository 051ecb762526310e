"""NVIDIA's real user space in the pods, for both Debian driver versions (issue 25 items 2 and 3).

The node's driver root is a root of e2e/node/debian_driver_root.py: NVIDIA's real files as Debian's
packages install them (bookworm 535.261.03, trixie 550.163.01). The kubelet plugin runs as a host
process in real-node mode over it, seeing the simulated NVML over NVIDIA's in its own mount
namespace only (real_userspace.py says why and how); the pods get NVIDIA's real files through
their CDI specs: the real libcuda.so.1 and libnvidia-ml.so.1 load and answer as NVIDIA's do on a
node whose kernel module is absent, the real nvidia-smi runs and prints NVIDIA's own message. The
same images without a claim have none of it.

NVIDIA's CDI hooks for real: nvidia-cdi-hook v1.20.2 (e2e/node/build.sh toolkit) installed on the node
and given to the plugin (--cdi-hook-path); runc runs the hooks the specs then carry. The files in
the layout of NVIDIA's `.run` installer on a RHEL-like host (usr/lib64), which a Debian image's
loader does not search: with the hook path set, update-ldcache puts them in its ld cache and
libcuda.so.1 loads; without it, the loader does not find it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import time
from pathlib import Path

import pytest
from real_userspace import (
    DEBIAN_LIB_DIR,
    PROFILE,
    RUN_LIB_DIR,
    STATE,
    RealUserspacePlugin,
    dpkg_md5,
    e2e_script,
    install_cdi_hook,
    md5,
    run_layout_root,
    wait_for_gpus,
)
from simnode.node import make_kernel_files
from support import wait_for
from test_driver_userspace import CUDA_STYLE_IMAGE, DEBIAN_IMAGE, glibc_images, gpu_pod  # noqa: F401
from test_kubelet_plugin import ensure_device_classes, our_slices, template

from dra_gpu.discovery.driver_install import read_soname

pytestmark = pytest.mark.e2e

SUITES = {"bookworm": "535.261.03", "trixie": "550.163.01"}
IMAGES = {"debian": DEBIAN_IMAGE, "cuda-style": CUDA_STYLE_IMAGE}
# Where each image's loader finds libcuda.so.1 (the mounts of driver_files.container_edits).
LIBCUDA_AT = {
    "debian": "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    "cuda-style": "/usr/local/nvidia/lib64/libcuda.so.1",
}
NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)
# What the workload does: load both libraries by SONAME, say which files the loader mapped (and
# their md5), initialise each; then nvidia-smi from PATH; then cuInit once more with the GPU's
# device nodes removed from the container's /dev (its own tmpfs).
LOAD = r"""
import ctypes, hashlib
def mapped(name):
    return next((l.split()[-1] for l in open("/proc/self/maps") if name in l), None)
for soname, init in (("libcuda.so.1", "cuInit"), ("libnvidia-ml.so.1", "nvmlInit_v2")):
    try:
        lib = ctypes.CDLL(soname)
    except OSError as e:
        print(soname, "not loaded:", e)
        continue
    path = mapped(soname.split(".")[0])
    print(soname, "resolved to", path)
    print("md5", soname, hashlib.md5(open(path, "rb").read()).hexdigest())
    print(init, getattr(lib, init)(0) if init == "cuInit" else getattr(lib, init)())
"""
CUINIT_WITHOUT_NODES = (
    'import ctypes; print("without device nodes: cuInit", ctypes.CDLL("libcuda.so.1").cuInit(0))'
)
PROBE = (
    f"python3 -c {shlex.quote(LOAD)}; ls /dev | grep ^nvidia | tr '\\n' ' '; echo; "
    'echo "nvidia-smi is $(command -v nvidia-smi)"; nvidia-smi; echo "nvidia-smi rc=$?"; '
    "rm -f /dev/nvidia* && "
    f"python3 -c {shlex.quote(CUINIT_WITHOUT_NODES)}; "
    "echo \"nodes after: $(stat -c '%n %t:%T' /dev/nvidia* 2>/dev/null | tr '\\n' ' ')\"; true"
)


class Nodes:
    """One plugin at a time, over the driver root a test asks for (suite, layout, hook or not)."""

    def __init__(self, target, core, dyn, logs: Path):
        self.kubeconfig, self.logs = target.kubeconfig, logs
        self.node = core.list_node().items[0].metadata.name
        self.dyn = dyn
        self.host_like = e2e_script("host_like_root")
        self.debian = e2e_script("debian_driver_root")
        self.current: tuple[str, str, str] | None = None
        self.plugin: RealUserspacePlugin | None = None
        self.hooks: dict[str, Path] = {}
        self.timings: dict[str, float] = {}

    def root(self, suite: str) -> Path:
        return Path(self.debian.driver_root(suite))

    def get(self, suite: str, layout: str = "debian", hook: str = "") -> RealUserspacePlugin:
        """`hook`: "" (no hook path), "new" (the toolkit pin's hook) or "old" (the older release's)."""
        key = (suite, layout, hook)
        if self.current == key and self.plugin is not None:
            return self.plugin
        self.stop()
        version = SUITES[suite]
        debian = self.root(suite)
        if layout == "debian":
            root, nvml_rel = debian, f"{DEBIAN_LIB_DIR}/libnvidia-ml.so.{version}"
        else:
            root = run_layout_root(debian, version, STATE / f"run-layout-{suite}")
            nvml_rel = f"{RUN_LIB_DIR}/libnvidia-ml.so.{version}"
        if hook and hook not in self.hooks:
            self.hooks[hook] = install_cdi_hook(old=hook == "old")
        dev_root = STATE / f"dev-{suite}"
        if not dev_root.exists():
            # The kernel's side of a loaded driver of the suite's version: nodes, proc/devices.
            make_kernel_files(self.host_like.node_profile(PROFILE, suite), dev_root)
        nvml = self.host_like.simulated_nvml(PROFILE, suite=suite)
        log = self.logs / f"plugin-{suite}-{layout}{'-hook-' + hook if hook else ''}.log"
        t0 = time.time()
        plugin = RealUserspacePlugin(
            self.kubeconfig, self.node, log, root, nvml, nvml_rel, dev_root, self.hooks.get(hook)
        )
        plugin.start()
        self.plugin, self.current = plugin, key
        wait_for_gpus(self.dyn, version)
        self.timings[f"{suite}/{layout}{'+hook-' + hook if hook else ''}"] = time.time() - t0
        return plugin

    def stop(self) -> None:
        if self.plugin is not None:
            self.plugin.stop()
        self.plugin, self.current = None, None
        api, items = our_slices(self.dyn)
        for s in items:
            api.delete(name=s["metadata"]["name"])


@pytest.fixture(scope="module")
def nodes(target, core, dyn, glibc_images, tmp_path_factory):  # noqa: F811 - the fixture imported above
    if not target.local:
        pytest.skip("the plugin runs as a host process only on the local e2e cluster")
    shutil.rmtree(STATE, ignore_errors=True)
    STATE.mkdir(parents=True)
    ensure_device_classes(dyn)
    t0 = time.time()
    n = Nodes(target, core, dyn, tmp_path_factory.mktemp("plugin-logs"))
    yield n
    n.stop()
    print(f"\n[real-userspace] module {time.time() - t0:.0f} s; plugin ready: {n.timings}")
    shutil.rmtree(STATE, ignore_errors=True)
    host_dev = sorted(p.name for p in Path("/dev").glob("nvidia*"))
    assert not host_dev, f"NVIDIA device nodes appeared in the host's /dev: {host_dev}"


def run_pod(core, dyn, namespace, wait_pod, name, image, command, claim=True):
    """Run a pod to its end; its phase and log. A claimed pod's claim is gone when this returns
    (unprepared), so the next test may switch the plugin."""
    if claim:
        template(dyn, namespace, "gpus", count=1)
    gpu_pod(core, namespace, name, image, command, claim=claim)
    phase = wait_pod(core, namespace, name, timeout=120)
    log = core.read_namespaced_pod_log(name, namespace)
    core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
    claims = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceClaim")
    wait_for(
        "the pod's claim to be unprepared and gone",
        lambda: not claims.get(namespace=namespace).to_dict()["items"],
        timeout=90,
        interval=0.5,
    )
    return phase, log


def value(log: str, prefix: str) -> str:
    match = re.search(rf"^{re.escape(prefix)} (.*)$", log, re.M)
    assert match, f"no line {prefix!r} in:\n{log}"
    return match.group(1)


@pytest.mark.parametrize("suite", list(SUITES))
def test_the_plugin_sees_the_simulated_nvml_at_nvidias_path(nodes, suite):
    """The plugin's NVML is the simulation, at NVIDIA's path with NVIDIA's SONAME and file name (all
    the plugin reads from it); on the host, that path is NVIDIA's own file."""
    plugin = nodes.get(suite)
    version = SUITES[suite]
    rel = f"{DEBIAN_LIB_DIR}/libnvidia-ml.so.{version}"
    path, inode = plugin.nvml_in_maps()
    assert path == str(plugin.root / rel)
    assert inode == plugin.nvml.stat().st_ino != (plugin.root / rel).stat().st_ino
    assert read_soname(plugin.nvml) == read_soname(plugin.root / rel) == "libnvidia-ml.so.1"
    assert md5(plugin.root / rel) == dpkg_md5(plugin.root, rel) != md5(plugin.nvml)
    assert f"NVML loaded library={plugin.root}/" in plugin.log_tail(200)


@pytest.mark.parametrize("image", list(IMAGES))
@pytest.mark.parametrize("suite", list(SUITES))
def test_pods_get_nvidias_real_libraries_and_nvidia_smi(nodes, suite, image, core, dyn, namespace, wait_pod):
    plugin = nodes.get(suite)
    version, root = SUITES[suite], plugin.root
    phase, log = run_pod(core, dyn, namespace, wait_pod, "real", IMAGES[image], PROBE)
    print(f"\n[real-userspace] {suite} {image}:\n{log}")
    assert phase == "Succeeded", log
    assert value(log, "libcuda.so.1 resolved to") == LIBCUDA_AT[image]
    # NVIDIA's files from Debian's packages, by dpkg's md5 (the NVML is not the plugin's simulation).
    assert value(log, "md5 libcuda.so.1") == dpkg_md5(root, f"{DEBIAN_LIB_DIR}/libcuda.so.{version}")
    nvml = dpkg_md5(root, f"{DEBIAN_LIB_DIR}/libnvidia-ml.so.{version}")
    assert value(log, "md5 libnvidia-ml.so.1") == nvml != md5(plugin.nvml)
    # No kernel module: the container has the GPU's nodes (195:minor), but no driver serves the
    # major, so opening /dev/nvidiactl fails (ENXIO); NVIDIA's libcuda answers that with
    # CUDA_ERROR_NO_DEVICE, its NVML with NVML_ERROR_DRIVER_NOT_LOADED.
    assert "nvidia0" in log and "nvidiactl" in log
    assert value(log, "cuInit") == "100"  # CUDA_ERROR_NO_DEVICE
    assert value(log, "nvmlInit_v2") == "9"  # NVML_ERROR_DRIVER_NOT_LOADED
    assert NO_DRIVER in log and "nvidia-smi rc=9" in log, log
    assert "not found" not in log and "error while loading shared libraries" not in log, log
    # Without the nodes: the same answer; libcuda made /dev/nvidiactl (195:255) again, in the
    # container's own /dev (the runtime gives pods CAP_MKNOD): what NVIDIA's libraries do as root
    # without a driver, and why they must never run so against a host's /dev.
    assert value(log, "without device nodes: cuInit") == "100"
    assert value(log, "nodes after:").split() == ["/dev/nvidiactl", "c3:ff"]


@pytest.mark.parametrize("image", list(IMAGES))
def test_the_same_image_without_a_claim_has_none_of_them(nodes, image, core, dyn, namespace, wait_pod):
    nodes.get("trixie")
    phase, log = run_pod(core, dyn, namespace, wait_pod, "noclaim", IMAGES[image], PROBE, claim=False)
    print(f"\n[real-userspace] {image} without a claim:\n{log}")
    assert phase == "Succeeded", log
    assert "libcuda.so.1 not loaded: libcuda.so.1: cannot open shared object file" in log, log
    assert "libnvidia-ml.so.1 not loaded: libnvidia-ml.so.1: cannot open shared object file" in log, log
    assert "nvidia-smi is \n" in log and "nvidia-smi: not found" in log, log
    assert "nvidia0" not in log and "nvidiactl" not in log, log


HOOK_PROBE = (
    f'python3 -c {shlex.quote(LOAD)}; echo "libcuda.so.1 link: $(readlink /{RUN_LIB_DIR}/libcuda.so.1)"; '
    'echo "ld cache: $(ldconfig -p | grep -c libcuda)"; nvidia-smi; echo "nvidia-smi rc=$?"'
)


@pytest.mark.parametrize("hooked", ["new", "old", ""], ids=["hook-path-set", "hook-1.17", "no-hook-path"])
def test_update_ldcache_makes_a_loader_that_does_not_search_the_folder_find_libcuda(
    nodes, hooked, core, dyn, namespace, wait_pod
):
    """NVIDIA's `.run` layout (usr/lib64) under a Debian image, whose loader searches the multiarch
    directories and /usr/lib only: libcuda.so.1 is found only through the ld cache the hook makes.
    With the older release's hook (1.17.8, no disable-device-node-modification) too: the plugin
    names only the hooks that program has, so the container starts (it did not when every spec
    named that hook)."""
    plugin = nodes.get("trixie", layout="run", hook=hooked)
    version = SUITES["trixie"]
    phase, log = run_pod(core, dyn, namespace, wait_pod, "ldcache", DEBIAN_IMAGE, HOOK_PROBE)
    print(f"\n[real-userspace] .run layout, {'with' if hooked else 'without'} the hook:\n{log}")
    assert phase == "Succeeded", log
    if hooked:
        assert plugin.hook_path is not None and os.access(plugin.hook_path, os.X_OK)
        assert value(log, "libcuda.so.1 resolved to") == f"/{RUN_LIB_DIR}/libcuda.so.{version}"
        assert value(log, "libcuda.so.1 link:") == f"libcuda.so.{version}"  # create-symlinks made it
        assert int(value(log, "ld cache:")) >= 2  # libcuda.so.1 and libcuda.so (update-ldcache)
        assert value(log, "cuInit") == "100" and value(log, "nvmlInit_v2") == "9"
        assert NO_DRIVER in log
        # What the program said it has at start (the claim's spec names only those: it ran).
        said = next(x for x in plugin.log_path.read_text().splitlines() if "CDI hook path=" in x)
        if hooked == "old":
            assert "version=1.17.8" in said and "disable-device-node-modification" not in said, said
        else:
            assert "disable-device-node-modification" in said, said
    else:
        assert "libcuda.so.1 not loaded: libcuda.so.1: cannot open shared object file" in log, log
        assert "libnvidia-ml.so.1 not loaded: libnvidia-ml.so.1: cannot open shared object file" in log, log
        assert value(log, "libcuda.so.1 link:") == ""  # a bind mount of the file, not a link
        assert value(log, "ld cache:") == "0"
