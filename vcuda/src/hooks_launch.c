/*
 * hooks_launch.c - the compute limiter.
 *
 * Budget: a container at p% may keep its GPU busy p% of the time. The
 * limiter is a virtual-time ("theoretical arrival time", tat) scheduler in
 * the shared region, one per GPU, shared by all processes of the container:
 * each launch pushes tat forward by cost * 100 / p; a launch waits while tat
 * is more than SLACK ahead of the clock. Idle time earns at most BURST of
 * credit.
 *
 * Cost: the device time a launch keeps the GPU busy. A GPU runs a grid in
 * waves of SMs x occ blocks (occ: resident blocks per SM for this block
 * size and shared memory, asked of the driver once per function and shape
 * with cuOccupancyMaxActiveBlocksPerMultiprocessor), so a kernel costs
 *     est(f, shape, bucket) * waves,   waves = ceil(blocks / (SMs * occ))
 * where est is the measured device time per wave for launches of that
 * function and shape whose wave count falls in the same power-of-two
 * bucket (a 1-block grid costs a whole wave; per-launch overheads stay
 * within their bucket). est is measured, not guessed: the first launches of
 * each bucket, then launches drawn at random (odds by the grid's waves, and
 * one every SAMPLE_GAP), are bracketed with two events (behind a gate, see
 * below; up to SAMPLE_RING in flight per thread) and the elapsed device
 * time updates the estimate, an unbiased running mean, when the end event
 * has completed (polled, never waited for, except once per process to
 * calibrate); a sampled launch is then settled at its measured cost.
 * Graph launches are measured per graph exec the same way (cost =
 * est(exec)). A closed loop (loop_update) scales every cost by what the
 * samples measured over what the model predicted for them.
 *
 * Overlap: kernels on different streams of a process run concurrently
 * unless one fills the device, and the GPU is busy for the union of their
 * intervals, not the sum. The limiter keeps a predicted timeline per stream
 * and device (start = max(now, the stream's predicted end), after the last
 * device-filling kernel; a device-filling kernel after everything) and
 * charges only what a launch adds to the union.
 *
 * Stream capture: PyTorch captures graphs in global mode, where an event
 * query or synchronize from any thread invalidates the capture. The
 * limiter's own event calls run with the thread switched to relaxed
 * capture mode (cuThreadExchangeStreamCaptureMode), which the rule exempts.
 *
 * Hot path when under the limit: the device and capture state (two driver
 * calls), a table lookup, loads of the remembered time and of tat, one
 * fetch_add on tat; a clock is read only when tat gets near the remembered
 * time. No lock, no syscall; a sleep only when the container is over its
 * share. When no GPU of the container is limited (all at 100%), the hooks
 * only forward.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <unistd.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "measured.h"
#include "real.h"
#include "region.h"
#include "vcuda.h"

#define SLACK_NS 2000000ull    /* work admitted ahead of the clock */
#define BURST_NS 20000000ull   /* credit earned by idling, at most */
#define SAMPLE_EVERY 64
#define SAMPLE_ODDS 8 /* a launch is sampled with odds 1 in SAMPLE_ODDS */
#define SAMPLE_WAVES 32 /* ... or waves in SAMPLE_WAVES, if more */
#define SAMPLE_GAP_NS 1000000ull
#define EST_BITS 12
/* A sample moves the estimate 1/EST_GAIN of the way: 32, not 16, since a
 * kernel whose time varies x0.2/x1.8 left a 16-sample mean 14% off (one
 * standard deviation); a step change takes ~32 samples of its bucket. */
#define EST_GAIN 32


/* Per-process estimates: key (function and shape, or graph exec; plus the
 * wave bucket) -> ns per wave, and the shape's occupancy. */
typedef struct {
    _Atomic uint64_t key;
    _Atomic uint64_t est_ns;
    _Atomic uint32_t occ;        /* resident blocks per SM; 0 = not asked yet */
    _Atomic uint32_t samples;    /* how many samples the estimate has seen (up to EST_GAIN) */
} est_entry;
static est_entry est_table[1u << EST_BITS];
/* Fallback for keys not measured yet, per GPU: [0] kernels (ns per wave),
 * [1] graphs (ns per launch); the units differ, so they are kept apart. */
static _Atomic uint64_t est_global[VC_MAX_GPUS][2];

static est_entry *est_get(uint64_t key) {
    uint64_t mask = (1u << EST_BITS) - 1, i = (key * 0x9e3779b97f4a7c15ULL) >> (64 - EST_BITS);
    for (unsigned n = 0; n < 32; n++, i = (i + 1) & mask) {
        uint64_t k = atomic_load_explicit(&est_table[i].key, memory_order_relaxed);
        if (k == key)
            return &est_table[i];
        if (k == 0) {
            if (atomic_compare_exchange_strong(&est_table[i].key, &k, key))
                return &est_table[i];
            if (k == key)
                return &est_table[i];
        }
    }
    return NULL; /* table crowded: use the per-GPU estimate */
}

/* One measurement: a launch bracketed by two events. */
typedef struct {
    CUcontext ctx; /* the events' */
    CUevent ev[2];
    int g;
    int graph;
    uint64_t key, waves, charged_ns, pred_wait, model_ns;
    uint64_t host_ns; /* host time the events bracket, not the kernel's (a gate that gave up) */
    uint64_t start_by; /* its start event is overdue after this (the predicted start + OVERDUE_NS) */
    int started;       /* its start event has completed */
    double charged_frac; /* share of the sampled launch's cost that was charged (overlap) */
} sample_slot;
/* Measurements in flight per thread. One was too few: a sample completes
 * only when the device reaches it, behind the queue (tens of ms when
 * co-tenants' work is queued too), so a process took a few dozen samples a
 * second, and the estimate of a kernel whose time varies x0.2/x1.8 was off
 * by tens of percent for a whole second (a 50% container got 90%). */
#ifndef VC_MUTATE_ONE_SAMPLE
#define SAMPLE_RING 16
#else
#define SAMPLE_RING 1 /* the old limiter: one sample in flight, odds 1 in 8 whatever the grid */
#endif
typedef struct {
    sample_slot *ring; /* SAMPLE_RING slots, allocated at the thread's first sample */
    uint32_t head, tail; /* in flight: ring[head..tail) (mod SAMPLE_RING) */
    uint32_t chk;        /* ring[head..chk) are known to have started (backlog_wait) */
    uint32_t launches;
    uint64_t sampled_at; /* last_now at this thread's last sample */
    uint64_t rng;        /* xorshift state: which launches are sampled */
    /* Device time charged but not yet added to the region's busy_ns
     * (batched: one shared write per SAMPLE_EVERY launches). */
    int busy_g;
    uint64_t busy_acc, busy_debt;
    /* A failed measurement backs sampling off for SAMPLE_EVERY launches, so
     * a driver that refuses event calls never gates every launch. */
    uint32_t no_sample_until;
} sampler;
/* vcuda is loaded at process start (preload), so its TLS can live in the
 * static block: no __tls_get_addr call on the hot path. */
static _Thread_local sampler tls __attribute__((tls_model("initial-exec")));

/* The estimate is the mean of the samples (an exponentially weighted one,
 * so it follows a workload that changes). It must move up and down at the
 * same rate: believing short samples faster than long ones (as this once
 * did, to discount interference) makes the estimate the low tail of the
 * distribution, and a kernel whose time varies x0.2..x1.8 was granted 1.9x
 * its share. Interference that lengthens a sample is corrected, on average,
 * by the closed loop (loop_update) rather than by a biased estimate. */
static void update_est(est_entry *e, int g, int graph, uint64_t v) {
    _Atomic uint64_t *slots[2] = {e ? &e->est_ns : NULL, &est_global[g][graph]};
    for (int i = 0; i < 2; i++) {
        if (!slots[i])
            continue;
        uint64_t old = atomic_load_explicit(slots[i], memory_order_relaxed), nv;
        /* the first EST_GAIN samples of a key: their plain mean (one short
         * first sample must not price the key for the next hundred) */
        uint32_t n = i == 0 ? atomic_load_explicit(&e->samples, memory_order_relaxed) : EST_GAIN;
        if (i == 0 && n < EST_GAIN)
            atomic_store_explicit(&e->samples, n + 1, memory_order_relaxed);
        if (old == 0)
            nv = v;
#ifdef VC_MUTATE_ASYMMETRIC
        else if (v < old)
            nv = (old + v) / 2; /* the old estimator: a shorter sample believed 4x faster */
        else
            nv = old + (v - old) / 8;
#else
        else
            nv = (uint64_t)((int64_t)old + ((int64_t)v - (int64_t)old) / (int64_t)(n < EST_GAIN ? n + 1 : EST_GAIN));
#endif
        atomic_store_explicit(slots[i], nv ? nv : 1, memory_order_relaxed);
    }
}

