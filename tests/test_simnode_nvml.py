"""The simulated libnvidia-ml.so.1 (sim/simnode) under the real pynvml: the same node as the
profile's FakeNvml, NVML's answers by driver version, and how it is loaded.

Each check runs in a child process (one libnvidia-ml.so.1 per process); see simnode_support.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from simnode import exports
from simnode.state import read_state

from tests.simnode_support import (
    H200,
    devdir_for,
    libcache,  # noqa: F401 - fixture
    library,
    needs_root,
    needs_toolchain,
    nvml_h,  # noqa: F401 - fixture
    run_child,
)

pytestmark = [needs_toolchain, needs_root]

PROFILES = ["dgx-a100-mig", "dgx-h100-mig", "hgx-2x4", "dgx-h100", "mixed", "pcie-pairs", str(H200)]
EQUIVALENCE = """
from simnode.fake import simulated_nvml
from simnode.profiles import load_profile
from dra_gpu.discovery.nvml_discovery import discover
fake, pcie_root = simulated_nvml(load_profile(sys.argv[2]))
real = discover(pynvml, "node-a", pcie_root, dynamic_mig=True)
out((real, discover(fake, "node-a", pcie_root, dynamic_mig=True)))
"""


def _without_mig_devices(inv: object) -> object:
    return dataclasses.replace(inv, gpus=[dataclasses.replace(g, mig_devices=[]) for g in inv.gpus])  # type: ignore[type-var,attr-defined]


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: Path(p).stem)
def test_discovery_over_the_c_library_matches_the_fake(profile: str, libcache: Path, tmp_path: Path) -> None:  # noqa: F811
    lib = library(libcache, profile)
    real, fake = run_child(lib, devdir_for(tmp_path / "dev", profile), EQUIVALENCE, profile)
    if any(g.mig_devices for g in fake.gpus) and not any(g.mig_devices for g in real.gpus):
        # Issue 24 defect 3: below 580 NVML has no ...ProfileInfoByIdV, which discovery still
        # needs for pre-made MIG devices; real NVML answers FunctionNotFound, and so does this one.
        assert int(fake.driver_version.split(".")[0]) < 580
        assert _without_mig_devices(real) == _without_mig_devices(fake)
    else:
        assert real == fake
    assert real.gpus and not real.skipped


def test_premade_mig_devices_match_from_driver_580(libcache: Path, tmp_path: Path) -> None:  # noqa: F811
    lib = library(libcache, "dgx-a100-mig", "580.95.05")
    real, fake = run_child(lib, devdir_for(tmp_path / "dev", "dgx-a100-mig"), EQUIVALENCE, "dgx-a100-mig")
    assert real.driver_version == "580.95.05"
    assert [g.mig_devices for g in real.gpus] == [g.mig_devices for g in fake.gpus]
    assert sum(len(g.mig_devices) for g in real.gpus) == 10
    assert dataclasses.replace(real, driver_version=fake.driver_version) == fake


VERSIONED = """
import os
from pynvml import NVMLError, NVMLError_FunctionNotFound, NVMLError_NotSupported
res = {}
def call(name, fn, *a):
    try:
        res[name] = fn(*a)
    except NVMLError as exc:
        res[name] = type(exc).__name__
pynvml.nvmlInit()
gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
call("byIdV", lambda: pynvml.nvmlDeviceGetGpuInstanceProfileInfoById(gpu, 9).id)
THREE_SLICE = pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE
call("profileInfoV", lambda: pynvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu, THREE_SLICE).id)
call("attributesWholeGpu", lambda: pynvml.nvmlDeviceGetAttributes(gpu).multiprocessorCount)
for fn in ("nvmlDeviceSetMemoryLimits_v1", "nvmlDeviceGetMemoryLimits_v1"):
    call(fn, lambda: pynvml._nvmlGetFunctionPointer(fn) is not None)
