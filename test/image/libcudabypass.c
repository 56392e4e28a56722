/*
 * libcudabypass.so: a shared library linked against libcuda.so.1 that allocates GPU memory the two
 * ways a library in the wild can walk past an LD_PRELOAD interposer such as vcuda (issue 28):
 *
 *   bypass_linked_alloc  calls cuMemAlloc_v2 (and the context calls) as linked symbols. Opened with
 *                        RTLD_DEEPBIND, the library's own dependencies (libcuda.so.1) come before
 *                        the global scope, so these bind to the driver, not to the preload.
 *   bypass_next_alloc    creates its context as linked symbols (through vcuda when opened
 *                        without RTLD_DEEPBIND) but looks cuMemAlloc_v2 up with
 *                        dlsym(RTLD_NEXT, ...): the search starts after this library, whose own
 *                        dependency libcuda.so.1 is next, so the driver's symbol comes back.
 *
 * Both return the CUresult and put in *from the file the cuMemAlloc_v2 they called lives in.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

#include "cuda_driver.h"

static CUresult context(void) {
    CUdevice d;
    CUcontext c;
    CUresult r = cuInit(0);
    if (r == 0) r = cuDeviceGet(&d, 0);
    if (r == 0) r = cuDevicePrimaryCtxRetain(&c, d);
    if (r == 0) r = cuCtxSetCurrent(c);
    return r;
}

static const char *file_of(void *fn) {
    Dl_info info;
    return fn && dladdr(fn, &info) && info.dli_fname ? info.dli_fname : "?";
}

CUresult bypass_linked_alloc(size_t bytes, const char **from) {
    *from = file_of((void *)cuMemAlloc_v2);
    CUresult r = context();
    CUdeviceptr p;
    return r != 0 ? r : cuMemAlloc_v2(&p, bytes);
}

CUresult bypass_next_alloc(size_t bytes, const char **from) {
    CUresult (*alloc)(CUdeviceptr *, size_t) = (CUresult(*)(CUdeviceptr *, size_t))dlsym(RTLD_NEXT, "cuMemAlloc_v2");
    *from = file_of((void *)alloc);
    if (!alloc) return 999;
    CUresult r = context();
    CUdeviceptr p;
    return r != 0 ? r : alloc(&p, bytes);
}
