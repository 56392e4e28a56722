/*
 * tests_launch.c - the compute limiter against the fake device's modelled
 * capacity. A launch of G blocks occupies a device with S SMs for
 * WAVE_NS * G / S; the fake keeps that timeline, so utilisation is measured
 * in modelled device time, not in host timing, and a loaded CI machine only
 * makes the loop launch less (never more).
 *
 * Tolerance: the measured utilisation must be within 10% (relative) of the
 * percent in the limits file, over a 1.5 s window after 0.4 s of warm-up.
 * The limiter's own error is at most (SLACK + BURST) / window ~ 1.5%.
 * On a loaded machine the launching thread, or the fake driver's host-function
 * worker that a gated sample waits for, may wait for a CPU (or the VM's CPUs
 * be stolen); budget that elapses meanwhile beyond the limiter's burst
 * allowance cannot be used, so the lower bound is scaled by the share of the
 * window not lost that way (rq_wait_ns: the process's threads' run-queue wait
 * from /proc/self/task/<tid>/schedstat, plus steal from /proc/stat). The upper
 * bound is never relaxed.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "cuda_api.h"
#include "util.h"

#define WAVE_NS 100000ull
#define WARMUP_NS 400000000ull
#define WINDOW_NS 1500000000ull

typedef struct {
    uint64_t t, busy;
} snap;
/* The fake device's busy time (union of kernel intervals, as a GPU's
 * utilisation counts it): of the whole device, or of one process (pid). */
static snap take_snap_pid(int dev, int pid) {
    snap s;
    if (pid) {
        CHECK(fakeProcessBusy(dev, pid, &s.busy, &s.t) == 0, "no busy time for pid %d", pid);
        return s;
    }
    fake_stats st;
    fakeDeviceStats(dev, &st);
    s.t = st.at;
    s.busy = st.busy;
    return s;
}
static snap take_snap(int dev) { return take_snap_pid(dev, 0); }
static double utilisation(snap a, snap b) { return (double)(b.busy - a.busy) / (double)(b.t - a.t); }

/* ns the threads the device's progress depends on have spent runnable but
 * waiting for a CPU, plus the machine's stolen time. The threads are this
 * process's: the launcher, and the fake driver's host-function worker, which
 * holds the device queue while a sampled launch is gated (in real time: a
 * worker kept off a CPU leaves the device idle, as a real driver's would).
 * Stolen time (the hypervisor ran another guest on our CPU) is not run-queue
 * wait at all, and is counted whole, for every CPU. Never decreases (a thread
 * that exits takes its wait with it). */
static uint64_t rq_wait_ns(void) {
    static uint64_t last;
    uint64_t total = 0;
    DIR *d = opendir("/proc/self/task");
    if (d) {
        struct dirent *e;
        while ((e = readdir(d))) {
            if (e->d_name[0] == '.')
                continue;
            char path[300];
            snprintf(path, sizeof(path), "/proc/self/task/%s/schedstat", e->d_name);
            FILE *f = fopen(path, "r");
            if (!f)
                continue;
            unsigned long long run, wait;
            if (fscanf(f, "%llu %llu", &run, &wait) == 2)
                total += wait;
            fclose(f);
        }
        closedir(d);
    }
    FILE *f = fopen("/proc/stat", "r");
    if (f) {
        unsigned long long v[8];
        if (fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
                   &v[6], &v[7]) == 8)
            total += v[7] * (1000000000ull / (unsigned long long)sysconf(_SC_CLK_TCK));
        fclose(f);
    }
    if (total < last)
        total = last;
    last = total;
    return total;
}

static vc_region_gpu *rgpu(int g) {
    return (vc_region_gpu *)((char *)region_map() + VC_REGION_GPU_OFFSET) + g;
}

enum { MIX_KERNEL = 0, MIX_ALL = 1 };

