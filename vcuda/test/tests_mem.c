/*
 * tests_mem.c - every allocation path x {1 process, 4 processes of one
 * container}: the container never holds a byte over its cap (checked both in
 * vcuda's region and in the fake driver's own high-water mark), OOM comes
 * exactly at the cap, frees are credited to the allocation's own device
 * (they run with another device's context current) and return everything.
 */
#define _GNU_SOURCE
#include <string.h>
#include <unistd.h>

#include "cuda_api.h"
#include "util.h"

#define CAP0 (60 * MiB) /* device 0: multiple of 1 MiB and of 1.25 MiB */
#define CAP1 (256 * MiB)
#define MAXH 256

typedef struct mem_path {
    const char *name;
    uint64_t unit;   /* what one unit is charged (the driver's rounding included) */
    uint64_t gran;   /* rounding of small allocations (512: linear memory and pools) */
    int fake_counts; /* the fake counts it as device memory (not IPC) */
    void (*setup)(void);
    CUresult (*alloc)(uint64_t *h);                   /* one unit */
    CUresult (*alloc_bytes)(uint64_t bytes, uint64_t *h); /* exact size, or NULL */
    CUresult (*release)(uint64_t h);
    void (*synced)(void); /* a synchronisation: pools give back their free pages */
} mem_path;

static CUcontext ctx0, ctx1;
static CUstream stream0;
static CUmemoryPool pool0;

/* linear */
static CUresult a_bytes(uint64_t b, uint64_t *h) { return cuMemAlloc_v2((CUdeviceptr *)h, b); }
static CUresult a_unit(uint64_t *h) { return a_bytes(MiB, h); }
static CUresult a_free(uint64_t h) { return cuMemFree_v2(h); }
/* managed */
static CUresult m_bytes(uint64_t b, uint64_t *h) { return cuMemAllocManaged((CUdeviceptr *)h, b, 1); }
static CUresult m_unit(uint64_t *h) { return m_bytes(MiB, h); }
/* pitch: 1000 bytes wide rows are padded to 1024 */
static CUresult p_unit(uint64_t *h) {
    size_t pitch;
    CUresult r = cuMemAllocPitch_v2((CUdeviceptr *)h, &pitch, 1000, 1024, 4);
    CHECK(r != CUDA_SUCCESS || pitch == 1024, "pitch %zu", pitch);
    return r;
}
/* arrays */
static CUresult arr_unit(uint64_t *h) {
    CUDA_ARRAY_DESCRIPTOR d = {512, 512, 0x20 /* float */, 1};
    return cuArrayCreate_v2((CUarray *)h, &d);
}
static CUresult arr_free(uint64_t h) { return cuArrayDestroy((CUarray)(uintptr_t)h); }
static CUresult arr3_unit(uint64_t *h) {
    CUDA_ARRAY3D_DESCRIPTOR d = {128, 128, 16, 0x01 /* u8 */, 4, 0};
    return cuArray3DCreate_v2((CUarray *)h, &d);
}
static CUresult mip_unit(uint64_t *h) {
    /* 512x512 float + 256x256 float = 1.25 MiB */
    CUDA_ARRAY3D_DESCRIPTOR d = {512, 512, 0, 0x20, 1, 0};
    return cuMipmappedArrayCreate((CUmipmappedArray *)h, &d, 2);
}
static CUresult mip_free(uint64_t h) { return cuMipmappedArrayDestroy((CUmipmappedArray)(uintptr_t)h); }
/* cuMemCreate on device 0 while device 1's context is current: the device
 * comes from the allocation's properties. */
