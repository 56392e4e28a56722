/*
 * hooks_info.c - memory queries answer with the container's share:
 * total = the cap, used = what the container's processes hold, free = the
 * rest (never more than the GPU really has free). This is what frameworks
 * size their pools from and what nvidia-smi prints.
 *
 * Out-parameters are passed to the real function as given, so NULLs get the
 * driver's own error; vcuda only rewrites results it was handed back.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "real.h"
#include "region.h"
#include "vcuda.h"

#define FAIL_CLOSED() (vc_g.mode == VC_MODE_FAIL_CLOSED)

static inline uint64_t min64(uint64_t a, uint64_t b) { return a < b ? a : b; }

/* The share of gpu record g given the real figures: total, free. */
static void share(int g, uint64_t real_total, uint64_t real_free, uint64_t *total, uint64_t *free,
                  uint64_t *used) {
    if (g < 0 || FAIL_CLOSED()) { /* not ours, or limits unusable: nothing */
        *total = *free = *used = 0;
        return;
    }
    vc_region_maybe_reclaim(); /* drop processes that died holding memory */
    uint64_t cap = min64(vc_g.limits.gpu[g].mem_cap, real_total);
    uint64_t u = vc_region_used(g);
    *total = cap;
    *used = min64(u, cap);
    *free = min64(cap - *used, real_free);
}

static CUresult cur_gpu_info(int *g) {
    CUdevice dev;
    if (FAIL_CLOSED()) {
        *g = -1;
        return CUDA_SUCCESS;
    }
    return vc_cur_gpu(g, &dev);
}

VC_EXPORT CUresult cuMemGetInfo_v2(size_t *free, size_t *total) {
    PROLOGUE(cuMemGetInfo_v2);
    size_t rf = 0, rt = 0;
    CUresult r = vc_real.cuMemGetInfo_v2(free ? &rf : NULL, total ? &rt : NULL);
    if (r != CUDA_SUCCESS || !(ACTIVE() || FAIL_CLOSED())) {
        if (r == CUDA_SUCCESS) {
            if (free)
                *free = rf;
            if (total)
                *total = rt;
        }
        return r;
    }
    int g;
    if (cur_gpu_info(&g) != CUDA_SUCCESS)
        g = -1;
    if (!total) { /* the driver accepted a NULL total; get it for the math */
        CUresult r2 = vc_real.cuMemGetInfo_v2(&rf, &rt);
        (void)r2;
    }
    if (!free)
        rf = (size_t)-1;
    uint64_t t, f, u;
    share(g, rt, rf, &t, &f, &u);
    if (free)
        *free = f;
    if (total)
        *total = t;
    return r;
}

VC_EXPORT CUresult cuMemGetInfo(unsigned int *free, unsigned int *total) {
    /* Legacy 32-bit variant: same figures, clamped. */
    size_t f = 0, t = 0;
    CUresult r = cuMemGetInfo_v2(free ? &f : NULL, total ? &t : NULL);
    if (r == CUDA_SUCCESS) {
        if (free)
            *free = f > 0xffffffffu ? 0xffffffffu : (unsigned)f;
        if (total)
            *total = t > 0xffffffffu ? 0xffffffffu : (unsigned)t;
    }
    return r;
}

VC_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    PROLOGUE(cuDeviceTotalMem_v2);
    CUresult r = vc_real.cuDeviceTotalMem_v2(bytes, dev);
    if (r != CUDA_SUCCESS || !bytes || !(ACTIVE() || FAIL_CLOSED()))
        return r;
    int g = FAIL_CLOSED() ? -1 : vc_dev_gpu(dev);
    *bytes = g < 0 ? 0 : (size_t)min64(vc_g.limits.gpu[g].mem_cap, *bytes);
    return r;
}

VC_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) {
    size_t b = 0;
    CUresult r = cuDeviceTotalMem_v2(bytes ? &b : NULL, dev);
    if (r == CUDA_SUCCESS && bytes)
        *bytes = b > 0xffffffffu ? 0xffffffffu : (unsigned)b;
    return r;
}

/* ---- NVML ---- */

/* nvmlDevice_t handles are stable for the life of the library; remember the
 * gpu record of each one. */
#define NVML_CACHE 256
static struct {
    _Atomic(nvmlDevice_t) dev;
    int g;
} nvml_cache[NVML_CACHE];
static _Atomic int nvml_cache_n;
static pthread_mutex_t nvml_mu = PTHREAD_MUTEX_INITIALIZER;

static int nvml_gpu(nvmlDevice_t dev) {
    int n = atomic_load_explicit(&nvml_cache_n, memory_order_acquire);
    for (int i = 0; i < n; i++)
        if (atomic_load_explicit(&nvml_cache[i].dev, memory_order_relaxed) == dev)
            return nvml_cache[i].g;
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    if (!vc_real.nvmlDeviceGetUUID || vc_real.nvmlDeviceGetUUID(dev, uuid, sizeof(uuid)) != NVML_SUCCESS)
        return -1; /* cannot tell which GPU: show nothing */
    uuid[sizeof(uuid) - 1] = '\0';
    int g = vc_limits_find(&vc_g.limits, uuid);
    if (g < 0)
        g = -1;
    pthread_mutex_lock(&nvml_mu);
    n = atomic_load(&nvml_cache_n);
    if (n < NVML_CACHE) {
        nvml_cache[n].g = g;
        atomic_store(&nvml_cache[n].dev, dev);
        atomic_store_explicit(&nvml_cache_n, n + 1, memory_order_release);
    }
    pthread_mutex_unlock(&nvml_mu);
    return g;
}

