/*
 * hooks_mem.c - every path that creates or releases device memory.
 *
 * Pattern: find the device the memory lands on, reserve the bytes in the
 * shared region (lock-free; refuses over the cap), call the driver, then
 * record handle -> (bytes, gpu) so that the free is credited to the same
 * device by the same amount whichever context is current then. A failed
 * driver call gives the reservation back; an allocation that would pass the
 * cap returns CUDA_ERROR_OUT_OF_MEMORY and changes nothing.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>

#include "handles.h"
#include "real.h"
#include "region.h"
#include "vcuda.h"

/* gpu record sentinels: -1 device not in the limits file (cap 0), -2 device
 * cannot be identified, VC_GPU_HOST memory that is not device memory. */
#define VC_GPU_HOST (-3)

/* Driver rounding of linear memory and arrays: the driver maps device
 * memory in 2 MiB pages; an allocation over 1 MiB takes whole pages of its
 * own, a smaller one is carved at 512-byte alignment from pages shared with
 * others (the partly used page they share is not charged). */
static uint64_t linear_bytes(uint64_t size) {
    return size > (1ull << 20) ? vc_round_up(size, 2ull << 20) : vc_round_up(size, 512);
}

static CUresult charge(int g, uint64_t size) {
    if (g < 0 || vc_reserve(g, size) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    return CUDA_SUCCESS;
}

static void table_full(void) {
    static _Atomic int once;
    if (!atomic_exchange(&once, 1))
        vc_log("handle table full: refusing further allocations of this kind");
}

/* The current context: memory allocated in it dies with it (hooks_ctx.c). */
static uint64_t cur_ctx(void) {
    CUcontext c = NULL;
    if (vc_real.cuCtxGetCurrent && vc_real.cuCtxGetCurrent(&c) != CUDA_SUCCESS)
        c = NULL;
    return (uint64_t)(uintptr_t)c;
}

/* After the driver call: on failure give the reservation back; on success
 * remember the handle (and the context it dies with, 0 for none), or undo
 * everything if it cannot be remembered. */
#define SETTLE(r, kind, key, g, size, ctx, undo)                                                   \
    do {                                                                                           \
        if ((r) != CUDA_SUCCESS) {                                                                 \
            vc_release((g), (size));                                                               \
            return (r);                                                                            \
        }                                                                                          \
        if (vc_track_ctx((kind), (uint64_t)(key), (size), (g), (ctx)) != 0) {                      \
            undo;                                                                                  \
            vc_release((g), (size));                                                               \
            table_full();                                                                          \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                       \
        }                                                                                          \
        return CUDA_SUCCESS;                                                                       \
    } while (0)

/* Free-like hook body: forget the handle first (so a concurrent allocation
 * that gets the same value back from the driver cannot be confused with it),
 * call the driver, credit the device on success, restore on failure. */
#define RELEASE(kind, key, call)                                                                   \
    do {                                                                                           \
        uint64_t sz_, c_;                                                                          \
        int g_;                                                                                    \
        if (!ACTIVE() || vc_untrack((kind), (uint64_t)(key), &sz_, &g_, &c_) != 0)                 \
            return call;                                                                           \
        CUresult r_ = call;                                                                        \
        if (r_ != CUDA_SUCCESS) {                                                                  \
            vc_track_ctx((kind), (uint64_t)(key), sz_, g_, c_);                                    \
            return r_;                                                                             \
        }                                                                                          \
        vc_release(g_, sz_);                                                                       \
        return r_;                                                                                 \
    } while (0)

/* ---- linear memory ---- */

static CUresult alloc_common(CUresult (*fn)(CUdeviceptr *, size_t), CUdeviceptr *dptr,
                             size_t size) {
    if (!ACTIVE() || !dptr || size == 0)
        return REFUSED() ? CUDA_ERROR_OUT_OF_MEMORY : fn(dptr, size);
    int g;
    CUdevice dev;
    CUresult r = vc_cur_gpu(&g, &dev);
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t sz = linear_bytes(size);
    if ((r = charge(g, sz)) != CUDA_SUCCESS)
        return r;
    r = fn(dptr, size);
    SETTLE(r, VC_K_PTR, *dptr, g, sz, cur_ctx(), vc_real.cuMemFree_v2(*dptr));
}

VC_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
    PROLOGUE(cuMemAlloc_v2);
    return alloc_common(vc_real.cuMemAlloc_v2, dptr, size);
}

static CUresult managed_fn(CUdeviceptr *d, size_t s);
static _Thread_local unsigned int managed_flags __attribute__((tls_model("initial-exec")));
static CUresult managed_fn(CUdeviceptr *d, size_t s) {
    return vc_real.cuMemAllocManaged(d, s, managed_flags);
}

VC_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned int flags) {
    PROLOGUE(cuMemAllocManaged);
    /* Managed memory can migrate anywhere; it is charged to the current
     * device, the conservative choice. */
    managed_flags = flags;
    return alloc_common(managed_fn, dptr, size);
}