static CUresult vmm_bytes(uint64_t b, uint64_t *h) {
    CUmemAllocationProp p;
    memset(&p, 0, sizeof(p));
    p.type = 1;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = 0;
    CHECK_CU(cuCtxSetCurrent(ctx1));
    CUresult r = cuMemCreate((CUmemGenericAllocationHandle *)h, b, &p, 0);
    CHECK_CU(cuCtxSetCurrent(ctx0));
    return r;
}
static CUresult vmm_unit(uint64_t *h) { return vmm_bytes(MiB, h); }
static CUresult vmm_free(uint64_t h) { return cuMemRelease(h); }
/* stream-ordered */
static void async_setup(void) { CHECK_CU(cuStreamCreate(&stream0, 0)); }
static CUresult as_bytes(uint64_t b, uint64_t *h) {
    /* from device 1's context: the stream decides the device */
    CHECK_CU(cuCtxSetCurrent(ctx1));
    CUresult r = cuMemAllocAsync((CUdeviceptr *)h, b, stream0);
    CHECK_CU(cuCtxSetCurrent(ctx0));
    return r;
}
static CUresult as_unit(uint64_t *h) { return as_bytes(MiB, h); }
static CUresult as_free(uint64_t h) { return cuMemFreeAsync(h, stream0); }
static void as_sync(void) { CHECK_CU(cuStreamSynchronize(stream0)); }
static void pool_setup(void) {
    async_setup();
    CUmemPoolProps p;
    memset(&p, 0, sizeof(p));
    p.allocType = 1;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = 0;
    CHECK_CU(cuMemPoolCreate(&pool0, &p));
}
static CUresult pool_bytes(uint64_t b, uint64_t *h) {
    return cuMemAllocFromPoolAsync((CUdeviceptr *)h, b, pool0, stream0);
}
static CUresult pool_unit(uint64_t *h) { return pool_bytes(MiB, h); }
/* IPC: export 1 MiB buffers from device 1, import them on device 0. The
 * path is an import of another container's memory (charged to the
 * importer): the container's table of its own exports is emptied, as if
 * another container had exported them (imports of the container's own
 * exports are counted once: security_ipc_counted_once_per_container). */
static CUipcMemHandle ipc_handles[MAXH];
static int ipc_next;
static void ipc_setup(void) {
    CHECK_CU(cuCtxSetCurrent(ctx1));
    for (int i = 0; i < (int)(CAP0 / MiB) + 2; i++) {
        CUdeviceptr p;
        CHECK_CU(cuMemAlloc_v2(&p, MiB));
        CHECK_CU(cuIpcGetMemHandle(&ipc_handles[i], p));
    }
    CHECK_CU(cuCtxSetCurrent(ctx0));
    char path[4200];
    snprintf(path, sizeof(path), "%s.ipc-exports", tpath("region"));
    FILE *f = fopen(path, "r+");
    CHECK(f != NULL, "no export table at %s", path);
    static const char zero[4096 - 16];
    CHECK(fseek(f, 16, SEEK_SET) == 0 && fwrite(zero, sizeof(zero), 1, f) == 1, "emptying %s", path);
    fclose(f);
}
static CUresult ipc_unit(uint64_t *h) {
    return cuIpcOpenMemHandle_v2((CUdeviceptr *)h, ipc_handles[ipc_next++], 1);
}
static CUresult ipc_free(uint64_t h) { return cuIpcCloseMemHandle(h); }
/* external memory, counted by the imported size */
static CUresult ext_bytes(uint64_t b, uint64_t *h) {
    CUDA_EXTERNAL_MEMORY_HANDLE_DESC d;
    memset(&d, 0, sizeof(d));
    d.type = 1;
    d.handle.fd = 99;
    d.size = b;
    CUresult r = cuImportExternalMemory((CUexternalMemory *)h, &d);
    if (r == CUDA_SUCCESS) {
        /* mapping a buffer is a view: never counted again */
        CUDA_EXTERNAL_MEMORY_BUFFER_DESC bd;
        memset(&bd, 0, sizeof(bd));
        bd.size = b;
        CUdeviceptr p;
        CHECK_CU(cuExternalMemoryGetMappedBuffer(&p, (CUexternalMemory)(uintptr_t)*h, &bd));
    }
    return r;
}
static CUresult ext_unit(uint64_t *h) { return ext_bytes(MiB, h); }
static CUresult ext_free(uint64_t h) { return cuDestroyExternalMemory((CUexternalMemory)(uintptr_t)h); }

