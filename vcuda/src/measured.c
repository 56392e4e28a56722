/*
 * measured.c - the compute limiter's reference from the driver.
 *
 * The limiter prices launches from in-process samples (events around a
 * launch). On a GPU that time-slices processes, a sampled launch preempted
 * at a slice's end resumes after the co-tenants' slices, and its events
 * measure those too: a container beside co-tenants was over-charged (graphs
 * at a 10% cap beside a 90% one got 6.3% of the GPU, its charge +58%, on the
 * fake's timeslice model), and nothing a process sees of itself tells
 * another context's slice from a slow kernel. The driver knows each
 * process's own kernel time; the node agent publishes it per container
 * (NVML's per-process SM utilisation, summed: the contract in
 * limits.h, vc_measured_parse), read-only beside the limits file.
 *
 * Per GPU record, this process keeps its raw charge (what the limiter
 * charged it before this factor, vc_meas_raw) and, at each read of the file
 * (at most every MEAS_READ_NS, from a launch that already has a clock
 * reading), a history of (time, raw charge). The factor is the busy time
 * the driver measured over the raw charge at the same times (the history
 * interpolated at each measurement's `at`), over the newest measurements
 * (MEAS_WINDOW_*), clamped to MEAS_MIN..MEAS_MAX; it multiplies every
 * charge (admission, settlements, the exported busy_ns). It is a ratio
 * measured afresh at every new measurement, not a gain integrated over
 * them: the raw charge per unit of work does not depend on the factor, so
 * there is nothing to oscillate, and it is not damped.
 *
 * No file (compute guard off, MIG, a host process, not sampled yet), a
 * malformed one (logged once), a measurement older than MEAS_STALE_NS
 * (the agent is down), busy going backwards (the agent started over) or
 * this process's line missing: the factor is 1, the in-process loop alone.
 */
#define _GNU_SOURCE
#include "measured.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "region.h"
#include "vcuda.h"

#define MEAS_READ_NS 50000000ull     /* the file is read at most this often */
/* The factor's window of measurements: the newest that hold both 200 ms
 * and 40 ms of raw charge (one NVML sample period at 20% or more, four or
 * five at 10%), at most 1.05 s. Short, since a process's raw charge per
 * device ns drifts while its in-process estimates learn (on the fake a
 * graphs container's fell from x0.72 to x0.55 of its device time over its
 * first second beside co-tenants): with a 1 s window (or 400 ms) the factor
 * lagged it, and graphs at 50% in 10+30+60 reached 44.4% (45.4%) against
 * 47.3% at 200 ms. Long enough for NVML's whole percents of a sample's
 * period (2 ms of 200 ms; truncated, the factor reads low by half that on
 * average: +5% of the cap at 10%, +1% at 50%). */
#define MEAS_WINDOW_NS 1050000000ull
#define MEAS_WINDOW_SPAN_NS 200000000ull
#define MEAS_WINDOW_RAW_NS 40000000ull
#define MEAS_STALE_NS 5000000000ull  /* a measurement older than this: the agent is down */
#define MEAS_FUTURE_NS 1000000000ull /* ... newer than now by more: not this host's clock */
/* The factor is applied once its window holds this much raw charge and
 * time: NVML counts whole percents of a sample period (2 ms of a 200 ms
 * period), so less would be mostly rounding. */
#define MEAS_MIN_RAW_NS 10000000ull
#define MEAS_MIN_SPAN_NS 150000000ull
#define MEAS_MIN 0.25
#define MEAS_MAX 4.0
#define MEAS_HIST 128 /* raw history: >= 6.4 s at one point per read */
#define MEAS_PTS 32   /* measurements: >= 5 s at NVML's 1/6 s */

_Atomic double vc_meas_factor[VC_MAX_GPUS];
_Atomic uint64_t vc_meas_raw[VC_MAX_GPUS];
_Atomic uint64_t vc_meas_next = UINT64_MAX; /* no file to read until vc_measured_init */