VC_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width,
                                      size_t height, unsigned int elem) {
    PROLOGUE(cuMemAllocPitch_v2);
    if (!ACTIVE() || !dptr || !pitch || width == 0 || height == 0)
        return REFUSED() ? CUDA_ERROR_OUT_OF_MEMORY
                             : vc_real.cuMemAllocPitch_v2(dptr, pitch, width, height, elem);
    int g;
    CUdevice dev;
    CUresult r = vc_cur_gpu(&g, &dev);
    if (r != CUDA_SUCCESS)
        return r;
    /* The driver picks the pitch (rows aligned to 512 bytes on current
     * GPUs). Reserve that, then settle to the real pitch * height. */
    uint64_t est;
    if (__builtin_mul_overflow((width + 511) & ~(size_t)511, height, &est))
        return CUDA_ERROR_OUT_OF_MEMORY;
    est = linear_bytes(est);
    if ((r = charge(g, est)) != CUDA_SUCCESS)
        return r;
    r = vc_real.cuMemAllocPitch_v2(dptr, pitch, width, height, elem);
    if (r != CUDA_SUCCESS) {
        vc_release(g, est);
        return r;
    }
    uint64_t actual = linear_bytes((uint64_t)*pitch * height);
    if (actual > est) {
        if (vc_reserve(g, actual - est) != 0) {
            vc_real.cuMemFree_v2(*dptr);
            vc_release(g, est);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    } else if (actual < est) {
        vc_release(g, est - actual);
    }
    SETTLE(CUDA_SUCCESS, VC_K_PTR, *dptr, g, actual, cur_ctx(), vc_real.cuMemFree_v2(*dptr));
}


/* Legacy 32-bit entry points (CUDA < 3.2 ABI). Nothing current uses them;
 * rather than account 32-bit pointers, refuse them while limits apply. */
VC_EXPORT CUresult cuMemAlloc(unsigned int *dptr, unsigned int size) {
    PROLOGUE(cuMemAlloc);
    if (vc_g.mode >= VC_MODE_ENFORCE && !vc_exiting)
        return CUDA_ERROR_NOT_SUPPORTED;
    return vc_real.cuMemAlloc(dptr, size);
}
VC_EXPORT CUresult cuMemAllocPitch(unsigned int *dptr, unsigned int *pitch, unsigned int w,
                                   unsigned int h, unsigned int e) {
    PROLOGUE(cuMemAllocPitch);
    if (vc_g.mode >= VC_MODE_ENFORCE && !vc_exiting)
        return CUDA_ERROR_NOT_SUPPORTED;
    return vc_real.cuMemAllocPitch(dptr, pitch, w, h, e);
}
VC_EXPORT CUresult cuArrayCreate(CUarray *a, const void *d) {
    PROLOGUE(cuArrayCreate);
    if (vc_g.mode >= VC_MODE_ENFORCE && !vc_exiting)
        return CUDA_ERROR_NOT_SUPPORTED;
    return vc_real.cuArrayCreate(a, d);
}
VC_EXPORT CUresult cuArray3DCreate(CUarray *a, const void *d) {
    PROLOGUE(cuArray3DCreate);
    if (vc_g.mode >= VC_MODE_ENFORCE && !vc_exiting)
        return CUDA_ERROR_NOT_SUPPORTED;
    return vc_real.cuArray3DCreate(a, d);
}

/* ---- arrays ---- */

/* Bytes per element times two (NV12 and block-compressed formats have
 * fractional sizes). Unknown formats count 16 bytes per element: an
 * over-count is a false OOM at worst, an under-count would pass the cap. */
static uint64_t elem_bytes_x2(int fmt, unsigned channels) {
    uint64_t ch = channels ? channels : 1;
    switch (fmt) {
    case 0x01: case 0x08: return 2 * ch;          /* (un)signed int8 */
    case 0x02: case 0x09: case 0x10: return 4 * ch; /* int16, half */
    case 0x03: case 0x0a: case 0x20: return 8 * ch; /* int32, float */
    case 0xb0: return 3;                           /* NV12: 1.5 bytes/pixel */
    case 0xc0: case 0xc6: return 2;                /* [us]norm int8 x1 */
    case 0xc1: case 0xc7: case 0xc3: case 0xc9: return 4;
    case 0xc2: case 0xc8: case 0xc4: case 0xca: return 8;
    case 0xc5: case 0xcb: return 16;
    case 0x91: case 0x92: case 0x97: case 0x98: return 1; /* BC1, BC4: 0.5 byte/texel */
    case 0x93: case 0x94: case 0x95: case 0x96: case 0x99: case 0x9a: case 0x9b: case 0x9c:
    case 0x9d: case 0x9e: return 2;                /* BC2/3/5/6H/7: 1 byte/texel */
    default: return 32;
    }
}

static int array_bytes(size_t w, size_t h, size_t d, int fmt, unsigned ch, uint64_t *out) {
    uint64_t n, b;
    if (__builtin_mul_overflow((uint64_t)(w ? w : 1), (uint64_t)(h ? h : 1), &n) ||
        __builtin_mul_overflow(n, (uint64_t)(d ? d : 1), &n) ||
        __builtin_mul_overflow(n, elem_bytes_x2(fmt, ch), &b))
        return -1;
    *out = (b + 1) / 2;
    return 0;
}

static int array3d_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels, uint64_t *out) {
    uint64_t total = 0;
    int layered = (d->Flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP)) != 0;
    for (unsigned l = 0; l < (levels ? levels : 1); l++) {
        size_t w = d->Width >> l, h = d->Height >> l, dep = layered ? d->Depth : d->Depth >> l;
        if (!w) w = 1;
        if (d->Height && !h) h = 1;
        if (d->Depth && !dep) dep = 1;
        uint64_t b;
        if (array_bytes(w, h, dep, d->Format, d->NumChannels, &b) != 0 ||
            __builtin_add_overflow(total, b, &total))
            return -1;
    }
    *out = total;
    return 0;
}

/* Arrays come from the same pages as linear memory: *size is rounded the
 * same way. */
static CUresult array_charge(uint64_t *size, int *g) {
    CUdevice dev;
    CUresult r = vc_cur_gpu(g, &dev);
    if (r != CUDA_SUCCESS)
        return r;
    *size = linear_bytes(*size);
    return charge(*g, *size);
}