/*
 * The closed loop: per GPU, the device time the sampled launches really took
 * over what the model predicted for them (both decayed sums, a ratio of sums
 * so a workload's mix of long and short kernels weighs as device time does).
 * Every launch's predicted cost is multiplied by it. The model (per key and
 * wave bucket) prices launches relative to each other at once; the loop
 * removes what the model gets wrong overall (a key whose estimate lags a
 * growing kernel, a shape whose waves it cannot see, interference) within
 * about LOOP_DECAY samples, whatever the cause. Samples are the only device
 * time the process can measure without a privileged counter (NVML's
 * per-process utilisation is coarse, 1/6 s at best, and not readable in the
 * container); the region's busy time is the limiter's own charge, not a
 * measurement.
 */
#define LOOP_DECAY 128
#define LOOP_MIN 0.25
#define LOOP_MAX 4.0
/* The loop corrects nothing until it has this many samples: its first
 * ratios are single samples (x0.1 or x9 for a kernel that varies x0.2/x1.8),
 * and one of them held every cost at the clamp for a second. */
#define LOOP_WARM 32
static struct {
    _Atomic int lock;
    uint32_t n;
    double meas, pred;
    _Atomic double corr; /* 0 = 1 (no samples yet) */
} loop[VC_MAX_GPUS];
static void loop_update(int g, uint64_t meas, uint64_t pred) {
    if (!pred)
        return;
    int z = 0;
    if (!atomic_compare_exchange_strong(&loop[g].lock, &z, 1))
        return; /* another thread is updating: one sample less */
    loop[g].meas = loop[g].meas * (1 - 1.0 / LOOP_DECAY) + (double)meas;
    loop[g].pred = loop[g].pred * (1 - 1.0 / LOOP_DECAY) + (double)pred;
    if (++loop[g].n < LOOP_WARM) {
        atomic_store_explicit(&loop[g].lock, 0, memory_order_release);
        return;
    }
    loop[g].n = LOOP_WARM;
    double c = loop[g].meas / loop[g].pred;
    c = c < LOOP_MIN ? LOOP_MIN : c > LOOP_MAX ? LOOP_MAX : c;
#ifdef VC_MUTATE_NO_LOOP
    c = 1;
#endif
    atomic_store_explicit(&loop[g].corr, c, memory_order_relaxed);
    atomic_store_explicit(&loop[g].lock, 0, memory_order_release);
}

#define FACTOR_DEVS 256
static _Atomic double kfactor[FACTOR_DEVS]; /* per device ordinal, 0 = not computed */

/* The latest clock reading of any thread of this process: a lower bound of
 * the current time that costs one load. */
static _Atomic uint64_t last_now;
static void remember_now(uint64_t now) {
    uint64_t old = atomic_load_explicit(&last_now, memory_order_relaxed);
    while (old < now && !atomic_compare_exchange_weak_explicit(&last_now, &old, now, memory_order_relaxed,
                                                               memory_order_relaxed))
        ;
}

/* busy_acc is the raw charge (before the measured factor, measured.c): it
 * goes to the process's raw total as it is, and to the exported busy_ns
 * as charged. */
static void flush_busy(void) {
    if (tls.busy_acc) {
        atomic_fetch_add_explicit(&vc_meas_raw[tls.busy_g], tls.busy_acc, memory_order_relaxed);
        atomic_fetch_add_explicit(&vc_region_gpu_rec(tls.busy_g)->busy_ns,
                                  (uint64_t)((double)tls.busy_acc * vc_measured_factor(tls.busy_g)),
                                  memory_order_relaxed);
    }
    tls.busy_acc = 0;
}
static inline void add_busy(int g, uint64_t ns) {
    if (VC_UNLIKELY(tls.busy_g != g)) {
        flush_busy();
        tls.busy_g = g;
        tls.busy_debt = 0;
    }
    if (VC_UNLIKELY(tls.busy_debt)) { /* refunds not yet taken off (busy_ns only grows) */
        uint64_t d = tls.busy_debt < ns ? tls.busy_debt : ns;
        tls.busy_debt -= d;
        ns -= d;
    }
    tls.busy_acc += ns;
}

static void charge_tat(int g, uint64_t cost_ns) {
    uint32_t p = vc_g.limits.gpu[g].cores;
    if (cost_ns) {
        atomic_fetch_add_explicit(&vc_region_gpu_rec(g)->tat,
                                  (uint64_t)((double)cost_ns * 100 / p * vc_measured_factor(g)), memory_order_relaxed);
        add_busy(g, cost_ns);
    }
}

static void refund_tat(int g, uint64_t cost_ns) {
    uint64_t back = (uint64_t)((double)cost_ns * 100 / vc_g.limits.gpu[g].cores * vc_measured_factor(g));
    _Atomic uint64_t *tat = &vc_region_gpu_rec(g)->tat;
    uint64_t t = atomic_load_explicit(tat, memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(tat, &t, t > back ? t - back : 0, memory_order_relaxed,
                                                  memory_order_relaxed))
        ;
    if (tls.busy_g == g) {
        uint64_t d = cost_ns < tls.busy_acc ? cost_ns : tls.busy_acc;
        tls.busy_acc -= d;
        tls.busy_debt += cost_ns - d;
    }
}

/* The limiter's event calls must not count as the application's: under
 * global capture mode they would invalidate a capture in progress on any
 * thread. Relaxed mode is exempt; the thread's own mode is restored after. */
static int relax(void) {
    int mode = 2; /* CU_STREAM_CAPTURE_MODE_RELAXED */
    if (!vc_real.cuThreadExchangeStreamCaptureMode || vc_real.cuThreadExchangeStreamCaptureMode(&mode) != CUDA_SUCCESS)
        return -1;
    return mode;
}
static void unrelax(int mode) {
    if (mode >= 0)
        vc_real.cuThreadExchangeStreamCaptureMode(&mode);
}

/* Harvest this thread's finished measurements, oldest first, up to the
 * first still running. wait: block for the oldest. */
static void harvest(int wait) {
    if (tls.head == tls.tail)
        return;
#ifndef VC_MUTATE_NO_RELAX
    int mode = relax();
#else
    int mode = -1;
#endif
    for (; tls.head != tls.tail; tls.head++, wait = 0) {
        sample_slot *sl = &tls.ring[tls.head % SAMPLE_RING];
        CUresult r = wait ? vc_real.cuEventSynchronize(sl->ev[1]) : vc_real.cuEventQuery(sl->ev[1]);
        if (r == CUDA_ERROR_NOT_READY)
            break;
        float ms = 0;
        if (r != CUDA_SUCCESS || vc_real.cuEventElapsedTime(&ms, sl->ev[0], sl->ev[1]) != CUDA_SUCCESS ||
            ms < 0) {
            tls.no_sample_until = tls.launches + SAMPLE_EVERY;
            continue;
        }
        uint64_t t = (uint64_t)((double)ms * 1e6);
#ifndef VC_MUTATE_EXPIRED_IN_FULL
        /* A gate that gave up let the start event complete before the
         * kernel was submitted: the host time from the give-up to the
         * launch call is not the kernel's (one sample of a launcher kept
         * off the CPU for 0.4 s, settled in full, took a 30% container to
         * 3.7% for seconds). What is left may run short by however late
         * the driver's callback thread let the stream go on (ms on a loaded
         * host, and a process can starve its own callback thread), so such
         * a sample is never taken below the launch's admission price: it
         * can raise the price, never lower it (fail closed), and never by
         * more than it measured. */
        if (sl->host_ns) {
            uint64_t k = t > sl->host_ns ? t - sl->host_ns : 0;
            if (k < sl->charged_ns)
                k = sl->charged_ns;
            if (k < t)
                t = k;
        }
#endif
        /* A kernel that fills the device first waits for other streams' work;
         * the predicted wait is not its own time. */
        if (t > 2 * sl->pred_wait)
            t -= sl->pred_wait;
        uint64_t v = sl->waves ? t / sl->waves : t;
        update_est(est_get(sl->key), sl->g, sl->graph, v);
        loop_update(sl->g, t, sl->model_ns);
        /* Settle the sampled launch itself at its measured cost (the part of
         * it that was not predicted to overlap other streams' work), up or
         * down: settling only launches that ran long would overcharge a
         * workload whose times vary. */
        if (t > sl->charged_ns)
            charge_tat(sl->g, (uint64_t)((double)(t - sl->charged_ns) * sl->charged_frac));
        else
            refund_tat(sl->g, (uint64_t)((double)(sl->charged_ns - t) * sl->charged_frac));
    }
    unrelax(mode);
}

