/*
 * tests_limiter_device.c - the compute limiter measured in device time on
 * the unkind fake (fake_device_model.c): what the limiter charges against
 * what the device really ran. Both sides count the same launches, so a
 * loaded machine that runs the launcher late changes neither: no bound here
 * depends on wall time, and none is relaxed for a loaded machine.
 *
 * A container is held to its share exactly when its charges equal its
 * device time (the admission side, tat against the clock, is checked in
 * wall time by tests_launch.c). So:
 *   limiter_prices_each_launch: each launch's charge (what it pushes the
 *     virtual clock, tat, times the share) against its device time, for
 *     grids of 1 to 12 waves with a fixed per-launch prologue. Catches a
 *     wrong share rate, waves counted without the SMs, one per-wave figure
 *     for every wave count (no buckets), the old per-block model.
 *   limiter_unbiased_*: kernels whose time varies per launch (lognormal,
 *     +-20%, a growing decode loop, x0.2/x1.8 block by block): the
 *     container's charge against its device time. Catches an estimator
 *     that believes short samples faster than long ones, and a limiter that
 *     learns nothing.
 *   limiter_loop_follows_growing_kernel: a kernel that keeps growing, which
 *     every mean of past samples lags: catches the closed loop held at 1.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "cuda_api.h"
#include "limiter_workloads.h"
#include "util.h"

static vc_region_gpu *gpu0(void) { return (vc_region_gpu *)((char *)region_map() + VC_REGION_GPU_OFFSET); }

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* 256 threads, 64 registers a thread: 4 blocks an SM, a wave is 4 x SMs
 * blocks (132 SMs). */
#define PRICE_SMS 132
#define PRICE_WAVE (4u * PRICE_SMS)
#define PRICE_N 1500
#define PRICE_PERCENT 50

typedef struct {
    CUfunction f;
    unsigned grid;
    double dev; /* its device time, on average */
} price_launch;
typedef price_launch (*price_next)(uint64_t *rng);

/* Launches next()'s choices at PRICE_PERCENT: 3000 to learn, then PRICE_N
 * whose charges are compared with their device time. Returns the median
 * signed and absolute relative error of the launches of function `only`
 * (NULL: all): mean (of the middle 80%) and median absolute. */
static void prices(const fake_func *cfg, CUfunction f2, const fake_func *cfg2, price_next next, CUfunction only,
                   double *median, double *mad) {
    char buf[32];
    snprintf(buf, sizeof(buf), "%d", PRICE_SMS);
    setenv("FAKE_CUDA_SMS", buf, 1);
    gpu_line g[1] = {{0, 1ull << 30, PRICE_PERCENT}};
    setup_limits(g, 1);
    ctx_on(0);
    uint64_t rng = 99;
    price_launch l = next(&rng);
    CHECK(fakeFunctionSet(l.f, cfg) == 0, "fakeFunctionSet");
    if (f2)
        CHECK(fakeFunctionSet(f2, cfg2) == 0, "fakeFunctionSet");
    CUstream s;
    CHECK_CU(cuStreamCreate(&s, 0));
    static double err[PRICE_N], abs_err[PRICE_N];
    int n = 0;
    for (int i = 0; i < 3000 + 2 * PRICE_N && n < PRICE_N; i++) {
        l = next(&rng);
        uint64_t t0 = atomic_load(&gpu0()->tat);
        CHECK_CU(cuLaunchKernel(l.f, l.grid, 1, 1, 256, 1, 1, 0, s, NULL, NULL));
        uint64_t t1 = atomic_load(&gpu0()->tat);
        if (i < 3000 || (only && l.f != only))
            continue;
        double charged = (double)(t1 - t0) * PRICE_PERCENT / 100.0;
        err[n++] = charged / l.dev - 1;
    }
    CHECK(n == PRICE_N, "only %d launches measured", n);
    qsort(err, PRICE_N, sizeof(err[0]), cmp_double);
    for (int i = 0; i < PRICE_N; i++)
        abs_err[i] = err[i] < 0 ? -err[i] : err[i];
    qsort(abs_err, PRICE_N, sizeof(abs_err[0]), cmp_double);
    /* the mean of the middle 80%: the launches that harvested a sample also
     * carry its settlement (up or down), which is not their own price */
    double sum = 0;
    for (int i = PRICE_N / 10; i < PRICE_N * 9 / 10; i++)
        sum += err[i];
    *median = sum / (PRICE_N * 8 / 10);
    *mad = abs_err[PRICE_N / 2];
    fprintf(stderr, "per-launch charge vs device time: mean error %+.1f%%, median |error| %.1f%%, 10th..90th %+.1f%%..%+.1f%%\n",
            *median * 100, *mad * 100, err[PRICE_N / 10] * 100, err[PRICE_N * 9 / 10] * 100);
}