static char path[4200];
static _Atomic int lock;
static _Atomic int bad_told;
static uint64_t my_pid, my_start;
static char *buf;
static struct {
    unsigned n, head; /* ring: the newest at head - 1 */
    uint64_t t[MEAS_HIST], raw[MEAS_HIST];
} hist[VC_MAX_GPUS];
static struct {
    unsigned n, head;
    uint64_t at[MEAS_PTS], busy[MEAS_PTS];
} pts[VC_MAX_GPUS];

void vc_measured_init(const char *limits_path) {
    const char *slash = strrchr(limits_path, '/');
    int dir = slash ? (int)(slash - limits_path) : 0;
    if (snprintf(path, sizeof(path), "%.*s%smeasured/compute", dir, limits_path, slash ? "/" : "") >=
        (int)sizeof(path))
        return; /* no room: never read */
    atomic_store(&vc_meas_next, 0);
}

static void reset(int g) {
    pts[g].n = pts[g].head = 0;
    atomic_store_explicit(&vc_meas_factor[g], 0, memory_order_relaxed);
}

void vc_measured_atfork_child(void) {
    my_pid = my_start = 0;
    atomic_store(&lock, 0);
    for (int g = 0; g < VC_MAX_GPUS; g++) {
        reset(g);
        hist[g].n = hist[g].head = 0;
        atomic_store(&vc_meas_raw[g], 0);
    }
    if (path[0])
        atomic_store(&vc_meas_next, 0);
}

/* 1 read, 0 absent, -1 unreadable or over the contract's size. */
static int read_measured(size_t *len) {
    if (!buf && !(buf = malloc(VC_MEASURED_MAX_BYTES + 1)))
        return -1;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT || errno == ENOTDIR ? 0 : -1;
    size_t n = 0;
    for (;;) {
        ssize_t r = read(fd, buf + n, VC_MEASURED_MAX_BYTES + 1 - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0 || (n += (size_t)r) > VC_MEASURED_MAX_BYTES)
            break;
    }
    close(fd);
    *len = n;
    return n > VC_MEASURED_MAX_BYTES ? -1 : 1;
}

/* The raw charge at time t, interpolated in the history; 0 when t is
 * before it. */
static int raw_at(int g, uint64_t t, double *raw) {
    unsigned n = hist[g].n;
    for (unsigned k = 0; k < n; k++) {
        unsigned i = (hist[g].head + MEAS_HIST - 1 - k) % MEAS_HIST; /* newest first */
        if (hist[g].t[i] > t)
            continue;
        if (k == 0) {
            *raw = (double)hist[g].raw[i];
            return 1;
        }
        unsigned j = (i + 1) % MEAS_HIST;
        double f = (double)(t - hist[g].t[i]) / (double)(hist[g].t[j] - hist[g].t[i]);
        *raw = (double)hist[g].raw[i] + f * (double)(hist[g].raw[j] - hist[g].raw[i]);
        return 1;
    }
    return 0;
}

