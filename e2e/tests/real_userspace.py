"""Support for test_real_userspace.py: the kubelet plugin as a host process over a driver root of
NVIDIA's real files, seeing the simulated NVML in place of NVIDIA's in its own mount namespace only.

Why that split: the plugin needs an NVML that sees GPUs (here the GPU simulation at NVIDIA's C
interface, sim/simnode); a workload must get NVIDIA's real libnvidia-ml, exactly as on a node
whose kernel module is absent. So the node's driver root on the host is the pure Debian root (what
the CDI specs point containerd at), and only the plugin's process has the simulated library
bind-mounted over `libnvidia-ml.so.<version>` (`unshare --mount --propagation private`: the bind
mount never reaches the host's mount table, the kubelet or containerd). What the plugin reads from
that file is the same for both (path, file name, hence the version, and the ELF SONAME, checked by
the test); its bytes are never written into a spec.

SAFETY: the plugin runs as root on the host; it loads only the simulated NVML (the bind mount is
made by `set -e` before the plugin starts, and the test checks the plugin's maps), and it runs no
program of the driver root here (no MPS or time-slice claim; the root has no nvidia-modprobe).
NVIDIA's real libraries and binaries run only in the pods, whose /dev is the runtime's own.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from support import CACHE, ROOT, wait_for
from test_kubelet_plugin import Plugin, device_attrs

PROFILE = "hgx-2x4"
STATE = Path(os.environ.get("DRA_GPU_E2E_STATE", "/var/lib/dra-gpu-e2e")) / "real-userspace"
DEBIAN_LIB_DIR = "usr/lib/x86_64-linux-gnu/nvidia/current"
RUN_LIB_DIR = "usr/lib64"  # NVIDIA's .run installer on RHEL-likes
# The private mount namespace: the simulated NVML over NVIDIA's file, then the plugin. `set -e`:
# no plugin (which would load NVIDIA's real NVML as root on the host) if the mount fails.
BIND_THEN_EXEC = 'set -e; mount --bind "$1" "$2"; shift 2; exec "$@"'


def e2e_script(name: str) -> ModuleType:
    """A script of e2e/node/ (host_like_root.py, debian_driver_root.py) as a module, loaded once."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "e2e" / "node" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def dpkg_md5(root: Path, rel: str) -> str:
    """The md5 Debian's package records for a file of the root (dpkg's md5sums, any package)."""
    for sums in (root / "var/lib/dpkg/info").glob("*.md5sums"):
        for line in sums.read_text().splitlines():
            digest, path = line.split(None, 1)
            if path.strip() == rel:
                return digest
    raise AssertionError(f"{rel} is in no package of {root}")


def toolkit_pin(name: str = "NVIDIA_CTK_VERSION") -> str:
    for line in (ROOT / "e2e" / "node" / "versions.sh").read_text().splitlines():
        if line.startswith(f"{name}="):
            return line.split("=", 1)[1].strip()
    raise AssertionError(f"e2e/node/versions.sh has no {name}")