/* 1 to 12 waves, not whole (the last wave partial, a whole wave on the
 * device): a 5 us prologue and 20 us a wave. */
#define PW_F ((CUfunction)(uintptr_t)0xd000)
static price_launch partial_waves(uint64_t *rng) {
    *rng = *rng * 6364136223846793005ULL + 1442695040888963407ULL;
    unsigned grid = PRICE_WAVE + (unsigned)((*rng >> 33) % (11u * PRICE_WAVE));
    return (price_launch){PW_F, grid, 5000.0 + (double)((grid + PRICE_WAVE - 1) / PRICE_WAVE) * 20000.0};
}
TEST(limiter_prices_partial_waves) {
    fake_func f = {64, 0, 20000, 5000};
    double median, mad;
    prices(&f, NULL, NULL, partial_waves, NULL, &median, &mad);
    CHECK(median > -0.03 && median < 0.03, "launches charged %+.1f%% of their device time (mean): pricing", median * 100);
    CHECK(mad < 0.025, "a launch's charge is %.1f%% off its device time (median): pricing", mad * 100);
}

/* 1, 2, 4 and 8 waves (grids of 1, 1.5, 2, 3.5, 4, 7.5, 8 waves of blocks),
 * after a 20 us prologue: a wave costs 40, 30, 25 or 22.5 us depending on
 * how many there are, and only per-bucket estimates price them all. */
#define WB_F ((CUfunction)(uintptr_t)0xd100)
static price_launch wave_buckets(uint64_t *rng) {
    static const double waves[7] = {1, 1.5, 2, 3.5, 4, 7.5, 8};
    *rng = *rng * 6364136223846793005ULL + 1442695040888963407ULL;
    double w = waves[(*rng >> 33) % 7];
    unsigned grid = (unsigned)(w * PRICE_WAVE);
    return (price_launch){WB_F, grid, 20000.0 + (double)((grid + PRICE_WAVE - 1) / PRICE_WAVE) * 20000.0};
}
TEST(limiter_prices_each_wave_bucket) {
    fake_func f = {64, 0, 20000, 20000};
    double median, mad;
    prices(&f, NULL, NULL, wave_buckets, NULL, &median, &mad);
    CHECK(median > -0.03 && median < 0.03, "launches charged %+.1f%% of their device time (mean): pricing", median * 100);
    CHECK(mad < 0.025, "a launch's charge is %.1f%% off its device time (median): pricing", mad * 100);
}

/* Two kernels of 2 waves (45 us) in turn: one steady, one lognormal (sigma
 * 0.5, mean 45 us). An estimator that believes the short samples faster
 * prices the varying one low, and the closed loop, which only sees the
 * total, makes up for it by charging the steady one high: both must be
 * priced at their own mean. */
