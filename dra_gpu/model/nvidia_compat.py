"""NVIDIA-compatible mode: the names under which NVIDIA's DRA driver (dra-driver-nvidia-gpu v0.5.0)
is addressed, so that manifests written for it run on dra-gpu unchanged, and what of NVIDIA's
driver dra-gpu does not do (refused with these reasons, never ignored).

One switch (`--nvidia-compatible`, the chart's `nvidiaCompatible`) selects the driver name; the
attributes and capacities are the same in both modes (NVIDIA's set is a subset of ours, see
docs/nvidia-compatibility.md), and the opaque API `resource.nvidia.com/v1beta1` is decoded in both
(dra_gpu.model.config).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from dra_gpu.model.inventory import DEFAULT_DRIVER_NAME

DRIVER_NAME = "gpu.nvidia.com"
GPU_CLASS = "gpu.nvidia.com"
MIG_CLASS = "mig.nvidia.com"
GPU_EXTENDED_RESOURCE = "nvidia.com/gpu"

_VFIO = "VFIO passthrough of a whole GPU to a virtual machine (NVIDIA's PassthroughSupport)"
_IMEX = "ComputeDomains and IMEX channels (multi-node NVLink, NVIDIA's compute-domain.nvidia.com driver)"

# NVIDIA's DeviceClasses that name something dra-gpu does not publish -> what it is.
UNSUPPORTED_CLASSES: Mapping[str, str] = MappingProxyType(
    {
        "vfio.gpu.nvidia.com": _VFIO,
        "compute-domain-daemon.nvidia.com": _IMEX,
        "compute-domain-default-channel.nvidia.com": _IMEX,
        "imex.nvidia.com": _IMEX,
    }
)
# NVIDIA's kinds of resource.nvidia.com/v1beta1 that dra-gpu does not do -> what they are for (its
# opaque config decoder refuses them on `kind`: dra_gpu.model.config.nvidia_v1beta1).
UNSUPPORTED_CONFIG_KINDS: Mapping[str, str] = MappingProxyType(
    {
        "VfioDeviceConfig": _VFIO,
        "ComputeDomainChannelConfig": _IMEX,
        "ComputeDomainDaemonConfig": _IMEX,
        "ComputeDomain": _IMEX,
        "ComputeDomainClique": _IMEX,
    }
)
# NVIDIA's other DRA driver (its devices never come from dra-gpu) -> what it is.
UNSUPPORTED_DRIVERS: Mapping[str, str] = MappingProxyType({"compute-domain.nvidia.com": _IMEX})


class DriverNameError(ValueError):
    """--driver-name and --nvidia-compatible disagree."""


def driver_name(explicit: str | None, nvidia_compatible: bool) -> str:
    """The DRA driver name a command runs as: `explicit` (--driver-name), else gpu.nvidia.com in
    NVIDIA-compatible mode, else dra-gpu's own."""
    if nvidia_compatible:
        if explicit and explicit != DRIVER_NAME:
            raise DriverNameError(
                f"--driver-name {explicit} contradicts --nvidia-compatible, whose driver name is "
                f"{DRIVER_NAME}: give one of them"
            )
        return DRIVER_NAME
    return explicit or DEFAULT_DRIVER_NAME


def unsupported_reason(class_name: str) -> str | None:
    """Why a claim for NVIDIA's DeviceClass `class_name` cannot run on dra-gpu (None: it can)."""
    what = UNSUPPORTED_CLASSES.get(class_name)
    if what is None:
        return None
    return f"DeviceClass {class_name} is NVIDIA's class for {what}, which dra-gpu does not do"
