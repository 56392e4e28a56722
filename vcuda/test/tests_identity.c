/* tests_identity.c - who is alive, and who holds the lock: liveness that
 * survives PID namespaces and pid reuse, no accounting after the exit
 * handler, and a region lock that a stopped process cannot hold forever. */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda_api.h"
#include "util.h"

#define CAP0 (60 * MiB)

static void one_gpu(void) {
    gpu_line g[1] = {{0, CAP0, 100}};
    setup_limits(g, 1);
    ctx_costs_nothing(); /* the cases count held memory to the byte, per process */
}

/* Holds 40 MiB from inside a new PID namespace (where it is pid 1, a pid
 * that in the parent's namespace names another, live process), reports
 * the grandchild's pid in our namespace, then waits to be killed. With
 * i == QUERY it instead asks for the memory figures (which first drops the
 * region's dead processes), reports and exits. */
#define QUERY 2
static int holder_in_pidns(int i, void *arg) {
    chan *c = arg; /* c[0]: the pid in our namespace, c[1]: in its own */
    if (unshare(CLONE_NEWPID) != 0 && unshare(CLONE_NEWUSER | CLONE_NEWPID) != 0) {
        fprintf(stderr, "unshare(CLONE_NEWPID): %s\n", strerror(errno));
        return 3;
    }
    pid_t g = fork();
    if (g < 0)
        return 4;
    if (g == 0) {
        prctl_die_with_parent();
        ctx_on(0);
        if (i == QUERY) {
            size_t free, total;
            if (cuMemGetInfo_v2(&free, &total) != CUDA_SUCCESS)
                _exit(6);
            chan_send_up(&c[1], (uint64_t)getpid());
            exit(0); /* exit, not _exit: vcuda gives its slot back */
        }
        CUdeviceptr d;
        if (cuMemAlloc_v2(&d, 40 * MiB) != CUDA_SUCCESS)
            _exit(5);
        chan_send_up(&c[1], (uint64_t)getpid()); /* 1: its own namespace's view */
        for (;;)
            pause();
    }
    chan_send_up(&c[0], (uint64_t)g);
    int st;
    waitpid(g, &st, 0);
    return i == QUERY && !(WIFEXITED(st) && WEXITSTATUS(st) == 0) ? 7 : 0;
}

