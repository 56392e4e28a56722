/*
 * tests_crash.c - processes die (SIGKILL) in the middle of updates; the
 * others must find the region consistent: what the dead held is given back
 * and the cap is still exact to the byte.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "cuda_api.h"
#include "util.h"

#define CAP0 (60 * MiB)

static void one_gpu(void) {
    gpu_line g[1] = {{0, CAP0, 100}};
    setup_limits(g, 1);
    ctx_costs_nothing(); /* the region must balance to the byte after each kill */
}

/* Allocates 1 MiB chunks until OOM; returns how many it got. */
static int fill_count(void) {
    CUdeviceptr d;
    int n = 0;
    CUresult r;
    while ((r = cuMemAlloc_v2(&d, MiB)) == CUDA_SUCCESS)
        n++;
    return r == CUDA_ERROR_OUT_OF_MEMORY ? n : -1;
}

typedef struct {
    chan c;
    long hold_mib;
} holder_arg;

/* Holds hold_mib MiB, reports, then either waits or fills the rest. */
static int hold(int fill_rest, void *arg) {
    holder_arg *a = arg;
    ctx_on(0);
    CUdeviceptr d;
    for (long i = 0; i < a->hold_mib; i++)
        if (cuMemAlloc_v2(&d, MiB) != CUDA_SUCCESS)
            return 10;
    if (fill_rest) {
        int n = fill_count();
        chan_send_up(&a->c, (uint64_t)n);
    } else {
        chan_send_up(&a->c, 0);
    }
    chan_recv_down(&a->c);
    return 0;
}

/* The fake driver blocks inside cuMemAlloc (after vcuda reserved); killed
 * there. Its earlier allocations and the in-flight one are reclaimed. */
static int blocked_alloc(int i, void *arg) {
    (void)i, (void)arg;
    setenv("FAKE_CUDA_BLOCK_ALLOC", tpath("blocked"), 1);
    setenv("FAKE_CUDA_BLOCK_AFTER", "10", 1);
    ctx_on(0);
    CUdeviceptr d;
    for (;;)
        if (cuMemAlloc_v2(&d, MiB) != CUDA_SUCCESS)
            return 1;
}

TEST(crash_killed_inside_driver_alloc) {
    one_gpu();
    holder_arg keep = {.hold_mib = 15};
    chan_init(&keep.c);
    pid_t k = spawn(hold, 0, &keep); /* a live process holding 15 MiB */
    chan_recv_up(&keep.c);
    pid_t v = spawn(blocked_alloc, 0, NULL);
    wait_for_file(tpath("blocked"), 30);
    CHECK(region_used(0) == 26 * MiB, "before the kill: %llu", (unsigned long long)region_used(0));
    kill(v, SIGKILL);
    CHECK(wait_child(v) == 128 + SIGKILL, "victim not killed");
    /* another process now gets exactly what is left: 60 - 15 MiB */
    holder_arg b = {.hold_mib = 0};
    chan_init(&b.c);
    pid_t p = spawn(hold, 1, &b);
    int n = (int)chan_recv_up(&b.c);
    CHECK(n == 45, "after the kill a process got %d MiB, want 45", n);
    CHECK(region_used(0) == CAP0, "region %llu", (unsigned long long)region_used(0));
    chan_send_down(&b.c, 1);
    chan_send_down(&keep.c, 1);
    CHECK(wait_child(p) == 0 && wait_child(k) == 0, "children failed");
    CHECK(region_used(0) == 0 && region_live_slots() == 0, "region %llu, %d slots",
          (unsigned long long)region_used(0), region_live_slots());
}

/* Test build: the victim stops inside vcuda's own critical section, between
 * the CAS on the device total and the update of its slot. */
static int paused_reserve(int i, void *arg) {
    (void)i, (void)arg;
    ctx_on(0);
    CUdeviceptr d;
    for (int k = 0; k < 5; k++)
        if (cuMemAlloc_v2(&d, MiB) != CUDA_SUCCESS)
            return 1;
    setenv("VCUDA_TEST_PAUSE_MARK", tpath("paused"), 1);
    setenv("VCUDA_TEST_PAUSE", "reserve", 1);
    cuMemAlloc_v2(&d, 8 * MiB);
    return 2;
}

TEST_LIB(crash_killed_inside_reservation, "testhooks") {
    one_gpu();
    holder_arg keep = {.hold_mib = 15};
    chan_init(&keep.c);
    pid_t k = spawn(hold, 0, &keep);
    chan_recv_up(&keep.c);
    pid_t v = spawn(paused_reserve, 0, NULL);
    wait_for_file(tpath("paused"), 30);
    CHECK(region_used(0) == 28 * MiB, "total before the kill: %llu", (unsigned long long)region_used(0));
    kill(v, SIGKILL);
    CHECK(wait_child(v) == 128 + SIGKILL, "victim not killed");
    holder_arg b = {.hold_mib = 0};
    chan_init(&b.c);
    pid_t p = spawn(hold, 1, &b);
    int n = (int)chan_recv_up(&b.c);
    CHECK(n == 45, "after the kill a process got %d MiB, want 45", n);
    chan_send_down(&b.c, 1);
    chan_send_down(&keep.c, 1);
    CHECK(wait_child(p) == 0 && wait_child(k) == 0, "children failed");
    CHECK(region_used(0) == 0 && region_live_slots() == 0, "region %llu, %d slots",
          (unsigned long long)region_used(0), region_live_slots());
}

/* Test build: the process reclaiming a dead one is itself killed after
 * freezing the totals. The next process that needs the region finishes the
 * recompute (the flock died with the reclaimer). */
