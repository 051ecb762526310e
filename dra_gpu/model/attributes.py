"""The device attributes and capacities dra-gpu publishes, with their value types
(docs/claims-and-examples.md, "What a device looks like"), and how NVML's versions become attribute values.

One list: the slice builder can only publish what is declared here, and the controller's CEL schema
(which type-checks selectors such as `device.attributes["gpu.dra-gpu.io"].index > 2`) is derived from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

# The value kinds of a ResourceSlice device attribute (the one key of its value object).
AttributeType = Literal["string", "int", "bool", "version"]

STANDARD_DOMAIN = "resource.kubernetes.io"

# Published unqualified, so under the driver's domain.
DRIVER_ATTRIBUTES: Mapping[str, AttributeType] = MappingProxyType(
    {
        "type": "string",  # "gpu" or "mig"
        "uuid": "string",
        "productName": "string",
        "brand": "string",
        "architecture": "string",
        "index": "int",
        "minor": "int",
        "cudaComputeCapability": "version",
        "driverVersion": "version",
        "cudaDriverVersion": "version",
        "numaNode": "int",
        "addressingMode": "string",  # driver 580+: ATS, HMM or None
        "nvlinkDomain": "string",
        "nvlinkDomainSize": "int",
        "packingRank": "int",  # whole GPUs: the node's fill order, 0..7 (dra_gpu.node.slices.packing_rank)
        # MIG devices only
        "profile": "string",
        "parentUUID": "string",
        "parentIndex": "int",
        "parentMinor": "int",
    }
)
# Published under STANDARD_DOMAIN (Kubernetes' own names, shared by drivers).
STANDARD_ATTRIBUTES: Mapping[str, AttributeType] = MappingProxyType(
    {"pciBusID": "string", "pcieRoot": "string", "numaNode": "int"}
)
# A MIG device made beforehand carries `memorySlice<i>: 1` for each memory slice of its GPU it
# holds, as NVIDIA's driver publishes them (so `matchAttribute`-free layouts can be told apart).
MAX_MEMORY_SLICES = 8
MEMORY_SLICE_CAPACITIES = tuple(f"memorySlice{i}" for i in range(MAX_MEMORY_SLICES))
# Published unqualified; every capacity is a quantity.
CAPACITIES = (
    "memory",
    "computeShare",  # only on GPUs shared by memory (--memory-shares): percent of the SMs
    "multiprocessors",
    "copyEngines",
    "decoders",
    "encoders",
    "jpegEngines",
    "ofaEngines",
    *MEMORY_SLICE_CAPACITIES,
)


def normalise_version(raw: str) -> str:
    """NVML's "535.161.08" -> SemVer "535.161.8"; "550.54" -> "550.54.0"."""
    parts = raw.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"{raw!r} is not a numeric version")
    nums = [str(int(p)) for p in parts] + ["0"] * (3 - len(parts))
    return ".".join(nums)


def cuda_major_minor(encoded: int) -> tuple[int, int]:
    """NVML's CUDA driver version 12080 -> (12, 8)."""
    return encoded // 1000, (encoded % 1000) // 10


def cuda_version(encoded: int) -> str:
    """NVML's CUDA driver version 12080 -> "12.8.0" (the cudaDriverVersion attribute)."""
    major, minor = cuda_major_minor(encoded)
    return f"{major}.{minor}.0"
