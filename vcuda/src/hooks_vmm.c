/*
 * hooks_vmm.c - virtual memory management: cuMemCreate'd allocations, their
 * mappings and handle references.
 *
 * The driver keeps an allocation until its handle has been released (the
 * cuMemCreate reference and one per cuMemRetainAllocationHandle, each
 * dropped by cuMemRelease) AND every mapping of it has been unmapped.
 * llama.cpp's VMM pool, PyTorch's expandable segments and many others
 * release the handle right after cuMemMap and unmap much later, so
 * crediting at cuMemRelease would leave all of that memory uncounted (and
 * let a create/map/release loop pass the cap). vcuda therefore charges
 * from cuMemCreate until the last reference goes: the handle table entry
 * (VC_K_GENERIC) counts references (creation + retains + live mappings) in
 * its ctx field, and a sorted per-process list of mappings says which
 * handle each mapped range holds, so one cuMemUnmap over several mappings
 * drops each of them. The bookkeeping runs under one mutex held across the
 * driver call, so a handle value the driver reuses after its last reference
 * cannot be confused with the old one. VMM calls are not on a hot path.
 *
 * Imports (cuMemImportFromShareableHandle) map another process's memory.
 * Inside one container it is already charged to the exporter; a fabric
 * handle (64 bytes) exported by a process of the container is found in the
 * container's export table (hooks_mem.c) and not charged again. Any other
 * import (another container's, or a POSIX file descriptor, which carries no
 * identity vcuda can trust: same-container fd imports are counted twice,
 * conservatively) is charged to the importer for what it maps, from
 * cuMemMap to cuMemUnmap: the import does not say its size, a mapping does.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "handles.h"
#include "hooks_mem.h"
#include "real.h"
#include "region.h"
#include "vcuda.h"

typedef struct {
    uint64_t va, size, h;
    uint64_t charged; /* what mapping an import charged (else 0) */
    int g;
} vmm_map;
/* In a VC_K_GENERIC entry's reference count: an import charged per mapping. */
#define REF_IMPORT (1ull << 62)
static pthread_mutex_t vmm_mu = PTHREAD_MUTEX_INITIALIZER;
static vmm_map *maps; /* sorted by va, under vmm_mu */
static size_t nmaps, capmaps;

void vc_vmm_atfork_child(void) {
    /* Device handles do not survive fork (the handle tables start empty). */
    pthread_mutex_init(&vmm_mu, NULL);
    nmaps = 0;
}

