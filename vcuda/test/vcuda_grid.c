/*
 * vcuda_grid - the compute limiter's benchmark grid on the fake device
 * (make bench-vcuda; BenchmarkVcudaGrid runs it under vcuda).
 *
 *   vcuda_grid grid <ms> [workload|all] [cap|all] [mix|all]
 *     every workload x cap {10,30,50,70,90} x mix {alone, 30+70, 10+30+60}:
 *     the measured container at <cap> runs the workload for <ms>, its
 *     co-tenants (own containers, own limits) fill the rest of the GPU
 *     (100 - cap, split as the mix's other shares); one line a cell:
 *       vcuda-grid workload=W cap=C mix=M achieved=A error_pct=E converge_ms=T
 *     achieved: the container's busy device time (the fake's timeline, the
 *     union of its kernels) over the last 70% of the run, in percent;
 *     error_pct: (achieved - cap) / cap; converge_ms: from the first launch
 *     until every later 200 ms window is within 10% of the cap (-1: never).
 *     Each cell runs twice, in fresh state: first with the measured
 *     container uncapped (its limits at 100%: vcuda only forwards) beside
 *     the same co-tenants at the same caps, then at <cap>. The first gives
 *     ceiling=, what the workload's launchers reach on this machine at this
 *     moment with nothing holding them back. A cap is a ceiling, not a
 *     guarantee, so a container alone is expected to reach min(cap,
 *     ceiling) (expected=, expected_err_pct=). In a mix expected= is the
 *     cap: an uncapped container there changes what its capped co-tenants
 *     get (its queue, 20 ms deep, holds their launches back on the fake's
 *     time-sliced device), so its figure bounds nothing (uniform at 50% in
 *     30+70 reached 49.4% capped and 42.6% uncapped); it is printed all the
 *     same, as the workload's reach beside those co-tenants. In a mix,
 *     cotenants= gives the co-tenants' achieved over the same window (the
 *     mix's other shares in order): 10+30+60 sums to 100, so the device is
 *     saturated and a container short of its cap shows who was not.
 *     VCUDA_GRID_JOIN_MS=<ms>: the co-tenants start that long into the cell
 *     (a pod landing on a GPU where a share runs); the capped run then also
 *     prints, on stderr, the measured container's share and the
 *     co-tenants' per 200 ms window from 400 ms before the join:
 *       vcuda-grid-window t_ms=<since the join> achieved=A cotenants=B,C
 *   vcuda_grid overhead <launches>
 *     the launch path at 100% (the limiter off; run with FAKE_CUDA_WAVE_NS=1
 *     so the device never holds the host back): median ns a launch over 31
 *     rounds of <launches>, and the launches a second of a launch-heavy loop.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda_api.h"
#include "limiter_workloads.h"
#include "measured_agent.h"
#include "util.h"

#define WARM_FRAC 0.3
#define WIN_NS 200000000ull
#define POLL_NS 10000000ull
#define MAXC 3
#define MAXPOLL 4096

static const int caps_all[] = {10, 30, 50, 70, 90};
static const char *mixes[] = {"alone", "30+70", "10+30+60"};

/* The co-tenants of a container at cap in mix: the mix's shares without the
 * one closest to cap, scaled to fill 100 - cap. Returns the container count
 * (the measured one first). */
static int mix_caps(const char *mix, int cap, int caps[MAXC]) {
    caps[0] = cap;
    int shares[3], n = 0;
    if (strcmp(mix, "30+70") == 0) {
        shares[0] = 30, shares[1] = 70, n = 2;
    } else if (strcmp(mix, "10+30+60") == 0) {
        shares[0] = 10, shares[1] = 30, shares[2] = 60, n = 3;
    } else {
        return 1;
    }
    int drop = 0;
    for (int i = 1; i < n; i++)
        if (abs(shares[i] - cap) < abs(shares[drop] - cap))
            drop = i;
    int rest = 0, m = 1;
    for (int i = 0; i < n; i++)
        if (i != drop)
            rest += shares[i];
    int left = 100 - cap;
    for (int i = 0; i < n; i++) {
        if (i == drop)
            continue;
        caps[m] = m == n - 1 ? left : shares[i] * (100 - cap) / rest;
        if (caps[m] < 1)
            caps[m] = 1;
        left -= caps[m];
        m++;
    }
    return n;
}

typedef struct {
    workload w;
    int caps[MAXC];
    uint64_t deadline;
} cell_arg;

/* One run of a cell, as measured (shared with run_cell across the fork). */
typedef struct {
    double achieved, charge_err, throttled;
    long converge;
    int n;             /* containers in the cell */
    double co[MAXC];   /* the co-tenants' achieved (co[1..n-1]), same window */
} phase_res;