VC_EXPORT CUresult cuArrayCreate_v2(CUarray *arr, const CUDA_ARRAY_DESCRIPTOR *desc) {
    PROLOGUE(cuArrayCreate_v2);
    if (!ACTIVE() || !arr || !desc)
        return REFUSED() ? CUDA_ERROR_OUT_OF_MEMORY : vc_real.cuArrayCreate_v2(arr, desc);
    uint64_t size;
    int g;
    if (array_bytes(desc->Width, desc->Height, 1, desc->Format, desc->NumChannels, &size) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = array_charge(&size, &g);
    if (r != CUDA_SUCCESS)
        return r;
    r = vc_real.cuArrayCreate_v2(arr, desc);
    SETTLE(r, VC_K_ARRAY, *arr, g, size, cur_ctx(), vc_real.cuArrayDestroy(*arr));
}

VC_EXPORT CUresult cuArray3DCreate_v2(CUarray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc) {
    PROLOGUE(cuArray3DCreate_v2);
    if (!ACTIVE() || !arr || !desc)
        return REFUSED() ? CUDA_ERROR_OUT_OF_MEMORY : vc_real.cuArray3DCreate_v2(arr, desc);
    uint64_t size;
    int g;
    if (array3d_bytes(desc, 1, &size) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = array_charge(&size, &g);
    if (r != CUDA_SUCCESS)
        return r;
    r = vc_real.cuArray3DCreate_v2(arr, desc);
    SETTLE(r, VC_K_ARRAY, *arr, g, size, cur_ctx(), vc_real.cuArrayDestroy(*arr));
}

VC_EXPORT CUresult cuArrayDestroy(CUarray arr) {
    PROLOGUE(cuArrayDestroy);
    RELEASE(VC_K_ARRAY, arr, vc_real.cuArrayDestroy(arr));
}

VC_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                          unsigned int levels) {
    PROLOGUE(cuMipmappedArrayCreate);
    if (!ACTIVE() || !arr || !desc)
        return REFUSED() ? CUDA_ERROR_OUT_OF_MEMORY
                             : vc_real.cuMipmappedArrayCreate(arr, desc, levels);
    uint64_t size;
    int g;
    if (array3d_bytes(desc, levels, &size) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = array_charge(&size, &g);
    if (r != CUDA_SUCCESS)
        return r;
    r = vc_real.cuMipmappedArrayCreate(arr, desc, levels);
    SETTLE(r, VC_K_MIPMAP, *arr, g, size, cur_ctx(), vc_real.cuMipmappedArrayDestroy(*arr));
}

VC_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray arr) {
    PROLOGUE(cuMipmappedArrayDestroy);
    RELEASE(VC_K_MIPMAP, arr, vc_real.cuMipmappedArrayDestroy(arr));
}

/* ---- virtual memory management ---- */

/* The gpu record a CUmemLocation charges: the device named by the location,
 * nothing for host memory, the current device for anything unrecognised. */
static CUresult location_gpu(const CUmemLocation *loc, int *g) {
    CUdevice dev;
    switch (loc->type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
        *g = vc_dev_gpu(loc->id);
        return CUDA_SUCCESS;
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT:
        *g = VC_GPU_HOST;
        return CUDA_SUCCESS;
    default:
        return vc_cur_gpu(g, &dev);
    }
}

VC_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size,
                               const CUmemAllocationProp *prop, unsigned long long flags) {
    PROLOGUE(cuMemCreate);
    if (!ACTIVE() || !h || !prop || size == 0)
        return REFUSED() ? CUDA_ERROR_OUT_OF_MEMORY : vc_real.cuMemCreate(h, size, prop, flags);
    int g;
    CUresult r = location_gpu(&prop->location, &g);
    if (r != CUDA_SUCCESS)
        return r;
    if (g == VC_GPU_HOST)
        return vc_real.cuMemCreate(h, size, prop, flags);
    if ((r = charge(g, size)) != CUDA_SUCCESS)
        return r;
    r = vc_real.cuMemCreate(h, size, prop, flags);
    SETTLE(r, VC_K_GENERIC, *h, g, size, 0, vc_real.cuMemRelease(*h));
}

VC_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    PROLOGUE(cuMemRelease);
    RELEASE(VC_K_GENERIC, h, vc_real.cuMemRelease(h));
}

/* ---- stream-ordered allocator ----
 *
 * A pool holds device memory in 2 MiB pages and keeps what is freed into it:
 * the driver gives pages back only at a synchronisation (stream, event or
 * context), down to max(live allocations, release threshold), or when asked
 * (cuMemPoolTrimTo). PyTorch's cudaMallocAsync backend sets the threshold
 * to UINT64_MAX, so its pool never shrinks. vcuda therefore charges a pool
 * what it holds, not what is live: an allocation that does not fit in the
 * pool's pages charges the pages it adds (live bytes, each allocation
 * rounded to 512, rounded up to 2 MiB) before the driver is called; a free
 * charges nothing back; after a synchronisation or a trim the pool is
 * credited down to what the driver says it still holds
 * (CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), never below its live pages. */
#define VC_MAX_POOLS 64
#define CU_MEMPOOL_ATTR_RELEASE_THRESHOLD 4
#define CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT 5
typedef struct {
    _Atomic uint64_t handle; /* 0: free slot */
    int g;
    int dead; /* destroyed with live allocations */
    uint64_t used, reserved, threshold;
} vc_pool;
static vc_pool pools[VC_MAX_POOLS];
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
/* Some pool holds pages above max(live, threshold): the next
 * synchronisation asks the driver. PyTorch's pools never set it. */
static _Atomic int pools_trimmable;

/* The slot of a pool, created (charging gpu record g) if new; -1 if the
 * table is full. */
