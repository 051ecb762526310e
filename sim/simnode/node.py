"""A simulated GPU node, prepared for one profile: everything that differs from a real node.

A simulated node runs the same NVML code path as a real one (its driver root's
`libnvidia-ml.so.1`, loaded by full path, with `pynvml` on top). It differs only in:

- the driver root: `--driver-root` if given, else the simulated driver root of the profile
  (built on first use with the system's C compiler and cached, `builder.ensure_driver_root`);
- the device-node directory: `<dev root>/dev`, where the profile's device nodes are made (real
  character devices) before NVML is loaded, and which the simulated library and NVIDIA's
  (simulated) tools are told through `$DRA_GPU_SIM_DEV_DIR`; the kernel's files under
  `<dev root>/proc` (`devices`, the module's `driver/nvidia/version`, and the MIG capability
  files the library keeps there while an instance exists: `$DRA_GPU_SIM_PROC_DIR`);
- the PCI devices' sysfs entries under `<dev root>/sys` (`bus/pci/devices/<bus id>`, a link into
  `devices/<root complex>/`, with its `numa_node`), which the driver reads there as on a real node;
- the node's view of its driver root, `<dev root>/driver-root`: the driver's files (links into the
  driver root) beside `dev/` (a link to the node's device nodes), as a GPU Operator's driver root
  (`/run/nvidia/driver`) or a host's `/` has its device nodes in `dev/`. NVIDIA's tools (its DRA
  plugin, the container toolkit's CDI generator) look for device nodes under `<driver root>/dev`
  when that is a directory, else under `/`, where a simulated node has none;
- what the kernel would report from outside (XIDs, ECC errors, a lost GPU, recovery actions):
  injected into the device-node directory (`inject`), where the library's event sets see them.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dra_gpu.discovery.kernel_devices import CAPS, UVM
from dra_gpu.discovery.nvml_discovery import normalise_pci_bus_id
from simnode import inject
from simnode.builder import SimDriverError, default_cache_dir, ensure_driver_root
from simnode.devnodes import NVIDIA_MAJOR, RealDriverMajorError, make_char, make_device_nodes
from simnode.profiles import NodeProfile, load_profile

DEV_DIR_ENV = "DRA_GPU_SIM_DEV_DIR"
PROC_DIR_ENV = "DRA_GPU_SIM_PROC_DIR"
# The uvm and caps majors are assigned dynamically by a real kernel; these are the simulated ones.
UVM_MAJOR = 509
CAPS_MAJOR = 508
MODESET_MINOR = 254
VIEW_SOURCE = ".simnode-driver-root"  # in the view: the driver root it is a copy of
DRIVER_ROOT_VIEW = "driver-root"  # under the dev root: the driver's files and the node's dev/


class SimulatedNodeError(RuntimeError):
    """The simulated node cannot be prepared; the message names what is missing."""


@dataclass(frozen=True)
class SimulatedNode:
    profile: NodeProfile
    driver_root: Path  # its NVIDIA driver installation (the simulated libnvidia-ml.so.1 and tools)
    dev_root: Path  # root of dev/ and proc/

    @property
    def dev_dir(self) -> Path:
        return self.dev_root / "dev"

    @property
    def proc_dir(self) -> Path:
        return self.dev_root / "proc"

    @property
    def sys_dir(self) -> Path:
        return self.dev_root / "sys"

    @property
    def driver_root_view(self) -> Path:
        """The driver root with the node's `dev/` in it, for tools that find device nodes there."""
        return self.dev_root / DRIVER_ROOT_VIEW

    def env(self) -> dict[str, str]:
        """What the simulated library and NVIDIA's tools must be told: where the node's kernel is."""
        return {DEV_DIR_ENV: str(self.dev_dir), PROC_DIR_ENV: str(self.proc_dir)}

    def events(self) -> SimulatedEvents:
        return SimulatedEvents(self.dev_dir)


