"""What NVIDIA's own DRA kubelet plugin (gpu-kubelet-plugin v0.5.0) asks of a simulated node beyond
what dra-gpu asks, answered as NVIDIA's libnvidia-ml answers it (docs/reference/nvidia-dra-driver-
v0.5.0.md §5): the virtualization mode (DynamicMIG), the baseboard module id
(FabricManagerPartitioning), persistence mode (PassthroughSupport), the MIG teardown it runs at
start with DynamicMIG, and a driver root whose `dev/` holds the node's device nodes (its CDI
generator looks there, else in `/`). Each NVML check runs in a child Python (one library per
process), through pynvml as the plugin's go-nvml would call the same C functions."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from simnode.node import (
    DRIVER_ROOT_VIEW,
    VIEW_SOURCE,
    SimulatedNodeError,
    make_driver_root_view,
    prepare_simulated_node,
)
from simnode.profiles import ProfileError, load_profile, parse_profile
from simnode.state import read_state, reboot

from tests.simnode_support import (
    devdir_for,
    libcache,  # noqa: F401 - fixture
    library,
    needs_root,
    needs_toolchain,
    nvml_h,  # noqa: F401 - fixture
    run_child,
)

pytestmark = [needs_toolchain, needs_root]

ERRORS = """
from pynvml import NVMLError
def call(fn, *a):
    try:
        return fn(*a)
    except NVMLError as exc:
        return type(exc).__name__
pynvml.nvmlInit()
gpus = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
"""


@pytest.mark.parametrize("profile", ["dgx-h100", "hgx-2x4", "pcie-pairs"])
def test_bare_metal_gpus_and_their_baseboard_modules(profile: str, libcache: Path, tmp_path: Path) -> None:  # noqa: F811
    body = (
        ERRORS
        + """
out([(pynvml.nvmlDeviceGetUUID(g), call(pynvml.nvmlDeviceGetVirtualizationMode, g),
      call(pynvml.nvmlDeviceGetModuleId, g)) for g in gpus])
"""
    )
    seen = run_child(library(libcache, profile), devdir_for(tmp_path / "dev", profile), body)
    gpus = sorted(load_profile(profile).gpus, key=lambda g: g.minor)
    assert [uuid for uuid, _, _ in seen] == [g.uuid for g in gpus]
    # No hypervisor below a simulated node: NVML_GPU_VIRTUALIZATION_MODE_NONE (0).
    assert {mode for _, mode, _ in seen} == {0}
    assert [module for _, _, module in seen] == [g.module_id for g in gpus]


def test_module_ids_are_the_baseboards() -> None:
    # An HGX board's SXM modules are 1..8; PCIe cards are on no baseboard (nvml.h: "always 0").
    assert sorted(g.module_id for g in load_profile("dgx-h100").gpus) == list(range(1, 9))
    assert sorted(g.module_id for g in load_profile("hgx-2x4").gpus) == [1, 1, 2, 2, 3, 3, 4, 4]
    assert {g.module_id for g in load_profile("pcie-pairs").gpus} == {0}
    assert {g.module_id for g in load_profile("mixed").gpus} == {0}


@pytest.mark.parametrize("value", [9, -1, "1"])
def test_a_module_id_off_the_board_is_refused(value: object) -> None:
    doc = {
        "name": "one",
        "driverVersion": "570.133.20",
        "cudaDriverVersion": 12080,
        "gpus": [
            {
                "index": 0,
                "uuid": "GPU-d680b5d7-e8ae-5bd1-a6aa-8fca9b8b93e4",
                "name": "NVIDIA H100 80GB HBM3",
                "brand": "nvidia",
                "architecture": "hopper",
                "computeCapability": "9.0",
                "memoryMiB": 81559,
                "pciBusId": "00000000:18:00.0",
                "moduleId": value,
            }
        ],
    }
    with pytest.raises(ProfileError, match="moduleId"):
        parse_profile(yaml.safe_dump(doc), "test")


def test_the_virtualization_mode_is_a_whole_gpus(libcache: Path, tmp_path: Path) -> None:  # noqa: F811
    body = (
        ERRORS
        + """
mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpus[0], 0)
out((call(pynvml.nvmlDeviceGetVirtualizationMode, mig), call(pynvml.nvmlDeviceGetModuleId, mig)))
"""
    )
    seen = run_child(library(libcache, "dgx-a100-mig"), devdir_for(tmp_path / "dev", "dgx-a100-mig"), body)
    assert seen == ("NVMLError_InvalidArgument", "NVMLError_InvalidArgument")


PERSISTENCE_SET = (
    ERRORS
    + """
