/* A minimal CUDA driver API client: cuInit, cuDeviceGet, cuCtxCreate, cuCtxDestroy.
 *
 *     cuda_client LIBCUDA
 *
 * dlopen()s the given libcuda.so.1 (the driver root's, by full path) and declares the few
 * prototypes it needs itself, so it builds with a plain C compiler and no CUDA headers. Prints
 * one line per call ("cuInit 0 CUDA_SUCCESS") and exits with the first non-zero CUresult's low
 * byte (0 when every call succeeded). Under MPS (CUDA_MPS_PIPE_DIRECTORY set) the context is the
 * MPS server's; a client that cannot reach the server's /dev/shm gets 805
 * (CUDA_ERROR_MPS_CONNECTION_FAILED).
 */
#include <dlfcn.h>
#include <stdio.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;

typedef CUresult (*cuInit_t)(unsigned int);
typedef CUresult (*cuDriverGetVersion_t)(int *);
typedef CUresult (*cuDeviceGet_t)(CUdevice *, int);
typedef CUresult (*cuCtxCreate_t)(CUcontext *, unsigned int, CUdevice);
typedef CUresult (*cuCtxDestroy_t)(CUcontext);
typedef CUresult (*cuGetErrorName_t)(CUresult, const char **);

static cuGetErrorName_t error_name;

static CUresult report(const char *call, CUresult rc) {
    const char *name = "?";
    if (error_name == NULL || error_name(rc, &name) != 0 || name == NULL) name = "?";
    printf("%s %d %s\n", call, rc, name);
    fflush(stdout);
    return rc;
}

static void *need(void *lib, const char *symbol) {
    void *f = dlsym(lib, symbol);
    if (f == NULL) printf("dlsym %s: %s\n", symbol, dlerror());
    return f;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s LIBCUDA\n", argv[0]);
        return 2;
    }
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        printf("dlopen %s: %s\n", argv[1], dlerror());
        return 3;
    }
    error_name = (cuGetErrorName_t)dlsym(lib, "cuGetErrorName");
    cuInit_t init = (cuInit_t)need(lib, "cuInit");
    cuDriverGetVersion_t version = (cuDriverGetVersion_t)need(lib, "cuDriverGetVersion");
    cuDeviceGet_t device_get = (cuDeviceGet_t)need(lib, "cuDeviceGet");
    cuCtxCreate_t ctx_create = (cuCtxCreate_t)need(lib, "cuCtxCreate_v2");
    cuCtxDestroy_t ctx_destroy = (cuCtxDestroy_t)need(lib, "cuCtxDestroy_v2");
    if (!init || !version || !device_get || !ctx_create || !ctx_destroy) return 4;
    int v = 0;
    if (version(&v) == 0) printf("cuDriverGetVersion %d\n", v);
    CUresult rc = report("cuInit", init(0));
    if (rc != 0) return rc & 0xff ? rc & 0xff : 1;
    CUdevice dev = 0;
    rc = report("cuDeviceGet", device_get(&dev, 0));
    if (rc != 0) return rc & 0xff ? rc & 0xff : 1;
    CUcontext ctx = NULL;
    rc = report("cuCtxCreate", ctx_create(&ctx, 0, dev));
    if (rc != 0) return rc & 0xff ? rc & 0xff : 1;
    rc = report("cuCtxDestroy", ctx_destroy(ctx));
    return rc == 0 ? 0 : (rc & 0xff ? rc & 0xff : 1);
}