#define VS_STEADY ((CUfunction)(uintptr_t)0xd200)
#define VS_VARY ((CUfunction)(uintptr_t)0xd300)
static price_launch vary_steady(uint64_t *rng) {
    (void)rng;
    static unsigned i;
    return (price_launch){i++ % 2 ? VS_VARY : VS_STEADY, 2 * PRICE_WAVE, 45000.0};
}
static void varying_beside_steady(CUfunction which, double bound) {
    fake_func f = {64, 0, 20000, 5000};
    CHECK(fakeFunctionVary(VS_VARY, "lognormal") == 0, "fakeFunctionVary");
    double median, mad;
    prices(&f, VS_VARY, &f, vary_steady, which, &median, &mad);
    CHECK(median > -bound && median < bound, "%s kernel charged %+.1f%% of its mean device time: estimator",
          which == VS_VARY ? "the varying" : "the steady", median * 100);
}
TEST(limiter_prices_steady_beside_varying) { varying_beside_steady(VS_STEADY, 0.05); }
TEST(limiter_prices_varying_beside_steady) { varying_beside_steady(VS_VARY, 0.10); }

/* The limiter adds a thread's charges to the region's busy time once every
 * 64 launches: 64 launches of a 1-block kernel (a couple of microseconds
 * each) flush what the workload was charged and settle its last sample. */
static void flush_charges(void) {
    CHECK_CU(cuCtxSynchronize());
    for (int i = 0; i < 64; i++)
        CHECK_CU(cuLaunchKernel((CUfunction)(uintptr_t)0xa000, 1, 1, 1, 256, 1, 1, 0, NULL, NULL, NULL));
    CHECK_CU(cuCtxSynchronize());
}

/* A workload (limiter_workloads.c) at 30%, each launch varying: what the
 * container was charged over what it ran, over a number of launches (not a
 * time: a launcher kept off the CPU launches, and samples, less). */
static void unbiased(workload w, unsigned long warm, unsigned long rounds) {
    workload_env(w);
    gpu_line g[1] = {{0, 1ull << 30, 30}};
    setup_limits(g, 1);
    ctx_on(0);
    uint64_t rng = 5;
    workload_run(w, UINT64_MAX, warm, &rng);
    flush_charges();
    uint64_t c0 = atomic_load(&gpu0()->busy_ns);
    fake_stats s0, s1;
    fakeDeviceStats(0, &s0);
    workload_run(w, UINT64_MAX, rounds, &rng);
    flush_charges();
    fakeDeviceStats(0, &s1);
    uint64_t c1 = atomic_load(&gpu0()->busy_ns);
    double ran = (double)(s1.busy_total - s0.busy_total), charged = (double)(c1 - c0);
    fprintf(stderr, "%s: charged %.0f ms for %.0f ms of device time (%+.1f%%), %llu launches\n", workload_name(w),
            charged / 1e6, ran / 1e6, (charged / ran - 1) * 100, (unsigned long long)(s1.launches - s0.launches));
    CHECK(charged >= ran * 0.9 && charged <= ran * 1.1,
          "charged %.0f ms for %.0f ms the device ran (%+.1f%%): the estimate is biased", charged / 1e6, ran / 1e6,
          (charged / ran - 1) * 100);
}
TEST(limiter_unbiased_jitter) { unbiased(WL_JITTER, 2000, 8000); }
TEST(limiter_unbiased_lognormal_graphs) { unbiased(WL_GRAPHS, 100, 400); }
TEST(limiter_unbiased_decode) { unbiased(WL_DECODE, 3000, 9000); }

/* A one-wave kernel whose time grows steadily, x1 to x8 over 1300 launches
 * (a decode step over a growing context): an estimate is a mean of past
 * samples, so it lags the kernel by about its window (EST_GAIN samples) and
 * the charge runs ~10% low for as long as the growth lasts. Only the closed
 * loop, which compares what samples measured with what the model predicted
 * for them, sees that lag and corrects every launch for it. Charged against
 * device time over 700 launches of the ramp (after 300 to learn), the
 * median of seven processes one after another (each learns from nothing:
 * one ramp's error varies by several percent with which launches are
 * sampled, and a process whose launcher lacked CPU strays by 10-25%).
 * Measured on the 2-core VM (load 4): medians +2.7..+3.1% with the loop
 * (four runs), -10.2..-10.3% with it held at 1 (the noloop mutant, three). */
