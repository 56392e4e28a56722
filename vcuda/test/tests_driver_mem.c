/*
 * tests_driver_mem.c - memory the driver takes beyond what was asked for:
 * stream-ordered pools that keep freed pages, ... Each case checks vcuda's
 * region and the fake driver's physical high-water mark, which is shared by
 * every process of the test (FAKE_CUDA_SHM): the container must never hold
 * a byte of device memory over its cap, however the memory is taken.
 */
#define _GNU_SOURCE
#include <string.h>
#include <unistd.h>

#include "cuda_api.h"
#include "util.h"

#define CAP (60 * MiB)
#define RELEASE_THRESHOLD 4
#define RESERVED_MEM_CURRENT 5

static void one_gpu(void) {
    gpu_line g[1] = {{0, CAP, 100}};
    setup_limits(g, 1);
    ctx_costs_nothing(); /* pools, graphs, modules: their pages to the byte (contexts: below) */
}

static uint64_t phys_peak(void) {
    fake_stats st;
    fakeDeviceStats(0, &st);
    return st.peak;
}
static uint64_t phys_used(void) {
    fake_stats st;
    fakeDeviceStats(0, &st);
    return st.used;
}

/* Allocates 1 MiB units with alloc() until OOM; returns how many. */
static int fill_mib(CUresult (*alloc)(CUdeviceptr *), CUdeviceptr *h, int max) {
    int n = 0;
    for (;;) {
        CHECK(n < max, "no OOM after %d MiB", n);
        CUresult r = alloc(&h[n]);
        if (r != CUDA_SUCCESS) {
            CHECK(r == CUDA_ERROR_OUT_OF_MEMORY, "got %d, want OOM", r);
            return n;
        }
        n++;
    }
}
static CUstream pstream;
static CUresult async_mib(CUdeviceptr *d) { return cuMemAllocAsync(d, MiB, pstream); }
static CUresult linear_mib(CUdeviceptr *d) { return cuMemAlloc_v2(d, MiB); }

/* A process of the container using cudaMallocAsync as PyTorch does (release
 * threshold UINT64_MAX): it fills the cap, frees everything and
 * synchronises; its pool keeps the pages. Steps driven by the parent. */
static int pool_user(int i, void *arg) {
    (void)i;
    chan *c = arg;
    ctx_on(0);
    CHECK_CU(cuStreamCreate(&pstream, 0));
    CUmemoryPool pool;
    CHECK_CU(cuDeviceGetMemPool(&pool, 0));
    cuuint64_t max = UINT64_MAX;
    CHECK_CU(cuMemPoolSetAttribute(pool, RELEASE_THRESHOLD, &max));
    CUdeviceptr h[128];
    int n = fill_mib(async_mib, h, 128);
    for (int k = 0; k < n; k++)
        CHECK_CU(cuMemFreeAsync(h[k], pstream));
    CHECK_CU(cuStreamSynchronize(pstream));
    CHECK_CU(cuCtxSynchronize());
    chan_send_up(c, (uint64_t)n);
    chan_recv_down(c); /* trim to 20 MiB */
    CHECK_CU(cuMemPoolTrimTo(pool, 20 * MiB));
    cuuint64_t held = 0;
    CHECK_CU(cuMemPoolGetAttribute(pool, RESERVED_MEM_CURRENT, &held));
    chan_send_up(c, held);
    chan_recv_down(c); /* threshold 0, then synchronise: everything goes */
    cuuint64_t zero = 0;
    CHECK_CU(cuMemPoolSetAttribute(pool, RELEASE_THRESHOLD, &zero));
    CHECK_CU(cuStreamSynchronize(pstream));
    chan_send_up(c, 0);
    chan_recv_down(c);
    return 0;
}
/* Another process of the container using cuMemAlloc. */
static int linear_user(int i, void *arg) {
    (void)i;
    chan *c = arg;
    ctx_on(0);
    CUdeviceptr h[128];
    for (;;) {
        if (chan_recv_down(c) == 0)
            return 0;
        int n = fill_mib(linear_mib, h, 128);
        for (int k = 0; k < n; k++)
            CHECK_CU(cuMemFree_v2(h[k]));
        chan_send_up(c, (uint64_t)n);
    }
}

