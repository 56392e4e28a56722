/*
 * fake_device_model.c - how long the fake device takes for a kernel: the
 * part of the fake driver the compute limiter must not be able to predict.
 *
 * fake_cuda.c keeps the timeline (streams, processes, events); this file
 * decides durations. It shares no code and no constant with vcuda's limiter
 * (hooks_launch.c): the limiter assumes every launch of a function and shape
 * costs the same number of whole waves; this device does not behave so.
 *
 *   shape       at or above one wave of resident blocks (SMs x occupancy):
 *               ceil(G / wave) waves (a tail wave takes a whole wave); below
 *               one wave: time proportional to the blocks (a memory-bound
 *               grid that uses a quarter of the SMs gets done in about a
 *               quarter of a wave), never under 1/64 of a wave
 *   variation   per launch, FAKE_CUDA_VARY=<none|jitter|bimodal|lognormal>:
 *               jitter: uniform x0.8..x1.2; bimodal: x0.2 or x1.8 with equal
 *               odds; lognormal: sigma 0.5; every one has mean x1 (the
 *               workload's mean device time is the same, only its spread);
 *               fakeFunctionVary(f, how) sets one function's
 *   decode      FAKE_CUDA_DECODE=<launches>,<factor>: the process's kernels
 *               grow linearly from x1 to x<factor> over <launches> launches,
 *               then start again (a decode loop whose context grows, one
 *               sequence after another)
 *   graphs      fakeGraphSetKernels(exec, n): one graph launch runs n kernels
 *               back to back, each varying on its own
 *   overlap     kernels of one process on different streams share the SMs:
 *               a partial grid that starts while others hold more than the
 *               device's SMs stretches by the oversubscription
 *   switch      FAKE_CUDA_CTXSW_NS (default 2000): the device switching
 *               from one process's work to another's (no MPS: contexts of
 *               different processes never overlap) idles that long
 *   queue       a launch blocks while its stream's work already queued ends
 *               more than FAKE_CUDA_QUEUE_NS (default 20 ms) from now (a
 *               real launch queue holds about 1024 entries, then blocks)
 *
 * FAKE_CUDA_SEED seeds the draws (with the pid, so processes differ).
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "fake_device_model.h"

enum { VARY_NONE, VARY_JITTER, VARY_BIMODAL, VARY_LOGNORMAL };

static struct {
    pthread_once_t once;
    int vary;
    uint64_t decode_n;
    double decode_factor;
    uint64_t ctxsw_ns, queue_ns;
    uint64_t seed;
} M = {.once = PTHREAD_ONCE_INIT};

static _Atomic uint64_t draws, launches;

static void model_init(void) {
    const char *v = getenv("FAKE_CUDA_VARY");
    if (v && strcmp(v, "jitter") == 0)
        M.vary = VARY_JITTER;
    else if (v && strcmp(v, "bimodal") == 0)
        M.vary = VARY_BIMODAL;
    else if (v && strcmp(v, "lognormal") == 0)
        M.vary = VARY_LOGNORMAL;
    const char *d = getenv("FAKE_CUDA_DECODE");
    if (d && *d) {
        char *end;
        M.decode_n = strtoull(d, &end, 10);
        M.decode_factor = *end == ',' ? strtod(end + 1, NULL) : 1;
    }
    const char *c = getenv("FAKE_CUDA_CTXSW_NS");
    M.ctxsw_ns = c ? strtoull(c, NULL, 10) : 2000;
    const char *q = getenv("FAKE_CUDA_QUEUE_NS");
    M.queue_ns = q ? strtoull(q, NULL, 10) : 20000000;
    const char *s = getenv("FAKE_CUDA_SEED");
    M.seed = (s ? strtoull(s, NULL, 10) : 1) * 0x9e3779b97f4a7c15ULL ^ (uint64_t)getpid() << 20;
}
static void init(void) { pthread_once(&M.once, model_init); }

/* A uniform draw in (0, 1): splitmix64 over a shared counter (thread-safe,
 * reproducible for one seed and launch order). */
