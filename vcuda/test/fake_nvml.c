/* fake_nvml.c - a stand-in for libnvidia-ml.so.1, backed by the fake
 * libcuda's devices (same UUIDs, capacities and shared usage counters). */
#include <string.h>

#include "fake.h"

#define EXPORT __attribute__((visibility("default")))

typedef struct nvmlDevice_st {
    int idx;
} fake_nvml_dev;
static fake_nvml_dev devs[FAKE_MAX_DEVS];
static int inited;

EXPORT nvmlReturn_t nvmlInit_v2(void) {
    inited = 1;
    for (int i = 0; i < FAKE_MAX_DEVS; i++)
        devs[i].idx = i;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInit_v2(); }
EXPORT nvmlReturn_t nvmlShutdown(void) {
    inited = 0;
    return NVML_SUCCESS;
}
EXPORT const char *nvmlErrorString(nvmlReturn_t r) { return r == NVML_SUCCESS ? "Success" : "Error"; }
EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n) {
    if (!inited)
        return NVML_ERROR_UNINITIALIZED;
    if (!n)
        return NVML_ERROR_INVALID_ARGUMENT;
    *n = (unsigned)fakeDeviceCount();
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d) {
    if (!inited)
        return NVML_ERROR_UNINITIALIZED;
    if (!d || (int)i >= fakeDeviceCount())
        return NVML_ERROR_INVALID_ARGUMENT;
    *d = &devs[i];
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *buf, unsigned int len) {
    char uuid[64];
    if (!inited)
        return NVML_ERROR_UNINITIALIZED;
    if (!d || !buf || fakeDeviceInfo(d->idx, uuid, NULL, NULL) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(uuid) + 1 > len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(buf, uuid);
    return NVML_SUCCESS;
}
static nvmlReturn_t mem(nvmlDevice_t d, unsigned long long *total, unsigned long long *free,
                        unsigned long long *used) {
    uint64_t cap;
    fake_stats st;
    if (!inited)
        return NVML_ERROR_UNINITIALIZED;
    if (!d || fakeDeviceInfo(d->idx, NULL, &cap, NULL) != 0 || fakeDeviceStats(d->idx, &st) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    *total = cap;
    *used = st.used;
    *free = cap - st.used;
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
