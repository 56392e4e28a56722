/*
 * tests_limiter_measured.c - the compute limiter's reference from the
 * driver (src/measured.c): the node agent's measured file, per process,
 * multiplies the limiter's charges by what the driver measured over what
 * the limiter charged.
 *   limiter_measured_two_containers_graphs_10_90: on the fake's timeslice
 *     scheduler a sampled graph launch preempted at a slice's end measures
 *     the co-tenant's slices too, and a 10% container beside a 90% one got
 *     6% of the GPU; with the node agent's double publishing the driver's
 *     figures, its share in device time is within 10% of its cap. Catches
 *     the factor held at 1 (nomeasured).
 *   limiter_measured_own_line_until_stale: a writer that says this process
 *     ran twice what it did (another process's lines around it): charged
 *     twice its device time; the writer stops: once its last measurement
 *     is 5 s old, charged its device time again. Catches a line taken by
 *     pid alone (measuredpidonly) and a factor kept when stale
 *     (measurednostale).
 *   limiter_measured_malformed_file_ignored: a file off spec anywhere is
 *     ignored whole, logged once.
 * Shares are measured in device time (fakeProcessBusy), as the grid does.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cuda_api.h"
#include "limiter_workloads.h"
#include "measured_agent.h"
#include "util.h"

static void sleep_until(uint64_t t) {
    uint64_t now = now_ns();
    if (t > now)
        usleep((useconds_t)((t - now) / 1000));
}

typedef struct {
    workload w;
    int caps[2];
    uint64_t deadline;
} mcont_arg;
static int mcontainer(int i, void *p) {
    mcont_arg *a = p;
    return workload_container(i, a->w, a->caps[i], a->deadline, 4242 + 31 * (uint64_t)i);
}

TEST(limiter_measured_two_containers_graphs_10_90) {
    workload_env(WL_GRAPHS);
    setenv("FAKE_CUDA_SHM", tpath("fake-shm"), 1);
    uint64_t t0 = now_ns();
    mcont_arg a = {.w = WL_GRAPHS, .caps = {10, 90}, .deadline = t0 + 3000000000ull};
    pid_t p[2];
    for (int i = 0; i < 2; i++) {
        CHECK(mkdir(workload_container_dir(i), 0700) == 0, "mkdir: %s", strerror(errno));
        p[i] = spawn(mcontainer, i, &a);
    }
    static measured_agent ag;
    ag = (measured_agent){.dev = 0, .uuid = fake_uuid(0), .period_ns = MEASURED_AGENT_PERIOD_NS,
                          .deadline = a.deadline, .n = 2};
    for (int i = 0; i < 2; i++)
        ag.dir[i] = strdup(workload_container_dir(i)), ag.pid[i] = p[i];
    pid_t agent = measured_agent_start(&ag);
    /* the last 1.8 s: the factor is first applied about 0.5 s in (a
     * baseline sample, one more, the next read) */
    sleep_until(t0 + 1200000000ull);
    uint64_t b0, a0, b1, a1;
    CHECK(fakeProcessBusy(0, p[0], &b0, &a0) == 0, "no busy time for the container");
    sleep_until(a.deadline - 20000000ull);
    CHECK(fakeProcessBusy(0, p[0], &b1, &a1) == 0, "no busy time for the container");
    for (int i = 0; i < 2; i++)
        CHECK(wait_child(p[i]) == 0, "container %d failed", i);
    CHECK(wait_child(agent) == 0, "the agent's double failed");
    double got = (double)(b1 - b0) / (double)(a1 - a0) * 100;
    fprintf(stderr, "graphs at 10%% beside 90%%: %.2f%% of the device\n", got);
    CHECK(got >= 9 && got <= 11, "%.2f%% at a 10%% cap beside a co-tenant: over-charged, the driver's measurement unused",
          got);
}

/* A writer of the measured file that says the container's process ran
 * `scale` times what the fake ran for it, with another process's line
 * before it and a line of the same pid but another start (a process that
 * had the pid before). */
