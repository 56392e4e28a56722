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
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "handles.h"
#include "real.h"
#include "region.h"
#include "vcuda.h"


static void credit(int kind, uint64_t size, int gpu) {
    if (gpu < 0)
        return;
    vc_release(gpu, size);
    if (kind == VC_K_CTX)
        vc_region_ctx_note(gpu, -1, size);
}

static void ctx_gone(CUcontext ctx) {
    vc_dgate_ctx_gone(ctx, 0);
    vc_untrack_ctx((uint64_t)(uintptr_t)ctx, credit);
}

VC_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
    PROLOGUE(cuCtxDestroy_v2);
    if (ACTIVE())
        vc_dgate_ctx_gone(ctx, 1); /* while its words can still be freed */
    CUresult r = vc_real.cuCtxDestroy_v2(ctx);
    if (r == CUDA_SUCCESS && ACTIVE())
        ctx_gone(ctx);
    return r;
}

VC_EXPORT CUresult cuCtxDestroy(CUcontext ctx) {
    PROLOGUE(cuCtxDestroy);
    if (ACTIVE())
        vc_dgate_ctx_gone(ctx, 1); /* while its words can still be freed */
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
    if (c && reset)
        vc_dgate_ctx_gone(c, 1);
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

/* ---- the memory a context takes ----
 *
 * Creating a context (the primary one at its first retain, cuCtxCreate
 * v1-v4, a green context) takes device memory of its own: the driver's
 * state, local memory for the default 1 KiB stack of every thread the
 * device can hold at once, the printf FIFO; a few hundred MiB on an H100.
 * The first creation on a device in a process is measured: NVML's memory
 * of this process on the device (its entry in the compute process list)
 * before and after, rounded up to 2 MiB. NVML lists a process that has a
 * context, so after the creation it must be listed; where it is not (its
 * pid is not NVML's: a container with its own PID namespace on a real
 * driver, which reports host pids) or NVML is unavailable, the
 * architecture's table value is charged instead, or the node agent's
 * measurement for the GPU's model where that is larger (measured_cost). The measured creation is
 * charged after the fact (holding room for it in advance would starve the
 * container's other processes starting at the same time): if the cost does
 * not fit under the cap, the context is destroyed again and the call
 * returns CUDA_ERROR_OUT_OF_MEMORY, so a nearly full cap can be passed by
 * one context for the moment of that first creation. Later contexts on the
 * device are charged the same cost before they are created. The charge is
 * credited when the context goes (cuCtxDestroy, last primary release,
 * reset, cuGreenCtxDestroy). */
#define MiB_ (1ull << 20)
/* Architecture table: what a CUDA 12 context with lazy module loading
 * takes, rounded up, by compute capability major: the first row whose
 * major is at most the device's; a device below every row (or whose
 * capability cannot be read) is charged VC_CTX_MIB_OTHER, the largest.
 * api/v1's ContextOverheadBytes is the same table for the extender and DRA,
 * which refuse shares below it; TestContextOverheadMatchesVcuda reads this
 * one and fails when the two differ. */
static const struct {
    int major;
    uint64_t mib;
} ctx_table[] = {
    {9, 512},
    {8, 384},
    {7, 320},
};
#define VC_CTX_MIB_OTHER 512
static uint64_t table_cost(CUdevice dev) {
    int major = 0;
    if (!vc_real.cuDeviceGetAttribute || vc_real.cuDeviceGetAttribute(&major, 75, dev) != CUDA_SUCCESS)
        major = 0;
    for (size_t i = 0; i < sizeof(ctx_table) / sizeof(ctx_table[0]); i++)
        if (major >= ctx_table[i].major)
            return ctx_table[i].mib * MiB_;
    return VC_CTX_MIB_OTHER * MiB_;
}

/* The node agent's measurement (limits.h, vc_overhead_parse): what a
 * context takes on GPU record g as the driver reports it for processes of
 * the node's containers, read at each creation whose cost this process does
 * not know yet. vcuda charges the larger of it and the table: the agent
 * derives it from slots the containers can write, so it may only ever raise
 * a charge (README, "Measured context overhead"); a missing, malformed or
 * stale file (written over VC_OVERHEAD_MAX_AGE s ago: the agent stopped)
 * leaves the table. Test build: the file is VCUDA_TEST_CONTEXT_OVERHEAD. */
static _Atomic int overhead_bad_told;
static uint64_t measured_cost(int g) {
    const char *path = VC_OVERHEAD_PATH;
#ifdef VCUDA_TEST_HOOKS
    path = getenv("VCUDA_TEST_CONTEXT_OVERHEAD");
    if (!path)
        return 0;
#endif
    if (g < 0 || g >= vc_g.limits.ngpus)
        return 0;
    char *text = NULL, err[160];
    size_t len = 0;
    uint64_t bytes = 0;
    int r = vc_read_small(path, &text, &len);
    if (r == 0)
        return 0;
    if (r < 0 || vc_overhead_parse(text, len, vc_g.limits.gpu[g].uuid, (uint64_t)time(NULL), &bytes, err,
                                   sizeof(err)) != 0) {
        if (!atomic_exchange(&overhead_bad_told, 1))
            vc_log("%s: %s; charging contexts the table's overhead", path, r < 0 ? "unreadable" : err);
        bytes = 0;
    }
    free(text);
    return vc_round_up(bytes, VC_PAGE);
}

/* A cap that cannot hold one context: the creation fails with
 * CUDA_ERROR_OUT_OF_MEMORY whatever else the container does, so say why,
 * once per GPU and process. */
static _Atomic int small_cap_told[VC_MAX_GPUS];
static int below_cap(int g, uint64_t cost) {
    if (g < 0 || g >= vc_g.limits.ngpus || cost <= vc_g.limits.gpu[g].mem_cap)
        return 0;
    if (!atomic_exchange(&small_cap_told[g], 1))
        vc_log("%s: memory cap %llu MiB is below the %llu MiB a CUDA context needs on this GPU; ask for more "
               "tessera.dev/vgpu-memory",
               vc_g.limits.gpu[g].uuid, (unsigned long long)(vc_g.limits.gpu[g].mem_cap / MiB_),
               (unsigned long long)((cost + MiB_ - 1) / MiB_));
    return 1;
}

#define VC_MAX_ORD 256
static _Atomic uint64_t ctx_cost_known[VC_MAX_ORD]; /* cost + 1; 0: not measured */

static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;
static int nvml_ok;
static void nvml_up(void) {
    vc_init_nvml();
    nvml_ok = vc_real.nvmlInit_v2 && vc_real.nvmlInit_v2() == NVML_SUCCESS;
}
/* This process's memory on device dev as NVML lists it: 1 listed, 0 not
 * listed, -1 NVML cannot say. */
static int nvml_self(CUdevice dev, uint64_t *used) {
#ifdef VCUDA_TEST_HOOKS
    /* Test build: NVML lists host pids, as a real driver does for a process
     * in a container's PID namespace: this process is never listed. */
    if (getenv("VCUDA_TEST_NVML_HOST_PIDS")) {
        *used = 0;
        return 0;
    }
#endif
    pthread_once(&nvml_once, nvml_up);
    CUuuid u;
    nvmlDevice_t h;
    char s[VC_UUID_LEN + 1];
    if (!nvml_ok || !vc_real.nvmlDeviceGetHandleByUUID || !vc_real.nvmlDeviceGetComputeRunningProcesses_v3 ||
        !vc_real.cuDeviceGetUuid || vc_real.cuDeviceGetUuid(&u, dev) != CUDA_SUCCESS)
        return -1;
    vc_uuid_format((const unsigned char *)u.bytes, s);
    if (vc_real.nvmlDeviceGetHandleByUUID(s, &h) != NVML_SUCCESS)
        return -1;
    nvmlProcessInfo_t p[256];
    unsigned int n = 256;
    if (vc_real.nvmlDeviceGetComputeRunningProcesses_v3(h, &n, p) != NVML_SUCCESS)
        return -1;
    unsigned int me = (unsigned int)getpid();
    for (unsigned int i = 0; i < n && i < 256; i++) {
        if (p[i].pid == me) {
            *used = p[i].usedGpuMemory;
            return 1;
        }
    }
    *used = 0;
    return 0;
}

typedef struct {
    CUdevice dev;
    int g, measure;
    uint64_t charged, table, self0;
} ctx_charge;

/* Before a creation: charge the context's cost if known, else prepare the
 * measurement. Contexts on a device the limits do not list (cap 0) are
 * refused. */
static CUresult ctx_pre(CUdevice dev, ctx_charge *c) {
    c->dev = dev;
    c->measure = 0;
    c->charged = 0;
    c->table = 0; /* 0: the cost is known, nothing to measure */
    c->g = vc_dev_gpu(dev);
    if (c->g < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t k = dev >= 0 && dev < VC_MAX_ORD ? atomic_load(&ctx_cost_known[dev]) : 0;
    if (k) {
        c->charged = k - 1;
        if (below_cap(c->g, c->charged))
            return CUDA_ERROR_OUT_OF_MEMORY;
        if (c->charged && vc_reserve(c->g, c->charged) != 0)
            return CUDA_ERROR_OUT_OF_MEMORY;
        return CUDA_SUCCESS;
    }
    uint64_t t = table_cost(dev), m = measured_cost(c->g);
    c->table = m > t ? m : t;
    /* Before its first context on the device the process cannot be
     * listed: an entry with its pid is another process's (a pid of
     * another namespace), so only the table can be trusted. */
    c->measure = nvml_self(dev, &c->self0) == 0;
    /* Nothing to measure: the table is what will be charged, so a cap
     * below it is refused before the driver creates anything. */
    if (!c->measure && below_cap(c->g, c->table))
        return CUDA_ERROR_OUT_OF_MEMORY;
    return CUDA_SUCCESS;
}

/* After it: give the hold back on failure, else settle to the cost and
 * remember it with the context (key), which credits it when the context
 * goes. */
static CUresult ctx_post(CUresult r, ctx_charge *c, uint64_t key, void (*destroy)(uint64_t key, CUdevice dev)) {
    if (r != CUDA_SUCCESS) {
        if (c->charged)
            vc_release(c->g, c->charged);
        return r;
    }
    uint64_t cost = c->charged;
    if (c->table) {
        uint64_t self1;
        cost = c->table;
        if (c->measure && nvml_self(c->dev, &self1) == 1) {
            uint64_t d = self1 > c->self0 ? self1 - c->self0 : 0;
            cost = vc_round_up(d, VC_PAGE);
        }
        if (c->dev >= 0 && c->dev < VC_MAX_ORD)
            atomic_store(&ctx_cost_known[c->dev], cost + 1);
    }
    if (cost > c->charged) {
        /* more than the room held: take the rest, or undo */
        if (below_cap(c->g, cost) || vc_reserve(c->g, cost - c->charged) != 0) {
            destroy(key, c->dev);
            if (c->charged)
                vc_release(c->g, c->charged);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        c->charged = cost;
    }
    if (cost < c->charged)
        vc_release(c->g, c->charged - cost);
    if (cost && vc_track_ctx(VC_K_CTX, key, cost, c->g, key) != 0) {
        vc_log("handle table full: a context's memory is not counted");
        vc_release(c->g, cost);
    } else if (cost) {
        vc_region_ctx_note(c->g, 1, cost);
    }
    return r;
}

static void destroy_ctx(uint64_t key, CUdevice dev) {
    (void)dev;
    if (vc_real.cuCtxDestroy_v2)
        vc_real.cuCtxDestroy_v2((CUcontext)(uintptr_t)key);
}
static void destroy_green(uint64_t key, CUdevice dev) {
    (void)dev;
    if (vc_real.cuGreenCtxDestroy)
        vc_real.cuGreenCtxDestroy((CUgreenCtx)(uintptr_t)key);
}
static void release_primary(uint64_t key, CUdevice dev) {
    (void)key;
    if (vc_real.cuDevicePrimaryCtxRelease_v2)
        vc_real.cuDevicePrimaryCtxRelease_v2(dev);
}

#define CTX_CREATE(realfn, destroy, pctx, dev, ...)                                                         \
    do {                                                                                           \
        PROLOGUE(realfn);                                                                          \
        if (REFUSED())                                                                             \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                       \
        if (!ACTIVE() || !(pctx))                                                                  \
            return vc_real.realfn(__VA_ARGS__);                                                    \
        ctx_charge c_;                                                                             \
        CUresult r_ = ctx_pre((dev), &c_);                                                         \
        if (r_ != CUDA_SUCCESS)                                                                    \
            return r_;                                                                             \
        r_ = vc_real.realfn(__VA_ARGS__);                                                          \
        return ctx_post(r_, &c_, r_ == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*(pctx) : 0, destroy);   \
    } while (0)

VC_EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    CTX_CREATE(cuCtxCreate, destroy_ctx, pctx, dev, pctx, flags, dev);
}
VC_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    CTX_CREATE(cuCtxCreate_v2, destroy_ctx, pctx, dev, pctx, flags, dev);
}
VC_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, void *params, int n, unsigned int flags, CUdevice dev) {
    CTX_CREATE(cuCtxCreate_v3, destroy_ctx, pctx, dev, pctx, params, n, flags, dev);
}
VC_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, void *params, unsigned int flags, CUdevice dev) {
    CTX_CREATE(cuCtxCreate_v4, destroy_ctx, pctx, dev, pctx, params, flags, dev);
}
VC_EXPORT CUresult cuGreenCtxCreate(CUgreenCtx *pctx, CUdevResourceDesc desc, CUdevice dev, unsigned int flags) {
    CTX_CREATE(cuGreenCtxCreate, destroy_green, pctx, dev, pctx, desc, dev, flags);
}

