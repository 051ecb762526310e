/* Simulated NVML (libnvidia-ml.so.1), compiled against NVIDIA's own nvml.h (go-nvml's copy,
 * fetched by the builder): every function the product, pynvml's use of it and the simulated
 * nvidia-smi call, with NVML's struct versions and return codes.
 *
 * The node (GPUs, NVLinks, MIG profiles, pre-made MIG devices) is compiled in from gputable.h.
 * What the kernel module would keep until reboot lives in files under the device-node directory
 * ($DRA_GPU_SIM_DEV_DIR, default /dev), so every process on the node sees the same GPU:
 *
 *   .nvidia-sim/state        MIG mode, GPU/compute instances, compute modes, memory limits;
 *                            read under a shared flock of .nvidia-sim/lock, replaced atomically
 *                            (temp file + rename) under an exclusive one. Boot-scoped like the
 *                            kernel's state (/dev is a tmpfs): no fsync.
 *   .nvidia-sim/events/      one file per injected event, named <ns>-<pid>-<n>.event, holding
 *                            "<gpu-uuid> <eventType> <eventData> <gi> <ci>"; an event set delivers
 *                            those made after it was created, in name order.
 *   .nvidia-sim/lost/<uuid>  the GPU fell off the bus: its calls answer NVML_ERROR_GPU_IS_LOST.
 *   .nvidia-sim/recovery/<uuid>     NVML_FI_DEV_GET_GPU_RECOVERY_ACTION of the GPU (a number).
 *   .nvidia-sim/processes/<uuid>    pids running on a GPU or MIG device, one a line.
 *
 * With $DRA_GPU_SIM_PROC_DIR set (a simulated node's proc/), the library also keeps the MIG
 * capability files the kernel module lists there while an instance exists (sync_caps below),
 * and init reads the loaded kernel module's version from its driver/nvidia/version: another
 * version than the library's own fails init with NVML_ERROR_LIB_RM_VERSION_MISMATCH, as a real
 * libnvidia-ml does against another driver's kernel module (no file: no check).
 *
 * Which functions the library exports depends on the driver version it reports: the builder
 * links it with a version script made from its table (function -> first driver version), so
 * a caller gets "function not found" exactly where the real library of that version lacks it.
 * Behaviour that differs by version is keyed on SIM_DRIVER_MAJOR below.
 */
#define _GNU_SOURCE
#define NVML_NO_UNVERSIONED_FUNC_DEFS /* define the old unversioned entry points too */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/file.h>
#include <sys/inotify.h>
#include <time.h>
#include <unistd.h>

#include "nvml.h"
#include "simgpu.h"

/* nvmlDeviceSetComputeMode on a MIG device handle is refused before SIM_MIG_COMPUTE_MODE_FROM
 * (gputable.h, from exports.MIG_COMPUTE_MODE_FROM): "On MIG-enabled GPUs, compute mode would be set
 * to DEFAULT and changing it is not supported" in the older headers. */

#define MAX_GI 14 /* GPU instance ids 1..14, as on A100/H100 */
#define MAX_CI 8
#define COMPUTE_SLICES 7
#define NO_ID 0xFFFFFFFFu
#define MAX_LIMITS 64
#define MAGIC_DEV 0x4e564431u
#define MAGIC_GI 0x4e564749u
#define MAGIC_CI 0x4e564349u
#define MAGIC_SET 0x4e564553u

typedef struct nvmlDevice_st *Dev;
typedef struct nvmlGpuInstance_st *GI;
typedef struct nvmlComputeInstance_st *CI;
typedef struct nvmlEventSet_st *SET;

/* ---- handles ---------------------------------------------------------------------------- */

struct nvmlDevice_st {
    unsigned magic;
    unsigned gpu; /* index into SIM_GPUS */
    int gi, ci;   /* -1: the whole GPU */
};
struct nvmlGpuInstance_st {
    unsigned magic, gpu, gi;
};
struct nvmlComputeInstance_st {
    unsigned magic, gpu, gi, ci;
};
struct nvmlEventSet_st {
    unsigned magic;
    unsigned long long masks[SIM_NGPUS + 1];
    unsigned long long created_ns;
    char cursor[128]; /* name of the last event file looked at */
};

static struct nvmlDevice_st gpu_handles[SIM_NGPUS + 1];
static struct nvmlDevice_st mig_handles[SIM_NGPUS + 1][MAX_GI + 1][MAX_CI];
static struct nvmlGpuInstance_st gi_handles[SIM_NGPUS + 1][MAX_GI + 1];
static struct nvmlComputeInstance_st ci_handles[SIM_NGPUS + 1][MAX_GI + 1][MAX_CI];

static int refs; /* nvmlInit/nvmlShutdown nest, as in the real library */
static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER; /* NVML is thread-safe */
static unsigned visible[SIM_NGPUS + 1];
static unsigned nvisible;

/* Full-GI compute-instance profile (NVML_COMPUTE_INSTANCE_PROFILE_*) by compute slices. */
static int ci_profile_of_slices(unsigned slices) {
    switch (slices) {
    case 1: return NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE;
    case 2: return NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE;
    case 3: return NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE;
    case 4: return NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE;
    case 7: return NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE;
    case 8: return NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE;
    case 6: return NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE;
    default: return -1;
    }
}
static int slices_of_ci_profile(unsigned profile) {
    for (unsigned s = 1; s <= 8; s++)
        if (ci_profile_of_slices(s) == (int)profile) return (int)s;
    return -1;
}

/* ---- node state (shared by every process through the state file) ------------------------ */

struct gi_state {
    int used;
    unsigned profile; /* index into SIM_MIG_PROFILES */
    unsigned start;
    int has_ci;
    unsigned ci_id;
    int ci_compute_mode;
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
};
struct gpu_state {
    int mig_enabled, compute_mode;
    int persistence; /* driver persistence mode: disabled at boot (nvml.h: reset on every reboot) */
    struct gi_state gi[MAX_GI + 1]; /* by GI id; 0 is never used */
};
struct limit_state {
    unsigned gpu;
    unsigned long long soft, hard;
    unsigned long long ino; /* the cgroup directory's inode: a cgroup made again at the path is another */
    char ns[512];
};
struct node_state {
    struct gpu_state gpu[SIM_NGPUS + 1];
    unsigned nlimits;
    struct limit_state limits[MAX_LIMITS];
};

static void sim_path(char *out, size_t n, const char *rel) {
    snprintf(out, n, "%s/.nvidia-sim%s%s", sim_dev_dir(), *rel ? "/" : "", rel);
}

static int gpu_by_uuid(const char *uuid) {
    for (unsigned i = 0; i < SIM_NGPUS; i++)
        if (!strcmp(SIM_GPUS[i].uuid, uuid)) return (int)i;
    return -1;
}

static int profile_by_id(unsigned id) {
    for (unsigned i = 0; i < SIM_NMIG_PROFILES; i++)
        if (SIM_MIG_PROFILES[i].id == id) return (int)i;
    return -1;
}

static void boot_state(struct node_state *s) {
    memset(s, 0, sizeof *s);
    for (unsigned g = 0; g < SIM_NGPUS; g++) {
        s->gpu[g].mig_enabled = (int)SIM_GPUS[g].mig_enabled;
        for (unsigned i = 0; i < SIM_GPUS[g].npremade; i++) {
            const struct sim_premade *p = &SIM_GPUS[g].premade[i];
            if (p->gi_id == 0 || p->gi_id > MAX_GI) continue;
            struct gi_state *gi = &s->gpu[g].gi[p->gi_id];
            gi->used = 1;
            gi->profile = p->profile;
            gi->start = p->start;
            gi->has_ci = 1;
            gi->ci_id = 0;
            snprintf(gi->uuid, sizeof gi->uuid, "%s", p->uuid);
        }
    }
}

/* Parses the state file; a missing file is the boot state. Returns 0 or an NVML error. */
/* A cgroup directory's inode (0: none): a limit belongs to the cgroup, not to its path. */
static unsigned long long cgroup_ino(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode) ? (unsigned long long)st.st_ino : 0;
}

static nvmlReturn_t parse_state(FILE *f, struct node_state *s) {
    char line[1024], uuid[128], text[600];
    boot_state(s);
    if (!f) return NVML_SUCCESS;
    while (fgets(line, sizeof line, f)) {
        unsigned a, b, c, d;
        int m, cm, pm = 0;
        unsigned long long soft, hard, ino;
        if (sscanf(line, "gpu %127s %d %d %d", uuid, &m, &cm, &pm) >= 3) {
            int g = gpu_by_uuid(uuid); /* its line comes first and its instances follow it */
            if (g >= 0) {
                s->gpu[g].mig_enabled = m, s->gpu[g].compute_mode = cm, s->gpu[g].persistence = pm;
                memset(s->gpu[g].gi, 0, sizeof s->gpu[g].gi);
            }
        } else if (sscanf(line, "gi %127s %u %u %u", uuid, &a, &b, &c) == 4) {
            int g = gpu_by_uuid(uuid), p = profile_by_id(b);
            if (g < 0 || p < 0 || a == 0 || a > MAX_GI) continue;
            struct gi_state *gi = &s->gpu[g].gi[a];
            memset(gi, 0, sizeof *gi);
            gi->used = 1, gi->profile = (unsigned)p, gi->start = c;
        } else if (sscanf(line, "ci %127s %u %u %d %599s", uuid, &a, &d, &cm, text) == 5) {
            int g = gpu_by_uuid(uuid);
            if (g < 0 || a == 0 || a > MAX_GI || d >= MAX_CI || !s->gpu[g].gi[a].used) continue;
            struct gi_state *gi = &s->gpu[g].gi[a];
            gi->has_ci = 1, gi->ci_id = d, gi->ci_compute_mode = cm;
            snprintf(gi->uuid, sizeof gi->uuid, "%s", text);
        } else if (sscanf(line, "limit %127s %llu %llu %llu %599[^\n]", uuid, &soft, &hard, &ino, text) == 5) {
            int g = gpu_by_uuid(uuid);
            if (g < 0 || s->nlimits >= MAX_LIMITS) continue;
            /* "Removing the cgroup will also clear any limits" (nvml.h): the kernel module drops
             * them with the cgroup; here a limit whose cgroup is gone (or made again) is not read. */
            if (cgroup_ino(text) != ino) continue;
            struct limit_state *l = &s->limits[s->nlimits++];
            l->gpu = (unsigned)g, l->soft = soft, l->hard = hard, l->ino = ino;
            snprintf(l->ns, sizeof l->ns, "%s", text);
        }
    }
    return NVML_SUCCESS;
}

