/* tests_fake.c - where the fake driver mirrors the real one, checked on the
 * fake alone (no vcuda preloaded): a double is only as good as its
 * strictness, so each documented rule the fake claims is a row here. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_api.h"
#include "util.h"

/* NVML's compute process lists (nvmlDeviceGetComputeRunningProcesses v1,
 * v2, v3, and nvmlDeviceGetRunningProcessDetailList in compute mode, with
 * numProcArrayEntries and procArray for *infoCount and infos) size themselves as NVIDIA's nvml.h documents them (the doc
 * comments of those functions; e.g. NVML 12.2 as vendored in NVIDIA/go-nvml,
 * pkg/nvml/nvml.h): *infoCount = 0 asks how many processes there are, with
 * infos allowed to be NULL, and answers NVML_SUCCESS when none run, else
 * NVML_ERROR_INSUFFICIENT_SIZE; an array too small for the list answers
 * NVML_ERROR_INSUFFICIENT_SIZE with *infoCount set to the size needed; a
 * large enough one is filled and *infoCount is the number of entries;
 * infoCount NULL is NVML_ERROR_INVALID_ARGUMENT; any call outside
 * nvmlInit/nvmlShutdown is NVML_ERROR_UNINITIALIZED. */
typedef struct {
    const char *what;
    int procs;        /* processes on the device when the row runs: 0 or 2 */
    unsigned count;   /* *infoCount passed in */
    int array;        /* 1: an array of 8 entries, 0: infos = NULL */
    nvmlReturn_t want;
    unsigned want_count;
} sizing_row;

static const sizing_row sizing_rows[] = {
    {"count query, no process", 0, 0, 0, NVML_SUCCESS, 0},
    {"count 0 with an array, no process", 0, 0, 1, NVML_SUCCESS, 0},
    {"room for 4, no process", 0, 4, 1, NVML_SUCCESS, 0},
    {"count query, two processes", 2, 0, 0, NVML_ERROR_INSUFFICIENT_SIZE, 2},
    {"count 0 with an array, two processes", 2, 0, 1, NVML_ERROR_INSUFFICIENT_SIZE, 2},
    {"room for 1, two processes", 2, 1, 1, NVML_ERROR_INSUFFICIENT_SIZE, 2},
    {"room for exactly 2", 2, 2, 1, NVML_SUCCESS, 2},
    {"room for 4, two processes", 2, 4, 1, NVML_SUCCESS, 2},
};

/* One call of list version ver (1, 2, 3: nvmlDeviceGetComputeRunningProcesses
 * v1, v2, v3; 4: nvmlDeviceGetRunningProcessDetailList in compute mode, whose
 * numProcArrayEntries and procArray size it as *infoCount and infos do the
 * others, per its nvml.h doc comment); count NULL passes no count (for the
 * detail list: no list). On success the entries' pids and memory are copied
 * out. */
static const char *const list_name[] = {"", "v1", "v2", "v3", "detail list"};
enum { LISTS = 4 };

static nvmlReturn_t list(int ver, nvmlDevice_t d, unsigned *count, int array, unsigned pid[8],
                         unsigned long long used[8]) {
    nvmlProcessInfo_v1_t v1[8];
    nvmlProcessInfo_t v2[8];
    nvmlProcessDetail_v1_t det[8];
    memset(v1, 0, sizeof(v1));
    memset(v2, 0, sizeof(v2));
    memset(det, 0, sizeof(det));
    nvmlReturn_t r;
    if (ver == 4) {
        nvmlProcessDetailList_t dl = {nvmlProcessDetailList_v1, 0, count ? *count : 0, array ? det : NULL};
        r = nvmlDeviceGetRunningProcessDetailList(d, count ? &dl : NULL);
        if (count)
            *count = dl.numProcArrayEntries;
    } else {
        r = ver == 1   ? nvmlDeviceGetComputeRunningProcesses(d, count, array ? v1 : NULL)
            : ver == 2 ? nvmlDeviceGetComputeRunningProcesses_v2(d, count, array ? v2 : NULL)
                       : nvmlDeviceGetComputeRunningProcesses_v3(d, count, array ? v2 : NULL);
    }
    if (r == NVML_SUCCESS && count)
        for (unsigned i = 0; i < *count && i < 8; i++) {
            pid[i] = ver == 1 ? v1[i].pid : ver == 4 ? det[i].pid : v2[i].pid;
            used[i] = ver == 1 ? v1[i].usedGpuMemory : ver == 4 ? det[i].usedGpuMemory : v2[i].usedGpuMemory;
            if (ver == 2 || ver == 3)
                CHECK(v2[i].gpuInstanceId == 0xFFFFFFFFu && v2[i].computeInstanceId == 0xFFFFFFFFu,
                      "%s: instance ids of a non-MIG GPU", list_name[ver]);
            if (ver == 4)
                CHECK(det[i].gpuInstanceId == 0xFFFFFFFFu && det[i].computeInstanceId == 0xFFFFFFFFu,
                      "%s: instance ids of a non-MIG GPU", list_name[ver]);
        }
    return r;
}

