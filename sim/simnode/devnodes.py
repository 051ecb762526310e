"""The device nodes of a simulated node: real character devices (major 195, as the NVIDIA kernel
module makes them) in a directory the simulated libraries look at ($DRA_GPU_SIM_DEV_DIR).
mknod needs CAP_MKNOD (root).

A node made with a major the running kernel gives to a driver opens that driver: on a host with
NVIDIA's kernel module loaded, /dev-like files of major 195 reach the real GPUs, and majors such as
1 (mem) reach far worse. So no node is made whose major /proc/devices lists under "Character
devices", whatever its name there.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255
PROC_DEVICES = Path("/proc/devices")


class RealDriverMajorError(RuntimeError):
    """A simulated device node would have a major that a real driver of this kernel holds."""


def character_majors(proc_devices: Path | None = None) -> dict[int, str]:
    """The kernel's character-device majors and the names of the drivers holding them."""
    majors: dict[int, str] = {}
    section = ""
    for line in (proc_devices or PROC_DEVICES).read_text().splitlines():
        if line.rstrip().endswith(":"):
            section = line.strip()
            continue
        number, _, name = line.strip().partition(" ")
        if section == "Character devices:" and number.isdigit():
            majors.setdefault(int(number), name.strip())
    return majors


def make_char(path: Path, major: int, minor: int, proc_devices: Path | None = None) -> None:
    """A character device `major:minor` at `path` (replacing anything else there); refused with
    RealDriverMajorError when `proc_devices` (the running kernel's) gives the major to a driver."""
    proc_devices = proc_devices or PROC_DEVICES
    holder = character_majors(proc_devices).get(major)
    if holder is not None:
        raise RealDriverMajorError(
            f"refusing to make the simulated device node {path} ({major}:{minor}): major {major} "
            f"belongs to the kernel's {holder!r} driver ({proc_devices}), and the node would reach "
            "it; run the simulated node where no driver holds that major (NVIDIA's: no NVIDIA "
            "kernel module loaded)"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    want = os.makedev(major, minor)
    try:
        st = os.stat(path)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == want:
            return
        path.unlink()
    except FileNotFoundError:
        pass
    os.mknod(path, 0o666 | stat.S_IFCHR, want)


def make_device_nodes(devdir: Path, minors: Iterable[int], proc_devices: Path | None = None) -> Path:
    """`nvidiactl` and `nvidia<minor>` for each minor in `devdir` (made if missing); returns it."""
    devdir = Path(devdir)
    devdir.mkdir(parents=True, exist_ok=True)
    make_char(devdir / "nvidiactl", NVIDIA_MAJOR, NVIDIACTL_MINOR, proc_devices)
    for minor in minors:
        if not 0 <= minor < NVIDIACTL_MINOR:
            raise ValueError(f"GPU minor {minor} must be in 0..254 (255 is nvidiactl)")
        make_char(devdir / f"nvidia{minor}", NVIDIA_MAJOR, minor, proc_devices)
    return devdir
