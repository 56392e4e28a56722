/* tests_procaddr.c - the runtime-style path: dlopen the driver, dlsym
 * cuGetProcAddress from it, resolve everything through it (what libcudart
 * does), and check every way of reaching a hooked symbol lands in vcuda. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "cuda_api.h"
#include "util.h"

#define CAP0 (60 * MiB)

typedef CUresult (*gpa2_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
typedef CUresult (*gpa_fn)(const char *, void **, int, cuuint64_t);

/* The fake's own cuGetProcAddress_v2, below vcuda. */
static void *vc_fake_gpa(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    CHECK(h != NULL, "libcuda.so.1 not loaded");
    /* dlsym is vcuda's; ask the fake through its test-only export instead */
    void *p = dlsym(h, "fakeGetProcAddress");
    CHECK(p != NULL, "fakeGetProcAddress missing");
    return p;
}

/* Which object and symbol an address belongs to. */
static void where(void *p, const char **lib, const char **sym) {
    Dl_info info;
    memset(&info, 0, sizeof(info));
    CHECK(p && dladdr(p, &info) != 0, "dladdr(%p)", p);
    *lib = info.dli_fname ? info.dli_fname : "?";
    *sym = info.dli_sname ? info.dli_sname : "?";
}
static void expect(void *p, const char *lib_part, const char *sym) {
    const char *l, *s;
    where(p, &l, &s);
    CHECK(strstr(l, lib_part) != NULL && strcmp(s, sym) == 0, "%p is %s in %s, want %s in *%s*", p, s,
          l, sym, lib_part);
}

