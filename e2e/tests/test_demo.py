"""The README's main job (scripts/demo -> e2e/demo.py) keeps working."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def test_demo_gets_four_nvlink_connected_gpus(target):
    if not target.local:
        pytest.skip("the demo runs the plugin as a host process on the local e2e cluster")
    demo = Path(__file__).resolve().parents[1] / "demo.py"
    out = subprocess.run([sys.executable, str(demo)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    gpus = [line.split() for line in out.stdout.splitlines() if line.startswith("    gpu-")]
    assert len(gpus) == 4, out.stdout
    assert len({g[-1] for g in gpus}) == 1, out.stdout  # one NVLink domain
    assert "DRA_GPU_VISIBLE_DEVICES=" in out.stdout
    # The container's own loader found the node's driver library, and nvidia-smi lists the 4 GPUs.
    assert "libcuda.so.1 resolved to /usr/lib/x86_64-linux-gnu/libcuda.so.1" in out.stdout, out.stdout
    listed = [line for line in out.stdout.splitlines() if line.strip().startswith("GPU ") and "UUID" in line]
    assert len(listed) == 4, out.stdout


def test_demo_on_a_node_without_four_nvlink_gpus_says_why_at_once(target):
    """PROFILE=mixed (PCIe GPUs, no NVLink): the demo says why from `dra-gpu explain`
    before any wait, instead of the scheduler's "cannot allocate all claims" after 120 s."""
    if not target.local:
        pytest.skip("the demo runs the plugin as a host process on the local e2e cluster")
    demo = Path(__file__).resolve().parents[1] / "demo.py"
    env = {**os.environ, "PROFILE": "mixed"}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(demo)], capture_output=True, text=True, timeout=300, env=env)
    print(f"\n[e2e] demo on mixed: {time.monotonic() - t0:.1f} s\n{out.stdout[-1500:]}")
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "cannot give them: largest free NVLink domain: 1 GPUs" in out.stdout, out.stdout
    assert "the claim needs 4 NVLink-connected GPUs" in out.stdout
    assert "waiting for it" not in out.stdout and "after 120 s" not in out.stdout