/* Launches until deadline. mix: plain kernels, or every launch API in turn. */
static void launch_loop(int sms, int mix, uint64_t deadline) {
    CUstream s;
    CHECK_CU(cuStreamCreate(&s, 0));
    CUgraphExec graph;
    CHECK_CU(fakeGraphExecCreate(&graph, 3ull * (unsigned)sms));
    unsigned g4 = 4u * (unsigned)sms;
    CUlaunchConfig cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.gridDimX = 2u * (unsigned)sms;
    cfg.gridDimY = 1;
    cfg.gridDimZ = 1;
    cfg.blockDimX = 256;
    cfg.blockDimY = cfg.blockDimZ = 1;
    cfg.hStream = s;
    for (unsigned long i = 0; now_ns() < deadline; i++) {
        CUfunction f = (CUfunction)(uintptr_t)(0x1000 + 0x10 * (i % 3));
        if (mix == MIX_KERNEL) {
            CHECK_CU(cuLaunchKernel(f, g4, 1, 1, 128, 1, 1, 0, s, NULL, NULL));
            continue;
        }
        switch (i % 6) {
        case 0: CHECK_CU(cuLaunchKernel(f, g4, 1, 1, 128, 1, 1, 0, s, NULL, NULL)); break;
        case 1: CHECK_CU(cuLaunchKernelEx(&cfg, (CUfunction)(uintptr_t)0x2000, NULL, NULL)); break;
        case 2: CHECK_CU(cuLaunchCooperativeKernel((CUfunction)(uintptr_t)0x3000, (unsigned)sms, 2, 1, 64, 1, 1, 0, s, NULL)); break;
        case 3: CHECK_CU(cuGraphLaunch(graph, s)); break;
        case 4: CHECK_CU(cuLaunchKernel_ptsz((CUfunction)(uintptr_t)0x4000, g4, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL)); break;
        /* a grid smaller than the GPU is charged for the SMs it uses */
        case 5: CHECK_CU(cuLaunchKernel((CUfunction)(uintptr_t)0x5000, (unsigned)sms / 4 + 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL)); break;
        }
    }
}

/* starved: share of the window the device's threads waited for a CPU or were
 * stolen (rq_wait_ns). */
static void check_util(double u, int percent, double starved) {
    double want = percent / 100.0, lo = want * 0.9 * (1 - starved);
    fprintf(stderr, "utilisation %.1f%% (limit %d%%; its threads waited for a CPU or were stolen %.1f%% of the window)\n",
            u * 100, percent, starved * 100);
    CHECK(u <= want * 1.1, "utilisation %.1f%%, over %d%% + 10%%", u * 100, percent);
    CHECK(u >= lo, "utilisation %.1f%%, under %d%% - 10%% (%.1f%% allowing for CPU starvation)",
          u * 100, percent, lo * 100);
}

static void single(int percent, int sms, int mix) {
    char buf[32];
    snprintf(buf, sizeof(buf), "%d", sms);
    setenv("FAKE_CUDA_SMS", buf, 1);
    snprintf(buf, sizeof(buf), "%llu", WAVE_NS);
    setenv("FAKE_CUDA_WAVE_NS", buf, 1);
    gpu_line g[1] = {{0, 1ull << 30, percent}};
    setup_limits(g, 1);
    ctx_on(0);
    uint64_t start = now_ns();
    launch_loop(sms, mix, start + WARMUP_NS);
    uint64_t w0 = rq_wait_ns();
    snap a = take_snap(0);
    launch_loop(sms, mix, a.t + WINDOW_NS);
    snap b = take_snap(0);
    double starved = (double)(rq_wait_ns() - w0) / (double)(b.t - a.t);
    double u = utilisation(a, b);
    if (percent >= 100) {
        fprintf(stderr, "utilisation %.1f%% (no limit)\n", u * 100);
        CHECK(u > 0.95, "unthrottled loop only reached %.1f%%", u * 100);
        CHECK(atomic_load(&rgpu(0)->throttled_ns) == 0, "throttled at 100%%");
        return;
    }
    check_util(u, percent, starved);
    uint64_t th = atomic_load(&rgpu(0)->throttled_ns);
    CHECK(th > 0 && atomic_load(&rgpu(0)->throttle_events) > 0, "throttling not recorded");
    fprintf(stderr, "throttled %.0f ms in %llu waits\n", th / 1e6,
            (unsigned long long)atomic_load(&rgpu(0)->throttle_events));
}

TEST(limiter_kernel_30pct_16sm) { single(30, 16, MIX_KERNEL); }
TEST(limiter_kernel_30pct_132sm) { single(30, 132, MIX_KERNEL); }
TEST(limiter_kernel_70pct_108sm) { single(70, 108, MIX_KERNEL); }
TEST(limiter_all_launch_apis_40pct) { single(40, 80, MIX_ALL); }
TEST(limiter_100pct_does_not_throttle) { single(100, 16, MIX_KERNEL); }

/* Two processes of one container share one budget. */
typedef struct {
    uint64_t win_start, win_end, deadline;
    chan c[2];
} two_arg;
static int loop_child(int i, void *arg) {
    two_arg *a = arg;
    ctx_on(0);
    launch_loop(64, MIX_KERNEL, a->win_start);
    uint64_t w0 = rq_wait_ns();
    launch_loop(64, MIX_KERNEL, a->win_end);
    chan_send_up(&a->c[i], rq_wait_ns() - w0);
    launch_loop(64, MIX_KERNEL, a->deadline);
    return 0;
}