VC_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem) {
    vc_init_nvml();
    if (!vc_real.nvmlDeviceGetMemoryInfo)
        return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t r = vc_real.nvmlDeviceGetMemoryInfo(dev, mem);
    if (r != NVML_SUCCESS || !mem || !(ACTIVE() || FAIL_CLOSED()))
        return r;
    int g = FAIL_CLOSED() ? -1 : nvml_gpu(dev);
    uint64_t t, f, u;
    share(g, mem->total, mem->free, &t, &f, &u);
    mem->total = t;
    mem->free = f;
    mem->used = u;
    return r;
}

VC_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem) {
    vc_init_nvml();
    if (!vc_real.nvmlDeviceGetMemoryInfo_v2)
        return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t r = vc_real.nvmlDeviceGetMemoryInfo_v2(dev, mem);
    if (r != NVML_SUCCESS || !mem || !(ACTIVE() || FAIL_CLOSED()))
        return r;
    int g = FAIL_CLOSED() ? -1 : nvml_gpu(dev);
    uint64_t t, f, u;
    share(g, mem->total, mem->free, &t, &f, &u);
    /* The driver's reserved memory is outside the container's share. */
    mem->total = t;
    mem->reserved = 0;
    mem->free = f;
    mem->used = u;
    return r;
}

/* ---- NVML: processes and utilisation of the container ----
 * Inside a container the driver's lists name host pids of every tenant of
 * the GPU. While limits apply, the lists are built from the region instead:
 * the container's live processes (pids as the container sees them) with
 * the memory vcuda charged them. Graphics and MPS lists are empty (vcuda
 * does not account them); a GPU not in the limits file shows nothing. */

/* The gpu record of an NVML handle, checking the handle with the driver
 * first so that errors (uninitialised, bad handle) are the driver's. */
static nvmlReturn_t nvml_check(nvmlDevice_t dev, int *g) {
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    if (!vc_real.nvmlDeviceGetUUID)
        return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t r = vc_real.nvmlDeviceGetUUID(dev, uuid, sizeof(uuid));
    if (r != NVML_SUCCESS)
        return r;
    *g = FAIL_CLOSED() ? -1 : nvml_gpu(dev);
    return NVML_SUCCESS;
}

#define VC_LIST_MAX 1024
typedef struct {
    uint32_t pid[VC_LIST_MAX];
    uint64_t used[VC_LIST_MAX];
    int n;
} proc_list;

/* mode: 0 compute (the region's processes), 1 graphics / MPS (none). */
static nvmlReturn_t container_procs(nvmlDevice_t dev, int mode, proc_list *l) {
    int g;
    nvmlReturn_t r = nvml_check(dev, &g);
    if (r != NVML_SUCCESS)
        return r;
    l->n = 0;
    if (g >= 0 && mode == 0) {
        vc_region_maybe_reclaim(); /* the dead are not listed */
        l->n = vc_region_procs(g, l->pid, l->used, VC_LIST_MAX);
        if (l->n > VC_LIST_MAX)
            l->n = VC_LIST_MAX;
    }
    return NVML_SUCCESS;
}

static nvmlReturn_t fill_v1(nvmlDevice_t dev, int mode, unsigned int *count, nvmlProcessInfo_v1_t *infos) {
    static __thread proc_list l;
    nvmlReturn_t r = container_procs(dev, mode, &l);
    if (r != NVML_SUCCESS)
        return r;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (*count < (unsigned)l.n || (l.n > 0 && !infos)) {
        *count = (unsigned)l.n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int i = 0; i < l.n; i++) {
        infos[i].pid = l.pid[i];
        infos[i].usedGpuMemory = l.used[i];
    }
    *count = (unsigned)l.n;
    return NVML_SUCCESS;
}

static nvmlReturn_t fill_v2(nvmlDevice_t dev, int mode, unsigned int *count, nvmlProcessInfo_t *infos) {
    static __thread proc_list l;
    nvmlReturn_t r = container_procs(dev, mode, &l);
    if (r != NVML_SUCCESS)
        return r;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (*count < (unsigned)l.n || (l.n > 0 && !infos)) {
        *count = (unsigned)l.n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int i = 0; i < l.n; i++) {
        infos[i].pid = l.pid[i];
        infos[i].usedGpuMemory = l.used[i];
        infos[i].gpuInstanceId = 0xFFFFFFFFu;
        infos[i].computeInstanceId = 0xFFFFFFFFu;
    }
    *count = (unsigned)l.n;
    return NVML_SUCCESS;
}