static void sizing_rows_with(int procs, nvmlDevice_t d, pid_t child) {
    for (size_t k = 0; k < sizeof(sizing_rows) / sizeof(sizing_rows[0]); k++) {
        const sizing_row *row = &sizing_rows[k];
        if (row->procs != procs)
            continue;
        for (int ver = 1; ver <= LISTS; ver++) {
            unsigned count = row->count, pid[8] = {0};
            unsigned long long used[8] = {0};
            nvmlReturn_t r = list(ver, d, &count, row->array, pid, used);
            CHECK(r == row->want && count == row->want_count, "%s, %s: returned %d with count %u, want %d with %u",
                  list_name[ver], row->what, r, count, row->want, row->want_count);
            if (r != NVML_SUCCESS || procs == 0)
                continue;
            /* the entries: this process (10 MiB) and the child (20 MiB),
             * each with its context's own memory */
            for (unsigned i = 0; i < count; i++) {
                unsigned long long want = pid[i] == (unsigned)getpid() ? FAKE_CTX_BYTES_SM90 + 10 * MiB
                                          : pid[i] == (unsigned)child ? FAKE_CTX_BYTES_SM90 + 20 * MiB
                                                                      : 0;
                CHECK(want && used[i] == want, "%s, %s: entry %u is pid %u with %llu bytes", list_name[ver], row->what,
                      i, pid[i], used[i]);
            }
            CHECK(pid[0] != pid[1], "%s, %s: one process listed twice", list_name[ver], row->what);
        }
    }
    for (int ver = 1; ver <= LISTS; ver++) {
        unsigned pid[8];
        unsigned long long used[8];
        CHECK(list(ver, d, NULL, 1, pid, used) == NVML_ERROR_INVALID_ARGUMENT, "%s: infoCount (list) NULL",
              list_name[ver]);
    }
    /* The detail list's modes: 0 compute, 1 graphics, 2 MPS compute (none of
     * those two on the fake: an empty list); any other is
     * NVML_ERROR_INVALID_ARGUMENT ("plist->mode is invalid"). */
    nvmlProcessDetail_v1_t det[8];
    for (unsigned mode = 1; mode <= 3; mode++) {
        nvmlProcessDetailList_t dl = {nvmlProcessDetailList_v1, mode, 8, det};
        nvmlReturn_t r = nvmlDeviceGetRunningProcessDetailList(d, &dl);
        if (mode < 3)
            CHECK(r == NVML_SUCCESS && dl.numProcArrayEntries == 0, "detail list, mode %u: %d with %u entries", mode,
                  r, dl.numProcArrayEntries);
        else
            CHECK(r == NVML_ERROR_INVALID_ARGUMENT, "detail list, mode %u (invalid): %d", mode, r);
    }
}

static int second_process(int i, void *arg) {
    (void)i;
    chan *c = arg;
    ctx_on(0);
    CUdeviceptr p;
    CHECK_CU(cuMemAlloc_v2(&p, 20 * MiB));
    chan_send_up(c, 1);
    chan_recv_down(c);
    return 0;
}

TEST_LIB(fake_nvml_process_list_sizing, "none") {
    CHECK(getenv("LD_PRELOAD") == NULL, "the case checks the fake's own NVML: no vcuda");
    setenv("FAKE_CUDA_SHM", tpath("fake-shm"), 1); /* processes see each other's memory */
    CHECK(nvmlInit_v2() == NVML_SUCCESS, "nvmlInit");
    nvmlDevice_t d;
    CHECK(nvmlDeviceGetHandleByIndex_v2(0, &d) == NVML_SUCCESS, "handle");
    sizing_rows_with(0, d, 0);

    ctx_on(0);
    CUdeviceptr p;
    CHECK_CU(cuMemAlloc_v2(&p, 10 * MiB));
    chan c;
    chan_init(&c);
    pid_t child = spawn(second_process, 0, &c);
    chan_recv_up(&c);
    sizing_rows_with(2, d, child);
    chan_send_down(&c, 1);
    CHECK(wait_child(child) == 0, "the second process failed");

    CHECK(nvmlShutdown() == NVML_SUCCESS, "shutdown");
    for (int ver = 1; ver <= LISTS; ver++) {
        unsigned count = 8, pid[8];
        unsigned long long used[8];
        CHECK(list(ver, d, &count, 1, pid, used) == NVML_ERROR_UNINITIALIZED, "%s after nvmlShutdown",
              list_name[ver]);
    }
}

/* Module loading, on the fake alone: lazy by default as CUDA 12.2+ (the load
 * takes one 2 MiB page for a module without globals; a function's code is
 * taken at its first cuModuleGetFunction, cuKernelGetFunction or CUkernel
 * launch, never at cuLibraryGetKernel), eager with CUDA_MODULE_LOADING=EAGER;
 * a table claiming more code than the image holds is refused. */