static double uniform(void) {
    uint64_t z = M.seed + atomic_fetch_add(&draws, 1) * 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return ((double)(z >> 11) + 0.5) / 9007199254740992.0;
}

/* Per-function variation (fakeFunctionVary), else FAKE_CUDA_VARY's. */
#define NVARY 64
static struct {
    _Atomic uint64_t func;
    int vary;
} fvary[NVARY];

int fakeFunctionVary(CUfunction f, const char *how) {
    int v = VARY_NONE;
    if (strcmp(how, "jitter") == 0)
        v = VARY_JITTER;
    else if (strcmp(how, "bimodal") == 0)
        v = VARY_BIMODAL;
    else if (strcmp(how, "lognormal") == 0)
        v = VARY_LOGNORMAL;
    else if (strcmp(how, "none") != 0)
        return -1;
    for (int i = 0; i < NVARY; i++) {
        uint64_t k = atomic_load(&fvary[i].func);
        if (k == (uint64_t)(uintptr_t)f ||
            (k == 0 && (atomic_compare_exchange_strong(&fvary[i].func, &k, (uint64_t)(uintptr_t)f) ||
                        k == (uint64_t)(uintptr_t)f))) {
            fvary[i].vary = v;
            return 0;
        }
    }
    return -1;
}

static double variation(uint64_t func) {
    int vary = M.vary;
    for (int i = 0; func && i < NVARY; i++) {
        uint64_t k = atomic_load(&fvary[i].func);
        if (k == 0)
            break;
        if (k == func) {
            vary = fvary[i].vary;
            break;
        }
    }
    switch (vary) {
    case VARY_JITTER:
        return 0.8 + 0.4 * uniform();
    case VARY_BIMODAL:
        return uniform() < 0.5 ? 0.2 : 1.8;
    case VARY_LOGNORMAL: {
        const double sigma = 0.5;
        double z = sqrt(-2 * log(uniform())) * cos(2 * M_PI * uniform());
        return exp(sigma * z - sigma * sigma / 2);
    }
    }
    return 1;
}

static double decode_growth(void) {
    uint64_t n = atomic_fetch_add(&launches, 1);
    if (M.decode_n == 0)
        return 1;
    return 1 + (M.decode_factor - 1) * (double)(n % M.decode_n) / (double)M.decode_n;
}

static uint64_t shape_ns(uint64_t grid, uint64_t per_wave, uint64_t wave_ns) {
    if (grid >= per_wave)
        return (grid + per_wave - 1) / per_wave * wave_ns;
    uint64_t t = (uint64_t)((double)wave_ns * (double)grid / (double)per_wave);
    return t < wave_ns / 64 ? wave_ns / 64 : t;
}

/* Partial grids in flight in this process (streams share the SMs; kernels
 * of other processes never overlap these). */
#define INFLIGHT 64
static struct {
    uint64_t stream, start, end;
    double frac;
} inflight[FDM_MAX_DEVS][INFLIGHT];
static pthread_mutex_t inflight_mu = PTHREAD_MUTEX_INITIALIZER;

static uint64_t share_sms(int d, uint64_t stream, uint64_t start, uint64_t dur, double frac) {
    if (d < 0 || d >= FDM_MAX_DEVS || frac >= 1 || dur == 0)
        return dur;
    pthread_mutex_lock(&inflight_mu);
    double used = 0;
    int slot = -1;
    uint64_t oldest = UINT64_MAX;
    for (int i = 0; i < INFLIGHT; i++) {
        if (inflight[d][i].stream != stream && inflight[d][i].start <= start && inflight[d][i].end > start)
            used += inflight[d][i].frac; /* one stream's kernels never run side by side */
        if (inflight[d][i].end < oldest) {
            oldest = inflight[d][i].end;
            slot = i;
        }
    }
    if (used + frac > 1)
        dur = (uint64_t)((double)dur * (used + frac));
    inflight[d][slot].stream = stream;
    inflight[d][slot].start = start;
    inflight[d][slot].end = start + dur;
    inflight[d][slot].frac = frac;
    pthread_mutex_unlock(&inflight_mu);
    return dur;
}

