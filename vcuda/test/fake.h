/*
 * fake.h - test-only API of the fake libcuda.so.1 (not part of CUDA).
 * The fake driver implements the entry points vcuda hooks on plain host
 * bookkeeping: per-device capacity, fake device addresses (never
 * dereferenced), and a modelled device timeline for launches.
 *
 * Configuration (environment, read at first use; fake only):
 *   FAKE_CUDA_DEVICES   number of devices (default 2, max 16)
 *   FAKE_CUDA_MEM       bytes per device, one value or a comma list (16 GiB)
 *   FAKE_CUDA_SMS       SMs per device, one value or a comma list (16)
 *   FAKE_CUDA_UUIDS     comma list of GPU-... UUIDs (default derived from index)
 *   FAKE_CUDA_WAVE_NS   device time of one full wave (SMs blocks) (100000)
 *   FAKE_CUDA_SHM       file holding the device counters, shared by processes
 *   FAKE_CUDA_BLOCK_ALLOC  file to create, then block forever, inside the
 *                          (FAKE_CUDA_BLOCK_AFTER+1)-th device allocation
 *
 * Launch model: a launch of G blocks on a device with S SMs occupies the
 * device for WAVE_NS * G / S ns; launches queue on one timeline per device
 * (shared by all processes when FAKE_CUDA_SHM is set). Events complete when
 * the timeline reaches them.
 */
#ifndef VCUDA_FAKE_H
#define VCUDA_FAKE_H

#include <stdint.h>

#include "../src/cuda_types.h"

#define FAKE_MAX_DEVS 16

typedef struct fake_stats {
    uint64_t used;       /* bytes of device memory held (all processes) */
    uint64_t peak;       /* high-water mark of used */
    uint64_t mapped;     /* bytes mapped through IPC (not device memory) */
    uint64_t busy_total; /* ns of device time scheduled so far */
    uint64_t busy_until; /* CLOCK_MONOTONIC ns when the queue drains */
    uint64_t launches;
} fake_stats;

int fakeDeviceStats(int dev, fake_stats *out);
int fakeDeviceInfo(int dev, char uuid[64], uint64_t *mem, int *sms);
int fakeDeviceCount(void);
CUresult fakeGraphExecCreate(CUgraphExec *exec, unsigned long long blocks);

#endif