static int pool_slot(CUmemoryPool pool, int g, int create) {
    uint64_t h = (uint64_t)(uintptr_t)pool;
    if (!h)
        return -1;
    for (int i = 0; i < VC_MAX_POOLS; i++)
        if (atomic_load_explicit(&pools[i].handle, memory_order_acquire) == h)
            return i;
    if (!create)
        return -1;
    /* Its threshold as the driver has it (0 unless set before vcuda saw it). */
    cuuint64_t thr = 0;
    if (!vc_real.cuMemPoolGetAttribute ||
        vc_real.cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &thr) != CUDA_SUCCESS)
        thr = 0;
    pthread_mutex_lock(&pool_mu);
    int s = -1;
    for (int i = 0; i < VC_MAX_POOLS; i++) {
        uint64_t cur = atomic_load(&pools[i].handle);
        if (cur == h) {
            s = i;
            break;
        }
        if (cur == 0 && s < 0)
            s = -2 - i;
    }
    if (s <= -2) {
        s = -2 - s;
        pools[s] = (vc_pool){0, g, 0, 0, 0, thr};
        atomic_store_explicit(&pools[s].handle, h, memory_order_release);
    }
    pthread_mutex_unlock(&pool_mu);
    if (s < 0) {
        static _Atomic int once;
        if (!atomic_exchange(&once, 1))
            vc_log("more than %d memory pools: refusing allocations from further pools", VC_MAX_POOLS);
    }
    return s;
}

