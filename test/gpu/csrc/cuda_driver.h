/*
 * The CUDA driver API types and calls test/gpu's probes use, declared as cuda.h does (the bundle
 * carries no CUDA headers; each probe links against libcuda.so.1, as any CUDA program). One copy
 * for callbench, memprobe and slicebench; procprobe resolves its names through cuGetProcAddress.
 * Below them, what the two timing probes (callbench, slicebench) share: the clock, the exit on an
 * error, and loading their kernels from PTX.
 */
#ifndef TESSERA_TEST_GPU_CUDA_DRIVER_H
#define TESSERA_TEST_GPU_CUDA_DRIVER_H
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUstream;
typedef void *CUevent;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

CUresult cuInit(unsigned flags);
CUresult cuDeviceGetCount(int *n);
CUresult cuDeviceGet(CUdevice *d, int ordinal);
CUresult cuDeviceGetUuid_v2(unsigned char uuid[16], CUdevice d);
CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice d);
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d);
CUresult cuCtxSetCurrent(CUcontext c);
CUresult cuCtxSynchronize(void);
CUresult cuMemGetInfo_v2(size_t *free, size_t *total);
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size);
CUresult cuMemFree_v2(CUdeviceptr p);
CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, CUfunction f, int block, size_t dyn);
CUresult cuEventCreate(CUevent *e, unsigned flags);
CUresult cuEventRecord(CUevent e, CUstream s);
CUresult cuEventQuery(CUevent e);
CUresult cuEventSynchronize(CUevent e);
CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b);
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, CUstream s, void **params, void **extra);

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* die prints the failed call in the probes' output format and exits. */
static inline void die(const char *what, CUresult r) {
    printf("error=%d during=%s\n", r, what);
    fflush(stdout);
    exit(1);
}

/* load_ptx loads the first of the n PTX images the driver compiles and looks up the nfn functions
 * names in it: the index of that image, or -1 where the driver has no cuModuleLoadData (the fake
 * driver: launches then take opaque handles), exiting with what on none. Looked up with dlsym so the probes
 * link against the fake too. */
static inline int load_ptx(const char *const *ptx, size_t n, const char *const *names, CUfunction *fns, size_t nfn,
                           const char *what) {
    typedef CUresult (*load_fn)(CUmodule *, const void *);
    typedef CUresult (*get_fn)(CUfunction *, CUmodule, const char *);
    load_fn load = (load_fn)dlsym(RTLD_DEFAULT, "cuModuleLoadData");
    get_fn get = (get_fn)dlsym(RTLD_DEFAULT, "cuModuleGetFunction");
    if (!load || !get)
        return -1;
    for (size_t i = 0; i < n; i++) {
        CUmodule m;
        size_t k = 0;
        if (load(&m, ptx[i]) == 0)
            while (k < nfn && get(&fns[k], m, names[k]) == 0)
                k++;
        if (k == nfn && nfn)
            return (int)i;
    }
    die(what, -1);
    return -2;
}

#endif
