/*
 * hooks_mem.c - the paths that create or release device memory: linear
 * memory, arrays, IPC and external memory. VMM (cuMemCreate/cuMemMap) is in
 * hooks_vmm.c, the stream-ordered allocator in hooks_pool.c, graph memory in
 * hooks_graph.c.
 *
 * Pattern: find the device the memory lands on, reserve the bytes in the
 * shared region (lock-free; refuses over the cap), call the driver, then
 * record handle -> (bytes, gpu) so that the free is credited to the same
 * device by the same amount whichever context is current then. A failed
 * driver call gives the reservation back; an allocation that would pass the
 * cap returns CUDA_ERROR_OUT_OF_MEMORY and changes nothing.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "handles.h"
#include "hooks_mem.h"
#include "real.h"
#include "region.h"
#include "vcuda.h"

/* Driver rounding of linear memory and arrays: the driver maps device
 * memory in 2 MiB pages; an allocation over 1 MiB takes whole pages of its
 * own, a smaller one is carved at 512-byte alignment from pages shared with
 * others (the partly used page they share is not charged). */
static uint64_t linear_bytes(uint64_t size) {
    return size > (1ull << 20) ? vc_round_up(size, 2ull << 20) : vc_round_up(size, 512);
}

CUresult vc_mem_charge(int g, uint64_t size) {
    if (g < 0 || vc_reserve(g, size) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    return CUDA_SUCCESS;
}

void vc_mem_table_full(void) {
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
            vc_mem_table_full();                                                                          \
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
    if ((r = vc_mem_charge(g, sz)) != CUDA_SUCCESS)
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
    if ((r = vc_mem_charge(g, est)) != CUDA_SUCCESS)
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
    return vc_mem_charge(*g, *size);
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

/* The gpu record a CUmemLocation charges (hooks_mem.h). */
CUresult vc_location_gpu(const CUmemLocation *loc, int *g) {
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

/* ---- IPC and external memory ---- */

/* CUDA IPC inside one container (a server and its workers sharing weights):
 * the exporter's allocation is already charged to the container, and the
 * importer's mapping adds no physical memory, so charging the importer too
 * counted it twice (a false OOM at half the cap). Exporters record each
 * handle they give out (a hash of its 64 bytes, which the driver makes
 * unique per allocation) in a table beside the container's region
 * (<region>.ipc-exports, shared by the container's processes like the
 * region); an import whose handle is in the table is not charged again.
 * Anything else (another container's export, a table vcuda cannot open) is
 * charged to the importer. The table, like the region, is writable by the
 * container: a forged entry makes an import of another container's memory
 * free for the importer while the exporter's cap still holds it; the node
 * agent's NVML guard bounds what the driver really holds. */
#define IPC_EXPORTS 255
typedef struct {
    uint64_t magic;
    _Atomic uint64_t next;
    struct {
        _Atomic uint64_t key;
        uint64_t gpu;
    } e[IPC_EXPORTS];
} ipc_exports;
_Static_assert(sizeof(ipc_exports) == 4096, "ipc export table size");
#define IPC_EXPORTS_MAGIC 0x31505849414455ull /* "UDAIXP1" */

static ipc_exports *exports_map(void) {
    static ipc_exports *_Atomic map;
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    ipc_exports *m = atomic_load(&map);
    if (m)
        return m;
    pthread_mutex_lock(&mu);
    if (!(m = atomic_load(&map))) {
        char path[sizeof(vc_g.limits.region) + 16];
        snprintf(path, sizeof(path), "%s.ipc-exports", vc_g.limits.region);
        int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
        struct stat st;
        if (fd >= 0 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
            (st.st_size >= (off_t)sizeof(ipc_exports) || ftruncate(fd, sizeof(ipc_exports)) == 0)) {
            void *p = mmap(NULL, sizeof(ipc_exports), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (p != MAP_FAILED) {
                m = p;
                uint64_t zero = 0;
                atomic_compare_exchange_strong((_Atomic uint64_t *)&m->magic, &zero, IPC_EXPORTS_MAGIC);
                atomic_store(&map, m);
            }
        }
        if (fd >= 0)
            close(fd);
    }
    pthread_mutex_unlock(&mu);
    return m;
}

static uint64_t ipc_key(const void *token) {
    uint64_t k = 0xcbf29ce484222325ull; /* FNV-1a */
    for (size_t i = 0; i < 64; i++)
        k = (k ^ ((const unsigned char *)token)[i]) * 0x100000001b3ull;
    return k | 1;
}

int vc_exported_here(const void *token) {
    ipc_exports *m = exports_map();
    if (!m || m->magic != IPC_EXPORTS_MAGIC)
        return -1;
    uint64_t k = ipc_key(token);
    for (int i = 0; i < IPC_EXPORTS; i++)
        if (atomic_load_explicit(&m->e[i].key, memory_order_acquire) == k)
            return m->e[i].gpu < VC_MAX_GPUS ? (int)m->e[i].gpu : -1;
    return -1;
}

void vc_export_add(const void *token, int g) {
    ipc_exports *m;
    if (g < 0 || vc_exported_here(token) >= 0 || !(m = exports_map()))
        return;
    /* A ring: an overwritten entry only makes a later import count twice. */
    uint64_t i = atomic_fetch_add(&m->next, 1) % IPC_EXPORTS;
    atomic_store_explicit(&m->e[i].key, 0, memory_order_relaxed);
    m->e[i].gpu = (uint64_t)g;
    atomic_store_explicit(&m->e[i].key, ipc_key(token), memory_order_release);
}

VC_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
    PROLOGUE(cuIpcGetMemHandle);
    CUresult r = vc_real.cuIpcGetMemHandle(h, p);
    uint64_t size;
    int g;
    /* Only memory charged here: an export is what makes imports free. */
    if (r == CUDA_SUCCESS && ACTIVE() && h && vc_lookup(VC_K_PTR, p, &size, &g) == 0)
        vc_export_add(h->reserved, g);
    return r;
}

static CUresult ipc_open(CUresult (*fn)(CUdeviceptr *, CUipcMemHandle, unsigned int),
                         CUdeviceptr *dptr, CUipcMemHandle h, unsigned int flags) {
    if (REFUSED())
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = fn(dptr, h, flags);
    if (r != CUDA_SUCCESS || !ACTIVE() || !dptr)
        return r;
    int here = vc_exported_here(h.reserved);
    if (here >= 0) /* charged to the container by its exporter: counted once */
        SETTLE(CUDA_SUCCESS, VC_K_IPC, *dptr, here, 0, cur_ctx(), vc_real.cuIpcCloseMemHandle(*dptr));
    /* The size is only known once mapped. The mapping adds no physical
     * memory of its own, so mapping first and refusing after is safe. */
    int g;
    CUdevice dev;
    CUdeviceptr base = 0;
    size_t size = 0;
    if (vc_cur_gpu(&g, &dev) != CUDA_SUCCESS || !vc_real.cuMemGetAddressRange_v2 ||
        vc_real.cuMemGetAddressRange_v2(&base, &size, *dptr) != CUDA_SUCCESS ||
        vc_mem_charge(g, size) != CUDA_SUCCESS) {
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
    if ((r = vc_mem_charge(g, desc->size)) != CUDA_SUCCESS)
        return r;
    r = vc_real.cuImportExternalMemory(ext, desc);
    SETTLE(r, VC_K_EXTMEM, *ext, g, desc->size, cur_ctx(), vc_real.cuDestroyExternalMemory(*ext));
}

VC_EXPORT CUresult cuDestroyExternalMemory(CUexternalMemory ext) {
    PROLOGUE(cuDestroyExternalMemory);
    RELEASE(VC_K_EXTMEM, ext, vc_real.cuDestroyExternalMemory(ext));
}