class SimulatedEvents:
    """What `dra-gpu health simulate` makes the node's kernel report, delivered to every NVML event
    set of the node (the plugin's monitor waits in `nvmlEventSetWait_v2`)."""

    def __init__(self, dev_dir: Path) -> None:
        self.dev_dir = dev_dir

    def inject_event(
        self, gpu_uuid: str, event_type: int, data: int = 0, gi: int = inject.NO_ID, ci: int = inject.NO_ID
    ) -> int:
        inject.inject_event(self.dev_dir, gpu_uuid, event_type, data, gi, ci)
        return 1

    def set_recovery_action(self, gpu_uuid: str, action: int) -> None:
        inject.set_recovery_action(self.dev_dir, gpu_uuid, action, event=False)

    def set_lost(self, gpu_uuid: str, lost: bool) -> None:
        inject.set_gpu_lost(self.dev_dir, gpu_uuid, lost)


def make_kernel_files(profile: NodeProfile, dev_root: Path) -> None:
    """The device nodes a loaded driver makes (nvidiactl, one per GPU, uvm, modeset) under
    `<dev_root>/dev`, the kernel's list of their majors in `<dev_root>/proc/devices` and the loaded
    module's version (the profile's driver version) in `<dev_root>/proc/driver/nvidia/version`."""
    dev = make_device_nodes(dev_root / "dev", [g.minor for g in profile.gpus])
    make_char(dev / "nvidia-uvm", UVM_MAJOR, 0)
    make_char(dev / "nvidia-uvm-tools", UVM_MAJOR, 1)
    make_char(dev / "nvidia-modeset", NVIDIA_MAJOR, MODESET_MINOR)
    proc = dev_root / "proc"
    proc.mkdir(parents=True, exist_ok=True)
    text = (
        f"Character devices:\n  1 mem\n{NVIDIA_MAJOR} nvidia-frontend\n{CAPS_MAJOR} {CAPS}\n"
        f"{UVM_MAJOR} {UVM}\n\nBlock devices:\n  8 sd\n"
    )
    tmp = proc / ".devices.tmp"
    tmp.write_text(text)
    tmp.replace(proc / "devices")
    # The loaded kernel module's version, in the real file's format; a library of another version
    # fails nvmlInit with NVML_ERROR_LIB_RM_VERSION_MISMATCH.
    nvidia = proc / "driver" / "nvidia"
    nvidia.mkdir(parents=True, exist_ok=True)
    tmp = nvidia / ".version.tmp"
    tmp.write_text(kernel_version_text(profile.driver_version))
    tmp.replace(nvidia / "version")
    make_pci_sysfs(profile, dev_root / "sys")


def make_pci_sysfs(profile: NodeProfile, sys_dir: Path) -> None:
    """Each GPU's PCI device in sysfs, as the kernel shows it: `bus/pci/devices/<bus id>`, a link to
    `devices/<root complex>/<bus id>/`, whose `numa_node` holds its NUMA node (-1: none). A GPU
    whose profile names no PCIe root has no entry (the root cannot be known)."""
    for gpu in profile.gpus:
        if not gpu.pcie_root:
            continue
        bus_id = normalise_pci_bus_id(gpu.pci_bus_id)
        device = sys_dir / "devices" / gpu.pcie_root / bus_id
        device.mkdir(parents=True, exist_ok=True)
        tmp = device / ".numa_node.tmp"
        tmp.write_text(f"{-1 if gpu.numa_node is None else gpu.numa_node}\n")
        tmp.replace(device / "numa_node")
        link = sys_dir / "bus" / "pci" / "devices" / bus_id
        link.parent.mkdir(parents=True, exist_ok=True)
        target = Path("../../..") / "devices" / gpu.pcie_root / bus_id
        if link.is_symlink() and Path(os.readlink(link)) == target:
            continue
        tmp_link = link.with_name(f".{bus_id}.tmp")
        tmp_link.unlink(missing_ok=True)
        tmp_link.symlink_to(target)
        tmp_link.replace(link)