static const mem_path paths[] = {
    {"alloc", MiB, 512, 1, NULL, a_unit, a_bytes, a_free, NULL},
    {"pitch", MiB, 512, 1, NULL, p_unit, NULL, a_free, NULL},
    {"managed", MiB, 512, 1, NULL, m_unit, m_bytes, a_free, NULL},
    {"array", MiB, 512, 1, NULL, arr_unit, NULL, arr_free, NULL},
    {"array3d", MiB, 512, 1, NULL, arr3_unit, NULL, arr_free, NULL},
    {"mipmap", 2 * MiB, 512, 1, NULL, mip_unit, NULL, mip_free, NULL}, /* 1.25 MiB: a 2 MiB page */
    {"vmm", MiB, 1, 1, NULL, vmm_unit, vmm_bytes, vmm_free, NULL},
    {"async", MiB, 512, 1, async_setup, as_unit, as_bytes, as_free, as_sync},
    {"pool", MiB, 512, 1, pool_setup, pool_unit, pool_bytes, as_free, as_sync},
    {"ipc", MiB, 1, 0, ipc_setup, ipc_unit, NULL, ipc_free, NULL},
    {"extmem", MiB, 1, 1, NULL, ext_unit, ext_bytes, ext_free, NULL},
};
#define NPATHS (int)(sizeof(paths) / sizeof(paths[0]))

static void limits_two_gpus(void) {
    gpu_line g[2] = {{0, CAP0, 100}, {1, CAP1, 100}};
    setup_limits(g, 2);
    ctx_costs_nothing(); /* the cases count each path's bytes to the cap exactly */
}

static void open_ctxs(const mem_path *p) {
    ctx1 = ctx_on(1);
    ctx0 = ctx_on(0);
    ipc_next = 0;
    if (p->setup)
        p->setup();
}

/* Fills device 0 to its cap; returns the number of units held. */
static int fill(const mem_path *p, uint64_t *h) {
    int n = 0;
    for (;;) {
        CHECK(n < MAXH, "allocated %d units without reaching the cap", n);
        CUresult r = p->alloc(&h[n]);
        if (r != CUDA_SUCCESS) {
            CHECK(r == CUDA_ERROR_OUT_OF_MEMORY, "%s: got %d, want CUDA_ERROR_OUT_OF_MEMORY", p->name, r);
            return n;
        }
        n++;
    }
}

/* Frees everything with device 1's context current. */
static void release_all(const mem_path *p, uint64_t *h, int n) {
    CHECK_CU(cuCtxSetCurrent(ctx1));
    for (int i = 0; i < n; i++)
        CHECK_CU(p->release(h[i]));
    CHECK_CU(cuCtxSetCurrent(ctx0));
}