#define PROC_HOOK(name, mode, fill, type)                                                          \
    VC_EXPORT nvmlReturn_t name(nvmlDevice_t dev, unsigned int *count, type *infos) {              \
        vc_init_nvml();                                                                            \
        if (!vc_real.name)                                                                         \
            return NVML_ERROR_UNINITIALIZED;                                                       \
        if (!(ACTIVE() || FAIL_CLOSED()))                                                          \
            return vc_real.name(dev, count, infos);                                                \
        return fill(dev, mode, count, infos);                                                      \
    }
PROC_HOOK(nvmlDeviceGetComputeRunningProcesses, 0, fill_v1, nvmlProcessInfo_v1_t)
PROC_HOOK(nvmlDeviceGetComputeRunningProcesses_v2, 0, fill_v2, nvmlProcessInfo_t)
PROC_HOOK(nvmlDeviceGetComputeRunningProcesses_v3, 0, fill_v2, nvmlProcessInfo_t)
PROC_HOOK(nvmlDeviceGetGraphicsRunningProcesses, 1, fill_v1, nvmlProcessInfo_v1_t)
PROC_HOOK(nvmlDeviceGetGraphicsRunningProcesses_v2, 1, fill_v2, nvmlProcessInfo_t)
PROC_HOOK(nvmlDeviceGetGraphicsRunningProcesses_v3, 1, fill_v2, nvmlProcessInfo_t)
PROC_HOOK(nvmlDeviceGetMPSComputeRunningProcesses, 1, fill_v1, nvmlProcessInfo_v1_t)
PROC_HOOK(nvmlDeviceGetMPSComputeRunningProcesses_v2, 1, fill_v2, nvmlProcessInfo_t)
PROC_HOOK(nvmlDeviceGetMPSComputeRunningProcesses_v3, 1, fill_v2, nvmlProcessInfo_t)

VC_EXPORT nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t dev, nvmlProcessDetailList_t *pl) {
    vc_init_nvml();
    if (!vc_real.nvmlDeviceGetRunningProcessDetailList)
        return NVML_ERROR_UNINITIALIZED;
    if (!(ACTIVE() || FAIL_CLOSED()))
        return vc_real.nvmlDeviceGetRunningProcessDetailList(dev, pl);
    static __thread proc_list l;
    if (!pl)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (pl->version != nvmlProcessDetailList_v1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (pl->mode > 2) /* 0 compute, 1 graphics, 2 MPS compute: as the driver, refuse others */
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = container_procs(dev, pl->mode == 0 ? 0 : 1, &l);
    if (r != NVML_SUCCESS)
        return r;
    if (pl->numProcArrayEntries < (unsigned)l.n || (l.n > 0 && !pl->procArray)) {
        pl->numProcArrayEntries = (unsigned)l.n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int i = 0; i < l.n; i++) {
        memset(&pl->procArray[i], 0, sizeof(pl->procArray[i]));
        pl->procArray[i].pid = l.pid[i];
        pl->procArray[i].usedGpuMemory = l.used[i];
        pl->procArray[i].gpuInstanceId = 0xFFFFFFFFu;
        pl->procArray[i].computeInstanceId = 0xFFFFFFFFu;
    }
    pl->numProcArrayEntries = (unsigned)l.n;
    return NVML_SUCCESS;
}

/* Utilisation: for a limited GPU, the container's share of the device time
 * as the limiter charged it (busy_ns) since this process's previous query
 * (never above the device's own figure plus rounding, never above 100);
 * unlimited GPUs report the device's figure (the container cannot be told
 * apart from its co-tenants there), GPUs outside the limits file 0. */
static struct {
    uint64_t at, busy;
} util_prev[VC_MAX_GPUS];
static pthread_mutex_t util_mu = PTHREAD_MUTEX_INITIALIZER;

VC_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t dev, nvmlUtilization_t *u) {
    vc_init_nvml();
    if (!vc_real.nvmlDeviceGetUtilizationRates)
        return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t r = vc_real.nvmlDeviceGetUtilizationRates(dev, u);
    if (r != NVML_SUCCESS || !u || !(ACTIVE() || FAIL_CLOSED()))
        return r;
    int g = FAIL_CLOSED() ? -1 : nvml_gpu(dev);
    if (g < 0) {
        u->gpu = u->memory = 0;
        return r;
    }
    if (vc_g.limits.gpu[g].cores >= 100)
        return r;
    uint64_t now = vc_now_ns(), busy = atomic_load(&vc_region_gpu_rec(g)->busy_ns);
    pthread_mutex_lock(&util_mu);
    uint64_t dt = now - util_prev[g].at, db = busy - util_prev[g].busy;
    int first = util_prev[g].at == 0;
    util_prev[g].at = now;
    util_prev[g].busy = busy;
    pthread_mutex_unlock(&util_mu);
    unsigned pct = first || dt == 0 ? 0 : (unsigned)(db >= dt ? 100 : db * 100 / dt);
    if (pct > u->gpu)
        pct = u->gpu; /* the container cannot be busier than the device */
    u->gpu = pct;
    return r;
}
