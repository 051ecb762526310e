"""The DeviceClasses the Helm chart installs (deploy/helm/dra-gpu/templates/deviceclasses.yaml), as
objects, so that `dra-gpu validate` and `dra-gpu explain` know them when neither the input nor the
cluster holds them: a user's claims name the chart's classes without shipping them.

tests/deploy/test_device_classes.py renders the chart with Helm and checks these against it.
"""

from __future__ import annotations

from typing import Any

from dra_gpu.kube.values import RESOURCE_API_VERSION
from dra_gpu.model.nvidia_compat import GPU_EXTENDED_RESOURCE

# The chart's defaults (values.yaml deviceClasses.*.extendedResourceName).
GPU_CLASS_EXTENDED_RESOURCE: str | None = GPU_EXTENDED_RESOURCE
MIG_CLASS_EXTENDED_RESOURCE: str | None = None


def gpu_class_name(driver: str) -> str:
    """The full-GPU class: the driver's own name (gpu.dra-gpu.io, gpu.nvidia.com)."""
    return driver


def mig_class_name(driver: str) -> str:
    """The MIG class: `mig.<domain>` where the driver name is `gpu.<domain>`, else `mig.<driver>`
    (the chart's dra-gpu.migClassName); gpu.nvidia.com gives NVIDIA's mig.nvidia.com."""
    return "mig." + driver.removeprefix("gpu.")


def type_selector(driver: str, device_type: str) -> str:
    """The chart's selector for devices of one `type` attribute. With driver gpu.nvidia.com it is
    NVIDIA's chart's expression character for character (docs/reference/nvidia-dra-driver-v0.5.0.md §2)."""
    return f"device.driver == '{driver}' && device.attributes['{driver}'].type == '{device_type}'"


def _device_class(name: str, driver: str, device_type: str, extended: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"selectors": [{"cel": {"expression": type_selector(driver, device_type)}}]}
    if extended:
        spec["extendedResourceName"] = extended
    return {
        "apiVersion": RESOURCE_API_VERSION,
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": spec,
    }


def chart_device_classes(
    driver: str,
    gpu_extended_resource: str | None = GPU_CLASS_EXTENDED_RESOURCE,
    mig_extended_resource: str | None = MIG_CLASS_EXTENDED_RESOURCE,
) -> list[dict[str, Any]]:
    """The chart's full-GPU and MIG DeviceClasses for `driver` (with the chart's default
    extendedResourceNames unless told otherwise); new objects on each call."""
    return [
        _device_class(gpu_class_name(driver), driver, "gpu", gpu_extended_resource),
        _device_class(mig_class_name(driver), driver, "mig", mig_extended_resource),
    ]