static int open_lock(int exclusive) {
    char path[4096];
    sim_path(path, sizeof path, "");
    if (exclusive) mkdir(path, 0755);
    sim_path(path, sizeof path, "lock");
    int fd = open(path, exclusive ? O_RDWR | O_CREAT | O_CLOEXEC : O_RDONLY | O_CLOEXEC, 0644);
    if (fd >= 0) flock(fd, exclusive ? LOCK_EX : LOCK_SH);
    return fd;
}

static void close_lock(int fd) {
    if (fd >= 0) {
        flock(fd, LOCK_UN);
        close(fd);
    }
}

static nvmlReturn_t read_state_unlocked(struct node_state *s) {
    char path[4096];
    sim_path(path, sizeof path, "state");
    FILE *f = fopen(path, "re");
    if (!f && errno != ENOENT) return NVML_ERROR_NO_PERMISSION;
    nvmlReturn_t r = parse_state(f, s);
    if (f) fclose(f);
    return r;
}

/* A consistent snapshot of the node (shared lock; a read-only device dir reads without one). */
static nvmlReturn_t load_state(struct node_state *s) {
    int fd = open_lock(0);
    nvmlReturn_t r = read_state_unlocked(s);
    close_lock(fd);
    return r;
}

/* ---- MIG capability files (what the kernel module lists under /proc) -------------------- */
/* While a GPU or compute instance exists the kernel module lists
 * /proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>/access and .../gi<G>/ci<C>/access; their
 * DeviceFileMinor is the minor of /dev/nvidia-caps/nvidia-cap<N>, fixed per (GPU, GI, CI) as in
 * the driver's mig-minors table (config 1, monitor 2, then per GPU 15 GIs of 9 minors each: the
 * GI's access, then CIs 0-7). NVML makes no device node: a CDI spec carries it by number.
 * Simulated under $DRA_GPU_SIM_PROC_DIR when it is set (else nothing is written), rewritten from
 * the state at init and after every change, under the state's exclusive lock. */
#define CAPS_GIS_PER_GPU 15
#define CAPS_PER_GI 9

static unsigned caps_minor(unsigned gpu_minor, unsigned gi, int ci) {
    unsigned base = 3 + gpu_minor * CAPS_GIS_PER_GPU * CAPS_PER_GI + gi * CAPS_PER_GI;
    return ci < 0 ? base : base + 1 + (unsigned)ci;
}

static void make_dirs(const char *dir) {
    char path[4200];
    snprintf(path, sizeof path, "%s", dir);
    for (char *p = path + 1; *p; p++)
        if (*p == '/') {
            *p = 0;
            mkdir(path, 0755);
            *p = '/';
        }
    mkdir(path, 0755);
}

static void write_access(const char *dir, unsigned minor) {
    char path[4300], tmp[4400], text[128], old[128];
    snprintf(path, sizeof path, "%s/access", dir);
    snprintf(text, sizeof text, "DeviceFileMinor: %u\nDeviceFileMode: 292\nDeviceFileModify: 1\n", minor);
    FILE *f = fopen(path, "re");
    if (f) {
        size_t n = fread(old, 1, sizeof old - 1, f);
        old[n] = 0;
        fclose(f);
        if (!strcmp(old, text)) return;
    }
    make_dirs(dir);
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    f = fopen(tmp, "we");
    if (!f) return;
    fputs(text, f);
    if (fclose(f) == 0 && chmod(tmp, 0444) == 0 && rename(tmp, path) == 0) return;
    unlink(tmp);
}

static void remove_access(const char *dir) {
    char path[4300];
    snprintf(path, sizeof path, "%s/access", dir);
    unlink(path);
    rmdir(dir);
}

static void sync_caps(const struct node_state *s) {
    const char *proc = getenv("DRA_GPU_SIM_PROC_DIR");
    if (!proc || !*proc) return;
    for (unsigned g = 0; g < SIM_NGPUS; g++) {
        unsigned minor = SIM_GPUS[g].minor;
        for (unsigned id = 1; id <= MAX_GI; id++) {
            const struct gi_state *gi = &s->gpu[g].gi[id];
            char gi_dir[4096], ci_dir[4200];
            snprintf(gi_dir, sizeof gi_dir, "%s/driver/nvidia/capabilities/gpu%u/mig/gi%u", proc, minor, id);
            if (gi->used) write_access(gi_dir, caps_minor(minor, id, -1));
            for (unsigned ci = 0; ci < MAX_CI; ci++) {
                snprintf(ci_dir, sizeof ci_dir, "%s/ci%u", gi_dir, ci);
                if (gi->used && gi->has_ci && gi->ci_id == ci)
                    write_access(ci_dir, caps_minor(minor, id, (int)ci));
                else
                    remove_access(ci_dir);
            }
            if (!gi->used) remove_access(gi_dir);
        }
    }
}

static nvmlReturn_t write_state_unlocked(const struct node_state *s) {
    char path[4096], tmp[4200];
    sim_path(path, sizeof path, "state");
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    FILE *f = fopen(tmp, "we");
    if (!f) return NVML_ERROR_NO_PERMISSION;
    fprintf(f, "# dra-gpu simulated NVML state (kernel-side MIG and compute state) v1\n");
    for (unsigned g = 0; g < SIM_NGPUS; g++) {
        const struct gpu_state *gs = &s->gpu[g];
        fprintf(f, "gpu %s %d %d %d\n", SIM_GPUS[g].uuid, gs->mig_enabled, gs->compute_mode, gs->persistence);
        for (unsigned id = 1; id <= MAX_GI; id++) {
            const struct gi_state *gi = &gs->gi[id];
            if (!gi->used) continue;
            fprintf(f, "gi %s %u %u %u\n", SIM_GPUS[g].uuid, id, SIM_MIG_PROFILES[gi->profile].id, gi->start);
            if (gi->has_ci)
                fprintf(f, "ci %s %u %u %d %s\n", SIM_GPUS[g].uuid, id, gi->ci_id, gi->ci_compute_mode,
                        gi->uuid);
        }
    }
    for (unsigned i = 0; i < s->nlimits; i++)
        fprintf(f, "limit %s %llu %llu %llu %s\n", SIM_GPUS[s->limits[i].gpu].uuid, s->limits[i].soft,
                s->limits[i].hard, s->limits[i].ino, s->limits[i].ns);
    int bad = ferror(f);
    bad |= fclose(f);
    if (bad || rename(tmp, path) != 0) {
        unlink(tmp);
        return NVML_ERROR_NO_PERMISSION;
    }
    sync_caps(s);
    return NVML_SUCCESS;
}

/* ---- per-GPU files written from outside (injection) ------------------------------------- */

static int gpu_lost(unsigned g) {
    char rel[256], path[4096];
    snprintf(rel, sizeof rel, "lost/%s", SIM_GPUS[g].uuid);
    sim_path(path, sizeof path, rel);
    return access(path, F_OK) == 0;
}

static unsigned read_number_file(const char *dir, const char *uuid) {
    char rel[256], path[4096];
    unsigned v = 0;
    snprintf(rel, sizeof rel, "%s/%s", dir, uuid);
    sim_path(path, sizeof path, rel);
    FILE *f = fopen(path, "re");
    if (f) {
        if (fscanf(f, "%u", &v) != 1) v = 0;
        fclose(f);
    }
    return v;
}

/* Pids listed for a GPU or MIG device UUID; returns how many (at most max stored). */
static unsigned read_processes(const char *uuid, unsigned *pids, unsigned max) {
    char rel[256], path[4096];
    unsigned n = 0, pid;
    snprintf(rel, sizeof rel, "processes/%s", uuid);
    sim_path(path, sizeof path, rel);
    FILE *f = fopen(path, "re");
    if (!f) return 0;
    while (fscanf(f, "%u", &pid) == 1) {
        if (n < max) pids[n] = pid;
        n++;
    }
    fclose(f);
    return n;
}

/* ---- helpers ---------------------------------------------------------------------------- */

