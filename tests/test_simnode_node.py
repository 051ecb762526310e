"""A simulated node through the node backend (`dra_gpu.node.backend`, `simnode.node`): the
state the plugin changes (compute modes, time slices, MIG instances and their capability files)
is the simulated kernel's, so the plugin, NVIDIA's nvidia-smi and a restarted plugin agree. Each
plugin process is a child (one simulated libnvidia-ml.so.1 per process)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest
from simnode.builder import nvml_library
from simnode.node import SimulatedNodeError, prepare_simulated_node
from simnode.profiles import load_profile
from simnode.state import read_state

from dra_gpu.discovery.nvml_discovery import sysfs_pcie_root
from dra_gpu.model.inventory import MigPlacement
from dra_gpu.node.backend import open_backend
from dra_gpu.plugin.compute_mode import EXCLUSIVE_PROCESS, ComputeModes
from dra_gpu.plugin.driver_files import DriverFiles
from dra_gpu.plugin.mig_lifecycle import MigInstances
from dra_gpu.plugin.sharing import node_sharing
from dra_gpu.plugin.timeslice import LEVELS
from tests.simnode_support import in_child, needs_root, needs_toolchain, nvml_h  # noqa: F401 - a fixture

pytestmark = [needs_toolchain, needs_root, pytest.mark.usefixtures("nvml_h")]


def set_modes_and_slices(dev_root: Path) -> list[str]:
    """A plugin process: GPU 0 to EXCLUSIVE_PROCESS (MPS), GPU 1's time slice Long."""
    backend = open_backend("hgx-2x4", None, dev_root)
    inventory = backend.discover("node-a")
    files = DriverFiles(backend.driver_root, inventory.driver_version)
    with tempfile.TemporaryDirectory() as mps:
        sharing = node_sharing(Path(mps), files, backend.nvml, backend.tool_env)
        gpus = [g.uuid for g in inventory.gpus]
        sharing.modes.set(gpus[0], EXCLUSIVE_PROCESS)
        assert sharing.timeslices is not None
        sharing.timeslices.set(gpus[1], LEVELS["Long"])
    return gpus


def read_mode(dev_root: Path, uuid: str) -> int:
    """A restarted plugin process reads the mode back."""
    backend = open_backend("hgx-2x4", None, dev_root)
    return ComputeModes(backend.nvml).get(uuid)


def test_compute_modes_and_time_slices_are_the_simulated_kernels(tmp_path: Path) -> None:
    dev_root = tmp_path / "simulated-root"
    gpus = in_child(set_modes_and_slices, dev_root)
    assert in_child(read_mode, dev_root, gpus[0]) == EXCLUSIVE_PROCESS
    assert read_state(dev_root / "dev").compute_mode(gpus[0]) == EXCLUSIVE_PROCESS
    # NVIDIA's nvidia-smi of the driver root, run as the plugin runs it (LD_PRELOAD of the one
    # library, told the node's device directory), sees what the plugin set.
    node = prepare_simulated_node("hgx-2x4", dev_root)
    env = {"PATH": "/usr/bin:/bin", "LD_PRELOAD": str(nvml_library(node.driver_root)), **node.env()}
    smi = str(node.driver_root / "usr/bin/nvidia-smi")
    query = [smi, "--query-gpu=uuid,compute_mode", "--format=csv,noheader"]
    modes = dict(line.split(", ") for line in subprocess.check_output(query, env=env, text=True).splitlines())
    assert modes[gpus[0]] == "Exclusive_Process" and modes[gpus[1]] == "Default"
    listed = subprocess.check_output([smi, "compute-policy", "-l"], env=env, text=True)
    assert f"({gpus[1]}): Timeslice 3" in listed and f"({gpus[0]}): Timeslice 0" in listed


def make_and_destroy_an_instance(dev_root: Path) -> tuple[list[str], list[str], list[str]]:
    """Dynamic MIG on dgx-h100-mig: a 3g.40gb instance at memory slice 4, then destroyed; the
    capability files under proc/ before, while it exists, and after."""
    backend = open_backend("dgx-h100-mig", None, dev_root)
    inventory = backend.discover("node-a", dynamic_mig=True)
    gpu = inventory.gpus[0]
    caps = dev_root / "proc/driver/nvidia/capabilities" / f"gpu{gpu.minor}" / "mig"

    def listing() -> list[str]:
        return sorted(
            f"{p.relative_to(caps).as_posix()}={p.read_text().split()[1]}" for p in caps.rglob("access")
        )

    before = listing()
    placement = next(p for p in gpu.mig_placements() if p.profile.name == "3g.40gb" and p.start == 4)
    assert isinstance(placement, MigPlacement)
    mig = MigInstances(backend.nvml)
    gi = mig.create_gpu_instance(gpu.uuid, placement)
    ci = mig.create_compute_instance(gpu.uuid, gi, placement)
    during = listing()
    (made,) = read_state(dev_root / "dev", load_profile("dgx-h100-mig")).instances[gpu.uuid]
    assert made["profile"] == "3g.40gb" and (made["placement"], made["giId"], made["ciId"]) == (4, gi, ci)
    assert made["uuid"] == mig.mig_device(gpu.uuid, gi, ci, placement).uuid
    assert mig.destroy(gpu.uuid, gi, placement.profile.profile_id, placement.start)
    return before, during, listing()