static int paused_reclaim(int i, void *arg) {
    (void)i, (void)arg;
    ctx_on(0);
    setenv("VCUDA_TEST_PAUSE_MARK", tpath("paused-reclaim"), 1);
    setenv("VCUDA_TEST_PAUSE", "reclaim", 1);
    CUdeviceptr d;
    cuMemAlloc_v2(&d, CAP0); /* over what is left: OOM path -> reclaim */
    return 2;
}

TEST_LIB(crash_killed_while_reclaiming, "testhooks") {
    one_gpu();
    holder_arg keep = {.hold_mib = 15};
    chan_init(&keep.c);
    pid_t k = spawn(hold, 0, &keep);
    chan_recv_up(&keep.c);
    pid_t v = spawn(blocked_alloc, 0, NULL); /* dies holding 11 MiB */
    wait_for_file(tpath("blocked"), 30);
    kill(v, SIGKILL);
    wait_child(v);
    pid_t r = spawn(paused_reclaim, 0, NULL);
    wait_for_file(tpath("paused-reclaim"), 30);
    CHECK((atomic_load(&((vc_region_gpu *)((char *)region_map() + VC_REGION_GPU_OFFSET))->used) &
           VC_FROZEN) != 0,
          "reclaimer paused without freezing");
    kill(r, SIGKILL);
    wait_child(r);
    holder_arg b = {.hold_mib = 0};
    chan_init(&b.c);
    pid_t p = spawn(hold, 1, &b);
    int n = (int)chan_recv_up(&b.c);
    CHECK(n == 45, "after both kills a process got %d MiB, want 45", n);
    chan_send_down(&b.c, 1);
    chan_send_down(&keep.c, 1);
    CHECK(wait_child(p) == 0 && wait_child(k) == 0, "children failed");
    CHECK(region_used(0) == 0 && region_live_slots() == 0, "region %llu, %d slots",
          (unsigned long long)region_used(0), region_live_slots());
}

/* Many processes allocating and freeing concurrently while others are
 * killed at random: the books still balance and the cap holds. */
static int churn(int i, void *arg) {
    uint64_t deadline = *(uint64_t *)arg;
    ctx_on(0);
    CUdeviceptr d[8];
    unsigned seed = (unsigned)i * 7919u + 1;
    while (now_ns() < deadline) {
        int n = 0;
        for (int k = 0; k < 8; k++) {
            seed = seed * 1103515245u + 12345u;
            size_t sz = (seed >> 8) % (3 * MiB) + 1;
            CUresult r = cuMemAlloc_v2(&d[n], sz);
            if (r == CUDA_SUCCESS)
                n++;
            else if (r != CUDA_ERROR_OUT_OF_MEMORY)
                return 1;
        }
        for (int k = 0; k < n; k++)
            if (cuMemFree_v2(d[k]) != CUDA_SUCCESS)
                return 1;
    }
    return 0;
}

TEST(crash_churn_with_kills) {
    one_gpu();
    enum { N = 6 };
    pid_t p[N];
    uint64_t deadline = now_ns() + 600000000ull;
    for (int i = 0; i < N; i++)
        p[i] = spawn(churn, i, &deadline);
    usleep(200000);
    kill(p[0], SIGKILL);
    kill(p[1], SIGKILL);
    for (int i = 0; i < N; i++) {
        int rc = wait_child(p[i]);
        CHECK(i < 2 ? rc == 128 + SIGKILL : rc == 0, "child %d: %d", i, rc);
    }
    /* The fake, unlike a real driver, never frees what a killed process
     * held: that is what it still counts now. Live processes never held
     * more than the cap on top of it. */
    fake_stats st;
    fakeDeviceStats(0, &st);
    CHECK(st.peak <= CAP0 + st.used, "fake device peaked at %llu over the cap (+%llu leaked by the dead)",
          (unsigned long long)st.peak, (unsigned long long)st.used);
    /* a newcomer reclaims the two dead and gets the whole cap */
    holder_arg b = {.hold_mib = 0};
    chan_init(&b.c);
    pid_t q = spawn(hold, 1, &b);
    int n = (int)chan_recv_up(&b.c);
    CHECK(n == 60, "newcomer got %d MiB of 60", n);
    chan_send_down(&b.c, 1);
    CHECK(wait_child(q) == 0, "newcomer failed");
    CHECK(region_used(0) == 0 && region_live_slots() == 0, "region %llu, %d slots",
          (unsigned long long)region_used(0), region_live_slots());
}

/* The harness: a child forked by spawn() dies with its parent, so a failed
 * case never leaves a process holding the Go side's output pipe. */
static int sleeper(int i, void *arg) {
    (void)i;
    (void)arg;
    for (;;)
        pause();
    return 0;
}
static int middle(int i, void *arg) {
    (void)i;
    chan *c = arg;
    chan_send_up(c, (uint64_t)spawn(sleeper, 0, NULL));
    _exit(1); /* a failed parent */
}
TEST(harness_child_dies_with_parent) {
    chan c;
    chan_init(&c);
    pid_t m = spawn(middle, 0, &c);
    pid_t g = (pid_t)chan_recv_up(&c);
    CHECK(wait_child(m) == 1, "middle");
    char path[64], st[256];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)g);
    uint64_t end = now_ns() + 5000000000ull;
    for (;;) {
        FILE *f = fopen(path, "r");
        char state = 'X';
        if (f) {
            if (fgets(st, sizeof(st), f)) {
                char *p = strrchr(st, ')');
                if (p && p[1] == ' ')
                    state = p[2];
            }
            fclose(f);
        }
        if (state == 'X' || state == 'Z')
            break; /* gone, or dead and waiting for its new parent to reap it */
        CHECK(now_ns() < end, "grandchild %d outlived its parent (state %c)", (int)g, state);
        usleep(1000);
    }
}