typedef struct {
    pid_t pid;
    double scale;
    uint64_t deadline;
    int malformed; /* an off-spec line after the process's own */
} lying_arg;
static int lying_writer(int i, void *p) {
    (void)i;
    lying_arg *a = p;
    unsigned long long start = measured_agent_start_time(a->pid);
    CHECK(start != 0, "no start time for %d", (int)a->pid);
    CHECK(mkdir(tpath("measured"), 0755) == 0 || errno == EEXIST, "mkdir");
    const char *u = fake_uuid(0);
    while (now_ns() < a->deadline) {
        uint64_t b = 0, t = 0;
        char text[2048];
        int m = snprintf(text, sizeof(text), "tessera-compute-measured 1\nwritten %llu\n", (unsigned long long)now_ns());
        if (fakeProcessBusy(0, a->pid, &b, &t) == 0 && b > 0) {
            unsigned long long lie = (unsigned long long)((double)b * a->scale);
            m += snprintf(text + m, sizeof(text) - (size_t)m,
                          "gpu %s pid %d start %llu busy %llu at %llu\n"
                          "gpu %s pid %d start %llu busy %llu at %llu\n"
                          "gpu %s pid %d start %llu busy %llu at %llu\n",
                          u, (int)a->pid + 1, start, (unsigned long long)b / 4, (unsigned long long)t, u, (int)a->pid,
                          start + 1, (unsigned long long)b / 4, (unsigned long long)t, u, (int)a->pid, start, lie,
                          (unsigned long long)t);
            if (a->malformed)
                snprintf(text + m, sizeof(text) - (size_t)m, "gpu GPU-FA4E0000-0000-4000-8000-000000000000 pid 1 start 1 busy 1 at 1\n");
        }
        write_file(tpath("measured/.compute.tmp"), text);
        CHECK(rename(tpath("measured/.compute.tmp"), tpath("measured/compute")) == 0, "rename: %s", strerror(errno));
        usleep(100000);
    }
    return 0;
}

typedef struct {
    uint64_t deadline;
} alone_arg;
static int alone_container(int i, void *p) {
    (void)i;
    alone_arg *a = p;
    redirect_stderr(tpath("stderr"));
    ctx_on(0);
    uint64_t rng = 77;
    workload_run(WL_UNIFORM, a->deadline, 0, &rng);
    return 0;
}

/* What the container was charged (the region's busy_ns) over the device
 * time it ran, between two times. */
static double charge_ratio(pid_t pid, uint64_t from, uint64_t to) {
    vc_region_gpu *g = (vc_region_gpu *)((char *)region_map() + VC_REGION_GPU_OFFSET);
    uint64_t b0, b1, t;
    sleep_until(from);
    uint64_t c0 = atomic_load(&g->busy_ns);
    CHECK(fakeProcessBusy(0, pid, &b0, &t) == 0, "no busy time");
    sleep_until(to);
    uint64_t c1 = atomic_load(&g->busy_ns);
    CHECK(fakeProcessBusy(0, pid, &b1, &t) == 0, "no busy time");
    CHECK(b1 > b0, "the container ran nothing");
    return (double)(c1 - c0) / (double)(b1 - b0);
}

static pid_t alone_setup(alone_arg *a, uint64_t dur) {
    workload_env(WL_UNIFORM);
    gpu_line g[1] = {{0, 1ull << 30, 50}};
    setup_limits(g, 1);
    a->deadline = now_ns() + dur;
    return spawn(alone_container, 0, a);
}

TEST(limiter_measured_own_line_until_stale) {
    static alone_arg ca;
    uint64_t t0 = now_ns();
    pid_t c = alone_setup(&ca, 8300000000ull);
    wait_for_file(tpath("region"), 10);
    static lying_arg la;
    la = (lying_arg){.pid = c, .scale = 2, .deadline = t0 + 2000000000ull};
    pid_t w = spawn(lying_writer, 0, &la);
    double r1 = charge_ratio(c, t0 + 1200000000ull, t0 + 2000000000ull);
    CHECK(wait_child(w) == 0, "the writer failed");
    /* its last measurement 5 s old at 7 s at the latest */
    double r2 = charge_ratio(c, t0 + 7200000000ull, t0 + 8200000000ull);
    CHECK(wait_child(c) == 0, "the container failed");
    fprintf(stderr, "charged / device time: %.3f with the file saying x2, %.3f after it went stale\n", r1, r2);
    CHECK(r1 > 1.8 && r1 < 2.2, "charged x%.3f of its device time where the driver's measure (its own line) says x2",
          r1);
    CHECK(r2 > 0.92 && r2 < 1.08, "charged x%.3f of its device time 5 s after the last measurement: a stale factor kept",
          r2);
}

TEST(limiter_measured_malformed_file_ignored) {
    static alone_arg ca;
    uint64_t t0 = now_ns();
    pid_t c = alone_setup(&ca, 2000000000ull);
    wait_for_file(tpath("region"), 10);
    static lying_arg la;
    la = (lying_arg){.pid = c, .scale = 2, .deadline = t0 + 2000000000ull, .malformed = 1};
    pid_t w = spawn(lying_writer, 0, &la);
    double r = charge_ratio(c, t0 + 1200000000ull, t0 + 1900000000ull);
    CHECK(wait_child(w) == 0, "the writer failed");
    CHECK(wait_child(c) == 0, "the container failed");
    fprintf(stderr, "charged / device time: %.3f with a malformed file saying x2\n", r);
    CHECK(r > 0.92 && r < 1.08, "charged x%.3f of its device time from a malformed file", r);
    char *log = read_text(tpath("stderr"));
    const char *want = "measured/compute: line 6: gpu: bad uuid GPU-FA4E0000";
    char *at = strstr(log, want);
    CHECK(at != NULL, "log %s, want %s", log, want);
    CHECK(strstr(at + 1, "measured/compute") == NULL, "logged more than once: %s", log);
}