before = [pynvml.nvmlDeviceGetPersistenceMode(g) for g in gpus]
pynvml.nvmlDeviceSetPersistenceMode(gpus[1], pynvml.NVML_FEATURE_ENABLED)
bad = call(pynvml.nvmlDeviceSetPersistenceMode, gpus[2], 7)
out((before, bad))
"""
)
PERSISTENCE_GET = ERRORS + "out([pynvml.nvmlDeviceGetPersistenceMode(g) for g in gpus])\n"


def test_persistence_mode_is_the_kernels_until_reboot(libcache: Path, tmp_path: Path) -> None:  # noqa: F811
    lib = library(libcache, "hgx-2x4")
    dev = devdir_for(tmp_path / "dev", "hgx-2x4")
    before, bad = run_child(lib, dev, PERSISTENCE_SET)
    assert before == [0] * 8  # nvml.h: "After each reboot the persistence mode is reset to Disabled"
    assert bad == "NVMLError_InvalidArgument"
    # Another process (the plugin's next NVML session) sees what was set.
    assert run_child(lib, dev, PERSISTENCE_GET) == [0, 1, 0, 0, 0, 0, 0, 0]
    assert read_state(dev).persistent == {sorted(load_profile("hgx-2x4").gpus, key=lambda g: g.minor)[1].uuid}
    reboot(dev)
    assert run_child(lib, dev, PERSISTENCE_GET) == [0] * 8


def test_persistence_mode_of_a_mig_device_is_refused(libcache: Path, tmp_path: Path) -> None:  # noqa: F811
    body = (
        ERRORS
        + """
mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpus[0], 0)
out((call(pynvml.nvmlDeviceGetPersistenceMode, mig),
     call(pynvml.nvmlDeviceSetPersistenceMode, mig, pynvml.NVML_FEATURE_ENABLED)))
"""
    )
    seen = run_child(library(libcache, "dgx-a100-mig"), devdir_for(tmp_path / "dev", "dgx-a100-mig"), body)
    assert seen == ("NVMLError_InvalidArgument", "NVMLError_InvalidArgument")


# NVIDIA's deleteMigDevice (nvlib.go), run for every MIG device at start with DynamicMIG, then
# its maybeDisableMigMode: the GI by id, its CI by id, destroy CI then GI, MIG mode off once no
# MIG device is left. The steps out of order answer as the driver does.
TEARDOWN = (
    ERRORS
    + """
gpu = gpus[1]
ids = []
for i in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu)):
    try:
        mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, i)
    except pynvml.NVMLError_NotFound:
        continue
    ids.append((pynvml.nvmlDeviceGetGpuInstanceId(mig), pynvml.nvmlDeviceGetComputeInstanceId(mig)))
res = {"ids": ids}
gi = pynvml.nvmlDeviceGetGpuInstanceById(gpu, ids[0][0])
res["giFirst"] = call(pynvml.nvmlGpuInstanceDestroy, gi)
res["migOffEarly"] = call(pynvml.nvmlDeviceSetMigMode, gpu, pynvml.NVML_DEVICE_MIG_DISABLE)
for gi_id, ci_id in ids:
    gi = pynvml.nvmlDeviceGetGpuInstanceById(gpu, gi_id)
    pynvml.nvmlComputeInstanceDestroy(pynvml.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id))
    pynvml.nvmlGpuInstanceDestroy(gi)
