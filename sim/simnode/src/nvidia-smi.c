/* Simulated nvidia-smi: a client of libnvidia-ml.so.1 only (linked, not dlopen'ed, so it cannot
 * start where the loader does not find the library). Implements the listing, the CSV query and a
 * short status table in the real program's formats and exit codes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int nvmlReturn_t;
typedef const void *nvmlDevice_t;
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;

nvmlReturn_t nvmlInit_v2(void);
nvmlReturn_t nvmlShutdown(void);
nvmlReturn_t nvmlSystemGetDriverVersion(char *, unsigned int);
nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *);
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *);
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int, nvmlDevice_t *);
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t, char *, unsigned int);
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t, char *, unsigned int);
nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t, unsigned int *);
nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t, nvmlPciInfo_t *);
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t, nvmlMemory_t *);
nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t, int *); /* nvmlComputeMode_t */
nvmlReturn_t nvmlDeviceSetComputeMode(nvmlDevice_t, int);
const char *nvmlErrorString(nvmlReturn_t);
enum { COMPUTEMODE_DEFAULT = 0, COMPUTEMODE_PROHIBITED = 2, COMPUTEMODE_EXCLUSIVE_PROCESS = 3 };

enum { EXIT_BAD_ARGS = 2, EXIT_NO_DEVICES = 6 };

struct gpu {
    unsigned index, minor;
    char name[96], uuid[96], driver[80], bus_id[32];
    unsigned long long mem_mib;
    int compute_mode;
};

/* NVML's init, and what nvidia-smi says when it fails (its exit status is NVML's code). */
static int init_failed(void) {
    int rc = nvmlInit_v2();
    if (rc == 18) /* NVML_ERROR_LIB_RM_VERSION_MISMATCH: libraries of another driver */
        printf("Failed to initialize NVML: Driver/library version mismatch\n");
    else if (rc != 0)
        printf("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
               "Make sure that the latest NVIDIA driver is installed and running.\n\n");
    return rc;
}

static void read_gpu(unsigned i, struct gpu *g) {
    nvmlDevice_t d;
    nvmlPciInfo_t pci;
    nvmlMemory_t mem;
    memset(g, 0, sizeof *g);
    g->index = i;
    nvmlDeviceGetHandleByIndex_v2(i, &d);
    nvmlDeviceGetName(d, g->name, sizeof g->name);
    nvmlDeviceGetUUID(d, g->uuid, sizeof g->uuid);
    nvmlDeviceGetMinorNumber(d, &g->minor);
    if (nvmlDeviceGetPciInfo_v3(d, &pci) == 0) strcpy(g->bus_id, pci.busId);
    if (nvmlDeviceGetMemoryInfo(d, &mem) == 0) g->mem_mib = mem.total >> 20;
    if (nvmlDeviceGetComputeMode(d, &g->compute_mode) != 0) g->compute_mode = -1;
    nvmlSystemGetDriverVersion(g->driver, sizeof g->driver);
}

/* The `--query-gpu` fields: name, accepted alias, CSV header (the unit stays with nounits). */
enum kind { F_INDEX, F_UUID, F_NAME, F_DRIVER, F_BUS_ID, F_MINOR, F_MEM_TOTAL, F_COMPUTE_MODE };
static const struct { const char *name, *alias, *header; enum kind kind; } FIELDS[] = {
    {"index", "index", "index", F_INDEX},
    {"uuid", "gpu_uuid", "uuid", F_UUID},
    {"name", "gpu_name", "name", F_NAME},
    {"driver_version", "driver_version", "driver_version", F_DRIVER},
    {"pci.bus_id", "gpu_bus_id", "pci.bus_id", F_BUS_ID},
    {"minor_number", "minor_number", "minor_number", F_MINOR},
    {"memory.total", "memory.total", "memory.total [MiB]", F_MEM_TOTAL},
    {"compute_mode", "compute_mode", "compute_mode", F_COMPUTE_MODE},
};
#define NFIELDS (int)(sizeof FIELDS / sizeof FIELDS[0])

