"""The driver's versioned opaque-configuration API (documented in the repository's api/): its own
gpu.dra-gpu.io/v1alpha1 and NVIDIA's resource.nvidia.com/v1beta1, both decoded onto one GpuConfig."""

from typing import Any

from dra_gpu.common.decoding import type_name
from dra_gpu.model.config import nvidia_v1beta1, v1alpha1
from dra_gpu.model.config.v1alpha1 import API_VERSION, ConfigError, GpuConfig

NVIDIA_API_VERSION = nvidia_v1beta1.API_VERSION
API_VERSIONS = (API_VERSION, NVIDIA_API_VERSION)


def decode(parameters: Any) -> GpuConfig:
    """Decode `opaque.parameters` of either API, by its apiVersion, strictly; raise ConfigError
    naming the field path."""
    if not isinstance(parameters, dict):
        return v1alpha1.decode(parameters)  # its error: must be an object
    api_version = parameters.get("apiVersion")
    if api_version == API_VERSION:
        return v1alpha1.decode(parameters)
    if api_version == NVIDIA_API_VERSION:
        return nvidia_v1beta1.decode(parameters)
    got = repr(api_version)[:80] if isinstance(api_version, str | None) else type_name(api_version)
    raise ConfigError("apiVersion", f"must be {API_VERSION!r} or {NVIDIA_API_VERSION!r}, got {got}")


__all__ = ["API_VERSION", "API_VERSIONS", "NVIDIA_API_VERSION", "ConfigError", "GpuConfig", "decode"]
