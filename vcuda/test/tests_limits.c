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

/* The node agent's measured compute file (the contract's golden example,
 * byte for byte, then every way off spec). */
#define MU "GPU-8f3c1a2e-0b4d-4e6f-9a1b-2c3d4e5f6a7b"
#define MU2 "GPU-8f3c1a2e-0b4d-4e6f-9a1b-2c3d4e5f6a7c"
#define MHDR "tessera-compute-measured 1\nwritten 123456789000\n"
static const char measured_uuids[2][VC_UUID_LEN + 1] = {MU, MU2};
static int mparse(const char *text, uint64_t pid, uint64_t start, vc_measured_line out[2], char *err) {
    uint64_t written;
    return vc_measured_parse(text, strlen(text), pid, start, measured_uuids, 2, &written, out, err, 256);
}
TEST(limits_measured_parse_valid) {
    vc_measured_line m[2];
    char err[256];
    uint64_t written = 0;
    const char *golden = "tessera-compute-measured 1\n"
                         "written 123456789000\n"
                         "gpu GPU-8f3c1a2e-0b4d-4e6f-9a1b-2c3d4e5f6a7b pid 42 start 98765 busy 1500000 at 123400000000\n";
    CHECK(vc_measured_parse(golden, strlen(golden), 42, 98765, measured_uuids, 2, &written, m, err, sizeof(err)) == 0,
          "golden example: %s", err);
    CHECK(written == 123456789000ull, "written %llu", (unsigned long long)written);
    CHECK(m[0].found && m[0].busy == 1500000 && m[0].at == 123400000000ull, "golden line %d %llu %llu", m[0].found,
          (unsigned long long)m[0].busy, (unsigned long long)m[0].at);
    CHECK(!m[1].found, "a GPU the file does not name");
    /* another process's line (same pid, another start: a reused pid; or
     * another pid) is not ours */
    CHECK(mparse(golden, 42, 98766, m, err) == 0 && !m[0].found, "a line of another start taken: %s", err);
    CHECK(mparse(golden, 43, 98765, m, err) == 0 && !m[0].found, "a line of another pid taken: %s", err);
    /* ours among others, on two GPUs; zeros and UINT64_MAX */
    const char *t = MHDR "gpu " MU " pid 42 start 1 busy 5 at 6\n"
                         "gpu " MU " pid 7 start 98765 busy 9 at 9\n"
                         "gpu " MU2 " pid 42 start 98765 busy 0 at 18446744073709551615\n"
                         "gpu " MU " pid 42 start 98765 busy 10 at 20\n";
    CHECK(mparse(t, 42, 98765, m, err) == 0, "%s", err);
    CHECK(m[0].found && m[0].busy == 10 && m[0].at == 20, "gpu 0: %llu at %llu", (unsigned long long)m[0].busy,
          (unsigned long long)m[0].at);
    CHECK(m[1].found && m[1].busy == 0 && m[1].at == UINT64_MAX, "gpu 1");
    /* no process sampled yet: header and written only */
    CHECK(mparse(MHDR, 42, 98765, m, err) == 0 && !m[0].found && !m[1].found, "%s", err);
    /* as many lines as 256 KiB holds (about 3600: the byte bound binds
     * before the 4096-line one, which the parser keeps all the same) */
    static char big[VC_MEASURED_MAX_BYTES + 128];
    size_t off = (size_t)snprintf(big, sizeof(big), MHDR);
    for (int i = 0;; i++) {
        char l[128];
        size_t k = (size_t)snprintf(l, sizeof(l), "gpu " MU " pid %d start 1 busy 1 at 1\n", i + 100);
        if (off + k > VC_MEASURED_MAX_BYTES)
            break;
        memcpy(big + off, l, k + 1);
        off += k;
    }
    uint64_t w;
    CHECK(vc_measured_parse(big, off, 42, 98765, measured_uuids, 2, &w, m, err, sizeof(err)) == 0, "%zu bytes: %s",
          off, err);
    /* one more line: over the bound */
    off += (size_t)snprintf(big + off, sizeof(big) - off, "gpu " MU " pid 42 start 98765 busy 1 at 1\n");
    CHECK(vc_measured_parse(big, off, 42, 98765, measured_uuids, 2, &w, m, err, sizeof(err)) != 0 &&
              strstr(err, "larger than") && !m[0].found,
          "%zu bytes: %s", off, err);
}