static void run_1proc(const mem_path *p) {
    limits_two_gpus();
    open_ctxs(p);
    uint64_t ipc_base = region_used(1);
    uint64_t h[MAXH];
    int n = fill(p, h);
    CHECK(n * p->unit == CAP0, "%s: held %llu bytes at OOM, cap %llu", p->name,
          (unsigned long long)(n * p->unit), (unsigned long long)CAP0);
    CHECK(region_used(0) == CAP0, "region says %llu", (unsigned long long)region_used(0));
    CHECK(region_used(1) == ipc_base, "device 1 charged for device 0 memory");
    fake_stats st;
    fakeDeviceStats(0, &st);
    if (p->fake_counts)
        CHECK(st.peak <= CAP0 && st.used == CAP0, "fake device 0 peak %llu used %llu",
              (unsigned long long)st.peak, (unsigned long long)st.used);
    size_t fr = 1, tot = 0;
    CHECK_CU(cuMemGetInfo_v2(&fr, &tot));
    CHECK(fr == 0 && tot == CAP0, "cuMemGetInfo free %zu total %zu", fr, tot);

    if (p->alloc_bytes) {
        /* exact to the driver's rounding unit (512 bytes for small linear
         * and pool allocations, 1 byte for VMM and imports): free one
         * unit, then fill the hole precisely */
        uint64_t a, b, c, gr = p->gran;
        CHECK_CU(p->release(h[--n]));
        CHECK_CU(p->alloc_bytes(p->unit - gr, &a));
        CHECK(p->alloc_bytes(gr + 1, &b) == CUDA_ERROR_OUT_OF_MEMORY, "%llu bytes over the cap accepted",
              (unsigned long long)(gr + 1));
        CHECK_CU(p->alloc_bytes(gr, &b));
        CHECK(p->alloc_bytes(1, &c) == CUDA_ERROR_OUT_OF_MEMORY, "1 byte over the cap accepted");
        CHECK(region_used(0) == CAP0, "region %llu", (unsigned long long)region_used(0));
        CHECK_CU(cuCtxSetCurrent(ctx1));
        CHECK_CU(p->release(a));
        CHECK_CU(p->release(b));
        CHECK_CU(cuCtxSetCurrent(ctx0));
    }
    release_all(p, h, n);
    if (p->synced) {
        /* a pool keeps freed pages until a synchronisation: still charged */
        CHECK(region_used(0) == CAP0, "pool pages credited before the driver gave them back: %llu",
              (unsigned long long)region_used(0));
        p->synced();
    }
    CHECK(region_used(0) == 0, "%llu bytes left charged", (unsigned long long)region_used(0));
    CHECK(region_used(1) == ipc_base, "device 1 credited for device 0 frees");
    fakeDeviceStats(0, &st);
    CHECK(st.used == 0 && st.mapped == 0, "fake still holds %llu (+%llu mapped)",
          (unsigned long long)st.used, (unsigned long long)st.mapped);
    /* and the memory is usable again */
    ipc_next = 0;
    n = fill(p, h);
    CHECK(n * p->unit == CAP0, "refill held %llu", (unsigned long long)(n * p->unit));
}

#define NPROC 4
typedef struct {
    const mem_path *p;
    chan ch[NPROC];
} mp_arg;

static int mp_child(int i, void *arg) {
    mp_arg *a = arg;
    const mem_path *p = a->p;
    open_ctxs(p);
    uint64_t h[MAXH];
    int n = fill(p, h);
    chan_send_up(&a->ch[i], (uint64_t)n);
    chan_recv_down(&a->ch[i]); /* hold until every process has hit the cap */
    release_all(p, h, n);
    if (p->synced)
        p->synced();
    chan_send_up(&a->ch[i], 0);
    chan_recv_down(&a->ch[i]);
    return 0;
}

static void run_4proc(const mem_path *p) {
    limits_two_gpus();
    mp_arg a = {.p = p};
    pid_t pid[NPROC];
    for (int i = 0; i < NPROC; i++) {
        chan_init(&a.ch[i]);
        pid[i] = spawn(mp_child, i, &a);
    }
    uint64_t total = 0;
    for (int i = 0; i < NPROC; i++)
        total += chan_recv_up(&a.ch[i]) * p->unit;
    CHECK(total == CAP0, "%s: %d processes held %llu bytes at OOM, cap %llu", p->name, NPROC,
          (unsigned long long)total, (unsigned long long)CAP0);
    CHECK(region_used(0) == CAP0, "region %llu", (unsigned long long)region_used(0));
    fake_stats st;
    fakeDeviceStats(0, &st);
    if (p->fake_counts)
        CHECK(st.peak <= CAP0, "fake device 0 peaked at %llu", (unsigned long long)st.peak);
    for (int i = 0; i < NPROC; i++)
        chan_send_down(&a.ch[i], 1);
    for (int i = 0; i < NPROC; i++)
        chan_recv_up(&a.ch[i]);
    CHECK(region_used(0) == 0, "%llu left after frees", (unsigned long long)region_used(0));
    fakeDeviceStats(0, &st);
    if (p->fake_counts)
        CHECK(st.used == 0, "fake holds %llu", (unsigned long long)st.used);
    for (int i = 0; i < NPROC; i++)
        chan_send_down(&a.ch[i], 1);
    for (int i = 0; i < NPROC; i++)
        CHECK(wait_child(pid[i]) == 0, "child %d failed", i);
    CHECK(region_live_slots() == 0, "%d slots still held after exit", region_live_slots());
}