TEST(procaddr_runtime_path) {
    gpu_line g[1] = {{0, CAP0, 100}};
    setup_limits(g, 1);
    ctx_costs_nothing(); /* each resolved entry point's bytes are checked against the 60 MiB cap */
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(h != NULL, "dlopen: %s", dlerror());
    gpa2_fn gpa2 = (gpa2_fn)dlsym(h, "cuGetProcAddress_v2");
    expect((void *)gpa2, "libvcuda", "cuGetProcAddress_v2");
    gpa_fn gpa1 = (gpa_fn)dlsym(h, "cuGetProcAddress");
    expect((void *)gpa1, "libvcuda", "cuGetProcAddress");

    CUdriverProcAddressQueryResult st = 99;
    void *fn = NULL;
    CHECK_CU(gpa2("cuGetProcAddress", &fn, 12040, 0, &st));
    expect(fn, "libvcuda", "cuGetProcAddress_v2");
    CHECK_CU(gpa2("cuGetProcAddress", &fn, 11080, 0, &st));
    expect(fn, "libvcuda", "cuGetProcAddress");

    struct {
        const char *base;
        cuuint64_t flags;
        const char *want;
    } hooked[] = {
        {"cuMemAlloc", 0, "cuMemAlloc_v2"},
        {"cuMemAllocPitch", 0, "cuMemAllocPitch_v2"},
        {"cuMemAllocManaged", 0, "cuMemAllocManaged"},
        {"cuMemFree", 0, "cuMemFree_v2"},
        {"cuMemGetInfo", 0, "cuMemGetInfo_v2"},
        {"cuDeviceTotalMem", 0, "cuDeviceTotalMem_v2"},
        {"cuArrayCreate", 0, "cuArrayCreate_v2"},
        {"cuArray3DCreate", 0, "cuArray3DCreate_v2"},
        {"cuArrayDestroy", 0, "cuArrayDestroy"},
        {"cuMipmappedArrayCreate", 0, "cuMipmappedArrayCreate"},
        {"cuMemCreate", 0, "cuMemCreate"},
        {"cuMemRelease", 0, "cuMemRelease"},
        {"cuMemAllocAsync", 0, "cuMemAllocAsync"},
        {"cuMemAllocAsync", CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, "cuMemAllocAsync_ptsz"},
        {"cuMemAllocFromPoolAsync", CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
         "cuMemAllocFromPoolAsync_ptsz"},
        {"cuMemFreeAsync", CU_GET_PROC_ADDRESS_LEGACY_STREAM, "cuMemFreeAsync"},
        {"cuMemFreeAsync", CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, "cuMemFreeAsync_ptsz"},
        {"cuIpcOpenMemHandle", 0, "cuIpcOpenMemHandle_v2"},
        {"cuIpcCloseMemHandle", 0, "cuIpcCloseMemHandle"},
        {"cuImportExternalMemory", 0, "cuImportExternalMemory"},
        {"cuDestroyExternalMemory", 0, "cuDestroyExternalMemory"},
        {"cuLaunchKernel", 0, "cuLaunchKernel"},
        {"cuLaunchKernel", CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, "cuLaunchKernel_ptsz"},
        {"cuLaunchKernelEx", CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, "cuLaunchKernelEx_ptsz"},
        {"cuLaunchCooperativeKernel", 0, "cuLaunchCooperativeKernel"},
        {"cuGraphLaunch", CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, "cuGraphLaunch_ptsz"},
        {"cuMemPoolCreate", 0, "cuMemPoolCreate"},
        {"cuDeviceGetDefaultMemPool", 0, "cuDeviceGetDefaultMemPool"},
        {"cuMemPoolTrimTo", 0, "cuMemPoolTrimTo"},
        {"cuMemPoolSetAttribute", 0, "cuMemPoolSetAttribute"},
        {"cuStreamSynchronize", CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, "cuStreamSynchronize_ptsz"},
        {"cuCtxSynchronize", 0, "cuCtxSynchronize"},
        {"cuEventSynchronize", 0, "cuEventSynchronize"},
        {"cuDevicePrimaryCtxRetain", 0, "cuDevicePrimaryCtxRetain"},
        {"cuCtxCreate", 0, "cuCtxCreate_v3"}, /* 12.4 headers */
        {"cuGreenCtxCreate", 0, "cuGreenCtxCreate"},
        {"cuGreenCtxDestroy", 0, "cuGreenCtxDestroy"},
        {"cuCtxFromGreenCtx", 0, "cuCtxFromGreenCtx"},
        {"cuGraphAddMemAllocNode", 0, "cuGraphAddMemAllocNode"},
        {"cuGraphInstantiate", 0, "cuGraphInstantiateWithFlags"},
        {"cuGraphInstantiateWithParams", 0, "cuGraphInstantiateWithParams"},
        {"cuGraphExecDestroy", 0, "cuGraphExecDestroy"},
        {"cuDeviceGraphMemTrim", 0, "cuDeviceGraphMemTrim"},
        {"cuStreamEndCapture", 0, "cuStreamEndCapture"},
    };
    for (size_t i = 0; i < sizeof(hooked) / sizeof(hooked[0]); i++) {
        fn = NULL;
        st = 99;
        CHECK_CU(gpa2(hooked[i].base, &fn, 12040, hooked[i].flags, &st));
        CHECK(st == CU_GET_PROC_ADDRESS_SUCCESS, "status %d", st);
        expect(fn, "libvcuda", hooked[i].want);
        fn = NULL;
        CHECK_CU(gpa1(hooked[i].base, &fn, 12040, hooked[i].flags));
        expect(fn, "libvcuda", hooked[i].want);
    }
    /* not hooked: the driver's own */
    CHECK_CU(gpa2("cuStreamCreate", &fn, 12040, 0, &st));
    expect(fn, "libcuda.so.1", "cuStreamCreate");
    CHECK(gpa2("cuNoSuchFunction", &fn, 12040, 0, &st) == CUDA_ERROR_NOT_FOUND &&
              st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND,
          "unknown symbol");

    /* and the functions obtained this way enforce */
    CUresult (*init)(unsigned), (*create)(CUcontext *, unsigned, CUdevice);
    CUresult (*alloc)(CUdeviceptr *, size_t), (*mfree)(CUdeviceptr), (*info)(size_t *, size_t *);
    CHECK_CU(gpa2("cuInit", (void **)&init, 12040, 0, NULL));
    CHECK_CU(gpa2("cuCtxCreate", (void **)&create, 12040, 0, NULL));
    CHECK_CU(gpa2("cuMemAlloc", (void **)&alloc, 12040, 0, NULL));
    CHECK_CU(gpa2("cuMemFree", (void **)&mfree, 12040, 0, NULL));
    CHECK_CU(gpa2("cuMemGetInfo", (void **)&info, 12040, 0, NULL));
    CUcontext c;
    CHECK_CU(init(0));
    CHECK_CU(create(&c, 0, 0));
    CUdeviceptr d;
    CHECK(alloc(&d, CAP0 + 1) == CUDA_ERROR_OUT_OF_MEMORY, "over the cap through cuGetProcAddress");
    CHECK_CU(alloc(&d, CAP0));
    size_t fr = 1, tot = 0;
    CHECK_CU(info(&fr, &tot));
    CHECK(fr == 0 && tot == CAP0, "info %zu/%zu", fr, tot);
    CHECK_CU(mfree(d));
    CHECK(region_used(0) == 0, "left %llu", (unsigned long long)region_used(0));
}