static int find_field(const char *f) {
    for (int i = 0; i < NFIELDS; i++)
        if (!strcmp(f, FIELDS[i].name) || !strcmp(f, FIELDS[i].alias)) return i;
    return -1;
}

static void print_value(enum kind k, const struct gpu *g, int units) {
    switch (k) {
    case F_INDEX: printf("%u", g->index); break;
    case F_UUID: printf("%s", g->uuid); break;
    case F_NAME: printf("%s", g->name); break;
    case F_DRIVER: printf("%s", g->driver); break;
    case F_BUS_ID: printf("%s", g->bus_id); break;
    case F_MINOR: printf("%u", g->minor); break;
    case F_MEM_TOTAL: printf(units ? "%llu MiB" : "%llu", g->mem_mib); break;
    case F_COMPUTE_MODE:
        printf("%s", g->compute_mode == COMPUTEMODE_DEFAULT             ? "Default"
                     : g->compute_mode == COMPUTEMODE_EXCLUSIVE_PROCESS ? "Exclusive_Process"
                     : g->compute_mode == COMPUTEMODE_PROHIBITED        ? "Prohibited"
                                                                        : "[N/A]");
        break;
    }
}

static int qidx[64], qn; /* the parsed --query-gpu fields */

/* Checked before talking to the driver, as the real program rejects a bad field first. */
static int parse_fields(const char *fields) {
    char list[1024], *save, *f;
    snprintf(list, sizeof list, "%s", fields);
    for (f = strtok_r(list, ", ", &save); f && qn < 64; f = strtok_r(NULL, ", ", &save)) {
        if ((qidx[qn++] = find_field(f)) < 0) {
            printf("Field \"%s\" is not a valid field to query.\n\n", f);
            return EXIT_BAD_ARGS;
        }
    }
    return 0;
}

static int query(const char *format, unsigned count) {
    int header = !strstr(format, "noheader"), units = !strstr(format, "nounits");
    for (int i = 0; header && i < qn; i++) printf("%s%s", i ? ", " : "", FIELDS[qidx[i]].header);
    if (header) printf("\n");
    for (unsigned d = 0; d < count; d++) {
        struct gpu g;
        read_gpu(d, &g);
        for (int i = 0; i < qn; i++) {
            if (i) printf(", ");
            print_value(FIELDS[qidx[i]].kind, &g, units);
        }
        printf("\n");
    }
    return 0;
}

static int table(unsigned count) {
    char driver[80] = "";
    int cuda = 0;
    time_t now = time(NULL);
    char cudastr[16];
    nvmlSystemGetDriverVersion(driver, sizeof driver);
    nvmlSystemGetCudaDriverVersion_v2(&cuda);
    snprintf(cudastr, sizeof cudastr, "%d.%d", cuda / 1000, cuda % 1000 / 10);
    const char *rule = "+-----------------------------------------+------------------------+----------------------+";
    printf("%s", ctime(&now));
    printf("+-----------------------------------------------------------------------------------------+\n");
    printf("| NVIDIA-SMI %-22s Driver Version: %-14s CUDA Version: %-9s|\n", driver, driver, cudastr);
    printf("%s\n| GPU  Name                               | Bus-Id                 |         Memory-Usage |\n", rule);
    printf("|=========================================+========================+======================|\n");
    for (unsigned i = 0; i < count; i++) {
        struct gpu g;
        char mem[32];
        read_gpu(i, &g);
        snprintf(mem, sizeof mem, "0MiB / %lluMiB", g.mem_mib);
        printf("| %3u  %-34.34s | %-22s | %20s |\n", i, g.name, g.bus_id, mem);
    }
    printf("%s\n", rule);
    return 0;
}

/* Time-slice levels live in the (simulated) kernel module until reboot: a file next to the
 * device nodes, one "<uuid> <level>" line per GPU whose level is not the default (0). */
