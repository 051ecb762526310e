"""e2e/real_gpu_check.sh runs to the end against the host-like driver root and gives the simulated
node's answers, leaving nothing behind on the host.

The root is e2e/node/host_like_root.py's (NVIDIA's real 550.163.01 Debian user space and glibc 2.41, the
simulated NVML), its GPUs the character devices of a temporary dev dir; the container section
runs the Debian test image (e2e/node/images.py --debian) under runc. No cluster: needs root, runc,
unshare, a C compiler, and mmdebstrap with Debian's archive unless the roots and the image are
cached. NVIDIA's real binaries run only inside the script's private mount namespace; the test
checks that the host's /dev got nothing and that no NVIDIA process was left running.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from real_userspace import e2e_script
from support import CACHE, ROOT

pytestmark = pytest.mark.e2e

SCRIPT = ROOT / "e2e" / "real_gpu_check.sh"


def _dev_entries() -> set[str]:
    return set(os.listdir("/dev"))


def _nvidia_processes() -> set[str]:
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith(("nvidia-cuda-mps", "nvidia-smi", "cuda_client")):
            out.add(f"{pid} {comm}")
    return out


@pytest.fixture(scope="module")
def needs() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (a private mount namespace, runc, mknod)")
    missing = [t for t in ("runc", "unshare", os.environ.get("CC", "cc")) if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")


def test_real_gpu_check_on_the_host_like_root(needs: None, tmp_path: Path) -> None:
    host_like = e2e_script("host_like_root")
    root = host_like.host_like_root("hgx-2x4")  # type: ignore[attr-defined]
    devdir = host_like.make_dev_dir(tmp_path / "dev", "hgx-2x4")  # type: ignore[attr-defined]
    images = CACHE / "images"
    subprocess.run(
        [sys.executable, str(ROOT / "e2e" / "node" / "images.py"), str(images), "--debian"], check=True
    )
    dev_before, procs_before = _dev_entries(), _nvidia_processes()

    proc = subprocess.run(
        ["bash", str(SCRIPT), "--driver-root", str(root), "--dev-root", str(devdir),
         "--image", str(images / "debian.tar"), "--python", sys.executable],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = proc.stdout
    print(out, proc.stderr)
    results = {m[0]: (m[1], m[2]) for m in re.findall(r"^RESULT ([a-z-]+): (\S+) ?(.*)$", out, re.M)}

    # Every section ran and gave the simulated node's expected answer.
    sections = ["driver", "glibc", "devices", "nvml", "inventory", "runc", "mps-daemon", "cuda-client"]
    sections.append("host-dev")
    assert sorted(results) == sorted(sections), out
    failed = {k: v for k, v in results.items() if v[0] != "ok"}
    assert not failed, out
    assert proc.returncode == 0 and "SUMMARY: " in out and out.rstrip().endswith(" 0 FAIL"), out
    expected = [
        "RESULT driver: ok NVML reports 550.163.01",
        "/proc/driver/nvidia/version: absent (no NVIDIA kernel module loaded)",
        "driver root (/usr/lib/x86_64-linux-gnu/libc.so.6): GNU C Library (Debian GLIBC 2.41",
        "  nvmlSystemGetDriverVersion: 550.163.01",
        "  nvmlSystemGetCudaDriverVersion_v2: 12.4",
        "  binding: ctypes, and pynvml",
        "  nvmlDeviceGetCount_v2: 8",
        "    nvmlDeviceGetAttributes_v2 (whole GPU): 3 (Not Supported)",
        "    nvmlDeviceGetSupportedEventTypes: 0xc00b",
        "    GetFieldValues NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (230): 0 (NONE)",
        "    nvmlEventSetWait_v2 (200 ms): 10 (Timeout)",
        "    missing nvmlDeviceGetGpuInstanceProfileInfoByIdV: first in driver 580, expected missing on 550",
        "RESULT inventory: ok 8 GPUs, driver 550.163.01",
        "nvidia-smi is /usr/bin/nvidia-smi",
        "Mismatch in versions between nvidia-smi and NVML.",  # NVIDIA's nvidia-smi over the simulation
        "  get_default_active_thread_percentage -> 50.0",
        "  get_default_device_pinned_mem_limit 0 -> 2G",
        "    cuInit 100 CUDA_ERROR_NO_DEVICE",  # NVIDIA's libcuda, no kernel module
        "    cuInit 805 CUDA_ERROR_MPS_CONNECTION_FAILED",  # through the daemon, no GPU for a server
        "  after quit: no MPS process of this check left",
        "RESULT host-dev: ok nothing new under /dev, nothing left running",
    ]
    for text in expected:
        assert text in out, f"{text!r} not in the output:\n{out}"

    # Nothing left behind on the host.
    assert _dev_entries() == dev_before
    assert not Path("/dev/nvidiactl").exists() or "nvidiactl" in dev_before
    assert _nvidia_processes() <= procs_before
    assert not list(Path("/tmp").glob("real-gpu-check.*"))