/* The launch queue is full: wait for the device to drain it (ahead: ns of
 * the stream's work queued, which the device drains at most as fast as the
 * clock runs). */
static void queue_wait(uint64_t ahead) {
    if (ahead > M.queue_ns) {
        uint64_t w = ahead - M.queue_ns;
        struct timespec ts = {(time_t)(w / 1000000000ull), (long)(w % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
}

uint64_t fdm_kernel_ns(int d, uint64_t func, uint64_t stream, uint64_t start, uint64_t ahead, uint64_t grid,
                       uint64_t per_wave, uint64_t wave_ns, uint64_t overhead_ns) {
    init();
    queue_wait(ahead);
    double t = (double)shape_ns(grid, per_wave, wave_ns) * variation(func) * decode_growth();
    uint64_t dur = overhead_ns + (uint64_t)t;
    return share_sms(d, stream, start, dur, (double)grid / (double)per_wave);
}

/* Graph execs with several kernels (fakeGraphSetKernels); others run one. */
#define NGRAPH 256
static struct {
    uintptr_t exec;
    unsigned n;
} graphs[NGRAPH];

int fakeGraphSetKernels(CUgraphExec e, unsigned n) {
    for (int i = 0; i < NGRAPH; i++) {
        if (graphs[i].exec == 0 || graphs[i].exec == (uintptr_t)e) {
            graphs[i].exec = (uintptr_t)e;
            graphs[i].n = n;
            return 0;
        }
    }
    return -1;
}

uint64_t fdm_graph_ns(CUgraphExec e, uint64_t ahead, uint64_t blocks, uint64_t per_wave, uint64_t wave_ns,
                      uint64_t overhead_ns) {
    init();
    queue_wait(ahead);
    unsigned n = 1;
    for (int i = 0; i < NGRAPH && graphs[i].exec; i++)
        if (graphs[i].exec == (uintptr_t)e)
            n = graphs[i].n;
    double t = 0;
    double g = decode_growth();
    for (unsigned k = 0; k < n; k++)
        t += (double)shape_ns(blocks, per_wave, wave_ns) * variation(0) * g;
    return overhead_ns + (uint64_t)t;
}

uint64_t fdm_switch_ns(void) {
    init();
    return M.ctxsw_ns;
}
uint64_t fdm_queue_ns(void) {
    init();
    return M.queue_ns;
}

/* ---- device time by process ----
 * Each process's busy time (the union of its own kernels: its streams
 * overlap, other processes' kernels never do) is kept exactly by the process
 * that queues them and published, with the time it is exact for, in a table
 * shared through FAKE_CUDA_SHM (its path + "-busy"). */
#define BUSY_SLOTS 256
typedef struct {
    _Atomic int pid;
    _Atomic uint32_t seq; /* odd while being written */
    uint64_t at[FDM_MAX_DEVS], busy[FDM_MAX_DEVS];
} busy_slot;
static busy_slot *busy_tab;
static pthread_once_t busy_once = PTHREAD_ONCE_INIT;
static void busy_map(void) {
    const char *shm = getenv("FAKE_CUDA_SHM");
    size_t sz = sizeof(busy_slot) * BUSY_SLOTS;
    if (shm && *shm) {
        char path[4096];
        snprintf(path, sizeof(path), "%s-busy", shm);
        int fd = open(path, O_RDWR | O_CREAT, 0600);
        if (fd >= 0 && ftruncate(fd, (off_t)sz) == 0) {
            void *m = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (m != MAP_FAILED)
                busy_tab = m;
        }
        if (fd >= 0)
            close(fd);
    }
    if (!busy_tab)
        busy_tab = calloc(BUSY_SLOTS, sizeof(busy_slot));
}
static busy_slot *busy_of(int pid, int create) {
    pthread_once(&busy_once, busy_map);
    for (int i = 0; i < BUSY_SLOTS; i++) {
        int p = atomic_load(&busy_tab[i].pid);
        if (p == pid)
            return &busy_tab[i];
        if (p == 0 && create && atomic_compare_exchange_strong(&busy_tab[i].pid, &p, pid))
            return &busy_tab[i];
        if (p == 0)
            return NULL;
    }
    return NULL;
}

/* This process's kernels that may not have ended: sorted, disjoint. */
static struct {
    uint64_t done;
    int n, cap;
    uint64_t *s, *e;
    pid_t owner;
} own[FDM_MAX_DEVS];
static pthread_mutex_t own_mu = PTHREAD_MUTEX_INITIALIZER;

void fdm_busy(int d, uint64_t st, uint64_t en, uint64_t now) {
    if (d < 0 || d >= FDM_MAX_DEVS || en <= st)
        return;
    pthread_mutex_lock(&own_mu);
    typeof(own[0]) *v = &own[d];
    if (v->owner != getpid()) { /* a forked child starts with nothing */
        v->done = 0, v->n = 0, v->owner = getpid();
    }
    /* fold what has ended */
    int w = 0;
    for (int i = 0; i < v->n; i++) {
        if (v->e[i] <= now) {
            v->done += v->e[i] - v->s[i];
            continue;
        }
        v->s[w] = v->s[i], v->e[w] = v->e[i], w++;
    }
    v->n = w;
    /* merge [st, en) into the set */
    int i = 0;
    while (i < v->n && v->e[i] < st)
        i++;
    int j = i;
    while (j < v->n && v->s[j] <= en) {
        if (v->s[j] < st)
            st = v->s[j];
        if (v->e[j] > en)
            en = v->e[j];
        j++;
    }
    if (v->n - (j - i) + 1 > v->cap) {
        v->cap = v->cap ? 2 * v->cap : 256;
        v->s = realloc(v->s, sizeof(uint64_t) * (size_t)v->cap);
        v->e = realloc(v->e, sizeof(uint64_t) * (size_t)v->cap);
    }
    int tail = v->n - j;
    memmove(&v->s[i + 1], &v->s[j], sizeof(uint64_t) * (size_t)tail);
    memmove(&v->e[i + 1], &v->e[j], sizeof(uint64_t) * (size_t)tail);
    v->s[i] = st, v->e[i] = en;
    v->n = i + 1 + tail;
    uint64_t b = v->done;
    for (int k = 0; k < v->n && v->s[k] < now; k++)
        b += (v->e[k] < now ? v->e[k] : now) - v->s[k];
    pthread_mutex_unlock(&own_mu);
    busy_slot *sl = busy_of(getpid(), 1);
    if (sl) {
        atomic_fetch_add(&sl->seq, 1);
        sl->at[d] = now, sl->busy[d] = b;
        atomic_fetch_add(&sl->seq, 1);
    }
}

void fdm_publish_busy(int d, int pid, uint64_t busy, uint64_t at) {
    if (d < 0 || d >= FDM_MAX_DEVS)
        return;
    busy_slot *sl = busy_of(pid, 1);
    if (!sl)
        return;
    atomic_fetch_add(&sl->seq, 1);
    sl->at[d] = at, sl->busy[d] = busy;
    atomic_fetch_add(&sl->seq, 1);
}

int fakeModelBusy(int d, int pid, uint64_t *busy, uint64_t *at) {
    if (d < 0 || d >= FDM_MAX_DEVS)
        return -1;
    busy_slot *sl = busy_of(pid, 0);
    if (!sl)
        return -1;
    uint32_t q;
    do {
        q = atomic_load(&sl->seq);
        *busy = sl->busy[d];
        *at = sl->at[d];
    } while ((q & 1) || q != atomic_load(&sl->seq));
    return 0;
}
