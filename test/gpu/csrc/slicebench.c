/*
 * slicebench: how the GPU time-slices two processes (no MPS), measured the way vcuda's limiter
 * samples a launch: two events around it. gpuproof timeslice runs it (test/gpu/README.md).
 *
 *   slicebench busy <kernel_ms> <seconds>   process B: spin kernels of <kernel_ms> back to back (two
 *                                           queued at all times) for <seconds>; prints "busy" once
 *                                           the first one started
 *   slicebench solo <target_us> <n>         process A alone: finds the work per kernel for about
 *                                           <target_us>, then times <n> kernels one at a time
 *   slicebench run <work> <batches> <per>   process A beside B: <batches> batches, each after a 5 ms
 *                                           idle; a batch is <per> kernels of <work> back to back,
 *                                           events around each
 *   slicebench feedback <file> <kernel_ms> <busy_s> <gap_s> <duty_pct> <wait_s>
 *                                           a known device-busy schedule for the agent's measured
 *                                           compute file (gpuproof feedback): spin kernels back to
 *                                           back until <file> names this process (at most <wait_s>),
 *                                           then busy1 (<busy_s> back to back), gap (<gap_s> idle),
 *                                           busy2, duty (<busy_s> of one kernel per cycle, idle
 *                                           between, <duty_pct>% busy), tail (1 s idle); events
 *                                           around every kernel measure its own device busy
 *
 * Output (one line each, space-separated words): "work=<n> kernel=<how>" (solo: and "uuid=GPU-..."), "elapsed_ns=<a,b,...>"
 * (each kernel's events, in order), "delay_ns=<a,b,...>" (per batch: host time from the first
 * launch call until its start event completed, polled: the wait for this process's turn).
 * feedback prints "warm named=<0|1> pid=<its pid> end=<ns>" and per segment "segment name=<n>
 * start=<ns> end=<ns> busy=<ns> kernels=<n>" (CLOCK_MONOTONIC: the host's, in a container without a
 * time namespace; busy: the sum of its kernels' event times), then "done".
 *
 * The kernels: on a real driver PTX the driver compiles (no nvcc needed): A's a fixed amount of
 * work (a dependent FMA chain of <work> steps: preempted, it takes longer), B's a spin on
 * %globaltimer (wall-clock length, whatever preempts it). The fake driver has no cuModuleLoadData
 * (looked up with dlsym): there a launch gets an opaque handle and lasts FAKE_CUDA_WAVE_NS (one
 * wave), which gpuproof sets per process.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_driver.h"

/* A: <work> dependent FMAs, the result stored so the compiler keeps the loop. B: spin until
 * %globaltimer (ns) passes start + <ns>. One thread each. */
#define PTX_BODY                                                                                                     \
    ".visible .entry tessera_work(.param .u64 work, .param .u64 out)\n{\n"                                           \
    "\t.reg .u64 %rd<6>;\n\t.reg .f32 %f<2>;\n\t.reg .pred %p;\n"                                                    \
    "\tld.param.u64 %rd1, [work];\n\tld.param.u64 %rd2, [out];\n\tmov.u64 %rd3, 0;\n\tmov.f32 %f1, 0f3F800000;\n"   \
    "LOOP:\n\tfma.rn.f32 %f1, %f1, 0f3F7FFFFF, 0f3A83126F;\n\tadd.u64 %rd3, %rd3, 1;\n"                              \
    "\tsetp.lt.u64 %p, %rd3, %rd1;\n\t@%p bra LOOP;\n"                                                              \
    "\tcvta.to.global.u64 %rd4, %rd2;\n\tst.global.f32 [%rd4], %f1;\n\tret;\n}\n"                                   \
    ".visible .entry tessera_spin(.param .u64 ns)\n{\n"                                                              \
    "\t.reg .u64 %rd<5>;\n\t.reg .pred %p;\n"                                                                        \
    "\tld.param.u64 %rd1, [ns];\n\tmov.u64 %rd2, %globaltimer;\n\tadd.u64 %rd3, %rd2, %rd1;\n"                     \
    "SPIN:\n\tmov.u64 %rd4, %globaltimer;\n\tsetp.lt.u64 %p, %rd4, %rd3;\n\t@%p bra SPIN;\n\tret;\n}\n"
static const char *ptx[] = {
    ".version 8.0\n.target sm_80\n.address_size 64\n" PTX_BODY,
    ".version 7.0\n.target sm_70\n.address_size 64\n" PTX_BODY,
};

