/*
 * tests_ctx_overhead.c - the node agent's measured per-context overhead
 * (/etc/tessera/node/context-overhead; VCUDA_TEST_CONTEXT_OVERHEAD in the
 * test build). In a pod NVML lists host pids, so vcuda cannot measure its
 * own contexts (VCUDA_TEST_NVML_HOST_PIDS makes the test build see NVML that
 * way): it charges the larger of its table and the agent's file, and
 * records per slot what it charged its contexts (slot.ctx[]), which the
 * agent's measurement divides by.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_api.h"
#include "util.h"

#define TABLE_SM90 (512 * MiB) /* vcuda's table for the fake's device 0 (9.0) */

/* A 4 GiB cap on device 0, NVML that never lists this process, and the
 * agent's file with the given text (NULL: none). */
static void setup(const char *overhead) {
    gpu_line g[1] = {{0, 4096 * MiB, 100}};
    setup_limits(g, 1);
    setenv("VCUDA_TEST_NVML_HOST_PIDS", "1", 1);
    if (overhead) {
        write_file(tpath("context-overhead"), overhead);
        setenv("VCUDA_TEST_CONTEXT_OVERHEAD", tpath("context-overhead"), 1);
    }
}

/* The file's text: written `age` seconds ago, device 0's overhead. */
static const char *file_text(long age, uint64_t bytes) {
    static char buf[256];
    snprintf(buf, sizeof(buf), "tessera-context-overhead 1\nwritten %lld\ngpu %s %llu\n",
             (long long)time(NULL) - age, fake_uuid(0), (unsigned long long)bytes);
    return buf;
}

/* This process's slot's ctx[] entry for GPU record 0 (0: none). */
static uint32_t my_ctx_word(void) {
    vc_region_slot *sl = (vc_region_slot *)((char *)region_map() + VC_REGION_SLOT_OFFSET);
    for (int i = 0; i < VC_MAX_SLOTS; i++) {
        if (atomic_load(&sl[i].pid) != (uint32_t)getpid())
            continue;
        for (int k = 0; k < VC_CTX_RECS; k++) {
            uint32_t w = atomic_load(&sl[i].ctx[k]);
            if (w && VC_CTX_GPU(w) == 0)
                return w;
        }
    }
    return 0;
}

/* The primary context on device 0 is charged the table's 512 MiB. */
static void charged_table(const char *file) {
    CHECK_CU(cuInit(0));
    CUcontext pc;
    CHECK_CU(cuDevicePrimaryCtxRetain(&pc, 0));
    CHECK(region_used(0) == TABLE_SM90, "charged %llu MiB with %s file, want the table's 512",
          (unsigned long long)(region_used(0) / MiB), file);
}

/* A measurement above the table is charged instead of it, per context, and
 * the slot says how many contexts hold how much. */
TEST_LIB(ctxoverhead_file_charged, "testhooks") {
    setup(file_text(5, 700 * MiB));
    CHECK_CU(cuInit(0));
    CUcontext pc, c2;
    CHECK_CU(cuDevicePrimaryCtxRetain(&pc, 0));
    CHECK(region_used(0) == 700 * MiB, "primary context charged %llu MiB, want the file's 700",
          (unsigned long long)(region_used(0) / MiB));
    uint32_t w = my_ctx_word();
    CHECK(VC_CTX_COUNT(w) == 1 && VC_CTX_PAGES(w) == 350, "slot record %#x: %u contexts, %u pages", w,
          VC_CTX_COUNT(w), VC_CTX_PAGES(w));
    CHECK_CU(cuCtxCreate_v2(&c2, 0, 0));
    CHECK(region_used(0) == 1400 * MiB, "two contexts charged %llu MiB", (unsigned long long)(region_used(0) / MiB));
    w = my_ctx_word();
    CHECK(VC_CTX_COUNT(w) == 2 && VC_CTX_PAGES(w) == 700, "slot record %#x: %u contexts, %u pages", w,
          VC_CTX_COUNT(w), VC_CTX_PAGES(w));
    /* an allocation is not a context's */
    CUdeviceptr d;
    CHECK_CU(cuMemAlloc_v2(&d, 64 * MiB));
    CHECK(my_ctx_word() == w, "an allocation changed the context record");
    /* for the Go reader (TestContextOverhead): the region as the agent reads it now */
    write_file(tpath("region.contexts"), "");
    FILE *in = fopen(tpath("region"), "rb"), *out = fopen(tpath("region.contexts"), "wb");
    CHECK(in && out, "snapshot the region");
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), in)) > 0)
        CHECK(fwrite(buf, 1, n, out) == n, "snapshot the region");
    fclose(in);
    fclose(out);
    CHECK_CU(cuCtxDestroy_v2(c2)); /* d dies with c2 */
    w = my_ctx_word();
    CHECK(VC_CTX_COUNT(w) == 1 && VC_CTX_PAGES(w) == 350, "after a destroy: %u contexts, %u pages",
          VC_CTX_COUNT(w), VC_CTX_PAGES(w));
    CHECK_CU(cuDevicePrimaryCtxRelease_v2(0));
    CHECK(my_ctx_word() == 0 && region_used(0) == 0, "after the last release: record %#x, region %llu",
          my_ctx_word(), (unsigned long long)region_used(0));
}

/* A measurement below the table never lowers the charge: the file is
 * derived from slots tenants write. */
TEST_LIB(ctxoverhead_below_table_ignored, "testhooks") {
    setup(file_text(5, 100 * MiB));
    charged_table("a 100 MiB");
}

/* A stale file (the agent stopped) is not used; one line says so. */
TEST_LIB(ctxoverhead_stale_ignored, "testhooks") {
    setup(file_text(VC_OVERHEAD_MAX_AGE + 30, 700 * MiB));
    int saved = redirect_stderr(tpath("stderr"));
    CHECK_CU(cuInit(0));
    CUcontext pc;
    CUresult r = cuDevicePrimaryCtxRetain(&pc, 0);
    dup2(saved, 2);
    CHECK(r == CUDA_SUCCESS, "retain: %d", r);
    CHECK(region_used(0) == TABLE_SM90, "charged %llu MiB from a stale file, want the table's 512",
          (unsigned long long)(region_used(0) / MiB));
    char *log = read_text(tpath("stderr"));
    CHECK(strstr(log, "charging contexts the table's overhead") != NULL, "log: %s", log);
}

/* A malformed file is not used, whatever it says about the GPU. */
TEST_LIB(ctxoverhead_malformed_ignored, "testhooks") {
    char text[512];
    snprintf(text, sizeof(text), "%sgpu %s 1024 extra\n", file_text(5, 700 * MiB), fake_uuid(1));
    setup(text);
    charged_table("a malformed");
}

/* From the future: not a time the agent wrote. */
TEST_LIB(ctxoverhead_future_ignored, "testhooks") {
    setup(file_text(-3600, 700 * MiB));
    charged_table("a future");
}
