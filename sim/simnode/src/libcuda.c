/* Simulated CUDA driver API (libcuda.so.1): init, version and device enumeration.
 * Return codes follow cuda.h; devices are the visible table GPUs in minor order. */
#include <string.h>

#include "simgpu.h"

typedef int CUresult;
typedef int CUdevice;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
};

static int initialized;
static const struct sim_gpu *visible[SIM_NGPUS + 1];
static int nvisible;

CUresult cuInit(unsigned int flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (!sim_ctl_present()) return CUDA_ERROR_NO_DEVICE;
    nvisible = (int)sim_scan(visible);
    if (nvisible == 0) return CUDA_ERROR_NO_DEVICE;
    initialized = 1;
    return CUDA_SUCCESS;
}

/* Works before cuInit, as the real one does: it is how programs check the driver's CUDA level. */
CUresult cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = SIM_CUDA_VERSION;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = nvisible;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= nvisible) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= nvisible) return CUDA_ERROR_INVALID_DEVICE;
    strncpy(name, visible[dev]->name, (size_t)len - 1);
    name[len - 1] = '\0';
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= nvisible) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = (size_t)(visible[dev]->memory_mib << 20);
    return CUDA_SUCCESS;
}