TEST(limiter_2proc_share_30pct) {
    setenv("FAKE_CUDA_SMS", "64", 1);
    char buf[32];
    snprintf(buf, sizeof(buf), "%llu", WAVE_NS);
    setenv("FAKE_CUDA_WAVE_NS", buf, 1);
    gpu_line g[1] = {{0, 1ull << 30, 30}};
    setup_limits(g, 1);
    two_arg ta;
    ta.win_start = now_ns() + WARMUP_NS;
    ta.win_end = ta.win_start + WINDOW_NS;
    ta.deadline = ta.win_end + 200000000ull;
    pid_t p[2];
    for (int i = 0; i < 2; i++) {
        chan_init(&ta.c[i]);
        p[i] = spawn(loop_child, i, &ta);
    }
    usleep((useconds_t)((ta.win_start - now_ns()) / 1000));
    snap a = take_snap(0);
    usleep((useconds_t)((ta.win_end - now_ns()) / 1000));
    snap b = take_snap(0);
    uint64_t w[2];
    for (int i = 0; i < 2; i++)
        w[i] = chan_recv_up(&ta.c[i]);
    for (int i = 0; i < 2; i++)
        CHECK(wait_child(p[i]) == 0, "child %d failed", i);
    /* budget is lost only while both launchers wait */
    check_util(utilisation(a, b), 30, (double)(w[0] < w[1] ? w[0] : w[1]) / (double)(b.t - a.t));
}

/* Launches into a capturing stream are recorded, not run: the limiter
 * neither charges nor samples them (an event in the stream would end up in
 * the graph or invalidate the capture); the graph's launch is charged. */
TEST(limiter_skips_stream_capture) {
    setenv("FAKE_CUDA_SMS", "16", 1);
    gpu_line g[1] = {{0, 1ull << 30, 30}};
    setup_limits(g, 1);
    ctx_on(0);
    CUstream s;
    CHECK_CU(cuStreamCreate(&s, 0));
    CHECK_CU(cuStreamBeginCapture_v2(s, 0));
    uint64_t t0 = now_ns();
    for (int i = 0; i < 2000; i++)
        CHECK_CU(cuLaunchKernel((CUfunction)(uintptr_t)0x7000, 64, 1, 1, 32, 1, 1, 0, s, NULL, NULL));
    uint64_t dt = now_ns() - t0;
    void *graph;
    CHECK_CU(cuStreamEndCapture(s, &graph));
    CHECK(atomic_load(&rgpu(0)->throttled_ns) == 0, "captured launches were throttled");
    CHECK(dt < 1000000000ull, "capture took %.0f ms", dt / 1e6);
    /* and outside capture the same kernel is limited */
    uint64_t end = now_ns() + 300000000ull;
    while (now_ns() < end)
        CHECK_CU(cuLaunchKernel((CUfunction)(uintptr_t)0x7000, 64, 1, 1, 32, 1, 1, 0, s, NULL, NULL));
    CHECK(atomic_load(&rgpu(0)->throttled_ns) > 0, "not limited after capture");
}

/* Tiny kernels launched back to back: the device is mostly idle, waiting for
 * the host. Samples are gated (the kernel runs right behind its start event),
 * so the container is charged for the device time it uses, not for the
 * host's launch overhead, and is not throttled below its share. */
TEST(limiter_launch_bound_not_overcharged) {
    setenv("FAKE_CUDA_SMS", "16", 1);
    setenv("FAKE_CUDA_WAVE_NS", "10", 1); /* 10 ns a launch: far below the host's cost */
    gpu_line g[1] = {{0, 1ull << 30, 50}};
    setup_limits(g, 1);
    ctx_on(0);
    CUstream s;
    CHECK_CU(cuStreamCreate(&s, 0));
    uint64_t t0 = now_ns(), n = 0;
    while (now_ns() < t0 + 1000000000ull) {
        CHECK_CU(cuLaunchKernel((CUfunction)(uintptr_t)0x8000, 16, 1, 1, 32, 1, 1, 0, s, NULL, NULL));
        n++;
    }
    uint64_t dt = now_ns() - t0, th = atomic_load(&rgpu(0)->throttled_ns);
    fprintf(stderr, "%llu launches in %.0f ms, throttled %.1f ms in %llu waits\n", (unsigned long long)n, dt / 1e6, th / 1e6,
            (unsigned long long)atomic_load(&rgpu(0)->throttle_events));
    /* Overcharging (the host's launch cost billed as device time) at this 50% cap throttles about half
     * the wall time; a fifth leaves room for a loaded machine descheduling the sampler mid-kernel. */
    CHECK(th < dt / 5, "a launch-bound loop was throttled %.1f ms of %.0f ms", th / 1e6, dt / 1e6);
}

