"""dra-gpu: a Kubernetes Dynamic Resource Allocation driver for NVIDIA GPUs."""

__version__ = "0.1.0"  # = dra_gpu.common.version.VERSION and pyproject.toml's (tests/test_version.py)
