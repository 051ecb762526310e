"""The driver's versioned opaque-configuration API (documented in the repository's api/)."""

from dra_gpu.model.config.v1alpha1 import API_VERSION, ConfigError, GpuConfig, decode

__all__ = ["API_VERSION", "ConfigError", "GpuConfig", "decode"]