/* NVML utilisation reports the container's share (the limiter's charged
 * device time), and the legacy launch entry points are throttled. */
CUresult cuLaunchGrid(CUfunction, int, int);
CUresult cuLaunchCooperativeKernelMultiDevice(void *, unsigned, unsigned);
TEST(limiter_legacy_launches_and_nvml_utilisation) {
    setenv("FAKE_CUDA_SMS", "32", 1);
    char buf[32];
    snprintf(buf, sizeof(buf), "%llu", WAVE_NS);
    setenv("FAKE_CUDA_WAVE_NS", buf, 1);
    gpu_line g[1] = {{0, 1ull << 30, 30}};
    setup_limits(g, 1);
    ctx_on(0);
    char params[64] = {0};
    CHECK(cuLaunchCooperativeKernelMultiDevice(params, 1, 0) == CUDA_ERROR_NOT_SUPPORTED,
          "multi-device cooperative launch not refused");
    CHECK(nvmlInit_v2() == NVML_SUCCESS, "nvmlInit");
    nvmlDevice_t dev;
    CHECK(nvmlDeviceGetHandleByIndex_v2(0, &dev) == NVML_SUCCESS, "handle");
    nvmlUtilization_t u;
    uint64_t end = now_ns() + WARMUP_NS;
    while (now_ns() < end)
        CHECK_CU(cuLaunchGrid((CUfunction)(uintptr_t)0x9000, 128, 1));
    CHECK(nvmlDeviceGetUtilizationRates(dev, &u) == NVML_SUCCESS, "util");
    uint64_t w0 = rq_wait_ns();
    snap a = take_snap(0);
    while (now_ns() < a.t + WINDOW_NS)
        CHECK_CU(cuLaunchGrid((CUfunction)(uintptr_t)0x9000, 128, 1));
    snap b = take_snap(0);
    CHECK(nvmlDeviceGetUtilizationRates(dev, &u) == NVML_SUCCESS, "util");
    double got = utilisation(a, b);
    check_util(got, 30, (double)(rq_wait_ns() - w0) / (double)(b.t - a.t));
    fprintf(stderr, "nvml utilisation %u%%\n", u.gpu);
    /* what the container was charged over (nearly) the same window */
    CHECK(u.gpu + 4 >= got * 100 && u.gpu <= got * 100 + 4, "nvml says %u%%, the device was busy %.1f%%", u.gpu,
          got * 100);
    CHECK(atomic_load(&rgpu(0)->throttled_ns) > 0, "cuLaunchGrid not throttled");
}

/* ---- workloads that are not one grid on one stream ----
 * One function (256 threads, 64 registers: 4 resident blocks an SM, so a
 * wave is 4 x S blocks; 20 us a wave plus 3 us a launch) launched with
 * grids drawn at random from {1, S/4, S, 4S, 64S}: small grids take a
 * whole wave, so a limiter that charges per block undercharges them by up
 * to S x occupancy. */
#define MIX_SMS 132
#define MIX_F ((CUfunction)(uintptr_t)0xa000)
static fake_func mix_func = {64, 0, 20000, 3000};
/* kinds: 5 = all of {1, S/4, S, 4S, 64S}; 3 = only the grids smaller than a
 * wave {1, S/4, S}, which overlap when on different streams. */
static int mix_kinds = 5;
static unsigned mix_grid(uint64_t *rng) {
    static const unsigned mult[5] = {0, 1, 4, 16, 256}; /* quarters of S */
    *rng = *rng * 6364136223846793005ULL + 1442695040888963407ULL;
    unsigned k = mult[(*rng >> 33) % (unsigned)mix_kinds];
    return k ? k * MIX_SMS / 4 : 1;
}
/* Launches until deadline. One stream: back to back. Several: fork-join
 * rounds, one kernel on each stream then wait for all (how multi-stream
 * inference and collectives run), so their kernels run side by side. */