def make_driver_root_view(driver_root: Path, dev_root: Path) -> Path:
    """`<dev_root>/driver-root`: a copy of `driver_root` (real directories and files, its own
    relative links kept, as an installed driver has) with `dev` a link to `<dev_root>/dev`.

    A copy, not links into the cached driver root: NVIDIA's CDI generator resolves links, and a
    `usr` linked to the cache gave containers the libraries at the cache's paths, where no loader
    looks (libnvidia-ml.so.1 not found in the container). The simulated driver is a few hundred KB.
    Made again when `driver_root` is another one (VIEW_SOURCE records which), or over the links
    an older simulator made; a directory there that the simulator did not make is left alone and
    refused (SimulatedNodeError)."""
    view = dev_root / DRIVER_ROOT_VIEW
    source = driver_root.resolve()
    marker = view / VIEW_SOURCE
    if view.exists() or view.is_symlink():
        made_before = view.is_dir() and all(e.is_symlink() for e in view.iterdir())  # the links of old
        if not marker.is_file() and not made_before:
            raise SimulatedNodeError(f"driver root view {view}: not made by the simulator (no {VIEW_SOURCE})")
        if marker.is_file() and marker.read_text() == str(source):
            return view
    tmp = dev_root / f".{DRIVER_ROOT_VIEW}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    dev_root.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(
            source, tmp, symlinks=True, ignore=lambda d, names: ["dev"] if Path(d) == source else []
        )
    else:
        tmp.mkdir()
    (tmp / "dev").symlink_to(Path("..") / "dev")  # relative: the view moves with the dev root
    (tmp / VIEW_SOURCE).write_text(str(source))
    if view.exists():
        shutil.rmtree(view)
    tmp.rename(view)
    return view


def kernel_version_text(version: str) -> str:
    """`/proc/driver/nvidia/version` of a loaded (proprietary) kernel module of `version`."""
    return (
        f"NVRM version: NVIDIA UNIX {os.uname().machine} Kernel Module  {version}  "
        "Fri Feb 28 00:53:10 UTC 2025\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
    )


def prepare_simulated_node(
    profile: str | Path | NodeProfile,
    dev_root: Path,
    driver_root: Path | None = None,
    cache_dir: Path | None = None,
) -> SimulatedNode:
    """Make the node's device nodes and kernel files, find or build its driver root, and tell this
    process's NVML (loaded after this) where the node's kernel is (`SimulatedNode.env`).

    ProfileError: the profile is invalid; SimulatedNodeError: no driver root can be had (the
    message names the missing C compiler or NVML header) or the nodes cannot be made."""
    node = profile if isinstance(profile, NodeProfile) else load_profile(str(profile))
    if driver_root is None:
        try:
            driver_root = ensure_driver_root(cache_dir or default_cache_dir(), node)
        except SimDriverError as exc:
            raise SimulatedNodeError(
                f"simulated node {node.name}: its NVIDIA driver (libnvidia-ml.so.1 and tools) is built "
                f"on first use and cannot be: {exc}; or pass a built one with --driver-root"
            ) from exc
    try:
        make_kernel_files(node, Path(dev_root))
    except RealDriverMajorError as exc:
        raise SimulatedNodeError(f"simulated node {node.name}: {exc}") from exc
    except PermissionError as exc:
        raise SimulatedNodeError(
            f"simulated node {node.name}: cannot make its device nodes under {dev_root}/dev: {exc} "
            "(mknod of character devices needs root: CAP_MKNOD)"
        ) from exc
    make_driver_root_view(Path(driver_root), Path(dev_root))
    simulated = SimulatedNode(node, Path(driver_root), Path(dev_root))
    os.environ.update(simulated.env())  # read by the simulated library at every call
    return simulated
