"""The Python fake's node for pure in-process unit tests and benchmarks: device nodes and MIG
capability files as a loaded driver would have made them, and sharing on a `FakeNvml`.

The product never uses these: a simulated node's nodes are made by `simnode.node` and its
NVML is the simulated C library. Unit tests of the preparer, health and sharing construct them
directly with the fake, which runs in-process (several profiles per process, no mknod needed for
most of it, no compiler)."""

from __future__ import annotations

from pathlib import Path

from simnode.devnodes import NVIDIA_MAJOR, NVIDIACTL_MINOR, make_char
from simnode.fake_nvml import FakeNvml
from simnode.node import CAPS_MAJOR as SIM_CAPS_MAJOR
from simnode.node import MODESET_MINOR as NVIDIA_MODESET_MINOR
from simnode.node import UVM_MAJOR as SIM_UVM_MAJOR
from simnode.profiles import load_profile

from dra_gpu.discovery.kernel_devices import CAPS, UVM
from dra_gpu.model.inventory import Inventory
from dra_gpu.plugin.driver_files import DriverFiles
from dra_gpu.plugin.sharing import Sharing, node_sharing


def fake_sharing(mps_root: Path, driver_files: DriverFiles, profile: str, dev_root: Path) -> Sharing:
    """Sharing on the fake NVML of `profile`, which keeps compute modes in
    `<dev_root>/nvidia-state.json` and MIG state under `dev_root`; nvidia-smi is told where the
    node's device nodes are."""
    nvml = FakeNvml(load_profile(profile), root=dev_root, state_file=dev_root / "nvidia-state.json")
    return node_sharing(mps_root, driver_files, nvml, {"DRA_GPU_SIM_DEV_DIR": str(dev_root / "dev")})


def create_simulated(inventory: Inventory, dev_root: Path) -> int:
    """Make the nodes (and MIG capability files) of a simulated node; returns how many nodes."""
    dev = dev_root / "dev"
    count = 0
    # The kernel's list of the simulated driver's character devices (major numbers).
    proc_devices = dev_root / "proc/devices"
    proc_devices.parent.mkdir(parents=True, exist_ok=True)
    proc_devices.write_text(
        f"Character devices:\n  1 mem\n{NVIDIA_MAJOR} nvidia-frontend\n{SIM_CAPS_MAJOR} {CAPS}\n"
        f"{SIM_UVM_MAJOR} {UVM}\n\nBlock devices:\n  8 sd\n"
    )
    make_char(dev / "nvidiactl", NVIDIA_MAJOR, NVIDIACTL_MINOR)
    make_char(dev / "nvidia-uvm", SIM_UVM_MAJOR, 0)
    make_char(dev / "nvidia-uvm-tools", SIM_UVM_MAJOR, 1)
    make_char(dev / "nvidia-modeset", NVIDIA_MAJOR, NVIDIA_MODESET_MINOR)
    count += 4
    cap_minor = 1
    for gpu in sorted(inventory.gpus, key=lambda g: g.minor):
        make_char(dev / f"nvidia{gpu.minor}", NVIDIA_MAJOR, gpu.minor)
        count += 1
        # Dynamic MIG instances get theirs from the simulated driver when it makes them.
        for mig in [] if gpu.dynamic_mig else gpu.mig_devices:
            base = dev_root / "proc/driver/nvidia/capabilities" / f"gpu{gpu.minor}" / "mig"
            for access in (
                base / f"gi{mig.gpu_instance_id}" / "access",
                base / f"gi{mig.gpu_instance_id}" / f"ci{mig.compute_instance_id}" / "access",
            ):
                access.parent.mkdir(parents=True, exist_ok=True)
                access.write_text(f"DeviceFileMinor: {cap_minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
                make_char(dev / "nvidia-caps" / f"nvidia-cap{cap_minor}", SIM_CAPS_MAJOR, cap_minor)
                cap_minor += 1
                count += 1
    return count