static void timeslice_path(char *out, size_t n) {
    const char *d = getenv("DRA_GPU_SIM_DEV_DIR");
    snprintf(out, n, "%s/.nvidia-sim-timeslices", d && *d ? d : "/dev");
}

static int timeslice_of(const char *uuid) {
    char path[4096], u[96];
    int level, found = 0;
    timeslice_path(path, sizeof path);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    while (fscanf(f, "%95s %d", u, &level) == 2)
        if (!strcmp(u, uuid)) found = level;
    fclose(f);
    return found;
}

static int set_timeslice(const char *uuid, int level) {
    char path[4096], tmp[4200], u[96];
    int l;
    timeslice_path(path, sizeof path);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *in = fopen(path, "r"), *out = fopen(tmp, "w");
    if (!out) return -1;
    while (in && fscanf(in, "%95s %d", u, &l) == 2)
        if (strcmp(u, uuid)) fprintf(out, "%s %d\n", u, l);
    if (in) fclose(in);
    if (level) fprintf(out, "%s %d\n", uuid, level);
    fclose(out);
    return rename(tmp, path);
}

/* `-i <index|uuid>`: whether GPU `d` is the one named (every GPU when none is). */
static int selected(const char *id, unsigned d, const struct gpu *g) {
    char index[16];
    snprintf(index, sizeof index, "%u", d);
    return !id || !strcmp(id, g->uuid) || !strcmp(id, index);
}

static const char *LEVELS[] = {"DEFAULT", "SHORT", "MEDIUM", "LONG"};

/* `compute-policy [-i <index|uuid>] (--set-timeslice <0..3> | -l)` */
static int compute_policy(int argc, char **argv) {
    const char *id = NULL;
    int set = -1, list = 0;
    for (int i = 1; i < argc; i++) {
        if ((!strcmp(argv[i], "-i") || !strcmp(argv[i], "--id")) && i + 1 < argc) id = argv[++i];
        else if (!strcmp(argv[i], "--set-timeslice") && i + 1 < argc) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 0 || v > 3) {
                printf("Invalid timeslice value \"%s\" (valid: 0-3).\n", argv[i]);
                return EXIT_BAD_ARGS;
            }
            set = (int)v;
        } else if (!strcmp(argv[i], "-l") || !strcmp(argv[i], "--list")) list = 1;
        else {
            printf("Invalid combination of input arguments. Please run 'nvidia-smi compute-policy -h' for help.\n\n");
            return EXIT_BAD_ARGS;
        }
    }
    if (set < 0 && !list) {
        printf("Invalid combination of input arguments. Please run 'nvidia-smi compute-policy -h' for help.\n\n");
        return EXIT_BAD_ARGS;
    }
    int rc = init_failed();
    if (rc != 0) return rc;
    unsigned count = 0, matched = 0;
    nvmlDeviceGetCount_v2(&count);
    for (unsigned d = 0; d < count; d++) {
        struct gpu g;
        read_gpu(d, &g);
        if (!selected(id, d, &g)) continue;
        matched++;
        if (set >= 0) {
            if (set_timeslice(g.uuid, set) != 0) {
                printf("Failed to set timeslice for GPU %s: Insufficient Permissions\n", g.uuid);
                nvmlShutdown();
                return 4;
            }
            printf("Set timeslice to %d for GPU %s.\n", set, g.uuid);
        } else {
            int level = timeslice_of(g.uuid);
            printf("GPU %u (%s): Timeslice %d (%s)\n", d, g.uuid, level, LEVELS[level]);
        }
    }
    nvmlShutdown();
    if (!matched) {
        printf("No devices were found\n");
        return EXIT_NO_DEVICES;
    }
    return 0;
}

static const char *MODE_NAMES[] = {"DEFAULT", NULL, "PROHIBITED", "EXCLUSIVE_PROCESS"};