#define GROW_F ((CUfunction)(uintptr_t)0xd400)
#define GROW_PROCS 7
static int grow_child(int i, void *arg) {
    (void)i;
    chan *c = arg;
    ctx_on(0);
    fake_func f = {64, 0, 20000, 3000};
    CHECK(fakeFunctionSet(GROW_F, &f) == 0, "fakeFunctionSet");
    CUstream s;
    CHECK_CU(cuStreamCreate(&s, 0));
    for (int k = 0; k < 300; k++)
        CHECK_CU(cuLaunchKernel(GROW_F, 4 * 132, 1, 1, 256, 1, 1, 0, s, NULL, NULL));
    CHECK_CU(cuCtxSynchronize());
    fake_stats s0, s1;
    CHECK(fakeDeviceStats(0, &s0) == 0, "fakeDeviceStats");
    uint64_t c0 = atomic_load(&gpu0()->busy_ns);
    for (int k = 0; k < 700; k++)
        CHECK_CU(cuLaunchKernel(GROW_F, 4 * 132, 1, 1, 256, 1, 1, 0, s, NULL, NULL));
    flush_charges();
    CHECK(fakeDeviceStats(0, &s1) == 0, "fakeDeviceStats");
    uint64_t c1 = atomic_load(&gpu0()->busy_ns);
    fprintf(stderr, "growing kernel, one process: charged %.1f ms for %.1f ms of device time (%+.1f%%)\n",
            (double)(c1 - c0) / 1e6, (double)(s1.busy_total - s0.busy_total) / 1e6,
            ((double)(c1 - c0) / (double)(s1.busy_total - s0.busy_total) - 1) * 100);
    chan_send_up(c, c1 - c0);
    chan_send_up(c, s1.busy_total - s0.busy_total);
    return 0;
}
TEST(limiter_loop_follows_growing_kernel) {
    setenv("FAKE_CUDA_SMS", "132", 1);
    setenv("FAKE_CUDA_DECODE", "1300,8", 1);
    gpu_line g[1] = {{0, 1ull << 30, 30}};
    setup_limits(g, 1);
    double err[GROW_PROCS];
    for (int i = 0; i < GROW_PROCS; i++) {
        chan c;
        chan_init(&c);
        pid_t p = spawn(grow_child, i, &c);
        double charged = (double)chan_recv_up(&c), ran = (double)chan_recv_up(&c);
        CHECK(wait_child(p) == 0, "child %d failed", i);
        err[i] = charged / ran - 1;
    }
    qsort(err, GROW_PROCS, sizeof(err[0]), cmp_double);
    double median = err[GROW_PROCS / 2];
    fprintf(stderr, "growing kernel: charged %+.1f%% of its device time (median of %d processes)\n", median * 100,
            GROW_PROCS);
    /* under is the regression (a growing kernel gets more than its share);
     * the loop may overshoot a ramp a little, its window remembering the
     * ramp's start, where the lag was larger for the kernel's size */
    CHECK(median > -0.05 && median < 0.1, "charged %+.1f%% of its device time (median): the loop does not follow",
          median * 100);
}
/* The grid mix, each launch x0.2 or x1.8: 90% of its device time is in
 * 16-wave grids whose samples differ 9x. Not only the total but every block
 * of 3000 launches (about 0.7 s at 30%) must be charged what
 * it ran: a limiter with one sample in flight and 1 in 8 grids sampled
 * whatever their size was off by 20-40% for whole seconds (the grid's
 * bimodal cells). */