/* The primary context takes its memory when its first retain creates it. */
static pthread_mutex_t primary_mu = PTHREAD_MUTEX_INITIALIZER;
VC_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    PROLOGUE(cuDevicePrimaryCtxRetain);
    if (REFUSED())
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (!ACTIVE() || !pctx)
        return vc_real.cuDevicePrimaryCtxRetain(pctx, dev);
    pthread_mutex_lock(&primary_mu);
    unsigned flags;
    int active = 0;
    CUresult r;
    if (vc_real.cuDevicePrimaryCtxGetState &&
        vc_real.cuDevicePrimaryCtxGetState(dev, &flags, &active) == CUDA_SUCCESS && active) {
        r = vc_real.cuDevicePrimaryCtxRetain(pctx, dev);
    } else {
        ctx_charge c;
        r = ctx_pre(dev, &c);
        if (r == CUDA_SUCCESS) {
            r = vc_real.cuDevicePrimaryCtxRetain(pctx, dev);
            r = ctx_post(r, &c, r == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*pctx : 0, release_primary);
        }
    }
    pthread_mutex_unlock(&primary_mu);
    return r;
}

/* A green context's memory, and what was allocated in the CUcontext made
 * from it, go with it. */
VC_EXPORT CUresult cuCtxFromGreenCtx(CUcontext *pctx, CUgreenCtx g) {
    PROLOGUE(cuCtxFromGreenCtx);
    CUresult r = vc_real.cuCtxFromGreenCtx(pctx, g);
    uint64_t sz;
    int gg;
    if (r == CUDA_SUCCESS && ACTIVE() && pctx && *pctx && (uint64_t)(uintptr_t)*pctx != (uint64_t)(uintptr_t)g &&
        vc_lookup(VC_K_GREEN, (uint64_t)(uintptr_t)g, &sz, &gg) != 0)
        vc_track_ctx(VC_K_GREEN, (uint64_t)(uintptr_t)g, 0, 0, (uint64_t)(uintptr_t)*pctx);
    return r;
}
VC_EXPORT CUresult cuGreenCtxDestroy(CUgreenCtx g) {
    PROLOGUE(cuGreenCtxDestroy);
    CUresult r = vc_real.cuGreenCtxDestroy(g);
    if (r == CUDA_SUCCESS && ACTIVE()) {
        uint64_t sz, cx = 0;
        int gg;
        if (vc_untrack(VC_K_GREEN, (uint64_t)(uintptr_t)g, &sz, &gg, &cx) == 0 && cx)
            ctx_gone((CUcontext)(uintptr_t)cx);
        ctx_gone((CUcontext)(uintptr_t)g);
    }
    return r;
}

