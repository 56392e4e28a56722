/* tests_limits.c - the limits file: parser (linked directly), and how the
 * preloaded library behaves with a good, bad, missing or foreign file. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sys/stat.h>
#include <string.h>
#include <unistd.h>

#include "../src/limits.h"
#include "cuda_api.h"
#include "util.h"

#define U0 "GPU-fa4e0000-0000-4000-8000-000000000000"
#define U1 "GPU-FA4E0001-0000-4000-8000-000000000001"
#define HDR "tessera-vcuda-limits 1\ncontainer c1\nregion /run/r\n"

static int parse(const char *text, vc_limits *l, int *line, char *err) {
    return vc_limits_parse(text, strlen(text), l, line, err, 256);
}

TEST(limits_parse_valid) {
    vc_limits l;
    int line;
    char err[256];
    const char *t = "# comment\n\n   \ntessera-vcuda-limits 1\n# another\ncontainer\tabc\n"
                    "region /var/run/tessera/abc.region\n"
                    "gpu " U0 " 1 1\ngpu\t" U1 "\t9223372036854775807\t100\n";
    CHECK(parse(t, &l, &line, err) == 0, "line %d: %s", line, err);
    CHECK(strcmp(l.container, "abc") == 0, "container %s", l.container);
    CHECK(strcmp(l.region, "/var/run/tessera/abc.region") == 0, "region %s", l.region);
    CHECK(l.ngpus == 2, "ngpus %d", l.ngpus);
    CHECK(l.gpu[0].mem_cap == 1 && l.gpu[0].cores == 1, "gpu0");
    CHECK(l.gpu[1].mem_cap == 9223372036854775807ull && l.gpu[1].cores == 100, "gpu1");
    CHECK(vc_limits_find(&l, "GPU-fa4e0001-0000-4000-8000-000000000001") == 1, "case-insensitive uuid");
    /* no trailing newline */
    CHECK(parse(HDR "gpu " U0 " 5 50", &l, &line, err) == 0, "%s", err);
    /* 64 gpus is the maximum */
    char big[16384];
    int off = snprintf(big, sizeof(big), HDR);
    for (int i = 0; i < 64; i++)
        off += snprintf(big + off, sizeof(big) - (size_t)off, "gpu GPU-%08x-0000-0000-0000-000000000000 1 1\n", i);
    CHECK(parse(big, &l, &line, err) == 0 && l.ngpus == 64, "64 gpus: %s", err);
    unsigned char raw[16] = {0xfa, 0x4e, 0, 1, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 1};
    char s[VC_UUID_LEN + 1];
    vc_uuid_format(raw, s);
    CHECK(strcmp(s, "GPU-fa4e0001-0000-4000-8000-000000000001") == 0, "format %s", s);
}