/* A new measurement of GPU record g: the factor over the window it ends. */
static void measure(int g, uint64_t busy, uint64_t at) {
    unsigned n = pts[g].n, newest = (pts[g].head + MEAS_PTS - 1) % MEAS_PTS;
    if (n && (busy < pts[g].busy[newest] || at < pts[g].at[newest])) {
        reset(g); /* the agent started over (its baseline is 0 again) */
        n = 0;
    }
    if (n && at == pts[g].at[newest])
        return; /* nothing new */
    pts[g].at[pts[g].head] = at, pts[g].busy[pts[g].head] = busy;
    pts[g].head = (pts[g].head + 1) % MEAS_PTS;
    pts[g].n = n = n < MEAS_PTS ? n + 1 : MEAS_PTS;
    /* The window: back from the newest measurement until it holds
     * MEAS_WINDOW_SPAN_NS and MEAS_WINDOW_RAW_NS of raw charge, at most
     * MEAS_WINDOW_NS, within the history. */
    double raw_end, raw_begin, raw = 0;
    if (!raw_at(g, at, &raw_end))
        return;
    unsigned i = 0, found = 0;
    for (unsigned k = 1; k < n; k++) {
        unsigned j = (pts[g].head + MEAS_PTS - 1 - k) % MEAS_PTS;
        if (at - pts[g].at[j] > MEAS_WINDOW_NS || !raw_at(g, pts[g].at[j], &raw_begin))
            break;
        i = j, found = 1, raw = raw_end - raw_begin;
        if (at - pts[g].at[j] >= MEAS_WINDOW_SPAN_NS && raw >= (double)MEAS_WINDOW_RAW_NS)
            break;
    }
    if (!found || at - pts[g].at[i] < MEAS_MIN_SPAN_NS || raw < (double)MEAS_MIN_RAW_NS)
        return; /* too little to mean anything yet: the factor stays */
    double f = (double)(busy - pts[g].busy[i]) / raw;
    f = f < MEAS_MIN ? MEAS_MIN : f > MEAS_MAX ? MEAS_MAX : f;
#ifdef VC_MUTATE_NO_MEASURED
    f = 1;
#endif
    atomic_store_explicit(&vc_meas_factor[g], f, memory_order_relaxed);
}

void vc_measured_refresh(uint64_t now) {
    uint64_t due = atomic_load(&vc_meas_next);
    if (now < due || !atomic_compare_exchange_strong(&vc_meas_next, &due, now + MEAS_READ_NS))
        return;
    int z = 0;
    if (!atomic_compare_exchange_strong(&lock, &z, 1))
        return;
    /* now may be a remembered reading, behind the clock: the history needs
     * the time of the raw charge it records */
    now = vc_now_ns();
    if (!my_pid) {
        char state;
        my_pid = (uint64_t)getpid();
        /* field 22, the agent's key for a process beside its pid (a reused
         * pid is another process) */
        if (vc_proc_stat((pid_t)my_pid, &state, &my_start) <= 0)
            my_start = 0;
    }
    int ng = vc_g.limits.ngpus;
    for (int g = 0; g < ng; g++) {
        hist[g].t[hist[g].head] = now;
        hist[g].raw[hist[g].head] = atomic_load_explicit(&vc_meas_raw[g], memory_order_relaxed);
        hist[g].head = (hist[g].head + 1) % MEAS_HIST;
        hist[g].n += hist[g].n < MEAS_HIST;
    }
    size_t len = 0;
    char err[200];
    uint64_t written;
    vc_measured_line line[VC_MAX_GPUS];
    static char ids[VC_MAX_GPUS][VC_UUID_LEN + 1];
    for (int g = 0; g < ng; g++)
        memcpy(ids[g], vc_g.limits.gpu[g].uuid, sizeof(ids[g]));
    int r = read_measured(&len);
    if (r > 0 && vc_measured_parse(buf, len, my_pid, my_start, ids, ng, &written, line, err, sizeof(err)) != 0)
        r = -2;
    if (r <= 0) {
        if (r < 0 && !atomic_exchange(&bad_told, 1))
            vc_log("%s: %s; the compute limiter goes on its own samples", path,
                   r == -2 ? err : "unreadable or larger than 256 KiB");
        for (int g = 0; g < ng; g++)
            reset(g);
        atomic_store(&lock, 0);
        return;
    }
    for (int g = 0; g < ng; g++) {
        if (line[g].found && line[g].at <= now + MEAS_FUTURE_NS)
            measure(g, line[g].busy, line[g].at);
        unsigned newest = (pts[g].head + MEAS_PTS - 1) % MEAS_PTS;
#ifndef VC_MUTATE_MEASURED_NO_STALE
        if (pts[g].n && pts[g].at[newest] + MEAS_STALE_NS < now)
            reset(g);
#else
        (void)newest;
#endif /* the agent stopped measuring: the in-process loop alone */
    }
    atomic_store(&lock, 0);
}
