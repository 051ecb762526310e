"""GPU discovery: NVML -> Inventory (`discover`, run on the node backend's NVML: the driver root's
libnvidia-ml.so.1, `dra_gpu.node_backend`).

`FakeNvml`, a pynvml-shaped Python stand-in serving a profile in-process, is for pure unit tests
and benchmarks only (`simulated_nvml`, `discover_node`): no node command uses it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dra_gpu.discovery.fake_nvml import FakeNvml
from dra_gpu.discovery.nvml_discovery import NvmlUnavailableError, discover
from dra_gpu.discovery.profiles import NodeProfile, ProfileError, load_profile
from dra_gpu.model import Inventory

__all__ = [
    "FakeNvml",
    "NvmlUnavailableError",
    "ProfileError",
    "discover",
    "discover_node",
    "load_profile",
    "simulated_nvml",
]


def simulated_nvml(profile: NodeProfile, root: Path | None = None) -> tuple[FakeNvml, Any]:
    """The Python fake NVML of a profile and the PCIe-root lookup that stands in for sysfs (unit
    tests); `root` keeps its MIG state (instances outlive the object, as the kernel's do)."""
    roots = {g.pci_bus_id.lower(): g.pcie_root for g in profile.gpus}

    def pcie_root(bus_id: str) -> str | None:
        # Profiles use NVML's 8-digit domain; discovery asks with the 4-digit sysfs form.
        for key, root in roots.items():
            if key.endswith(bus_id.lower()):
                return root
        return None

    return FakeNvml(profile, root), pcie_root


def discover_node(
    node_name: str, profile: str, dynamic_mig: bool = False, sim_root: Path | None = None
) -> Inventory:
    """A profile's inventory through the Python fake, in-process (unit tests, benchmarks)."""
    nvml, pcie_root = simulated_nvml(load_profile(profile), sim_root)
    return discover(nvml, node_name, pcie_root, dynamic_mig)
