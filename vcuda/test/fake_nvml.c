/* fake_nvml.c - a stand-in for libnvidia-ml.so.1, backed by the fake
 * libcuda's devices (same UUIDs, names, capacities, shared usage counters
 * and per-process accounting) in NVML's view (fake.h, fakeNvml*): the
 * physical GPUs, a GPU in MIG mode whole, where CUDA sees its instance. Like the real library: init is reference
 * counted, every call before it is NVML_ERROR_UNINITIALIZED, a missing
 * control device is NVML_ERROR_DRIVER_NOT_LOADED, and list calls answer
 * NVML_ERROR_INSUFFICIENT_SIZE with the count needed. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "fake.h"

#define EXPORT __attribute__((visibility("default")))

typedef struct nvmlDevice_st {
    int idx;
} fake_nvml_dev;
static fake_nvml_dev devs[2 * FAKE_MAX_DEVS]; /* the GPUs, then MIG device handles */
static int inited; /* reference count */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

EXPORT nvmlReturn_t nvmlInit_v2(void) {
    if (!fakeDriverLoaded())
        return NVML_ERROR_DRIVER_NOT_LOADED;
    pthread_mutex_lock(&mu);
    inited++;
    for (int i = 0; i < 2 * FAKE_MAX_DEVS; i++)
        devs[i].idx = i;
    pthread_mutex_unlock(&mu);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInit_v2(); }
EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return nvmlInit_v2();
}
EXPORT nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&mu);
    nvmlReturn_t r = inited > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (inited > 0)
        inited--;
    pthread_mutex_unlock(&mu);
    return r;
}
EXPORT const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument Version Mismatch";
    default: return "Unknown Error";
    }
}
#define NEED_INIT()                                                                                \
    do {                                                                                           \
        if (!__atomic_load_n(&inited, __ATOMIC_ACQUIRE))                                           \
            return NVML_ERROR_UNINITIALIZED;                                                       \
    } while (0)