res["giGone"] = call(pynvml.nvmlDeviceGetGpuInstanceById, gpu, ids[0][0])
left = [call(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, gpu, i) for i in range(7)]
res["left"] = sum(1 for h in left if h != "NVMLError_NotFound")
res["migOff"] = call(pynvml.nvmlDeviceSetMigMode, gpu, pynvml.NVML_DEVICE_MIG_DISABLE)
res["mode"] = pynvml.nvmlDeviceGetMigMode(gpu)
res["miglessGi"] = call(pynvml.nvmlDeviceGetGpuInstanceById, gpu, ids[0][0])
out(res)
"""
)


def test_mig_teardown_at_start_answers_as_the_driver(libcache: Path, tmp_path: Path) -> None:  # noqa: F811
    profile = load_profile("dgx-a100-mig")
    lib = library(libcache, "dgx-a100-mig")
    dev = devdir_for(tmp_path / "dev", "dgx-a100-mig")
    proc = tmp_path / "proc"
    caps = proc / "driver" / "nvidia" / "capabilities" / f"gpu{profile.gpus[1].minor}" / "mig"
    res = run_child(lib, dev, TEARDOWN, env={"DRA_GPU_SIM_PROC_DIR": str(proc)})
    premade = profile.gpus[1].mig_instances
    assert sorted(res["ids"]) == sorted((m.gi_id, 0) for m in premade)
    assert res["giFirst"] == "NVMLError_InUse"  # "compute instances are active" on it
    assert res["migOffEarly"] == "NVMLError_InUse"
    assert res["giGone"] == "NVMLError_NotFound"  # NVIDIA's code takes that as "already deleted"
    assert res["left"] == 0
    assert res["migOff"] == 0 and res["mode"] == [0, 0]  # activation status: NVML_SUCCESS
    # MIG off: "If device doesn't have MIG mode enabled" - NVIDIA's code treats it as deleted.
    assert res["miglessGi"] == "NVMLError_NotSupported"
    assert not list(caps.rglob("access"))  # the kernel lists no instance any more


def test_the_driver_root_view_holds_the_nodes_devices(tmp_path: Path, nvml_h: Path) -> None:  # noqa: F811
    node = prepare_simulated_node("hgx-2x4", tmp_path / "root")
    view = node.driver_root_view
    assert view == tmp_path / "root" / DRIVER_ROOT_VIEW
    # What NVIDIA's plugin checks (root.go isDevRoot: <driver root>/dev is a directory) and finds.
    assert (view / "dev").is_dir()
    assert (view / "dev" / "nvidiactl").is_char_device()
    assert (view / "dev" / f"nvidia{node.profile.gpus[0].minor}").is_char_device()
    assert (view / "dev").resolve() == node.dev_dir.resolve()
    library_file = view / "usr" / "lib"
    assert sorted(p.name for p in library_file.rglob("libnvidia-ml.so.1")) == ["libnvidia-ml.so.1"]
    assert {p.name for p in view.iterdir()} == {p.name for p in node.driver_root.iterdir()} | {
        "dev",
        VIEW_SOURCE,
    }
    # Real directories and files, no link out of the view: NVIDIA's CDI generator resolves links,
    # and a library reached through one would go into containers at the link target's path.
    assert not (view / "usr").is_symlink()
    for path in view.rglob("*"):
        if path.is_symlink() and path.name != "dev":
            assert path.resolve().is_relative_to(view.resolve()), path
    nvml = next(view.rglob("libnvidia-ml.so.1"))
    assert nvml.resolve().is_relative_to(view.resolve())
    # Our own plugin's driver root is untouched: no dev/ in the shared, cached build.
    assert not (node.driver_root / "dev").exists()
    # Prepared again (a plugin restart), the view is kept as it is.
    before = (view / VIEW_SOURCE).stat().st_mtime_ns
    prepare_simulated_node("hgx-2x4", tmp_path / "root")
    assert (view / VIEW_SOURCE).stat().st_mtime_ns == before


def test_the_view_follows_another_driver_root(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    (old / "usr").mkdir(parents=True)
    (old / "opt").mkdir()
    (new / "usr").mkdir(parents=True)
    view = make_driver_root_view(old, tmp_path / "root")
    assert {p.name for p in view.iterdir()} == {"usr", "opt", "dev", VIEW_SOURCE}
    make_driver_root_view(new, tmp_path / "root")
    assert {p.name for p in view.iterdir()} == {"usr", "dev", VIEW_SOURCE}
    assert (view / VIEW_SOURCE).read_text() == str(new.resolve())
    assert os.readlink(view / "dev") == str(Path("..") / "dev")


def test_the_view_leaves_what_is_not_its_own(tmp_path: Path) -> None:
    (tmp_path / "driver" / "usr").mkdir(parents=True)
    (tmp_path / "root" / DRIVER_ROOT_VIEW / "usr").mkdir(parents=True)
    with pytest.raises(SimulatedNodeError, match=r"driver root view .*: not made by the simulator"):
        make_driver_root_view(tmp_path / "driver", tmp_path / "root")
    assert (tmp_path / "root" / DRIVER_ROOT_VIEW / "usr").is_dir()


def test_the_view_replaces_the_links_an_older_simulator_made(tmp_path: Path) -> None:
    (tmp_path / "driver" / "usr" / "bin").mkdir(parents=True)
    old = tmp_path / "root" / DRIVER_ROOT_VIEW
    old.mkdir(parents=True)
    (old / "usr").symlink_to(tmp_path / "driver" / "usr")
    (old / "dev").symlink_to(Path("..") / "dev")
    view = make_driver_root_view(tmp_path / "driver", tmp_path / "root")
    assert not (view / "usr").is_symlink() and (view / "usr" / "bin").is_dir()
    assert (view / VIEW_SOURCE).is_file()