static const mem_path *current;
static void case_1proc(void);
static void case_4proc(void);
static char *names[NPATHS * 2];

__attribute__((constructor)) static void register_mem_cases(void) {
    for (int i = 0; i < NPATHS; i++) {
        if (asprintf(&names[2 * i], "mem_%s_1proc", paths[i].name) < 0 ||
            asprintf(&names[2 * i + 1], "mem_%s_4proc", paths[i].name) < 0)
            abort();
        register_test(names[2 * i], case_1proc);
        register_test(names[2 * i + 1], case_4proc);
    }
}

static const mem_path *path_of_current(void) {
    for (int i = 0; i < NPATHS; i++)
        if (strcmp(current_test_name + 4, paths[i].name) == 0 ||
            (strncmp(current_test_name + 4, paths[i].name, strlen(paths[i].name)) == 0 &&
             current_test_name[4 + strlen(paths[i].name)] == '_'))
            return &paths[i];
    CHECK(0, "no path for %s", current_test_name);
    return NULL;
}
static void case_1proc(void) {
    current = path_of_current();
    run_1proc(current);
}
static void case_4proc(void) {
    current = path_of_current();
    run_4proc(current);
}

/* Host locations are not device memory: never charged. */
TEST(mem_host_locations_not_counted) {
    limits_two_gpus();
    ctx1 = ctx_on(1);
    ctx0 = ctx_on(0);
    CUmemAllocationProp p;
    memset(&p, 0, sizeof(p));
    p.type = 1;
    p.location.type = CU_MEM_LOCATION_TYPE_HOST;
    CUmemGenericAllocationHandle h;
    CHECK_CU(cuMemCreate(&h, 4 * CAP0, &p, 0));
    p.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    CUmemGenericAllocationHandle h2;
    CHECK_CU(cuMemCreate(&h2, 4 * CAP0, &p, 0));
    CUmemPoolProps pp;
    memset(&pp, 0, sizeof(pp));
    pp.allocType = 1;
    pp.location.type = CU_MEM_LOCATION_TYPE_HOST;
    CUmemoryPool hostpool;
    CHECK_CU(cuMemPoolCreate(&hostpool, &pp));
    CUdeviceptr d;
    CHECK_CU(cuMemAllocFromPoolAsync(&d, 4 * CAP0, hostpool, NULL));
    CHECK(region_used(0) == 0 && region_used(1) == 0, "host memory was charged");
    /* the default pool of device 0 is device memory */
    CUmemoryPool dp;
    CHECK_CU(cuDeviceGetDefaultMemPool(&dp, 0));
    CHECK(cuMemAllocFromPoolAsync(&d, CAP0 + 1, dp, NULL) == CUDA_ERROR_OUT_OF_MEMORY,
          "default pool over the cap accepted");
    CHECK_CU(cuMemAllocFromPoolAsync(&d, CAP0, dp, NULL));
    CHECK(region_used(0) == CAP0, "default pool not charged");
    CHECK_CU(cuMemFreeAsync(d, NULL));
    CHECK(region_used(0) == CAP0, "pool pages credited at the free");
    CHECK_CU(cuCtxSynchronize()); /* the default pool's threshold is 0: pages go back */
    CHECK_CU(cuMemRelease(h));
    CHECK_CU(cuMemRelease(h2));
    CHECK(region_used(0) == 0, "left %llu", (unsigned long long)region_used(0));
}