/* Reserves room for sz more live bytes in pool s; *grew: pages charged. */
static CUresult pool_charge(int s, uint64_t sz, uint64_t *grew) {
    vc_pool *p = &pools[s];
    pthread_mutex_lock(&pool_mu);
    uint64_t need = p->used + sz;
    *grew = 0;
    if (need > p->reserved) {
        uint64_t add = vc_round_up(need, VC_PAGE) - p->reserved;
        if (charge(p->g, add) != CUDA_SUCCESS) {
            pthread_mutex_unlock(&pool_mu);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        p->reserved += add;
        *grew = add;
    }
    p->used = need;
    pthread_mutex_unlock(&pool_mu);
    return CUDA_SUCCESS;
}

/* Under pool_mu: what pool p may be credited down to (its live pages, or
 * more while the driver says it holds more). */
static void pool_credit_locked(vc_pool *p, uint64_t keep) {
    uint64_t k = vc_round_up(p->used, VC_PAGE);
    if (keep > k)
        k = keep;
    if (k < p->reserved) {
        vc_release(p->g, p->reserved - k);
        p->reserved = k;
    }
}

/* The driver did not take sz bytes (its call failed): give back the pages
 * this allocation added, if still unused. */
static void pool_uncharge(int s, uint64_t sz, uint64_t grew) {
    vc_pool *p = &pools[s];
    pthread_mutex_lock(&pool_mu);
    p->used -= sz;
    if (grew)
        pool_credit_locked(p, p->reserved - grew);
    pthread_mutex_unlock(&pool_mu);
}

static int pool_over(const vc_pool *p) {
    return p->reserved > vc_round_up(p->used, VC_PAGE) && p->reserved > p->threshold;
}

/* An allocation of sz live bytes went back into pool s. */
static void pool_freed(int s, uint64_t sz) {
    vc_pool *p = &pools[s];
    pthread_mutex_lock(&pool_mu);
    p->used -= sz;
    if (p->dead) {
        /* the driver frees a destroyed pool's pages as its last
         * allocations go */
        pool_credit_locked(p, 0);
        if (p->used == 0)
            atomic_store(&p->handle, 0);
    } else if (pool_over(p)) {
        atomic_store(&pools_trimmable, 1);
    }
    pthread_mutex_unlock(&pool_mu);
}

/* After the driver may have given pages back: credit pool s down to what
 * it says it holds. A driver that cannot say keeps the charge. */
static void pool_settle(int s) {
    cuuint64_t held;
    uint64_t h = atomic_load(&pools[s].handle);
    if (!h || !vc_real.cuMemPoolGetAttribute ||
        vc_real.cuMemPoolGetAttribute((CUmemoryPool)(uintptr_t)h, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                                      &held) != CUDA_SUCCESS)
        return;
    pthread_mutex_lock(&pool_mu);
    if (atomic_load(&pools[s].handle) == h && !pools[s].dead)
        pool_credit_locked(&pools[s], held);
    pthread_mutex_unlock(&pool_mu);
}

/* A synchronisation returned: settle the pools that hold pages above their
 * threshold. One relaxed load when none does. */
static void pools_synced(void) {
    if (VC_LIKELY(!atomic_load_explicit(&pools_trimmable, memory_order_relaxed)) || !ACTIVE())
        return;
    atomic_store(&pools_trimmable, 0);
    for (int i = 0; i < VC_MAX_POOLS; i++) {
        if (!atomic_load(&pools[i].handle))
            continue;
        pthread_mutex_lock(&pool_mu);
        int over = pool_over(&pools[i]) && !pools[i].dead;
        pthread_mutex_unlock(&pool_mu);
        if (!over)
            continue;
        pool_settle(i);
        pthread_mutex_lock(&pool_mu);
        if (pool_over(&pools[i])) /* the driver kept them: try again next time */
            atomic_store(&pools_trimmable, 1);
        pthread_mutex_unlock(&pool_mu);
    }
}

/* The device of a stream: the current context's for the default streams,
 * else the stream's own context's. */
static CUresult stream_gpu(CUstream s, int *g, CUdevice *dev) {
    if ((uintptr_t)s <= 2 || !vc_real.cuStreamGetCtx)
        return vc_cur_gpu(g, dev);
    CUcontext sc, cur = NULL;
    CUresult r = vc_real.cuStreamGetCtx(s, &sc);
    if (r != CUDA_SUCCESS)
        return r;
    if (vc_real.cuCtxGetCurrent && vc_real.cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur == sc)
        return vc_cur_gpu(g, dev);
    if (!vc_real.cuCtxPushCurrent_v2 || !vc_real.cuCtxPopCurrent_v2)
        return CUDA_ERROR_NOT_INITIALIZED;
    if ((r = vc_real.cuCtxPushCurrent_v2(sc)) != CUDA_SUCCESS)
        return r;
    r = vc_cur_gpu(g, dev);
    CUcontext popped;
    vc_real.cuCtxPopCurrent_v2(&popped);
    return r;
}

/* An allocation from pool `pool` (g: its gpu record): charged as the pool
 * grows, tracked with the pool's slot. */
static CUresult pool_alloc_in(CUresult (*fn)(CUdeviceptr *, size_t, CUmemoryPool, CUstream),
                              CUresult (*ffree)(CUdeviceptr, CUstream), CUdeviceptr *dptr,
                              size_t size, CUmemoryPool pool, CUstream s, int g) {
    if (g == VC_GPU_HOST)
        return fn(dptr, size, pool, s);
    if (g < 0)
        return CUDA_ERROR_OUT_OF_MEMORY; /* not in the limits file: cap 0 */
    int slot = pool_slot(pool, g, 1);
    if (slot < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t sz = vc_round_up(size, 512), grew;
    CUresult r = pool_charge(slot, sz, &grew);
    if (r != CUDA_SUCCESS)
        return r;
    r = fn(dptr, size, pool, s);
    if (r != CUDA_SUCCESS) {
        pool_uncharge(slot, sz, grew);
        return r;
    }
    if (vc_track(VC_K_POOLPTR, *dptr, sz, slot) != 0) {
        ffree(*dptr, s);
        pool_freed(slot, sz);
        table_full();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

static void graph_add(const void *h, int g, uint64_t pages);
static int captured(CUstream s, int ptsz);
static CUresult capture_alloc(CUresult (*fn)(CUdeviceptr *, size_t, CUstream), CUdeviceptr *dptr, size_t size,
                              CUstream s, int g) {
    if (g < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = fn(dptr, size, s);
    if (r == CUDA_SUCCESS)
        graph_add(s, g, vc_round_up(size, VC_PAGE));
    return r;
}

/* cuMemAllocAsync draws from the device's current pool. */
static CUresult via_async(CUdeviceptr *d, size_t n, CUmemoryPool pool, CUstream s) {
    (void)pool;
    return vc_real.cuMemAllocAsync(d, n, s);
}
static CUresult via_async_ptsz(CUdeviceptr *d, size_t n, CUmemoryPool pool, CUstream s) {
    (void)pool;
    return vc_real.cuMemAllocAsync_ptsz(d, n, s);
}

static CUresult async_alloc(int ptsz, CUresult (*ffree)(CUdeviceptr, CUstream), CUdeviceptr *dptr,
                            size_t size, CUstream s) {
    CUresult (*fn)(CUdeviceptr *, size_t, CUstream) = ptsz ? vc_real.cuMemAllocAsync_ptsz
                                                           : vc_real.cuMemAllocAsync;
    if (!ACTIVE() || !dptr || size == 0)
        return REFUSED() ? CUDA_ERROR_OUT_OF_MEMORY : fn(dptr, size, s);
    int g;
    CUdevice dev;
    CUresult r = stream_gpu(s, &g, &dev);
    if (r != CUDA_SUCCESS)
        return r;
    if (captured(s, ptsz)) /* an allocation node: charged with its graph */
        return capture_alloc(fn, dptr, size, s, g);
    CUmemoryPool pool = NULL;
    if (!vc_real.cuDeviceGetMemPool || vc_real.cuDeviceGetMemPool(&pool, dev) != CUDA_SUCCESS || !pool)
        return CUDA_ERROR_OUT_OF_MEMORY; /* cannot tell which pool grows: refuse */
    return pool_alloc_in(ptsz ? via_async_ptsz : via_async, ffree, dptr, size, pool, s, g);
}

VC_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t size, CUstream s) {
    PROLOGUE(cuMemAllocAsync);
    return async_alloc(0, vc_real.cuMemFreeAsync, dptr, size, s);
}
VC_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t size, CUstream s) {
    PROLOGUE(cuMemAllocAsync_ptsz);
    return async_alloc(1, vc_real.cuMemFreeAsync_ptsz ? vc_real.cuMemFreeAsync_ptsz : vc_real.cuMemFreeAsync,
                       dptr, size, s);
}

/* Pools are remembered with their location when created or fetched; an
 * unknown pool (imported from another process) charges the stream's
 * device. */
static int pool_gpu(CUmemoryPool pool, CUstream s, int *g) {
    int slot = pool_slot(pool, 0, 0);
    if (slot >= 0) {
        *g = pools[slot].g;
        return CUDA_SUCCESS;
    }
    CUdevice dev;
    return stream_gpu(s, g, &dev);
}

static CUresult pool_alloc(CUresult (*fn)(CUdeviceptr *, size_t, CUmemoryPool, CUstream),
                           CUresult (*ffree)(CUdeviceptr, CUstream), CUdeviceptr *dptr,
                           size_t size, CUmemoryPool pool, CUstream s) {
    if (!ACTIVE() || !dptr || size == 0 || !pool)
        return REFUSED() ? CUDA_ERROR_OUT_OF_MEMORY : fn(dptr, size, pool, s);
    int g;
    CUresult r = pool_gpu(pool, s, &g);
    if (r != CUDA_SUCCESS)
        return r;
    if (g != VC_GPU_HOST && captured(s, fn == vc_real.cuMemAllocFromPoolAsync_ptsz)) {
        if (g < 0)
            return CUDA_ERROR_OUT_OF_MEMORY;
        if ((r = fn(dptr, size, pool, s)) == CUDA_SUCCESS)
            graph_add(s, g, vc_round_up(size, VC_PAGE));
        return r;
    }
    return pool_alloc_in(fn, ffree, dptr, size, pool, s, g);
}

VC_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t size, CUmemoryPool pool,
                                           CUstream s) {
    PROLOGUE(cuMemAllocFromPoolAsync);
    return pool_alloc(vc_real.cuMemAllocFromPoolAsync, vc_real.cuMemFreeAsync, dptr, size, pool, s);
}
VC_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t size, CUmemoryPool pool,
                                                CUstream s) {
    PROLOGUE(cuMemAllocFromPoolAsync_ptsz);
    return pool_alloc(vc_real.cuMemAllocFromPoolAsync_ptsz,
                      vc_real.cuMemFreeAsync_ptsz ? vc_real.cuMemFreeAsync_ptsz
                                                  : vc_real.cuMemFreeAsync,
                      dptr, size, pool, s);
}

static CUresult free_sync(CUdeviceptr p, CUstream s) {
    (void)s;
    return vc_real.cuMemFree_v2(p);
}

/* Frees of linear memory and of pool allocations (either call frees
 * either kind): linear memory is credited at once, pool memory goes back
 * into its pool. */
static CUresult free_ptr(CUresult (*fn)(CUdeviceptr, CUstream), CUdeviceptr p, CUstream s) {
    uint64_t sz, c;
    int g;
    /* A free captured into a graph happens when the graph runs, which vcuda
     * does not see: the memory stays charged (conservative). */
    if (!ACTIVE() || (fn != free_sync && captured(s, fn == vc_real.cuMemFreeAsync_ptsz)))
        return fn(p, s);
    if (vc_untrack(VC_K_PTR, p, &sz, &g, &c) == 0) {
        CUresult r = fn(p, s);
        if (r != CUDA_SUCCESS)
            vc_track_ctx(VC_K_PTR, p, sz, g, c);
        else
            vc_release(g, sz);
        return r;
    }
    if (vc_untrack(VC_K_POOLPTR, p, &sz, &g, &c) == 0) {
        CUresult r = fn(p, s);
        if (r != CUDA_SUCCESS)
            vc_track(VC_K_POOLPTR, p, sz, g);
        else
            pool_freed(g, sz);
        return r;
    }
    return fn(p, s);
}

VC_EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
    PROLOGUE(cuMemFree_v2);
    return free_ptr(free_sync, p, NULL);
}
VC_EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
    PROLOGUE(cuMemFreeAsync);
    return free_ptr(vc_real.cuMemFreeAsync, p, s);
}
VC_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) {
    PROLOGUE(cuMemFreeAsync_ptsz);
    return free_ptr(vc_real.cuMemFreeAsync_ptsz, p, s);
}