def test_mig_capability_files_follow_the_instances(tmp_path: Path) -> None:
    before, during, after = in_child(make_and_destroy_an_instance, tmp_path / "simulated-root")
    assert before == [] and after == []
    # The driver's mig-minors numbering: per GPU 15 GIs of 9 minors (the GI's, then CIs 0-7).
    gi = int(during[0].split("/")[0].removeprefix("gi"))
    assert during == [f"gi{gi}/access={3 + gi * 9}", f"gi{gi}/ci0/access={3 + gi * 9 + 1}"]


def loaded_nvml_log(dev_root: Path) -> tuple[list[str], str]:
    """A plugin process's log records of loading NVML, and the library file it loaded."""
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("dra_gpu").addHandler(handler)
    logging.getLogger("dra_gpu").setLevel(logging.INFO)
    backend = open_backend("hgx-2x4", None, dev_root)
    return [m for m in records if m.startswith("NVML loaded")], str(nvml_library(backend.driver_root))


def test_the_library_nvml_was_loaded_from_is_logged(tmp_path: Path) -> None:
    """One line says which file of the driver root NVML is (what an operator checks first)."""
    lines, library = in_child(loaded_nvml_log, tmp_path / "simulated-root")
    assert len(lines) == 1, lines
    assert lines[0].startswith("NVML loaded library=") and "driver_root=" in lines[0], lines
    # The file itself (links followed inside the driver root), not the SONAME link.
    logged = Path(lines[0].split("library=", 1)[1].split()[0])
    assert logged == Path(library).resolve() or logged.resolve() == Path(library).resolve(), lines


def test_no_c_compiler_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(SimulatedNodeError, match=r"no C compiler .*no-such-cc.* --driver-root"):
        prepare_simulated_node(load_profile("hgx-2x4"), tmp_path / "root", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "root").exists()
    assert os.environ.get("DRA_GPU_SIM_DEV_DIR") != str(tmp_path / "root" / "dev")


def pcie_roots(dev_root: Path) -> dict[str, str | None]:
    """A plugin process: each GPU's PCIe root as discovery reads it (sysfs under the dev root)."""
    inventory = open_backend("pcie-pairs", None, dev_root).discover("node-a")
    return {g.pci_bus_id: g.pcie_root for g in inventory.gpus}


def test_pcie_roots_come_from_the_nodes_sysfs_as_on_a_real_node(tmp_path: Path) -> None:
    """The simulated node renders its GPUs' PCI devices in sysfs (a link from bus/pci/devices into
    devices/<root complex>/, with numa_node), and the driver reads the roots there: the one code
    path a real node takes, no lookup of the profile's own."""
    dev_root = tmp_path / "simulated-root"
    profile = load_profile("pcie-pairs")
    roots = in_child(pcie_roots, dev_root)
    wanted = {g.pci_bus_id.lower()[-12:]: g.pcie_root for g in profile.gpus}
    assert {bus[-12:]: root for bus, root in roots.items()} == wanted
    assert len(set(wanted.values())) > 1
    gpu = profile.gpus[0]
    entry = dev_root / "sys" / "bus" / "pci" / "devices" / gpu.pci_bus_id.lower()[4:]
    assert entry.is_symlink() and entry.resolve().parent.name == gpu.pcie_root
    numa = (entry / "numa_node").read_text().strip()
    assert numa == str(-1 if gpu.numa_node is None else gpu.numa_node)
    # A bus id without an entry, or one whose device is not under a root complex: unknown.
    lookup = sysfs_pcie_root(str(dev_root / "sys"))
    assert lookup("0000:99:00.0") is None
    odd = dev_root / "sys" / "devices" / "platform" / "0000:98:00.0"
    odd.mkdir(parents=True)
    (dev_root / "sys" / "bus" / "pci" / "devices" / "0000:98:00.0").symlink_to(odd)
    assert lookup("0000:98:00.0") is None
