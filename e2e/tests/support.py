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