static uint64_t dev_used(void) {
    fake_stats st;
    fakeDeviceStats(0, &st);
    return st.used;
}
static void modules_on_fake(int eager) {
    CHECK(getenv("LD_PRELOAD") == NULL, "the case checks the fake itself: no vcuda");
    setenv("FAKE_CUDA_CTX_BYTES", "0", 1);
    if (eager)
        setenv("CUDA_MODULE_LOADING", "EAGER", 1);
    CUcontext c = ctx_on(0);
    unsigned char *img = fake_fatbin(8 * MiB, 1 * MiB, 2, 3 * MiB); /* 1 MiB globals, 2 x 3 MiB code */
    CUmodule m;
    CUfunction f;
    CHECK_CU(cuModuleLoadData(&m, img));
    CHECK(dev_used() == (eager ? 8 : 2) * MiB, "after the load: %llu", (unsigned long long)dev_used());
    CHECK(cuModuleGetFunction(&f, m, "nope") == CUDA_ERROR_NOT_FOUND, "an unknown function");
    CHECK_CU(cuModuleGetFunction(&f, m, "k1"));
    CHECK(dev_used() == (eager ? 8 : 4) * MiB, "after k1: %llu", (unsigned long long)dev_used());
    CHECK_CU(cuModuleGetFunction(&f, m, "k1"));
    CHECK(dev_used() == (eager ? 8 : 4) * MiB, "k1 again: %llu", (unsigned long long)dev_used());
    CUlibrary lib;
    CUkernel k1, k2;
    CHECK_CU(cuLibraryLoadData(&lib, img, NULL, NULL, 0, NULL, NULL, 0));
    CHECK_CU(cuLibraryGetKernel(&k1, lib, "k1"));
    CHECK_CU(cuLibraryGetKernel(&k2, lib, "k2"));
    CHECK(dev_used() == (eager ? 16 : 6) * MiB, "library, kernels looked up: %llu", (unsigned long long)dev_used());
    CHECK_CU(cuLaunchKernel((CUfunction)k1, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL));
    CHECK(dev_used() == (eager ? 16 : 8) * MiB, "k1 launched: %llu", (unsigned long long)dev_used());
    CHECK_CU(cuKernelGetFunction(&f, k2));
    CHECK(dev_used() == (eager ? 16 : 12) * MiB, "k2 as a function: %llu", (unsigned long long)dev_used());
    CHECK_CU(cuLibraryUnload(lib));
    CHECK_CU(cuModuleUnload(m));
    CHECK(dev_used() == 0, "left: %llu", (unsigned long long)dev_used());
    /* more code than the image holds */
    unsigned char *bad = fake_fatbin(5 * MiB, 0, 2, 3 * MiB);
    CHECK(cuModuleLoadData(&m, bad) == 218, "a table claiming 6 MiB of code in a 5 MiB image");
    CHECK(dev_used() == 0, "a refused image took %llu", (unsigned long long)dev_used());
    /* a module's code goes with its context */
    CHECK_CU(cuModuleLoadData(&m, img));
    CHECK_CU(cuModuleGetFunction(&f, m, "k2"));
    CHECK_CU(cuCtxDestroy_v2(c));
    CHECK(dev_used() == 0, "after the context: %llu", (unsigned long long)dev_used());
    free(bad);
    free(img);
}
TEST_LIB(fake_modules_lazy, "none") { modules_on_fake(0); }
TEST_LIB(fake_modules_eager, "none") { modules_on_fake(1); }

/* Mapped pinned memory and cuStreamWaitValue32_v2, as the CUDA driver API
 * documents them ("Stream Memory Operations", "Memory Management"): the
 * wait takes a device pointer (mapped host memory: DEVICEMAP, then
 * cuMemHostGetDevicePointer, which refuses memory allocated without it);
 * flags are GEQ (cyclic), EQ, AND, NOR, optionally FLUSH (platform
 * hardware only); the stream's later work waits until the condition holds,
 * and an event recorded behind it completes only then. Never-met waits
 * are bounded here: the case writes the word itself. */
static void *sync_thread(void *p) {
    cuStreamSynchronize((CUstream)p);
    return NULL;
}
TEST_LIB(fake_stream_wait_value, "none") {
    ctx_on(0);
    CUstream s;
    CHECK_CU(cuStreamCreate(&s, 0));
    void *mapped = NULL, *plain = NULL;
    CHECK(cuMemHostAlloc(&mapped, 4096, 0x80) == CUDA_ERROR_INVALID_VALUE, "unknown host-alloc flag accepted");
    CHECK_CU(cuMemHostAlloc(&mapped, 4096, 0x2 /* DEVICEMAP */));
    CHECK_CU(cuMemHostAlloc(&plain, 4096, 0));
    CHECK(fakeHostAllocs() == 2, "%d host allocations alive, want 2", fakeHostAllocs());
    CUdeviceptr dp = 0, dq = 0;
    CHECK(cuMemHostGetDevicePointer_v2(&dq, plain, 0) == CUDA_ERROR_INVALID_VALUE,
          "a device pointer for memory not mapped for the device");
    CHECK(cuMemHostGetDevicePointer_v2(&dp, mapped, 1) == CUDA_ERROR_INVALID_VALUE, "flags must be 0");
    int local = 0;
    CHECK(cuMemHostGetDevicePointer_v2(&dq, &local, 0) == CUDA_ERROR_INVALID_VALUE, "pageable memory mapped");
    CHECK_CU(cuMemHostGetDevicePointer_v2(&dp, mapped, 0));
    _Atomic uint32_t *w = mapped;
    CHECK(cuStreamWaitValue32_v2(s, (CUdeviceptr)(uintptr_t)plain, 1, 0) == CUDA_ERROR_INVALID_VALUE,
          "a wait on memory the device cannot address");
    CHECK(cuStreamWaitValue32_v2(s, dp + 2, 1, 0) == CUDA_ERROR_INVALID_VALUE, "a misaligned word");
    CHECK(cuStreamWaitValue32_v2(s, dp, 1, 0x7) == CUDA_ERROR_INVALID_VALUE, "an unknown condition");
    CHECK(cuStreamWaitValue32_v2(s, dp, 1, 1u << 30) == CUDA_ERROR_NOT_SUPPORTED,
          "FLUSH without CAN_FLUSH_REMOTE_WRITES");
    uint64_t calls0 = fakeWaitValueCalls();
    /* GEQ on 5: the kernel behind it waits while the word is below */
    fake_func f = {32, 0, 1000000, 0};
    CHECK(fakeFunctionSet((CUfunction)(uintptr_t)0xe100, &f) == 0, "fakeFunctionSet");
    CUevent e0, e1;
    CHECK_CU(cuEventCreate(&e0, 0));
    CHECK_CU(cuEventCreate(&e1, 0));
    atomic_store(w, 4);
    CHECK_CU(cuStreamWaitValue32_v2(s, dp, 5, 0 /* GEQ */));
    CHECK_CU(cuEventRecord(e0, s));
    CHECK_CU(cuLaunchKernel((CUfunction)(uintptr_t)0xe100, 16, 1, 1, 256, 1, 1, 0, s, NULL, NULL));
    CHECK_CU(cuEventRecord(e1, s));
    pthread_t t;
    CHECK(pthread_create(&t, NULL, sync_thread, s) == 0, "pthread_create");
    struct timespec ts = {0, 30000000};
    nanosleep(&ts, NULL);
    CHECK(cuEventQuery(e0) == CUDA_ERROR_NOT_READY, "an event behind an unmet wait completed");
    CHECK(pthread_tryjoin_np(t, NULL) != 0, "a stream synchronize returned with a wait unmet");
    atomic_store(w, 5);
    CHECK(pthread_join(t, NULL) == 0, "join");
    CHECK_CU(cuEventQuery(e1));
    float ms = 0;
    CHECK_CU(cuEventElapsedTime(&ms, e0, e1));
    /* the held work runs back to back once released: the kernel's time
     * (a partial wave: 16 of 128 blocks), not the wait */
    CHECK(ms > 0.1f && ms < 1.1f, "the held kernel measured %.3f ms, want its device time", ms);
    /* cyclic GEQ: 0x00000001 is "after" 0xffffffff */
    atomic_store(w, 1);
    CHECK_CU(cuStreamWaitValue32_v2(s, dp, 0xffffffffu, 0));
    CHECK_CU(cuEventRecord(e0, s));
    CHECK_CU(cuStreamSynchronize(s));
    /* EQ, AND, NOR: each held until its condition holds */
    struct { unsigned op; uint32_t value, unmet, met; } rows[] = {
        {1, 7, 6, 7}, {2, 0x10, 0x0f, 0x30}, {3, 0xfffffff0u, 0xffffffffu, 0x0000000eu}};
    for (unsigned i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
        atomic_store(w, rows[i].unmet);
        CHECK_CU(cuStreamWaitValue32_v2(s, dp, rows[i].value, rows[i].op));
        CHECK_CU(cuEventRecord(e0, s));
        nanosleep(&(struct timespec){0, 2000000}, NULL);
        CHECK(cuEventQuery(e0) == CUDA_ERROR_NOT_READY, "op %u: passed on %#x", rows[i].op, rows[i].unmet);
        atomic_store(w, rows[i].met);
        CHECK_CU(cuStreamSynchronize(s));
        CHECK_CU(cuEventQuery(e0));
    }
    CHECK(fakeWaitValueCalls() - calls0 == 5, "%llu waits counted, want 5",
          (unsigned long long)(fakeWaitValueCalls() - calls0));
    /* the poller, not only a driver call, sees the word: no call is made
     * between the store and the event's completion */
    atomic_store(w, 0);
    CHECK_CU(cuStreamWaitValue32_v2(s, dp, 1, 0));
    CHECK_CU(cuEventRecord(e0, s));
    atomic_store(w, 1);
    nanosleep(&(struct timespec){0, 20000000}, NULL);
    CHECK(cuEventElapsedTime(&ms, e0, e0) == CUDA_SUCCESS, "the wait was not released without a driver call");
    CHECK_CU(cuMemFreeHost(plain));
    CHECK(cuMemFreeHost(plain) == CUDA_ERROR_INVALID_VALUE, "a double free of host memory accepted");
    CHECK_CU(cuMemFreeHost(mapped));
    CHECK(fakeHostAllocs() == 0, "host allocations left");
}

