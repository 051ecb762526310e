"""The NVIDIA kernel modules' character devices as the kernel lists them in `/proc/devices`.

The `nvidia-uvm` and `nvidia-caps` majors are assigned dynamically when the modules load, so
they are read here, never assumed. A module the kernel does not list is not loaded; a container
cannot load one (no `/sbin/modprobe`, no `/lib/modules`), so what to do about it is said for
the host (`UVM_HOST_FIX`).
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

UVM = "nvidia-uvm"  # /dev/nvidia-uvm (minor 0) and /dev/nvidia-uvm-tools (minor 1)
CAPS = "nvidia-caps"  # /dev/nvidia-caps/nvidia-cap<N> (MIG and other capabilities)
UVM_MINORS = {"/dev/nvidia-uvm": 0, "/dev/nvidia-uvm-tools": 1}
UVM_HOST_FIX = (
    "load it on the host at boot (`modprobe nvidia-uvm`, or `nvidia-modprobe -u -c=0`, which also "
    "makes /dev/nvidia-uvm; e.g. `nvidia-uvm` in /etc/modules-load.d/nvidia.conf); "
    "a container cannot load a kernel module"
)


def char_majors(proc_devices: Path) -> dict[str, int]:
    """Name -> major of the character devices in `proc_devices` (`/proc/devices`); empty when the
    file cannot be read."""
    try:
        text = proc_devices.read_text(errors="replace")
    except OSError as exc:
        log.warning("cannot read the kernel's device list path=%s error=%s", proc_devices, exc)
        return {}
    majors: dict[str, int] = {}
    in_char = False
    for line in text.splitlines():
        line = line.strip()
        if line.endswith(":"):
            in_char = line == "Character devices:"
            continue
        parts = line.split(None, 1)
        if in_char and len(parts) == 2 and parts[0].isdigit():
            majors.setdefault(parts[1], int(parts[0]))
    return majors


def uvm_missing(proc_devices: Path) -> str | None:
    """Why no container can use CUDA's unified memory device, or None when the module is loaded."""
    if UVM in char_majors(proc_devices):
        return None
    return f"the nvidia-uvm kernel module is not loaded (no {UVM} in {proc_devices})"