# a MIG device: 3g.40gb at slice 4, its full compute instance
placement = pynvml.c_nvmlGpuInstancePlacement_t(); placement.start, placement.size = 4, 4
gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, 9, ctypes.byref(placement))
ci = pynvml.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
call("attributesMig", lambda: pynvml.nvmlDeviceGetAttributes(mig).multiprocessorCount)
call("setComputeModeMig", pynvml.nvmlDeviceSetComputeMode, mig, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
call("getComputeModeMig", pynvml.nvmlDeviceGetComputeMode, mig)
call("setComputeModeParent", pynvml.nvmlDeviceSetComputeMode, gpu, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
whole = pynvml.nvmlDeviceGetHandleByIndex(1)
pynvml.nvmlDeviceSetMigMode(whole, 0)
call("setComputeModeWholeGpu", pynvml.nvmlDeviceSetComputeMode, whole, pynvml.NVML_COMPUTEMODE_PROHIBITED)
call("getComputeModeWholeGpu", pynvml.nvmlDeviceGetComputeMode, whole)
if res["nvmlDeviceSetMemoryLimits_v1"] is True:
    class Limits(ctypes.Structure):
        _fields_ = [
            ("nameSpace", ctypes.c_char_p),
            ("softLimit", ctypes.c_ulonglong),
            ("hardLimit", ctypes.c_ulonglong),
        ]
    class GetLimits(ctypes.Structure):
        _fields_ = Limits._fields_ + [("currentUsed", ctypes.c_ulonglong)]
    lib = pynvml.nvmlLib
    cg = sys.argv[2].encode()
    res["setLimits"] = lib.nvmlDeviceSetMemoryLimits_v1(whole, ctypes.byref(Limits(cg, 1 << 30, 2 << 30)))
    got = GetLimits(cg, 0, 0, 0)
    rc = lib.nvmlDeviceGetMemoryLimits_v1(whole, ctypes.byref(got))
    res["getLimits"] = (rc, got.softLimit, got.hardLimit)
    res["setLimitsMig"] = lib.nvmlDeviceSetMemoryLimits_v1(mig, ctypes.byref(Limits(cg, 1, 2)))
    nope = Limits(cg + b"/nope", 1, 2)
    res["setLimitsNoCgroup"] = lib.nvmlDeviceSetMemoryLimits_v1(whole, ctypes.byref(nope))
    res["setLimitsOverTotal"] = lib.nvmlDeviceSetMemoryLimits_v1(whole, ctypes.byref(Limits(cg, 0, 1 << 50)))
    res["setLimitsSoftOverHard"] = lib.nvmlDeviceSetMemoryLimits_v1(whole, ctypes.byref(Limits(cg, 2, 1)))
    kept = cg + b"-kept"
    os.mkdir(kept)
    kept_limits = Limits(kept, 3 << 30, 4 << 30)
    res["setLimitsKept"] = lib.nvmlDeviceSetMemoryLimits_v1(whole, ctypes.byref(kept_limits))
    res["wholeUuid"] = pynvml.nvmlDeviceGetUUID(whole)
    # The cgroup removed (its container ended): its limit goes with it.
    os.rmdir(cg)
    got = GetLimits(cg, 0, 0, 0)
    res["getLimitsRemovedCgroup"] = lib.nvmlDeviceGetMemoryLimits_v1(whole, ctypes.byref(got))
out(res)
"""


@pytest.mark.parametrize(
    ("version", "by_id", "limits", "mig_compute_mode"),
    [
        ("570.133.20", "NVMLError_FunctionNotFound", False, False),
        ("580.95.05", 9, True, False),
        (f"{exports.MIG_COMPUTE_MODE_FROM}.10.01", 9, True, True),
    ],
)
def test_answers_that_depend_on_the_driver_version(
    version: str,
    by_id: object,
    limits: bool,
    mig_compute_mode: bool,
    libcache: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    lib = library(libcache, "dgx-h100-mig", version)
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    devdir = devdir_for(tmp_path / "dev", "dgx-h100-mig")
    res = run_child(lib, devdir, VERSIONED, str(cgroup))
    assert res["byIdV"] == by_id
    assert res["profileInfoV"] == 9  # ...ProfileInfoV is there on every version
    # "This API currently only supports MIG device handles", on every version.
    assert res["attributesWholeGpu"] == "NVMLError_NotSupported"
    assert res["attributesMig"] == 60
    not_found = "NVMLError_FunctionNotFound"
    assert res["nvmlDeviceSetMemoryLimits_v1"] == (True if limits else not_found)
    assert res["nvmlDeviceGetMemoryLimits_v1"] == (True if limits else not_found)
    if mig_compute_mode:
        assert (res["setComputeModeMig"], res["getComputeModeMig"]) == (None, 3)
    else:
        assert (res["setComputeModeMig"], res["getComputeModeMig"]) == ("NVMLError_NotSupported", 0)
    assert res["setComputeModeParent"] == "NVMLError_NotSupported"  # MIG is on: ask its MIG devices
    assert (res["setComputeModeWholeGpu"], res["getComputeModeWholeGpu"]) == (None, 2)  # PROHIBITED
    if limits:
        assert res["setLimits"] == 0
        assert res["getLimits"] == (0, 1 << 30, 2 << 30)
        assert res["setLimitsMig"] == 3  # NVML_ERROR_NOT_SUPPORTED: "MIG handles are not supported"
        assert res["setLimitsNoCgroup"] == 17  # NVML_ERROR_OPERATING_SYSTEM
        assert res["setLimitsOverTotal"] == 2  # INVALID_ARGUMENT: "a limit exceeds total device memory"
        assert res["setLimitsSoftOverHard"] == 2  # INVALID_ARGUMENT: "the softLimit exceeds the hardLimit"
        # "Removing the cgroup will also clear any limits": gone for NVML and for the state reader.
        assert res["getLimitsRemovedCgroup"] == 17  # OPERATING_SYSTEM: "the cgroup path cannot be opened"
        # What the kernel keeps: only the limit of the cgroup that still exists.
        assert res["setLimitsKept"] == 0
        kept = {res["wholeUuid"]: {f"{cgroup}-kept": (3 << 30, 4 << 30)}}
        assert read_state(devdir).memory_limits == kept


@pytest.mark.parametrize("version", ["535.261.03", "550.163.01", "570.133.20", "580.95.05"])
def test_the_library_exports_only_what_the_real_one_of_its_version_does(version: str, libcache: Path) -> None:  # noqa: F811
    lib = library(libcache, "dgx-h100", version)
    nm = subprocess.run(["nm", "-D", "--defined-only", str(lib)], check=True, capture_output=True, text=True)
    names = sorted(m.group(1) for m in re.finditer(r" T (\w+)$", nm.stdout, re.M))
    assert names == exports.exported(version)
    assert ("nvmlDeviceGetGpuInstanceProfileInfoByIdV" in names) == (version >= "580")


LOADING = """
import os
pynvml.nvmlInit()
maps = [line.split()[-1] for line in open("/proc/self/maps") if "libnvidia-ml" in line]
out({
    "name": pynvml.nvmlLib._name,
    "same": pynvml.nvmlLib._handle == ctypes.CDLL(LIB)._handle,
    "mapped": sorted(set(maps)),
    "ld_library_path": os.environ.get("LD_LIBRARY_PATH"),
    "driver": pynvml.nvmlSystemGetDriverVersion(),
    "count": pynvml.nvmlDeviceGetCount(),
})
"""


def test_pynvml_binds_to_the_library_loaded_by_full_path(libcache: Path, tmp_path: Path) -> None:  # noqa: F811
    lib = library(libcache, "dgx-h100")
    res = run_child(lib, devdir_for(tmp_path / "dev", "dgx-h100"), LOADING)
    assert res["name"] == "libnvidia-ml.so.1"  # pynvml asked by SONAME ...
    assert res["same"]  # ... and got the library already loaded by full path
    assert res["mapped"] == [str(lib.resolve())]  # one libnvidia-ml in the process
    assert res["ld_library_path"] is None  # nothing came through the loader path
    assert (res["driver"], res["count"]) == ("570.133.20", 8)


def test_without_nvidiactl_init_fails_like_the_real_library(libcache: Path, tmp_path: Path) -> None:  # noqa: F811
    lib = library(libcache, "dgx-h100")
    dev = devdir_for(tmp_path / "dev", "dgx-h100")
    (dev / "nvidiactl").unlink()
    body = """
try:
    pynvml.nvmlInit()
    out("initialised")
except pynvml.NVMLError as exc:
    out(exc.value)
"""
    assert run_child(lib, dev, body) == 9  # NVML_ERROR_DRIVER_NOT_LOADED, as measured on Debian's


def test_struct_versions_are_checked(libcache: Path, tmp_path: Path) -> None:  # noqa: F811
    lib = library(libcache, "dgx-h100-mig", "580.95.05")
    body = """
pynvml.nvmlInit()
gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
lib = pynvml.nvmlLib
res = {}
info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
info.version = 0x01000098  # a version this NVML does not know
res["profileInfoV"] = lib.nvmlDeviceGetGpuInstanceProfileInfoV(gpu, 2, ctypes.byref(info))
res["byIdV"] = lib.nvmlDeviceGetGpuInstanceProfileInfoByIdV(gpu, 9, ctypes.byref(info))
good = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu, 2)
res["good"] = (good.version, good.id, good.name)  # the driver leaves version 0 (H200, 580)
mem = pynvml.c_nvmlMemory_v2_t(); mem.version = 1
res["memoryV2Bad"] = lib.nvmlDeviceGetMemoryInfo_v2(gpu, ctypes.byref(mem))
res["memoryV2"] = pynvml.nvmlDeviceGetMemoryInfo(gpu, version=pynvml.nvmlMemory_v2).total
fab = pynvml.c_nvmlGpuFabricInfoV_t(); fab.version = 7
res["fabricBad"] = lib.nvmlDeviceGetGpuFabricInfoV(gpu, ctypes.byref(fab))
count = ctypes.c_uint(1)
placements = (pynvml.c_nvmlGpuInstancePlacement_t * 1)()
rc = lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2(gpu, 19, placements, ctypes.byref(count))
res["placementsShort"] = (rc, count.value)
info2 = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
res["profileOutOfRange"] = lib.nvmlDeviceGetGpuInstanceProfileInfoV(gpu, 99, ctypes.byref(info2))
res["uninitialisedAfterShutdown"] = (pynvml.nvmlShutdown(), lib.nvmlDeviceGetCount_v2(ctypes.byref(count)))
out(res)
"""
    res = run_child(lib, devdir_for(tmp_path / "dev", "dgx-h100-mig"), body)
    assert res["profileInfoV"] == 25  # NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    assert res["byIdV"] == 25
    assert res["good"] == (0, 9, "MIG 3g.40gb")  # pynvml decodes the name
    assert res["memoryV2Bad"] == 25
    assert res["memoryV2"] == 81559 << 20
    assert res["fabricBad"] == 25
    assert res["placementsShort"] == (7, 7)  # NVML_ERROR_INSUFFICIENT_SIZE, count = what is needed
    assert res["profileOutOfRange"] == 2  # NVML_ERROR_INVALID_ARGUMENT
    assert res["uninitialisedAfterShutdown"] == (None, 1)  # NVML_ERROR_UNINITIALIZED


FAILURES_DOC = {
    "name": "failures",
    "driverVersion": "570.133.20",
    "cudaDriverVersion": 12080,
    "defaults": {
        "name": "NVIDIA H100 80GB HBM3",
        "brand": "nvidia",
        "architecture": "hopper",
        "computeCapability": "9.0",
        "memoryMiB": 81559,
        "nvlinkCount": 18,
    },
    "gpus": [
        {
            "index": i,
            "uuid": f"GPU-{i:08x}-0000-4000-8000-{i:012x}",
            "pciBusId": f"00000000:{0x10 + i:02X}:00.0",
            "numaNode": i // 2,
        }
        for i in range(4)
    ],
}


def test_the_profiles_injected_nvml_errors_answer_as_on_the_fake(libcache: Path, tmp_path: Path) -> None:  # noqa: F811
    doc = json.loads(json.dumps(FAILURES_DOC))
    doc["gpus"][0]["nvlinks"] = [{"remote": doc["gpus"][1]["pciBusId"], "links": 4}]
    doc["gpus"][1]["nvlinks"] = [{"remote": doc["gpus"][0]["pciBusId"], "links": 4}]
    doc["gpus"][0]["nvmlErrors"] = {
        "nvmlDeviceGetNvLinkState": "NotSupported",
        "nvmlDeviceGetBrand": "Unknown",
    }
    doc["gpus"][1]["nvmlErrors"] = {"nvmlDeviceGetMemoryInfo": "NotSupported"}
    doc["gpus"][2]["nvmlErrors"] = {"*": "GpuIsLost"}
    doc["gpus"][3]["nvmlErrors"] = {"nvmlDeviceGetUUID": "Unknown"}
    path = tmp_path / "failures.yaml"
    path.write_text(yaml.safe_dump(doc))
    lib = library(libcache, path)
    real, fake = run_child(lib, devdir_for(tmp_path / "dev", path), EQUIVALENCE, str(path))
    assert real == fake
    assert [g.index for g in real.gpus] == [0, 1]
    assert (real.gpus[0].nvlinks, real.gpus[0].brand, real.gpus[1].memory_bytes) == ([], None, None)
    assert len(real.skipped) == 2

    doc["nvmlErrors"] = {"nvmlInit": "DriverNotLoaded"}
    path.write_text(yaml.safe_dump(doc))
    body = """
try:
    pynvml.nvmlInit()
    out("initialised")
except pynvml.NVMLError as exc:
    out(exc.value)
"""
    assert run_child(library(libcache, path), devdir_for(tmp_path / "dev2", path), body) == 9


def test_one_shot_failures_from_the_environment(libcache: Path, tmp_path: Path) -> None:  # noqa: F811
    lib = library(libcache, "dgx-h100-mig")
    body = """
pynvml.nvmlInit()
gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
placement = pynvml.c_nvmlGpuInstancePlacement_t(); placement.start, placement.size = 0, 4
res = []
for _ in range(2):
    try:
        gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, 9, ctypes.byref(placement))
        res.append(pynvml.nvmlGpuInstanceGetInfo(gi).id)
    except pynvml.NVMLError as exc:
        res.append(exc.value)
out(res)
"""
    env = {"DRA_GPU_SIM_NVML_FAIL": "nvmlDeviceCreateGpuInstanceWithPlacement=Unknown"}
    assert run_child(lib, devdir_for(tmp_path / "dev", "dgx-h100-mig"), body, env=env) == [999, 1]