TEST(procaddr_dlsym) {
    gpu_line g[1] = {{0, CAP0, 100}};
    setup_limits(g, 1);
    ctx_costs_nothing(); /* each resolved entry point's bytes are checked against the 60 MiB cap */
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(h != NULL, "dlopen: %s", dlerror());
    expect(dlsym(h, "cuMemAlloc_v2"), "libvcuda", "cuMemAlloc_v2");
    expect(dlsym(h, "cuLaunchKernel_ptsz"), "libvcuda", "cuLaunchKernel_ptsz");
    expect(dlsym(h, "cuStreamCreate"), "libcuda.so.1", "cuStreamCreate");
    CHECK(dlsym(h, "cuNoSuchFunction") == NULL, "unknown symbol resolved");
    void *n = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(n != NULL, "dlopen nvml: %s", dlerror());
    expect(dlsym(n, "nvmlDeviceGetMemoryInfo"), "libvcuda", "nvmlDeviceGetMemoryInfo");
    expect(dlsym(n, "nvmlDeviceGetMemoryInfo_v2"), "libvcuda", "nvmlDeviceGetMemoryInfo_v2");
    expect(dlsym(n, "nvmlDeviceGetUUID"), "libnvidia-ml", "nvmlDeviceGetUUID");
    /* RTLD_NEXT keeps its meaning for the caller: searching after this
     * executable finds the preloaded vcuda, not the driver behind it. */
    expect(dlsym(RTLD_NEXT, "cuMemAlloc_v2"), "libvcuda", "cuMemAlloc_v2");
    expect(dlsym(RTLD_DEFAULT, "cuMemFree_v2"), "libvcuda", "cuMemFree_v2");
    CHECK(dlsym(RTLD_NEXT, "no_such_symbol_anywhere") == NULL, "RTLD_NEXT bogus");
}

/* Programs linked against libcuda (no dlopen) reach vcuda by interposition. */
TEST(procaddr_linked_symbols) {
    expect((void *)cuMemAlloc_v2, "libvcuda", "cuMemAlloc_v2");
    expect((void *)cuLaunchKernel, "libvcuda", "cuLaunchKernel");
    expect((void *)nvmlDeviceGetMemoryInfo_v2, "libvcuda", "nvmlDeviceGetMemoryInfo_v2");
}

/* A real driver's cuGetProcAddress may hand out internal entry points that
 * are in no symbol table (the fake's FAKE_CUDA_PROC_INTERNAL mode): vcuda
 * must still return its hooks, and what it calls must count. */