#define NEED_DEV(d)                                                                                \
    do {                                                                                           \
        NEED_INIT();                                                                               \
        if (!(d) || (d) < devs || (d) >= devs + 2 * FAKE_MAX_DEVS || (d)->idx >= fakeNvmlHandleCount()) \
            return NVML_ERROR_INVALID_ARGUMENT;                                                    \
    } while (0)

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *buf, unsigned int len) {
    NEED_INIT();
    if (!buf)
        return NVML_ERROR_INVALID_ARGUMENT;
    const char *v = fakeDriverVersion(NULL);
    if (strlen(v) + 1 > len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(buf, v);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) {
    NEED_INIT();
    if (!v)
        return NVML_ERROR_INVALID_ARGUMENT;
    fakeDriverVersion(v);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { return nvmlSystemGetCudaDriverVersion(v); }

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n) {
    NEED_INIT();
    if (!n)
        return NVML_ERROR_INVALID_ARGUMENT;
    *n = (unsigned)fakeNvmlDeviceCount();
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *n) { return nvmlDeviceGetCount_v2(n); }
EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d) {
    NEED_INIT();
    if (!d || (int)i >= fakeNvmlDeviceCount())
        return NVML_ERROR_INVALID_ARGUMENT;
    *d = &devs[i];
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int i, nvmlDevice_t *d) {
    return nvmlDeviceGetHandleByIndex_v2(i, d);
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *d) {
    NEED_INIT();
    if (!uuid || !d)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < fakeNvmlHandleCount(); i++) { /* a MIG UUID finds its MIG device handle */
        fake_desc x;
        if (fakeNvmlDeviceDesc(i, &x, NULL) == 0 && strcmp(x.uuid, uuid) == 0) {
            *d = &devs[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}
EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned int *i) {
    NEED_DEV(d);
    if (!i || d->idx >= fakeNvmlDeviceCount()) /* a MIG device has no index */
        return NVML_ERROR_INVALID_ARGUMENT;
    *i = (unsigned)d->idx;
    return NVML_SUCCESS;
}
static nvmlReturn_t copy_str(const char *s, char *buf, unsigned int len) {
    if (!buf)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(s) + 1 > len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(buf, s);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *buf, unsigned int len) {
    fake_desc x;
    NEED_DEV(d);
    if (fakeNvmlDeviceDesc(d->idx, &x, NULL) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    return copy_str(x.uuid, buf, len);
}
EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *buf, unsigned int len) {
    fake_desc x;
    NEED_DEV(d);
    if (fakeNvmlDeviceDesc(d->idx, &x, NULL) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    return copy_str(x.name, buf, len);
}
EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t d, unsigned int *minor) {
    fake_desc x;
    NEED_DEV(d);
    if (!minor || fakeNvmlDeviceDesc(d->idx, &x, NULL) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    *minor = (unsigned)x.minor;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t d, int *major, int *minor) {
    fake_desc x;
    NEED_DEV(d);
    if (!major || !minor || fakeNvmlDeviceDesc(d->idx, &x, NULL) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    *major = x.cc_major;
    *minor = x.cc_minor;
    return NVML_SUCCESS;
}
static nvmlReturn_t mem(nvmlDevice_t d, unsigned long long *total, unsigned long long *free,
                        unsigned long long *used) {
    fake_desc x;
    fake_stats st;
    NEED_DEV(d);
    if (fakeNvmlDeviceDesc(d->idx, &x, NULL) != 0 || fakeNvmlDeviceStats(d->idx, &st) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    *total = x.mem;
    *used = st.used;
    *free = x.mem - st.used;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    if (!m)
        return NVML_ERROR_INVALID_ARGUMENT;
    return mem(d, &m->total, &m->free, &m->used);
}
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
    if (!m)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (m->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    m->reserved = 1 << 20; /* the real driver reserves some; vcuda must hide it */
    return mem(d, &m->total, &m->free, &m->used);
}

/* ---- processes and utilisation ---- */

/* The driver's view: every live process holding memory on the device. In
 * node-file mode (the simulated node) that is every process's record in the
 * simulated driver's state directory, named by host pid, and so empty in a
 * container's own PID namespace, where no host pid can be known (fake_cuda.c,
 * node_processes); a real driver's list there holds only pids of other
 * namespaces too, so vcuda's "NVML does not list me" path runs. */
static nvmlReturn_t procs(nvmlDevice_t d, fake_proc *out, int *n) {
    NEED_DEV(d);
    *n = fakeNvmlDeviceProcesses(d->idx, out, FAKE_MAX_PROCS);
    if (*n > FAKE_MAX_PROCS)
        *n = FAKE_MAX_PROCS;
    return NVML_SUCCESS;
}
/* procs for a caller's array of *count entries, as NVML sizes it: too small (or none while there are
 * processes) answers INSUFFICIENT_SIZE with the count needed. */
static nvmlReturn_t procs_fit(nvmlDevice_t d, fake_proc *out, int *n, unsigned int *count, int have_array) {
    nvmlReturn_t r = procs(d, out, n);
    if (r != NVML_SUCCESS)
        return r;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (*count < (unsigned)*n || (*n > 0 && !have_array)) {
        *count = (unsigned)*n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t d, unsigned int *count,
                                                         nvmlProcessInfo_v1_t *infos) {
    fake_proc p[FAKE_MAX_PROCS];
    int n;
    nvmlReturn_t r = procs_fit(d, p, &n, count, infos != NULL);
    if (r != NVML_SUCCESS)
        return r;
    for (int i = 0; i < n; i++) {
        infos[i].pid = (unsigned)p[i].pid;
        infos[i].usedGpuMemory = p[i].used;
    }
    *count = (unsigned)n;
    return NVML_SUCCESS;
}
static nvmlReturn_t procs_v2(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos) {
    fake_proc p[FAKE_MAX_PROCS];
    int n;
    nvmlReturn_t r = procs_fit(d, p, &n, count, infos != NULL);
    if (r != NVML_SUCCESS)
        return r;
    for (int i = 0; i < n; i++) {
        infos[i].pid = (unsigned)p[i].pid;
        infos[i].usedGpuMemory = p[i].used;
        infos[i].gpuInstanceId = 0xFFFFFFFFu;
        infos[i].computeInstanceId = 0xFFFFFFFFu;
    }
    *count = (unsigned)n;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *count,
                                                            nvmlProcessInfo_t *infos) {
    return procs_v2(d, count, infos);
}
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count,
                                                            nvmlProcessInfo_t *infos) {
    return procs_v2(d, count, infos);
}
/* No graphics or MPS clients on the fake. */
#define EMPTY_LIST(name, type)                                                                     \
    EXPORT nvmlReturn_t name(nvmlDevice_t d, unsigned int *count, type *infos) {                   \
        (void)infos;                                                                               \
        NEED_DEV(d);                                                                               \
        if (!count)                                                                                \
            return NVML_ERROR_INVALID_ARGUMENT;                                                    \
        *count = 0;                                                                                \
        return NVML_SUCCESS;                                                                       \
    }
EMPTY_LIST(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t)
EMPTY_LIST(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_t)
EMPTY_LIST(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_t)
EMPTY_LIST(nvmlDeviceGetMPSComputeRunningProcesses, nvmlProcessInfo_v1_t)
EMPTY_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlProcessInfo_t)
EMPTY_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_t)

EXPORT nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t d, nvmlProcessDetailList_t *l) {
    fake_proc p[FAKE_MAX_PROCS];
    int n;
    nvmlReturn_t r = procs(d, p, &n);
    if (r != NVML_SUCCESS)
        return r;
    if (!l)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (l->version != nvmlProcessDetailList_v1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (l->mode > 2) /* 0 compute, 1 graphics, 2 MPS compute */
        return NVML_ERROR_INVALID_ARGUMENT;
    if (l->mode != 0) { /* graphics and MPS: none on the fake */
        l->numProcArrayEntries = 0;
        return NVML_SUCCESS;
    }
    if (l->numProcArrayEntries < (unsigned)n || (n > 0 && !l->procArray)) {
        l->numProcArrayEntries = (unsigned)n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int i = 0; i < n; i++) {
        memset(&l->procArray[i], 0, sizeof(l->procArray[i]));
        l->procArray[i].pid = (unsigned)p[i].pid;
        l->procArray[i].usedGpuMemory = p[i].used;
        l->procArray[i].gpuInstanceId = 0xFFFFFFFFu;
        l->procArray[i].computeInstanceId = 0xFFFFFFFFu;
    }
    l->numProcArrayEntries = (unsigned)n;
    return NVML_SUCCESS;
}

/* Utilisation: the share of wall time the device's queue was busy since the
 * previous call from this process (the first call: since the first launch
 * it saw, or 0). */
static struct {
    uint64_t at, busy;
} util_last[2 * FAKE_MAX_DEVS];
EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
    fake_stats st;
    fake_desc x;
    int mode = FAKE_NVML_GPU;
    NEED_DEV(d);
    if (!u || fakeNvmlDeviceStats(d->idx, &st) != 0 || fakeNvmlDeviceDesc(d->idx, &x, &mode) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (mode != FAKE_NVML_GPU) /* as NVML: no utilisation rates for a GPU in MIG mode or a MIG device */
        return NVML_ERROR_NOT_SUPPORTED;
    uint64_t now = st.at, busy = st.busy; /* the union of kernel intervals so far */
    pthread_mutex_lock(&mu);
    uint64_t dt = now - util_last[d->idx].at, db = busy - util_last[d->idx].busy;
    int first = util_last[d->idx].at == 0;
    util_last[d->idx].at = now;
    util_last[d->idx].busy = busy;
    pthread_mutex_unlock(&mu);
    unsigned pct = first || dt == 0 ? 0 : (unsigned)(db >= dt ? 100 : db * 100 / dt);
    u->gpu = pct;
    u->memory = pct / 2;
    return NVML_SUCCESS;
}