TEST(mem_pool_keeps_pages_across_processes) {
    one_gpu();
    chan a, b;
    chan_init(&a);
    chan_init(&b);
    pid_t pa = spawn(pool_user, 0, &a), pb = spawn(linear_user, 1, &b);
    CHECK(chan_recv_up(&a) == CAP / MiB, "the pool user got less than the cap");
    CHECK(region_used(0) == CAP, "freed pool pages credited: region %llu", (unsigned long long)region_used(0));
    CHECK(phys_used() == CAP, "the fake's pool gave pages back: %llu", (unsigned long long)phys_used());
    chan_send_down(&b, 1);
    uint64_t got = chan_recv_up(&b);
    CHECK(got == 0, "cuMemAlloc got %llu MiB while the pool held the cap", (unsigned long long)got);
    CHECK(phys_peak() <= CAP, "physical peak %llu over the cap", (unsigned long long)phys_peak());

    chan_send_down(&a, 1); /* cuMemPoolTrimTo(20 MiB) */
    CHECK(chan_recv_up(&a) == 20 * MiB, "pool kept the wrong amount after the trim");
    CHECK(region_used(0) == 20 * MiB, "after trim: region %llu", (unsigned long long)region_used(0));
    chan_send_down(&b, 1);
    got = chan_recv_up(&b);
    CHECK(got == 40, "cuMemAlloc got %llu MiB next to a 20 MiB pool", (unsigned long long)got);

    chan_send_down(&a, 1); /* threshold 0 + synchronise */
    chan_recv_up(&a);
    CHECK(region_used(0) == 0, "after the synchronisation: region %llu", (unsigned long long)region_used(0));
    chan_send_down(&b, 1);
    got = chan_recv_up(&b);
    CHECK(got == 60, "cuMemAlloc got %llu MiB after the pool emptied", (unsigned long long)got);
    CHECK(phys_peak() <= CAP, "physical peak %llu over the cap", (unsigned long long)phys_peak());
    chan_send_down(&a, 1);
    chan_send_down(&b, 0);
    CHECK(wait_child(pa) == 0 && wait_child(pb) == 0, "children failed");
    CHECK(region_used(0) == 0 && phys_used() == 0, "left: region %llu, fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)phys_used());
}

/* The release threshold: at a synchronisation the pool keeps what it holds
 * up to the threshold; memory is charged while the driver holds it. */
TEST(mem_pool_release_threshold) {
    one_gpu();
    ctx_on(0);
    CHECK_CU(cuStreamCreate(&pstream, 0));
    CUmemoryPool pool;
    CHECK_CU(cuDeviceGetMemPool(&pool, 0));
    CUdeviceptr h[128];
    /* default threshold 0: pages go back at the synchronisation */
    CHECK_CU(cuMemAllocAsync(&h[0], 30 * MiB, pstream));
    CHECK_CU(cuMemFreeAsync(h[0], pstream));
    CHECK(region_used(0) == 30 * MiB, "freed before the driver gave pages back: %llu",
          (unsigned long long)region_used(0));
    CHECK_CU(cuStreamSynchronize(pstream));
    CHECK(region_used(0) == 0 && phys_used() == 0, "after sync: region %llu fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)phys_used());
    /* threshold 10 MiB: 10 stay; an event synchronisation also counts */
    cuuint64_t ten = 10 * MiB;
    CHECK_CU(cuMemPoolSetAttribute(pool, RELEASE_THRESHOLD, &ten));
    CHECK_CU(cuMemAllocAsync(&h[0], 30 * MiB, pstream));
    CHECK_CU(cuMemAllocAsync(&h[1], 1000, pstream)); /* small: 512-byte units in the pool's pages */
    CHECK(region_used(0) == 32 * MiB, "30 MiB + 1000 B took %llu", (unsigned long long)region_used(0));
    CHECK_CU(cuMemFreeAsync(h[0], pstream));
    CUevent ev;
    CHECK_CU(cuEventCreate(&ev, 0));
    CHECK_CU(cuEventRecord(ev, pstream));
    CHECK_CU(cuEventSynchronize(ev));
    CHECK(region_used(0) == 10 * MiB && phys_used() == 10 * MiB, "threshold 10 MiB: region %llu fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)phys_used());
    /* the kept pages are reused without new charges */
    CHECK_CU(cuMemAllocAsync(&h[0], 8 * MiB, pstream));
    CHECK(region_used(0) == 10 * MiB, "reuse charged again: %llu", (unsigned long long)region_used(0));
    /* a synchronous free of a pool allocation goes back into the pool too */
    CHECK_CU(cuMemFree_v2(h[0]));
    CHECK_CU(cuMemFreeAsync(h[1], pstream));
    /* a destroyed pool gives everything back */
    CUmemPoolProps pp;
    memset(&pp, 0, sizeof(pp));
    pp.allocType = 1;
    pp.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    CUmemoryPool own;
    CHECK_CU(cuMemPoolCreate(&own, &pp));
    CHECK_CU(cuMemAllocFromPoolAsync(&h[2], 20 * MiB, own, pstream));
    CHECK_CU(cuMemAllocFromPoolAsync(&h[3], 20 * MiB, own, pstream));
    CHECK(cuMemAllocFromPoolAsync(&h[4], 20 * MiB + 1, own, pstream) == CUDA_ERROR_OUT_OF_MEMORY,
          "pool pages over the cap");
    CHECK_CU(cuMemFreeAsync(h[2], pstream));
    CHECK_CU(cuMemPoolDestroy(own)); /* h[3] still live: its pages stay */
    CHECK(region_used(0) == 30 * MiB, "after destroy: %llu", (unsigned long long)region_used(0));
    CHECK_CU(cuMemFreeAsync(h[3], pstream));
    CHECK(region_used(0) == 10 * MiB && phys_used() == 10 * MiB, "after the last free: region %llu fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)phys_used());
    CHECK_CU(cuMemPoolTrimTo(pool, 0));
    CHECK(region_used(0) == 0 && phys_used() == 0, "after trim: region %llu fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)phys_used());
    CHECK(phys_peak() <= CAP, "physical peak %llu", (unsigned long long)phys_peak());
}

/* Linear memory is rounded as the driver does: over 1 MiB to whole 2 MiB
 * pages, smaller to 512 bytes. */
TEST(mem_driver_rounding) {
    one_gpu();
    ctx_on(0);
    CUdeviceptr d[64];
    CHECK_CU(cuMemAlloc_v2(&d[0], MiB + 1)); /* 2 MiB */
    CHECK_CU(cuMemAlloc_v2(&d[1], 3 * MiB)); /* 4 MiB */
    CHECK_CU(cuMemAlloc_v2(&d[2], 1)); /* 512 B */
    CHECK(region_used(0) == 6 * MiB + 512, "charged %llu", (unsigned long long)region_used(0));
    CHECK(phys_used() == region_used(0), "fake took %llu", (unsigned long long)phys_used());
    int n = 3;
    while (cuMemAlloc_v2(&d[n], MiB + 1) == CUDA_SUCCESS)
        n++;
    CHECK(n == 3 + 26, "%d allocations of 1 MiB + 1 fit, want 26 (2 MiB each)", n - 3);
    CHECK(phys_peak() <= CAP, "physical peak %llu", (unsigned long long)phys_peak());
    for (int k = 0; k < n; k++)
        CHECK_CU(cuMemFree_v2(d[k]));
    CHECK(region_used(0) == 0 && phys_used() == 0, "left");
}

/* Contexts take device memory of their own (the fake: FAKE_CUDA_CTX_BYTES
 * a context). vcuda measures it at the first creation (NVML's entry of the
 * process) and charges every context for it: primary (first retain only),
 * cuCtxCreate v1-v4, green contexts; destroying one credits its memory and
 * what was allocated in it. */
CUresult cuCtxCreate(CUcontext *, unsigned, CUdevice);
CUresult cuCtxCreate_v3(CUcontext *, void *, int, unsigned, CUdevice);
CUresult cuCtxCreate_v4(CUcontext *, void *, unsigned, CUdevice);
CUresult cuGreenCtxCreate(CUgreenCtx *, CUdevResourceDesc, CUdevice, unsigned);
CUresult cuGreenCtxDestroy(CUgreenCtx);
CUresult cuCtxFromGreenCtx(CUcontext *, CUgreenCtx);
CUresult cuCtxSetLimit(int, size_t);
#define CTXB (100 * MiB)

TEST(mem_contexts_counted) {
    gpu_line g[1] = {{0, 1000 * MiB, 100}};
    setup_limits(g, 1);
    setenv("FAKE_CUDA_CTX_BYTES", "104857600", 1);
    CHECK_CU(cuInit(0));
    CUcontext pc, pc2;
    CHECK_CU(cuDevicePrimaryCtxRetain(&pc, 0));
    CHECK(region_used(0) == CTXB, "primary context charged %llu", (unsigned long long)region_used(0));
    CHECK_CU(cuDevicePrimaryCtxRetain(&pc2, 0)); /* already created: nothing more */
    CHECK(region_used(0) == CTXB, "second retain charged %llu", (unsigned long long)region_used(0));
    CUcontext c[8];
    CHECK_CU(cuCtxCreate(&c[0], 0, 0));
    CHECK_CU(cuCtxCreate_v2(&c[1], 0, 0));
    CHECK_CU(cuCtxCreate_v3(&c[2], NULL, 0, 0, 0));
    CHECK_CU(cuCtxCreate_v4(&c[3], NULL, 0, 0));
    CHECK(region_used(0) == 5 * CTXB, "after v1-v4: %llu", (unsigned long long)region_used(0));
    /* through cuGetProcAddress, as the runtime resolves it (12.5+: v4) */
    void *fn = NULL;
    CHECK_CU(cuGetProcAddress("cuCtxCreate", &fn, 12080, 0));
    CHECK_CU(((CUresult(*)(CUcontext *, void *, unsigned, CUdevice))fn)(&c[4], NULL, 0, 0));
    CHECK(region_used(0) == 6 * CTXB, "cuCtxCreate via cuGetProcAddress: %llu", (unsigned long long)region_used(0));
    /* a green context, and memory allocated in the context made from it */
    CUgreenCtx gc;
    CHECK_CU(cuGreenCtxCreate(&gc, (CUdevResourceDesc)(uintptr_t)1, 0, 1));
    CHECK(region_used(0) == 7 * CTXB, "green context: %llu", (unsigned long long)region_used(0));
    CUcontext gcc;
    CHECK_CU(cuCtxFromGreenCtx(&gcc, gc));
    CHECK_CU(cuCtxSetCurrent(gcc));
    CUdeviceptr d;
    CHECK_CU(cuMemAlloc_v2(&d, 10 * MiB));
    /* the cap: 1000 MiB = 7 contexts + 10 MiB + 2 more contexts; the third is refused */
    CHECK_CU(cuCtxCreate_v2(&c[5], 0, 0));
    CHECK_CU(cuCtxCreate_v2(&c[6], 0, 0));
    CHECK(cuCtxCreate_v2(&c[7], 0, 0) == CUDA_ERROR_OUT_OF_MEMORY, "a context past the cap");
    CHECK(cuGreenCtxCreate(&gc, (CUdevResourceDesc)(uintptr_t)1, 0, 1) == CUDA_ERROR_OUT_OF_MEMORY,
          "a green context past the cap");
    CHECK(phys_peak() <= 1000 * MiB, "physical peak %llu", (unsigned long long)phys_peak());
    CHECK(phys_used() == region_used(0), "fake %llu, region %llu", (unsigned long long)phys_used(),
          (unsigned long long)region_used(0));
    CHECK_CU(cuGreenCtxDestroy(gc)); /* its memory and the 10 MiB allocated in it */
    CHECK(region_used(0) == 8 * CTXB, "after the green context went: %llu", (unsigned long long)region_used(0));
    for (int i = 0; i < 7; i++)
        CHECK_CU(cuCtxDestroy_v2(c[i]));
    CHECK(region_used(0) == CTXB, "after destroying: %llu", (unsigned long long)region_used(0));
    CHECK_CU(cuDevicePrimaryCtxRelease_v2(0));
    CHECK(region_used(0) == CTXB, "primary still retained once: %llu", (unsigned long long)region_used(0));
    CHECK_CU(cuDevicePrimaryCtxRelease_v2(0));
    CHECK(region_used(0) == 0 && phys_used() == 0, "after the last release: region %llu fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)phys_used());
    CHECK_CU(cuDevicePrimaryCtxRetain(&pc, 0));
    CHECK_CU(cuDevicePrimaryCtxReset_v2(0));
    CHECK(region_used(0) == 0 && phys_used() == 0, "after reset: region %llu fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)phys_used());
}

/* A first context that does not fit under the cap is destroyed again. */
TEST(mem_context_over_cap_refused) {
    gpu_line g[1] = {{0, 50 * MiB, 100}};
    setup_limits(g, 1);
    setenv("FAKE_CUDA_CTX_BYTES", "104857600", 1);
    CHECK_CU(cuInit(0));
    CUcontext c;
    CHECK(cuCtxCreate_v2(&c, 0, 0) == CUDA_ERROR_OUT_OF_MEMORY, "a 100 MiB context under a 50 MiB cap");
    CHECK(region_used(0) == 0 && phys_used() == 0, "left: region %llu fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)phys_used());
    /* now known: refused before the driver is asked */
    CHECK(cuDevicePrimaryCtxRetain(&c, 0) == CUDA_ERROR_OUT_OF_MEMORY, "primary context over the cap");
    CHECK(phys_peak() <= 100 * MiB, "the known cost was not checked first: peak %llu",
          (unsigned long long)phys_peak());
}

/* A cap below what one context takes (the fake's default on 9.x,
 * FAKE_CTX_BYTES_SM90, measured through NVML) can hold no context at all: every creation fails with
 * CUDA_ERROR_OUT_OF_MEMORY, and one stderr line says why, naming the cap and
 * the context's cost; later attempts are refused before the driver. */
TEST(mem_context_small_cap_told) {
    gpu_line g[1] = {{0, 256 * MiB, 100}};
    setup_limits(g, 1);
    CHECK(getenv("FAKE_CUDA_CTX_BYTES") == NULL, "the case needs the fake's default context size");
    int saved = redirect_stderr(tpath("stderr"));
    CUresult r0 = cuInit(0);
    CUcontext c;
    CUresult r1 = cuDevicePrimaryCtxRetain(&c, 0);
    CUresult r2 = cuCtxCreate_v2(&c, 0, 0);
    CUresult r3 = cuDevicePrimaryCtxRetain(&c, 0);
    dup2(saved, 2);
    CHECK(r0 == CUDA_SUCCESS, "cuInit returned %d", r0);
    CHECK(r1 == CUDA_ERROR_OUT_OF_MEMORY, "primary context under a 256 MiB cap: %d", r1);
    CHECK(r2 == CUDA_ERROR_OUT_OF_MEMORY, "cuCtxCreate under a 256 MiB cap: %d", r2);
    CHECK(r3 == CUDA_ERROR_OUT_OF_MEMORY, "primary context again: %d", r3);
    CHECK(region_used(0) == 0 && phys_used() == 0, "left: region %llu fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)phys_used());
    CHECK(phys_peak() <= FAKE_CTX_BYTES_SM90, "a known cost was not checked first: peak %llu",
          (unsigned long long)phys_peak());
    char *log = read_text(tpath("stderr"));
    char want[256];
    snprintf(want, sizeof(want),
             "vcuda: %s: memory cap 256 MiB is below the %llu MiB a CUDA context needs on this GPU; "
             "ask for more tessera.dev/vgpu-memory\n",
             fake_uuid(0), FAKE_CTX_BYTES_SM90 / MiB);
    CHECK(strstr(log, want) != NULL, "log %s, want %s", log, want);
    CHECK(strstr(strstr(log, want) + strlen(want), "memory cap") == NULL, "told more than once: %s", log);
}

/* With the fake's default (a context as large as a real one on the
 * architecture: FAKE_CTX_BYTES_SM90 for 9.x), the context counts against the cap: an
 * allocation that would fit only if the context were free is refused. */
TEST(mem_context_default_cost_counted) {
    gpu_line g[1] = {{0, 1ull << 30, 100}};
    setup_limits(g, 1);
    CHECK(getenv("FAKE_CUDA_CTX_BYTES") == NULL, "the case needs the fake's default context size");
    CHECK_CU(cuInit(0));
    CUcontext pc;
    CHECK_CU(cuDevicePrimaryCtxRetain(&pc, 0));
    CHECK_CU(cuCtxSetCurrent(pc));
    CHECK(phys_used() == FAKE_CTX_BYTES_SM90, "the fake's context took %llu", (unsigned long long)phys_used());
    CHECK(region_used(0) == FAKE_CTX_BYTES_SM90, "context charged %llu", (unsigned long long)region_used(0));
    size_t fr = 0, tot = 0;
    CHECK_CU(cuMemGetInfo_v2(&fr, &tot));
    CHECK(tot == 1ull << 30 && fr == (1ull << 30) - FAKE_CTX_BYTES_SM90, "info %zu/%zu", fr, tot);
    CUdeviceptr d;
    CHECK(cuMemAlloc_v2(&d, 600 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "600 MiB beside the fake's context under 1 GiB");
    CHECK_CU(cuMemAlloc_v2(&d, (1ull << 30) - FAKE_CTX_BYTES_SM90));
    CUdeviceptr one;
    CHECK(cuMemAlloc_v2(&one, 1) == CUDA_ERROR_OUT_OF_MEMORY, "a byte past the cap");
    CHECK(phys_peak() <= 1ull << 30, "physical peak %llu over the cap", (unsigned long long)phys_peak());
    CHECK_CU(cuMemFree_v2(d));
    CHECK_CU(cuDevicePrimaryCtxRelease_v2(0));
    CHECK(region_used(0) == 0 && phys_used() == 0, "after the release: region %llu fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)phys_used());
}

/* Stack and printf FIFO limits size device memory of the context too. */
TEST(mem_ctx_limits_counted) {
    gpu_line g[1] = {{0, 1000 * MiB, 100}};
    setup_limits(g, 1);
    ctx_costs_nothing(); /* the limits' own bytes, exactly */
    CUcontext c = ctx_on(0);
    /* 16 SMs x 2048 threads x (2 KiB - the 1 KiB default) = 32 MiB */
    CHECK_CU(cuCtxSetLimit(0, 2048));
    CHECK(region_used(0) == 32 * MiB, "stack charged %llu", (unsigned long long)region_used(0));
    CHECK_CU(cuCtxSetLimit(1, 5 * MiB)); /* 4 MiB beyond the default */
    CHECK(region_used(0) == 36 * MiB, "printf FIFO charged %llu", (unsigned long long)region_used(0));
    CHECK(cuCtxSetLimit(0, 64 * 1024) == CUDA_ERROR_OUT_OF_MEMORY, "a 64 KiB stack (2 GiB) under a 1000 MiB cap");
    CHECK_CU(cuCtxSetLimit(0, 1024)); /* back to the default: credited */
    CHECK(region_used(0) == 4 * MiB, "after shrinking %llu", (unsigned long long)region_used(0));
    CHECK(phys_used() == region_used(0) && phys_peak() <= 1000 * MiB, "fake %llu peak %llu",
          (unsigned long long)phys_used(), (unsigned long long)phys_peak());
    CHECK_CU(cuCtxDestroy_v2(c));
    CHECK(region_used(0) == 0 && phys_used() == 0, "after destroy: region %llu", (unsigned long long)region_used(0));
}

/* Graph memory nodes take their pages when the graph first runs, keep them
 * while it lives, and the device keeps them for later graphs until
 * cuDeviceGraphMemTrim: vcuda charges them at instantiation, so nothing
 * else of the container can take them first. */
CUresult cuGraphCreate(CUgraph *, unsigned);
CUresult cuGraphAddMemAllocNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUDA_MEM_ALLOC_NODE_PARAMS *);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *, CUgraph, unsigned long long);
CUresult cuGraphExecDestroy(CUgraphExec);
CUresult cuGraphUpload(CUgraphExec, CUstream);
CUresult cuDeviceGraphMemTrim(CUdevice);

TEST(mem_graph_memory_nodes) {
    one_gpu();
    ctx_on(0);
    CUstream s;
    CHECK_CU(cuStreamCreate(&s, 0));
    CUgraph graph;
    CHECK_CU(cuGraphCreate(&graph, 0));
    CUDA_MEM_ALLOC_NODE_PARAMS p;
    memset(&p, 0, sizeof(p));
    p.poolProps.allocType = 1;
    p.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.bytesize = 30 * MiB + 1; /* 32 MiB of pages */
    CUgraphNode node;
    CHECK_CU(cuGraphAddMemAllocNode(&node, graph, NULL, 0, &p));
    CHECK(region_used(0) == 0, "a node charged before instantiation: %llu", (unsigned long long)region_used(0));
    CUgraphExec e, e2;
    CHECK_CU(cuGraphInstantiateWithFlags(&e, graph, 0));
    CHECK(region_used(0) == 32 * MiB, "instantiated graph charged %llu", (unsigned long long)region_used(0));
    CHECK(cuGraphInstantiateWithFlags(&e2, graph, 0) == CUDA_ERROR_OUT_OF_MEMORY, "two 32 MiB graphs under 60 MiB");
    CUdeviceptr d;
    CHECK(cuMemAlloc_v2(&d, 30 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc took the graph's memory");
    CHECK_CU(cuGraphLaunch(e, s));
    CHECK(phys_used() == 32 * MiB, "the fake's graph took %llu", (unsigned long long)phys_used());
    CHECK_CU(cuGraphExecDestroy(e));
    CHECK(region_used(0) == 32 * MiB && phys_used() == 32 * MiB, "the device keeps graph memory: region %llu",
          (unsigned long long)region_used(0));
    CHECK(cuMemAlloc_v2(&d, 30 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc took kept graph memory");
    /* a later graph reuses it */
    CHECK_CU(cuGraphInstantiateWithFlags(&e, graph, 0));
    CHECK(region_used(0) == 32 * MiB, "reuse charged again: %llu", (unsigned long long)region_used(0));
    CHECK_CU(cuGraphExecDestroy(e));
    CHECK_CU(cuDeviceGraphMemTrim(0));
    CHECK(region_used(0) == 0 && phys_used() == 0, "after trim: region %llu fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)phys_used());
    CHECK_CU(cuMemAlloc_v2(&d, 30 * MiB));
    CHECK_CU(cuMemFree_v2(d));

    /* captured cudaMallocAsync: an allocation node of the captured graph */
    CHECK_CU(cuStreamBeginCapture_v2(s, 0));
    CHECK_CU(cuMemAllocAsync(&d, 20 * MiB, s));
    CHECK_CU(cuMemFreeAsync(d, s));
    CHECK(region_used(0) == 0 && phys_used() == 0, "capture took memory: region %llu fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)phys_used());
    void *cg = NULL;
    CHECK_CU(cuStreamEndCapture(s, &cg));
    void *fn = NULL;
    CHECK_CU(cuGetProcAddress("cuGraphInstantiate", &fn, 12080, 0)); /* as the runtime resolves it */
    CHECK_CU(((CUresult(*)(CUgraphExec *, CUgraph, unsigned long long))fn)(&e, (CUgraph)cg, 0));
    CHECK(region_used(0) == 20 * MiB, "captured graph charged %llu", (unsigned long long)region_used(0));
    CHECK_CU(cuGraphUpload(e, s));
    CHECK(phys_used() == 20 * MiB, "upload took %llu", (unsigned long long)phys_used());
    CHECK(cuMemAlloc_v2(&d, 41 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc next to a captured graph");
    CHECK_CU(cuGraphExecDestroy(e));
    CHECK_CU(cuDeviceGraphMemTrim(0));
    CHECK(region_used(0) == 0 && phys_used() == 0, "left: region %llu fake %llu", (unsigned long long)region_used(0),
          (unsigned long long)phys_used());
    CHECK(phys_peak() <= CAP, "physical peak %llu", (unsigned long long)phys_peak());
}

/* Modules and libraries take device memory for code and __device__
 * globals (the fake's images say how much; vcuda measures it). This case
 * loads eagerly, so everything is taken at the load; lazy loading is
 * mem_modules_lazy. */

static void fake_image(unsigned char img[24], uint64_t code, uint64_t globals) {
    memcpy(img, "FAKEMOD", 8);
    memcpy(img + 8, &code, 8);
    memcpy(img + 16, &globals, 8);
}

TEST(mem_modules_counted) {
    one_gpu();
    setenv("CUDA_MODULE_LOADING", "EAGER", 1);
    CUcontext c = ctx_on(0);
    unsigned char img[24];
    fake_image(img, 10 * MiB, 20 * MiB); /* 10 MiB of code, 20 MiB of zeroed globals */
    CUmodule m1, m2, m3;
    CHECK_CU(cuModuleLoadData(&m1, img));
    CHECK(region_used(0) == 30 * MiB, "module charged %llu", (unsigned long long)region_used(0));
    CUlibrary lib;
    CHECK_CU(cuLibraryLoadData(&lib, img, NULL, NULL, 0, NULL, NULL, 0));
    CHECK(region_used(0) == 60 * MiB && phys_peak() <= CAP, "library charged: region %llu peak %llu",
          (unsigned long long)region_used(0), (unsigned long long)phys_peak());
    CHECK(cuModuleLoadData(&m2, img) == CUDA_ERROR_OUT_OF_MEMORY, "a module past the cap");
    CHECK(region_used(0) == 60 * MiB && phys_used() == 60 * MiB, "after the refusal: region %llu fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)phys_used());
    CHECK_CU(cuModuleUnload(m1));
    CHECK(region_used(0) == 30 * MiB, "after unload %llu", (unsigned long long)region_used(0));
    /* from a file */
    write_file(tpath("mod.bin"), "");
    FILE *f = fopen(tpath("mod.bin"), "wb");
    fake_image(img, 3 * MiB, 0);
    CHECK(f && fwrite(img, 1, 24, f) == 24 && fclose(f) == 0, "writing the module file");
    CHECK_CU(cuModuleLoad(&m3, tpath("mod.bin")));
    CHECK(region_used(0) == 34 * MiB, "module file charged %llu", (unsigned long long)region_used(0));
    /* modules die with their context, libraries do not */
    CHECK_CU(cuCtxDestroy_v2(c));
    CHECK(region_used(0) == 30 * MiB && phys_used() == 30 * MiB, "after the context: region %llu fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)phys_used());
    ctx_on(0);
    CHECK_CU(cuLibraryUnload(lib));
    CHECK(region_used(0) == 0 && phys_used() == 0, "left: region %llu fake %llu", (unsigned long long)region_used(0),
          (unsigned long long)phys_used());
}

/* Lazy loading (CUDA 12.2+'s default): the load takes a page, each
 * function's code is taken at its first cuModuleGetFunction /
 * cuKernelGetFunction / first launch of a CUkernel, long after vcuda
 * measured the load through NVML. A tenant that fills its cap right after
 * the load and then looks its functions up must still stay under the cap:
 * the code lies in the image, whose size vcuda can read. */
TEST(mem_modules_lazy) {
    one_gpu();
    ctx_on(0);
    unsigned char *img = fake_fatbin(8 * MiB, 0, 2, 3 * MiB); /* two functions of 3 MiB code */
    CUdeviceptr h[64];
    /* a module: code at cuModuleGetFunction */
    CUmodule m;
    CHECK_CU(cuModuleLoadData(&m, img));
    CHECK(phys_used() < 3 * MiB, "the fake loaded the module eagerly: %llu", (unsigned long long)phys_used());
    int n = fill_mib(linear_mib, h, 64);
    CUfunction f1, f2;
    CHECK_CU(cuModuleGetFunction(&f1, m, "k1"));
    CHECK_CU(cuModuleGetFunction(&f2, m, "k2"));
    CHECK(phys_used() >= n * MiB + 6 * MiB, "the code was not loaded: %llu", (unsigned long long)phys_used());
    CHECK(phys_peak() <= CAP && region_used(0) >= phys_used(),
          "module code loaded past the cap: region %llu, fake %llu, physical peak %llu",
          (unsigned long long)region_used(0), (unsigned long long)phys_used(), (unsigned long long)phys_peak());
    for (int i = 0; i < n; i++)
        CHECK_CU(cuMemFree_v2(h[i]));
    CHECK_CU(cuModuleUnload(m));
    CHECK(region_used(0) == 0 && phys_used() == 0, "after the module: region %llu fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)phys_used());
    /* a library: code at the first launch of a CUkernel and at cuKernelGetFunction */
    CUlibrary lib;
    CHECK_CU(cuLibraryLoadData(&lib, img, NULL, NULL, 0, NULL, NULL, 0));
    n = fill_mib(linear_mib, h, 64);
    CUkernel k1, k2;
    CHECK_CU(cuLibraryGetKernel(&k1, lib, "k1"));
    CHECK_CU(cuLibraryGetKernel(&k2, lib, "k2"));
    CHECK_CU(cuLaunchKernel((CUfunction)k1, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL));
    CHECK_CU(cuKernelGetFunction(&f2, k2));
    CHECK(phys_used() >= n * MiB + 6 * MiB, "the kernels were not loaded: %llu", (unsigned long long)phys_used());
    CHECK(phys_peak() <= CAP && region_used(0) >= phys_used(),
          "library code loaded past the cap: region %llu, fake %llu, physical peak %llu",
          (unsigned long long)region_used(0), (unsigned long long)phys_used(), (unsigned long long)phys_peak());
    for (int i = 0; i < n; i++)
        CHECK_CU(cuMemFree_v2(h[i]));
    CHECK_CU(cuLibraryUnload(lib));
    CHECK(region_used(0) == 0 && phys_used() == 0, "left: region %llu fake %llu", (unsigned long long)region_used(0),
          (unsigned long long)phys_used());
    free(img);
}