static int container(int i, void *p) {
    cell_arg *a = p;
    return workload_container(i, a->w, a->caps[i], a->deadline, 1234567 + 7919 * (uint64_t)i);
}

/* The measured container's region record (what the limiter charged and how
 * long it slept), mapped once the container has created it. */
static vc_region_gpu *c0_gpu(void) {
    static vc_region_gpu *g;
    if (g)
        return g;
    int fd = open(tpath("c0-region"), O_RDONLY);
    if (fd < 0)
        return NULL;
    struct stat st;
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_size < VC_REGION_SIZE) { /* still being made: mapping it would SIGBUS */
        close(fd);
        return NULL;
    }
    void *m = mmap(NULL, VC_REGION_SIZE, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED)
        return NULL;
    if (((vc_region_hdr *)m)->magic != VC_REGION_MAGIC) { /* not written yet */
        munmap(m, VC_REGION_SIZE);
        return NULL;
    }
    return g = (vc_region_gpu *)((char *)m + VC_REGION_GPU_OFFSET);
}

/* Starts containers lo..hi-1 of a cell and, every period, an agent double
 * that publishes what the driver measured of them; returns hi. */
static int start_group(cell_arg *a, int lo, int hi, pid_t *pid, uint64_t period, pid_t *agent) {
    static measured_agent ag[2];
    measured_agent *m = &ag[lo > 0];
    for (int i = lo; i < hi; i++) {
        CHECK(mkdir(workload_container_dir(i), 0700) == 0 || errno == EEXIST, "mkdir: %s", strerror(errno));
        pid[i] = spawn(container, i, a);
    }
    if (period) {
        *m = (measured_agent){.dev = 0, .uuid = fake_uuid(0), .period_ns = period, .deadline = a->deadline, .n = hi - lo};
        for (int i = lo; i < hi; i++)
            m->dir[i - lo] = strdup(workload_container_dir(i)), m->pid[i - lo] = pid[i];
        *agent = measured_agent_start(m);
    }
    return hi;
}

/* Runs workload w with the measured container at cap0 and its co-tenants
 * at the shares mix gives a container at cap; converge is judged against
 * cap. */
