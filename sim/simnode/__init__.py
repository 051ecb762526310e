"""A simulated GPU node at NVIDIA's own interfaces: a driver root whose libnvidia-ml.so.1 is built
from C against NVIDIA's nvml.h and serves a node profile, plus the injection of what the kernel
would report from outside (XIDs, ECC errors, a lost GPU, recovery actions). See README.md.

Its own distribution (sim/pyproject.toml), never part of the driver's wheel or image: dra-gpu finds
it through the entry point `dra_gpu.node_profiles` (`simnode.provider`). It is built on the driver's
floors, never the reverse.

May import: dra_gpu.common, dra_gpu.model, dra_gpu.discovery, dra_gpu.node.
"""

from __future__ import annotations

from simnode.builder import (
    SimDriverError,
    SimGpu,
    build_driver_root,
    default_cache_dir,
    ensure_driver_root,
    lib_dir,
    nvml_library,
)

__all__ = [
    "SimDriverError",
    "SimGpu",
    "build_driver_root",
    "default_cache_dir",
    "ensure_driver_root",
    "lib_dir",
    "nvml_library",
]