/* The knobs that make the fake a driver without them: no mapped host
 * memory (FAKE_CUDA_MAP_HOST=0), no stream memory operations
 * (FAKE_CUDA_STREAM_MEMOPS=0); and host allocations go with their context. */
TEST_LIB(fake_stream_wait_value_unsupported, "none") {
    setenv("FAKE_CUDA_MAP_HOST", "0", 1);
    CUcontext c = ctx_on(0);
    int v = -1;
    CHECK_CU(cuDeviceGetAttribute(&v, 19 /* CAN_MAP_HOST_MEMORY */, 0));
    CHECK(v == 0, "CAN_MAP_HOST_MEMORY %d with FAKE_CUDA_MAP_HOST=0", v);
    void *mapped = NULL;
    CHECK_CU(cuMemHostAlloc(&mapped, 64, 0x2));
    CUdeviceptr dp;
    CHECK(cuMemHostGetDevicePointer_v2(&dp, mapped, 0) == CUDA_ERROR_NOT_SUPPORTED, "mapped without the device's support");
    unsetenv("FAKE_CUDA_MAP_HOST");
    CHECK_CU(cuDeviceGetAttribute(&v, 19, 0));
    CHECK(v == 1, "CAN_MAP_HOST_MEMORY %d by default", v);
    CHECK_CU(cuMemHostGetDevicePointer_v2(&dp, mapped, 0));
    setenv("FAKE_CUDA_STREAM_MEMOPS", "0", 1);
    CUstream s;
    CHECK_CU(cuStreamCreate(&s, 0));
    CHECK(cuStreamWaitValue32_v2(s, dp, 0, 0) == CUDA_ERROR_NOT_SUPPORTED, "a wait without stream memory operations");
    unsetenv("FAKE_CUDA_STREAM_MEMOPS");
    CHECK_CU(cuStreamWaitValue32_v2(s, dp, 0, 0));
    CHECK_CU(cuStreamSynchronize(s));
    setenv("FAKE_CUDA_HOST_ALLOC_FAIL", "1", 1);
    void *more = NULL;
    CHECK(cuMemHostAlloc(&more, 64, 0x2) == CUDA_ERROR_OUT_OF_MEMORY, "FAKE_CUDA_HOST_ALLOC_FAIL ignored");
    unsetenv("FAKE_CUDA_HOST_ALLOC_FAIL");
    CHECK(fakeHostAllocs() == 1, "%d host allocations", fakeHostAllocs());
    CHECK_CU(cuCtxDestroy_v2(c));
    CHECK(fakeHostAllocs() == 0, "a destroyed context's host allocation kept");
}