/* A failed driver call changes nothing. */
TEST(mem_driver_failure_gives_back) {
    gpu_line g[1] = {{0, 1ull << 40, 100}}; /* cap above the fake's 16 GiB */
    setup_limits(g, 1);
    ctx0 = ctx_on(0);
    uint64_t ctx = region_used(0); /* the context's own memory */
    CHECK(ctx == FAKE_CTX_BYTES_SM90, "context charged %llu", (unsigned long long)ctx);
    CUdeviceptr p;
    CHECK(cuMemAlloc_v2(&p, 17ull << 30) == CUDA_ERROR_OUT_OF_MEMORY, "fake should refuse");
    CHECK(region_used(0) == ctx, "failed allocation left %llu charged", (unsigned long long)(region_used(0) - ctx));
    CHECK(cuMemFree_v2(0x1234) != CUDA_SUCCESS, "free of an unknown pointer");
    CHECK(region_used(0) == ctx, "unknown free credited");
}

/* Hundreds of processes of one container starting CUDA at once: vcuda's
 * first-use work is one small file read, one mmap and one slot claim under a
 * short flock, so they all start quickly and the books balance. (Timing is
 * printed, not asserted.) */
static int starter(int i, void *arg) {
    (void)i;
    chan *c = arg;
    uint64_t t0 = now_ns();
    CUdeviceptr d;
    ctx0 = ctx_on(0);
    CUresult r = cuMemAlloc_v2(&d, MiB / 4); /* first intercepted call: vcuda initialises */
    uint64_t t1 = now_ns();
    if (r != CUDA_SUCCESS)
        return 1;
    chan_send_up(c, t1 - t0);
    chan_recv_down(c);
    return cuMemFree_v2(d) == CUDA_SUCCESS ? 0 : 1;
}

TEST(mem_200_processes_start_together) {
    limits_two_gpus();
    enum { N = 200 };
    static pid_t p[N];
    static chan c[N];
    uint64_t t0 = now_ns(), worst = 0;
    for (int i = 0; i < N; i++) {
        chan_init(&c[i]);
        p[i] = spawn(starter, i, &c[i]);
    }
    for (int i = 0; i < N; i++) {
        uint64_t t = chan_recv_up(&c[i]);
        if (t > worst)
            worst = t;
    }
    uint64_t all = now_ns() - t0;
    CHECK(region_used(0) == N * (MiB / 4), "region %llu", (unsigned long long)region_used(0));
    CHECK(region_live_slots() == N, "%d slots", region_live_slots());
    for (int i = 0; i < N; i++) {
        chan_send_down(&c[i], 1);
        close(c[i].up[0]), close(c[i].up[1]), close(c[i].down[1]);
    }
    for (int i = 0; i < N; i++)
        CHECK(wait_child(p[i]) == 0, "process %d failed", i);
    CHECK(region_used(0) == 0 && region_live_slots() == 0, "region %llu, %d slots",
          (unsigned long long)region_used(0), region_live_slots());
    fprintf(stderr, "%d processes up and allocating in %.0f ms; slowest first call %.1f ms\n", N,
            all / 1e6, worst / 1e6);
}

/* Destroying a context frees what was allocated in it; so does the last
 * release or a reset of a primary context. vcuda credits it back. VMM
 * handles belong to the device and stay charged until released. */
