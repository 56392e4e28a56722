/*
 * fake_device_model.h - kernel durations of the fake device (see
 * fake_device_model.c): what fake_cuda.c's timeline asks of the model.
 */
#ifndef VCUDA_FAKE_DEVICE_MODEL_H
#define VCUDA_FAKE_DEVICE_MODEL_H

#include <stdint.h>

#include "../src/cuda_types.h"

#define FDM_MAX_DEVS 16
#define FDM_INTERNAL __attribute__((visibility("hidden")))

/* Device time of one kernel of function func on stream, of `grid` blocks on device d (a wave holds
 * per_wave blocks), expected to start at `start` (on the process's device timeline: real ns
 * under the FIFO scheduler, the process's virtual ns under the timeslice one); `ahead`: ns of
 * the stream's work queued before it; blocks while that exceeds the launch queue. */
FDM_INTERNAL uint64_t fdm_kernel_ns(int d, uint64_t func, uint64_t stream, uint64_t start, uint64_t ahead, uint64_t grid,
                                    uint64_t per_wave, uint64_t wave_ns, uint64_t overhead_ns);
/* Device time of one launch of graph exec e (its kernels back to back). */
FDM_INTERNAL uint64_t fdm_graph_ns(CUgraphExec e, uint64_t ahead, uint64_t blocks, uint64_t per_wave, uint64_t wave_ns,
                                   uint64_t overhead_ns);
/* How much of a stream's work may be queued before a launch blocks
 * (FAKE_CUDA_QUEUE_NS). */
FDM_INTERNAL uint64_t fdm_queue_ns(void);
/* Idle device time when the device turns from one process's work to
 * another's. */
FDM_INTERNAL uint64_t fdm_switch_ns(void);

/* Records [st, en) as device time of this process on d (its kernels, as
 * scheduled at `now`). */
FDM_INTERNAL void fdm_busy(int d, uint64_t st, uint64_t en, uint64_t now);
/* Publishes process pid's device time on d, exact up to `at` (the timeslice
 * scheduler knows it for every process, whichever one resolves it). */
FDM_INTERNAL void fdm_publish_busy(int d, int pid, uint64_t busy, uint64_t at);

#endif