/* ---- the timeslice scheduler (FAKE_CUDA_SCHED=timeslice) ----
 * A GPU without MPS round-robins the contexts that have work, a timeslice
 * each (2 ms here), and switches early when the running one runs out of
 * work; the switch costs FAKE_CUDA_CTXSW_NS (2 us) each time, not each
 * kernel. Device times are read with fakeEventTime, the fake's own clock,
 * so the rows below assert the replay, not how fast the host ran it (a host
 * bound appears only where the case submits, and is 5x what it allows).
 * Each row fails under FAKE_CUDA_SCHED=fifo (the environment's value wins
 * over the case's, the default, so running the case by hand with it checks
 * that), where
 * a process's work waits for all another queued before it, except where a
 * row says otherwise. */
#define TS_BLOCKS 128 /* of 256 threads: one wave of the fake's 16 SMs */
#define TS_MS 1000000ull
static CUfunction ts_fn(uintptr_t h, uint64_t ns) {
    fake_func f = {32, 0, ns, 0};
    CHECK(fakeFunctionSet((CUfunction)h, &f) == 0, "fakeFunctionSet");
    return (CUfunction)h;
}
static void ts_launch(CUfunction f, CUstream s) {
    CHECK_CU(cuLaunchKernel(f, TS_BLOCKS, 1, 1, 256, 1, 1, 0, s, NULL, NULL));
}
static void ts_setup(void) {
    CHECK(getenv("LD_PRELOAD") == NULL, "the case checks the fake itself: no vcuda");
    setenv("FAKE_CUDA_SCHED", "timeslice", 0);
    setenv("FAKE_CUDA_QUEUE_NS", "10000000000", 1); /* a deep queue at once */
    setenv("FAKE_CUDA_SHM", tpath("fake-shm"), 1);  /* processes share the device */
}
static uint64_t ev_ns(CUevent e) {
    uint64_t t = 0;
    CHECK(fakeEventTime(e, &t) == 0, "an event not reached after its stream was synchronized");
    return t;
}
static uint64_t busy_of_pid(int pid) {
    uint64_t b = 0, at = 0;
    CHECK(fakeProcessBusy(0, pid, &b, &at) == 0, "no busy time for pid %d", pid);
    return b;
}

/* A process that keeps the device busy: n kernels of `wave` ns on one
 * stream, an event after each. It says when they are queued, then takes a
 * time T from the parent and answers when its first kernel after T ended
 * (0: none did). */
#define HOG_MAX 400
typedef struct {
    chan c;
    int n;
    uint64_t wave;
} hog_arg;
static int hog(int i, void *p) {
    (void)i;
    hog_arg *a = p;
    ctx_on(0);
    CUfunction f = ts_fn(0xe200, a->wave);
    CUstream s;
    CHECK_CU(cuStreamCreate(&s, 0));
    static CUevent ev[HOG_MAX];
    for (int k = 0; k < a->n; k++) {
        CHECK_CU(cuEventCreate(&ev[k], 0));
        ts_launch(f, s);
        CHECK_CU(cuEventRecord(ev[k], s));
    }
    chan_send_up(&a->c, now_ns());
    uint64_t t = chan_recv_down(&a->c);
    CHECK_CU(cuStreamSynchronize(s));
    uint64_t first = 0;
    for (int k = 0; k < a->n && !first; k++)
        if (ev_ns(ev[k]) > t)
            first = ev_ns(ev[k]);
    chan_send_up(&a->c, first);
    return 0;
}
static pid_t hog_start(hog_arg *a, int n, uint64_t wave) {
    a->n = n, a->wave = wave;
    chan_init(&a->c);
    pid_t h = spawn(hog, 0, a);
    chan_recv_up(&a->c);
    return h;
}
static uint64_t hog_finish(hog_arg *a, pid_t h, uint64_t t) {
    chan_send_down(&a->c, t);
    uint64_t first = chan_recv_up(&a->c);
    CHECK(wait_child(h) == 0, "the other process failed");
    return first;
}

/* A process arriving beside one with 100 ms queued starts within about a
 * timeslice, not behind the other's queue (FIFO: ~100 ms). */
TEST_LIB(fake_timeslice_alternates, "none") {
    ts_setup();
    hog_arg a;
    pid_t h = hog_start(&a, 200, TS_MS / 2);
    ctx_on(0);
    CUfunction f = ts_fn(0xe300, TS_MS / 2);
    CUstream s;
    CUevent e0, e1;
    CHECK_CU(cuStreamCreate(&s, 0));
    CHECK_CU(cuEventCreate(&e0, 0));
    CHECK_CU(cuEventCreate(&e1, 0));
    uint64_t t0 = now_ns();
    CHECK_CU(cuEventRecord(e0, s));
    ts_launch(f, s);
    CHECK_CU(cuEventRecord(e1, s));
    CHECK_CU(cuStreamSynchronize(s));
    uint64_t s0 = ev_ns(e0), s1 = ev_ns(e1);
    uint64_t other = busy_of_pid(h);
    hog_finish(&a, h, s1);
    CHECK(s0 - t0 < 10 * TS_MS, "the arrival waited %.2f ms for the device, want about a timeslice (2 ms)",
          (double)(s0 - t0) / 1e6);
    /* its kernel ran whole in its slice: the other's time is not in it */
    CHECK(s1 - s0 == TS_MS / 2, "its 0.5 ms kernel took %.3f ms of device time", (double)(s1 - s0) / 1e6);
    CHECK(other < 50 * TS_MS, "the other process had %.1f ms of the device before it, want its slices only",
          (double)other / 1e6);
}