static int cell(workload w, int cap0, int cap, const char *mix, uint64_t dur_ns, phase_res *out) {
    cell_arg a = {.w = w};
    int n = mix_caps(mix, cap, a.caps);
    a.caps[0] = cap0;
    workload_env(w);
    setenv("FAKE_CUDA_SHM", tpath("fake-shm"), 1);
    uint64_t start = now_ns();
    a.deadline = start + dur_ns;
    /* The node agent's double publishes what the driver measured of each
     * container (every VCUDA_GRID_MEASURED_MS, default 200; 0: no agent,
     * the limiter on its own samples). VCUDA_GRID_JOIN_MS: the co-tenants
     * start that long after the measured container, as a pod lands on a
     * GPU where a share already runs (each group with an agent double of
     * its own from its start). */
    const char *ms = getenv("VCUDA_GRID_MEASURED_MS"), *js = getenv("VCUDA_GRID_JOIN_MS");
    uint64_t period = ms ? (uint64_t)atol(ms) * 1000000ull : MEASURED_AGENT_PERIOD_NS;
    uint64_t join = start + (js ? (uint64_t)atol(js) * 1000000ull : 0);
    CHECK(join < a.deadline, "VCUDA_GRID_JOIN_MS=%s: the co-tenants would join after the cell ends", js);
    pid_t pid[MAXC] = {0}, agent[2] = {0, 0};
    int started = js ? 1 : n;
    start_group(&a, 0, started, pid, period, &agent[0]);
    static uint64_t ts[MAXPOLL], busy[MAXPOLL], charged[MAXPOLL], slept[MAXPOLL], cob[MAXPOLL][MAXC];
    int np = 0;
    uint64_t first = 0; /* the first reading with device time */
    while (now_ns() < a.deadline && np < MAXPOLL) {
        if (started < n && now_ns() >= join)
            started = start_group(&a, started, n, pid, period, &agent[1]);
        uint64_t b = 0, at = now_ns();
        if (fakeModelBusy(0, pid[0], &b, &at) != 0)
            b = 0, at = now_ns();
        if (np && at <= ts[np - 1]) { /* nothing queued since the last reading */
            struct timespec sl = {0, (long)POLL_NS};
            nanosleep(&sl, NULL);
            continue;
        }
        if (b && !first)
            first = at;
        vc_region_gpu *g = c0_gpu();
        charged[np] = g ? atomic_load(&g->busy_ns) : 0;
        slept[np] = g ? atomic_load(&g->throttled_ns) : 0;
        for (int i = 1; i < n; i++) {
            uint64_t x = 0, t = 0;
            cob[np][i] = pid[i] && fakeModelBusy(0, pid[i], &x, &t) == 0 ? x : 0;
        }
        ts[np] = at, busy[np] = b, np++;
        struct timespec sl = {0, (long)POLL_NS};
        nanosleep(&sl, NULL);
    }
    CHECK(started == n, "the co-tenants never started");
    for (int i = 0; i < n; i++)
        CHECK(wait_child(pid[i]) == 0, "container %d failed", i);
    for (int k = 0; k < 2; k++)
        if (agent[k])
            CHECK(wait_child(agent[k]) == 0, "the node agent's double failed");
    /* With a join, the measured container's share and the co-tenants' per
     * 200 ms window from 400 ms before it (stderr: the cell's line stays
     * the grid's). */
    for (int i = 0; js && cap0 < 100 && i < np - 1;) {
        if (ts[i] + 400000000ull < join) {
            i++;
            continue;
        }
        int j = i;
        while (j < np - 1 && ts[j] < ts[i] + WIN_NS)
            j++;
        if (ts[j] < ts[i] + WIN_NS * 3 / 4)
            break;
        double dt = (double)(ts[j] - ts[i]);
        fprintf(stderr, "vcuda-grid-window t_ms=%+.0f achieved=%.1f", ((double)ts[i] - (double)join) / 1e6,
                (double)(busy[j] - busy[i]) / dt * 100);
        for (int k = 1; k < n; k++)
            fprintf(stderr, "%s%.1f", k == 1 ? " cotenants=" : ",", (double)(cob[j][k] - cob[i][k]) / dt * 100);
        fprintf(stderr, "\n");
        i = j;
    }
    /* achieved over the last 70% of the run */
    int w0 = 0;
    while (w0 < np - 1 && ts[w0] < start + (uint64_t)(WARM_FRAC * (double)dur_ns))
        w0++;
    double achieved = np > 1 && ts[np - 1] > ts[w0] ? (double)(busy[np - 1] - busy[w0]) / (double)(ts[np - 1] - ts[w0]) * 100 : 0;
    /* convergence: the earliest window start after which every 200 ms
     * window is within 10% of the cap */
    long converge = -1;
    for (int i = np - 1, j = np - 1; i >= 0; i--) {
        while (j > i && ts[j - 1] >= ts[i] + WIN_NS)
            j--;
        if (ts[j] < ts[i] + WIN_NS)
            continue; /* no full window from here */
        double u = (double)(busy[j] - busy[i]) / (double)(ts[j] - ts[i]) * 100;
        if (u < cap * 0.9 || u > cap * 1.1)
            break;
        if (ts[i] >= first && first)
            converge = (long)((ts[i] - first) / 1000000);
        else
            converge = 0;
    }
    /* Not part of the line, after it: why a cell misses. charge_err:
     * what the limiter charged over the device time it ran, in the same
     * window (its pricing error, whatever the CPU did); throttled: the share
     * of the window the container's launchers slept (near 0 with achieved
     * under the cap: the launchers lacked CPU, not budget). */
    double ran = np > 1 ? (double)(busy[np - 1] - busy[w0]) : 0;
    double charge_err = ran > 0 ? ((double)(charged[np - 1] - charged[w0]) / ran - 1) * 100 : 0;
    double throttled = np > 1 && ts[np - 1] > ts[w0] ? (double)(slept[np - 1] - slept[w0]) / (double)(ts[np - 1] - ts[w0]) * 100 : 0;
    *out = (phase_res){achieved, charge_err, throttled, converge, n, {0}};
    /* the co-tenants' share over the same window: a saturated mix (10+30+60
     * sums to 100) shows who was short */
    for (int i = 1; i < n && np > 1 && ts[np - 1] > ts[w0]; i++)
        out->co[i] = (double)(cob[np - 1][i] - cob[w0][i]) / (double)(ts[np - 1] - ts[w0]) * 100;
    return 0;
}

/* One run of a cell in a child process with its own scratch directory (its
 * own fake device, regions and limits). */
static int run_phase(workload w, int cap0, int cap, const char *mix, uint64_t dur_ns, const char *dir, phase_res *out) {
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
        fprintf(stderr, "mkdir %s: %s\n", dir, strerror(errno));
        return 1;
    }
    fflush(stdout);
    pid_t p = fork();
    if (p == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        setenv("VCUDA_TEST_TMP", dir, 1); /* before tmpdir() is first asked */
        _exit(cell(w, cap0, cap, mix, dur_ns, out));
    }
    int st;
    waitpid(p, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* A cell: the workload's ceiling (the measured container uncapped, the
 * same co-tenants), then the cell at its cap, back to back so both see the
 * same machine. */
