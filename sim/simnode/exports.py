"""Which NVML functions the simulated libnvidia-ml.so.1 exports, by the driver version it reports.

The real library of a driver exports the functions of its NVML header and no others; a caller
(pynvml) gets "function not found" for the rest. `FIRST_DRIVER` holds, for each function whose
first release matters, the first driver branch that exports it; every other function of
`FUNCTIONS` is exported by every supported driver (all are in the CUDA 12.0 header, driver 525).

Sources: the NVML headers go-nvml ships for each CUDA release (module proxy, `pkg/nvml/nvml.h`):
v0.12.0-x = CUDA 12.0 (525), v0.12.4-x = 12.4 (550), v0.12.9-0 = 12.9 (575), v0.13.0-1 = 13.0 (580),
v0.13.1-0 = 13.1 (590), v0.13.2-0, v0.13.3-x, v0.13.4-x. There is no header between 12.0 and 12.4:
a function first seen in the 12.4 one may already be in 535/545 (the symbol check against Debian's
535.261.03 library settles it).
"""

from __future__ import annotations

# Every function the C source defines (a test checks this list against the built library).
FUNCTIONS = (
    "nvmlInit",
    "nvmlInit_v2",
    "nvmlInitWithFlags",
    "nvmlShutdown",
    "nvmlErrorString",
    "nvmlSystemGetDriverVersion",
    "nvmlSystemGetNVMLVersion",
    "nvmlSystemGetCudaDriverVersion",
    "nvmlSystemGetCudaDriverVersion_v2",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetHandleByUUID",
    "nvmlDeviceGetHandleByPciBusId",
    "nvmlDeviceGetHandleByPciBusId_v2",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetName",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetMinorNumber",
    "nvmlDeviceGetBrand",
    "nvmlDeviceGetArchitecture",
    "nvmlDeviceGetCudaComputeCapability",
    "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetPciInfo_v2",
    "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetNumaNodeId",
    "nvmlDeviceGetVirtualizationMode",
    "nvmlDeviceGetModuleId",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceSetMemoryLimits_v1",
    "nvmlDeviceGetMemoryLimits_v1",
    "nvmlDeviceGetComputeMode",
    "nvmlDeviceSetComputeMode",
    "nvmlDeviceGetPersistenceMode",
    "nvmlDeviceSetPersistenceMode",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetAttributes",
    "nvmlDeviceGetAttributes_v2",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceSetMigMode",
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceIsMigDeviceHandle",
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
    "nvmlDeviceGetGpuInstanceId",
    "nvmlDeviceGetComputeInstanceId",
    "nvmlDeviceGetGpuInstanceProfileInfo",
    "nvmlDeviceGetGpuInstanceProfileInfoV",
    "nvmlDeviceGetGpuInstanceProfileInfoByIdV",
    "nvmlDeviceGetGpuInstancePossiblePlacements",
    "nvmlDeviceGetGpuInstancePossiblePlacements_v2",
    "nvmlDeviceCreateGpuInstance",
    "nvmlDeviceCreateGpuInstanceWithPlacement",
    "nvmlDeviceGetGpuInstanceById",
    "nvmlDeviceGetGpuInstances",
    "nvmlGpuInstanceGetInfo",
    "nvmlGpuInstanceDestroy",
    "nvmlGpuInstanceGetComputeInstanceProfileInfo",
    "nvmlGpuInstanceGetComputeInstanceProfileInfoV",
    "nvmlGpuInstanceCreateComputeInstance",
    "nvmlGpuInstanceGetComputeInstanceById",
    "nvmlComputeInstanceGetInfo",
    "nvmlComputeInstanceGetInfo_v2",
    "nvmlComputeInstanceDestroy",
    "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetNvLinkRemotePciInfo",
    "nvmlDeviceGetNvLinkRemotePciInfo_v2",
    "nvmlDeviceGetNvLinkRemoteDeviceType",
    "nvmlDeviceGetTopologyCommonAncestor",
    "nvmlDeviceGetGpuFabricInfoV",
    "nvmlDeviceGetSupportedEventTypes",
    "nvmlDeviceRegisterEvents",
    "nvmlEventSetCreate",
    "nvmlEventSetWait",
    "nvmlEventSetWait_v2",
    "nvmlEventSetFree",
    "nvmlDeviceGetFieldValues",
)

# function -> first driver branch whose library exports it.
FIRST_DRIVER = {
    "nvmlDeviceGetNumaNodeId": 550,  # first in the CUDA 12.4 header
    "nvmlDeviceGetGpuFabricInfoV": 550,  # first in the CUDA 12.4 header
    "nvmlDeviceGetModuleId": 535,  # not in the CUDA 12.0 header; in Debian's 535.261.03 library
    "nvmlDeviceGetGpuInstanceProfileInfoByIdV": 580,  # first in the NVML 13 (CUDA 13.0) header
    # Per-cgroup memory limits: "new in NVML 13" (issue 24). go-nvml's headers declare them only
    # from v0.13.4-0 on; modelled from 580 as the issue asks until a real 580 library says more.
    "nvmlDeviceSetMemoryLimits_v1": 580,
    "nvmlDeviceGetMemoryLimits_v1": 580,
}

# nvmlDeviceSetComputeMode on a MIG device handle: the headers up to go-nvml v0.13.2-0 (CUDA 13.1
# = driver 590, and 13.2) say "On MIG-enabled GPUs ... changing it is not supported"; v0.13.3-0 is
# the first to say "If MIG is enabled on a GPU, device must be MIG device handle". The driver
# branch of that header is not known here: 600 is the first branch past 13.2's, an estimate.
MIG_COMPUTE_MODE_FROM = 600


def driver_major(version: str) -> int:
    """570 of "570.133.20"."""
    return int(version.split(".", 1)[0])


def exported(version: str) -> list[str]:
    """The functions the library of driver `version` exports, sorted."""
    major = driver_major(version)
    return sorted(f for f in FUNCTIONS if FIRST_DRIVER.get(f, 0) <= major)


def version_script(version: str) -> str:
    """A GNU ld version script exporting exactly `exported(version)`; everything else is local."""
    names = "".join(f"    {name};\n" for name in exported(version))
    return "{\n  global:\n" + names + "  local: *;\n};\n"