/* The running context that runs out of work gives the device up at once:
 * the other resumes a switch later, not at the end of the slice. (FIFO: the
 * other's whole queue ran before, none of its kernels ends after.) */
TEST_LIB(fake_timeslice_yields_early, "none") {
    ts_setup();
    hog_arg a;
    pid_t h = hog_start(&a, 200, TS_MS / 2);
    ctx_on(0);
    CUfunction f = ts_fn(0xe300, TS_MS / 5);
    CUstream s;
    CUevent e1;
    CHECK_CU(cuStreamCreate(&s, 0));
    CHECK_CU(cuEventCreate(&e1, 0));
    ts_launch(f, s);
    CHECK_CU(cuEventRecord(e1, s));
    CHECK_CU(cuStreamSynchronize(s));
    uint64_t s1 = ev_ns(e1);
    uint64_t first = hog_finish(&a, h, s1);
    CHECK(first, "none of the other process's kernels ended after this one's");
    /* its kernel in flight (0.5 ms, partly run) ends at most 0.5 ms and a
     * switch after; held to the slice's end it would be 1.8 ms later */
    CHECK(first - s1 <= TS_MS / 2 + 10000, "the other process resumed %.3f ms after this one ran out of work",
          (double)(first - s1) / 1e6);
}

/* Two processes with deep queues of short kernels (20 us, 100 a slice): the
 * device switches at slice ends, about once per 2 ms of their work, each
 * switch paid once, not at every kernel (FIFO: once, the second queue runs
 * after the first). */
static int short_queue(int i, void *p) {
    (void)i;
    chan *c = p;
    ctx_on(0);
    CUfunction f = ts_fn(0xe400, 20000);
    CUstream s;
    CHECK_CU(cuStreamCreate(&s, 0));
    chan_recv_down(c);
    for (int k = 0; k < 5000; k++) /* 100 ms */
        ts_launch(f, s);
    chan_send_up(c, 1);
    CHECK_CU(cuStreamSynchronize(s));
    return 0;
}
TEST_LIB(fake_timeslice_switch_once, "none") {
    ts_setup();
    chan c;
    chan_init(&c);
    pid_t h = spawn(short_queue, 0, &c);
    ctx_on(0);
    CUfunction f = ts_fn(0xe400, 20000);
    CUstream s;
    CHECK_CU(cuStreamCreate(&s, 0));
    fake_stats st0, st1;
    CHECK(fakeDeviceStats(0, &st0) == 0, "fakeDeviceStats");
    chan_send_down(&c, 1);
    chan_recv_up(&c);
    for (int k = 0; k < 5000; k++)
        ts_launch(f, s);
    CHECK_CU(cuStreamSynchronize(s));
    CHECK(wait_child(h) == 0, "the other process failed");
    CHECK(fakeDeviceStats(0, &st1) == 0, "fakeDeviceStats");
    uint64_t n = st1.switches - st0.switches;
    /* at most 200 ms / 2 ms, less the time the first ran alone while the
     * second was queueing */
    CHECK(n >= 10 && n <= 110, "%llu context switches for two 100 ms queues of 20 us kernels, want one per 2 ms slice",
          (unsigned long long)n);
    CHECK(st1.busy - st0.busy == 200 * TS_MS, "device busy %.3f ms, want the 200 ms of work",
          (double)(st1.busy - st0.busy) / 1e6);
}

/* An idle process's first kernel starts at once on an idle device; beside a
 * busy one it gets its slices, no more for having been idle (its clock does
 * not run while it has no work), and every switch costs FAKE_CUDA_CTXSW_NS
 * (3 ms here, to see it): 10 ms of its work in 5 slices, the other's 4
 * slices between, 8 switches: 42 ms (FIFO: 10 ms, the other's queue first;
 * the first half passes under FIFO too). */
TEST_LIB(fake_timeslice_idle_catch_up, "none") {
    setenv("FAKE_CUDA_CTXSW_NS", "3000000", 1);
    ts_setup();
    ctx_on(0);
    CUfunction f = ts_fn(0xe300, TS_MS);
    CUstream s;
    CUevent e0, e1;
    CHECK_CU(cuStreamCreate(&s, 0));
    CHECK_CU(cuEventCreate(&e0, 0));
    CHECK_CU(cuEventCreate(&e1, 0));
    ts_launch(f, s);
    CHECK_CU(cuStreamSynchronize(s));
    nanosleep(&(struct timespec){0, 20000000}, NULL);
    uint64_t t0 = now_ns();
    CHECK_CU(cuEventRecord(e0, s));
    ts_launch(f, s);
    CHECK_CU(cuEventRecord(e1, s));
    CHECK_CU(cuStreamSynchronize(s));
    CHECK(ev_ns(e0) - t0 < 5 * TS_MS, "an idle process on an idle device waited %.2f ms",
          (double)(ev_ns(e0) - t0) / 1e6);
    /* the kernel was submitted a moment after the event was reached */
    CHECK(ev_ns(e1) - ev_ns(e0) >= TS_MS && ev_ns(e1) - ev_ns(e0) < 5 * TS_MS, "its 1 ms kernel took %.3f ms",
          (double)(ev_ns(e1) - ev_ns(e0)) / 1e6);
    hog_arg a;
    pid_t h = hog_start(&a, 200, TS_MS / 2);
    nanosleep(&(struct timespec){0, 10000000}, NULL);
    CHECK_CU(cuEventRecord(e0, s));
    for (int k = 0; k < 10; k++)
        ts_launch(f, s);
    CHECK_CU(cuEventRecord(e1, s));
    CHECK_CU(cuStreamSynchronize(s));
    float ms = 0;
    CHECK_CU(cuEventElapsedTime(&ms, e0, e1));
    hog_finish(&a, h, 0);
    CHECK(ms >= 41.9f, "10 ms of work beside a busy process took %.3f ms, want 10 + 4 of its 2 ms slices + 8 switches of 3 ms",
          ms);
}

