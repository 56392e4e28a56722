/*
 * hooks_pool.c - the stream-ordered allocator (cuMemAllocAsync, pools) and
 * the synchronisations at which a pool gives pages back. Same pattern as
 * hooks_mem.c; what a pool is charged is explained below.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>

#include "handles.h"
#include "hooks_mem.h"
#include "real.h"
#include "region.h"
#include "vcuda.h"

/* A pool holds device memory in 2 MiB pages and keeps what is freed into it:
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
        if (vc_mem_charge(p->g, add) != CUDA_SUCCESS) {
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
        vc_mem_table_full();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

static CUresult capture_alloc(CUresult (*fn)(CUdeviceptr *, size_t, CUstream), CUdeviceptr *dptr, size_t size,
                              CUstream s, int ptsz, int g) {
    if (g < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = fn(dptr, size, s);
    if (r == CUDA_SUCCESS)
        vc_graph_add(vc_capture_key(s, ptsz), g, vc_round_up(size, VC_PAGE));
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
    if (vc_stream_captured(s, ptsz)) /* an allocation node: charged with its graph */
        return capture_alloc(fn, dptr, size, s, ptsz, g);
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
    int ptsz = fn == vc_real.cuMemAllocFromPoolAsync_ptsz;
    if (g != VC_GPU_HOST && vc_stream_captured(s, ptsz)) {
        if (g < 0)
            return CUDA_ERROR_OUT_OF_MEMORY;
        if ((r = fn(dptr, size, pool, s)) == CUDA_SUCCESS)
            vc_graph_add(vc_capture_key(s, ptsz), g, vc_round_up(size, VC_PAGE));
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
    if (!ACTIVE() || (fn != free_sync && vc_stream_captured(s, fn == vc_real.cuMemFreeAsync_ptsz)))
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
        if (vc_location_gpu(&props->location, &g) == CUDA_SUCCESS)
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

/* Pool pointers shared between processes (cuMemPoolExportPointer /
 * cuMemPoolImportPointer): as CUDA IPC (hooks_mem.c), an import of memory a
 * process of this container exported is not charged again; any other import
 * is charged to the importer by its size and credited when freed. */
VC_EXPORT CUresult cuMemPoolExportPointer(CUmemPoolPtrExportData *data, CUdeviceptr p) {
    PROLOGUE(cuMemPoolExportPointer);
    CUresult r = vc_real.cuMemPoolExportPointer(data, p);
    uint64_t size;
    int slot;
    if (r == CUDA_SUCCESS && ACTIVE() && data && vc_lookup(VC_K_POOLPTR, p, &size, &slot) == 0 && slot >= 0 &&
        slot < VC_MAX_POOLS)
        vc_export_add(data->reserved, pools[slot].g);
    return r;
}

VC_EXPORT CUresult cuMemPoolImportPointer(CUdeviceptr *p, CUmemoryPool pool, CUmemPoolPtrExportData *data) {
    PROLOGUE(cuMemPoolImportPointer);
    if (REFUSED())
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = vc_real.cuMemPoolImportPointer(p, pool, data);
    if (r != CUDA_SUCCESS || !ACTIVE() || !p || !data)
        return r;
    int g = vc_exported_here(data->reserved);
    uint64_t size = 0;
    if (g < 0) {
        /* Imported memory adds no pages to the importer's pool: importing
         * first and refusing after is safe. */
        CUdeviceptr base = 0;
        size_t sz = 0;
        CUdevice dev;
        if (vc_cur_gpu(&g, &dev) != CUDA_SUCCESS || !vc_real.cuMemGetAddressRange_v2 ||
            vc_real.cuMemGetAddressRange_v2(&base, &sz, *p) != CUDA_SUCCESS || vc_mem_charge(g, sz) != CUDA_SUCCESS) {
            vc_real.cuMemFree_v2(*p);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        size = sz;
    }
    /* Freed with cuMemFree[Async] like linear memory (free_ptr credits it). */
    if (vc_track(VC_K_PTR, *p, size, g) != 0) {
        vc_real.cuMemFree_v2(*p);
        vc_release(g, size);
        vc_mem_table_full();
        return CUDA_ERROR_OUT_OF_MEMORY;
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