/*
 * The limiter charges a launch when it admits it. While a sampling gate
 * holds a stream (its host function waits for the driver's callback thread,
 * which a loaded CPU runs late), work admitted behind it waits unscheduled,
 * then runs back to back: on the fake, 147 ms of it at a 50% cap, against
 * the 11 ms (SLACK + BURST) the limiter otherwise lets run ahead, so a
 * second's charge was off by the backlog at its ends. So while the oldest
 * of this thread's samples not yet seen started is OVERDUE_NS past its
 * predicted start, the launcher waits (polling its start event, at most
 * BACKLOG_WAIT_NS for a sample, so a stream held by the application's own
 * host function cannot stop it for good): the backlog stays about
 * OVERDUE_NS x the share. A co-tenant's queue (time slicing, ~20 ms on the
 * fake) delays a start without any gate, and must not pace the container:
 * at 20 ms a 10% container beside a 70% one got 8.3-9.8% (six runs, 9.7-10.2
 * without the wait), at 50 ms 9.3-9.6%, its backlog still capped.
 */
#define OVERDUE_NS 50000000ull
#define BACKLOG_WAIT_NS 250000000ull
static uint64_t backlog_wait(void) {
    if ((int32_t)(tls.chk - tls.head) < 0)
        tls.chk = tls.head;
    while (tls.chk != tls.tail && tls.ring[tls.chk % SAMPLE_RING].started)
        tls.chk++;
    if (tls.chk == tls.tail)
        return 0;
    sample_slot *sl = &tls.ring[tls.chk % SAMPLE_RING];
    if (atomic_load_explicit(&last_now, memory_order_relaxed) < sl->start_by)
        return 0;
#ifndef VC_MUTATE_NO_RELAX
    int mode = relax();
#else
    int mode = -1;
#endif
    uint64_t t0 = 0, now = 0;
    for (;;) {
        CUresult r = vc_real.cuEventQuery(sl->ev[0]);
        if (r != CUDA_ERROR_NOT_READY) {
            sl->started = 1; /* run, or failed: harvest deals with it */
            break;
        }
        now = vc_now_ns();
        remember_now(now);
        if (!t0)
            t0 = now;
        if (now < sl->start_by || now - t0 >= BACKLOG_WAIT_NS) {
            if (now - t0 >= BACKLOG_WAIT_NS)
                sl->started = 1; /* held by something else: stop waiting on it */
            break;
        }
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
    unrelax(mode);
    return t0 ? now - t0 : 0;
}

typedef struct {
    int sample;
    int ptsz;
    CUstream stream;
    struct gate *gate;
    int dslot;     /* a device gate: its word index + 1 (0: none) */
    uint32_t dseq; /* ... and the value that opens it */
    uint64_t rec0_ns;   /* a sampled launch: the clock after its start event was recorded */
    uint64_t submit_ns; /* ... and just before the launch call */
} launch_ctx;

/*
 * A sample must time the kernel, not the host: on an idle GPU the start
 * event would complete as soon as it is submitted, and the elapsed time would
 * include the host's launch overhead between the two events (a launch-bound
 * container would be charged for GPU time it never used). So a sampled launch
 * is gated: a host function at the head of the stream holds it until the
 * start event, the kernel and the end event are all queued, then the device
 * runs them back to back. The gate opens within microseconds; the host
 * function gives up after GATE_MAX_NS in any case, so the stream can never be
 * held for long (e.g. if the launch blocks on a full queue).
 */
#define GATE_MAX_NS 5000000ull
/* Two hold a gate: the host function (until it stops waiting) and the
 * launcher (until it opens it); the last to let go frees it. The host
 * function gives up after GATE_MAX_NS, which a launcher descheduled between
 * closing and opening the gate outlasts on a loaded machine: a gate freed by
 * the host function alone was then written by the launcher, a heap
 * corruption in the tenant's process (malloc's "unaligned fastbin chunk"). */
struct gate {
    _Atomic int open;
    _Atomic int refs;
    _Atomic uint64_t gave_up; /* when the host function stopped waiting, unopened; 0: it did not */
#ifdef VCUDA_TEST_HOOKS
    unsigned stall_ms; /* VCUDA_TEST_DELAY=gatefn: the first gate's host function waits this long first */
#endif
};
#ifdef VCUDA_TEST_HOOKS
/* Test build: a gate is never freed but marked released, so a write after
 * release is caught at once instead of corrupting the heap silently. */
#define GATE_RELEASED 0x5eed
static void gate_free(struct gate *gt) { atomic_store(&gt->open, GATE_RELEASED); }
#else
static void gate_free(struct gate *gt) { free(gt); }
#endif
static void gate_put(struct gate *gt) {
    if (atomic_fetch_sub_explicit(&gt->refs, 1, memory_order_acq_rel) == 1)
        gate_free(gt);
}
static void gate_wait(void *p) {
    struct gate *gt = p;
#ifdef VCUDA_TEST_HOOKS
    if (gt->stall_ms) { /* the driver's callback thread kept off the CPU */
        struct timespec ts = {gt->stall_ms / 1000, (long)(gt->stall_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
#endif
    uint64_t start = 0;
    for (unsigned i = 0; !atomic_load_explicit(&gt->open, memory_order_acquire); i++) {
        if (i < 2000) {
            VC_CPU_RELAX();
            continue;
        }
        uint64_t now = vc_now_ns();
        if (!start)
            start = now;
        else if (now - start > GATE_MAX_NS) {
            /* read last, just before the stream goes on: the start event
             * completes no earlier */
            atomic_store_explicit(&gt->gave_up, vc_now_ns(), memory_order_release);
            break;
        }
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
    gate_put(gt); /* the host function runs exactly once */
}

static struct gate *gate_close(launch_ctx *lc) {
    CUresult (*fn)(CUstream, void (*)(void *), void *) =
        lc->ptsz && vc_real.cuLaunchHostFunc_ptsz ? vc_real.cuLaunchHostFunc_ptsz : vc_real.cuLaunchHostFunc;
    struct gate *gt = fn ? malloc(sizeof(*gt)) : NULL;
    if (!gt)
        return NULL;
    atomic_store(&gt->open, 0);
    atomic_store(&gt->refs, 2);
    atomic_store(&gt->gave_up, 0);
#ifdef VCUDA_TEST_HOOKS
    /* read here, on the launcher: the host function's thread must not read
     * the environment the test thread writes */
    static int stalled;
    const char *d = getenv("VCUDA_TEST_DELAY"), *ms = getenv("VCUDA_TEST_DELAY_MS");
    gt->stall_ms = !stalled && d && ms && !strcmp(d, "gatefn") ? (unsigned)atoi(ms) : 0;
    stalled |= gt->stall_ms != 0;
#endif
    if (fn(lc->stream, gate_wait, gt) != CUDA_SUCCESS) {
        free(gt); /* the host function will never run */
        return NULL; /* sample ungated */
    }
    VC_TEST_DELAY("gate"); /* a launcher descheduled past GATE_MAX_NS */
    return gt;
}

static void gate_open(launch_ctx *lc) {
    if (lc->gate) {
#ifdef VCUDA_TEST_HOOKS
        if (atomic_load(&lc->gate->open) == GATE_RELEASED) {
            vc_log("test build: a sampling gate was opened after it was released");
            abort();
        }
#endif
        atomic_store_explicit(&lc->gate->open, 1, memory_order_release);
        gate_put(lc->gate);
    }
    lc->gate = NULL;
}

/*
 * The device gate. The host-function gate runs on the driver's callback
 * thread, so a fork-join round with a sampled launch waits for that thread
 * (multistream alone at 90% reached 66.4% of a 76.1% ceiling on the fake;
 * with sampling compiled out, its ceiling). Where the driver can, the gate
 * is a wait of the stream on a 32-bit word in pinned host memory mapped
 * for the device (cuStreamWaitValue32_v2, GEQ): the launcher closes it by
 * queueing the wait for the word's next value and opens it by storing that
 * value after its end event is queued; the device lets the stream go, no
 * host thread in between. The v2 stream memory operations need no module
 * parameter (the v1 ones did); the word needs CAN_MAP_HOST_MEMORY. Any
 * failure (attribute, allocation, mapping, the wait) leaves the
 * host-function gate in place: for the context, or for that launch.
 *
 * Each launcher thread owns one word index (DGATE_WORDS per context's
 * pool); a word only grows (cyclic GEQ), so a wait is released by its own
 * store or any later one and the word is never reset under a pending wait.
 * The words are in the container's own memory: a tenant that writes one
 * only opens its own gate early, so its sample times host overhead too,
 * which it could already fake in-process in many ways; its share is
 * backed by the node agent's NVML guard, not by this.
 *
 * A gate never opened: the launcher opens it right after the launch call
 * returns, failed or not; if the process dies the stream dies with its
 * context. But the launch call can block (a stream's queue filled behind
 * the wait by other threads would wait for the gate: a deadlock), and a
 * thread can be cancelled inside it, so a watchdog thread opens any gate
 * closed longer than GATE_MAX_NS, as the host function gives up, and notes
 * when (the sample is then settled as an expired one). It wakes every
 * DGATE_TICK_NS while gates are in use and sleeps otherwise.
 */
#define DGATE_WORDS 1024 /* one 4 KiB page of words per context */
#define DGATE_POOLS 16
#define DGATE_TICK_NS 1000000ull
typedef struct {
    _Atomic(CUcontext) ctx;
    int state; /* 1: words usable; -1: the device gate is off for this context */
    _Atomic uint32_t *words;
    CUdeviceptr dwords;
} dgate_pool;
static dgate_pool dpools[DGATE_POOLS];
static pthread_mutex_t dgate_mu = PTHREAD_MUTEX_INITIALIZER;
/* Per word index: closed gate (closed-at clock in ~1 ms units << 33, a
 * closed bit, the value that opens it), 0 when open; the word it waits on; when the
 * watchdog gave up on it. */
static _Atomic uint64_t dstate[DGATE_WORDS];
static _Atomic(_Atomic uint32_t *) dword[DGATE_WORDS];
static _Atomic uint64_t dgave_up[DGATE_WORDS];
static _Atomic uint32_t dused[DGATE_WORDS / 32];
static _Atomic uint32_t dslot_hw;
static _Thread_local int tls_dslot __attribute__((tls_model("initial-exec"))); /* index + 1; -1: none free */
static _Atomic int wd_sleeping;
static pid_t wd_pid;
static pthread_cond_t wd_cv = PTHREAD_COND_INITIALIZER;

#define DGATE_UNITS(ns) (((ns) >> 20) & 0x7fffffffu) /* ~1 ms units, 31 bits */
static uint64_t dgate_closed_state(uint64_t now, uint32_t seq) {
    return (DGATE_UNITS(now) << 33) | (1ull << 32) | seq;
}
static int dgate_expired(uint64_t st, uint64_t now) {
    return ((DGATE_UNITS(now) - (st >> 33)) & 0x7fffffffu) > (GATE_MAX_NS >> 20);
}
/* Open every gate closed too long (under dgate_mu). Returns whether any
 * gate is closed. */
static int dgate_sweep(void) {
    int closed = 0;
    uint32_t n = atomic_load(&dslot_hw);
    uint64_t now = vc_now_ns();
    for (uint32_t i = 0; i < n && i < DGATE_WORDS; i++) {
        uint64_t st = atomic_load(&dstate[i]);
        if (!st)
            continue;
        closed = 1;
        if (dgate_expired(st, now) && atomic_compare_exchange_strong(&dstate[i], &st, 0)) {
            atomic_store(&dgave_up[i], vc_now_ns());
            _Atomic uint32_t *w = atomic_load(&dword[i]);
            if (w)
                atomic_store_explicit(w, (uint32_t)st, memory_order_release);
        }
    }
    return closed;
}
static void *dgate_watchdog(void *arg) {
    (void)arg;
    for (unsigned idle = 0;;) {
        pthread_mutex_lock(&dgate_mu);
        idle = dgate_sweep() ? 0 : idle + 1;
        if (idle > 200) { /* no gate for ~200 ms: sleep until one closes */
            atomic_store(&wd_sleeping, 1);
            while (!dgate_sweep() && atomic_load(&wd_sleeping))
                pthread_cond_wait(&wd_cv, &dgate_mu);
            atomic_store(&wd_sleeping, 0);
            idle = 0;
        }
        pthread_mutex_unlock(&dgate_mu);
        struct timespec ts = {0, (long)DGATE_TICK_NS};
        nanosleep(&ts, NULL);
    }
    return NULL;
}
static void dgate_wake_watchdog(void) {
    if (atomic_load(&wd_sleeping)) {
        pthread_mutex_lock(&dgate_mu);
        atomic_store(&wd_sleeping, 0);
        pthread_cond_signal(&wd_cv);
        pthread_mutex_unlock(&dgate_mu);
    }
}
/* Under dgate_mu: a watchdog for this process (a forked child has none). */
static int dgate_watchdog_running(void) {
    if (wd_pid == getpid())
        return 1;
#ifdef VC_MUTATE_NO_WATCHDOG
    (void)dgate_watchdog;
    return 1; /* no give-up: a gate stays closed until its launcher opens it */
#endif
    pthread_t t;
    pthread_attr_t a;
    if (pthread_attr_init(&a) != 0)
        return 0;
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    int ok = pthread_create(&t, &a, dgate_watchdog, NULL) == 0;
    pthread_attr_destroy(&a);
    if (ok)
        wd_pid = getpid();
    return ok;
}

/* This thread's word index, or -1. */
static int dgate_slot(void) {
    if (VC_LIKELY(tls_dslot > 0))
        return tls_dslot - 1;
    if (tls_dslot < 0)
        return -1;
    for (uint32_t i = 0; i < DGATE_WORDS / 32; i++) {
        uint32_t m = atomic_load(&dused[i]);
        while (~m) {
            uint32_t b = (uint32_t)__builtin_ctz(~m);
            if (atomic_compare_exchange_weak(&dused[i], &m, m | (1u << b))) {
                uint32_t slot = i * 32 + b, hw = atomic_load(&dslot_hw);
                while (hw <= slot && !atomic_compare_exchange_weak(&dslot_hw, &hw, slot + 1))
                    ;
                tls_dslot = (int)slot + 1;
                return (int)slot;
            }
        }
    }
    tls_dslot = -1; /* every word taken: this thread keeps the host-function gate */
    return -1;
}
/* A thread that ends gives its word index back (its gate is open). */
static void dgate_slot_free(void) {
    if (tls_dslot > 0) {
        uint32_t s = (uint32_t)tls_dslot - 1;
        atomic_fetch_and(&dused[s / 32], ~(1u << (s % 32)));
    }
    tls_dslot = 0;
}

/* The pool of ctx (dev its device), made at its first sampled launch and
 * never again on the launch path; NULL: the device gate is off there. */
static _Atomic int dgate_said_off; /* the host-function gate was said to be in use */
static void dgate_say_off(const char *why) {
    if (!atomic_exchange(&dgate_said_off, 1))
        vc_log("sampling gate: host function (%s)", why);
}
static dgate_pool *dgate_pool_of(CUcontext ctx, CUdevice dev) {
#ifdef VCUDA_HOST_GATE_ONLY
    /* test/gpu's second build: both gates measured on one GPU (never a production build) */
    (void)ctx, (void)dev;
    dgate_say_off("built with VCUDA_HOST_GATE_ONLY");
    return NULL;
#endif
    for (int i = 0; i < DGATE_POOLS; i++)
        if (atomic_load_explicit(&dpools[i].ctx, memory_order_acquire) == ctx)
            return dpools[i].state > 0 ? &dpools[i] : NULL;
    if (!vc_real.cuMemHostAlloc || !vc_real.cuMemHostGetDevicePointer_v2 || !vc_real.cuStreamWaitValue32_v2 ||
        !vc_real.cuDeviceGetAttribute)
        return NULL;
    pthread_mutex_lock(&dgate_mu);
    dgate_pool *p = NULL;
    for (int i = 0; i < DGATE_POOLS && !p; i++)
        if (atomic_load(&dpools[i].ctx) == ctx)
            p = &dpools[i];
    for (int i = 0; i < DGATE_POOLS && !p; i++)
        if (!atomic_load(&dpools[i].ctx))
            p = &dpools[i];
    if (!p || atomic_load(&p->ctx) == ctx) { /* table full, or made meanwhile */
        pthread_mutex_unlock(&dgate_mu);
        return p && p->state > 0 ? p : NULL;
    }
    /* under a global-mode capture elsewhere an allocation would invalidate it */
    int mode = relax(), can = 0;
    void *h = NULL;
    CUdeviceptr d = 0;
    p->state = -1;
    if (vc_real.cuDeviceGetAttribute(&can, CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, dev) == CUDA_SUCCESS && can &&
        dgate_watchdog_running() &&
        vc_real.cuMemHostAlloc(&h, DGATE_WORDS * sizeof(uint32_t), CU_MEMHOSTALLOC_DEVICEMAP) == CUDA_SUCCESS) {
        if (vc_real.cuMemHostGetDevicePointer_v2(&d, h, 0) == CUDA_SUCCESS) {
            p->words = h;
            p->dwords = d;
            p->state = 1;
        } else if (vc_real.cuMemFreeHost) {
            vc_real.cuMemFreeHost(h);
        }
    }
    unrelax(mode);
    atomic_store_explicit(&p->ctx, ctx, memory_order_release);
    pthread_mutex_unlock(&dgate_mu);
    if (p->state <= 0) /* once a process: the samples of this context measure the host's wake-up too */
        dgate_say_off("no device-mapped, pinned host memory for the device gate here");
    return p->state > 0 ? p : NULL;
}
/* Before ctx is destroyed (freeh: free the words; the driver has not yet)
 * or after (it freed them with the context): forget its pool; a gate
 * closed there is dropped, its stream going with the context. */
void vc_dgate_ctx_gone(CUcontext ctx, int freeh) {
    pthread_mutex_lock(&dgate_mu);
    for (int i = 0; i < DGATE_POOLS; i++) {
        dgate_pool *p = &dpools[i];
        if (atomic_load(&p->ctx) != ctx)
            continue;
        for (uint32_t s = 0; s < DGATE_WORDS; s++) {
            _Atomic uint32_t *w = atomic_load(&dword[s]);
            if (p->words && w >= p->words && w < p->words + DGATE_WORDS) {
                atomic_store(&dstate[s], 0);
                atomic_store(&dword[s], NULL);
            }
        }
        if (freeh && p->words && vc_real.cuMemFreeHost && vc_real.cuCtxPushCurrent_v2 &&
            vc_real.cuCtxPushCurrent_v2(ctx) == CUDA_SUCCESS) {
            CUcontext o;
            vc_real.cuMemFreeHost((void *)p->words);
            vc_real.cuCtxPopCurrent_v2(&o);
        }
        p->words = NULL;
        p->dwords = 0;
        p->state = 0;
        atomic_store(&p->ctx, NULL);
    }
    pthread_mutex_unlock(&dgate_mu);
}

/* Close a device gate on the launch's stream; 0 if it cannot be (the
 * host-function gate is used instead). */
static int dgate_close(launch_ctx *lc, CUcontext ctx, CUdevice dev) {
    int slot = dgate_slot();
    dgate_pool *p = slot >= 0 ? dgate_pool_of(ctx, dev) : NULL;
    if (!p)
        return 0;
    CUresult (*wait)(CUstream, CUdeviceptr, uint32_t, unsigned int) =
        lc->ptsz && vc_real.cuStreamWaitValue32_v2_ptsz ? vc_real.cuStreamWaitValue32_v2_ptsz
                                                         : vc_real.cuStreamWaitValue32_v2;
    _Atomic uint32_t *w = &p->words[slot];
    uint32_t seq = atomic_load_explicit(w, memory_order_relaxed) + 1;
    atomic_store(&dword[slot], w);
    atomic_store(&dgave_up[slot], 0);
    atomic_store(&dstate[slot], dgate_closed_state(vc_now_ns(), seq));
    dgate_wake_watchdog();
    CUresult r = wait(lc->stream, p->dwords + (CUdeviceptr)slot * sizeof(uint32_t), seq, CU_STREAM_WAIT_VALUE_GEQ);
    if (r != CUDA_SUCCESS) {
        atomic_store(&dstate[slot], 0);
        if (r == CUDA_ERROR_NOT_SUPPORTED) { /* no stream memory operations here: stop trying */
            pthread_mutex_lock(&dgate_mu);
            if (atomic_load(&p->ctx) == ctx)
                p->state = -1;
            pthread_mutex_unlock(&dgate_mu);
            dgate_say_off("cuStreamWaitValue32_v2: not supported by this driver");
        }
        return 0;
    }
    lc->dslot = slot + 1;
    lc->dseq = seq;
    VC_TEST_DELAY("gate"); /* a launcher descheduled past GATE_MAX_NS */
    return 1;
}
/* Open it; returns when the watchdog gave up on it, 0 if it did not. */
static uint64_t dgate_open(launch_ctx *lc) {
    if (!lc->dslot)
        return 0;
    int slot = lc->dslot - 1;
    lc->dslot = 0;
#ifdef VC_MUTATE_DGATE_STUCK
    (void)slot;
    return 0; /* the launcher never opens its gate: the watchdog does, GATE_MAX_NS later */
#endif
    uint64_t gave_up = 0;
    if (!atomic_exchange(&dstate[slot], 0)) {
        /* the watchdog gave up (or the context went): let it finish */
        pthread_mutex_lock(&dgate_mu);
        pthread_mutex_unlock(&dgate_mu);
        gave_up = atomic_load(&dgave_up[slot]);
    }
    _Atomic uint32_t *w = atomic_load(&dword[slot]);
    if (w)
        atomic_store_explicit(w, lc->dseq, memory_order_release);
    return gave_up;
}

/* A thread that ends gives its ring's events back (a pool that starts
 * launcher threads again and again would otherwise leak up to 2 x
 * SAMPLE_RING events each; the driver frees an event still pending when it
 * completes). */
static pthread_key_t ring_key;
static pthread_once_t ring_once = PTHREAD_ONCE_INIT;
static void ring_free(void *p) {
    sample_slot *ring = p;
    dgate_slot_free();
    for (int i = 0; i < SAMPLE_RING; i++)
        for (int k = 0; k < 2; k++)
            if (ring[i].ev[k])
                vc_real.cuEventDestroy_v2(ring[i].ev[k]);
    free(ring);
}
static void ring_key_init(void) {
    if (pthread_key_create(&ring_key, ring_free) != 0)
        ring_key = (pthread_key_t)-1;
}

/* The slot the next sample goes in, its events made in the current context;
 * NULL if every slot is in flight or events cannot be made. */
static sample_slot *free_slot(void) {
    if (tls.tail - tls.head >= SAMPLE_RING)
        return NULL;
    if (!tls.ring) {
        pthread_once(&ring_once, ring_key_init);
        if (ring_key == (pthread_key_t)-1 || !(tls.ring = calloc(SAMPLE_RING, sizeof(sample_slot))))
            return NULL;
        if (pthread_setspecific(ring_key, tls.ring) != 0) {
            free(tls.ring);
            tls.ring = NULL;
            return NULL;
        }
    }
    sample_slot *sl = &tls.ring[tls.tail % SAMPLE_RING];
    CUcontext cur = NULL;
    if (!vc_real.cuCtxGetCurrent || vc_real.cuCtxGetCurrent(&cur) != CUDA_SUCCESS || !cur)
        return NULL;
    if (sl->ctx == cur && sl->ev[0])
        return sl;
    sl->ctx = NULL;
    if (vc_real.cuEventCreate(&sl->ev[0], 0) != CUDA_SUCCESS)
        return NULL;
    if (vc_real.cuEventCreate(&sl->ev[1], 0) != CUDA_SUCCESS) {
        vc_real.cuEventDestroy_v2(sl->ev[0]);
        sl->ev[0] = NULL;
        return NULL;
    }
    sl->ctx = cur;
    return sl;
}

static CUresult record(launch_ctx *lc, CUevent ev) {
    if (lc->ptsz && vc_real.cuEventRecord_ptsz)
        return vc_real.cuEventRecord_ptsz(ev, lc->stream);
    return vc_real.cuEventRecord(ev, lc->stream);
}

/* ---- the predicted device timeline (overlap of streams) ---- */

/* Per process and device: when the predicted work ends, and when the last
 * device-filling kernel ends. Per stream: when its predicted work ends. */
static _Atomic uint64_t pred_all[FACTOR_DEVS], pred_excl[FACTOR_DEVS];
#define STREAM_BITS 8
static struct {
    _Atomic uint64_t key;
    _Atomic uint64_t until;
} pred_stream[1u << STREAM_BITS];
static _Thread_local uint64_t tls_skey __attribute__((tls_model("initial-exec")));
static _Thread_local _Atomic uint64_t *tls_suntil __attribute__((tls_model("initial-exec")));

static _Atomic uint64_t *stream_slot(uint64_t skey) {
    if (VC_LIKELY(tls_skey == skey && tls_suntil))
        return tls_suntil;
    uint64_t mask = (1u << STREAM_BITS) - 1, i = (skey * 0x9e3779b97f4a7c15ULL) >> (64 - STREAM_BITS);
    _Atomic uint64_t *slot = NULL;
    for (unsigned n = 0; n < 16 && !slot; n++, i = (i + 1) & mask) {
        uint64_t k = atomic_load_explicit(&pred_stream[i].key, memory_order_relaxed);
        if (k == skey || (k == 0 && (atomic_compare_exchange_strong(&pred_stream[i].key, &k, skey) || k == skey)))
            slot = &pred_stream[i].until;
    }
    tls_skey = skey;
    tls_suntil = slot;
    return slot; /* NULL: table crowded; the launch is charged in full */
}

static inline void atomic_max64(_Atomic uint64_t *a, uint64_t v) {
    uint64_t o = atomic_load_explicit(a, memory_order_relaxed);
    while (o < v && !atomic_compare_exchange_weak_explicit(a, &o, v, memory_order_relaxed, memory_order_relaxed))
        ;
}

/* What a launch of `cost` ns starting no earlier than `now` adds to the
 * predicted busy union; commit: record it in the prediction. */
static _Thread_local uint64_t tls_pred_wait __attribute__((tls_model("initial-exec")));
static _Thread_local uint64_t tls_pred_start __attribute__((tls_model("initial-exec")));
static uint64_t union_charge(CUdevice dev, CUstream stream, uint64_t cost, int full, uint64_t now, int commit) {
#ifdef VC_MUTATE_NO_OVERLAP
    (void)dev, (void)stream, (void)full, (void)now, (void)commit, (void)pred_all, (void)pred_excl, (void)stream_slot;
    return cost;
#else
    if (dev < 0 || dev >= FACTOR_DEVS)
        return cost;
    _Atomic uint64_t *su = stream_slot((uint64_t)(uintptr_t)stream ^ ((uint64_t)(dev + 1) << 56));
    if (!su)
        return cost;
    uint64_t start = atomic_load_explicit(su, memory_order_relaxed);
    uint64_t all = atomic_load_explicit(&pred_all[dev], memory_order_relaxed);
    if (start < now)
        start = now;
    uint64_t own_start = start; /* when its own stream lets it go */
    if (full) {
        if (start < all)
            start = all;
    } else {
        uint64_t ex = atomic_load_explicit(&pred_excl[dev], memory_order_relaxed);
        if (start < ex)
            start = ex;
    }
    uint64_t end = start + cost;
    tls_pred_wait = start - own_start; /* waiting for other streams: not its own time */
    tls_pred_start = start;
    if (commit) {
        atomic_store_explicit(su, end, memory_order_relaxed);
        atomic_max64(&pred_all[dev], end);
        if (full)
            atomic_max64(&pred_excl[dev], end);
    }
    if (end <= all)
        return 0; /* entirely under work already charged */
    return start >= all ? cost : end - all;
#endif
}

/* Before a launch of `blocks` blocks of `threads` threads with `smem` bytes
 * of dynamic shared memory (blocks 0: a graph) keyed by key. Waits if the
 * container is over its share. */
static void before_launch(launch_ctx *lc, uint64_t key, uint64_t blocks, uint64_t threads, uint64_t smem, int graph) {
    lc->sample = 0;
    if (!ACTIVE() || !vc_g.any_limited)
        return;
    int g;
    CUdevice dev;
    if (vc_cur_gpu(&g, &dev) != CUDA_SUCCESS || g < 0)
        return;
    uint32_t p = vc_g.limits.gpu[g].cores;
    if (p >= 100)
        return;
    if (VC_UNLIKELY(!vc_real.cuEventQuery || !vc_real.cuEventElapsedTime || !vc_real.cuEventCreate ||
                    !vc_real.cuEventRecord || !vc_real.cuEventSynchronize))
        return;

    /* Work launched into a stream being captured does not run now: it is
     * charged when the graph is launched. And event calls on a capturing
     * stream would become part of the graph (or invalidate the capture), so
     * stay out entirely. */
    int capturing = 0;
    CUresult (*is_cap)(CUstream, int *) =
        lc->ptsz && vc_real.cuStreamIsCapturing_ptsz ? vc_real.cuStreamIsCapturing_ptsz
                                                     : vc_real.cuStreamIsCapturing;
    if (is_cap && (is_cap(lc->stream, &capturing) != CUDA_SUCCESS || capturing != 0))
        return;

    harvest(0);
#ifndef VC_MUTATE_NO_BACKLOG_CAP
    uint64_t held = tls.chk != tls.tail ? backlog_wait() : 0;
#else
    uint64_t held = 0;
#endif
    /* tat advance per ns of device time: 100 / p (floating point: a 64-bit
     * division per launch costs more than the rest of the hot path). */
    double kf = dev >= 0 && dev < FACTOR_DEVS ? atomic_load_explicit(&kfactor[dev], memory_order_relaxed) : 0;
    if (VC_UNLIKELY(kf == 0)) {
        kf = 100.0 / p;
#ifdef VC_MUTATE_RATE
        kf /= 1.099; /* 33.0% granted at a 30% cap */
#endif
        if (dev >= 0 && dev < FACTOR_DEVS)
            atomic_store_explicit(&kfactor[dev], kf, memory_order_relaxed);
    }
    /* ... times what the driver measured of this process over what it was
     * charged (measured.c; 1 without the node agent's file) */
    kf *= vc_measured_factor(g);

    /* Waves: blocks over what the device holds at once. */
    uint64_t skey = graph ? key : key ^ (threads * 0x100000001b3ULL) ^ (smem << 40);
    est_entry *e0 = est_get(skey), *e = e0;
    uint64_t waves = 1;
    int full = 1;
    if (!graph && blocks) {
#ifdef VC_MUTATE_NO_NORMALISE
        /* the old model: charged per block, as a share of the SMs */
        (void)threads, (void)smem;
        uint64_t sms = (uint64_t)vc_dev_sms(dev);
        waves = 0; /* cost below is est * blocks / sms */
        full = blocks >= sms;
        uint64_t per_wave = sms;
#else
        uint32_t occ = e0 ? atomic_load_explicit(&e0->occ, memory_order_relaxed) : 0;
        if (VC_UNLIKELY(occ == 0)) {
            int n = 0;
            if (!vc_real.cuOccupancyMaxActiveBlocksPerMultiprocessor ||
                vc_real.cuOccupancyMaxActiveBlocksPerMultiprocessor(&n, (CUfunction)(uintptr_t)key, (int)threads,
                                                                    (size_t)smem) != CUDA_SUCCESS ||
                n <= 0)
                n = 1; /* unknown: one block an SM, the most a launch can cost */
            occ = (uint32_t)n;
            if (e0)
                atomic_store_explicit(&e0->occ, occ, memory_order_relaxed);
        }
#ifdef VC_MUTATE_NO_SM
        uint64_t per_wave = occ; /* the SM count forgotten */
#else
        uint64_t per_wave = (uint64_t)vc_dev_sms(dev) * occ;
#endif
        if (blocks > per_wave) {
            waves = (blocks + per_wave - 1) / per_wave;
            /* per-wave time is kept per power-of-two bucket of waves */
#ifndef VC_MUTATE_NO_BUCKETS
            e = est_get(skey ^ ((uint64_t)(63 - __builtin_clzll(waves)) << 58) ^ 0x5bd1e995ULL);
#endif
        } else if (blocks < per_wave) {
            /* Below one wave, per power-of-two bucket of blocks: a partial
             * grid takes anywhere from a block's time to a whole wave's, and
             * grids of different sizes on different streams overlap for as
             * long as the longest, so each size needs its own figure */
#ifndef VC_MUTATE_NO_BUCKETS
            e = est_get(skey ^ ((uint64_t)(64 - __builtin_clzll(blocks)) << 52) ^ 0x27d4eb2dULL);
#endif
        }
        full = blocks >= per_wave;
#endif
        (void)per_wave;
    }
    uint64_t own = e ? atomic_load_explicit(&e->est_ns, memory_order_relaxed) : 0;
    if (!own && e != e0 && e0) /* a new bucket: the 1-wave figure (per wave: an upper bound) */
        own = atomic_load_explicit(&e0->est_ns, memory_order_relaxed);
    uint64_t est = own ? own : atomic_load_explicit(&est_global[g][graph], memory_order_relaxed);
    int own_est = e && atomic_load_explicit(&e->est_ns, memory_order_relaxed) != 0;
#ifdef VC_MUTATE_NO_NORMALISE
    uint64_t cost = graph || !blocks ? est : est * blocks / (uint64_t)vc_dev_sms(dev);
    (void)waves;
#else
    uint64_t cost = est * waves;
#endif
    uint64_t model = cost;
    double corr = atomic_load_explicit(&loop[g].corr, memory_order_relaxed);
    if (corr != 0)
        cost = (uint64_t)((double)cost * corr);

    /* What the launch adds to the predicted busy union. The prediction needs
     * the real time when streams interleave (a stale "now" could predict
     * overlap with work that has ended); one stream needs no clock. */
    uint64_t now = atomic_load_explicit(&last_now, memory_order_relaxed), slept = 0;
    uint64_t pnow = now;
    if (tls_skey != ((uint64_t)(uintptr_t)lc->stream ^ ((uint64_t)(dev + 1) << 56))) {
        pnow = vc_now_ns();
        remember_now(pnow);
    }
    /* A first look decides whether the launch must wait; the charge is
     * settled after admission, from when it really goes. */
    uint64_t charge = union_charge(dev, lc->stream, cost, full, pnow, 0);
    uint64_t inc = (uint64_t)((double)charge * kf);

    /* Admission: wait while tat is more than SLACK ahead of the clock; a
     * launch that adds less than half its cost (it runs mostly under work
     * already paid for on another stream) is not held back, or pacing would
     * serialise the application's streams. 
     * Any time value read earlier is a lower bound of "now", so deciding
     * "admit" on it is safe: first try the last value any thread of this
     * process read (no clock read at all), then the coarse clock (a vDSO
     * read of the last tick), and only when both say "wait" the precise
     * clock. Idle credit is forfeited (against a fresh reading) whenever tat
     * is BURST behind any reading, so at most BURST + SLACK can be admitted
     * between readings, as with a precise clock. */
    _Atomic uint64_t *tat = &vc_region_gpu_rec(g)->tat;
    int fresh = 0; /* 0: remembered, 1: coarse, 2: precise */
    /* A launch that mostly runs under work already charged (another
     * stream's) goes at once: its small charge still lands on tat, so the
     * next launch that adds real busy time pays for it. */
    int must_wait = inc && charge * 2 > cost;
    for (; must_wait;) {
        uint64_t t = atomic_load_explicit(tat, memory_order_relaxed);
        if (t + BURST_NS < now) {
            /* Idle for a while: forfeit credit beyond BURST, against a
             * fresh reading (a remembered one may be far behind). */
            if (fresh < 2) {
                now = vc_now_ns();
                fresh = 2;
                remember_now(now);
            }
            atomic_compare_exchange_strong(tat, &t, now - BURST_NS);
            continue;
        }
        if (t <= now + SLACK_NS)
            break;
        if (fresh < 2) {
            now = fresh == 0 ? vc_now_coarse_ns() : vc_now_ns();
            fresh++;
            remember_now(now);
            continue;
        }
        uint64_t wait = t - now - SLACK_NS;
        /* about to sleep anyway: export what this thread was charged, so a
         * loop of long kernels (few launches) is not seen idle for long */
        flush_busy();
        struct timespec ts = {(time_t)(wait / 1000000000ull), (long)(wait % 1000000000ull)};
        nanosleep(&ts, NULL);
        uint64_t after = vc_now_ns();
        slept += after - now;
        now = after;
        remember_now(now);
    }
    slept += held;
    if (slept) {
        vc_region_add_throttle(g, slept);
        pnow = now;
    }
    charge = union_charge(dev, lc->stream, cost, full, pnow, 1);
    inc = (uint64_t)((double)charge * kf);
    /* the node agent's measured file, read on a launch that has a clock
     * reading anyway (at most every 50 ms: a load and a compare until then) */
    vc_measured_tick(now);
    if (inc) {
        atomic_fetch_add_explicit(tat, inc, memory_order_relaxed);
        add_busy(g, charge);
    }

    /* Measure a key until it has its own estimate; then a launch drawn at
     * random (odds 1 in SAMPLE_ODDS, up to every launch for grids of many
     * waves: the more device time a launch holds, the more a wrong price
     * for it costs, and a sampled launch is settled at what it measured),
     * and at least one every SAMPLE_GAP (on
     * the remembered time) when launches are few (long kernels): the
     * estimate and the loop are means, their noise falls with the number of
     * samples. Whether a launch is sampled never depends on its own
     * duration nor on its key's estimate (a rule that sampled launches
     * predicted long sampled a varying kernel more when its estimate was
     * high, and held the estimate low), so the samples are an unbiased draw
     * of the workload. */
    uint32_t n = ++tls.launches;
    if (n % SAMPLE_EVERY == 0)
        flush_busy();
    uint64_t mine = e ? atomic_load_explicit(&e->est_ns, memory_order_relaxed) : 0;
    /* a random draw, not every n-th launch: a workload repeats itself (a
     * model's layers), and every n-th launch would measure the same few
     * kernels of it for ever */
    uint64_t x = tls.rng ? tls.rng : (uint64_t)(uintptr_t)&tls ^ now;
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    tls.rng = x;
    /* odds by the grid's shape (its waves), never by its estimate */
    uint64_t odds = waves < SAMPLE_WAVES / SAMPLE_ODDS ? SAMPLE_WAVES / SAMPLE_ODDS : waves;
#ifdef VC_MUTATE_ONE_SAMPLE
    odds = SAMPLE_WAVES / SAMPLE_ODDS;
#endif
    int due = !mine || x % SAMPLE_WAVES < odds || now - tls.sampled_at >= SAMPLE_GAP_NS;
    if (VC_UNLIKELY((int32_t)(n - tls.no_sample_until) < 0))
        due = 0;
#ifdef VC_MUTATE_NO_FEEDBACK
    due = 0; /* nothing measured: nothing learned, nothing settled */
#endif
    sample_slot *sl;
    if (due && (sl = free_slot())) {
        tls.sampled_at = now;
        if (!dgate_close(lc, sl->ctx, dev))
            lc->gate = gate_close(lc);
        if (record(lc, sl->ev[0]) != CUDA_SUCCESS) {
            dgate_open(lc);
            gate_open(lc);
        } else {
            lc->sample = 1;
            sl->g = g;
            sl->key = e == e0 ? skey : e ? atomic_load_explicit(&e->key, memory_order_relaxed) : skey;
#ifdef VC_MUTATE_NO_NORMALISE
            sl->waves = graph || !blocks ? 1 : 0;
            if (!graph && blocks) {
                uint64_t sms = (uint64_t)vc_dev_sms(dev);
                sl->key = skey;
                /* per-SM normalisation of the old model: t * sms / blocks */
                sl->waves = blocks >= sms ? blocks / sms : 1;
            }
#else
            sl->waves = waves;
#endif
            sl->graph = graph;
            sl->charged_ns = cost;
            /* the loop measures the model's error where the model has
             * a figure of the key's own; a first guess borrowed from
             * another bucket would drag it (a 16-wave grid priced at 16
             * times a whole wave of a small grid) */
            sl->model_ns = own_est ? model : 0;
            sl->pred_wait = tls_pred_wait;
            sl->charged_frac = cost ? (double)charge / (double)cost : 1;
            lc->rec0_ns = vc_now_ns();
            sl->started = 0;
            sl->start_by = (tls_pred_start > lc->rec0_ns ? tls_pred_start : lc->rec0_ns) + OVERDUE_NS;
            VC_TEST_DELAY("sampled"); /* a launcher descheduled before its sampled launch call */
            lc->submit_ns = vc_now_ns(); /* the kernel is submitted no earlier */
        }
    }
}

static void after_launch(launch_ctx *lc, CUresult r) {
    if (!lc->sample)
        return;
    sample_slot *sl = &tls.ring[tls.tail % SAMPLE_RING];
    int ok = r == CUDA_SUCCESS && record(lc, sl->ev[1]) == CUDA_SUCCESS;
    /* The start event completed when the stream reached it: at the gate's
     * give-up or at its recording, whichever came later (or later still:
     * see harvest); the kernel started no earlier than the launch call.
     * Read while this launcher still holds the gate; a give-up whose store
     * is not seen yet is missed, and the sample settled in full. */
    uint64_t gave_up = lc->dslot ? dgate_open(lc)
                       : lc->gate ? atomic_load_explicit(&lc->gate->gave_up, memory_order_acquire)
                                  : 0;
    uint64_t ev0_by = gave_up > lc->rec0_ns ? gave_up : lc->rec0_ns;
    sl->host_ns = gave_up && lc->submit_ns > ev0_by ? lc->submit_ns - ev0_by : 0;
    gate_open(lc);
    /* A sample whose gate gave up (the launcher was descheduled past
     * GATE_MAX_NS) timed the host too; it is kept, less the host time from
     * the give-up to the launch call (harvest): dropping it would let a
     * process that stalls its own launcher just before its long kernels
     * keep them out of the estimate (fail open). */
    if (!ok)
        return; /* the slot is reused by the next sample */
    tls.tail++;
    /* Nothing known yet for this GPU: calibrate once, synchronously, rather
     * than let a whole queue of unpriced work through. */
    if (atomic_load_explicit(&est_global[sl->g][sl->graph], memory_order_relaxed) == 0)
        harvest(1);
}

#define LAUNCH_BODY(fn, ptsz_, key, blocks, threads, smem, graph, stream_, call)                   \
    PROLOGUE(fn);                                                                                  \
    launch_ctx lc = {.ptsz = (ptsz_), .stream = (stream_), .gate = NULL};                          \
    before_launch(&lc, (uint64_t)(uintptr_t)(key), (blocks), (threads), (smem), (graph));          \
    CUresult r = call;                                                                             \
    after_launch(&lc, r);                                                                          \
    return r;

#define GRID(x, y, z) ((uint64_t)(x) * (uint64_t)(y) * (uint64_t)(z))

VC_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                  unsigned by, unsigned bz, unsigned shm, CUstream s, void **params,
                                  void **extra) {
    LAUNCH_BODY(cuLaunchKernel, 0, f, GRID(gx, gy, gz), GRID(bx, by, bz), shm, 0, s,
                vc_real.cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shm, s, params, extra));
}

VC_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                       unsigned bx, unsigned by, unsigned bz, unsigned shm,
                                       CUstream s, void **params, void **extra) {
    LAUNCH_BODY(cuLaunchKernel_ptsz, 1, f, GRID(gx, gy, gz), GRID(bx, by, bz), shm, 0, s,
                vc_real.cuLaunchKernel_ptsz(f, gx, gy, gz, bx, by, bz, shm, s, params, extra));
}

VC_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *cfg, CUfunction f, void **params,
                                    void **extra) {
    LAUNCH_BODY(cuLaunchKernelEx, 0, f, cfg ? GRID(cfg->gridDimX, cfg->gridDimY, cfg->gridDimZ) : 0,
                cfg ? GRID(cfg->blockDimX, cfg->blockDimY, cfg->blockDimZ) : 0, cfg ? cfg->sharedMemBytes : 0,
                0, cfg ? cfg->hStream : NULL, vc_real.cuLaunchKernelEx(cfg, f, params, extra));
}

VC_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *cfg, CUfunction f, void **params,
                                         void **extra) {
    LAUNCH_BODY(cuLaunchKernelEx_ptsz, 1, f,
                cfg ? GRID(cfg->gridDimX, cfg->gridDimY, cfg->gridDimZ) : 0,
                cfg ? GRID(cfg->blockDimX, cfg->blockDimY, cfg->blockDimZ) : 0, cfg ? cfg->sharedMemBytes : 0, 0,
                cfg ? cfg->hStream : NULL, vc_real.cuLaunchKernelEx_ptsz(cfg, f, params, extra));
}