TEST(identity_nested_pid_namespace) {
    one_gpu();
    chan c[2];
    chan_init(&c[0]);
    chan_init(&c[1]);
    pid_t m = spawn(holder_in_pidns, 0, c);
    pid_t g = (pid_t)chan_recv_up(&c[0]);
    uint64_t inner = chan_recv_up(&c[1]);
    CHECK(inner == 1, "the holder is pid %llu in its namespace, want 1", (unsigned long long)inner);
    ctx_on(0);
    CUdeviceptr d;
    /* alive in another namespace: its 40 MiB stay charged */
    CHECK(cuMemAlloc_v2(&d, 40 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "a live holder in a nested namespace was reclaimed");
    CHECK_CU(cuMemAlloc_v2(&d, 20 * MiB));
    fake_stats st;
    fakeDeviceStats(0, &st);
    CHECK(st.peak <= CAP0, "fake peak %llu over the cap", (unsigned long long)st.peak);
    CHECK_CU(cuMemFree_v2(d));
    /* killed: its memory comes back */
    kill(g, SIGKILL);
    CHECK(wait_child(m) == 0, "namespace parent");
    CHECK_CU(cuMemAlloc_v2(&d, 40 * MiB));
    CHECK(region_used(0) == 40 * MiB, "region %llu", (unsigned long long)region_used(0));
}

/* How many live slots hold at least bytes on GPU record 0 (live: how many
 * are live). */
static int slots_holding(uint64_t bytes, int *live) {
    vc_region_slot *sl = (vc_region_slot *)((char *)region_map() + VC_REGION_SLOT_OFFSET);
    int n = 0;
    *live = 0;
    for (int i = 0; i < VC_MAX_SLOTS; i++) {
        if (atomic_load(&sl[i].pid) == 0)
            continue;
        (*live)++;
        n += atomic_load(&sl[i].used[0]) >= bytes;
    }
    return n;
}

/* A DRA claim's region is shared by the containers using it, each in its own
 * PID namespace: two live processes with the same pid (1, a container's
 * first process). Neither takes the other's slot for the image it exec'ed
 * from (a pid alone never marks a slot dead), nor does a third looking for
 * the dead (nvidia-smi): neither's memory is dropped from the claim's one
 * cap. */
TEST(identity_same_pid_in_two_pid_namespaces) {
    /* Room for a context's table cost: the fake's NVML lists pids as each
     * namespace sees them, so the second pid 1 finds "itself" listed before
     * its first context and is charged the table (as wherever NVML's pid is
     * not the process's own). */
    gpu_line gl[1] = {{0, 4096 * MiB, 100}};
    setup_limits(gl, 1);
    ctx_costs_nothing();
    chan a[2], b[2];
    for (int i = 0; i < 2; i++) {
        chan_init(&a[i]);
        chan_init(&b[i]);
    }
    pid_t ma = spawn(holder_in_pidns, 0, a);
    pid_t ga = (pid_t)chan_recv_up(&a[0]);
    CHECK(chan_recv_up(&a[1]) == 1, "the first holder is not pid 1 in its namespace");
    CHECK(region_used(0) == 40 * MiB, "first holder: region %llu", (unsigned long long)region_used(0));
    pid_t mb = spawn(holder_in_pidns, 1, b);
    pid_t gb = (pid_t)chan_recv_up(&b[0]);
    CHECK(chan_recv_up(&b[1]) == 1, "the second holder is not pid 1 in its namespace");
    int live = 0;
    int both = slots_holding(40 * MiB, &live);
    CHECK(both == 2 && live == 2, "%d of %d live slots hold 40 MiB or more, want both: the second pid 1 took the first's slot for dead", both, live);
    /* a third pid 1 (nvidia-smi in a third container) looks for the dead */
    chan q[2];
    chan_init(&q[0]);
    chan_init(&q[1]);
    pid_t mq = spawn(holder_in_pidns, QUERY, q);
    chan_recv_up(&q[0]);
    CHECK(chan_recv_up(&q[1]) == 1, "the querying process is not pid 1 in its namespace");
    CHECK(wait_child(mq) == 0, "the querying process failed");
    both = slots_holding(40 * MiB, &live);
    CHECK(both == 2 && live == 2, "after a query: %d of %d live slots hold 40 MiB or more, want both: a pid 1 reclaimed the others", both, live);
    CHECK(region_used(0) >= 80 * MiB, "region %llu: a pid 1's 40 MiB were dropped", (unsigned long long)region_used(0));
    kill(gb, SIGKILL);
    kill(ga, SIGKILL);
    CHECK(wait_child(mb) == 0 && wait_child(ma) == 0, "namespace parents");
    /* both dead now: all of the cap comes back */
    ctx_on(0);
    CUdeviceptr d;
    CHECK_CU(cuMemAlloc_v2(&d, 4000 * MiB));
    CHECK(region_used(0) == 4000 * MiB, "region %llu", (unsigned long long)region_used(0));
}

/* A pid reused by an unrelated process does not keep a dead slot alive:
 * the liveness lock died with its owner. (The dead slot is given our
 * parent's pid and start time, as a reused pid would look to /proc.) */
static uint64_t starttime_of(pid_t pid) {
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    char *t = read_text(path), *p = strrchr(t, ')');
    CHECK(p != NULL, "stat of %d", (int)pid);
    p += 2;
    for (int f = 3; f < 22; f++)
        p = strchr(p, ' ') + 1;
    return strtoull(p, NULL, 10);
}
static int die_holding(int i, void *arg) {
    (void)i, (void)arg;
    ctx_on(0);
    CUdeviceptr d;
    if (cuMemAlloc_v2(&d, 30 * MiB) != CUDA_SUCCESS)
        return 5;
    _exit(0); /* no exit handler: as if killed */
}
TEST(identity_pid_reuse) {
    one_gpu();
    CHECK(wait_child(spawn(die_holding, 0, NULL)) == 0, "holder");
    int fd = open(tpath("region"), O_RDWR);
    CHECK(fd >= 0, "open region");
    void *h = mmap(NULL, VC_REGION_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(h != MAP_FAILED, "mmap region");
    close(fd);
    vc_region_slot *s = (vc_region_slot *)((char *)h + VC_REGION_SLOT_OFFSET);
    int found = 0;
    for (int i = 0; i < VC_MAX_SLOTS; i++) {
        if (atomic_load(&s[i].pid) != 0) {
            /* pretend the pid now belongs to a live process with the same start time */
            atomic_store(&s[i].pid, (uint32_t)getppid());
            s[i].starttime = starttime_of(getppid());
            found = 1;
        }
    }
    CHECK(found, "the dead holder left no slot");
    ctx_on(0);
    CUdeviceptr d;
    CHECK_CU(cuMemAlloc_v2(&d, 50 * MiB)); /* its 30 MiB reclaimed */
}

/* An atexit handler the application registered before vcuda's runs after
 * it: its allocations are refused, not forwarded uncounted. */
static void late_alloc(void) {
    CUdeviceptr d;
    CUresult r = cuMemAlloc_v2(&d, 50 * MiB);
    char buf[32];
    snprintf(buf, sizeof(buf), "%d\n", r);
    write_file(tpath("late-alloc"), buf);
}
static int exits_allocating(int i, void *arg) {
    (void)i, (void)arg;
    atexit(late_alloc); /* before any CUDA call: vcuda's handler comes later, runs first */
    ctx_on(0);
    CUdeviceptr d;
    if (cuMemAlloc_v2(&d, 40 * MiB) != CUDA_SUCCESS)
        return 5;
    return 0;
}
TEST(identity_alloc_after_exit_handler_refused) {
    one_gpu();
    pid_t p = spawn(exits_allocating, 0, NULL);
    CHECK(wait_child(p) == 0, "child");
    char *r = read_text(tpath("late-alloc"));
    CHECK(atoi(r) == CUDA_ERROR_OUT_OF_MEMORY, "allocation after the exit handler returned %s", r);
}

/* Test build: a reclaimer stopped with the region lock held (and the totals
 * frozen) does not stall the container: another process's allocation is
 * refused within the lock's deadline instead of waiting forever. */
static int stopped_reclaim(int i, void *arg) {
    (void)i, (void)arg;
    ctx_on(0);
    setenv("VCUDA_TEST_PAUSE_MARK", tpath("paused-reclaim"), 1);
    setenv("VCUDA_TEST_PAUSE", "reclaim", 1);
    CUdeviceptr d;
    cuMemAlloc_v2(&d, 55 * MiB); /* over what is left: OOM path -> reclaim -> paused */
    return 2;
}
static int dead_holder(int i, void *arg) {
    (void)i, (void)arg;
    ctx_on(0);
    CUdeviceptr d;
    if (cuMemAlloc_v2(&d, 10 * MiB) != CUDA_SUCCESS)
        return 5;
    _exit(0);
}
TEST_LIB(identity_stopped_lock_holder_fails_closed, "testhooks") {
    one_gpu();
    CHECK(wait_child(spawn(dead_holder, 0, NULL)) == 0, "dead holder"); /* something to reclaim */
    pid_t r = spawn(stopped_reclaim, 0, NULL);
    wait_for_file(tpath("paused-reclaim"), 30);
    kill(r, SIGSTOP);
    ctx_on(0);
    CUdeviceptr d;
    uint64_t t0 = now_ns();
    CUresult res = cuMemAlloc_v2(&d, MiB);
    double waited = (double)(now_ns() - t0) / 1e9;
    fprintf(stderr, "allocation returned %d after %.2f s\n", res, waited);
    CHECK(res == CUDA_ERROR_OUT_OF_MEMORY, "allocation with the region frozen by a stopped process: %d", res);
    CHECK(waited < 10, "waited %.1f s", waited);
    /* once the stopped process is gone, the container recovers */
    kill(r, SIGKILL);
    wait_child(r);

    CHECK_CU(cuMemAlloc_v2(&d, 50 * MiB));
    CHECK(region_used(0) == 50 * MiB, "region %llu", (unsigned long long)region_used(0));
}