CUresult cuStreamSynchronize(CUstream);
static void mix_loop(CUstream *s, int nstreams, uint64_t *rng, uint64_t deadline) {
    while (now_ns() < deadline) {
        for (int i = 0; i < nstreams; i++)
            CHECK_CU(cuLaunchKernel(MIX_F, mix_grid(rng), 1, 1, 256, 1, 1, 0, s[i], NULL, NULL));
        if (nstreams > 1)
            for (int i = 0; i < nstreams; i++)
                CHECK_CU(cuStreamSynchronize(s[i]));
    }
}
static void mix_env(void) {
    char buf[32];
    snprintf(buf, sizeof(buf), "%d", MIX_SMS);
    setenv("FAKE_CUDA_SMS", buf, 1);
}
static double mix_min_overlap; /* kernel time / busy time the case requires */
static void grid_mix(int percent, int nstreams) {
    mix_env();
    gpu_line g[1] = {{0, 1ull << 30, percent}};
    setup_limits(g, 1);
    ctx_on(0);
    CHECK(fakeFunctionSet(MIX_F, &mix_func) == 0, "fakeFunctionSet");
    CUstream s[4];
    for (int i = 0; i < nstreams; i++)
        CHECK_CU(cuStreamCreate(&s[i], 0));
    uint64_t rng = 42 + (uint64_t)percent;
    mix_loop(s, nstreams, &rng, now_ns() + WARMUP_NS);
    uint64_t w0 = rq_wait_ns();
    snap a = take_snap(0);
    fake_stats sa, sb;
    fakeDeviceStats(0, &sa);
    mix_loop(s, nstreams, &rng, a.t + WINDOW_NS);
    snap b = take_snap(0);
    fakeDeviceStats(0, &sb);
    fprintf(stderr, "%llu launches; kernel time %.0f ms for %.0f ms busy\n", (unsigned long long)(sb.launches - sa.launches),
            (double)(sb.busy_total - sa.busy_total) / 1e6, (double)(sb.busy - sa.busy) / 1e6);
    double overlap = (double)(sb.busy_total - sa.busy_total) / (double)(sb.busy - sa.busy);
    CHECK(overlap >= mix_min_overlap, "the streams ran side by side only %.2fx (want %.2fx): the limiter serialised them",
          overlap, mix_min_overlap);
    check_util(utilisation(a, b), percent, (double)(rq_wait_ns() - w0) / (double)(b.t - a.t));
}
TEST(limiter_grid_mix_10pct) { grid_mix(10, 1); }
TEST(limiter_grid_mix_30pct) { grid_mix(30, 1); }
TEST(limiter_grid_mix_50pct) { grid_mix(50, 1); }
TEST(limiter_grid_mix_70pct) { grid_mix(70, 1); }
/* Several streams in fork-join rounds: kernels smaller than a wave overlap
 * on the device, so busy time is less than the sum of their durations. The
 * whole mix on three streams at 30%; at 30%, only grids {1, S/4} on four
 * streams, long enough (50 and 200 us) that a round's kernels run side by
 * side: a limiter that charges the sum paces them one by one, and the
 * application loses its concurrency. */
TEST(limiter_multi_stream_30pct) { grid_mix(30, 3); }
TEST(limiter_multi_stream_small_grids_30pct) {
    mix_kinds = 2;
    /* the fake times a partial grid by its blocks (at least 1/64 wave):
     * 3.2 ms a wave makes these 50 and 200 us */
    mix_func.wave_ns = 3200000;
    mix_min_overlap = 2; /* four streams: the limiter must not serialise them */
    grid_mix(30, 4);
}

/* Two containers (own limits, own regions) at 30% and 70% on one GPU: each
 * gets its share within 10%, and together no more than the device. */