/* A synchronize returns when the replay has served the process's work, and
 * not before (FIFO: after the other's 100 ms queue). */
TEST_LIB(fake_timeslice_synchronize, "none") {
    ts_setup();
    hog_arg a;
    pid_t h = hog_start(&a, 200, TS_MS / 2);
    ctx_on(0);
    CUfunction f = ts_fn(0xe300, TS_MS);
    CUstream s;
    CUevent e1;
    CHECK_CU(cuStreamCreate(&s, 0));
    CHECK_CU(cuEventCreate(&e1, 0));
    for (int round = 0; round < 2; round++) {
        uint64_t t0 = now_ns(), b0 = busy_of_pid(getpid());
        ts_launch(f, s);
        ts_launch(f, s);
        ts_launch(f, s);
        CHECK_CU(cuEventRecord(e1, s));
        if (round == 0)
            CHECK_CU(cuStreamSynchronize(s));
        else
            CHECK_CU(cuCtxSynchronize());
        uint64_t t1 = now_ns();
        CHECK(cuEventQuery(e1) == CUDA_SUCCESS, "%s returned before its work ran",
              round ? "cuCtxSynchronize" : "cuStreamSynchronize");
        CHECK(busy_of_pid(getpid()) - b0 == 3 * TS_MS, "3 ms of work, %.3f ms served at the return",
              (double)(busy_of_pid(getpid()) - b0) / 1e6);
        CHECK(t1 >= ev_ns(e1), "returned %.3f ms before its work ended", (double)(ev_ns(e1) - t1) / 1e6);
        CHECK(ev_ns(e1) - t0 < 25 * TS_MS, "3 ms of work beside another process's 100 ms queue ended after %.2f ms",
              (double)(ev_ns(e1) - t0) / 1e6);
    }
    hog_finish(&a, h, 0);
}

/* Events bracket what the device did between them, other contexts' slices
 * included, as on a GPU: a 6 ms kernel beside a busy process runs in three
 * slices with two of the other's between (FIFO: 6.0 ms). */
TEST_LIB(fake_timeslice_events_see_preemption, "none") {
    ts_setup();
    hog_arg a;
    pid_t h = hog_start(&a, 200, TS_MS / 2);
    ctx_on(0);
    CUfunction f = ts_fn(0xe300, 6 * TS_MS);
    CUstream s;
    CUevent e0, e1;
    CHECK_CU(cuStreamCreate(&s, 0));
    CHECK_CU(cuEventCreate(&e0, 0));
    CHECK_CU(cuEventCreate(&e1, 0));
    CHECK_CU(cuEventRecord(e0, s));
    ts_launch(f, s);
    CHECK_CU(cuEventRecord(e1, s));
    CHECK_CU(cuEventSynchronize(e1));
    float ms = 0;
    CHECK_CU(cuEventElapsedTime(&ms, e0, e1));
    hog_finish(&a, h, 0);
    CHECK(ms >= 9.9f, "a 6 ms kernel preempted twice measured %.3f ms, want 6 + 2 slices of 2 ms + 4 switches", ms);
}

/* cuStreamWaitEvent joins streams on the device: work queued behind a wait
 * for another stream's event starts when the device reaches that event, not
 * beside the other stream's work, and the host does not wait. Partial grids
 * (16 of 128 blocks: 200 ms on a, 8 blocks: 1 ms on b), which overlap on two
 * streams without the wait; also with the event held behind a stream-memory wait
 * (the waiting stream is held with it) and with the waiting stream held
 * itself (the wait keeps its place in the stream: a kernel queued on it
 * before the wait still runs beside the other stream's, and two streams
 * joining each other behind a gate do not wait for each other for ever, nor
 * when the event is re-recorded before the wait is reached: a wait is for
 * the record that was the latest when it was made).
 * Times from fakeEventTime, the device's clock. */