static nvmlReturn_t copy_str(char *dst, unsigned int len, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

static int is_visible(unsigned g) {
    for (unsigned i = 0; i < nvisible; i++)
        if (visible[i] == g) return 1;
    return 0;
}

static int valid_device(Dev d) {
    return d && d->magic == MAGIC_DEV && d->gpu < SIM_NGPUS && is_visible(d->gpu);
}

static int valid_gi(GI h) { return h && h->magic == MAGIC_GI && h->gpu < SIM_NGPUS; }
static int valid_ci(CI h) { return h && h->magic == MAGIC_CI && h->gpu < SIM_NGPUS; }

static nvmlDevice_t gpu_handle(unsigned g) {
    struct nvmlDevice_st *h = &gpu_handles[g];
    h->magic = MAGIC_DEV, h->gpu = g, h->gi = -1, h->ci = -1;
    return (nvmlDevice_t){h};
}

static nvmlDevice_t mig_handle(unsigned g, unsigned gi, unsigned ci) {
    struct nvmlDevice_st *h = &mig_handles[g][gi][ci];
    h->magic = MAGIC_DEV, h->gpu = g, h->gi = (int)gi, h->ci = (int)ci;
    return (nvmlDevice_t){h};
}

static nvmlGpuInstance_t gi_handle(unsigned g, unsigned gi) {
    struct nvmlGpuInstance_st *h = &gi_handles[g][gi];
    h->magic = MAGIC_GI, h->gpu = g, h->gi = gi;
    return (nvmlGpuInstance_t){h};
}

static nvmlComputeInstance_t ci_handle(unsigned g, unsigned gi, unsigned ci) {
    struct nvmlComputeInstance_st *h = &ci_handles[g][gi][ci];
    h->magic = MAGIC_CI, h->gpu = g, h->gi = gi, h->ci = ci;
    return (nvmlComputeInstance_t){h};
}

static int is_mig(Dev d) { return d->gi >= 0; }

/* The MIG device behind a MIG handle, or NULL when it no longer exists. */
static struct gi_state *mig_of(struct node_state *s, Dev d) {
    struct gi_state *gi = &s->gpu[d->gpu].gi[d->gi];
    return gi->used && gi->has_ci && (int)gi->ci_id == d->ci ? gi : NULL;
}

/* Every device call: initialised, a handle of a visible GPU, not lost. */
#define CHECK_DEV(dev)                                         \
    do {                                                       \
        if (refs == 0) return NVML_ERROR_UNINITIALIZED;        \
        if (!valid_device(dev)) return NVML_ERROR_INVALID_ARGUMENT; \
        if (gpu_lost((dev)->gpu)) return NVML_ERROR_GPU_IS_LOST; \
    } while (0)
#define CHECK(dev, out)                                          \
    do {                                                         \
        CHECK_DEV(dev);                                          \
        if (!(out)) return NVML_ERROR_INVALID_ARGUMENT;          \
    } while (0)
/* Calls that take only a whole GPU's handle. */
#define CHECK_GPU(dev, out)                                      \
    do {                                                         \
        CHECK(dev, out);                                         \
        if (is_mig(dev)) return NVML_ERROR_INVALID_ARGUMENT;     \
    } while (0)

/* ---- injected failures (the profile's nvmlErrors, $DRA_GPU_SIM_NVML_FAIL) -------------------
 * As the Python FakeNvml does: SIM_ERRORS (gputable.h) lists the profile's per-GPU errors (gpu =
 * index into SIM_GPUS, "*" = every call on that GPU) and node-wide ones (gpu = -1); the
 * environment names one-shot failures "nvmlFunction=ErrorName,..." for this process. A name
 * matches the C function of the same name or its versioned form (..._v2, ...V), which is how
 * pynvml's names map to the symbols it calls. */

static pthread_mutex_t fail_lock = PTHREAD_MUTEX_INITIALIZER;
static int fail_parsed;
static struct {
    char fn[96];
    nvmlReturn_t code;
    int used;
} fail_once[32];
static unsigned nfail_once;

static int name_matches(const char *want, const char *fn) {
    size_t n = strlen(want);
    if (strncmp(want, fn, n)) return 0;
    const char *rest = fn + n;
    return !*rest || !strcmp(rest, "V") ||
           (rest[0] == '_' && rest[1] == 'v' && rest[2] >= '0' && rest[2] <= '9' && !rest[3]);
}

static void parse_fail_env(void) {
    const char *env = getenv("DRA_GPU_SIM_NVML_FAIL");
    char buf[2048], *save = NULL;
    if (!env) return;
    snprintf(buf, sizeof buf, "%s", env);
    for (char *item = strtok_r(buf, ",", &save); item && nfail_once < 32; item = strtok_r(NULL, ",", &save)) {
        while (*item == ' ') item++;
        char *eq = strchr(item, '=');
        if (!eq || strncmp(item, "nvml", 4)) continue;
        *eq = 0;
        for (unsigned i = 0; i < SIM_NERROR_NAMES; i++)
            if (!strcmp(SIM_ERROR_NAMES[i].name, eq + 1)) {
                snprintf(fail_once[nfail_once].fn, sizeof fail_once[0].fn, "%s", item);
                fail_once[nfail_once++].code = SIM_ERROR_NAMES[i].code;
            }
    }
}

static nvmlReturn_t sim_failpoint(const char *fn, int gpu) {
    nvmlReturn_t r = NVML_SUCCESS;
    pthread_mutex_lock(&fail_lock);
    if (!fail_parsed) parse_fail_env(), fail_parsed = 1;
    for (unsigned i = 0; i < nfail_once && !r; i++)
        if (!fail_once[i].used && name_matches(fail_once[i].fn, fn)) fail_once[i].used = 1, r = fail_once[i].code;
    pthread_mutex_unlock(&fail_lock);
    for (unsigned i = 0; i < SIM_NERRORS && !r && gpu >= 0; i++)
        if (SIM_ERRORS[i].gpu == gpu && (!strcmp(SIM_ERRORS[i].fn, "*") || name_matches(SIM_ERRORS[i].fn, fn)))
            r = SIM_ERRORS[i].code;
    for (unsigned i = 0; i < SIM_NERRORS && !r; i++)
        if (SIM_ERRORS[i].gpu < 0 && name_matches(SIM_ERRORS[i].fn, fn)) r = SIM_ERRORS[i].code;
    return r;
}

#define FAILPOINT(gpu_expr)                                       \
    do {                                                          \
        if (refs == 0) return NVML_ERROR_UNINITIALIZED;           \
        nvmlReturn_t fp_ = sim_failpoint(__func__, (gpu_expr));   \
        if (fp_) return fp_;                                      \
    } while (0)
/* The same, for a call on a device handle (a bad handle is not any GPU's failure). */
#define DEVICE_FAILPOINT(dev) FAILPOINT(valid_device(dev) ? (int)(dev)->gpu : -1)

/* ---- init, errors, system --------------------------------------------------------------- */

/* The capability files of the instances there are (the boot state's pre-made ones included). */
static void init_caps(void) {
    const char *proc = getenv("DRA_GPU_SIM_PROC_DIR");
    if (!proc || !*proc) return;
    static struct node_state s; /* large; callers hold init_lock */
    int fd = open_lock(1);
    if (read_state_unlocked(&s) == NVML_SUCCESS) sync_caps(&s);
    close_lock(fd);
}

/* The kernel module's version, as /proc/driver/nvidia/version says it: "NVRM version: NVIDIA
 * UNIX x86_64 Kernel Module  570.133.20  <date>" (open modules: "... Open Kernel Module for
 * x86_64  570.133.20  ..."). 0: no file (or no version in it); 1: found, in `out`. */
static int kernel_module_version(char *out, size_t size) {
    const char *proc = getenv("DRA_GPU_SIM_PROC_DIR");
    if (!proc || !*proc) return 0;
    char path[4096], text[512];
    snprintf(path, sizeof path, "%s/driver/nvidia/version", proc);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    const char *p = strstr(text, "Kernel Module");
    if (!p) return 0;
    p += strlen("Kernel Module");
    while (*p == ' ' || *p == '\t') p++;
    if (!strncmp(p, "for ", 4)) { /* "for x86_64" */
        p += 4;
        while (*p && *p != ' ' && *p != '\t') p++;
        while (*p == ' ' || *p == '\t') p++;
    }
    size_t len = strspn(p, "0123456789.");
    if (len == 0 || len >= size) return 0;
    memcpy(out, p, len);
    out[len] = 0;
    return 1;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    for (unsigned i = 0; i < SIM_NERRORS; i++) /* the profile's nvmlErrors.nvmlInit */
        if (SIM_ERRORS[i].gpu < 0 && !strcmp(SIM_ERRORS[i].fn, "nvmlInit")) return SIM_ERRORS[i].code;
    pthread_mutex_lock(&init_lock);
    if (refs == 0) {
        if (!sim_ctl_present()) {
            pthread_mutex_unlock(&init_lock);
            return NVML_ERROR_DRIVER_NOT_LOADED;
        }
        char kernel[64];
        if (kernel_module_version(kernel, sizeof kernel) && strcmp(kernel, SIM_DRIVER_VERSION)) {
            pthread_mutex_unlock(&init_lock);
            return NVML_ERROR_LIB_RM_VERSION_MISMATCH; /* libraries of another driver */
        }
        nvisible = 0; /* the device list is fixed at init, like the real one */
        for (unsigned i = 0; i < SIM_NGPUS; i++)
            if (sim_gpu_present(&SIM_GPUS[i])) visible[nvisible++] = i;
        init_caps();
    }
    refs++;
    pthread_mutex_unlock(&init_lock);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    nvmlReturn_t r = NVML_SUCCESS;
    pthread_mutex_lock(&init_lock);
    if (refs == 0) r = NVML_ERROR_UNINITIALIZED;
    else refs--;
    pthread_mutex_unlock(&init_lock);
    return r;
}

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "Deprecated";
    case NVML_ERROR_NOT_READY: return "Not ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    FAILPOINT(-1);
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    return copy_str(version, length, SIM_DRIVER_VERSION);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    char v[96];
    snprintf(v, sizeof v, "%d.%s", SIM_CUDA_VERSION / 1000, SIM_DRIVER_VERSION);
    return copy_str(version, length, v);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) {
    if (!v) return NVML_ERROR_INVALID_ARGUMENT;
    *v = SIM_CUDA_VERSION;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) { return nvmlSystemGetCudaDriverVersion_v2(v); }

