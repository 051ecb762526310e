"""Small NVIDIA driver roots for unit tests: real ELF libraries (compiled here) under the real
file names, SONAMEs and links, plus binaries and firmware, in a Debian or RHEL layout."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

DEB = "usr/lib/x86_64-linux-gnu"
VERSION = "570.133.20"
MPS_CONTROL_SOURCE = Path(__file__).parents[1] / "sim" / "simnode" / "src" / "mps-control.c"


def _so(path: Path, soname: str | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    src = path.parent / ".empty.c"
    src.write_text("int dra_gpu_test_symbol(void) { return 1; }\n")
    args = ["cc", "-shared", "-fPIC", "-o", str(path), str(src)]
    if soname:
        args.insert(1, f"-Wl,-soname,{soname}")
    subprocess.run(args, check=True)
    src.unlink()


def make_root(root: Path, version: str = VERSION, libdir: str = DEB, soname: bool = True) -> Path:
    sonames = {"libcuda.so": "libcuda.so.1", "libnvidia-ml.so": "libnvidia-ml.so.1"}
    sonames["libnvidia-ptxjitcompiler.so"] = "libnvidia-ptxjitcompiler.so.1"
    for name, so in sonames.items():
        _so(root / libdir / f"{name}.{version}", so if soname else None)
        (root / libdir / so).unlink(missing_ok=True)
        (root / libdir / so).symlink_to(f"{name}.{version}")
    (root / libdir / "libcuda.so").unlink(missing_ok=True)
    (root / libdir / "libcuda.so").symlink_to("libcuda.so.1")
    bindir = root / "usr/bin"
    bindir.mkdir(parents=True, exist_ok=True)
    # nvidia-smi notes its arguments where the simulated one keeps its state (next to the nodes).
    (bindir / "nvidia-smi").write_text(
        '#!/bin/sh\necho "$*" >> "${DRA_GPU_SIM_DEV_DIR:-/tmp}/nvidia-smi.calls"\n'
    )
    (bindir / "nvidia-smi").chmod(0o755)
    # The simulated MPS control daemon (sim/simnode): the plugin starts and asks it for real.
    subprocess.run(
        ["cc", "-O1", "-o", str(bindir / "nvidia-cuda-mps-control"), str(MPS_CONTROL_SOURCE)], check=True
    )
    fw = root / "lib/firmware/nvidia" / version
    fw.mkdir(parents=True, exist_ok=True)
    (fw / "gsp_ga10x.bin").write_bytes(b"\0" * 16)
    return root


# ---------------------------------------------------------------- NVIDIA's real Debian packages


def e2e_node_script(name: str) -> ModuleType:
    """A script of e2e/node/ (debian_driver_root.py, host_like_root.py) as a module, loaded once:
    they are scripts of the e2e, not a package."""
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).parents[1] / "e2e" / "node" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def debian_driver_roots() -> ModuleType:
    """e2e/node/debian_driver_root.py as a module."""
    return e2e_node_script("debian_driver_root")


def _cannot_build_debian_root() -> str | None:
    missing = [tool for tool in ("mmdebstrap", "dpkg-query") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} (e2e/node/build.sh debs installs mmdebstrap)"
    if os.geteuid() != 0:
        return "needs root (mmdebstrap runs dpkg in the root)"
    return None


def debian_root(suite_or_version: str) -> Path:
    """The driver root of NVIDIA's real Debian packages (bookworm 535.261.03, trixie 550.163.01):
    the cached one, else built (about a minute); the test is skipped, saying why, only where it
    can be neither (no mmdebstrap, not root)."""
    import pytest

    roots = debian_driver_roots()
    root: Path | None = roots.cached_driver_root(suite_or_version)
    if root is None:
        reason = _cannot_build_debian_root()
        if reason is not None:
            pytest.skip(f"Debian driver root {suite_or_version} is not cached and building it {reason}")
        root = roots.driver_root(suite_or_version)
    assert root is not None
    return root


def with_simulated_nvml(root: Path, dest: Path, profile: str | Path, cache: Path) -> Path:
    """A copy of the driver root `root` at `dest` (hard links where the filesystem allows) whose
    NVML (`libnvidia-ml.so.<version>`, the file behind `libnvidia-ml.so.1`) is the simulated one
    of `profile` (reporting the profile's driver version): the rest of NVIDIA's files stay real.
    A simulated node loads its driver root's NVML, and NVIDIA's real library must never be
    initialised here (as root it would make device nodes in the host's /dev)."""
    import os
    import shutil

    from simnode.builder import ensure_nvml_library
    from simnode.profiles import load_profile

    version = load_profile(str(profile)).driver_version

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(root, dest, symlinks=True, copy_function=link_or_copy)
    real = [p for p in dest.rglob(f"libnvidia-ml.so.{version}") if p.is_file() and not p.is_symlink()]
    assert len(real) == 1, f"{root}: libnvidia-ml.so.{version} files: {real}"
    real[0].unlink()
    shutil.copy2(ensure_nvml_library(cache, str(profile)).resolve(), real[0])
    return dest


def run_probe_in_private_namespace(probe: str, root: Path, work: Path) -> str:
    """Run the Python `probe` (argv: driver root, work dir) as root in a private mount and PID
    namespace whose /dev is a scratch tmpfs: NVIDIA's real MPS daemon and libraries may create
    device nodes and daemons, none of which must reach the host. Returns its stdout; fails the test
    with its stderr when it exits non-zero."""
    work.mkdir(parents=True, exist_ok=True)
    script_path = work / "probe.py"
    script_path.write_text(probe)
    repo = Path(__file__).resolve().parents[1]
    script = (
        "mount -t tmpfs -o size=1m,mode=755 tmpfs /dev && touch /dev/null "
        "&& mount --bind /proc/1/root/dev/null /dev/null 2>/dev/null; mkdir -p /dev/shm; "
        f"cd {repo} && exec {sys.executable} {script_path} {root} {work / 'mps'}"
    )
    unshare = ["unshare", "--mount", "--propagation", "private", "--fork", "--pid", "--mount-proc"]
    r = subprocess.run([*unshare, "sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout
