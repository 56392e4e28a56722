/*
 * limiter_workloads.c - the launch loops of limiter_workloads.h.
 * Kernels: one function of 256 threads and 64 registers a thread (4 resident
 * blocks an SM: a wave is 4 x 132 blocks), 20 us a wave and 3 us a launch,
 * unless a workload says otherwise.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_api.h"
#include "limiter_workloads.h"
#include "util.h"

static const char *names[WL_NAMED] = {"uniform", "gridmix", "bimodal", "jitter", "multistream",
                                      "graphs", "decode", "tiny", "multistream-hostjoin"};

const char *workload_name(workload w) { return w < WL_NAMED ? names[w] : "?"; }

int workload_parse(const char *name) {
    for (int i = 0; i < WL_NAMED; i++)
        if (strcmp(name, names[i]) == 0)
            return i;
    return -1;
}

void workload_env(workload w) {
    char buf[32];
    snprintf(buf, sizeof(buf), "%d", WL_SMS);
    setenv("FAKE_CUDA_SMS", buf, 1);
    unsetenv("FAKE_CUDA_VARY");
    unsetenv("FAKE_CUDA_DECODE");
    switch (w) {
    case WL_BIMODAL: setenv("FAKE_CUDA_VARY", "bimodal", 1); break;
    case WL_JITTER: setenv("FAKE_CUDA_VARY", "jitter", 1); break;
    case WL_GRAPHS: setenv("FAKE_CUDA_VARY", "lognormal", 1); break;
    case WL_DECODE: setenv("FAKE_CUDA_DECODE", "3000,4", 1); break;
    default: break;
    }
}

#define F_MAIN ((CUfunction)(uintptr_t)0xa000)
#define F_TINY ((CUfunction)(uintptr_t)0xa100)
static uint64_t next(uint64_t *rng) {
    *rng = *rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return *rng >> 33;
}
static unsigned mix_grid(uint64_t *rng) {
    static const unsigned quarters[5] = {0, 1, 4, 16, 256}; /* of S */
    unsigned k = quarters[next(rng) % 5];
    return k ? k * WL_SMS / 4 : 1;
}
static void launch(CUfunction f, unsigned grid, CUstream s) {
    CHECK_CU(cuLaunchKernel(f, grid, 1, 1, 256, 1, 1, 0, s, NULL, NULL));
}

/* One fork-join round on ns streams, joined on the device as frameworks do
 * (PyTorch's Stream.wait_stream: an event recorded on one stream, waited
 * for by another; the host goes on): the side streams wait for the main
 * stream's last join (fork), one kernel each, the main stream waits for
 * theirs (join); the host synchronises every WL_MS_SYNC_ROUNDS rounds.
 * Host-joined each round instead (multistream-hostjoin), the device idled
 * from every round's end until the host had woken from its synchronize and
 * launched the next: 70-75 us a round on the 2-core VM (the fake's
 * synchronize sleeps, and the default 50 us timer slack makes most of it),
 * a quarter of the wall time: 74-76% alone uncapped, 44-71% beside
 * co-tenants, whose work the device switches to at every round's end
 * (vcuda/README.md, "Benchmark grid"). 32 rounds: about 7 ms of device time
 * between synchronizes (a round averages ~210 us), so that wake-up costs
 * ~1%, and well under the fake's 20 ms launch queue. */
static void fork_join_round(CUstream *s, int ns, CUevent fork, CUevent *join, unsigned long i, uint64_t *rng) {
    for (int k = 1; k < ns; k++)
        CHECK_CU(cuStreamWaitEvent(s[k], fork, 0));
    for (int k = 0; k < ns; k++)
        launch(F_MAIN, mix_grid(rng), s[k]);
    for (int k = 1; k < ns; k++) {
        CHECK_CU(cuEventRecord(join[k], s[k]));
        CHECK_CU(cuStreamWaitEvent(s[0], join[k], 0));
    }
    CHECK_CU(cuEventRecord(fork, s[0]));
    if (i % WL_MS_SYNC_ROUNDS == WL_MS_SYNC_ROUNDS - 1)
        CHECK_CU(cuStreamSynchronize(s[0]));
}

const char *workload_container_dir(int i) {
    char name[32];
    snprintf(name, sizeof(name), "c%d", i);
    return tpath(name);
}

int workload_container(int i, workload w, int cap, uint64_t deadline, uint64_t seed) {
    char text[1024], path[4200];
    snprintf(text, sizeof(text), "tessera-vcuda-limits 1\ncontainer c%d\nregion %s/c%d-region\ngpu %s %llu %d\n", i,
             tmpdir(), i, fake_uuid(0), 1ull << 30, cap);
    snprintf(path, sizeof(path), "%s/limits", workload_container_dir(i));
    write_file(path, text);
    setenv("TESSERA_VCUDA_LIMITS", path, 1);
    ctx_on(0);
    workload_run(w, deadline, 0, &seed);
    return 0;
}

void workload_run(workload w, uint64_t deadline, unsigned long launches, uint64_t *rng) {
    static fake_func main_f = {64, 0, 20000, 3000}, tiny_f = {64, 0, 4000, 0};
    CHECK(fakeFunctionSet(F_MAIN, &main_f) == 0 && fakeFunctionSet(F_TINY, &tiny_f) == 0, "fakeFunctionSet");
    CUstream s[3];
    CUevent fork = NULL, join[3] = {NULL};
    int ns = w == WL_MULTISTREAM || w == WL_MULTISTREAM_HOSTJOIN ? 3 : 1;
    for (int i = 0; i < ns; i++)
        CHECK_CU(cuStreamCreate(&s[i], 0));
    if (w == WL_MULTISTREAM) {
        CHECK_CU(cuEventCreate(&fork, 0));
        for (int i = 1; i < ns; i++)
            CHECK_CU(cuEventCreate(&join[i], 0));
    }
    CUgraphExec g = NULL;
    if (w == WL_GRAPHS) {
        CHECK_CU(fakeGraphExecCreate(&g, 8ull * WL_SMS)); /* 2 waves a kernel (graphs: 4 blocks an SM) */
        CHECK(fakeGraphSetKernels(g, 16) == 0, "fakeGraphSetKernels");
    }
    for (unsigned long i = 0; now_ns() < deadline && (!launches || i < launches); i++) {
        switch (w) {
        case WL_UNIFORM: launch(F_MAIN, 16 * WL_SMS, s[0]); break;
        case WL_GRIDMIX:
        case WL_BIMODAL:
        case WL_JITTER: launch(F_MAIN, mix_grid(rng), s[0]); break;
        case WL_MULTISTREAM: fork_join_round(s, ns, fork, join, i, rng); break;
        case WL_MULTISTREAM_HOSTJOIN:
            for (int k = 0; k < ns; k++)
                launch(F_MAIN, mix_grid(rng), s[k]);
            for (int k = 0; k < ns; k++)
                CHECK_CU(cuStreamSynchronize(s[k]));
            break;
        case WL_GRAPHS: CHECK_CU(cuGraphLaunch(g, s[0])); break;
        case WL_DECODE:
            launch(F_MAIN, 4 * WL_SMS, s[0]);
            if (i % 32 == 31) { /* the host picks the next token */
                struct timespec ts = {0, 100000};
                nanosleep(&ts, NULL);
            }
            break;
        case WL_TINY: launch(F_TINY, 4 * WL_SMS, s[0]); break;
        default: CHECK(0, "workload %d", (int)w);
        }
    }
}