VC_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                             unsigned bx, unsigned by, unsigned bz, unsigned shm,
                                             CUstream s, void **params) {
    LAUNCH_BODY(cuLaunchCooperativeKernel, 0, f, GRID(gx, gy, gz), GRID(bx, by, bz), shm, 0, s,
                vc_real.cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, shm, s, params));
}

VC_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy,
                                                  unsigned gz, unsigned bx, unsigned by,
                                                  unsigned bz, unsigned shm, CUstream s,
                                                  void **params) {
    LAUNCH_BODY(cuLaunchCooperativeKernel_ptsz, 1, f, GRID(gx, gy, gz), GRID(bx, by, bz), shm, 0, s,
                vc_real.cuLaunchCooperativeKernel_ptsz(f, gx, gy, gz, bx, by, bz, shm, s, params));
}

VC_EXPORT CUresult cuGraphLaunch(CUgraphExec ge, CUstream s) {
    LAUNCH_BODY(cuGraphLaunch, 0, ge, 0, 0, 0, 1, s, vc_real.cuGraphLaunch(ge, s));
}

VC_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec ge, CUstream s) {
    LAUNCH_BODY(cuGraphLaunch_ptsz, 1, ge, 0, 0, 0, 1, s, vc_real.cuGraphLaunch_ptsz(ge, s));
}