TEST(procaddr_internal_addresses) {
    setenv("FAKE_CUDA_PROC_INTERNAL", "1", 1);
    gpu_line g[1] = {{0, CAP0, 100}};
    setup_limits(g, 1);
    ctx_costs_nothing(); /* each resolved entry point's bytes are checked against the 60 MiB cap */
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(h != NULL, "dlopen: %s", dlerror());
    gpa2_fn gpa2 = (gpa2_fn)dlsym(h, "cuGetProcAddress_v2");
    void *fn = NULL;
    CUdriverProcAddressQueryResult st;
    /* the fake really hands out an address no symbol names */
    CHECK_CU(((gpa2_fn)vc_fake_gpa())("cuMemAlloc", &fn, 12080, 0, &st));
    Dl_info info;
    CHECK(dladdr(fn, &info) == 0 || info.dli_sname == NULL || strncmp(info.dli_sname, "internal_", 9) == 0,
          "the fake's internal cuMemAlloc is named %s", info.dli_sname);
    struct {
        const char *base, *want;
    } hooked[] = {
        {"cuMemAlloc", "cuMemAlloc_v2"},     {"cuMemFree", "cuMemFree_v2"},
        {"cuMemAllocAsync", "cuMemAllocAsync"}, {"cuMemFreeAsync", "cuMemFreeAsync"},
        {"cuMemGetInfo", "cuMemGetInfo_v2"}, {"cuCtxCreate", "cuCtxCreate_v4"},
        {"cuCtxSetLimit", "cuCtxSetLimit"},  {"cuStreamSynchronize", "cuStreamSynchronize"},
    };
    void *f[8];
    for (int i = 0; i < 8; i++) {
        CHECK_CU(gpa2(hooked[i].base, &f[i], 12080, 0, &st));
        expect(f[i], "libvcuda", hooked[i].want);
    }
    CHECK_CU(cuInit(0));
    CUcontext c;
    CHECK_CU(((CUresult(*)(CUcontext *, void *, unsigned, CUdevice))f[5])(&c, NULL, 0, 0));
    CUdeviceptr d, e;
    CHECK_CU(((CUresult(*)(CUdeviceptr *, size_t))f[0])(&d, CAP0 - 4 * MiB));
    CHECK(((CUresult(*)(CUdeviceptr *, size_t))f[0])(&e, 8 * MiB) == CUDA_ERROR_OUT_OF_MEMORY,
          "over the cap through an internal address");
    CHECK_CU(((CUresult(*)(int, size_t))f[6])(2, 4 * MiB)); /* heap: exactly the rest */
    CHECK(region_used(0) == CAP0, "region %llu", (unsigned long long)region_used(0));
    size_t fr = 1, tot = 0;
    CHECK_CU(((CUresult(*)(size_t *, size_t *))f[4])(&fr, &tot));
    CHECK(fr == 0 && tot == CAP0, "info %zu/%zu", fr, tot);
    CHECK_CU(((CUresult(*)(CUdeviceptr))f[1])(d));
    CHECK(region_used(0) == 4 * MiB, "after free %llu", (unsigned long long)region_used(0));
    fake_stats fs;
    fakeDeviceStats(0, &fs);
    CHECK(fs.peak <= CAP0, "physical peak %llu", (unsigned long long)fs.peak);
}

/* Every hook through cuGetProcAddress (v1 and v2) at every version and
 * flag in the matrix TestHookTable writes (generated from procaddr.c's
 * table): one line "base version flags want", want the hook's name or "-"
 * for a version no variant serves. */
TEST(hooktable_every_hook_every_version) {
    gpu_line g[1] = {{0, CAP0, 100}};
    setup_limits(g, 1);
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(h != NULL, "dlopen: %s", dlerror());
    gpa2_fn gpa2 = (gpa2_fn)dlsym(h, "cuGetProcAddress_v2");
    gpa_fn gpa1 = (gpa_fn)dlsym(h, "cuGetProcAddress");
    FILE *f = fopen(tpath("matrix"), "r");
    CHECK(f != NULL, "no matrix at %s (TestHookTable writes it)", tpath("matrix"));
    char base[128], want[128];
    int version, n = 0;
    unsigned long long flags;
    while (fscanf(f, "%127s %d %llu %127s", base, &version, &flags, want) == 4) {
        for (int v = 1; v <= 2; v++) {
            void *fn = NULL;
            CUdriverProcAddressQueryResult st = 99;
            CUresult r = v == 2 ? gpa2(base, &fn, version, flags, &st) : gpa1(base, &fn, version, flags);
            if (strcmp(want, "-") == 0) {
                CHECK(r != CUDA_SUCCESS, "cuGetProcAddress%s(%s, %d, %llu) answered for a version before its hook",
                      v == 2 ? "_v2" : "", base, version, flags);
                continue;
            }
            CHECK(r == CUDA_SUCCESS, "cuGetProcAddress%s(%s, %d, %llu): %d", v == 2 ? "_v2" : "", base, version, flags,
                  r);
            const char *l, *s;
            where(fn, &l, &s);
            CHECK(strstr(l, "libvcuda") != NULL && strcmp(s, want) == 0,
                  "cuGetProcAddress%s(%s, %d, %llu) is %s in %s, want vcuda's %s", v == 2 ? "_v2" : "", base, version,
                  flags, s, l, want);
        }
        n++;
    }
    fclose(f);
    CHECK(n > 100, "only %d matrix lines", n);
}
