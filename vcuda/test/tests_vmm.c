/*
 * tests_vmm.c - virtual memory management (cuMemCreate / cuMemMap) with the
 * driver's lifetime rule: an allocation lives until its handle is released
 * (every cuMemRetainAllocationHandle reference too) AND every mapping of it
 * is unmapped. The fake driver keeps memory alive the same way, so a hook
 * that credits at cuMemRelease lets the fake's physical use pass the cap.
 * The security_ cases are what a tenant (or llama.cpp's VMM pool, which
 * does create -> map -> release and unmaps much later) does to get memory
 * past the cap.
 */
#define _GNU_SOURCE
#include <string.h>

#include "cuda_api.h"
#include "util.h"

#define CAP (64 * MiB)
#define GRAN (2 * MiB)

static void one_gpu(void) {
    gpu_line g[1] = {{0, CAP, 100}};
    setup_limits(g, 1);
    ctx_costs_nothing(); /* the cases count VMM bytes to the cap exactly */
    ctx_on(0);
}

static CUresult create(CUmemGenericAllocationHandle *h, uint64_t size) {
    CUmemAllocationProp p;
    memset(&p, 0, sizeof(p));
    p.type = 1; /* pinned */
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = 0;
    return cuMemCreate(h, size, &p, 0);
}

/* cuMemMap + cuMemSetAccess, as every VMM user does. */
static void map(CUdeviceptr va, uint64_t size, CUmemGenericAllocationHandle h) {
    CHECK_CU(cuMemMap(va, size, 0, h, 0));
    struct {
        CUmemLocation loc;
        unsigned long long flags;
    } access = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, 3 /* read-write */};
    CHECK_CU(cuMemSetAccess(va, size, &access, 1));
}

static uint64_t fake_used(void) {
    fake_stats st;
    fakeDeviceStats(0, &st);
    return st.used;
}
static uint64_t fake_peak(void) {
    fake_stats st;
    fakeDeviceStats(0, &st);
    return st.peak;
}