/* Limits that size device memory of the context (cuCtxSetLimit), of any
 * size the application asks for: charged like an allocation, in the
 * driver's 2 MiB pages, refused with CUDA_ERROR_OUT_OF_MEMORY over the cap,
 * re-charged by the difference when resized, credited when the context goes.
 *   CU_LIMIT_STACK_SIZE: local memory for every thread the device can hold
 *     at once: (stack - 1 KiB) x threads per SM x SMs beyond the default
 *     1 KiB, which the context's own cost includes;
 *   CU_LIMIT_PRINTF_FIFO_SIZE: the FIFO beyond its 1 MiB default (also in
 *     the context's cost);
 *   CU_LIMIT_MALLOC_HEAP_SIZE: the whole heap (the driver allocates it
 *     when it is sized or first used). */
#define CU_LIMIT_STACK_SIZE 0
#define CU_LIMIT_PRINTF_FIFO_SIZE 1
#define CU_LIMIT_MALLOC_HEAP_SIZE 2
#define HEAP_PAGE (2ull << 20)
#define CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR 39
static uint64_t limit_bytes(int limit, uint64_t v, CUdevice dev) {
    uint64_t b;
    switch (limit) {
    case CU_LIMIT_STACK_SIZE: {
        int tps = 0;
        if (v <= 1024)
            return 0;
        if (!vc_real.cuDeviceGetAttribute ||
            vc_real.cuDeviceGetAttribute(&tps, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, dev) !=
                CUDA_SUCCESS ||
            tps <= 0)
            tps = 2048; /* the most any GPU holds */
        if (__builtin_mul_overflow(v - 1024, (uint64_t)tps * (uint64_t)vc_dev_sms(dev), &b))
            return UINT64_MAX;
        break;
    }
    case CU_LIMIT_PRINTF_FIFO_SIZE:
        if (v <= (1u << 20))
            return 0;
        b = v - (1u << 20);
        break;
    default:
        b = v;
    }
    return b > UINT64_MAX - HEAP_PAGE ? UINT64_MAX : (b + HEAP_PAGE - 1) & ~(HEAP_PAGE - 1);
}
VC_EXPORT CUresult cuCtxSetLimit(int limit, size_t value) {
    PROLOGUE(cuCtxSetLimit);
    if (limit < CU_LIMIT_STACK_SIZE || limit > CU_LIMIT_MALLOC_HEAP_SIZE ||
        !(ACTIVE() || vc_g.mode == VC_MODE_FAIL_CLOSED || vc_exiting))
        return vc_real.cuCtxSetLimit(limit, value);
    if (!ACTIVE())
        return CUDA_ERROR_OUT_OF_MEMORY; /* limits unusable, or after exit: refuse */
    CUcontext ctx = NULL;
    int g;
    CUdevice dev;
    if (!vc_real.cuCtxGetCurrent || vc_real.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx ||
        vc_cur_gpu(&g, &dev) != CUDA_SUCCESS)
        return vc_real.cuCtxSetLimit(limit, value); /* the driver's error */
    uint64_t key = (uint64_t)(uintptr_t)ctx | (uint64_t)limit << 60, want = limit_bytes(limit, value, dev);
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
    if (want && vc_track_ctx(VC_K_LIMIT, key, want, g, (uint64_t)(uintptr_t)ctx) != 0) {
        vc_release(g, want); /* cannot remember it: do not keep it charged forever */
    }
    return r;
}