/* `-i <index|uuid> -c <DEFAULT|PROHIBITED|EXCLUSIVE_PROCESS|0|2|3>` through nvmlDeviceSetComputeMode,
 * as NVIDIA's DRA driver runs it before setting a time slice. */
static int set_compute_mode(const char *id, const char *text) {
    int mode = -1;
    for (int m = 0; m < 4; m++)
        if (MODE_NAMES[m] && (!strcmp(text, MODE_NAMES[m]) || (text[0] == '0' + m && !text[1]))) mode = m;
    if (mode < 0) {
        printf("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n\n");
        return EXIT_BAD_ARGS;
    }
    int rc = init_failed();
    if (rc != 0) return rc;
    unsigned count = 0, matched = 0;
    nvmlDeviceGetCount_v2(&count);
    for (unsigned d = 0; d < count; d++) {
        struct gpu g;
        nvmlDevice_t h;
        read_gpu(d, &g);
        if (!selected(id, d, &g)) continue;
        matched++;
        nvmlDeviceGetHandleByIndex_v2(d, &h);
        nvmlReturn_t r = nvmlDeviceSetComputeMode(h, mode);
        if (r != 0) {
            printf("Unable to set the compute mode for GPU %s: %s\n", g.bus_id, nvmlErrorString(r));
            rc = 3;
            continue;
        }
        printf("Set compute mode to %s for GPU %s.\n", MODE_NAMES[mode], g.bus_id);
    }
    nvmlShutdown();
    if (!matched) {
        printf("No devices were found\n");
        return EXIT_NO_DEVICES;
    }
    if (rc == 0) printf("All done.\n");
    return rc;
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "compute-policy")) return compute_policy(argc - 1, argv + 1);
    const char *fields = NULL, *format = NULL, *id = NULL, *compute_mode = NULL;
    int list = 0;
    for (int i = 1; i < argc; i++) {
        if ((!strcmp(argv[i], "-i") || !strcmp(argv[i], "--id")) && i + 1 < argc) id = argv[++i];
        else if (!strncmp(argv[i], "--id=", 5)) id = argv[i] + 5;
        else if (!strcmp(argv[i], "-c") && i + 1 < argc) compute_mode = argv[++i];
        else if (!strncmp(argv[i], "--compute-mode=", 15)) compute_mode = argv[i] + 15;
        else if (!strcmp(argv[i], "-L") || !strcmp(argv[i], "--list-gpus")) list = 1;
        else if (!strncmp(argv[i], "--query-gpu=", 12)) fields = argv[i] + 12;
        else if (!strncmp(argv[i], "--format=", 9)) format = argv[i] + 9;
        else {
            printf("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n\n");
            return EXIT_BAD_ARGS;
        }
    }
    if (compute_mode) {
        if (list || fields) {
            printf("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n\n");
            return EXIT_BAD_ARGS;
        }
        return set_compute_mode(id, compute_mode);
    }
    if (id) {  /* -i narrows only what this simulation implements with it */
        printf("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n\n");
        return EXIT_BAD_ARGS;
    }
    if (fields && (!format || strncmp(format, "csv", 3))) {
        printf("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n\n");
        return EXIT_BAD_ARGS;
    }
    if (fields && parse_fields(fields)) return EXIT_BAD_ARGS;
    int rc = init_failed();
    if (rc != 0) return rc;
    unsigned count = 0;
    nvmlDeviceGetCount_v2(&count);
    if (count == 0) {
        printf(list ? "No devices found.\n" : "No devices were found\n");
        nvmlShutdown();
        return EXIT_NO_DEVICES;
    }
    if (list) {
        for (unsigned i = 0; i < count; i++) {
            struct gpu g;
            read_gpu(i, &g);
            printf("GPU %u: %s (UUID: %s)\n", i, g.name, g.uuid);
        }
        rc = 0;
    } else if (fields) rc = query(format, count);
    else rc = table(count);
    nvmlShutdown();
    return rc;
}