typedef struct {
    uint64_t win_start, win_end, deadline;
    int percent[2];
    chan c[2];
} twoc_arg;
static int container_child(int i, void *arg) {
    twoc_arg *a = arg;
    char text[1024], name[32];
    snprintf(name, sizeof(name), "c%d-limits", i);
    snprintf(text, sizeof(text), "tessera-vcuda-limits 1\ncontainer c%d\nregion %s/c%d-region\ngpu %s %llu %d\n", i,
             tmpdir(), i, fake_uuid(0), 1ull << 30, a->percent[i]);
    write_file(tpath(name), text);
    setenv("TESSERA_VCUDA_LIMITS", tpath(name), 1);
    ctx_on(0);
    CHECK(fakeFunctionSet(MIX_F, &mix_func) == 0, "fakeFunctionSet");
    CUstream s;
    CHECK_CU(cuStreamCreate(&s, 0));
    uint64_t rng = 7 + (uint64_t)i;
    mix_loop(&s, 1, &rng, a->win_start);
    uint64_t w0 = rq_wait_ns();
    mix_loop(&s, 1, &rng, a->win_end);
    chan_send_up(&a->c[i], rq_wait_ns() - w0);
    mix_loop(&s, 1, &rng, a->deadline);
    return 0;
}
TEST(limiter_two_containers_30_70) {
    mix_env();
    setenv("FAKE_CUDA_SHM", tpath("fake-shm"), 1);
    twoc_arg ta = {.percent = {30, 70}};
    ta.win_start = now_ns() + WARMUP_NS;
    ta.win_end = ta.win_start + WINDOW_NS;
    ta.deadline = ta.win_end + 200000000ull;
    pid_t p[2];
    for (int i = 0; i < 2; i++) {
        chan_init(&ta.c[i]);
        p[i] = spawn(container_child, i, &ta);
    }
    usleep((useconds_t)((ta.win_start - now_ns()) / 1000));
    snap a[3], b[3];
    for (int i = 0; i < 2; i++)
        a[i] = take_snap_pid(0, p[i]);
    a[2] = take_snap(0);
    usleep((useconds_t)((ta.win_end - now_ns()) / 1000));
    for (int i = 0; i < 2; i++)
        b[i] = take_snap_pid(0, p[i]);
    b[2] = take_snap(0);
    uint64_t w[2];
    for (int i = 0; i < 2; i++)
        w[i] = chan_recv_up(&ta.c[i]);
    for (int i = 0; i < 2; i++)
        CHECK(wait_child(p[i]) == 0, "container %d failed", i);
    double total = utilisation(a[2], b[2]);
    fprintf(stderr, "device busy %.1f%%\n", total * 100);
    CHECK(total <= 1.0, "device over 100%%: %.1f%%", total * 100);
    for (int i = 0; i < 2; i++)
        check_util(utilisation(a[i], b[i]), ta.percent[i], (double)w[i] / (double)(b[i].t - a[i].t));
}

/* PyTorch captures CUDA graphs in global mode while other threads keep
 * launching: the limiter's event calls on those threads must not
 * invalidate the capture. */
CUresult cuThreadExchangeStreamCaptureMode(int *);
typedef struct {
    CUcontext ctx;
    _Atomic int phase; /* 1: capturing, 2: done */
    CUresult end;
} cap_arg;
static void *capturer(void *p) {
    cap_arg *a = p;
    CHECK_CU(cuCtxSetCurrent(a->ctx));
    CUstream s;
    CHECK_CU(cuStreamCreate(&s, 0));
    CHECK_CU(cuStreamBeginCapture_v2(s, 0 /* global */));
    atomic_store(&a->phase, 1);
    uint64_t end = now_ns() + 300000000ull;
    while (now_ns() < end) {
        CHECK_CU(cuLaunchKernel((CUfunction)(uintptr_t)0xb000, 64, 1, 1, 128, 1, 1, 0, s, NULL, NULL));
        usleep(100);
    }
    void *graph;
    a->end = cuStreamEndCapture(s, &graph);
    /* fail at once: a limiter that broke the capture may also have been
     * misled by the failed event calls into throttling the launcher for
     * good */
    CHECK(a->end == CUDA_SUCCESS, "the capture was invalidated (%d) by the limiter", a->end);
    atomic_store(&a->phase, 2);
    return NULL;
}
TEST(limiter_never_invalidates_a_capture) {
    setenv("FAKE_CUDA_SMS", "16", 1);
    gpu_line g[1] = {{0, 1ull << 30, 30}};
    setup_limits(g, 1);
    cap_arg a = {.ctx = ctx_on(0)};
    CUstream s;
    CHECK_CU(cuStreamCreate(&s, 0));
    /* the fake enforces the rule: an event query from this thread now would
     * invalidate a capture (checked on a capture of our own first) */
    CUstream c;
    CHECK_CU(cuStreamCreate(&c, 0));
    CHECK_CU(cuStreamBeginCapture_v2(c, 0));
    CUevent ev;
    CUresult cuEventCreate(CUevent *, unsigned);
    CHECK_CU(cuEventCreate(&ev, 0));
    CHECK(cuEventQuery(ev) == 900, "the fake allows an event query during a global capture");
    void *graph;
    CHECK(cuStreamEndCapture(c, &graph) == 901, "the fake did not invalidate the capture");

    pthread_t t;
    CHECK(pthread_create(&t, NULL, capturer, &a) == 0, "thread");
    while (atomic_load(&a.phase) == 0)
        usleep(100);
    uint64_t n = 0, stop = now_ns() + 2000000000ull;
    while (atomic_load(&a.phase) == 1 && now_ns() < stop) { /* limited launches, sampled, on another stream */
        CHECK_CU(cuLaunchKernel((CUfunction)(uintptr_t)(0xc000 + 0x10 * (n % 4)), 16u << (n % 5), 1, 1, 128, 1, 1, 0,
                                s, NULL, NULL));
        n++;
    }
    pthread_join(t, NULL);
    fprintf(stderr, "%llu launches during the capture (%.0f ms)\n", (unsigned long long)n,
            (double)(now_ns() + 2000000000ull - stop) / 1e6);
    CHECK(a.end == CUDA_SUCCESS, "the capture was invalidated (%d) by the limiter", a.end);
    CHECK(atomic_load(&rgpu(0)->throttled_ns) > 0, "not limited meanwhile");
}