/* ---- device handles --------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    FAILPOINT(-1);
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = nvisible;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= nvisible) return NVML_ERROR_INVALID_ARGUMENT;
    FAILPOINT((int)visible[index]);
    *device = gpu_handle(visible[index]);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int i, nvmlDevice_t *d) {
    return nvmlDeviceGetHandleByIndex_v2(i, d);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    FAILPOINT(-1);
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < nvisible; i++)
        if (!strcmp(SIM_GPUS[visible[i]].uuid, uuid)) return *device = gpu_handle(visible[i]), NVML_SUCCESS;
    struct node_state s;
    nvmlReturn_t r = load_state(&s);
    if (r) return r;
    for (unsigned i = 0; i < nvisible; i++) {
        unsigned g = visible[i];
        if (!s.gpu[g].mig_enabled) continue;
        for (unsigned id = 1; id <= MAX_GI; id++) {
            struct gi_state *gi = &s.gpu[g].gi[id];
            if (gi->used && gi->has_ci && !strcmp(gi->uuid, uuid))
                return *device = mig_handle(g, id, gi->ci_id), NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

static int parse_bus_id(const char *text, unsigned *dom, unsigned *bus, unsigned *dev, unsigned *fn) {
    *fn = 0;
    if (sscanf(text, "%x:%x:%x.%x", dom, bus, dev, fn) >= 3) return 1;
    *dom = 0;
    return sscanf(text, "%x:%x.%x", bus, dev, fn) >= 2;
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device) {
    FAILPOINT(-1);
    unsigned dom, bus, dev, fn;
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    if (!pciBusId || !device || !parse_bus_id(pciBusId, &dom, &bus, &dev, &fn))
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < nvisible; i++) {
        const struct sim_gpu *g = &SIM_GPUS[visible[i]];
        if (g->domain == dom && g->bus == bus && g->device == dev && g->function == fn)
            return *device = gpu_handle(visible[i]), NVML_SUCCESS;
    }
    return NVML_ERROR_NOT_FOUND;
}
nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
}

/* ---- identity --------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device_, unsigned int *index) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK_GPU(device, index);
    for (unsigned i = 0; i < nvisible; i++)
        if (visible[i] == device->gpu) return *index = i, NVML_SUCCESS;
    return NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device_, char *name, unsigned int length) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK(device, name);
    const struct sim_gpu *g = &SIM_GPUS[device->gpu];
    if (!is_mig(device)) return copy_str(name, length, g->name);
    struct node_state s;
    nvmlReturn_t r = load_state(&s);
    if (r) return r;
    struct gi_state *gi = mig_of(&s, device);
    if (!gi) return NVML_ERROR_INVALID_ARGUMENT;
    char full[NVML_DEVICE_NAME_V2_BUFFER_SIZE + 32];
    snprintf(full, sizeof full, "%s MIG %s", g->name, SIM_MIG_PROFILES[gi->profile].name);
    return copy_str(name, length, full);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device_, char *uuid, unsigned int length) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK(device, uuid);
    if (!is_mig(device)) return copy_str(uuid, length, SIM_GPUS[device->gpu].uuid);
    struct node_state s;
    nvmlReturn_t r = load_state(&s);
    if (r) return r;
    struct gi_state *gi = mig_of(&s, device);
    return gi ? copy_str(uuid, length, gi->uuid) : NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device_, unsigned int *minor) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK_GPU(device, minor);
    *minor = SIM_GPUS[device->gpu].minor;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device_, nvmlBrandType_t *type) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK(device, type);
    *type = (nvmlBrandType_t)SIM_GPUS[device->gpu].brand;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device_, nvmlDeviceArchitecture_t *arch) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK(device, arch);
    *arch = SIM_GPUS[device->gpu].arch;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device_, int *major, int *minor) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK(device, major);
    if (!minor) return NVML_ERROR_INVALID_ARGUMENT;
    *major = (int)SIM_GPUS[device->gpu].cc_major;
    *minor = (int)SIM_GPUS[device->gpu].cc_minor;
    return NVML_SUCCESS;
}

/* A bare-metal GPU: no vGPU host or guest, no passthrough hypervisor below (NVIDIA's DRA plugin
 * asks before it offers dynamic MIG, which a vGPU guest cannot repartition). A whole GPU's query. */
nvmlReturn_t nvmlDeviceGetVirtualizationMode(nvmlDevice_t device_, nvmlGpuVirtualizationMode_t *pVirtualMode) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK_GPU(device, pVirtualMode);
    *pVirtualMode = NVML_GPU_VIRTUALIZATION_MODE_NONE;
    return NVML_SUCCESS;
}

/* The GPU's module on its baseboard (the profile's moduleId, 1..8 on an HGX board); "for
 * non-baseboard products, this ID would always be 0" (nvml.h). */
nvmlReturn_t nvmlDeviceGetModuleId(nvmlDevice_t device_, unsigned int *moduleId) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK_GPU(device, moduleId);
    *moduleId = SIM_GPUS[device->gpu].module_id;
    return NVML_SUCCESS;
}

static void fill_pci(nvmlPciInfo_t *pci, unsigned dom, unsigned bus, unsigned dev, unsigned fn) {
    memset(pci, 0, sizeof *pci);
    pci->domain = dom, pci->bus = bus, pci->device = dev;
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", dom, bus, dev, fn);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", dom, bus, dev, fn);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device_, nvmlPciInfo_t *pci) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK(device, pci);
    const struct sim_gpu *g = &SIM_GPUS[device->gpu];
    fill_pci(pci, g->domain, g->bus, g->device, g->function);
    pci->pciDeviceId = g->pci_device_id;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t d, nvmlPciInfo_t *p) { return nvmlDeviceGetPciInfo_v3(d, p); }
nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t d, nvmlPciInfo_t *p) { return nvmlDeviceGetPciInfo_v3(d, p); }

nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device_, unsigned int *node) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK(device, node);
    if (SIM_GPUS[device->gpu].numa < 0) return NVML_ERROR_NOT_SUPPORTED;
    *node = (unsigned)SIM_GPUS[device->gpu].numa;
    return NVML_SUCCESS;
}

/* ---- memory ------------------------------------------------------------------------------ */

static nvmlReturn_t memory_total(Dev device, unsigned long long *total) {
    if (!is_mig(device)) {
        *total = SIM_GPUS[device->gpu].memory_mib << 20;
        return NVML_SUCCESS;
    }
    struct node_state s;
    nvmlReturn_t r = load_state(&s);
    if (r) return r;
    struct gi_state *gi = mig_of(&s, device);
    if (!gi) return NVML_ERROR_INVALID_ARGUMENT;
    *total = SIM_MIG_PROFILES[gi->profile].memory_mib << 20;
    return NVML_SUCCESS;
}

#define SIM_USED_BYTES (600ULL << 20) /* a live GPU never has zero used: the driver reserves some */

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device_, nvmlMemory_t *memory) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    unsigned long long total;
    CHECK(device, memory);
    nvmlReturn_t r = memory_total(device, &total);
    if (r) return r;
    memory->total = total;
    memory->used = total < SIM_USED_BYTES ? total : SIM_USED_BYTES;
    memory->free = total - memory->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device_, nvmlMemory_v2_t *memory) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    unsigned long long total;
    CHECK(device, memory);
    if (memory->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlReturn_t r = memory_total(device, &total);
    if (r) return r;
    memory->total = total;
    memory->reserved = 0;
    memory->used = total < SIM_USED_BYTES ? total : SIM_USED_BYTES;
    memory->free = total - memory->used;
    return NVML_SUCCESS;
}

/* Per-cgroup memory limits (NVML 13): "MIG handles are not supported"; cgroup paths must exist. */

static nvmlReturn_t limits_check(Dev device, const char *ns) {
    CHECK_DEV(device);
    if (is_mig(device)) return NVML_ERROR_NOT_SUPPORTED;
    if (!ns) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(ns) >= sizeof(((struct limit_state *)0)->ns) || strchr(ns, '\n'))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (access(ns, F_OK) != 0) return NVML_ERROR_OPERATING_SYSTEM;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t device_, nvmlSetMemoryLimits_v1_t *limits) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    if (!limits) return refs == 0 ? NVML_ERROR_UNINITIALIZED : NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = limits_check(device, limits->nameSpace);
    if (r) return r;
    /* nvml.h: INVALID_ARGUMENT when "the softLimit exceeds the hardLimit, or a limit exceeds total
     * device memory"; a hard limit of NVML_DEVICE_MEMORY_LIMIT_MAX is "no limit". */
    unsigned long long total = SIM_GPUS[device->gpu].memory_mib << 20;
    if (limits->softLimit > limits->hardLimit) return NVML_ERROR_INVALID_ARGUMENT;
    if (limits->softLimit > total || (limits->hardLimit > total && limits->hardLimit != NVML_DEVICE_MEMORY_LIMIT_MAX))
        return NVML_ERROR_INVALID_ARGUMENT;
    struct node_state s;
    int fd = open_lock(1);
    r = read_state_unlocked(&s);
    if (!r) {
        unsigned i = 0;
        while (i < s.nlimits && !(s.limits[i].gpu == device->gpu && !strcmp(s.limits[i].ns, limits->nameSpace)))
            i++;
        if (i == s.nlimits) {
            if (s.nlimits == MAX_LIMITS) r = NVML_ERROR_INSUFFICIENT_RESOURCES;
            else s.nlimits++;
        }
        if (!r) {
            s.limits[i].gpu = device->gpu;
            s.limits[i].soft = limits->softLimit, s.limits[i].hard = limits->hardLimit;
            s.limits[i].ino = cgroup_ino(limits->nameSpace);
            snprintf(s.limits[i].ns, sizeof s.limits[i].ns, "%s", limits->nameSpace);
            r = write_state_unlocked(&s);
        }
    }
    close_lock(fd);
    return r;
}

nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t device_, nvmlGetMemoryLimits_v1_t *limits) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    if (!limits) return refs == 0 ? NVML_ERROR_UNINITIALIZED : NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = limits_check(device, limits->nameSpace);
    if (r) return r;
    struct node_state s;
    if ((r = load_state(&s))) return r;
    limits->softLimit = limits->hardLimit = limits->currentUsed = 0;
    for (unsigned i = 0; i < s.nlimits; i++)
        if (s.limits[i].gpu == device->gpu && !strcmp(s.limits[i].ns, limits->nameSpace)) {
            limits->softLimit = s.limits[i].soft, limits->hardLimit = s.limits[i].hard;
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

/* ---- compute mode and processes ----------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device_, nvmlComputeMode_t *mode) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK(device, mode);
    struct node_state s;
    nvmlReturn_t r = load_state(&s);
    if (r) return r;
    if (!is_mig(device)) {
        if (s.gpu[device->gpu].mig_enabled) return NVML_ERROR_NOT_SUPPORTED; /* ask its MIG devices */
        *mode = (nvmlComputeMode_t)s.gpu[device->gpu].compute_mode;
        return NVML_SUCCESS;
    }
    struct gi_state *gi = mig_of(&s, device);
    if (!gi) return NVML_ERROR_INVALID_ARGUMENT;
    *mode = (nvmlComputeMode_t)gi->ci_compute_mode;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceSetComputeMode(nvmlDevice_t device_, nvmlComputeMode_t mode) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK_DEV(device);
    if (mode != NVML_COMPUTEMODE_DEFAULT && mode != NVML_COMPUTEMODE_PROHIBITED &&
        mode != NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (is_mig(device) && SIM_DRIVER_MAJOR < SIM_MIG_COMPUTE_MODE_FROM) return NVML_ERROR_NOT_SUPPORTED;
    struct node_state s;
    int fd = open_lock(1);
    nvmlReturn_t r = read_state_unlocked(&s);
    if (!r) {
        struct gpu_state *gs = &s.gpu[device->gpu];
        if (!is_mig(device)) {
            if (gs->mig_enabled) r = NVML_ERROR_NOT_SUPPORTED; /* "device must be MIG device handle" */
            else gs->compute_mode = (int)mode;
        } else {
            struct gi_state *gi = mig_of(&s, device);
            if (!gi) r = NVML_ERROR_INVALID_ARGUMENT;
            else gi->ci_compute_mode = (int)mode;
        }
        if (!r) r = write_state_unlocked(&s);
    }
    close_lock(fd);
    return r;
}

