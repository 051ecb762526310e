"""The device nodes of a simulated node: real character devices (major 195, as the NVIDIA kernel
module makes them) in a directory the simulated libraries look at ($DRA_GPU_SIM_DEV_DIR).
mknod needs CAP_MKNOD (root)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255


def make_char(path: Path, major: int, minor: int) -> None:
    """A character device `major:minor` at `path` (replacing anything else there)."""
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


def make_device_nodes(devdir: Path, minors: Iterable[int]) -> Path:
    """`nvidiactl` and `nvidia<minor>` for each minor in `devdir` (made if missing); returns it."""
    devdir = Path(devdir)
    devdir.mkdir(parents=True, exist_ok=True)
    make_char(devdir / "nvidiactl", NVIDIA_MAJOR, NVIDIACTL_MINOR)
    for minor in minors:
        if not 0 <= minor < NVIDIACTL_MINOR:
            raise ValueError(f"GPU minor {minor} must be in 0..254 (255 is nvidiactl)")
        make_char(devdir / f"nvidia{minor}", NVIDIA_MAJOR, minor)
    return devdir
