"""NVML functions that older supported drivers lack, and what the product does instead.

The product supports drivers from the 535 branch on. Every NVML call it makes resolves, through
`pynvml`, to a C symbol of `libnvidia-ml.so.1`; `tests/test_nvml_symbols.py` resolves each of them in
NVIDIA's real libraries of every driver version the tests carry (Debian's 535.261.03 and
550.163.01) and fails for a symbol missing in one of them unless `FALLBACKS` names it here, with
the driver branch that introduced it, what the product does where it is missing, and the test that
runs that path. pynvml raises `NVMLError_FunctionNotFound` for a missing symbol.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Fallback:
    """What the product does where a driver's libnvidia-ml lacks a symbol."""

    since: int  # the first driver branch whose libnvidia-ml exports it (e.g. 580)
    instead: str  # what the product does on older drivers
    test: str  # "tests/<file>.py::<test>": the test that runs the fallback path


FALLBACKS: Mapping[str, Fallback] = {
    # NVML 13 header (CUDA 13, driver 580); not in 535.261.03 nor 550.163.01 (nor 570).
    "nvmlDeviceGetGpuInstanceProfileInfoByIdV": Fallback(
        since=580,
        instead=(
            "gpu_instance_profile_info_by_id(): nvmlDeviceGetGpuInstanceProfileInfo(V) over the "
            "profile indices, the one whose info.id matches"
        ),
        test="tests/test_nvml_compat.py::test_premade_mig_devices_published_without_profile_info_by_id",
    ),
    # Per-cgroup GPU memory limits, NVML 13 (driver 580); not in 535, 550 or 570.
    **{
        symbol: Fallback(
            since=580,
            instead=(
                "memory shares are held by their MPS daemons' limits only (cooperative): "
                "memory_limits.detect finds no nvmlDeviceSetMemoryLimits_v1 and adds no hook; the "
                "claim's status says so"
            ),
            test="tests/plugin/test_memory_limits.py::test_driver_limits_need_driver_580_cgroup_v2_and_the_hook",
        )
        for symbol in ("nvmlDeviceSetMemoryLimits_v1", "nvmlDeviceGetMemoryLimits_v1")
    },
    # Not in 535.261.03, in 550.163.01 (CUDA 12.4 headers).
    "nvmlDeviceGetGpuFabricInfoV": Fallback(
        since=550,
        instead=(
            "no multi-node NVLink fabric registration: the GPUs' NVLink domains come from their "
            "own NVLink links (multi-node NVLink needs a newer driver anyway)"
        ),
        test="tests/test_nvml_compat.py::test_nvlink_domains_without_fabric_info",
    ),
    # NVML 13 header (CUDA 13, driver 580); not in 535, 550 or 570. go-nvlib calls it only where
    # the library has it, and NVIDIA's driver then publishes addressingMode; so does dra-gpu.
    "nvmlDeviceGetAddressingMode": Fallback(
        since=580,
        instead="the addressingMode attribute is left out (discovery's optional call answers None)",
        test="tests/test_slices.py::test_addressing_mode_is_published_where_nvml_gives_it",
    ),
    # Not in 535.261.03, in 550.163.01 (CUDA 12.3 headers, driver 545).
    "nvmlDeviceGetNumaNodeId": Fallback(
        since=545,
        instead="the numaNode attribute is left out (discovery's optional call answers None)",
        test="tests/test_nvml_compat.py::test_numa_node_left_out_without_get_numa_node_id",
    ),
}


def driver_branch(version: str) -> int:
    """'535.261.03' -> 535."""
    return int(version.split(".", 1)[0])


def exported_in(symbol: str, driver_version: str) -> bool:
    """Whether a driver's libnvidia-ml exports `symbol`, as far as FALLBACKS knows (others: yes)."""
    fallback = FALLBACKS.get(symbol)
    return fallback is None or driver_branch(driver_version) >= fallback.since


def gpu_instance_profile_info_by_id(nv: Any, device: Any, profile_id: int) -> Any:
    """The GPU-instance profile info (a v2 struct) of `profile_id` on `device`.

    `nvmlDeviceGetGpuInstanceProfileInfoByIdV` where the driver has it (580 on); before that the
    profile indices are asked with `nvmlDeviceGetGpuInstanceProfileInfo(V)` and the one whose
    `id` matches is returned. Raises NVMLError_NotFound when no index has that id.
    """
    try:
        return nv.nvmlDeviceGetGpuInstanceProfileInfoById(device, profile_id)
    except nv.NVMLError_FunctionNotFound:
        pass
    for index in range(int(nv.NVML_GPU_INSTANCE_PROFILE_COUNT)):
        try:
            info = nv.nvmlDeviceGetGpuInstanceProfileInfo(device, index)
        except (nv.NVMLError_NotSupported, nv.NVMLError_InvalidArgument):
            continue  # not a profile of this GPU
        if int(info.id) == int(profile_id):
            return info
    raise nv.NVMLError(nv.NVML_ERROR_NOT_FOUND)