TEST(mem_context_destroy_credits) {
    limits_two_gpus();
    CUcontext a = ctx_on(0);
    (void)a;
    CUdeviceptr d;
    CHECK_CU(cuMemAlloc_v2(&d, 10 * MiB));
    CHECK_CU(cuMemAllocManaged(&d, 2 * MiB, 1));
    uint64_t h;
    CHECK_CU(arr_unit(&h));
    CHECK_CU(ext_bytes(MiB, &h));
    CUmemAllocationProp p;
    memset(&p, 0, sizeof(p));
    p.type = 1;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    CUmemGenericAllocationHandle vmm;
    CHECK_CU(cuMemCreate(&vmm, 3 * MiB, &p, 0));
    CHECK(region_used(0) == 17 * MiB, "before: %llu", (unsigned long long)region_used(0));
    CHECK_CU(cuCtxDestroy_v2(a));
    CHECK(region_used(0) == 3 * MiB, "after cuCtxDestroy: %llu", (unsigned long long)region_used(0));

    CUcontext pc;
    CHECK_CU(cuDevicePrimaryCtxRetain(&pc, 0));
    CHECK_CU(cuDevicePrimaryCtxRetain(&pc, 0));
    CHECK_CU(cuCtxSetCurrent(pc));
    CHECK_CU(cuMemAlloc_v2(&d, 4 * MiB));
    CHECK_CU(cuDevicePrimaryCtxRelease_v2(0)); /* still referenced: memory stays */
    CHECK(region_used(0) == 7 * MiB, "after first release: %llu", (unsigned long long)region_used(0));
    CHECK_CU(cuDevicePrimaryCtxRelease_v2(0)); /* last reference: the context dies */
    CHECK(region_used(0) == 3 * MiB, "after last release: %llu", (unsigned long long)region_used(0));

    CHECK_CU(cuDevicePrimaryCtxRetain(&pc, 0));
    CHECK_CU(cuCtxSetCurrent(pc));
    CHECK_CU(cuMemAlloc_v2(&d, 4 * MiB));
    CHECK_CU(cuDevicePrimaryCtxReset_v2(0));
    CHECK(region_used(0) == 3 * MiB, "after reset: %llu", (unsigned long long)region_used(0));
    CHECK_CU(cuMemRelease(vmm));
    CHECK(region_used(0) == 0, "after release: %llu", (unsigned long long)region_used(0));
    fake_stats st;
    fakeDeviceStats(0, &st);
    CHECK(st.used == 0, "fake holds %llu", (unsigned long long)st.used);
}

/* fork(): the child starts with no slot and no handles of its own; it
 * allocates under the same cap; its exit gives its share back. */
static int forked(int i, void *arg) {
    (void)i, (void)arg;
    CUdeviceptr d;
    ctx0 = ctx_on(0);
    if (cuMemAlloc_v2(&d, 30 * MiB) != CUDA_SUCCESS)
        return 1;
    if (cuMemAlloc_v2(&d, 1) != CUDA_ERROR_OUT_OF_MEMORY)
        return 2; /* parent holds 30, child 30: the cap is full */
    return 0;
}
TEST(mem_fork_child_own_slot) {
    limits_two_gpus();
    ctx0 = ctx_on(0);
    CUdeviceptr d;
    CHECK_CU(cuMemAlloc_v2(&d, 30 * MiB));
    CHECK(region_live_slots() == 1, "slots %d", region_live_slots());
    int rc = wait_child(spawn(forked, 0, NULL));
    CHECK(rc == 0, "child: %d", rc);
    CHECK(region_used(0) == 30 * MiB && region_live_slots() == 1, "after the child: %llu, %d slots",
          (unsigned long long)region_used(0), region_live_slots());
    CHECK_CU(cuMemFree_v2(d));
    CHECK(region_used(0) == 0, "left %llu", (unsigned long long)region_used(0));
}

/* Threads of one process allocating and freeing at once (linear, arrays,
 * VMM handles): the lock-free tables and reservations keep the books exact
 * and the fake driver never holds more than the cap. */