#define CK(call)                                                                                                     \
    do {                                                                                                             \
        CUresult r_ = (call);                                                                                        \
        if (r_ != 0) die(#call, r_);                                                                                 \
    } while (0)

static CUfunction work_fn, spin_fn;
static const char *how = "opaque-handle(fake-driver)";
static CUdeviceptr out_word;
/* One wave of one-thread blocks: as many per SM as fit (the driver's occupancy), so the kernel
 * holds the whole device, and the fake's lasts exactly FAKE_CUDA_WAVE_NS (its occupancy depends on
 * the handle: a fixed grid would last one wave or two, or a fraction). */
static unsigned sms, grid_work, grid_spin;

static void load(void) {
    static const char *const names[] = {"tessera_work", "tessera_spin"};
    CUfunction fns[2];
    int i = load_ptx(ptx, sizeof ptx / sizeof ptx[0], names, fns, 2, "cuModuleLoadData(the probe's PTX)");
    if (i < 0) {
        work_fn = spin_fn = (CUfunction)(uintptr_t)0x1000;
        return;
    }
    work_fn = fns[0], spin_fn = fns[1];
    how = i == 0 ? "ptx-sm_80" : "ptx-sm_70";
    CK(cuMemAlloc_v2(&out_word, 64));
}

static void launch_work(uint64_t work) {
    void *params[] = {&work, &out_word};
    CK(cuLaunchKernel(work_fn, grid_work, 1, 1, 1, 1, 1, 0, NULL, params, NULL));
}

static void launch_spin(uint64_t ns) {
    void *params[] = {&ns};
    CK(cuLaunchKernel(spin_fn, grid_spin, 1, 1, 1, 1, 1, 0, NULL, params, NULL));
}

static uint64_t elapsed_ns(CUevent a, CUevent b) {
    float ms;
    CK(cuEventElapsedTime(&ms, a, b));
    return (uint64_t)((double)ms * 1e6);
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* the median of n solo kernels of work, one at a time */
static uint64_t solo_median(uint64_t work, int n, uint64_t *all) {
    CUevent s, e;
    CK(cuEventCreate(&s, 0));
    CK(cuEventCreate(&e, 0));
    for (int i = 0; i < n; i++) {
        CK(cuEventRecord(s, NULL));
        launch_work(work);
        CK(cuEventRecord(e, NULL));
        CK(cuEventSynchronize(e));
        all[i] = elapsed_ns(s, e);
    }
    uint64_t *tmp = malloc(sizeof(uint64_t) * (size_t)n);
    memcpy(tmp, all, sizeof(uint64_t) * (size_t)n);
    qsort(tmp, (size_t)n, sizeof(uint64_t), cmp_u64);
    uint64_t m = tmp[n / 2];
    free(tmp);
    return m;
}

static void print_list(const char *name, const uint64_t *v, int n) {
    printf("%s=", name);
    for (int i = 0; i < n; i++)
        printf(i ? ",%llu" : "%llu", (unsigned long long)v[i]);
    printf("\n");
}


/* Does the measured compute file name this process ("gpu <uuid> pid <pid> start ...")? */
static int file_names_me(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    char line[512], want[64];
    snprintf(want, sizeof want, " pid %d start ", (int)getpid());
    int found = 0;
    while (!found && fgets(line, sizeof line, f))
        found = strncmp(line, "gpu ", 4) == 0 && strstr(line, want) != NULL;
    fclose(f);
    return found;
}

/* Spin kernels of ns back to back, two queued, each between two events, until the host clock passes
 * end (or, with path, the file names this process): the summed event times. */
#define FB_SLOTS 3
static CUevent fb_ev[FB_SLOTS][2];
static uint64_t fb_kernels;
static uint64_t fb_settle(int slot) {
    CK(cuEventSynchronize(fb_ev[slot][1]));
    return elapsed_ns(fb_ev[slot][0], fb_ev[slot][1]);
}
static uint64_t fb_busy(uint64_t ns, uint64_t end, const char *path, int *named) {
    uint64_t busy = 0;
    long i = 0;
    for (; now_ns() < end; i++) {
        int slot = (int)(i % FB_SLOTS);
        if (i >= FB_SLOTS - 1)
            busy += fb_settle((int)((i - (FB_SLOTS - 1)) % FB_SLOTS)); /* at most two queued */
        if (path && (*named = file_names_me(path)))
            break;
        CK(cuEventRecord(fb_ev[slot][0], NULL));
        launch_spin(ns);
        CK(cuEventRecord(fb_ev[slot][1], NULL));
    }
    for (long k = i - (FB_SLOTS - 1) < 0 ? 0 : i - (FB_SLOTS - 1); k < i; k++)
        busy += fb_settle((int)(k % FB_SLOTS));
    fb_kernels += (uint64_t)i;
    return busy;
}

static void fb_segment(const char *name, uint64_t t0, uint64_t busy, uint64_t kernels) {
    printf("segment name=%s start=%llu end=%llu busy=%llu kernels=%llu\n", name, (unsigned long long)t0,
           (unsigned long long)now_ns(), (unsigned long long)busy, (unsigned long long)kernels);
    fflush(stdout);
}

static void sleep_ns(uint64_t ns) {
    struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    while (nanosleep(&ts, &ts) != 0)
        ;
}

static int feedback(const char *path, double kernel_ms, double busy_s, double gap_s, double duty_pct, double wait_s) {
    if (kernel_ms <= 0 || busy_s <= 0 || gap_s < 0 || duty_pct <= 0 || duty_pct > 100 || wait_s < 0)
        die("arguments", -2);
    uint64_t ns = (uint64_t)(kernel_ms * 1e6), seg = (uint64_t)(busy_s * 1e9);
    for (int i = 0; i < FB_SLOTS; i++)
        for (int j = 0; j < 2; j++)
            CK(cuEventCreate(&fb_ev[i][j], 0));
    int named = 0;
    fb_busy(ns, now_ns() + (uint64_t)(wait_s * 1e9), path, &named);
    printf("warm named=%d pid=%d end=%llu\n", named, (int)getpid(), (unsigned long long)now_ns());
    fflush(stdout);
    uint64_t t0 = now_ns(), k0 = fb_kernels;
    uint64_t b = fb_busy(ns, t0 + seg, NULL, NULL);
    fb_segment("busy1", t0, b, fb_kernels - k0);
    t0 = now_ns();
    sleep_ns((uint64_t)(gap_s * 1e9));
    fb_segment("gap", t0, 0, 0);
    t0 = now_ns(), k0 = fb_kernels;
    b = fb_busy(ns, t0 + seg, NULL, NULL);
    fb_segment("busy2", t0, b, fb_kernels - k0);
    /* one kernel per cycle, synchronised, then idle to the cycle's end */
    uint64_t cycle = (uint64_t)((double)ns * 100.0 / duty_pct);
    t0 = now_ns(), b = 0;
    uint64_t n = 0;
    for (uint64_t c = t0; c < t0 + seg; c += cycle, n++) {
        CK(cuEventRecord(fb_ev[0][0], NULL));
        launch_spin(ns);
        CK(cuEventRecord(fb_ev[0][1], NULL));
        b += fb_settle(0);
        uint64_t now = now_ns();
        if (now < c + cycle)
            sleep_ns(c + cycle - now);
    }
    fb_segment("duty", t0, b, n);
    t0 = now_ns();
    sleep_ns(1000000000ull);
    fb_segment("tail", t0, 0, 0);
    printf("done\n");
    return 0;
}

int main(int argc, char **argv) {
    CUdevice d;
    CUcontext c;
    if (argc < 4) {
        fprintf(stderr, "usage: slicebench busy <kernel_ms> <seconds> | solo <target_us> <n> | run <work> <batches> <per> | feedback <file> <kernel_ms> <busy_s> <gap_s> <duty_pct> <wait_s>\n");
        return 2;
    }
    CK(cuInit(0));
    CK(cuDeviceGet(&d, 0));
    CK(cuDevicePrimaryCtxRetain(&c, d));
    CK(cuCtxSetCurrent(c));
    int n_sm = 0, occ_work = 0, occ_spin = 0;
    CK(cuDeviceGetAttribute(&n_sm, 16 /* CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT */, d));
    sms = n_sm > 0 ? (unsigned)n_sm : 1;
    load();
    CK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&occ_work, work_fn, 1, 0));
    CK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&occ_spin, spin_fn, 1, 0));
    grid_work = sms * (unsigned)(occ_work > 0 ? occ_work : 1);
    grid_spin = sms * (unsigned)(occ_spin > 0 ? occ_spin : 1);
    if (strcmp(argv[1], "busy") == 0) {
        uint64_t ns = (uint64_t)(atof(argv[2]) * 1e6);
        uint64_t end = now_ns() + (uint64_t)(atof(argv[3]) * 1e9);
        CUevent ev[2];
        CK(cuEventCreate(&ev[0], 0));
        CK(cuEventCreate(&ev[1], 0));
        for (long i = 0; now_ns() < end; i++) {
            if (i >= 2)
                CK(cuEventSynchronize(ev[i % 2])); /* two queued at all times */
            launch_spin(ns);
            CK(cuEventRecord(ev[i % 2], NULL));
            if (i == 0) {
                CK(cuEventSynchronize(ev[0]));
                printf("busy kernel=%s\n", how);
                fflush(stdout);
            }
        }
        CK(cuCtxSynchronize());
        return 0;
    }
    if (argc == 4 && strcmp(argv[1], "solo") == 0) {
        uint64_t target = (uint64_t)(atof(argv[2]) * 1e3);
        int n = atoi(argv[3]);
        if (n < 1 || n > 100000 || target == 0) die("arguments", -2);
        uint64_t *all = calloc((size_t)n, sizeof(uint64_t));
        uint64_t work = 1 << 16;
        solo_median(work, 3, all); /* warm-up: the module's first launch */
        for (int round = 0; round < 4; round++) { /* scale the work to the target */
            uint64_t t = solo_median(work, 3, all);
            if (t == 0)
                break;
            uint64_t next = (uint64_t)((double)work * (double)target / (double)t);
            work = next < 1 ? 1 : next > (1ull << 34) ? 1ull << 34 : next;
        }
        solo_median(work, n, all);
        unsigned char u[16];
        CK(cuDeviceGetUuid_v2(u, d));
        printf("work=%llu kernel=%s uuid=GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x\n",
               (unsigned long long)work, how, u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12],
               u[13], u[14], u[15]);
        print_list("elapsed_ns", all, n);
        return 0;
    }
    if (argc == 8 && strcmp(argv[1], "feedback") == 0)
        return feedback(argv[2], atof(argv[3]), atof(argv[4]), atof(argv[5]), atof(argv[6]), atof(argv[7]));
    if (argc == 5 && strcmp(argv[1], "run") == 0) {
        uint64_t work = strtoull(argv[2], NULL, 10);
        int batches = atoi(argv[3]), per = atoi(argv[4]);
        if (batches < 1 || per < 1 || batches * per > 100000) die("arguments", -2);
        int n = batches * per;
        CUevent *ev = calloc((size_t)n * 2, sizeof(CUevent));
        uint64_t *el = calloc((size_t)n, sizeof(uint64_t)), *delay = calloc((size_t)batches, sizeof(uint64_t));
        for (int i = 0; i < 2 * n; i++)
            CK(cuEventCreate(&ev[i], 0));
        for (int b = 0; b < batches; b++) {
            struct timespec idle = {0, 5000000}; /* B has the device to itself */
            nanosleep(&idle, NULL);
            for (int k = 0; k < per; k++) {
                int i = b * per + k;
                uint64_t t0 = now_ns();
                CK(cuEventRecord(ev[2 * i], NULL));
                launch_work(work);
                CK(cuEventRecord(ev[2 * i + 1], NULL));
                if (k == 0) { /* this process's turn: the wait for B's slice to end, and the switch */
                    CUresult q;
                    while ((q = cuEventQuery(ev[2 * i])) == 600) /* CUDA_ERROR_NOT_READY */
                        ;
                    if (q != 0) die("cuEventQuery", q);
                    delay[b] = now_ns() - t0;
                }
            }
            CK(cuCtxSynchronize());
        }
        for (int i = 0; i < n; i++)
            el[i] = elapsed_ns(ev[2 * i], ev[2 * i + 1]);
        printf("work=%llu kernel=%s\n", (unsigned long long)work, how);
        print_list("elapsed_ns", el, n);
        print_list("delay_ns", delay, batches);
        return 0;
    }
    fprintf(stderr, "usage: slicebench busy <kernel_ms> <seconds> | solo <target_us> <n> | run <work> <batches> <per> | feedback <file> <kernel_ms> <busy_s> <gap_s> <duty_pct> <wait_s>\n");
    return 2;
}
