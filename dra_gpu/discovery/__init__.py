"""GPU discovery: NVML -> Inventory (`discover`, run on the node backend's NVML: the driver root's
libnvidia-ml.so.1, `dra_gpu.node.backend`).

This package holds only what a real node runs: NVML discovery, the driver installation, NVLink
domains, root paths, NVML library loading and compatibility. The simulator (profiles, the C
library, the in-process Python fake of unit tests and benchmarks) is `simnode`.

May import: dra_gpu.common, dra_gpu.model.
"""

from __future__ import annotations

from dra_gpu.discovery.nvml_discovery import NvmlUnavailableError, discover

__all__ = [
    "NvmlUnavailableError",
    "discover",
]
