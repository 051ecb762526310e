/* Simulated NVML (libnvidia-ml.so.1): the subset of the real C API that nvidia-smi and pynvml use.
 * Signatures and return codes follow nvml.h; a device handle points at its GPU table entry. */
#include <string.h>

#include "simgpu.h"

typedef int nvmlReturn_t;
typedef const struct sim_gpu *nvmlDevice_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_UNKNOWN = 999,
};

typedef struct { /* nvmlPciInfo_t (v2/v3 layout) */
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;

static int refs;                           /* nvmlInit/nvmlShutdown nest, as in the real library */
static const struct sim_gpu *visible[SIM_NGPUS + 1]; /* +1: a table may be empty */
static unsigned nvisible;

static nvmlReturn_t copy_str(char *dst, unsigned int len, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    if (refs == 0) {
        if (!sim_ctl_present()) return NVML_ERROR_DRIVER_NOT_LOADED;
        nvisible = sim_scan(visible); /* the device list is fixed at init, like the real one */
    }
    refs++;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    refs--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    return copy_str(version, length, SIM_DRIVER_VERSION);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) {
    if (!v) return NVML_ERROR_INVALID_ARGUMENT;
    *v = SIM_CUDA_VERSION;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) { return nvmlSystemGetCudaDriverVersion_v2(v); }

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = nvisible;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= nvisible) return NVML_ERROR_INVALID_ARGUMENT;
    *device = visible[index];
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int i, nvmlDevice_t *d) {
    return nvmlDeviceGetHandleByIndex_v2(i, d);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    for (unsigned i = 0; device && index && i < nvisible; i++)
        if (visible[i] == device) return *index = i, NVML_SUCCESS;
    return NVML_ERROR_INVALID_ARGUMENT;
}

/* Every per-device getter checks init and the handle the same way. */
#define CHECK(dev, out)                                    \
    do {                                                   \
        if (refs == 0) return NVML_ERROR_UNINITIALIZED;    \
        if (!(dev) || !(out)) return NVML_ERROR_INVALID_ARGUMENT; \
    } while (0)

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    CHECK(device, name);
    return copy_str(name, length, device->name);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    CHECK(device, uuid);
    return copy_str(uuid, length, device->uuid);
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor) {
    CHECK(device, minor);
    *minor = device->minor;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    CHECK(device, pci);
    memset(pci, 0, sizeof *pci);
    pci->domain = device->domain;
    pci->bus = device->bus;
    pci->device = device->device;
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", device->domain, device->bus,
             device->device, device->function);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", device->domain,
             device->bus, device->device, device->function);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *mem) {
    CHECK(device, mem);
    mem->total = device->memory_mib << 20;
    mem->used = 0;
    mem->free = mem->total;
    return NVML_SUCCESS;
}