/* Driver persistence mode, kept with the node's state: the kernel keeps it until reboot. A whole
 * GPU's setting (MIG devices share their GPU's driver state). */
nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device_, nvmlEnableState_t *mode) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK_GPU(device, mode);
    struct node_state s;
    nvmlReturn_t r = load_state(&s);
    if (r) return r;
    *mode = s.gpu[device->gpu].persistence ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceSetPersistenceMode(nvmlDevice_t device_, nvmlEnableState_t mode) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK_DEV(device);
    if (is_mig(device)) return NVML_ERROR_INVALID_ARGUMENT;
    if (mode != NVML_FEATURE_DISABLED && mode != NVML_FEATURE_ENABLED) return NVML_ERROR_INVALID_ARGUMENT;
    struct node_state s;
    int fd = open_lock(1);
    nvmlReturn_t r = read_state_unlocked(&s);
    if (!r) {
        s.gpu[device->gpu].persistence = mode == NVML_FEATURE_ENABLED;
        r = write_state_unlocked(&s);
    }
    close_lock(fd);
    return r;
}

static unsigned gpu_processes(struct node_state *s, Dev device, nvmlProcessInfo_t *infos,
                              unsigned max) {
    unsigned pids[64], n = 0;
    if (is_mig(device)) {
        struct gi_state *gi = mig_of(s, device);
        unsigned k = gi ? read_processes(gi->uuid, pids, 64) : 0;
        for (unsigned i = 0; i < k && i < 64; i++, n++)
            if (infos && n < max) {
                memset(&infos[n], 0, sizeof infos[n]);
                infos[n].pid = pids[i], infos[n].usedGpuMemory = 0;
                infos[n].gpuInstanceId = (unsigned)device->gi, infos[n].computeInstanceId = (unsigned)device->ci;
            }
        return n;
    }
    unsigned k = read_processes(SIM_GPUS[device->gpu].uuid, pids, 64);
    for (unsigned i = 0; i < k && i < 64; i++, n++)
        if (infos && n < max) {
            memset(&infos[n], 0, sizeof infos[n]);
            infos[n].pid = pids[i], infos[n].gpuInstanceId = NO_ID, infos[n].computeInstanceId = NO_ID;
        }
    for (unsigned id = 1; id <= MAX_GI; id++) { /* a whole GPU's handle lists its MIG devices' too */
        struct gi_state *gi = &s->gpu[device->gpu].gi[id];
        if (!gi->used || !gi->has_ci) continue;
        k = read_processes(gi->uuid, pids, 64);
        for (unsigned i = 0; i < k && i < 64; i++, n++)
            if (infos && n < max) {
                memset(&infos[n], 0, sizeof infos[n]);
                infos[n].pid = pids[i], infos[n].gpuInstanceId = id, infos[n].computeInstanceId = gi->ci_id;
            }
    }
    return n;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device_, unsigned int *infoCount,
                                                    nvmlProcessInfo_t *infos) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK(device, infoCount);
    struct node_state s;
    nvmlReturn_t r = load_state(&s);
    if (r) return r;
    if (is_mig(device) && !mig_of(&s, device)) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned n = gpu_processes(&s, device, NULL, 0);
    if (n > *infoCount || (n && !infos)) {
        *infoCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    *infoCount = gpu_processes(&s, device, infos, *infoCount);
    return NVML_SUCCESS;
}

/* ---- attributes (MIG device handles only, as the header says) ---------------------------- */

nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device_, nvmlDeviceAttributes_t *attributes) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK(device, attributes);
    if (!is_mig(device)) return NVML_ERROR_NOT_SUPPORTED; /* "currently only supports MIG device handles" */
    struct node_state s;
    nvmlReturn_t r = load_state(&s);
    if (r) return r;
    struct gi_state *gi = mig_of(&s, device);
    if (!gi) return NVML_ERROR_INVALID_ARGUMENT;
    const struct sim_mig_profile *p = &SIM_MIG_PROFILES[gi->profile];
    memset(attributes, 0, sizeof *attributes);
    attributes->multiprocessorCount = p->sms;
    attributes->sharedCopyEngineCount = p->copy_engines;
    attributes->sharedDecoderCount = p->decoders;
    attributes->sharedEncoderCount = p->encoders;
    attributes->sharedJpegCount = p->jpeg;
    attributes->sharedOfaCount = p->ofa;
    attributes->gpuInstanceSliceCount = attributes->computeInstanceSliceCount = p->slices;
    attributes->memorySizeMB = p->memory_mib;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetAttributes(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes) {
    return nvmlDeviceGetAttributes_v2(device, attributes);
}

/* ---- MIG mode and MIG devices ------------------------------------------------------------ */

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device_, unsigned int *currentMode, unsigned int *pendingMode) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK_GPU(device, currentMode);
    if (!pendingMode) return NVML_ERROR_INVALID_ARGUMENT;
    if (!SIM_GPUS[device->gpu].mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    struct node_state s;
    nvmlReturn_t r = load_state(&s);
    if (r) return r;
    *currentMode = *pendingMode = (unsigned)s.gpu[device->gpu].mig_enabled;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceSetMigMode(nvmlDevice_t device_, unsigned int mode, nvmlReturn_t *activationStatus) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK_GPU(device, activationStatus);
    if (mode != NVML_DEVICE_MIG_DISABLE && mode != NVML_DEVICE_MIG_ENABLE) return NVML_ERROR_INVALID_ARGUMENT;
    if (!SIM_GPUS[device->gpu].mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    struct node_state s;
    int fd = open_lock(1);
    nvmlReturn_t r = read_state_unlocked(&s);
    if (!r) {
        struct gpu_state *gs = &s.gpu[device->gpu];
        for (unsigned id = 1; id <= MAX_GI; id++)
            if (gs->gi[id].used) r = NVML_ERROR_IN_USE; /* instances must be destroyed first */
        if (!r) {
            gs->mig_enabled = (int)mode;
            gs->compute_mode = 0;
            r = write_state_unlocked(&s);
        }
    }
    close_lock(fd);
    *activationStatus = r;
    return r;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device_, unsigned int *count) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK_GPU(device, count);
    if (!SIM_GPUS[device->gpu].mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    struct node_state s;
    nvmlReturn_t r = load_state(&s);
    if (r) return r;
    *count = s.gpu[device->gpu].mig_enabled ? COMPUTE_SLICES : 0; /* an H200 says 0 with MIG off */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device_, unsigned int index, nvmlDevice_t *migDevice) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK_GPU(device, migDevice);
    if (!SIM_GPUS[device->gpu].mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    if (index >= COMPUTE_SLICES) return NVML_ERROR_INVALID_ARGUMENT;
    struct node_state s;
    nvmlReturn_t r = load_state(&s);
    if (r) return r;
    unsigned n = 0;
    for (unsigned id = 1; id <= MAX_GI && s.gpu[device->gpu].mig_enabled; id++) { /* in GI order */
        struct gi_state *gi = &s.gpu[device->gpu].gi[id];
        if (gi->used && gi->has_ci && n++ == index) {
            *migDevice = mig_handle(device->gpu, id, gi->ci_id);
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device_, unsigned int *isMigDevice) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK(device, isMigDevice);
    *isMigDevice = is_mig(device) ? 1 : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice_, nvmlDevice_t *device) {
    Dev migDevice = migDevice_.handle;
    DEVICE_FAILPOINT(migDevice);
    CHECK(migDevice, device);
    if (!is_mig(migDevice)) return NVML_ERROR_INVALID_ARGUMENT;
    *device = gpu_handle(migDevice->gpu);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device_, unsigned int *id) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK(device, id);
    if (!is_mig(device)) return NVML_ERROR_INVALID_ARGUMENT;
    *id = (unsigned)device->gi;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device_, unsigned int *id) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK(device, id);
    if (!is_mig(device)) return NVML_ERROR_INVALID_ARGUMENT;
    *id = (unsigned)device->ci;
    return NVML_SUCCESS;
}

/* ---- GPU-instance profiles and placements ------------------------------------------------- */

static int profile_by_index(unsigned index) {
    for (unsigned i = 0; i < SIM_NMIG_PROFILES; i++)
        if (SIM_MIG_PROFILES[i].index == index) return (int)i;
    return -1;
}

/* The fields of every profile-info version (the v1 struct lacks `version`). The driver leaves
 * `version` zero in what it returns (seen on an H200 with driver 580). */
#define FILL_GI_PROFILE(info, p)                                                      \
    do {                                                                              \
        (info)->id = (p)->id;                                                         \
        (info)->sliceCount = (p)->slices;                                             \
        (info)->instanceCount = (p)->max_instances;                                   \
        (info)->multiprocessorCount = (p)->sms;                                       \
        (info)->copyEngineCount = (p)->copy_engines;                                  \
        (info)->decoderCount = (p)->decoders;                                         \
        (info)->encoderCount = (p)->encoders;                                         \
        (info)->jpegCount = (p)->jpeg;                                                \
        (info)->ofaCount = (p)->ofa;                                                  \
        (info)->memorySizeMB = (p)->memory_mib;                                       \
    } while (0)

