"""NVML loaded by full path from the driver root: one code path on a real and a simulated node.

The plugin never puts a driver-root directory on its own `LD_LIBRARY_PATH`: with driver root `/`
or `/run/nvidia/driver` that directory holds the host's `libc.so.6`, and the image's Python would
die relocating against it. NVIDIA's own DRA driver loads `libnvidia-ml.so.1` by full path; so does
this module, then lets `pynvml` bind to it: its `CDLL("libnvidia-ml.so.1")` is answered by the
object already loaded under that SONAME, so no search path is consulted.

A process holds one NVML: the first driver root loaded wins, and another root is refused.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path, PurePosixPath
from typing import Any

from dra_gpu.discovery.driver_install import LIBRARY_DIRS
from dra_gpu.discovery.nvml_discovery import NvmlUnavailableError
from dra_gpu.discovery.root_paths import regular_file_in_root

NVML_SONAME = "libnvidia-ml.so.1"

_lock = threading.Lock()
_loaded: Path | None = None  # the library file this process bound pynvml to


def find_nvml(driver_root: Path) -> Path:
    """The `libnvidia-ml.so.1` of the driver root (its links followed inside the root)."""
    for rel in LIBRARY_DIRS:
        found = regular_file_in_root(driver_root, PurePosixPath(rel, NVML_SONAME))
        if found is not None:
            return found
    searched = ", ".join(f"/{d}" for d in LIBRARY_DIRS)
    raise NvmlUnavailableError(
        f"NVML is not available: no {NVML_SONAME} under the driver root {driver_root} "
        f"(searched {searched}); is the NVIDIA driver installed there? (--driver-root)"
    )


def load_nvml(path: Path) -> Any:
    """`pynvml`, bound to the library at `path` (a driver root's `libnvidia-ml.so.1`, as
    `find_nvml` finds it), loaded once per process."""
    global _loaded
    with _lock:
        if _loaded is not None:
            if _loaded.resolve() != path.resolve():
                raise NvmlUnavailableError(
                    f"NVML is not available: this process already loaded {_loaded}; "
                    f"it cannot load {path} as well"
                )
            return _pynvml()
        try:
            library = ctypes.CDLL(str(path))
        except OSError as exc:
            raise NvmlUnavailableError(f"NVML is not available: cannot load {path}: {exc}") from exc
        pynvml = _pynvml()
        with pynvml.libLoadLock:
            bound = pynvml.nvmlLib
            if bound is None:
                # The name is answered by the object just loaded (same SONAME), never a search.
                bound = pynvml.nvmlLib = ctypes.CDLL(NVML_SONAME)
        if bound._handle != library._handle:
            raise NvmlUnavailableError(
                f"NVML is not available: pynvml is bound to another {NVML_SONAME} than {path} "
                "(does the file's SONAME differ, or was NVML loaded before?)"
            )
        _loaded = path
        return pynvml


def _pynvml() -> Any:
    try:
        import pynvml
    except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a dependency
        raise NvmlUnavailableError(f"NVML is not available: {exc}") from exc
    return pynvml