TEST(limiter_unbiased_bimodal) {
    workload_env(WL_BIMODAL);
    gpu_line g[1] = {{0, 1ull << 30, 30}};
    setup_limits(g, 1);
    ctx_on(0);
    uint64_t rng = 5;
    workload_run(WL_BIMODAL, UINT64_MAX, 2000, &rng);
    double worst = 0;
    for (int b = 0; b < 4; b++) {
        flush_charges();
        uint64_t c0 = atomic_load(&gpu0()->busy_ns);
        fake_stats s0, s1;
        CHECK(fakeDeviceStats(0, &s0) == 0, "fakeDeviceStats");
        workload_run(WL_BIMODAL, UINT64_MAX, 3000, &rng);
        flush_charges();
        CHECK(fakeDeviceStats(0, &s1) == 0, "fakeDeviceStats");
        double ran = (double)(s1.busy_total - s0.busy_total), charged = (double)(atomic_load(&gpu0()->busy_ns) - c0);
        double err = charged / ran - 1;
        fprintf(stderr, "bimodal block %d: charged %.0f ms for %.0f ms of device time (%+.1f%%)\n", b, charged / 1e6,
                ran / 1e6, err * 100);
        if (err * err > worst * worst)
            worst = err;
    }
    CHECK(worst > -0.1 && worst < 0.1, "a block of launches charged %+.1f%% of its device time: the estimate is biased",
          worst * 100);
}

/* A sampling gate that gave up: the launcher is held 20 ms after it
 * records a sampled launch's start event (VCUDA_TEST_DELAY "sampled", at
 * every sampled launch), so the gate's host function stops waiting after
 * its 5 ms, the start event completes then, and the kernel (one 2 ms wave)
 * is submitted ~15 ms later: such a sample measures ~17 ms. Settled in full,
 * that charged the container 5-8x what it ran (the expiredfull mutant; on
 * the grid, one 390 ms sample took a 30% container to 3.7%); settled less
 * the host time from the give-up to the launch call, and never below the
 * admission price, it is charged what it ran (+3.5..+7.7% in three runs at
 * load 15: a launcher also descheduled between its launch and the end
 * event still times the host). Device time against charge: no wall-time
 * bound. */
TEST_LIB(limiter_settles_an_expired_gate_at_its_kernel, "testhooks") {
    setenv("FAKE_CUDA_SMS", "16", 1);
    gpu_line g[1] = {{0, 1ull << 30, 50}};
    setup_limits(g, 1);
    ctx_on(0);
    fake_func f = {64, 0, 2000000, 0}; /* 4 blocks an SM: a wave is 64 blocks, 2 ms */
    CHECK(fakeFunctionSet((CUfunction)(uintptr_t)0xd500, &f) == 0, "fakeFunctionSet");
    CUstream s;
    CHECK_CU(cuStreamCreate(&s, 0));
    fake_stats s0, s1;
    CHECK(fakeDeviceStats(0, &s0) == 0, "fakeDeviceStats");
    uint64_t c0 = atomic_load(&gpu0()->busy_ns);
    setenv("VCUDA_TEST_DELAY", "sampled", 1);
    setenv("VCUDA_TEST_DELAY_MS", "20", 1);
    for (int i = 0; i < 200; i++)
        CHECK_CU(cuLaunchKernel((CUfunction)(uintptr_t)0xd500, 64, 1, 1, 256, 1, 1, 0, s, NULL, NULL));
    unsetenv("VCUDA_TEST_DELAY"); /* the flush's launches run undelayed */
    flush_charges();
    CHECK(fakeDeviceStats(0, &s1) == 0, "fakeDeviceStats");
    double ran = (double)(s1.busy_total - s0.busy_total), charged = (double)(atomic_load(&gpu0()->busy_ns) - c0);
    fprintf(stderr, "expired gates: charged %.1f ms for %.1f ms of device time (%+.1f%%)\n", charged / 1e6, ran / 1e6,
            (charged / ran - 1) * 100);
    CHECK(charged <= ran * 1.5, "charged %.1f ms for %.1f ms the device ran: an expired gate's sample settled in full",
          charged / 1e6, ran / 1e6);
    CHECK(charged >= ran * 0.8, "charged %.1f ms for %.1f ms the device ran: more than the host time taken off",
          charged / 1e6, ran / 1e6);
    /* The delayed launcher ran under its share (throttled once at most with
     * the host-function gate, never with the device gate); the suite expects
     * a limited loop to be throttled: 100 ms more, undelayed. */
    for (int i = 0; i < 50; i++)
        CHECK_CU(cuLaunchKernel((CUfunction)(uintptr_t)0xd500, 64, 1, 1, 256, 1, 1, 0, s, NULL, NULL));
    CHECK_CU(cuCtxSynchronize());
}

