/*
 * limiter_workloads.h - launch loops the compute limiter is measured on: the
 * accuracy cases (tests_launch.c) and the benchmark grid (vcuda_grid.c) run
 * the same ones on the fake device (fake_device_model.c decides how long
 * their kernels take).
 */
#ifndef VCUDA_LIMITER_WORKLOADS_H
#define VCUDA_LIMITER_WORKLOADS_H

#include <stdint.h>

typedef enum {
    WL_UNIFORM,     /* one grid of 4 waves, always the same */
    WL_GRIDMIX,     /* grids of 1, S/4, S, 4S, 64S blocks at random */
    WL_BIMODAL,     /* the grid mix, each launch x0.2 or x1.8 */
    WL_JITTER,      /* the grid mix, each launch x0.8..x1.2 */
    WL_MULTISTREAM, /* the grid mix on 3 streams in fork-join rounds, joined on the device */
    WL_GRAPHS,      /* graphs of 16 kernels of 2 waves, lognormal each */
    WL_DECODE,      /* one-wave kernels growing x1..x4 over 3000 launches, host gaps */
    WL_TINY,        /* launch-heavy: 4 us kernels back to back */
    WL_COUNT,       /* the grid's workloads are those above */
    /* by name only, outside the grid: */
    WL_MULTISTREAM_HOSTJOIN = WL_COUNT, /* multistream, the host synchronising every round */
    WL_NAMED
} workload;

#define WL_SMS 132

const char *workload_name(workload w);
/* -1 if name is no workload */
int workload_parse(const char *name);
/* Sets the fake device's environment for w: call before the first CUDA call
 * of the process. */
void workload_env(workload w);
/* Launches w's kernels on the current context until deadline (CLOCK_MONOTONIC
 * ns) or, if launches is not 0, that many rounds (a round: one launch, one
 * per stream for multistream); rng: the loop's random state. */
/* multistream's host synchronises every this many rounds (a training step's
 * loss.item()); between, its streams fork and join on the device */
#define WL_MS_SYNC_ROUNDS 32
void workload_run(workload w, uint64_t deadline, unsigned long launches, uint64_t *rng);

/* Container i of a mix (a spawned child): its own vcuda directory
 * tmpdir()/c<i> (made by the caller: workload_container_dir), its limits
 * file there at cap percent of fake device 0 (region tmpdir()/c<i>-region),
 * the node agent's measured file under it; runs w until deadline. */
const char *workload_container_dir(int i);
int workload_container(int i, workload w, int cap, uint64_t deadline, uint64_t seed);

#endif