def install_cdi_hook(old: bool = False) -> Path:
    """NVIDIA's nvidia-cdi-hook (e2e/node/build.sh toolkit, built when not cached) installed on the
    node as the GPU Operator's toolkit installs it: a copy in a toolkit directory of the node's
    own (the Debian package would put it at /usr/bin/nvidia-cdi-hook; this one stays under the
    e2e state dir, so the machine's /usr is not changed). `old`: the older release's hook
    (NVIDIA_CTK_OLD_VERSION), which lacks the newer hooks."""
    if old:
        built = CACHE / "bin" / f"nvidia-cdi-hook-{toolkit_pin('NVIDIA_CTK_OLD_VERSION')}"
    else:
        built = CACHE / "bin" / f"nvidia-container-toolkit-{toolkit_pin()}"
    if not (built / ".complete").is_file():
        proc = subprocess.run(
            ["bash", str(ROOT / "e2e" / "node" / "build.sh"), "toolkit"],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        assert proc.returncode == 0, (
            f"e2e/node/build.sh toolkit failed:\n{(proc.stdout + proc.stderr)[-3000:]}"
        )
    dest = STATE / ("toolkit-old" if old else "toolkit") / "nvidia-cdi-hook"
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(".nvidia-cdi-hook.tmp")
    shutil.copyfile(built / "nvidia-cdi-hook", tmp)
    tmp.chmod(0o755)
    os.replace(tmp, dest)
    return dest


def run_layout_root(debian_root: Path, version: str, dest: Path) -> Path:
    """NVIDIA's real files of a Debian root in the layout of NVIDIA's `.run` installer on a
    RHEL-like host: libraries, their SONAME and development links in usr/lib64, nvidia-smi in
    usr/bin (hard links to the Debian root's files where possible: no copy of the bytes)."""
    if dest.exists():
        shutil.rmtree(dest)
    libs = dest / RUN_LIB_DIR
    libs.mkdir(parents=True)
    links = {
        "libcuda.so": ("libcuda.so.1", "libcuda.so"),
        "libnvidia-ml.so": ("libnvidia-ml.so.1", "libnvidia-ml.so"),
        "libnvidia-ptxjitcompiler.so": ("libnvidia-ptxjitcompiler.so.1",),
    }
    for name, made in links.items():
        file = f"{name}.{version}"
        _place(debian_root / DEBIAN_LIB_DIR / file, libs / file)
        (libs / made[0]).symlink_to(file)
        for dev in made[1:]:
            (libs / dev).symlink_to(made[0])
    (dest / "usr/bin").mkdir(parents=True)
    _place(debian_root / "usr/lib/nvidia/current/nvidia-smi", dest / "usr/bin/nvidia-smi")
    return dest


def _place(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


class RealUserspacePlugin(Plugin):
    """`dra-gpu kubelet-plugin` in real-node mode (no --profile: NVML loaded from the driver root)
    as a host process over `root`, with the simulated NVML `nvml` over `root/nvml_rel` in its own
    mount namespace, and the simulated kernel's dev root (device nodes, proc/devices)."""

    def __init__(self, kubeconfig, node, log_path, root, nvml, nvml_rel, dev_root, hook_path=None):
        super().__init__(kubeconfig, node, log_path)
        self.root, self.nvml, self.nvml_rel, self.dev_root = Path(root), Path(nvml), nvml_rel, dev_root
        self.hook_path = hook_path

    def node_args(self) -> list[str]:
        return [
            "--driver-root",
            str(self.root),
            "--dev-root",
            str(self.dev_root),
            *(["--cdi-hook-path", str(self.hook_path)] if self.hook_path else []),
        ]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DRA_GPU_PROFILE", "NVIDIA_"))}
        # The simulated NVML's own knobs: where its GPUs' device nodes and kernel files are.
        return env | {
            "DRA_GPU_SIM_DEV_DIR": str(self.dev_root / "dev"),
            "DRA_GPU_SIM_PROC_DIR": str(self.dev_root / "proc"),
            "PYTHONPATH": str(ROOT),
        }

    def start(self) -> None:
        target = self.root / self.nvml_rel
        assert target.is_file() and not target.is_symlink(), target
        # The simulated NVML over NVIDIA's file, in the plugin's own mount namespace only.
        bind = ["unshare", "--mount", "--propagation", "private", "sh", "-c", BIND_THEN_EXEC, "sh"]
        self.wrapper = [*bind, str(self.nvml), str(target)]
        super().start()

    def nvml_in_maps(self) -> tuple[str, int]:
        """The libnvidia-ml the plugin's process has mapped: (path, inode)."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/maps").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 6 and "libnvidia-ml" in parts[5]:
                return parts[5], int(parts[4])
        raise AssertionError("no libnvidia-ml in the plugin's maps")


def wait_for_gpus(dyn, version: str, count: int = 8) -> dict[str, dict]:
    """The node's `count` GPUs published with the driver version (semver: 550.163.1)."""
    major, minor, patch = version.split(".")
    want = f"{int(major)}.{int(minor)}.{int(patch)}"

    def published():
        attrs = device_attrs(dyn)
        ok = len(attrs) == count and all(a.get("driverVersion") == want for a in attrs.values())
        return attrs if ok else None

    return wait_for(f"{count} GPUs with driver {want}", published, timeout=60)
