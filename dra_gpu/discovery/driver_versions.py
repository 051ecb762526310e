"""The two halves of a driver installation and their versions: the kernel module loaded
(`<dev root>/proc/driver/nvidia/version`) and the user-space libraries of the driver root (the
`libnvidia-ml.so.<version>` file the loader resolved `libnvidia-ml.so.1` to).

NVIDIA's libnvidia-ml of one version refuses a kernel module of another: `nvmlInit` answers
`NVML_ERROR_LIB_RM_VERSION_MISMATCH` ("RM has detected an NVML/RM version mismatch"), the state of
a node whose driver was upgraded on disk while the old module is still loaded (or whose
--driver-root names another driver's files). `version_mismatch` says which versions and what to do.
"""

from __future__ import annotations

import re
from pathlib import Path

from dra_gpu.discovery.nvml_discovery import NvmlUnavailableError

KERNEL_VERSION_FILE = "proc/driver/nvidia/version"
# "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.133.20  <date>";
# open modules: "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.133.20  Release Build ..."
_KERNEL_VERSION = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)")
_LIBRARY_VERSION = re.compile(r"\.so\.(\d+\.\d+(?:\.\d+)?)$")
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18  # nvml.h


def kernel_module_version(dev_root: Path) -> str | None:
    """The loaded kernel module's version (None: no such file, no module loaded; "unknown": a
    file without a version in it)."""
    try:
        text = (dev_root / KERNEL_VERSION_FILE).read_text(errors="replace")
    except OSError:
        return None
    match = _KERNEL_VERSION.search(text)
    return match.group(1) if match else "unknown"


def library_version(library: Path) -> str | None:
    """The driver version in a library file's name (`libnvidia-ml.so.570.133.20`), if any."""
    match = _LIBRARY_VERSION.search(library.name)
    return match.group(1) if match else None


class DriverVersionMismatchError(NvmlUnavailableError):
    """NVML refused the loaded kernel module: its libraries are another driver's."""

    def __init__(self, message: str, library_version: str, kernel_version: str, fix: str) -> None:
        super().__init__(f"{message}; {fix}")
        self.problem = message
        self.library_version = library_version
        self.kernel_version = kernel_version
        self.fix = fix


def version_mismatch(library: Path, driver_root: Path, dev_root: Path) -> DriverVersionMismatchError:
    """The error for an init that failed with NVML_ERROR_LIB_RM_VERSION_MISMATCH: `library` is the
    file NVML was loaded from (links resolved), `dev_root` the root of the node's proc/."""
    lib = library_version(library) or "unknown"
    kernel = kernel_module_version(dev_root) or "unknown"
    message = (
        f"driver version mismatch: NVML refuses to initialise (RM has detected an NVML/RM version "
        f"mismatch): the driver libraries under {driver_root} are version {lib} ({library}), but "
        f"the loaded kernel module is version {kernel} ({dev_root / KERNEL_VERSION_FILE})"
    )
    fix = (
        f"if the driver was upgraded to {lib} on disk while the old module is still loaded, reboot "
        f"the node or reload the NVIDIA kernel modules (stop the GPU workloads, then "
        f"`modprobe -r nvidia_uvm nvidia_drm nvidia_modeset nvidia && modprobe nvidia`); otherwise "
        f"the driver root {driver_root} is not the loaded driver's: point --driver-root at the files "
        f"of driver {kernel}"
    )
    return DriverVersionMismatchError(message, lib, kernel, fix)
