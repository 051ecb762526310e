"""The MPS daemon pod's program (dra_gpu.plugin.mps_supervisor) with NVIDIA's real control daemon
of Debian's 535 root: it serves in the foreground, quits through its own pipe when the pod is
deleted (SIGTERM: NVIDIA's daemon would otherwise die on the spot, its sockets left behind) and when
its directory is removed (a plugin of an earlier release unprepared the claim), and nothing of it is
left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dra_gpu.plugin.mps_supervisor import CHECK_INTERVAL
from tests.driver_root import debian_root

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="NVIDIA's daemon as the plugin runs it: root")
LIBCUDA = "usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.1"


def start(tmp_path: Path) -> tuple[subprocess.Popen[str], Path, dict[str, str]]:
    root = debian_root("bookworm")
    pipe, logs = tmp_path / "pipe", tmp_path / "log"
    pipe.mkdir()
    logs.mkdir()
    env = {
        "PATH": f"{root}/usr/bin:{root}/usr/sbin:/usr/bin:/bin",
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
        "CUDA_MPS_LOG_DIRECTORY": str(logs),
    }
    binary = str(root / "usr/bin/nvidia-cuda-mps-control")
    argv = [
        sys.executable,
        "-m",
        "dra_gpu.plugin.mps_supervisor",
        str(pipe),
        str(root / LIBCUDA),
        binary,
        "-f",
    ]
    sup = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 10
    while not (pipe / "control").exists():
        assert time.monotonic() < deadline and sup.poll() is None, "the daemon did not start"
        time.sleep(0.05)
    ask = subprocess.run(
        [binary],
        input="get_default_active_thread_percentage\n",
        env={**env, "LD_PRELOAD": str(root / LIBCUDA)},
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert ask.stdout.strip() == "100.0", ask
    return sup, pipe, env


def daemons_of(pipe: Path) -> list[int]:
    found = []
    for p in Path("/proc").iterdir():
        try:
            if (
                p.name.isdigit()
                and f"CUDA_MPS_PIPE_DIRECTORY={pipe}".encode() in (p / "environ").read_bytes()
                and (p / "comm").read_text().startswith("nvidia-cuda-mps")
            ):
                found.append(int(p.name))
        except OSError:
            continue
    return found


def test_sigterm_quits_the_daemon_through_its_pipe(tmp_path: Path) -> None:
    sup, pipe, _ = start(tmp_path)
    assert daemons_of(pipe)
    sup.send_signal(signal.SIGTERM)
    out, _ = sup.communicate(timeout=CHECK_INTERVAL + 10)
    print(out)
    assert sup.returncode == 0, out
    assert "Cmd:quit" in out and "Exit with status 0" in out, out  # NVIDIA's daemon's own log
    assert not daemons_of(pipe)


def test_the_daemon_ends_when_its_directory_is_removed(tmp_path: Path) -> None:
    sup, pipe, _ = start(tmp_path)
    for f in pipe.iterdir():
        f.unlink()
    pipe.rmdir()
    out, _ = sup.communicate(timeout=CHECK_INTERVAL + 10)
    print(out)
    assert sup.returncode == 0 and "is gone (the claim was unprepared)" in out, out
    assert "did not quit" not in out, out  # no pipe to ask through: ended at once
    assert not daemons_of(pipe)