VC_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props) {
    PROLOGUE(cuMemPoolCreate);
    CUresult r = vc_real.cuMemPoolCreate(pool, props);
    if (r == CUDA_SUCCESS && ACTIVE() && pool && props) {
        int g;
        if (location_gpu(&props->location, &g) == CUDA_SUCCESS)
            pool_slot(*pool, g, 1);
    }
    return r;
}

VC_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    PROLOGUE(cuMemPoolDestroy);
    CUresult r = vc_real.cuMemPoolDestroy(pool);
    int s;
    if (r != CUDA_SUCCESS || !ACTIVE() || (s = pool_slot(pool, 0, 0)) < 0)
        return r;
    /* Its free pages go now; pages of live allocations when those are
     * freed. */
    pthread_mutex_lock(&pool_mu);
    pools[s].dead = 1;
    pool_credit_locked(&pools[s], 0);
    if (pools[s].used == 0)
        atomic_store(&pools[s].handle, 0);
    pthread_mutex_unlock(&pool_mu);
    return r;
}

VC_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value) {
    PROLOGUE(cuMemPoolSetAttribute);
    CUresult r = vc_real.cuMemPoolSetAttribute(pool, attr, value);
    int s;
    if (r == CUDA_SUCCESS && ACTIVE() && attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD && value &&
        (s = pool_slot(pool, 0, 0)) >= 0) {
        pthread_mutex_lock(&pool_mu);
        pools[s].threshold = *(cuuint64_t *)value;
        if (pool_over(&pools[s]))
            atomic_store(&pools_trimmable, 1);
        pthread_mutex_unlock(&pool_mu);
    }
    return r;
}

VC_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) {
    PROLOGUE(cuMemPoolTrimTo);
    CUresult r = vc_real.cuMemPoolTrimTo(pool, keep);
    int s;
    if (r == CUDA_SUCCESS && ACTIVE() && (s = pool_slot(pool, 0, 0)) >= 0)
        pool_settle(s);
    return r;
}

/* Synchronisations: the driver trims pools to their thresholds here. */
VC_EXPORT CUresult cuStreamSynchronize(CUstream s) {
    PROLOGUE(cuStreamSynchronize);
    CUresult r = vc_real.cuStreamSynchronize(s);
    pools_synced();
    return r;
}
VC_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream s) {
    PROLOGUE(cuStreamSynchronize_ptsz);
    CUresult r = vc_real.cuStreamSynchronize_ptsz(s);
    pools_synced();
    return r;
}
VC_EXPORT CUresult cuCtxSynchronize(void) {
    PROLOGUE(cuCtxSynchronize);
    CUresult r = vc_real.cuCtxSynchronize();
    pools_synced();
    return r;
}
VC_EXPORT CUresult cuEventSynchronize(CUevent e) {
    PROLOGUE(cuEventSynchronize);
    CUresult r = vc_real.cuEventSynchronize(e);
    pools_synced();
    return r;
}

