/* Shared by the simulated libcuda and libnvidia-ml: the node's GPU table and the device-node test.
 *
 * The table comes from gputable.h, generated per driver root by sim/simnode/builder.py from a
 * node profile, the way the kernel module knows its GPUs. A GPU is visible to a process only when
 * its /dev/nvidia<minor> character device (major 195) exists there, so a container sees exactly
 * the nodes it was given.
 */
#ifndef SIMGPU_H
#define SIMGPU_H

#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

/* One NVLink of a GPU: the PCI bus id of its remote end (NULL: the link is inactive). */
struct sim_link {
    const char *remote;
    unsigned remote_is_gpu;
};

/* A GPU-instance profile the node's MIG-capable GPUs offer (NVML's profile info + placements). */
struct sim_mig_profile {
    const char *name; /* "3g.40gb" */
    unsigned id, index, slices, size;
    unsigned long long memory_mib;
    unsigned sms, copy_engines, decoders, encoders, jpeg, ofa, max_instances;
    unsigned nplacements, placements[8];
};

/* A MIG device that exists at boot (made before the plugin ran): its GI and full-size CI. */
struct sim_premade {
    unsigned profile; /* index into SIM_MIG_PROFILES */
    unsigned start, gi_id;
    const char *uuid;
};

struct sim_gpu {
    unsigned minor;
    const char *uuid, *name;
    unsigned domain, bus, device, function;
    unsigned long long memory_mib;
    /* NVML's view (libnvidia-ml only) */
    unsigned brand, arch, cc_major, cc_minor, pci_device_id;
    int numa, pcie_root, pcie_switch; /* -1: none */
    unsigned nvlink_count;
    const struct sim_link *links;
    unsigned mig_capable, mig_enabled;
    unsigned npremade;
    const struct sim_premade *premade;
    unsigned has_fabric;
    unsigned char cluster_uuid[16];
    unsigned clique_id, fabric_state;
    unsigned module_id; /* the GPU's module on its baseboard; 0: not a baseboard product */
};

/* An NVML error the profile injects (nvmlErrors): on one GPU (index into SIM_GPUS; fn "*" = every
 * call on it) or node-wide (gpu -1). */
struct sim_error {
    int gpu;
    const char *fn;
    int code;
};
struct sim_error_name { /* profile error names (NVML_ERROR_CODES) -> NVML return codes */
    const char *name;
    int code;
};

/* SIM_DRIVER_VERSION, SIM_DRIVER_MAJOR, SIM_CUDA_VERSION, SIM_GPUS[], SIM_NGPUS,
 * SIM_MIG_PROFILES[], SIM_NMIG_PROFILES, SIM_ERRORS[], SIM_NERRORS, SIM_ERROR_NAMES[] */
#include "gputable.h"

#define SIM_NVIDIA_MAJOR 195
#define SIM_CTL_MINOR 255

/* Simulation only: unit tests point this at a temp dir of mknod'ed nodes; real nodes live in /dev. */
static const char *sim_dev_dir(void) {
    const char *d = getenv("DRA_GPU_SIM_DEV_DIR");
    return d && *d ? d : "/dev";
}

static int sim_is_node(const char *name, unsigned minor) {
    char path[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", sim_dev_dir(), name);
    return stat(path, &st) == 0 && S_ISCHR(st.st_mode) && major(st.st_rdev) == SIM_NVIDIA_MAJOR &&
           minor(st.st_rdev) == minor;
}

static int sim_ctl_present(void) { return sim_is_node("nvidiactl", SIM_CTL_MINOR); }

static int sim_gpu_present(const struct sim_gpu *g) {
    char name[32];
    snprintf(name, sizeof name, "nvidia%u", g->minor);
    return sim_is_node(name, g->minor);
}

/* Fills out[] with the visible GPUs in minor order (the table is sorted); returns how many. */
static inline unsigned sim_scan(const struct sim_gpu **out) {
    unsigned n = 0;
    for (unsigned i = 0; i < SIM_NGPUS; i++)
        if (sim_gpu_present(&SIM_GPUS[i])) out[n++] = &SIM_GPUS[i];
    return n;
}

#endif