TEST(limits_parse_malformed) {
    static const struct {
        const char *text;
        int line;
        const char *want;
    } bad[] = {
        {"", 0, "missing header"},
        {"tessera-vcuda-limits 2\n", 1, "unsupported version"},
        {"container c\n", 1, "expected header"},
        {"tessera-vcuda-limits  1\n", 1, "empty field"},
        {"tessera-vcuda-limits 1 \n", 1, "empty field"},
        {HDR "gpu " U0 " 1\n", 4, "missing field"},
        {HDR "gpu " U0 " 1 1 1\n", 4, "extra field"},
        {HDR "gpu " U0 " 0 1\n", 4, "bad memory cap"},
        {HDR "gpu " U0 " 9223372036854775808 1\n", 4, "bad memory cap"},
        {HDR "gpu " U0 " -5 1\n", 4, "bad memory cap"},
        {HDR "gpu " U0 " 1k 1\n", 4, "bad memory cap"},
        {HDR "gpu " U0 " 1 0\n", 4, "bad cores"},
        {HDR "gpu " U0 " 1 101\n", 4, "bad cores"},
        {HDR "gpu GPU-1234 1 1\n", 4, "bad uuid"},
        {HDR "gpu " U0 " 1 1\ngpu " U0 " 2 2\n", 5, "duplicated uuid"},
        {HDR "gpu " U0 " 1 1\ngpu GPU-FA4E0000-0000-4000-8000-000000000000 2 2\n", 5, "duplicated uuid"},
        {HDR "gpus " U0 " 1 1\n", 4, "unknown keyword"},
        {HDR "gpu " U0 " 1 1\ncontainer c2\n", 5, "given twice"},
        {HDR "gpu " U0 " 1 1\nregion /x\n", 5, "given twice"},
        {"tessera-vcuda-limits 1\ncontainer c\nregion relative/path\n", 3, "absolute"},
        {"tessera-vcuda-limits 1\nregion /r\ngpu " U0 " 1 1\n", 3, "missing container"},
        {"tessera-vcuda-limits 1\ncontainer c\ngpu " U0 " 1 1\n", 3, "missing region"},
        {HDR, 3, "no gpu"},
        {HDR "container\n", 4, "missing field"},
        {HDR "gpu " U0 " 1 1\r\n", 4, "control character"},
        {HDR "gpu " U0 " 1 1\n\tgpu " U1 " 1 1\n", 5, "empty field"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        vc_limits l;
        int line = -1;
        char err[256] = "";
        CHECK(parse(bad[i].text, &l, &line, err) != 0, "case %zu accepted", i);
        CHECK(strstr(err, bad[i].want) != NULL, "case %zu: error %s, want %s", i, err, bad[i].want);
        CHECK(line == bad[i].line, "case %zu: line %d, want %d (%s)", i, line, bad[i].line, err);
    }
    /* 65 gpu lines */
    char big[16384];
    int off = snprintf(big, sizeof(big), HDR);
    for (int i = 0; i < 65; i++)
        off += snprintf(big + off, sizeof(big) - (size_t)off, "gpu GPU-%08x-0000-0000-0000-000000000000 1 1\n", i);
    vc_limits l;
    int line;
    char err[256];
    CHECK(parse(big, &l, &line, err) != 0 && strstr(err, "more than 64"), "65 gpus: %s", err);
}

TEST(limits_fail_closed_when_malformed) {
    const char *p = tpath("limits");
    char text[512];
    snprintf(text, sizeof(text), "tessera-vcuda-limits 1\ncontainer c\nregion %s\nbogus line\n",
             tpath("region"));
    write_file(p, text);
    setenv("TESSERA_VCUDA_LIMITS", p, 1);
    int saved = redirect_stderr(tpath("stderr"));
    /* a context takes device memory too: refused */
    CUcontext c;
    CHECK_CU(cuInit(0));
    CHECK(cuCtxCreate_v2(&c, 0, 0) == CUDA_ERROR_OUT_OF_MEMORY, "context created with a bad file");
    CHECK(cuDevicePrimaryCtxRetain(&c, 0) == CUDA_ERROR_OUT_OF_MEMORY, "primary context with a bad file");
    CUdeviceptr d;
    CHECK(cuMemAlloc_v2(&d, 1) == CUDA_ERROR_OUT_OF_MEMORY, "allocation allowed with a bad file");
    CHECK(cuMemAllocManaged(&d, 1, 1) == CUDA_ERROR_OUT_OF_MEMORY, "managed allowed");
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof(prop));
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    CUmemGenericAllocationHandle h;
    CHECK(cuMemCreate(&h, 1, &prop, 0) == CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate allowed");
    dup2(saved, 2);
    char *log = read_text(tpath("stderr"));
    char want[4200];
    snprintf(want, sizeof(want), "vcuda: %s:4: unknown keyword bogus\n", p);
    CHECK(strstr(log, want) != NULL, "log %s, want %s", log, want);
    CHECK(strstr(strstr(log, want) + strlen(want), "unknown keyword") == NULL, "logged more than once: %s", log);
    CHECK(access(tpath("region"), F_OK) != 0, "region created from a bad file");
}

TEST(limits_passthrough_without_file) {
    unsetenv("TESSERA_VCUDA_LIMITS");
    setenv("FAKE_CUDA_SHM", tpath("fake-shm"), 1);
    ctx_on(0);
    CUdeviceptr d;
    CHECK_CU(cuMemAlloc_v2(&d, 15ull << 30)); /* whole fake device: no cap */
    size_t fr, tot;
    CHECK_CU(cuMemGetInfo_v2(&fr, &tot));
    CHECK(tot == 16ull << 30 && fr == (1ull << 30) - FAKE_CTX_BYTES_SM90, "info %zu/%zu: the driver's own figures",
          fr, tot);
    CHECK_CU(cuMemFree_v2(d));
}

TEST(limits_passthrough_env_file_missing) {
    setenv("TESSERA_VCUDA_LIMITS", tpath("does-not-exist"), 1);
    ctx_on(0);
    CUdeviceptr d;
    CHECK_CU(cuMemAlloc_v2(&d, 15ull << 30));
    CHECK_CU(cuMemFree_v2(d));
}

TEST(limits_unlisted_gpu_gets_cap_zero) {
    gpu_line g[1] = {{1, 1ull << 30, 100}}; /* room for a real context (the fake's FAKE_CTX_BYTES_SM90) */
    setup_limits(g, 1);
    CUcontext c1 = ctx_on(1);
    /* a context takes device memory: refused on a device with cap 0 */
    CUcontext c0;
    CHECK(cuCtxCreate_v2(&c0, 0, 0) == CUDA_ERROR_OUT_OF_MEMORY, "context on an unlisted device");
    CUdeviceptr d;
    size_t tm = 1;
    CHECK_CU(cuDeviceTotalMem_v2(&tm, 0));
    CHECK(tm == 0, "unlisted device total %zu", tm);
    CHECK_CU(cuCtxSetCurrent(c1));
    CHECK_CU(cuMemAlloc_v2(&d, 10 * MiB));
    CHECK_CU(cuMemFree_v2(d));
    (void)c0;
}

/* A container cannot point vcuda elsewhere: with the node agent's file in
 * place, the environment variable is ignored. (Test build: the "node agent"
 * path is inside the build directory.) */
TEST_LIB(limits_mounted_file_wins_over_env, "testhooks") {
    const char *etc = getenv("VCUDA_TEST_ETC_LIMITS");
    CHECK(etc && *etc, "VCUDA_TEST_ETC_LIMITS not set");
    char dir[4096];
    snprintf(dir, sizeof(dir), "%s", etc);
    for (char *s = dir + 1; *s; s++)
        if (*s == '/') {
            *s = '\0';
            mkdir(dir, 0700);
            *s = '/';
        }
    char text[1024];
    snprintf(text, sizeof(text), "tessera-vcuda-limits 1\ncontainer mounted\nregion %s\ngpu %s %llu 100\n",
             tpath("region"), fake_uuid(0), (unsigned long long)(10 * MiB));
    write_file(etc, text);
    gpu_line g[1] = {{0, 20 * MiB, 100}};
    setup_limits(g, 1); /* the forged file: 20 MiB */
    ctx_costs_nothing(); /* 10 and 20 MiB caps tell the two files apart */
    ctx_on(0);
    CUdeviceptr d;
    CUresult r = cuMemAlloc_v2(&d, 15 * MiB);
    unlink(etc);
    CHECK(r == CUDA_ERROR_OUT_OF_MEMORY, "env file honoured over the mounted one (%d)", r);
    CHECK_CU(cuMemAlloc_v2(&d, 10 * MiB));
}

/* All processes of a container must agree on the GPU table. */
static int other_limits_child(int i, void *arg) {
    (void)i, (void)arg;
    ctx_on(0);
    CUdeviceptr d;
    return cuMemAlloc_v2(&d, 1) == CUDA_SUCCESS ? 0 : 1;
}
TEST(limits_region_mismatch_fails_closed) {
    gpu_line g[1] = {{0, 10 * MiB, 100}};
    setup_limits(g, 1);
    ctx_costs_nothing(); /* small caps: the case is about the GPU table, not sizes */
    CHECK(wait_child(spawn(other_limits_child, 0, NULL)) == 0, "first process");
    gpu_line g2[1] = {{1, 10 * MiB, 100}};
    setup_limits(g2, 1); /* same region path, different GPU */
    int saved = redirect_stderr(tpath("stderr"));
    int rc = wait_child(spawn(other_limits_child, 0, NULL));
    dup2(saved, 2);
    CHECK(rc == 1, "allocation allowed against a foreign region");
    CHECK(strstr(read_text(tpath("stderr")), "region gpu 0 is") != NULL, "log: %s",
          read_text(tpath("stderr")));
}