/* First mapping whose start is >= va. */
static size_t map_lower(uint64_t va) {
    size_t lo = 0, hi = nmaps;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (maps[mid].va < va)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static int map_insert(uint64_t va, uint64_t size, uint64_t h, uint64_t charged, int g) {
    if (nmaps == capmaps) {
        size_t nc = capmaps ? capmaps * 2 : 256;
        vmm_map *m = realloc(maps, nc * sizeof(*m));
        if (!m)
            return -1;
        maps = m;
        capmaps = nc;
    }
    size_t i = map_lower(va);
    memmove(&maps[i + 1], &maps[i], (nmaps - i) * sizeof(*maps));
    maps[i] = (vmm_map){va, size, h, charged, g};
    nmaps++;
    return 0;
}

/* Drops one reference of handle h; the last one credits the allocation
 * (vmm_mu held). */
static void unref(uint64_t h) {
    uint64_t size, refs, c;
    int g;
    if (vc_lookup_ctx(VC_K_GENERIC, h, &size, &g, &refs) != 0)
        return;
    if ((refs & ~REF_IMPORT) > 1) {
        vc_set_ctx(VC_K_GENERIC, h, refs - 1);
        return;
    }
    if (vc_untrack(VC_K_GENERIC, h, &size, &g, &c) == 0)
        vc_release(g, size);
}

/* Adds a reference to h if vcuda tracks it; 0 if it does, and whether it
 * is an import charged per mapping and to which gpu record (vmm_mu held). */
static int addref_import(uint64_t h, int *import, int *g) {
    uint64_t size, refs;
    if (vc_lookup_ctx(VC_K_GENERIC, h, &size, g, &refs) != 0)
        return -1;
    vc_set_ctx(VC_K_GENERIC, h, refs + 1);
    *import = (refs & REF_IMPORT) != 0;
    return 0;
}
static int addref(uint64_t h) {
    int import, g;
    return addref_import(h, &import, &g);
}

/* An entry for a handle value the driver has just handed out again belongs
 * to an allocation the driver no longer has (its references went by a path
 * vcuda did not see): credit it and forget its mappings (vmm_mu held). */
static void drop_stale(uint64_t h) {
    uint64_t size, c;
    int g;
    if (vc_untrack(VC_K_GENERIC, h, &size, &g, &c) != 0)
        return;
    vc_release(g, size);
    size_t k = 0;
    for (size_t i = 0; i < nmaps; i++)
        if (maps[i].h != h)
            maps[k++] = maps[i];
    nmaps = k;
}

VC_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size,
                               const CUmemAllocationProp *prop, unsigned long long flags) {
    PROLOGUE(cuMemCreate);
    if (!ACTIVE() || !h || !prop || size == 0)
        return REFUSED() ? CUDA_ERROR_OUT_OF_MEMORY : vc_real.cuMemCreate(h, size, prop, flags);
    int g;
    CUresult r = vc_location_gpu(&prop->location, &g);
    if (r != CUDA_SUCCESS)
        return r;
    if (g == VC_GPU_HOST)
        return vc_real.cuMemCreate(h, size, prop, flags);
    if ((r = vc_mem_charge(g, size)) != CUDA_SUCCESS)
        return r;
    r = vc_real.cuMemCreate(h, size, prop, flags);
    if (r != CUDA_SUCCESS) {
        vc_release(g, size);
        return r;
    }
    pthread_mutex_lock(&vmm_mu);
    drop_stale(*h);
    int t = vc_track_ctx(VC_K_GENERIC, *h, size, g, 1 /* the creation's reference */);
    pthread_mutex_unlock(&vmm_mu);
    if (t != 0) {
        vc_real.cuMemRelease(*h);
        vc_release(g, size);
        vc_mem_table_full();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

VC_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    PROLOGUE(cuMemRelease);
    if (!ACTIVE())
        return vc_real.cuMemRelease(h);
    pthread_mutex_lock(&vmm_mu);
    CUresult r = vc_real.cuMemRelease(h);
    if (r == CUDA_SUCCESS)
        unref(h);
    pthread_mutex_unlock(&vmm_mu);
    return r;
}

VC_EXPORT CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                            unsigned long long flags) {
    PROLOGUE(cuMemMap);
    if (!ACTIVE())
        return vc_real.cuMemMap(va, size, offset, h, flags);
    pthread_mutex_lock(&vmm_mu);
    CUresult r = vc_real.cuMemMap(va, size, offset, h, flags);
    int import = 0, g = -1;
    if (r == CUDA_SUCCESS && addref_import(h, &import, &g) == 0) {
        /* An import's mapping adds no physical memory of its own: mapping
         * first and refusing after is safe. */
        int over = import && vc_mem_charge(g, size) != CUDA_SUCCESS;
        if (over || map_insert(va, size, h, import ? size : 0, g) != 0) {
            /* Over the cap, or the mapping cannot be remembered (so never
             * credited): undo. */
            if (import && !over)
                vc_release(g, size);
            unref(h);
            if (vc_real.cuMemUnmap)
                vc_real.cuMemUnmap(va, size);
            if (!over)
                vc_mem_table_full();
            r = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    pthread_mutex_unlock(&vmm_mu);
    return r;
}

VC_EXPORT CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
    PROLOGUE(cuMemUnmap);
    if (!ACTIVE())
        return vc_real.cuMemUnmap(va, size);
    pthread_mutex_lock(&vmm_mu);
    CUresult r = vc_real.cuMemUnmap(va, size);
    if (r == CUDA_SUCCESS) {
        /* The driver unmaps only whole mappings: every one starting in the range goes. */
        size_t i = map_lower(va), j = i;
        for (; j < nmaps && maps[j].va - va < size; j++) {
            if (maps[j].charged)
                vc_release(maps[j].g, maps[j].charged);
            unref(maps[j].h);
        }
        memmove(&maps[i], &maps[j], (nmaps - j) * sizeof(*maps));
        nmaps -= j - i;
    }
    pthread_mutex_unlock(&vmm_mu);
    return r;
}

#define CU_MEM_HANDLE_TYPE_FABRIC 8

VC_EXPORT CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type,
                                                unsigned long long flags) {
    PROLOGUE(cuMemExportToShareableHandle);
    CUresult r = vc_real.cuMemExportToShareableHandle(out, h, type, flags);
    uint64_t size, refs;
    int g;
    if (r != CUDA_SUCCESS || !ACTIVE() || !out || type != CU_MEM_HANDLE_TYPE_FABRIC)
        return r;
    pthread_mutex_lock(&vmm_mu);
    /* Only memory charged here (not an import) makes same-container imports free. */
    if (vc_lookup_ctx(VC_K_GENERIC, h, &size, &g, &refs) == 0 && !(refs & REF_IMPORT))
        vc_export_add(out, g);
    pthread_mutex_unlock(&vmm_mu);
    return r;
}

VC_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os, int type) {
    PROLOGUE(cuMemImportFromShareableHandle);
    if (REFUSED())
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = vc_real.cuMemImportFromShareableHandle(h, os, type);
    if (r != CUDA_SUCCESS || !ACTIVE() || !h)
        return r;
    CUmemAllocationProp prop;
    int g;
    if (!vc_real.cuMemGetAllocationPropertiesFromHandle ||
        vc_real.cuMemGetAllocationPropertiesFromHandle(&prop, *h) != CUDA_SUCCESS ||
        vc_location_gpu(&prop.location, &g) != CUDA_SUCCESS) {
        vc_real.cuMemRelease(*h);
        return CUDA_ERROR_OUT_OF_MEMORY; /* cannot tell where it is: refuse */
    }
    if (g == VC_GPU_HOST)
        return r;
    int here = type == CU_MEM_HANDLE_TYPE_FABRIC && os ? vc_exported_here(os) : -1;
    pthread_mutex_lock(&vmm_mu);
    drop_stale(*h);
    int t = vc_track_ctx(VC_K_GENERIC, *h, 0, g, here >= 0 ? 1 : 1 | REF_IMPORT);
    pthread_mutex_unlock(&vmm_mu);
    if (t != 0) {
        vc_real.cuMemRelease(*h);
        vc_mem_table_full();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return r;
}

VC_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr) {
    PROLOGUE(cuMemRetainAllocationHandle);
    if (!ACTIVE())
        return vc_real.cuMemRetainAllocationHandle(h, addr);
    pthread_mutex_lock(&vmm_mu);
    /* The driver returns the handle value the memory was mapped with. */
    CUresult r = vc_real.cuMemRetainAllocationHandle(h, addr);
    if (r == CUDA_SUCCESS && h)
        addref(*h);
    pthread_mutex_unlock(&vmm_mu);
    return r;
}