static nvmlReturn_t gi_profile_check(Dev device, const void *info) {
    CHECK_GPU(device, info);
    if (!SIM_GPUS[device->gpu].mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device_, unsigned int profile,
                                                 nvmlGpuInstanceProfileInfo_t *info) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    nvmlReturn_t r = gi_profile_check(device, info);
    if (r) return r;
    if (profile >= NVML_GPU_INSTANCE_PROFILE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    int p = profile_by_index(profile);
    if (p < 0) return NVML_ERROR_NOT_SUPPORTED;
    memset(info, 0, sizeof *info);
    FILL_GI_PROFILE(info, &SIM_MIG_PROFILES[p]);
    return NVML_SUCCESS;
}

static nvmlReturn_t gi_profile_v(int p, nvmlGpuInstanceProfileInfo_v2_t *info) {
    const struct sim_mig_profile *mp = &SIM_MIG_PROFILES[p];
    if (info->version == nvmlGpuInstanceProfileInfo_v2) {
        memset(info, 0, sizeof *info);
        FILL_GI_PROFILE(info, mp);
        snprintf(info->name, sizeof info->name, "MIG %s", mp->name);
        return NVML_SUCCESS;
    }
    if (info->version == nvmlGpuInstanceProfileInfo_v3) {
        nvmlGpuInstanceProfileInfo_v3_t *v3 = (nvmlGpuInstanceProfileInfo_v3_t *)info;
        memset(v3, 0, sizeof *v3);
        FILL_GI_PROFILE(v3, mp);
        snprintf(v3->name, sizeof v3->name, "MIG %s", mp->name);
        return NVML_SUCCESS;
    }
    return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device_, unsigned int profile,
                                                  nvmlGpuInstanceProfileInfo_v2_t *info) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    nvmlReturn_t r = gi_profile_check(device, info);
    if (r) return r;
    if (profile >= NVML_GPU_INSTANCE_PROFILE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    int p = profile_by_index(profile);
    if (p < 0) return NVML_ERROR_NOT_SUPPORTED;
    return gi_profile_v(p, info);
}

/* New in NVML 13 (driver 580): the builder exports it only from there. */
nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoByIdV(nvmlDevice_t device_, unsigned int profileId,
                                                      nvmlGpuInstanceProfileInfo_v2_t *info) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    nvmlReturn_t r = gi_profile_check(device, info);
    if (r) return r;
    int p = profile_by_id(profileId);
    if (p < 0) return NVML_ERROR_NOT_SUPPORTED;
    return gi_profile_v(p, info);
}

nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t device_, unsigned int profileId,
                                                           nvmlGpuInstancePlacement_t *placements,
                                                           unsigned int *count) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    nvmlReturn_t r = gi_profile_check(device, count);
    if (r) return r;
    int p = profile_by_id(profileId);
    if (p < 0) return NVML_ERROR_NOT_SUPPORTED;
    const struct sim_mig_profile *mp = &SIM_MIG_PROFILES[p];
    if (!placements) { /* the count only */
        *count = mp->nplacements;
        return NVML_SUCCESS;
    }
    if (*count < mp->nplacements) {
        *count = mp->nplacements;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned i = 0; i < mp->nplacements; i++)
        placements[i].start = mp->placements[i], placements[i].size = mp->size;
    *count = mp->nplacements;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements(nvmlDevice_t device, unsigned int profileId,
                                                        nvmlGpuInstancePlacement_t *placements,
                                                        unsigned int *count) {
    return nvmlDeviceGetGpuInstancePossiblePlacements_v2(device, profileId, placements, count);
}

/* ---- GPU instances ------------------------------------------------------------------------ */

static nvmlReturn_t create_gi(unsigned g, int p, unsigned start, nvmlGpuInstance_t *out) {
    const struct sim_mig_profile *mp = &SIM_MIG_PROFILES[p];
    struct node_state s;
    int fd = open_lock(1);
    nvmlReturn_t r = read_state_unlocked(&s);
    struct gpu_state *gs = &s.gpu[g];
    unsigned id = 0;
    if (r) goto out;
    if (!gs->mig_enabled) {
        r = NVML_ERROR_NOT_SUPPORTED; /* "doesn't have MIG mode enabled" */
        goto out;
    }
    unsigned same = 0, slices = 0;
    for (unsigned i = 1; i <= MAX_GI; i++) {
        struct gi_state *o = &gs->gi[i];
        if (!o->used) {
            if (!id) id = i;
            continue;
        }
        const struct sim_mig_profile *op = &SIM_MIG_PROFILES[o->profile];
        if (start < o->start + op->size && o->start < start + mp->size) {
            r = NVML_ERROR_INSUFFICIENT_RESOURCES; /* the memory slices are taken */
            goto out;
        }
        same += o->profile == (unsigned)p;
        slices += op->slices;
    }
    if (same >= mp->max_instances || slices + mp->slices > COMPUTE_SLICES || !id) {
        r = NVML_ERROR_INSUFFICIENT_RESOURCES;
        goto out;
    }
    memset(&gs->gi[id], 0, sizeof gs->gi[id]);
    gs->gi[id].used = 1, gs->gi[id].profile = (unsigned)p, gs->gi[id].start = start;
    r = write_state_unlocked(&s);
    if (!r) *out = gi_handle(g, id);
out:
    close_lock(fd);
    return r;
}

nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t device_, unsigned int profileId,
                                                      const nvmlGpuInstancePlacement_t *placement,
                                                      nvmlGpuInstance_t *gpuInstance) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK_GPU(device, gpuInstance);
    if (!placement) return NVML_ERROR_INVALID_ARGUMENT;
    if (!SIM_GPUS[device->gpu].mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    int p = profile_by_id(profileId);
    if (p < 0) return NVML_ERROR_INVALID_ARGUMENT;
    const struct sim_mig_profile *mp = &SIM_MIG_PROFILES[p];
    int ok = placement->size == mp->size;
    for (unsigned i = 0, found = 0; ok && i <= mp->nplacements; i++) {
        if (i == mp->nplacements) ok = found;
        else found |= mp->placements[i] == placement->start;
    }
    if (!ok) return NVML_ERROR_INVALID_ARGUMENT;
    return create_gi(device->gpu, p, placement->start, gpuInstance);
}

nvmlReturn_t nvmlDeviceCreateGpuInstance(nvmlDevice_t device_, unsigned int profileId,
                                         nvmlGpuInstance_t *gpuInstance) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK_GPU(device, gpuInstance);
    if (!SIM_GPUS[device->gpu].mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    int p = profile_by_id(profileId);
    if (p < 0) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = NVML_ERROR_INSUFFICIENT_RESOURCES;
    for (unsigned i = 0; i < SIM_MIG_PROFILES[p].nplacements; i++) { /* first placement that fits */
        r = create_gi(device->gpu, p, SIM_MIG_PROFILES[p].placements[i], gpuInstance);
        if (r != NVML_ERROR_INSUFFICIENT_RESOURCES) break;
    }
    return r;
}

/* The GI behind a handle (state loaded into s), or NULL when it no longer exists. */
static struct gi_state *gi_of(struct node_state *s, GI gi) {
    struct gi_state *st = &s->gpu[gi->gpu].gi[gi->gi];
    return st->used ? st : NULL;
}

#define CHECK_GI(h_)                                                                          \
    do {                                                                                      \
        if (refs == 0) return NVML_ERROR_UNINITIALIZED;                                       \
        if (!(h_) || (h_)->magic != MAGIC_GI || (h_)->gpu >= SIM_NGPUS || (h_)->gi == 0 ||    \
            (h_)->gi > MAX_GI || !is_visible((h_)->gpu))                                      \
            return NVML_ERROR_INVALID_ARGUMENT;                                               \
        if (gpu_lost((h_)->gpu)) return NVML_ERROR_GPU_IS_LOST;                               \
    } while (0)

nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device_, unsigned int id, nvmlGpuInstance_t *gpuInstance) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK_GPU(device, gpuInstance);
    if (!SIM_GPUS[device->gpu].mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    struct node_state s;
    nvmlReturn_t r = load_state(&s);
    if (r) return r;
    if (!s.gpu[device->gpu].mig_enabled) return NVML_ERROR_NOT_SUPPORTED;
    if (id == 0 || id > MAX_GI) return NVML_ERROR_NOT_FOUND;
    if (!s.gpu[device->gpu].gi[id].used) return NVML_ERROR_NOT_FOUND;
    *gpuInstance = gi_handle(device->gpu, id);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t device_, unsigned int profileId,
                                       nvmlGpuInstance_t *gpuInstances, unsigned int *count) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK_GPU(device, count);
    if (!gpuInstances) return NVML_ERROR_INVALID_ARGUMENT;
    if (!SIM_GPUS[device->gpu].mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    int p = profile_by_id(profileId);
    if (p < 0) return NVML_ERROR_INVALID_ARGUMENT;
    struct node_state s;
    nvmlReturn_t r = load_state(&s);
    if (r) return r;
    if (!s.gpu[device->gpu].mig_enabled) return NVML_ERROR_NOT_SUPPORTED;
    unsigned n = 0;
    for (unsigned id = 1; id <= MAX_GI; id++) {
        struct gi_state *gi = &s.gpu[device->gpu].gi[id];
        if (gi->used && gi->profile == (unsigned)p) gpuInstances[n++] = gi_handle(device->gpu, id);
    }
    *count = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance_, nvmlGpuInstanceInfo_t *info) {
    GI gpuInstance = gpuInstance_.handle;
    FAILPOINT(valid_gi(gpuInstance) ? (int)gpuInstance->gpu : -1);
    CHECK_GI(gpuInstance);
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    struct node_state s;
    nvmlReturn_t r = load_state(&s);
    if (r) return r;
    struct gi_state *gi = gi_of(&s, gpuInstance);
    if (!gi) return NVML_ERROR_INVALID_ARGUMENT;
    const struct sim_mig_profile *mp = &SIM_MIG_PROFILES[gi->profile];
    memset(info, 0, sizeof *info);
    info->device = gpu_handle(gpuInstance->gpu);
    info->id = gpuInstance->gi;
    info->profileId = mp->id;
    info->placement.start = gi->start;
    info->placement.size = mp->size;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpuInstanceDestroy(nvmlGpuInstance_t gpuInstance_) {
    GI gpuInstance = gpuInstance_.handle;
    FAILPOINT(valid_gi(gpuInstance) ? (int)gpuInstance->gpu : -1);
    CHECK_GI(gpuInstance);
    struct node_state s;
    int fd = open_lock(1);
    nvmlReturn_t r = read_state_unlocked(&s);
    if (!r) {
        struct gi_state *gi = gi_of(&s, gpuInstance);
        if (!gi) r = NVML_ERROR_INVALID_ARGUMENT;
        else if (gi->has_ci) r = NVML_ERROR_IN_USE; /* compute instances are active on it */
        else {
            memset(gi, 0, sizeof *gi);
            r = write_state_unlocked(&s);
        }
    }
    close_lock(fd);
    return r;
}

/* ---- compute instances ------------------------------------------------------------------- */

static nvmlReturn_t ci_profile_fill(const struct sim_mig_profile *gp, unsigned profile, unsigned eng,
                                    nvmlComputeInstanceProfileInfo_v2_t *info, int with_version) {
    int slices = slices_of_ci_profile(profile);
    if (profile >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT || eng >= NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (slices < 0 || (unsigned)slices > gp->slices) return NVML_ERROR_NOT_SUPPORTED;
    unsigned sms = gp->sms * (unsigned)slices / (gp->slices ? gp->slices : 1);
    if (with_version) {
        memset(info, 0, sizeof *info);
        info->id = profile, info->sliceCount = (unsigned)slices;
        info->instanceCount = gp->slices / (unsigned)slices;
        info->multiprocessorCount = sms;
        info->sharedCopyEngineCount = gp->copy_engines, info->sharedDecoderCount = gp->decoders;
        info->sharedEncoderCount = gp->encoders, info->sharedJpegCount = gp->jpeg, info->sharedOfaCount = gp->ofa;
        snprintf(info->name, sizeof info->name, "MIG %uc.%s", (unsigned)slices, gp->name);
    } else {
        nvmlComputeInstanceProfileInfo_t *v1 = (nvmlComputeInstanceProfileInfo_t *)info;
        memset(v1, 0, sizeof *v1);
        v1->id = profile, v1->sliceCount = (unsigned)slices;
        v1->instanceCount = gp->slices / (unsigned)slices;
        v1->multiprocessorCount = sms;
        v1->sharedCopyEngineCount = gp->copy_engines, v1->sharedDecoderCount = gp->decoders;
        v1->sharedEncoderCount = gp->encoders, v1->sharedJpegCount = gp->jpeg, v1->sharedOfaCount = gp->ofa;
    }
    return NVML_SUCCESS;
}

static nvmlReturn_t ci_profile_info(GI gpuInstance, unsigned profile, unsigned eng, void *info,
                                    int with_version) {
    CHECK_GI(gpuInstance);
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    if (with_version) {
        unsigned v = ((nvmlComputeInstanceProfileInfo_v2_t *)info)->version;
        if (v != nvmlComputeInstanceProfileInfo_v2 && v != nvmlComputeInstanceProfileInfo_v3)
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    }
    struct node_state s;
    nvmlReturn_t r = load_state(&s);
    if (r) return r;
    struct gi_state *gi = gi_of(&s, gpuInstance);
    if (!gi) return NVML_ERROR_INVALID_ARGUMENT;
    return ci_profile_fill(&SIM_MIG_PROFILES[gi->profile], profile, eng, info, with_version);
}

nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t gpuInstance_, unsigned int profile,
                                                          unsigned int engProfile,
                                                          nvmlComputeInstanceProfileInfo_t *info) {
    GI gpuInstance = gpuInstance_.handle;
    FAILPOINT(valid_gi(gpuInstance) ? (int)gpuInstance->gpu : -1);
    return ci_profile_info(gpuInstance, profile, engProfile, info, 0);
}

nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvmlGpuInstance_t gpuInstance_, unsigned int profile,
                                                           unsigned int engProfile,
                                                           nvmlComputeInstanceProfileInfo_v2_t *info) {
    GI gpuInstance = gpuInstance_.handle;
    FAILPOINT(valid_gi(gpuInstance) ? (int)gpuInstance->gpu : -1);
    return ci_profile_info(gpuInstance, profile, engProfile, info, 1);
}

