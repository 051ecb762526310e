"""The Python fake of a simulated node, for in-process tests and benchmarks: the product never uses
it (a node command on `--profile` loads the C library of `simnode`, see README.md).

`FakeNvml` is a pynvml-shaped stand-in serving a profile in-process (`fake_nvml.py`, with its MIG
and event calls in `fake_nvml_mig.py` and `fake_nvml_events.py`, its MIG state in `fake_mig.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dra_gpu.discovery.nvml_discovery import discover
from dra_gpu.model.inventory import Inventory
from simnode.fake_nvml import FakeNvml
from simnode.profiles import NodeProfile, load_profile

__all__ = ["FakeNvml", "discover_node", "simulated_nvml"]


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