static int run_cell(workload w, int cap, const char *mix, uint64_t dur_ns, int seq) {
    phase_res *r = mmap(NULL, 2 * sizeof(phase_res), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (r == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    char dir[512];
    const char *base = getenv("VCUDA_TEST_TMP");
    snprintf(dir, sizeof(dir), "%s/cell-%d-ceiling", base ? base : "/tmp", seq);
    int rc = run_phase(w, 100, cap, mix, dur_ns, dir, &r[0]);
    snprintf(dir, sizeof(dir), "%s/cell-%d", base ? base : "/tmp", seq);
    rc |= run_phase(w, cap, cap, mix, dur_ns, dir, &r[1]);
    if (rc == 0) {
        double ceiling = r[0].achieved, achieved = r[1].achieved;
        double expected = ceiling < cap && strcmp(mix, "alone") == 0 ? ceiling : cap;
        printf("vcuda-grid workload=%s cap=%d mix=%s achieved=%.1f error_pct=%+.1f converge_ms=%ld charge_err_pct=%+.1f "
               "throttled_pct=%.0f ceiling=%.1f expected=%.1f expected_err_pct=%+.1f",
               workload_name(w), cap, mix, achieved, (achieved - cap) / cap * 100, r[1].converge, r[1].charge_err,
               r[1].throttled, ceiling, expected, expected > 0 ? (achieved - expected) / expected * 100 : 0);
        for (int i = 1; i < r[1].n; i++)
            printf("%s%.1f", i == 1 ? " cotenants=" : ",", r[1].co[i]);
        printf("\n");
        fflush(stdout);
    }
    munmap(r, 2 * sizeof(phase_res));
    return rc;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int overhead(long iters) {
    gpu_line g[1] = {{0, 8ull << 30, 100}};
    setup_limits(g, 1);
    workload_env(WL_TINY);
    ctx_on(0);
    CUstream s;
    CHECK_CU(cuStreamCreate(&s, 0));
    CUfunction f = (CUfunction)(uintptr_t)0xa200;
    double r[31];
    for (int round = 0; round < 32; round++) {
        uint64_t t0 = now_ns();
        for (long i = 0; i < iters; i++)
            CHECK_CU(cuLaunchKernel(f, 16, 1, 1, 128, 1, 1, 0, s, NULL, NULL));
        if (round > 0) /* round 0 warms up */
            r[round - 1] = (double)(now_ns() - t0) / (double)iters;
    }
    qsort(r, 31, sizeof(r[0]), cmp_double);
    printf("vcuda-overhead median_ns_per_launch=%.1f\n", r[15]);
    /* launch-heavy: kernels of (next to) no device time back to back for
     * 300 ms, until the device has run them: the host's launch rate */
    uint64_t t0 = now_ns(), n = 0;
    while (now_ns() < t0 + 300000000ull)
        for (int i = 0; i < 256; i++, n++)
            CHECK_CU(cuLaunchKernel(f, 16, 1, 1, 128, 1, 1, 0, s, NULL, NULL));
    CHECK_CU(cuStreamSynchronize(s));
    printf("vcuda-overhead tiny_launches_per_s=%.0f\n", (double)n / ((double)(now_ns() - t0) / 1e9));
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 3 && strcmp(argv[1], "overhead") == 0)
        return overhead(atol(argv[2]));
    if (argc < 3 || strcmp(argv[1], "grid") != 0) {
        fprintf(stderr, "usage: vcuda_grid grid <ms> [workload|all] [cap|all] [mix|all] | overhead <launches>\n");
        return 2;
    }
    /* The fake device round-robins processes by timeslice, as a GPU without
     * MPS does (its FIFO made a small container wait behind a co-tenant's
     * whole queue); FAKE_CUDA_SCHED=fifo in the environment compares. */
    setenv("FAKE_CUDA_SCHED", "timeslice", 0);
    uint64_t dur = (uint64_t)atol(argv[2]) * 1000000ull;
    const char *wsel = argc > 3 ? argv[3] : "all", *csel = argc > 4 ? argv[4] : "all", *msel = argc > 5 ? argv[5] : "all";
    int seq = 0, rc = 0;
    for (int w = 0; w < WL_NAMED; w++) { /* all: the grid's; a workload outside it by name only */
        if (strcmp(wsel, "all") == 0 ? w >= WL_COUNT : workload_parse(wsel) != w)
            continue;
        for (unsigned c = 0; c < sizeof(caps_all) / sizeof(caps_all[0]); c++) {
            if (strcmp(csel, "all") != 0 && atoi(csel) != caps_all[c])
                continue;
            for (int m = 0; m < 3; m++) {
                if (strcmp(msel, "all") != 0 && strcmp(msel, mixes[m]) != 0)
                    continue;
                rc |= run_cell((workload)w, caps_all[c], mixes[m], dur, seq++);
            }
        }
    }
    return rc;
}