static void random_mig_uuid(char *out, size_t n) {
    unsigned char b[16] = {0};
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0 || read(fd, b, sizeof b) != (ssize_t)sizeof b) { /* fall back on time and pid */
        unsigned long long t = (unsigned long long)time(NULL) ^ ((unsigned long long)getpid() << 32);
        for (int i = 0; i < 16; i++) b[i] ^= (unsigned char)(t >> (8 * (i % 8))) + (unsigned char)i;
    }
    if (fd >= 0) close(fd);
    b[6] = (b[6] & 0x0f) | 0x40, b[8] = (b[8] & 0x3f) | 0x80;
    snprintf(out, n, "MIG-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
             b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(nvmlGpuInstance_t gpuInstance_, unsigned int profileId,
                                                  nvmlComputeInstance_t *computeInstance) {
    GI gpuInstance = gpuInstance_.handle;
    FAILPOINT(valid_gi(gpuInstance) ? (int)gpuInstance->gpu : -1);
    CHECK_GI(gpuInstance);
    if (!computeInstance) return NVML_ERROR_INVALID_ARGUMENT;
    int slices = slices_of_ci_profile(profileId);
    if (slices < 0) return NVML_ERROR_INVALID_ARGUMENT;
    struct node_state s;
    int fd = open_lock(1);
    nvmlReturn_t r = read_state_unlocked(&s);
    if (!r) {
        struct gi_state *gi = gi_of(&s, gpuInstance);
        if (!gi) r = NVML_ERROR_INVALID_ARGUMENT;
        else if ((unsigned)slices > SIM_MIG_PROFILES[gi->profile].slices) r = NVML_ERROR_NOT_SUPPORTED;
        else if ((unsigned)slices != SIM_MIG_PROFILES[gi->profile].slices)
            r = NVML_ERROR_NOT_SUPPORTED; /* the simulation makes only full-GI compute instances */
        else if (gi->has_ci) r = NVML_ERROR_INSUFFICIENT_RESOURCES; /* its slices are taken */
        else {
            gi->has_ci = 1, gi->ci_id = 0, gi->ci_compute_mode = 0;
            random_mig_uuid(gi->uuid, sizeof gi->uuid);
            r = write_state_unlocked(&s);
            if (!r) *computeInstance = ci_handle(gpuInstance->gpu, gpuInstance->gi, 0);
        }
    }
    close_lock(fd);
    return r;
}

nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t gpuInstance_, unsigned int id,
                                                   nvmlComputeInstance_t *computeInstance) {
    GI gpuInstance = gpuInstance_.handle;
    FAILPOINT(valid_gi(gpuInstance) ? (int)gpuInstance->gpu : -1);
    CHECK_GI(gpuInstance);
    if (!computeInstance) return NVML_ERROR_INVALID_ARGUMENT;
    struct node_state s;
    nvmlReturn_t r = load_state(&s);
    if (r) return r;
    struct gi_state *gi = gi_of(&s, gpuInstance);
    if (!gi) return NVML_ERROR_INVALID_ARGUMENT;
    if (id >= MAX_CI || !gi->has_ci || gi->ci_id != id) return NVML_ERROR_NOT_FOUND;
    *computeInstance = ci_handle(gpuInstance->gpu, gpuInstance->gi, id);
    return NVML_SUCCESS;
}

#define CHECK_CI(h_)                                                                           \
    do {                                                                                       \
        if (refs == 0) return NVML_ERROR_UNINITIALIZED;                                        \
        if (!(h_) || (h_)->magic != MAGIC_CI || (h_)->gpu >= SIM_NGPUS || (h_)->gi == 0 ||     \
            (h_)->gi > MAX_GI || (h_)->ci >= MAX_CI || !is_visible((h_)->gpu))                 \
            return NVML_ERROR_INVALID_ARGUMENT;                                                \
        if (gpu_lost((h_)->gpu)) return NVML_ERROR_GPU_IS_LOST;                                \
    } while (0)

static struct gi_state *ci_of(struct node_state *s, CI ci) {
    struct gi_state *st = &s->gpu[ci->gpu].gi[ci->gi];
    return st->used && st->has_ci && st->ci_id == ci->ci ? st : NULL;
}

nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t computeInstance_, nvmlComputeInstanceInfo_t *info) {
    CI computeInstance = computeInstance_.handle;
    FAILPOINT(valid_ci(computeInstance) ? (int)computeInstance->gpu : -1);
    CHECK_CI(computeInstance);
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    struct node_state s;
    nvmlReturn_t r = load_state(&s);
    if (r) return r;
    struct gi_state *gi = ci_of(&s, computeInstance);
    if (!gi) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned slices = SIM_MIG_PROFILES[gi->profile].slices;
    memset(info, 0, sizeof *info);
    info->device = gpu_handle(computeInstance->gpu);
    info->gpuInstance = gi_handle(computeInstance->gpu, computeInstance->gi);
    info->id = computeInstance->ci;
    info->profileId = (unsigned)ci_profile_of_slices(slices);
    info->placement.start = 0;
    info->placement.size = slices;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlComputeInstanceGetInfo(nvmlComputeInstance_t ci, nvmlComputeInstanceInfo_t *info) {
    return nvmlComputeInstanceGetInfo_v2(ci, info);
}

nvmlReturn_t nvmlComputeInstanceDestroy(nvmlComputeInstance_t computeInstance_) {
    CI computeInstance = computeInstance_.handle;
    FAILPOINT(valid_ci(computeInstance) ? (int)computeInstance->gpu : -1);
    CHECK_CI(computeInstance);
    struct node_state s;
    unsigned pids[4];
    int fd = open_lock(1);
    nvmlReturn_t r = read_state_unlocked(&s);
    if (!r) {
        struct gi_state *gi = ci_of(&s, computeInstance);
        if (!gi) r = NVML_ERROR_INVALID_ARGUMENT;
        else if (read_processes(gi->uuid, pids, 4)) r = NVML_ERROR_IN_USE; /* processes run on it */
        else {
            gi->has_ci = 0, gi->ci_id = 0, gi->ci_compute_mode = 0, gi->uuid[0] = 0;
            r = write_state_unlocked(&s);
        }
    }
    close_lock(fd);
    return r;
}

/* ---- NVLink, topology, fabric -------------------------------------------------------------- */

static nvmlReturn_t link_check(Dev device, unsigned link, const void *out) {
    CHECK_GPU(device, out);
    const struct sim_gpu *g = &SIM_GPUS[device->gpu];
    if (g->nvlink_count == 0) return NVML_ERROR_NOT_SUPPORTED;
    if (link >= g->nvlink_count) return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device_, unsigned int link, nvmlEnableState_t *isActive) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    nvmlReturn_t r = link_check(device, link, isActive);
    if (r) return r;
    *isActive = SIM_GPUS[device->gpu].links[link].remote ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device_, unsigned int link, nvmlPciInfo_t *pci) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    nvmlReturn_t r = link_check(device, link, pci);
    if (r) return r;
    const char *remote = SIM_GPUS[device->gpu].links[link].remote;
    unsigned dom, bus, dev, fn;
    if (!remote || !parse_bus_id(remote, &dom, &bus, &dev, &fn)) return NVML_ERROR_NOT_SUPPORTED;
    fill_pci(pci, dom, bus, dev, fn);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci) {
    return nvmlDeviceGetNvLinkRemotePciInfo_v2(device, link, pci);
}

nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device_, unsigned int link,
                                                 nvmlIntNvLinkDeviceType_t *type) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    nvmlReturn_t r = link_check(device, link, type);
    if (r) return r;
    const struct sim_link *l = &SIM_GPUS[device->gpu].links[link];
    if (!l->remote) return NVML_ERROR_NOT_SUPPORTED;
    *type = l->remote_is_gpu ? NVML_NVLINK_DEVICE_TYPE_GPU : NVML_NVLINK_DEVICE_TYPE_SWITCH;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1_, nvmlDevice_t device2_,
                                                 nvmlGpuTopologyLevel_t *pathInfo) {
    Dev device1 = device1_.handle;
    Dev device2 = device2_.handle;
    DEVICE_FAILPOINT(device1);
    CHECK_GPU(device1, pathInfo);
    CHECK_GPU(device2, pathInfo);
    const struct sim_gpu *a = &SIM_GPUS[device1->gpu], *b = &SIM_GPUS[device2->gpu];
    if (a == b) return NVML_ERROR_NOT_SUPPORTED; /* what a real H200 answers for itself */
    if (a->pcie_switch >= 0 && a->pcie_switch == b->pcie_switch) *pathInfo = NVML_TOPOLOGY_SINGLE;
    else if (a->pcie_root >= 0 && a->pcie_root == b->pcie_root) *pathInfo = NVML_TOPOLOGY_HOSTBRIDGE;
    else if (a->numa >= 0 && a->numa == b->numa) *pathInfo = NVML_TOPOLOGY_NODE;
    else *pathInfo = NVML_TOPOLOGY_SYSTEM;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device_, nvmlGpuFabricInfoV_t *gpuFabricInfo) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK_GPU(device, gpuFabricInfo);
    const struct sim_gpu *g = &SIM_GPUS[device->gpu];
    unsigned version = gpuFabricInfo->version;
    if (version != nvmlGpuFabricInfo_v2 && version != nvmlGpuFabricInfo_v3)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (!g->has_fabric && g->arch < NVML_DEVICE_ARCH_HOPPER) return NVML_ERROR_NOT_SUPPORTED;
    size_t size = version == nvmlGpuFabricInfo_v3 ? sizeof(nvmlGpuFabricInfo_v3_t) : sizeof(nvmlGpuFabricInfo_v2_t);
    memset(gpuFabricInfo, 0, size);
    gpuFabricInfo->version = version; /* kept, as an H200 keeps it */
    gpuFabricInfo->status = NVML_SUCCESS;
    if (g->has_fabric) { /* Hopper without a fabric: success, state NOT_SUPPORTED, zero cluster */
        memcpy(gpuFabricInfo->clusterUuid, g->cluster_uuid, sizeof g->cluster_uuid);
        gpuFabricInfo->cliqueId = g->clique_id;
        gpuFabricInfo->state = (nvmlGpuFabricState_t)g->fabric_state;
    }
    return NVML_SUCCESS;
}

/* ---- events, health fields ---------------------------------------------------------------- */

#define SIM_SUPPORTED_EVENTS                                                               \
    (nvmlEventTypeXidCriticalError | nvmlEventTypeDoubleBitEccError | nvmlEventTypeSingleBitEccError | \
     nvmlEventTypeGpuUnavailableError | nvmlEventTypeGpuRecoveryAction)

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device_, unsigned long long *eventTypes) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK_GPU(device, eventTypes);
    *eventTypes = SIM_SUPPORTED_EVENTS;
    return NVML_SUCCESS;
}

static unsigned long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    FAILPOINT(-1);
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    struct nvmlEventSet_st *s = calloc(1, sizeof *s);
    if (!s) return NVML_ERROR_MEMORY;
    s->magic = MAGIC_SET;
    s->created_ns = now_ns();
    snprintf(s->cursor, sizeof s->cursor, "%020llu", s->created_ns); /* only events made from now on */
    *set = (nvmlEventSet_t){s};
    return NVML_SUCCESS;
}

static int valid_set(SET set) { return set && set->magic == MAGIC_SET; }

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device_, unsigned long long eventTypes, nvmlEventSet_t set_) {
    Dev device = device_.handle;
    SET set = set_.handle;
    DEVICE_FAILPOINT(device);
    CHECK_DEV(device);
    if (!valid_set(set)) return NVML_ERROR_INVALID_ARGUMENT;
    if (is_mig(device)) return NVML_ERROR_NOT_SUPPORTED; /* no per-instance event reporting */
    if (eventTypes & ~(unsigned long long)SIM_SUPPORTED_EVENTS) return NVML_ERROR_NOT_SUPPORTED;
    set->masks[device->gpu] |= eventTypes;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set_) {
    SET set = set_.handle;
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    if (!valid_set(set)) return NVML_ERROR_INVALID_ARGUMENT;
    set->magic = 0;
    free(set);
    return NVML_SUCCESS;
}

/* The next spooled event for the set (advancing its cursor); 1 if one was found. */
static int next_event(SET set, nvmlEventData_t *data) {
    char dirpath[4096];
    sim_path(dirpath, sizeof dirpath, "events");
    for (;;) {
        DIR *d = opendir(dirpath);
        if (!d) return 0;
        char best[128] = "";
        struct dirent *e;
        while ((e = readdir(d))) {
            size_t len = strlen(e->d_name);
            if (e->d_name[0] < '0' || e->d_name[0] > '9' || len < 7 || len >= sizeof best ||
                strcmp(e->d_name + len - 6, ".event"))
                continue;
            if (strcmp(e->d_name, set->cursor) > 0 && (!best[0] || strcmp(e->d_name, best) < 0))
                snprintf(best, sizeof best, "%s", e->d_name);
        }
        closedir(d);
        if (!best[0]) return 0;
        snprintf(set->cursor, sizeof set->cursor, "%s", best);
        char path[4300], uuid[128];
        unsigned long long type, value;
        unsigned gi, ci;
        snprintf(path, sizeof path, "%s/%s", dirpath, best);
        FILE *f = fopen(path, "re");
        if (!f) continue; /* cleaned up meanwhile */
        int n = fscanf(f, "%127s %llu %llu %u %u", uuid, &type, &value, &gi, &ci);
        fclose(f);
        int g = n == 5 ? gpu_by_uuid(uuid) : -1;
        if (g < 0 || !is_visible((unsigned)g) || !(set->masks[g] & type)) continue;
        memset(data, 0, sizeof *data);
        data->device = gpu_handle((unsigned)g);
        data->eventType = type;
        data->eventData = value;
        data->gpuInstanceId = gi;
        data->computeInstanceId = ci;
        return 1;
    }
}

/* Watches for what can end an event wait: a new event file or lost marker (both are written by
 * rename), or the creation of their directories (made at the first injection: until then the
 * watch of the directory above wakes the wait, which then watches the new one). Returns whether
 * the spool's directory or the one it is made in is watched: with either, no change goes unseen. */
static int arm_event_watches(int fd, int armed[4]) {
    static const char *const rel[3] = {"events", "lost", ""};
    for (int i = 0; i < 4; i++) {
        if (!armed[i]) {
            char path[4096];
            if (i < 3)
                sim_path(path, sizeof path, rel[i]);
            else /* the device-node directory, where the spool itself is made */
                snprintf(path, sizeof path, "%s", sim_dev_dir());
            armed[i] = inotify_add_watch(fd, path, IN_CREATE | IN_MOVED_TO | IN_ONLYDIR) >= 0;
        }
    }
    return armed[2] || armed[3];
}

/* Sleeps in the kernel until the spool changes or the wait times out, as the real driver's wait
 * does: 56 health watchers polling a directory every 10 ms cost their plugin ~0.13 CPU a second,
 * which no real node pays. Without inotify (or without the spool's directory) it polls every 10 ms. */
nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set_, nvmlEventData_t *data, unsigned int timeoutms) {
    SET set = set_.handle;
    FAILPOINT(-1);
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    if (!valid_set(set) || !data) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long deadline = now_ns() + (unsigned long long)timeoutms * 1000000ULL;
    int fd = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
    int armed[4] = {0, 0, 0, 0};
    nvmlReturn_t rc;
    for (;;) {
        /* armed before looking, so that a file renamed in after the look still wakes the wait */
        int watched = fd >= 0 ? arm_event_watches(fd, armed) : 0;
        if (next_event(set, data)) {
            rc = NVML_SUCCESS;
            break;
        }
        int lost = 0;
        for (unsigned g = 0; g < SIM_NGPUS && !lost; g++) lost = set->masks[g] && gpu_lost(g);
        if (lost) {
            rc = NVML_ERROR_GPU_IS_LOST;
            break;
        }
        unsigned long long now = now_ns();
        if (now >= deadline) {
            rc = NVML_ERROR_TIMEOUT;
            break;
        }
        unsigned long long left = deadline - now;
        if (watched) {
            struct pollfd pfd = {fd, POLLIN, 0};
            unsigned long long ms = left / 1000000ULL + 1;
            if (poll(&pfd, 1, ms > 1000 ? 1000 : (int)ms) > 0) {
                char buf[4096];
                while (read(fd, buf, sizeof buf) > 0) {
                }
            }
        } else {
            struct timespec ts = {0, (long)(left < 10000000ULL ? left : 10000000ULL)};
            nanosleep(&ts, NULL);
        }
    }
    if (fd >= 0) close(fd);
    return rc;
}
nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    return nvmlEventSetWait_v2(set, data, timeoutms);
}

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device_, int valuesCount, nvmlFieldValue_t *values) {
    Dev device = device_.handle;
    DEVICE_FAILPOINT(device);
    CHECK(device, values);
    if (valuesCount < 0) return NVML_ERROR_INVALID_ARGUMENT;
    long long ts = (long long)(now_ns() / 1000ULL);
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *v = &values[i];
        v->timestamp = ts;
        v->latencyUsec = 0;
        memset(&v->value, 0, sizeof v->value);
        if (v->fieldId == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION && !is_mig(device)) {
            v->nvmlReturn = NVML_SUCCESS;
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
            v->value.uiVal = read_number_file("recovery", SIM_GPUS[device->gpu].uuid);
        } else {
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    return NVML_SUCCESS;
}