/* Release while mapped: the driver keeps the memory, so must the cap. */
TEST(security_vmm_release_while_mapped) {
    one_gpu();
    CUmemGenericAllocationHandle h, h2;
    CUdeviceptr va;
    CHECK_CU(create(&h, 32 * MiB));
    CHECK_CU(cuMemAddressReserve(&va, 32 * MiB, 0, 0, 0));
    map(va, 32 * MiB, h);
    CHECK_CU(cuMemRelease(h));
    CHECK(fake_used() == 32 * MiB, "the fake freed mapped memory at release: holds %llu",
          (unsigned long long)fake_used());
    CHECK(region_used(0) == 32 * MiB, "released but still mapped: region says %llu, the driver holds 32 MiB",
          (unsigned long long)region_used(0));
    CHECK(create(&h2, 33 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "33 MiB more accepted next to 32 MiB still mapped");
    CHECK(fake_peak() <= CAP, "physical peak %llu over the cap", (unsigned long long)fake_peak());
    CHECK_CU(create(&h2, 32 * MiB)); /* exactly the rest */
    CHECK_CU(cuMemRelease(h2));
    /* the memory goes with its last mapping */
    CHECK_CU(cuMemUnmap(va, 32 * MiB));
    CHECK(region_used(0) == 0 && fake_used() == 0, "after unmap: region %llu, fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)fake_used());
    CHECK_CU(cuMemAddressFree(va, 32 * MiB));
    CHECK_CU(create(&h, CAP));
    CHECK_CU(cuMemRelease(h));
}

/* The loop create -> map -> release, never unmapping: each iteration's
 * memory stays. The cap must stop it exactly at CAP, and unmapping the whole
 * range at once (llama.cpp's pool destructor) gives all of it back. */
static int vmm_pool_fill(CUdeviceptr va, uint64_t reserve) {
    int n = 0;
    for (;;) {
        CUmemGenericAllocationHandle h;
        CHECK((uint64_t)n * GRAN < reserve, "mapped %d x 2 MiB without reaching the cap", n);
        CUresult r = create(&h, GRAN);
        if (r != CUDA_SUCCESS) {
            CHECK(r == CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate: %d, want CUDA_ERROR_OUT_OF_MEMORY", r);
            return n;
        }
        map(va + (uint64_t)n * GRAN, GRAN, h);
        CHECK_CU(cuMemRelease(h));
        n++;
    }
}

TEST(security_vmm_create_map_release_loop) {
    one_gpu();
    const uint64_t reserve = 4 * CAP;
    CUdeviceptr va;
    CHECK_CU(cuMemAddressReserve(&va, reserve, 0, 0, 0));
    int n = vmm_pool_fill(va, reserve);
    CHECK((uint64_t)n * GRAN == CAP, "create/map/release held %llu MiB at OOM, cap %llu MiB",
          (unsigned long long)((uint64_t)n * GRAN / MiB), (unsigned long long)(CAP / MiB));
    CHECK(fake_peak() <= CAP, "physical peak %llu MiB over the %llu MiB cap",
          (unsigned long long)(fake_peak() / MiB), (unsigned long long)(CAP / MiB));
    CHECK(region_used(0) == CAP, "region %llu", (unsigned long long)region_used(0));
    CHECK_CU(cuMemUnmap(va, (uint64_t)n * GRAN));
    CHECK(region_used(0) == 0 && fake_used() == 0, "after unmapping the pool: region %llu, fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)fake_used());
    CHECK_CU(cuMemAddressFree(va, reserve));
}

/* The same loop in 4 processes of one container: together never over the cap. */
#define NPROC 4
static chan pool_ch[NPROC];
static int pool_child(int i, void *arg) {
    (void)arg;
    ctx_on(0);
    const uint64_t reserve = 4 * CAP;
    CUdeviceptr va;
    CHECK_CU(cuMemAddressReserve(&va, reserve, 0, 0, 0));
    int n = vmm_pool_fill(va, reserve);
    chan_send_up(&pool_ch[i], (uint64_t)n);
    chan_recv_down(&pool_ch[i]); /* hold until every process hit the cap */
    if (n)
        CHECK_CU(cuMemUnmap(va, (uint64_t)n * GRAN));
    CHECK_CU(cuMemAddressFree(va, reserve));
    chan_send_up(&pool_ch[i], 0);
    chan_recv_down(&pool_ch[i]);
    return 0;
}
TEST(security_vmm_create_map_release_4proc) {
    gpu_line g[1] = {{0, CAP, 100}};
    setup_limits(g, 1);
    ctx_costs_nothing(); /* the cases count VMM bytes to the cap exactly */
    pid_t pid[NPROC];
    for (int i = 0; i < NPROC; i++) {
        chan_init(&pool_ch[i]);
        pid[i] = spawn(pool_child, i, NULL);
    }
    uint64_t total = 0;
    for (int i = 0; i < NPROC; i++)
        total += chan_recv_up(&pool_ch[i]) * GRAN;
    CHECK(total == CAP, "%d processes held %llu MiB at OOM, cap %llu MiB", NPROC,
          (unsigned long long)(total / MiB), (unsigned long long)(CAP / MiB));
    CHECK(fake_peak() <= CAP, "physical peak %llu MiB", (unsigned long long)(fake_peak() / MiB));
    for (int i = 0; i < NPROC; i++)
        chan_send_down(&pool_ch[i], 1);
    for (int i = 0; i < NPROC; i++)
        chan_recv_up(&pool_ch[i]);
    CHECK(region_used(0) == 0 && fake_used() == 0, "after unmapping: region %llu, fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)fake_used());
    for (int i = 0; i < NPROC; i++)
        chan_send_down(&pool_ch[i], 1);
    for (int i = 0; i < NPROC; i++)
        CHECK(wait_child(pid[i]) == 0, "child %d failed", i);
}

/* cuMemRetainAllocationHandle adds a reference: the memory stays through
 * the original release and the unmap, until the retained handle is released. */
TEST(security_vmm_retain_keeps_memory) {
    one_gpu();
    CUmemGenericAllocationHandle h, r, x;
    CUdeviceptr va;
    CHECK_CU(create(&h, 16 * MiB));
    CHECK_CU(cuMemAddressReserve(&va, 16 * MiB, 0, 0, 0));
    map(va, 16 * MiB, h);
    CHECK_CU(cuMemRetainAllocationHandle(&r, (void *)(uintptr_t)(va + MiB)));
    CHECK(r == h, "retained handle %llx, created %llx", (unsigned long long)r, (unsigned long long)h);
    CHECK_CU(cuMemRelease(h));
    CHECK_CU(cuMemUnmap(va, 16 * MiB));
    CHECK(fake_used() == 16 * MiB, "the fake freed retained memory: %llu", (unsigned long long)fake_used());
    CHECK(region_used(0) == 16 * MiB, "retained after release and unmap: region says %llu, the driver holds 16 MiB",
          (unsigned long long)region_used(0));
    CHECK(create(&x, CAP - 15 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "accepted past the retained 16 MiB");
    CHECK(fake_peak() <= CAP, "physical peak %llu", (unsigned long long)fake_peak());
    /* the retained handle maps again like the original */
    map(va, 16 * MiB, r);
    CHECK_CU(cuMemRelease(r));
    CHECK(region_used(0) == 16 * MiB, "mapped again: region %llu", (unsigned long long)region_used(0));
    CHECK_CU(cuMemUnmap(va, 16 * MiB));
    CHECK(region_used(0) == 0 && fake_used() == 0, "after the last reference: region %llu, fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)fake_used());
}

/* What the driver refuses changes nothing: a map outside a reservation, a
 * map of a released handle, an unmap of part of a mapping, a second release.
 * One unmap over mappings of two handles frees both. */
TEST(mem_vmm_refusals_change_nothing) {
    one_gpu();
    CUmemGenericAllocationHandle a, b;
    CUdeviceptr va;
    CHECK_CU(create(&a, 4 * MiB));
    CHECK_CU(create(&b, 4 * MiB));
    CHECK_CU(cuMemAddressReserve(&va, 8 * MiB, 0, 0, 0));
    CHECK(cuMemMap(va + 64 * MiB, 4 * MiB, 0, a, 0) == CUDA_ERROR_INVALID_VALUE, "map outside the reservation");
    CHECK(cuMemMap(va, 8 * MiB, 0, a, 0) == CUDA_ERROR_INVALID_VALUE, "map past the allocation");
    map(va, 4 * MiB, a);
    CHECK(cuMemMap(va, 4 * MiB, 0, b, 0) == CUDA_ERROR_INVALID_VALUE, "map over a mapping");
    map(va + 4 * MiB, 4 * MiB, b);
    CHECK_CU(cuMemRelease(a));
    CHECK(cuMemRelease(a) == CUDA_ERROR_INVALID_VALUE, "second release of a handle");
    CHECK(cuMemMap(va, 4 * MiB, 0, a, 0) == CUDA_ERROR_INVALID_HANDLE, "map of a released handle");
    CHECK(cuMemUnmap(va, 2 * MiB) == CUDA_ERROR_INVALID_VALUE, "unmap of part of a mapping");
    CHECK(cuMemAddressFree(va, 8 * MiB) == CUDA_ERROR_INVALID_VALUE, "free of a mapped range");
    CHECK(region_used(0) == 8 * MiB, "region %llu after refused calls", (unsigned long long)region_used(0));
    CHECK_CU(cuMemRelease(b));
    CHECK(region_used(0) == 8 * MiB && fake_used() == 8 * MiB, "both still mapped: region %llu, fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)fake_used());
    CHECK_CU(cuMemUnmap(va, 8 * MiB));
    CHECK(region_used(0) == 0 && fake_used() == 0, "one unmap over two mappings: region %llu, fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)fake_used());
    CHECK_CU(cuMemAddressFree(va, 8 * MiB));
    /* an unmapped handle still goes at its release */
    CHECK_CU(create(&a, CAP));
    CHECK_CU(cuMemRelease(a));
    CHECK(region_used(0) == 0, "release of an unmapped handle: %llu", (unsigned long long)region_used(0));
}
