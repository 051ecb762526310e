"""A driver's libraries of another version than its loaded kernel module: the simulated
libnvidia-ml.so.1 refuses the simulated kernel as NVIDIA's does (`nvmlInit` answers
NVML_ERROR_LIB_RM_VERSION_MISMATCH when `$DRA_GPU_SIM_PROC_DIR/driver/nvidia/version` names another
version than its own), and the node backend names both versions and what to do.

Each check runs in a child process (one libnvidia-ml.so.1 per process); see simnode_support."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from simnode.builder import default_cache_dir, ensure_driver_root, nvml_library
from simnode.node import kernel_version_text, prepare_simulated_node

from dra_gpu.discovery.driver_versions import DriverVersionMismatchError, kernel_module_version
from dra_gpu.node.backend import open_backend
from tests.simnode_support import (
    devdir_for,
    in_child,
    libcache,  # noqa: F401 - fixture
    library,
    needs_root,
    needs_toolchain,
    nvml_h,  # noqa: F401 - fixture
    run_child,
)

pytestmark = [needs_toolchain, needs_root, pytest.mark.usefixtures("nvml_h")]

INIT = """
try:
    pynvml.nvmlInit()
    out(pynvml.nvmlSystemGetDriverVersion())
except pynvml.NVMLError as exc:
    out(exc.value)
"""
OTHER = "550.54.15"  # hgx-2x4's driver is 570.133.20


@pytest.mark.parametrize(
    ("kernel", "answer"),
    [
        (None, "570.133.20"),  # no file: no check (as before the kernel's version was simulated)
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.133.20  Fri Feb 28 2025", "570.133.20"),
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.133.20  Release Build  (dvs)",
            "570.133.20",
        ),
        (f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {OTHER}  Fri Feb 28 2025", 18),
        (f"NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  {OTHER}  Release Build", 18),
    ],
    ids=["no-file", "same", "same-open", "other", "other-open"],
)
def test_init_refuses_a_kernel_module_of_another_version(
    kernel: str | None,
    answer: object,
    libcache: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    lib = library(libcache, "hgx-2x4")
    proc = tmp_path / "proc"
    if kernel is not None:
        (proc / "driver/nvidia").mkdir(parents=True)
        (proc / "driver/nvidia/version").write_text(kernel + "\nGCC version:  gcc version 12.2.0\n")
    env = {"DRA_GPU_SIM_PROC_DIR": str(proc)}
    # 18: NVML_ERROR_LIB_RM_VERSION_MISMATCH, "RM has detected an NVML/RM version mismatch."
    assert run_child(lib, devdir_for(tmp_path / "dev", "hgx-2x4"), INIT, env=env) == answer


def test_the_simulated_node_writes_the_kernel_modules_version(tmp_path: Path) -> None:
    node = prepare_simulated_node("hgx-2x4", tmp_path / "root")
    text = (node.proc_dir / "driver/nvidia/version").read_text()
    assert text.startswith("NVRM version: NVIDIA UNIX ") and " Kernel Module  570.133.20  " in text
    assert text == kernel_version_text("570.133.20")
    assert kernel_module_version(tmp_path / "root") == "570.133.20"


def discover_over(driver_root: Path, dev_root: Path) -> dict[str, str]:
    """A plugin process on hgx-2x4 (kernel module 570.133.20) with `driver_root`'s libraries."""
    backend = open_backend("hgx-2x4", driver_root, dev_root)
    try:
        backend.discover("node-a")
    except DriverVersionMismatchError as exc:
        return {"message": str(exc), "library": exc.library_version, "kernel": exc.kernel_version}
    return {}


def test_another_drivers_libraries_fail_discovery_naming_both_versions(tmp_path: Path) -> None:
    root = ensure_driver_root(default_cache_dir(), "hgx-2x4", OTHER)
    dev_root = tmp_path / "simulated-root"
    got = in_child(discover_over, root, dev_root)
    assert got["library"] == OTHER and got["kernel"] == "570.133.20", got
    message = got["message"]
    assert message.startswith("driver version mismatch: ")
    assert f"libnvidia-ml.so.{OTHER}" in message and str(dev_root / "proc/driver/nvidia/version") in message
    assert "reboot" in message and "reload the NVIDIA kernel modules" in message
    assert "--driver-root" in message
    # NVIDIA's nvidia-smi of that driver root says the same, as the real one does.
    env = {
        "PATH": "/usr/bin:/bin",
        "LD_PRELOAD": str(nvml_library(root)),
        "DRA_GPU_SIM_DEV_DIR": str(dev_root / "dev"),
        "DRA_GPU_SIM_PROC_DIR": str(dev_root / "proc"),
    }
    smi = subprocess.run([str(root / "usr/bin/nvidia-smi"), "-L"], env=env, capture_output=True, text=True)
    assert smi.returncode == 18 and "Driver/library version mismatch" in smi.stdout, smi


def test_inventory_and_doctor_name_both_versions(tmp_path: Path) -> None:
    """`dra-gpu inventory` and `dra-gpu doctor` on a simulated node whose driver root is another
    driver's: both fail naming the libraries' and the kernel module's versions."""
    root = ensure_driver_root(default_cache_dir(), "hgx-2x4", OTHER)
    cli = [sys.executable, "-m", "dra_gpu.cli"]
    node = ["--profile", "hgx-2x4", "--driver-root", str(root)]
    inv = subprocess.run([*cli, "inventory", *node], capture_output=True, text=True, timeout=120)
    assert inv.returncode != 0, inv
    assert "driver version mismatch" in inv.stderr and OTHER in inv.stderr and "570.133.20" in inv.stderr
    assert "No NVIDIA driver on this machine" not in inv.stderr
    doctor = subprocess.run(
        [*cli, "doctor", "--only", "node", *node, "--dev-root", str(tmp_path), "--output", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert doctor.returncode != 0, doctor
    results = {r["check"]: r for r in json.loads(doctor.stdout)["checks"]}
    assert results["node/nvml"]["status"] == "FAIL" and OTHER in results["node/nvml"]["detail"]
    assert "kernel module 570.133.20" in results["node/driver"]["detail"], results["node/driver"]