/* The sampling gate outlives a launcher descheduled between closing and
 * opening it: the host function gives up after 5 ms, and the gate it held
 * must not be freed while the launcher still writes it (the test build marks
 * a released gate, and opening one aborts). VCUDA_TEST_DELAY holds the
 * launcher 20 ms right after it closes a gate, at every sampled launch. */
TEST_LIB(limiter_gate_outlives_a_slow_launcher, "testhooks") {
    setenv("VCUDA_TEST_DELAY", "gate", 1);
    setenv("VCUDA_TEST_DELAY_MS", "20", 1);
    setenv("FAKE_CUDA_SMS", "16", 1);
    /* kernels of 10-40 ms: a launcher held 20 ms at most of its launches
     * (one in 8 is sampled, and every one after a 1 ms gap) still runs over
     * its share, and is throttled as the suite expects of a limited loop */
    setenv("FAKE_CUDA_WAVE_NS", "40000000", 1);
    gpu_line g[1] = {{0, 1ull << 30, 50}};
    setup_limits(g, 1);
    ctx_on(0);
    launch_loop(16, MIX_KERNEL, now_ns() + 1500000000ull);
    CHECK_CU(cuCtxSynchronize());
}

/* ---- the device gate (cuStreamWaitValue32_v2 on a mapped word) ----
 * Where the driver has mapped host memory and stream memory operations, a
 * sampled launch's stream waits on a word the launcher writes when the
 * launch is queued: the fake counts the waits and reports any not yet
 * released. Each case runs a loop limited at 50%, over its share. */
#define DG_F ((CUfunction)(uintptr_t)0xd700)
static void dg_setup(void) {
    setenv("FAKE_CUDA_SMS", "16", 1);
    gpu_line g[1] = {{0, 1ull << 30, 50}};
    setup_limits(g, 1);
}
static CUstream dg_stream(void) {
    fake_func f = {64, 0, 200000, 0}; /* 4 blocks an SM: a wave is 64 blocks, 0.2 ms */
    CHECK(fakeFunctionSet(DG_F, &f) == 0, "fakeFunctionSet");
    CUstream s;
    CHECK_CU(cuStreamCreate(&s, 0));
    return s;
}
/* The launcher opens every gate before its launch call returns: a gate still
 * closed then holds the stream until the watchdog gives up (5 ms a sample,
 * the dgatestuck mutant). One pool of words for the context, made once. */
TEST(limiter_device_gate_opens_with_the_launch) {
    dg_setup();
    ctx_on(0);
    CUstream s = dg_stream();
    for (int i = 0; i < 400; i++) {
        CHECK_CU(cuLaunchKernel(DG_F, 64, 1, 1, 256, 1, 1, 0, s, NULL, NULL));
        int n = fakeWaitsPending();
        CHECK(n == 0, "launch %d: %d device gate(s) still closed after the launch returned: the launcher did not open it",
              i, n);
    }
    CHECK_CU(cuCtxSynchronize());
    fprintf(stderr, "%llu device gates, %llu host functions, %d host allocations\n",
            (unsigned long long)fakeWaitValueCalls(), (unsigned long long)fakeHostFuncCalls(), fakeHostAllocs());
    CHECK(fakeWaitValueCalls() >= 20, "only %llu device gates in 400 launches: sampling is not gated by the device",
          (unsigned long long)fakeWaitValueCalls());
    CHECK(fakeHostFuncCalls() == 0, "%llu host-function gates where the device gate works",
          (unsigned long long)fakeHostFuncCalls());
    CHECK(fakeHostAllocs() == 1, "%d pinned allocations: the gate's words are allocated once per context",
          fakeHostAllocs());
}

/* Without mapped memory, with the allocation failing, or without stream
 * memory operations, every sample keeps the host-function gate. */
