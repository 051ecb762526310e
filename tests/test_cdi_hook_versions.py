"""NVIDIA's real nvidia-cdi-hook of two toolkit releases, probed as the plugin probes it at start,
and the spec the driver files make for each run past the program itself.

The programs are what `e2e/node/build.sh toolkit` builds from the Go module
github.com/NVIDIA/nvidia-container-toolkit: the pinned release (NVIDIA_CTK_VERSION, 1.20) and an
older one (NVIDIA_CTK_OLD_VERSION, 1.17), which has no `disable-device-node-modification`. A
spec naming a hook the 1.17 program lacks fails every container of a claim; 1.18 and later skip an
unknown hook with a warning and exit 0, so "exit 0" alone proves nothing there: a hook counts as
accepted only when `<hook> <name> --help` shows that hook's own help. Without the builds (Go, a C
compiler and the module proxy are needed) the tests are skipped, saying how to build them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dra_gpu.plugin.cdi_hook import (
    APPLY_CUDA_MEMORY_LIMITS,
    DISABLE_DEVICE_NODE_MODIFICATION,
    PROBE_ENV,
    probe,
)
from dra_gpu.plugin.driver_files import DriverFiles
from tests.driver_root import make_root

REPO = Path(__file__).resolve().parents[1]
DRIVER = "570.133.20"


def _pin(name: str) -> str:
    match = re.search(rf"^{name}=(\S+)", (REPO / "e2e" / "node" / "versions.sh").read_text(), re.M)
    assert match, f"e2e/node/versions.sh has no {name}"
    return match.group(1)


def _built(directory: str, program: str) -> Path:
    cache = Path(os.environ.get("DRA_GPU_CACHE") or Path.home() / ".cache" / "dra-gpu")
    out = cache / "bin" / directory
    if not (out / ".complete").is_file():
        pytest.skip(f"NVIDIA's {program} is not built in {out}: run `bash e2e/node/build.sh toolkit`")
    return out / program


def old_hook() -> Path:
    return _built(f"nvidia-cdi-hook-{_pin('NVIDIA_CTK_OLD_VERSION')}", "nvidia-cdi-hook")


def new_hook() -> Path:
    return _built(f"nvidia-container-toolkit-{_pin('NVIDIA_CTK_VERSION')}", "nvidia-cdi-hook")


def accepts(hook: Path, name: str) -> bool:
    """The program runs `name` as one of its own hooks (its help is that hook's, exit 0)."""
    proc = subprocess.run(
        [str(hook), name, "--help"], capture_output=True, text=True, timeout=30, env=PROBE_ENV
    )
    return (
        proc.returncode == 0
        and re.search(rf"^NAME:\n\s+.*\b{re.escape(name)} - ", proc.stdout, re.M) is not None
    )


def spec_hooks(tmp_path: Path, hook: Path) -> list[str]:
    """The hooks a claim's spec names with this program (the plugin's start probes it)."""
    files = DriverFiles(make_root(tmp_path / "root", DRIVER), DRIVER, hook_path=str(hook))
    hooks = files.edits()["hooks"]
    assert {h["path"] for h in hooks} == {str(hook)}
    return [h["args"][1] for h in hooks]


needs_cc = pytest.mark.skipif(
    shutil.which("cc") is None, reason="the driver root's libraries need a C compiler"
)


@needs_cc
def test_the_older_release_gets_a_spec_without_the_hooks_it_lacks(tmp_path: Path) -> None:
    hook = old_hook()
    found = probe(str(hook))
    assert found.version == _pin("NVIDIA_CTK_OLD_VERSION").removeprefix("v")
    assert not found.supports(DISABLE_DEVICE_NODE_MODIFICATION)
    assert not found.supports(APPLY_CUDA_MEMORY_LIMITS)
    # The probe is right: the program itself does not know the hook.
    assert not accepts(hook, DISABLE_DEVICE_NODE_MODIFICATION)
    names = spec_hooks(tmp_path, hook)
    assert names == ["create-symlinks", "enable-cuda-compat", "update-ldcache"]
    for name in names:
        assert accepts(hook, name), f"nvidia-cdi-hook {found.version} does not run {name}"


@needs_cc
def test_the_pinned_release_gets_every_hook(tmp_path: Path) -> None:
    hook = new_hook()
    found = probe(str(hook))
    assert found.version == _pin("NVIDIA_CTK_VERSION").removeprefix("v")
    assert found.supports(DISABLE_DEVICE_NODE_MODIFICATION)
    assert found.supports(APPLY_CUDA_MEMORY_LIMITS)
    names = spec_hooks(tmp_path, hook)
    assert names == [
        "create-symlinks",
        "enable-cuda-compat",
        "update-ldcache",
        DISABLE_DEVICE_NODE_MODIFICATION,
    ]
    for name in names:
        assert accepts(hook, name), f"nvidia-cdi-hook {found.version} does not run {name}"
    # An unknown hook exits 0 here too, so `accepts` must look at the help it shows.
    assert not accepts(hook, "no-such-hook")


def test_nvidia_ctk_lists_the_same_hooks_under_its_hook_command() -> None:
    ctk = new_hook().with_name("nvidia-ctk")
    assert probe(str(ctk)).subcommands == probe(str(new_hook())).subcommands
