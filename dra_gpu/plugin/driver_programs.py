"""NVIDIA's own programs (`nvidia-smi`, `nvidia-cuda-mps-control`) run from the driver root.

The driver root holds the host's whole library directory (with driver root `/` or the GPU
Operator's `/run/nvidia/driver`, its `libc.so.6` too), so none of it goes on a loader search path
(`LD_LIBRARY_PATH`): the program would then run on the host's glibc with the image's loader, or
not at all. A program gets, by full path in `LD_PRELOAD`, the one driver library it needs:
- `nvidia-smi`: `libnvidia-ml.so.1` (NVML);
- `nvidia-cuda-mps-control`: `libcuda.so.1`. The control daemon spawns `nvidia-cuda-mps-server`,
  which is a CUDA program: the server inherits the preload, and finds its binary on `PATH`, which
  starts with the driver root's directories of the MPS binaries.
A library loaded by full path satisfies every later request for its SONAME, so the program's own
`dlopen("libnvidia-ml.so.1")` finds it; everything else comes from the image's default search path.

Not `chroot` into the driver root, as NVIDIA's DRA driver does for its MPS daemons: that needs a
driver root that is a whole OS tree with its own C library (not every driver root is: a bare
driver installation, or the simulated node's), and the daemon's pipe and log directories under
the plugin's directory would have to be visible inside the driver root, which the plugin mounts
read-only.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dra_gpu.plugin.driver_files import DriverFiles

# The driver library each program is given (the DriverInstallation's library names).
NEEDS = {
    "nvidia-smi": "libnvidia-ml.so",
    "nvidia-cuda-mps-control": "libcuda.so",
}
# Programs a program starts by name, found on PATH: the MPS control daemon starts the server.
SPAWNS = {"nvidia-cuda-mps-control": ("nvidia-cuda-mps-server",)}
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


class DriverProgramError(RuntimeError):
    """A driver program that cannot be run safely; the message says why."""


@dataclass(frozen=True)
class DriverProgram:
    """One driver program as this process runs it."""

    binary: Path | None  # None: the installation has no such program
    preload: Path | None = None  # the one driver library, by full path
    path_dirs: list[Path] = field(default_factory=list)  # where it finds the programs it starts

    def env(self, base_path: str = SYSTEM_PATH) -> dict[str, str]:
        """`PATH` and `LD_PRELOAD` for the program (never `LD_LIBRARY_PATH`)."""
        dirs = [str(d) for d in self.path_dirs]
        env = {"PATH": ":".join([*dict.fromkeys(dirs), base_path])}
        if self.preload is not None:
            preload = str(self.preload)
            # The loader splits LD_PRELOAD at spaces and colons.
            if any(c in preload for c in " :\t\n"):
                raise DriverProgramError(f"cannot preload {preload}: the path has a space or colon")
            env["LD_PRELOAD"] = preload
        return env


def program_locator(driver_files: DriverFiles, program: str) -> Callable[[], DriverProgram]:
    """`program` of the node's driver installation as this process sees it (looked up per use:
    the installation may be found or fixed after start-up)."""

    def locate() -> DriverProgram:
        found = driver_files.installation
        if found is None:
            return DriverProgram(None)

        def binary(name: str) -> Path | None:
            rel = next((b for b in found.binaries if os.path.basename(b) == name), None)
            return driver_files.root / rel if rel else None

        own = binary(program)
        if own is None:
            return DriverProgram(None)
        library = next((lib for lib in found.libraries if lib.name == NEEDS.get(program)), None)
        dirs = [own.parent] + [b.parent for name in SPAWNS.get(program, ()) if (b := binary(name))]
        return DriverProgram(
            binary=own,
            preload=driver_files.root / library.path if library else None,
            path_dirs=dirs,
        )

    return locate