static void dg_fallback(const char *knob, const char *value, int allocs) {
    setenv(knob, value, 1);
    dg_setup();
    ctx_on(0);
    CUstream s = dg_stream();
    for (int i = 0; i < 300; i++)
        CHECK_CU(cuLaunchKernel(DG_F, 64, 1, 1, 256, 1, 1, 0, s, NULL, NULL));
    CHECK_CU(cuCtxSynchronize());
    fprintf(stderr, "%s=%s: %llu device gates, %llu host functions, %d host allocations\n", knob, value,
            (unsigned long long)fakeWaitValueCalls(), (unsigned long long)fakeHostFuncCalls(), fakeHostAllocs());
    CHECK(fakeWaitValueCalls() == 0, "a device gate where the driver cannot have one");
    CHECK(fakeHostFuncCalls() >= 20, "only %llu host-function gates in 300 launches: the fallback is gone",
          (unsigned long long)fakeHostFuncCalls());
    CHECK(fakeHostAllocs() == allocs, "%d pinned allocations, want %d", fakeHostAllocs(), allocs);
}
TEST(limiter_device_gate_falls_back_without_mapped_memory) { dg_fallback("FAKE_CUDA_MAP_HOST", "0", 0); }
TEST(limiter_device_gate_falls_back_when_pinning_fails) { dg_fallback("FAKE_CUDA_HOST_ALLOC_FAIL", "1", 0); }
/* the words were allocated and mapped; the wait is refused: freed at once */
TEST(limiter_device_gate_falls_back_without_stream_memops) { dg_fallback("FAKE_CUDA_STREAM_MEMOPS", "0", 1); }

/* A gate whose launcher is held inside its launch (test hooks: 300 ms
 * after the start event, at the first sampled launch) is opened by the
 * watchdog after about 5 ms, as the host function gives up: a launch that
 * blocks on a queue filled behind the gate would otherwise wait for ever. */
static _Atomic int dg_seen_closed, dg_opened_while_held;
static uint64_t dg_t0;
static void *dg_observer(void *p) {
    (void)p;
    uint64_t stop = now_ns() + 3000000000ull, closed_at = 0;
    while (now_ns() < stop) {
        int n = fakeWaitsPending();
        if (n > 0) {
            if (!atomic_load(&dg_seen_closed))
                closed_at = now_ns();
            atomic_store(&dg_seen_closed, 1);
        }
        else if (atomic_load(&dg_seen_closed)) {
            /* the launcher cannot open it before its 300 ms hold ends */
            atomic_store(&dg_opened_while_held, now_ns() - dg_t0 < 250000000ull);
            fprintf(stderr, "the gate seen closed %.1f ms into the launch, open %.1f ms after\n",
                    (double)(closed_at - dg_t0) / 1e6, (double)(now_ns() - closed_at) / 1e6);
            return NULL;
        }
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}
TEST_LIB(limiter_device_gate_watchdog_opens_a_held_gate, "testhooks") {
    dg_setup();
    ctx_on(0);
    CUstream s = dg_stream();
    pthread_t t;
    CHECK(pthread_create(&t, NULL, dg_observer, NULL) == 0, "pthread_create");
    setenv("VCUDA_TEST_DELAY", "sampled", 1);
    setenv("VCUDA_TEST_DELAY_MS", "300", 1);
    dg_t0 = now_ns();
    CHECK_CU(cuLaunchKernel(DG_F, 64, 1, 1, 256, 1, 1, 0, s, NULL, NULL)); /* the first is sampled */
    fprintf(stderr, "the held launch took %.1f ms\n", (double)(now_ns() - dg_t0) / 1e6);
    unsetenv("VCUDA_TEST_DELAY");
    pthread_join(t, NULL);
    CHECK(atomic_load(&dg_seen_closed), "no device gate seen closed");
    CHECK(atomic_load(&dg_opened_while_held),
          "the gate stayed closed while its launcher was held 300 ms: no watchdog gave up on it");
    for (int i = 0; i < 300; i++) /* over its share, as the suite expects of a limited loop */
        CHECK_CU(cuLaunchKernel(DG_F, 64, 1, 1, 256, 1, 1, 0, s, NULL, NULL));
    CHECK_CU(cuCtxSynchronize());
}

/* The host-function gate's own lifetime case, with the device gate off. */
TEST_LIB(limiter_gate_outlives_a_slow_launcher_hostfn, "testhooks") {
    setenv("FAKE_CUDA_STREAM_MEMOPS", "0", 1);
    limiter_gate_outlives_a_slow_launcher();
    CHECK(fakeHostFuncCalls() > 0, "no host-function gate used");
}