TEST(limits_measured_parse_malformed) {
    static const struct {
        const char *text;
        const char *want;
    } bad[] = {
        {"", "line 0: expected header"},
        {"tessera-compute-measured 1\n", "line 1: expected header and"},
        {"tessera-compute-measured 2\nwritten 1\n", "line 1: expected header"},
        {"tessera-compute-measured 1 \nwritten 1\n", "line 1: empty field"},
        {"tessera-compute-measured 1\nwritten 1", "line 2: no newline at the end"},
        {"tessera-compute-measured 1\r\nwritten 1\n", "line 1: non-ASCII or control"},
        {"tessera-compute-measured 1\nwritten 01\n", "line 2: expected \"written"},
        {"tessera-compute-measured 1\nwritten -1\n", "line 2: expected \"written"},
        {"tessera-compute-measured 1\nwritten 18446744073709551616\n", "line 2: expected \"written"},
        {"tessera-compute-measured 1\ngpu " MU " pid 42 start 1 busy 1 at 1\n", "line 2: expected \"written"},
        {MHDR "written 5\n", "line 3: expected \"gpu"},
        {MHDR "\n", "line 3: empty field"},
        {MHDR "gpu " MU " pid 42 start 1 busy 1 at 1 x\n", "line 3: extra field"},
        {MHDR "gpu " MU " pid 42 start 1 busy 1\n", "line 3: expected \"gpu"},
        {MHDR "gpu " MU " pid 42 start 1 busy 1 at\n", "line 3: expected \"gpu"},
        {MHDR "gpu " MU " pid 42 start 1 busy 1 at  1\n", "line 3: extra field"},
        {MHDR "gpu " MU " pid 42 start 1 busy  at 1\n", "line 3: empty field"},
        {MHDR "gpu " MU " pid 42 start 1 busy 1\tat 1\n", "line 3: non-ASCII or control"},
        {MHDR "gpu " MU " pid 42 begin 1 busy 1 at 1\n", "line 3: expected \"gpu"},
        {MHDR "gpu GPU-8F3C1A2E-0B4D-4E6F-9A1B-2C3D4E5F6A7B pid 42 start 1 busy 1 at 1\n", "line 3: gpu: bad uuid"},
        {MHDR "gpu GPU-8f3c pid 42 start 1 busy 1 at 1\n", "line 3: gpu: bad uuid"},
        {MHDR "gpu " MU " pid 042 start 1 busy 1 at 1\n", "line 3: gpu: numbers"},
        {MHDR "gpu " MU " pid 42 start +1 busy 1 at 1\n", "line 3: gpu: numbers"},
        {MHDR "gpu " MU " pid 42 start 1 busy 1.5 at 1\n", "line 3: gpu: numbers"},
        {MHDR "gpu " MU " pid 42 start 1 busy 1 at 18446744073709551616\n", "line 3: gpu: numbers"},
        {MHDR "gpu " MU " pid 42 start 98765 busy 1 at 1\ngpu " MU " pid 42 start 98765 busy 2 at 2\n",
         "line 4: gpu " MU " pid 42 start 98765 given twice"},
        /* off spec anywhere, even in a line not ours, and after ours */
        {MHDR "gpu " MU " pid 42 start 98765 busy 1 at 1\ngpu " MU " pid 7 start 1 busy x at 1\n", "line 4: gpu: numbers"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        vc_measured_line m[2];
        char err[256] = "";
        CHECK(mparse(bad[i].text, 42, 98765, m, err) != 0, "case %zu accepted", i);
        CHECK(strstr(err, bad[i].want) == err, "case %zu: error %s, want %s", i, err, bad[i].want);
        CHECK(!m[0].found && !m[1].found, "case %zu: a line returned from a rejected file", i);
    }
}