static void wait_event_case(void) {
    ctx_on(0);
    CUfunction f = ts_fn(0xe500, 16 * TS_MS), f_long = ts_fn(0xe501, 1600 * TS_MS); /* 8 blocks: 1 ms; 16: 200 ms */
    CUstream a, b;
    CHECK_CU(cuStreamCreate(&a, 0));
    CHECK_CU(cuStreamCreate(&b, 0));
    CUevent ev, eb, e0b, never;
    CHECK_CU(cuEventCreate(&ev, 0));
    CHECK_CU(cuEventCreate(&e0b, 0));
    CHECK_CU(cuEventCreate(&eb, 0));
    CHECK_CU(cuEventCreate(&never, 0));
    CHECK(cuStreamWaitEvent(b, NULL, 0) == CUDA_ERROR_INVALID_HANDLE, "a wait on no event");
    CHECK(cuStreamWaitEvent(b, ev, 2) == CUDA_ERROR_INVALID_VALUE, "an unknown wait flag");
    void *mapped = NULL;
    CUdeviceptr dp = 0;
    CHECK_CU(cuMemHostAlloc(&mapped, 4096, 0x2 /* DEVICEMAP */));
    CHECK_CU(cuMemHostGetDevicePointer_v2(&dp, mapped, 0));
    _Atomic uint32_t *w = mapped;
    atomic_store(w, 0);
    /* 0: no wait (the kernels overlap); 1: the wait; 2: the event held
     * behind a gate on a; 3: the waiting stream b held behind a gate; 4: a
     * never-recorded event (reached: no wait) */
    for (int row = 0; row <= 4; row++) {
        if (row == 2)
            CHECK_CU(cuStreamWaitValue32_v2(a, dp, (uint32_t)row, 0 /* GEQ */));
        if (row == 3)
            CHECK_CU(cuStreamWaitValue32_v2(b, dp, (uint32_t)row, 0));
        CHECK_CU(cuLaunchKernel(f_long, 16, 1, 1, 256, 1, 1, 0, a, NULL, NULL));
        CHECK_CU(cuEventRecord(ev, a));
        if (row == 3) {
            CHECK_CU(cuLaunchKernel(f, 8, 1, 1, 256, 1, 1, 0, b, NULL, NULL));
            CHECK_CU(cuEventRecord(e0b, b));
        }
        if (row >= 1)
            CHECK_CU(cuStreamWaitEvent(b, row == 4 ? never : ev, 0));
        CHECK_CU(cuLaunchKernel(f, 8, 1, 1, 256, 1, 1, 0, b, NULL, NULL));
        CHECK_CU(cuEventRecord(eb, b));
        if (row == 2 || row == 3) {
            nanosleep(&(struct timespec){0, 5000000}, NULL);
            CHECK(cuEventQuery(eb) == CUDA_ERROR_NOT_READY, "row %d: b ran before the held %s was released", row,
                  row == 2 ? "event" : "stream");
            atomic_store(w, (uint32_t)row);
        }
        CHECK_CU(cuStreamSynchronize(b));
        CHECK_CU(cuStreamSynchronize(a));
        uint64_t ta = ev_ns(ev), tb = ev_ns(eb);
        if (row == 3)
            CHECK(ev_ns(e0b) + 100 * TS_MS < ta, "row 3: b's kernel queued before the wait ended %.3f ms after a's event: "
                  "the wait moved ahead of it", ((double)ev_ns(e0b) - (double)ta) / 1e6);
        if (row == 0 || row == 4)
            CHECK(tb + 100 * TS_MS < ta, "row %d: b's 1 ms kernel ended %.3f ms after a's 200 ms one: no overlap", row,
                  ((double)tb - (double)ta) / 1e6);
        else
            CHECK(tb >= ta + TS_MS, "row %d: b's 1 ms kernel behind the wait ended %.3f ms after a's event, want >= 1",
                  row, ((double)tb - (double)ta) / 1e6);
    }
    /* two streams joining each other behind a gate (what a fork-join round
     * does when a sampled launch's gate holds a side stream): b, held,
     * records eb; a waits for eb and records ea; b waits for ea after eb, then
     * runs a kernel. Once the gate opens everything runs, in that order */
    CUevent eb2;
    CHECK_CU(cuEventCreate(&eb2, 0));
    CHECK_CU(cuStreamWaitValue32_v2(b, dp, 5, 0));
    CHECK_CU(cuLaunchKernel(f, 8, 1, 1, 256, 1, 1, 0, b, NULL, NULL));
    CHECK_CU(cuEventRecord(eb, b));
    CHECK_CU(cuStreamWaitEvent(a, eb, 0));
    CHECK_CU(cuEventRecord(ev, a));
    CHECK_CU(cuStreamWaitEvent(b, ev, 0));
    CHECK_CU(cuLaunchKernel(f, 8, 1, 1, 256, 1, 1, 0, b, NULL, NULL));
    CHECK_CU(cuEventRecord(eb2, b));
    atomic_store(w, 5);
    for (int k = 0; k < 1000 && cuEventQuery(eb2) == CUDA_ERROR_NOT_READY; k++)
        nanosleep(&(struct timespec){0, 10000000}, NULL);
    CHECK(cuEventQuery(eb2) == CUDA_SUCCESS, "10 s after the gate opened the streams still wait for each other");
    CHECK(ev_ns(ev) >= ev_ns(eb) && ev_ns(eb2) >= ev_ns(ev) + TS_MS, "out of order: eb %.3f, ea %.3f, eb2 %.3f ms",
          (double)ev_ns(eb) / 1e6, (double)ev_ns(ev) / 1e6, (double)ev_ns(eb2) / 1e6);
    /* two fork-join rounds behind a gate on a, the join event re-recorded
     * (held) before a's first wait is released: that wait is for the first
     * record, already reached, not the second, which lies behind b's wait
     * for a */
    CHECK_CU(cuStreamSynchronize(a));
    CHECK_CU(cuStreamSynchronize(b));
    CHECK_CU(cuStreamWaitValue32_v2(a, dp, 9, 0));
    for (int round = 0; round < 2; round++) {
        if (round)
            CHECK_CU(cuStreamWaitEvent(b, ev, 0));
        CHECK_CU(cuLaunchKernel(f, 8, 1, 1, 256, 1, 1, 0, b, NULL, NULL));
        CHECK_CU(cuEventRecord(eb, b));
        CHECK_CU(cuStreamWaitEvent(a, eb, 0));
        CHECK_CU(cuEventRecord(ev, a));
    }
    atomic_store(w, 9);
    for (int k = 0; k < 1000 && cuEventQuery(ev) == CUDA_ERROR_NOT_READY; k++)
        nanosleep(&(struct timespec){0, 10000000}, NULL);
    CHECK(cuEventQuery(ev) == CUDA_SUCCESS, "10 s after the gate opened a waits for a join recorded after it");
    CHECK(ev_ns(ev) >= ev_ns(eb), "a's fork %.3f ms before b's second join", ((double)ev_ns(eb) - (double)ev_ns(ev)) / 1e6);
    CHECK_CU(cuMemFreeHost(mapped));
}
TEST_LIB(fake_stream_wait_event, "none") {
    ts_setup();
    wait_event_case();
}
TEST_LIB(fake_stream_wait_event_fifo, "none") {
    setenv("FAKE_CUDA_SCHED", "fifo", 1);
    ts_setup();
    wait_event_case();
}
