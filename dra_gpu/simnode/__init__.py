"""A simulated GPU node at NVIDIA's own interfaces: a driver root whose libnvidia-ml.so.1 is built
from C against NVIDIA's nvml.h and serves a node profile, plus the injection of what the kernel
would report from outside (XIDs, ECC errors, a lost GPU, recovery actions). See README.md."""

from __future__ import annotations

from dra_gpu.simnode.builder import (
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