/* Work admitted behind a held stream: the driver's callback thread is kept
 * off the CPU 200 ms before it runs the first sampling gate's host function
 * (VCUDA_TEST_DELAY "gatefn", once a process; the device gate is turned off
 * with the fake's FAKE_CUDA_STREAM_MEMOPS=0), so the stream waits that
 * long, and whatever the limiter admits meanwhile waits unscheduled, already
 * charged, then runs back to back. At 50% the launcher admitted 108 ms of it
 * (the nobacklogcap mutant); waiting while the oldest sample not yet started
 * is overdue (50 ms past its predicted start) kept it at 29 ms (three runs,
 * load 5-13).
 * The backlog is counted on the device: the device time launched (each
 * launch one 1 ms wave, a figure the test sets) less what the device has
 * run by then. */
#define BL_F ((CUfunction)(uintptr_t)0xd600)
TEST_LIB(limiter_caps_the_backlog_behind_a_held_gate, "testhooks") {
    /* the hold is the driver's callback thread's: the host-function gate
     * (the device gate has no thread to starve) */
    setenv("FAKE_CUDA_STREAM_MEMOPS", "0", 1);
    setenv("FAKE_CUDA_SMS", "16", 1);
    gpu_line g[1] = {{0, 1ull << 30, 50}};
    setup_limits(g, 1);
    ctx_on(0);
    fake_func f = {64, 0, 1000000, 0}; /* 4 blocks an SM: a wave is 64 blocks, 1 ms */
    CHECK(fakeFunctionSet(BL_F, &f) == 0, "fakeFunctionSet");
    CUstream s;
    CHECK_CU(cuStreamCreate(&s, 0));
    for (int i = 0; i < 200; i++) /* learn the kernel undisturbed */
        CHECK_CU(cuLaunchKernel(BL_F, 64, 1, 1, 256, 1, 1, 0, s, NULL, NULL));
    CHECK_CU(cuCtxSynchronize());
    fake_stats s0, s1;
    CHECK(fakeDeviceStats(0, &s0) == 0, "fakeDeviceStats");
    setenv("VCUDA_TEST_DELAY", "gatefn", 1);
    setenv("VCUDA_TEST_DELAY_MS", "200", 1);
    double worst = 0;
    for (int i = 1; i <= 400; i++) {
        CHECK_CU(cuLaunchKernel(BL_F, 64, 1, 1, 256, 1, 1, 0, s, NULL, NULL));
        CHECK(fakeDeviceStats(0, &s1) == 0, "fakeDeviceStats");
        double backlog = (double)i * 1e6 - (double)(s1.busy - s0.busy);
        if (backlog > worst)
            worst = backlog;
    }
    CHECK_CU(cuCtxSynchronize());
    CHECK(fakeDeviceStats(0, &s1) == 0, "fakeDeviceStats");
    fprintf(stderr, "held gates: %.0f ms launched, %.0f ms run; at most %.1f ms admitted and not run\n", 400.0,
          (double)(s1.busy - s0.busy) / 1e6, worst / 1e6);
    CHECK(s1.busy - s0.busy >= 395000000ull && s1.busy - s0.busy <= 405000000ull,
          "the device ran %.1f ms of 400 ms launched: the test's count of device time is wrong",
          (double)(s1.busy - s0.busy) / 1e6);
    CHECK(worst <= 50e6, "%.1f ms admitted and not run: work admitted behind a held stream", worst / 1e6);
}