/* Legacy launches (block shape and parameters set beforehand through
 * cuFuncSetBlockShape / cuParamSet*): grid w x h, or 1 x 1 for cuLaunch.
 * Throttled like cuLaunchKernel. */
VC_EXPORT CUresult cuLaunch(CUfunction f) {
    LAUNCH_BODY(cuLaunch, 0, f, 1, 32, 0, 0, NULL, vc_real.cuLaunch(f));
}

VC_EXPORT CUresult cuLaunchGrid(CUfunction f, int w, int h) {
    LAUNCH_BODY(cuLaunchGrid, 0, f, w > 0 && h > 0 ? (uint64_t)w * (uint64_t)h : 0, 32, 0, 0, NULL,
                vc_real.cuLaunchGrid(f, w, h));
}

VC_EXPORT CUresult cuLaunchGridAsync(CUfunction f, int w, int h, CUstream s) {
    LAUNCH_BODY(cuLaunchGridAsync, 0, f, w > 0 && h > 0 ? (uint64_t)w * (uint64_t)h : 0, 32, 0, 0, s,
                vc_real.cuLaunchGridAsync(f, w, h, s));
}

/* One launch across several devices (deprecated since CUDA 11.3): it cannot
 * be charged per device with one admission, so it is refused while any GPU
 * of the container is limited (the application falls back to per-device
 * cooperative launches, which are throttled). */
VC_EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(void *params, unsigned int n, unsigned int flags) {
    PROLOGUE(cuLaunchCooperativeKernelMultiDevice);
    if (ACTIVE() && vc_g.any_limited)
        return CUDA_ERROR_NOT_SUPPORTED;
    return vc_real.cuLaunchCooperativeKernelMultiDevice(params, n, flags);
}