/* ---- modules and libraries ----
 *
 * Loading a module (cuModuleLoad*) or a library (cuLibraryLoad*) takes
 * device memory for its code, constant banks and __device__ globals
 * (zero-initialised globals are not even in the image). vcuda charges an
 * estimate before the load: the image's size (an ELF cubin up to its section
 * headers, a fatbin its header's size, a file its length, PTX its text) in
 * 2 MiB pages, at least one. After the load it measures, as for contexts,
 * NVML's entry of the process before and after (less what this process was
 * charged meanwhile) and settles up to that, never below the estimate: with
 * lazy loading (CUDA 12.2+'s default) the load takes little and each
 * function's code comes at its first lookup or launch, unseen, and the image
 * bounds what that code can take (the cost: a module whose functions are
 * never used stays charged its image). If the measurement does not fit, the
 * module is unloaded again and the call returns CUDA_ERROR_OUT_OF_MEMORY.
 * Where NVML does not list the process, the estimate stands (it misses
 * zero-initialised globals). A module's charge is credited when it is
 * unloaded or its context goes, a library's when it is unloaded. */
static uint64_t image_estimate(const void *image) {
    const unsigned char *b = image;
    uint32_t magic;
    if (!b)
        return 0;
    memcpy(&magic, b, 4);
    if (magic == 0x466243b1u) { /* the runtime's fatbin wrapper: {magic, version, data, ...} */
        const void *data;
        memcpy(&data, b + 8, sizeof(data));
        return data && data != image ? image_estimate(data) : 0;
    }
    if (magic == 0xba55ed50u) { /* fatbin: u32 magic, u16 version, u16 header size, u64 size */
        uint16_t hs;
        uint64_t fs;
        memcpy(&hs, b + 6, 2);
        memcpy(&fs, b + 8, 8);
        return hs + fs;
    }
    if (b[0] == 0x7f && b[1] == 'E' && b[2] == 'L' && b[3] == 'F' && b[4] == 2) { /* ELF64 cubin */
        uint64_t shoff;
        uint16_t shentsize, shnum;
        memcpy(&shoff, b + 0x28, 8);
        memcpy(&shentsize, b + 0x3a, 2);
        memcpy(&shnum, b + 0x3c, 2);
        return shoff + (uint64_t)shentsize * shnum;
    }
    return strnlen((const char *)b, 1ull << 30); /* PTX text */
}
static uint64_t file_estimate(const char *path) {
    struct stat st;
    return path && stat(path, &st) == 0 && st.st_size > 0 ? (uint64_t)st.st_size : 0;
}

