"""`dra-gpu wait-for-driver`, the plugin pod's init container: it waits, saying what for, until
the driver root holds NVML's library (the GPU Operator installs it after the pod started)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

DRA_GPU = shutil.which("dra-gpu") or str(Path(sys.executable).with_name("dra-gpu"))


def wait(root: Path, *extra: str) -> subprocess.Popen[str]:
    args = [DRA_GPU, "wait-for-driver", "--driver-root", str(root), "--interval", "0.1", *extra]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_it_waits_until_the_driver_is_installed(tmp_path: Path) -> None:
    proc = wait(tmp_path)
    time.sleep(1.5)
    assert proc.poll() is None  # still waiting
    library = tmp_path / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")  # as the driver container's install makes it appear
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out == f"NVIDIA driver found: {library}\n"
    assert err.startswith(
        f"waiting for the NVIDIA driver under {tmp_path} (0 s so far): NVML is not available"
    )
    assert "/run/nvidia/driver" in err


def test_it_gives_up_after_its_timeout_saying_why(tmp_path: Path) -> None:
    proc = wait(tmp_path, "--timeout", "1")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "dra-gpu wait-for-driver: no NVIDIA driver after 1 s: NVML is not available" in err
    assert not out
