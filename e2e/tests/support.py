"""Helpers shared by the e2e scenario files."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
    """The simulated NVIDIA driver installation of a profile's node (e2e/simdriver, cached):
    real ELF libraries, nvidia-smi and firmware of the profile's driver version (or `version`)."""
    cmd = [sys.executable, str(ROOT / "e2e" / "simdriver" / "build.py"), "--profile", profile]
    cmd += ["--cache", str(CACHE)] + (["--version", version] if version else [])
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        pytest.fail(f"e2e/simdriver/build.py failed:\n{r.stderr[-3000:]}")
    return r.stdout.strip().splitlines()[-1]