#include <pthread.h>
static void *thread_churn(void *arg) {
    unsigned seed = (unsigned)(uintptr_t)arg * 2654435761u + 7;
    CHECK_CU(cuCtxSetCurrent(ctx0));
    for (int round = 0; round < 3000; round++) {
        uint64_t h[6];
        int kind[6], n = 0;
        for (int k = 0; k < 6; k++) {
            seed = seed * 1103515245u + 12345u;
            CUresult r;
            kind[n] = (int)(seed >> 28) % 3;
            if (kind[n] == 0) {
                r = cuMemAlloc_v2((CUdeviceptr *)&h[n], (seed >> 6) % (16 * MiB) + 1);
            } else if (kind[n] == 1) {
                r = arr_unit(&h[n]);
            } else {
                CUmemAllocationProp p;
                memset(&p, 0, sizeof(p));
                p.type = 1;
                p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
                r = cuMemCreate((CUmemGenericAllocationHandle *)&h[n], 2 * MiB, &p, 0);
            }
            if (r == CUDA_SUCCESS)
                n++;
            else
                CHECK(r == CUDA_ERROR_OUT_OF_MEMORY, "got %d", r);
        }
        for (int k = 0; k < n; k++) {
            if (kind[k] == 0)
                CHECK_CU(cuMemFree_v2(h[k]));
            else if (kind[k] == 1)
                CHECK_CU(arr_free(h[k]));
            else
                CHECK_CU(cuMemRelease(h[k]));
        }
    }
    return NULL;
}
TEST(mem_threads_churn) {
    limits_two_gpus();
    ctx1 = ctx_on(1);
    ctx0 = ctx_on(0);
    pthread_t t[4];
    for (uintptr_t i = 0; i < 4; i++)
        CHECK(pthread_create(&t[i], NULL, thread_churn, (void *)i) == 0, "pthread_create");
    for (int i = 0; i < 4; i++)
        pthread_join(t[i], NULL);
    fake_stats st;
    fakeDeviceStats(0, &st);
    CHECK(st.peak <= CAP0, "fake device peaked at %llu, cap %llu", (unsigned long long)st.peak,
          (unsigned long long)CAP0);
    CHECK(st.used == 0 && region_used(0) == 0, "left: fake %llu region %llu", (unsigned long long)st.used,
          (unsigned long long)region_used(0));
    vc_region_gpu *g0 = (vc_region_gpu *)((char *)region_map() + VC_REGION_GPU_OFFSET);
    CHECK(atomic_load(&g0->oom_events) > 0, "the churn never reached the cap");
    fprintf(stderr, "peak %.1f MiB of %llu, %llu refusals\n", st.peak / (double)MiB,
            (unsigned long long)(CAP0 / MiB), (unsigned long long)atomic_load(&g0->oom_events));
}

/* The device malloc heap (cuCtxSetLimit) is device memory of any size the
 * application asks for: charged, refused over the cap, resized by the
 * difference, credited with its context. The fake takes it from the
 * device, so its physical peak shows nothing passed the cap. */
CUresult cuCtxSetLimit(int, size_t);
TEST(mem_heap_limit_charged) {
    gpu_line g[1] = {{0, 60 * MiB, 100}};
    setup_limits(g, 1);
    ctx_costs_nothing(); /* the heap's bytes against the cap, exactly */
    CUcontext c = ctx_on(0);
    CHECK_CU(cuCtxSetLimit(2, 20 * MiB + 1)); /* rounded to 22 MiB */
    CHECK(region_used(0) == 22 * MiB, "heap charged %llu", (unsigned long long)region_used(0));
    CUdeviceptr d;
    CHECK(cuMemAlloc_v2(&d, 40 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "heap not counted against the cap");
    CHECK_CU(cuMemAlloc_v2(&d, 38 * MiB));
    CHECK(cuCtxSetLimit(2, 30 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "heap grown past the cap");
    CHECK_CU(cuMemFree_v2(d));
    CHECK_CU(cuCtxSetLimit(2, 8 * MiB)); /* shrink: credited */
    CHECK(region_used(0) == 8 * MiB, "after shrinking %llu", (unsigned long long)region_used(0));
    CHECK(cuCtxSetLimit(2, 61 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "a heap over the cap");
    fake_stats st;
    fakeDeviceStats(0, &st);
    CHECK(st.peak <= 60 * MiB, "fake peak %llu", (unsigned long long)st.peak);
    CHECK_CU(cuCtxDestroy_v2(c));
    CHECK(region_used(0) == 0, "heap not credited with its context: %llu", (unsigned long long)region_used(0));
}