typedef struct {
    int g, listed;
    CUdevice dev;
    uint64_t charged, self0, slot0;
} load_charge;

static CUresult load_pre(uint64_t estimate, load_charge *c) {
    CUresult r = vc_cur_gpu(&c->g, &c->dev);
    if (r != CUDA_SUCCESS)
        return r;
    if (c->g < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    c->charged = estimate > UINT64_MAX - VC_PAGE ? UINT64_MAX : vc_round_up(estimate, VC_PAGE);
    if (!c->charged)
        c->charged = VC_PAGE;
    if (vc_reserve(c->g, c->charged) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    c->slot0 = vc_region_self_used(c->g);
    c->listed = nvml_self(c->dev, &c->self0) == 1;
    return CUDA_SUCCESS;
}

static CUresult load_post(CUresult r, load_charge *c, uint64_t key, uint64_t ctx, void (*unload)(uint64_t)) {
    if (r != CUDA_SUCCESS) {
        vc_release(c->g, c->charged);
        return r;
    }
    uint64_t cost = c->charged, self1;
    if (c->listed && nvml_self(c->dev, &self1) == 1) {
        uint64_t slot1 = vc_region_self_used(c->g), mine = slot1 > c->slot0 ? slot1 - c->slot0 : 0;
        uint64_t d = self1 > c->self0 ? self1 - c->self0 : 0;
        d = d > mine ? d - mine : 0;
        if (vc_round_up(d, VC_PAGE) > cost) /* up only: lazily loaded code comes later (above) */
            cost = vc_round_up(d, VC_PAGE);
    }
    if (cost > c->charged && vc_reserve(c->g, cost - c->charged) != 0) {
        unload(key);
        vc_release(c->g, c->charged);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (cost && vc_track_ctx(VC_K_MODULE, key, cost, c->g, ctx) != 0) {
        vc_log("handle table full: a module's memory is not counted");
        vc_release(c->g, cost);
    }
    return r;
}

static void unload_module(uint64_t m) {
    if (vc_real.cuModuleUnload)
        vc_real.cuModuleUnload((CUmodule)(uintptr_t)m);
}
static void unload_library(uint64_t l) {
    if (vc_real.cuLibraryUnload)
        vc_real.cuLibraryUnload((CUlibrary)(uintptr_t)l);
}

/* lib: a library (not bound to the context). */
#define LOAD(realfn, handle, estimate, lib, ...)                                                   \
    do {                                                                                           \
        PROLOGUE(realfn);                                                                          \
        if (REFUSED())                                                                             \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                       \
        if (!ACTIVE() || !(handle))                                                                \
            return vc_real.realfn(__VA_ARGS__);                                                    \
        load_charge c_;                                                                            \
        CUresult r_ = load_pre((estimate), &c_);                                                   \
        if (r_ != CUDA_SUCCESS)                                                                    \
            return r_ == CUDA_ERROR_OUT_OF_MEMORY ? r_ : vc_real.realfn(__VA_ARGS__);              \
        CUcontext cx_ = NULL;                                                                      \
        if (!(lib) && vc_real.cuCtxGetCurrent)                                                     \
            vc_real.cuCtxGetCurrent(&cx_);                                                         \
        r_ = vc_real.realfn(__VA_ARGS__);                                                          \
        return load_post(r_, &c_, r_ == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*(handle) : 0,         \
                         (uint64_t)(uintptr_t)cx_, (lib) ? unload_library : unload_module);        \
    } while (0)

VC_EXPORT CUresult cuModuleLoad(CUmodule *m, const char *path) {
    LOAD(cuModuleLoad, m, file_estimate(path), 0, m, path);
}
VC_EXPORT CUresult cuModuleLoadData(CUmodule *m, const void *image) {
    LOAD(cuModuleLoadData, m, image_estimate(image), 0, m, image);
}
VC_EXPORT CUresult cuModuleLoadDataEx(CUmodule *m, const void *image, unsigned int n, void *opts, void **vals) {
    LOAD(cuModuleLoadDataEx, m, image_estimate(image), 0, m, image, n, opts, vals);
}
VC_EXPORT CUresult cuModuleLoadFatBinary(CUmodule *m, const void *image) {
    LOAD(cuModuleLoadFatBinary, m, image_estimate(image), 0, m, image);
}
VC_EXPORT CUresult cuLibraryLoadData(CUlibrary *l, const void *code, void *jo, void **jv, unsigned int nj, void *lo,
                                     void **lv, unsigned int nl) {
    LOAD(cuLibraryLoadData, l, image_estimate(code), 1, l, code, jo, jv, nj, lo, lv, nl);
}
VC_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *l, const char *path, void *jo, void **jv, unsigned int nj,
                                         void *lo, void **lv, unsigned int nl) {
    LOAD(cuLibraryLoadFromFile, l, file_estimate(path), 1, l, path, jo, jv, nj, lo, lv, nl);
}

static CUresult unloaded(CUresult r, uint64_t key) {
    uint64_t sz, cx;
    int g;
    if (r == CUDA_SUCCESS && ACTIVE() && vc_untrack(VC_K_MODULE, key, &sz, &g, &cx) == 0 && g >= 0)
        vc_release(g, sz);
    return r;
}
VC_EXPORT CUresult cuModuleUnload(CUmodule m) {
    PROLOGUE(cuModuleUnload);
    return unloaded(vc_real.cuModuleUnload(m), (uint64_t)(uintptr_t)m);
}
VC_EXPORT CUresult cuLibraryUnload(CUlibrary l) {
    PROLOGUE(cuLibraryUnload);
    return unloaded(vc_real.cuLibraryUnload(l), (uint64_t)(uintptr_t)l);
}
