/*
 * hooks_ctx.c - memory that dies with its context.
 *
 * Destroying a context (or resetting / finally releasing a device's primary
 * context) frees everything allocated in it without any cuMemFree. Each
 * context-bound allocation is recorded with its context, so when a context
 * goes, its allocations are credited back too; otherwise the process would
 * stay charged for memory it no longer holds. (VMM handles and stream-ordered
 * pool allocations belong to the device, not a context, and are untouched.)
 */
#define _GNU_SOURCE
#include "handles.h"
#include "real.h"
#include "region.h"
#include "vcuda.h"

#define ACTIVE() (vc_g.mode == VC_MODE_ENFORCE && !vc_exiting)

static void credit(uint64_t size, int gpu) {
    if (gpu >= 0)
        vc_release(gpu, size);
}

static void ctx_gone(CUcontext ctx) { vc_untrack_ctx((uint64_t)(uintptr_t)ctx, credit); }

VC_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
    vc_init_cuda();
    if (!vc_real.cuCtxDestroy_v2)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = vc_real.cuCtxDestroy_v2(ctx);
    if (r == CUDA_SUCCESS && ACTIVE())
        ctx_gone(ctx);
    return r;
}

VC_EXPORT CUresult cuCtxDestroy(CUcontext ctx) {
    vc_init_cuda();
    if (!vc_real.cuCtxDestroy)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = vc_real.cuCtxDestroy(ctx);
    if (r == CUDA_SUCCESS && ACTIVE())
        ctx_gone(ctx);
    return r;
}

/* The primary context of dev, if it is active (retaining an inactive one
 * would create it). The retain is given back at once: the count is as it
 * was. */
static CUcontext primary_if_active(CUdevice dev, CUresult (*release)(CUdevice)) {
    unsigned flags;
    int active = 0;
    CUcontext c = NULL;
    if (!vc_real.cuDevicePrimaryCtxGetState || !vc_real.cuDevicePrimaryCtxRetain || !release ||
        vc_real.cuDevicePrimaryCtxGetState(dev, &flags, &active) != CUDA_SUCCESS || !active)
        return NULL;
    if (vc_real.cuDevicePrimaryCtxRetain(&c, dev) != CUDA_SUCCESS)
        return NULL;
    release(dev);
    return c;
}

static int primary_active(CUdevice dev) {
    unsigned flags;
    int active = 1;
    if (vc_real.cuDevicePrimaryCtxGetState)
        vc_real.cuDevicePrimaryCtxGetState(dev, &flags, &active);
    return active;
}

/* release: the real release/reset function; reset: it always destroys. */
static CUresult primary_op(CUresult (*op)(CUdevice), CUresult (*release)(CUdevice), CUdevice dev,
                           int reset) {
    if (!op)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUcontext c = ACTIVE() ? primary_if_active(dev, release) : NULL;
    CUresult r = op(dev);
    if (r == CUDA_SUCCESS && c && (reset || !primary_active(dev)))
        ctx_gone(c);
    return r;
}

VC_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    vc_init_cuda();
    return primary_op(vc_real.cuDevicePrimaryCtxRelease_v2, vc_real.cuDevicePrimaryCtxRelease_v2,
                      dev, 0);
}
VC_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
    vc_init_cuda();
    return primary_op(vc_real.cuDevicePrimaryCtxRelease, vc_real.cuDevicePrimaryCtxRelease, dev, 0);
}
VC_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    vc_init_cuda();
    return primary_op(vc_real.cuDevicePrimaryCtxReset_v2, vc_real.cuDevicePrimaryCtxRelease_v2, dev,
                      1);
}
VC_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev) {
    vc_init_cuda();
    return primary_op(vc_real.cuDevicePrimaryCtxReset,
                      vc_real.cuDevicePrimaryCtxRelease ? vc_real.cuDevicePrimaryCtxRelease
                                                        : vc_real.cuDevicePrimaryCtxRelease_v2,
                      dev, 1);
}

/* The device-side malloc heap (cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE)) is
 * device memory of the context, of any size the application asks for: it is
 * charged like an allocation (rounded up to the driver's 2 MiB pages),
 * refused with CUDA_ERROR_OUT_OF_MEMORY over the cap, re-charged by the
 * difference when resized, and credited when the context goes. */
#define CU_LIMIT_MALLOC_HEAP_SIZE 2
#define HEAP_PAGE (2ull << 20)
VC_EXPORT CUresult cuCtxSetLimit(int limit, size_t value) {
    vc_init_cuda();
    if (!vc_real.cuCtxSetLimit)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (limit != CU_LIMIT_MALLOC_HEAP_SIZE || !(ACTIVE() || vc_g.mode == VC_MODE_FAIL_CLOSED || vc_exiting))
        return vc_real.cuCtxSetLimit(limit, value);
    if (!ACTIVE())
        return CUDA_ERROR_OUT_OF_MEMORY; /* limits unusable, or after exit: refuse */
    CUcontext ctx = NULL;
    int g;
    CUdevice dev;
    if (!vc_real.cuCtxGetCurrent || vc_real.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx ||
        vc_cur_gpu(&g, &dev) != CUDA_SUCCESS)
        return vc_real.cuCtxSetLimit(limit, value); /* the driver's error */
    uint64_t key = (uint64_t)(uintptr_t)ctx, want = ((uint64_t)value + HEAP_PAGE - 1) & ~(HEAP_PAGE - 1);
    uint64_t had = 0;
    int hg = -1;
    if (vc_lookup(VC_K_LIMIT, key, &had, &hg) != 0)
        had = 0;
    if (g < 0 && want > 0)
        return CUDA_ERROR_OUT_OF_MEMORY; /* not in the limits file: cap 0 */
    if (want > had && vc_reserve(g, want - had) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = vc_real.cuCtxSetLimit(limit, value);
    if (r != CUDA_SUCCESS) {
        if (want > had)
            vc_release(g, want - had);
        return r;
    }
    if (want < had)
        vc_release(g, had - want);
    uint64_t sz, cx;
    int gg;
    vc_untrack(VC_K_LIMIT, key, &sz, &gg, &cx);
    if (want && vc_track_ctx(VC_K_LIMIT, key, want, g, key) != 0) {
        vc_release(g, want); /* cannot remember it: do not keep it charged forever */
    }
    return r;
}