VC_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev) {
    PROLOGUE(cuDeviceGetDefaultMemPool);
    CUresult r = vc_real.cuDeviceGetDefaultMemPool(pool, dev);
    if (r == CUDA_SUCCESS && ACTIVE() && pool)
        pool_slot(*pool, vc_dev_gpu(dev), 1);
    return r;
}

VC_EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) {
    PROLOGUE(cuDeviceGetMemPool);
    CUresult r = vc_real.cuDeviceGetMemPool(pool, dev);
    if (r == CUDA_SUCCESS && ACTIVE() && pool)
        pool_slot(*pool, vc_dev_gpu(dev), 1);
    return r;
}

/* ---- graph memory nodes ----
 *
 * A graph's allocation nodes (cuGraphAddMemAllocNode, or cuMemAllocAsync
 * into a stream being captured) take no memory when added: the driver maps
 * their pages (2 MiB each node) from the device's graph memory when the
 * instantiated graph is first uploaded or launched, the graph keeps them
 * until it is destroyed, and the device keeps freed graph memory for later
 * graphs until cuDeviceGraphMemTrim. vcuda counts each graph's nodes, and
 * charges an instantiated graph's pages when it is instantiated (before the
 * driver can take them), as the device's graph memory grows; destroying
 * the graph exec returns them to that memory, and cuDeviceGraphMemTrim
 * credits what the driver then says it still holds
 * (CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT). */
#define CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT 2
static struct {
    uint64_t live, reserved;
} gmem[VC_MAX_GPUS];

static uint64_t gkey(const void *h, int g) { return (uint64_t)(uintptr_t)h ^ ((uint64_t)(g + 1) << 56); }

/* Adds pages to the allocation nodes of graph (or capturing stream) h. */
static void graph_add(const void *h, int g, uint64_t pages) {
    uint64_t had = 0, c;
    int gg;
    if (vc_untrack(VC_K_GRAPH, gkey(h, g), &had, &gg, &c) != 0)
        had = 0;
    if (vc_track(VC_K_GRAPH, gkey(h, g), had + pages, g) != 0)
        table_full(); /* the graph will be charged nothing for these: logged */
}

static int captured(CUstream s, int ptsz) {
    int st = 0;
    CUresult (*fn)(CUstream, int *) = ptsz && vc_real.cuStreamIsCapturing_ptsz ? vc_real.cuStreamIsCapturing_ptsz
                                                                             : vc_real.cuStreamIsCapturing;
    return (uintptr_t)s > 2 && fn && fn(s, &st) == CUDA_SUCCESS && st == 1 /* ACTIVE */;
}

VC_EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps,
                                          size_t n, CUDA_MEM_ALLOC_NODE_PARAMS *p) {
    PROLOGUE(cuGraphAddMemAllocNode);
    CUresult r = vc_real.cuGraphAddMemAllocNode(node, graph, deps, n, p);
    int g;
    if (r == CUDA_SUCCESS && ACTIVE() && p && location_gpu(&p->poolProps.location, &g) == CUDA_SUCCESS &&
        g != VC_GPU_HOST && g >= 0)
        graph_add(graph, g, vc_round_up(p->bytesize, VC_PAGE));
    return r;
}

VC_EXPORT CUresult cuStreamEndCapture(CUstream s, CUgraph *graph) {
    PROLOGUE(cuStreamEndCapture);
    CUresult r = vc_real.cuStreamEndCapture(s, graph);
    if (!ACTIVE())
        return r;
    for (int g = 0; g < vc_g.limits.ngpus; g++) {
        uint64_t pages, c;
        int gg;
        if (vc_untrack(VC_K_GRAPH, gkey(s, g), &pages, &gg, &c) == 0 && r == CUDA_SUCCESS && graph && *graph)
            graph_add(*graph, g, pages);
    }
    return r;
}

VC_EXPORT CUresult cuGraphDestroy(CUgraph graph) {
    PROLOGUE(cuGraphDestroy);
    CUresult r = vc_real.cuGraphDestroy(graph);
    if (r == CUDA_SUCCESS && ACTIVE())
        for (int g = 0; g < vc_g.limits.ngpus; g++) {
            uint64_t pages, c;
            int gg;
            vc_untrack(VC_K_GRAPH, gkey(graph, g), &pages, &gg, &c);
        }
    return r;
}

/* The graph exec's pages leave it (destroyed, or never kept). */
static void exec_gone(CUgraphExec e) {
    for (int g = 0; g < vc_g.limits.ngpus; g++) {
        uint64_t pages, c;
        int gg;
        if (vc_untrack(VC_K_GRAPHEXEC, gkey(e, g), &pages, &gg, &c) == 0) {
            pthread_mutex_lock(&pool_mu);
            gmem[g].live -= pages;
            pthread_mutex_unlock(&pool_mu);
        }
    }
}

/* After a successful instantiation: charge the graph's pages as the
 * device's graph memory grows; refuse (destroying the exec) over the cap. */
