/* Shared by the simulated libcuda and libnvidia-ml: the node's GPU table and the device-node test.
 *
 * The table comes from gputable.h, generated per driver root by e2e/simdriver/build.py, the way the
 * kernel module knows its GPUs. A GPU is visible to a process only when its /dev/nvidia<minor>
 * character device (major 195) exists there, so a container sees exactly the nodes it was given.
 */
#ifndef SIMGPU_H
#define SIMGPU_H

#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include "gputable.h" /* SIM_DRIVER_VERSION, SIM_CUDA_VERSION, SIM_GPUS[], SIM_NGPUS */

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
static unsigned sim_scan(const struct sim_gpu **out) {
    unsigned n = 0;
    for (unsigned i = 0; i < SIM_NGPUS; i++)
        if (sim_gpu_present(&SIM_GPUS[i])) out[n++] = &SIM_GPUS[i];
    return n;
}

#endif
