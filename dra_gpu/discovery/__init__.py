"""GPU discovery: NVML (or a simulated node served through a pynvml-shaped fake) -> Inventory."""

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
    "open_nvml",
    "simulated_nvml",
]


def simulated_nvml(profile: NodeProfile, root: Path | None = None) -> tuple[FakeNvml, Any]:
    """The fake NVML of a profile and the PCIe-root lookup that stands in for sysfs; `root`
    keeps its MIG state (instances outlive the process, as the kernel's do)."""
    roots = {g.pci_bus_id.lower(): g.pcie_root for g in profile.gpus}

    def pcie_root(bus_id: str) -> str | None:
        # Profiles use NVML's 8-digit domain; discovery asks with the 4-digit sysfs form.
        for key, root in roots.items():
            if key.endswith(bus_id.lower()):
                return root
        return None

    return FakeNvml(profile, root), pcie_root


def open_nvml(profile: str | None = None, sim_root: Path | None = None) -> tuple[Any, Any]:
    """(nvml, pcie-root lookup or None): a simulated node's fake (`profile`: a built-in name or a
    file; `sim_root` keeps its MIG state) or this machine's pynvml."""
    if profile is not None:
        return simulated_nvml(load_profile(profile), sim_root)
    try:
        import pynvml
    except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a dependency
        raise NvmlUnavailableError(f"NVML is not available: {exc}") from exc
    return pynvml, None


def discover_node(
    node_name: str, profile: str | None = None, dynamic_mig: bool = False, sim_root: Path | None = None
) -> Inventory:
    """Discover a simulated node (`profile`: a built-in name or a file) or this machine's GPUs."""
    nvml, pcie_root = open_nvml(profile, sim_root)
    return discover(nvml, node_name, pcie_root, dynamic_mig)