static CUresult instantiated(CUresult r, CUgraphExec *e, CUgraph graph) {
    if (r != CUDA_SUCCESS || !ACTIVE() || !e || !*e)
        return r;
    for (int g = 0; g < vc_g.limits.ngpus; g++) {
        uint64_t pages;
        int gg;
        if (vc_lookup(VC_K_GRAPH, gkey(graph, g), &pages, &gg) != 0 || !pages)
            continue;
        pthread_mutex_lock(&pool_mu);
        uint64_t need = gmem[g].live + pages;
        int ok = need <= gmem[g].reserved || charge(g, need - gmem[g].reserved) == CUDA_SUCCESS;
        if (ok) {
            if (need > gmem[g].reserved)
                gmem[g].reserved = need;
            gmem[g].live = need;
        }
        pthread_mutex_unlock(&pool_mu);
        if (!ok || vc_track(VC_K_GRAPHEXEC, gkey(*e, g), pages, g) != 0) {
            if (ok) {
                pthread_mutex_lock(&pool_mu);
                gmem[g].live -= pages;
                pthread_mutex_unlock(&pool_mu);
            }
            exec_gone(*e);
            if (vc_real.cuGraphExecDestroy)
                vc_real.cuGraphExecDestroy(*e);
            *e = NULL;
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    return r;
}

VC_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *e, CUgraph graph, unsigned long long flags) {
    PROLOGUE(cuGraphInstantiateWithFlags);
    return instantiated(vc_real.cuGraphInstantiateWithFlags(e, graph, flags), e, graph);
}
VC_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *e, CUgraph graph, void *params) {
    PROLOGUE(cuGraphInstantiateWithParams);
    return instantiated(vc_real.cuGraphInstantiateWithParams(e, graph, params), e, graph);
}
VC_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *e, CUgraph graph, CUgraphNode *err, char *log, size_t n) {
    PROLOGUE(cuGraphInstantiate_v2);
    return instantiated(vc_real.cuGraphInstantiate_v2(e, graph, err, log, n), e, graph);
}

VC_EXPORT CUresult cuGraphExecDestroy(CUgraphExec e) {
    PROLOGUE(cuGraphExecDestroy);
    CUresult r = vc_real.cuGraphExecDestroy(e);
    if (r == CUDA_SUCCESS && ACTIVE())
        exec_gone(e);
    return r;
}

VC_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev) {
    PROLOGUE(cuDeviceGraphMemTrim);
    CUresult r = vc_real.cuDeviceGraphMemTrim(dev);
    int g;
    cuuint64_t held;
    if (r != CUDA_SUCCESS || !ACTIVE() || (g = vc_dev_gpu(dev)) < 0 || !vc_real.cuDeviceGetGraphMemAttribute ||
        vc_real.cuDeviceGetGraphMemAttribute(dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &held) != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&pool_mu);
    uint64_t keep = held > gmem[g].live ? held : gmem[g].live;
    if (keep < gmem[g].reserved) {
        vc_release(g, gmem[g].reserved - keep);
        gmem[g].reserved = keep;
    }
    pthread_mutex_unlock(&pool_mu);
    return r;
}

/* ---- IPC and external memory ---- */

static CUresult ipc_open(CUresult (*fn)(CUdeviceptr *, CUipcMemHandle, unsigned int),
                         CUdeviceptr *dptr, CUipcMemHandle h, unsigned int flags) {
    if (REFUSED())
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = fn(dptr, h, flags);
    if (r != CUDA_SUCCESS || !ACTIVE() || !dptr)
        return r;
    /* The size is only known once mapped. The mapping adds no physical
     * memory of its own, so mapping first and refusing after is safe. */
    int g;
    CUdevice dev;
    CUdeviceptr base = 0;
    size_t size = 0;
    if (vc_cur_gpu(&g, &dev) != CUDA_SUCCESS || !vc_real.cuMemGetAddressRange_v2 ||
        vc_real.cuMemGetAddressRange_v2(&base, &size, *dptr) != CUDA_SUCCESS ||
        charge(g, size) != CUDA_SUCCESS) {
        vc_real.cuIpcCloseMemHandle(*dptr);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    SETTLE(CUDA_SUCCESS, VC_K_IPC, *dptr, g, size, cur_ctx(), vc_real.cuIpcCloseMemHandle(*dptr));
}

VC_EXPORT CUresult cuIpcOpenMemHandle(CUdeviceptr *dptr, CUipcMemHandle h, unsigned int flags) {
    PROLOGUE(cuIpcOpenMemHandle);
    return ipc_open(vc_real.cuIpcOpenMemHandle, dptr, h, flags);
}
VC_EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *dptr, CUipcMemHandle h, unsigned int flags) {
    PROLOGUE(cuIpcOpenMemHandle_v2);
    return ipc_open(vc_real.cuIpcOpenMemHandle_v2, dptr, h, flags);
}
VC_EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
    PROLOGUE(cuIpcCloseMemHandle);
    RELEASE(VC_K_IPC, p, vc_real.cuIpcCloseMemHandle(p));
}

VC_EXPORT CUresult cuImportExternalMemory(CUexternalMemory *ext,
                                          const CUDA_EXTERNAL_MEMORY_HANDLE_DESC *desc) {
    PROLOGUE(cuImportExternalMemory);
    if (!ACTIVE() || !ext || !desc || desc->size == 0)
        return REFUSED() ? CUDA_ERROR_OUT_OF_MEMORY : vc_real.cuImportExternalMemory(ext, desc);
    /* Counted once, by the imported size; buffers and mipmapped arrays
     * mapped from it are views and are not counted again. */
    int g;
    CUdevice dev;
    CUresult r = vc_cur_gpu(&g, &dev);
    if (r != CUDA_SUCCESS)
        return r;
    if ((r = charge(g, desc->size)) != CUDA_SUCCESS)
        return r;
    r = vc_real.cuImportExternalMemory(ext, desc);
    SETTLE(r, VC_K_EXTMEM, *ext, g, desc->size, cur_ctx(), vc_real.cuDestroyExternalMemory(*ext));
}

VC_EXPORT CUresult cuDestroyExternalMemory(CUexternalMemory ext) {
    PROLOGUE(cuDestroyExternalMemory);
    RELEASE(VC_K_EXTMEM, ext, vc_real.cuDestroyExternalMemory(ext));
}
