"""Helpers for the tests of the simulated libnvidia-ml.so.1 (sim/simnode).

One process can load only one libnvidia-ml.so.1, so every check runs in a child Python that loads
the library by full path first (`ctypes.CDLL(<path>)`), then uses pynvml as a real node does. The
child's device-node directory is a temporary one with real character devices (mknod: root).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from simnode.builder import default_cache_dir, ensure_nvml_library
from simnode.devnodes import make_device_nodes
from simnode.nvml_header import HEADER_ENV, NvmlHeaderUnreachable, nvml_header
from simnode.profiles import load_profile

REPO = Path(__file__).resolve().parents[1]
H200 = REPO / "tests" / "data" / "h200.yaml"
PRELUDE = """\
import ctypes, pickle, sys
LIB = sys.argv[1]
ctypes.CDLL(LIB)  # by full path first: pynvml's CDLL("libnvidia-ml.so.1") then binds to it
import pynvml
def out(value):
    sys.stdout.buffer.write(pickle.dumps(value))
"""

needs_toolchain = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None,
    reason="no C compiler: the simulated NVML is compiled from C (apt-get install gcc)",
)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod of character devices needs root")


@pytest.fixture(scope="session")
def nvml_h() -> Iterator[Path]:
    """NVIDIA's nvml.h, named for every build of the session (fetched once into the user cache)."""
    try:
        path = nvml_header(default_cache_dir())
    except NvmlHeaderUnreachable as exc:  # (a wrong DRA_GPU_NVML_H or a bad download fails)
        pytest.skip(f"NVIDIA's nvml.h is not available: {exc}")
    mp = pytest.MonkeyPatch()
    mp.setenv(HEADER_ENV, str(path))
    yield path
    mp.undo()


@pytest.fixture(scope="session")
def libcache(tmp_path_factory: pytest.TempPathFactory, nvml_h: Path) -> Path:
    return tmp_path_factory.mktemp("simnvml-cache")


def library(cache: Path, profile: str | Path, version: str | None = None) -> Path:
    return ensure_nvml_library(cache, str(profile), version)


def devdir_for(path: Path, profile: str | Path) -> Path:
    """A device-node directory with nvidiactl and every GPU of the profile."""
    return make_device_nodes(path, [g.minor for g in load_profile(str(profile)).gpus])


def run_child(
    lib: Path, devdir: Path, body: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> Any:
    """Run `body` (after PRELUDE) in a child Python; returns what it passed to out()."""
    env = {
        **(env or {}),
        "PATH": "/usr/bin:/bin",
        "DRA_GPU_SIM_DEV_DIR": str(devdir),
        "PYTHONPATH": str(REPO),
        "HOME": os.environ.get("HOME", "/root"),
    }
    script = PRELUDE + textwrap.dedent(body)
    proc = subprocess.run(
        [sys.executable, "-c", script, str(lib), *args], env=env, capture_output=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-4000:]
    return pickle.loads(proc.stdout)


def _child(conn: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        conn.send((True, fn(*args)))
    except BaseException:
        conn.send((False, traceback.format_exc()))
    finally:
        conn.close()


def in_child(fn: Callable[..., Any], *args: Any, timeout: float = 180) -> Any:
    """`fn(*args)` in a fresh Python (spawned: nothing of this process's NVML in it), for a test
    that loads a simulated node's libnvidia-ml.so.1 in-process (one per process); its return value,
    or an AssertionError with the child's traceback. `fn` must be importable (a module function)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, fn, args))
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise AssertionError(f"{fn.__name__} did not finish in {timeout:.0f}s")
        ok, value = parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if not ok:
        raise AssertionError(f"{fn.__name__} failed in its child process:\n{value}")
    return value
