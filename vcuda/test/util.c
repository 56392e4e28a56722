#define _GNU_SOURCE
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

const char *tmpdir(void) {
    static char dir[4096];
    if (dir[0])
        return dir;
    const char *e = getenv("VCUDA_TEST_TMP");
    if (e && *e) {
        snprintf(dir, sizeof(dir), "%s", e);
        mkdir(dir, 0700);
    } else {
        snprintf(dir, sizeof(dir), "/tmp/vcuda-test-XXXXXX");
        CHECK(mkdtemp(dir) != NULL, "mkdtemp: %s", strerror(errno));
    }
    return dir;
}

const char *tpath(const char *name) {
    static char buf[8][4096];
    static int i;
    char *b = buf[i++ % 8];
    snprintf(b, 4096, "%s/%s", tmpdir(), name);
    return b;
}

void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    CHECK(f != NULL, "open %s: %s", path, strerror(errno));
    fputs(text, f);
    fclose(f);
}

char *read_text(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f)
        return strdup("");
    static char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    buf[n] = '\0';
    fclose(f);
    return strdup(buf);
}

const char *fake_uuid(int i) {
    static char buf[16][64];
    snprintf(buf[i], 64, "GPU-%08x-0000-4000-8000-%012x", 0xfa4e0000u + (unsigned)i, i);
    return buf[i];
}

const char *setup_limits(const gpu_line *gpus, int n) {
    char text[8192];
    int off = snprintf(text, sizeof(text),
                       "# written by the vcuda tests\ntessera-vcuda-limits 1\ncontainer test-%d\n"
                       "region %s\n",
                       (int)getpid(), tpath("region"));
    for (int i = 0; i < n; i++)
        off += snprintf(text + off, sizeof(text) - (size_t)off, "gpu %s %llu %d\n",
                        fake_uuid(gpus[i].dev), (unsigned long long)gpus[i].cap,
                        gpus[i].cores ? gpus[i].cores : 100);
    const char *p = tpath("limits");
    write_file(p, text);
    setenv("TESSERA_VCUDA_LIMITS", p, 1);
    setenv("FAKE_CUDA_SHM", tpath("fake-shm"), 1);
    return p;
}

static vc_region_hdr *region;
vc_region_hdr *region_map(void) {
    if (region)
        return region;
    int fd = open(tpath("region"), O_RDONLY);
    if (fd < 0 && errno == ENOENT)
        return NULL; /* no process has used CUDA yet */
    CHECK(fd >= 0, "open region: %s", strerror(errno));
    void *m = mmap(NULL, VC_REGION_SIZE, PROT_READ, MAP_SHARED, fd, 0);
    CHECK(m != MAP_FAILED, "mmap region: %s", strerror(errno));
    close(fd);
    region = m;
    CHECK(region->magic == VC_REGION_MAGIC, "bad region magic");
    return region;
}

uint64_t region_used(int g) {
    if (!region_map())
        return 0;
    vc_region_gpu *gp = (vc_region_gpu *)((char *)region_map() + VC_REGION_GPU_OFFSET) + g;
    return atomic_load(&gp->used) & ~VC_FROZEN;
}

int region_live_slots(void) {
    if (!region_map())
        return 0;
    vc_region_slot *s = (vc_region_slot *)((char *)region_map() + VC_REGION_SLOT_OFFSET);
    int n = 0;
    for (int i = 0; i < VC_MAX_SLOTS; i++)
        n += atomic_load(&s[i].pid) != 0;
    return n;
}

void ctx_costs_nothing(void) { setenv("FAKE_CUDA_CTX_BYTES", "0", 1); }

unsigned char *fake_fatbin(uint64_t payload, uint64_t globals, int n, uint64_t code) {
    unsigned char *b = calloc(1, 16 + payload);
    CHECK(b != NULL, "no memory for a %llu-byte image", (unsigned long long)payload);
    uint32_t magic = 0xba55ed50u; /* fatbin: u32 magic, u16 version, u16 header size, u64 payload */
    uint16_t version = 1, hs = 16;
    uint64_t nfn = (uint64_t)n;
    memcpy(b, &magic, 4);
    memcpy(b + 4, &version, 2);
    memcpy(b + 6, &hs, 2);
    memcpy(b + 8, &payload, 8);
    unsigned char *p = b + 16;
    memcpy(p, "FAKEFNS", 8);
    memcpy(p + 8, &globals, 8);
    memcpy(p + 16, &nfn, 8);
    for (int i = 0; i < n; i++) {
        snprintf((char *)p + 24 + i * 32, 24, "k%d", i + 1);
        memcpy(p + 24 + i * 32 + 24, &code, 8);
    }
    return b;
}

CUresult cuInit(unsigned);
CUresult cuCtxCreate_v2(CUcontext *, unsigned, CUdevice);
CUcontext ctx_on(int d) {
    CUcontext c;
    CHECK_CU(cuInit(0));
    CHECK_CU(cuCtxCreate_v2(&c, 0, d));
    return c;
}

void prctl_die_with_parent(void) { prctl(PR_SET_PDEATHSIG, SIGKILL); }

/* The children this process spawned and has not reaped yet. */
#define MAX_KIDS 256
static struct {
    pid_t pid;
    const char *name;
    int i;
} kids[MAX_KIDS];
static int nkids;

pid_t spawn_named(child_fn fn, int i, void *arg, const char *name) {
    fflush(NULL);
    CHECK(nkids < MAX_KIDS, "more than %d children", MAX_KIDS);
    pid_t parent = getpid();
    pid_t p = fork();
    CHECK(p >= 0, "fork: %s", strerror(errno));
    if (p == 0) {
        /* A child never outlives a failed parent: the harness would wait
         * for its pipes to close until its timeout. */
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent)
            _exit(99);
        nkids = 0; /* its parent's children are not its own */
        int rc = fn(i, arg);
        fflush(NULL);
        exit(rc);
    }
    kids[nkids].pid = p;
    kids[nkids].name = name;
    kids[nkids].i = i;
    nkids++;
    return p;
}

int wait_child(pid_t pid) {
    int st;
    while (waitpid(pid, &st, 0) < 0)
        CHECK(errno == EINTR, "waitpid: %s", strerror(errno));
    for (int k = 0; k < nkids; k++)
        if (kids[k].pid == pid)
            kids[k] = kids[--nkids];
    if (WIFSIGNALED(st))
        return 128 + WTERMSIG(st);
    return WEXITSTATUS(st);
}

/* Whether a spawned child has exited (any child when any_exit, else one
 * that failed or was killed): if so, describes it in how (left unreaped). */
static int child_ended(int any_exit, char *how, size_t len) {
    for (int k = 0; k < nkids; k++) {
        siginfo_t si = {0};
        if (waitid(P_PID, (id_t)kids[k].pid, &si, WEXITED | WNOHANG | WNOWAIT) != 0 || si.si_pid == 0)
            continue;
        if (!any_exit && si.si_code == CLD_EXITED && si.si_status == 0)
            continue;
        int off = snprintf(how, len, "child %s(%d), pid %d, ", kids[k].name, kids[k].i, (int)kids[k].pid);
        if (si.si_code == CLD_EXITED)
            snprintf(how + off, len - (size_t)off, "exited with status %d", si.si_status);
        else
            snprintf(how + off, len - (size_t)off, "was killed by signal %d (%s)", si.si_status,
                     strsignal(si.si_status));
        return 1;
    }
    return 0;
}

static void fail_child_ended(const char *how, const char *waiting_for) {
    fprintf(stderr, "FAIL case %s: %s while the parent waited for %s\n",
            current_test_name ? current_test_name : "?", how, waiting_for);
    exit(1);
}

void wait_for_file(const char *path, double timeout_s) {
    uint64_t end = now_ns() + (uint64_t)(timeout_s * 1e9);
    char how[256];
    while (access(path, F_OK) != 0) {
        /* checked again after the child is seen gone: it may have made
         * the file just before it exited */
        if (child_ended(0, how, sizeof(how)) && access(path, F_OK) != 0)
            fail_child_ended(how, path);
        CHECK(now_ns() < end, "timed out waiting for %s", path);
        usleep(1000);
    }
}

void chan_init(chan *c) {
    CHECK(pipe(c->up) == 0 && pipe(c->down) == 0, "pipe");
}
static void wr(int fd, uint64_t v) { CHECK(write(fd, &v, 8) == 8, "pipe write"); }
static uint64_t rd(int fd) {
    /* Wakes up now and then to look at the children: a sibling that
     * inherited this pipe's write end keeps it open after its writer died. */
    struct pollfd p = {.fd = fd, .events = POLLIN};
    char how[256];
    for (;;) {
        int n = poll(&p, 1, 50);
        if (n > 0)
            break;
        CHECK(n == 0 || errno == EINTR, "poll: %s", strerror(errno));
        /* polled again after the child is seen gone: it may have sent
         * just before it exited */
        if (n == 0 && child_ended(0, how, sizeof(how)) && poll(&p, 1, 0) == 0)
            fail_child_ended(how, "a message on a pipe");
    }
    uint64_t v;
    ssize_t got = read(fd, &v, 8);
    if (got == 0) {
        /* Every writer is gone: say which child, once it can be waited for
         * (a child closes its files just before it becomes waitable); for
         * 0.2 s only one that failed, then also one that merely exited. */
        uint64_t t0 = now_ns();
        for (uint64_t t = t0; t < t0 + 2000000000ull; usleep(1000), t = now_ns())
            if (child_ended(0, how, sizeof(how)) || (t > t0 + 200000000ull && child_ended(1, how, sizeof(how))))
                fail_child_ended(how, "a message on a pipe (every writer closed it without sending)");
        CHECK(0, "every writer closed the pipe without sending, and no child exited");
    }
    CHECK(got == 8, "pipe read: %zd bytes: %s", got, strerror(errno));
    return v;
}
void chan_send_up(chan *c, uint64_t v) { wr(c->up[1], v); }
uint64_t chan_recv_up(chan *c) {
    if (c->up[1] >= 0) {
        close(c->up[1]);
        c->up[1] = -1;
    }
    return rd(c->up[0]);
}
void chan_send_down(chan *c, uint64_t v) { wr(c->down[1], v); }
uint64_t chan_recv_down(chan *c) { return rd(c->down[0]); }

/* ---- registry and main ---- */

#define MAX_TESTS 256
static struct {
    const char *name;
    test_fn fn;
    const char *lib;
} tests[MAX_TESTS];
static int ntests;

void register_test_lib(const char *name, test_fn fn, const char *lib) {
    if (ntests < MAX_TESTS) {
        tests[ntests].name = name;
        tests[ntests].fn = fn;
        tests[ntests].lib = lib;
        ntests++;
    }
}

const char *current_test_name;
int test_main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "--list") == 0) {
        for (int i = 0; i < ntests; i++)
            printf("%s\t%s\n", tests[i].name, tests[i].lib);
        return 0;
    }
    if (argc != 2) {
        fprintf(stderr, "usage: %s --list | <case>\n", argv[0]);
        return 2;
    }
    for (int i = 0; i < ntests; i++) {
        if (strcmp(tests[i].name, argv[1]) == 0) {
            current_test_name = tests[i].name;
            tests[i].fn();
            printf("PASS %s\n", argv[1]);
            return 0;
        }
    }
    fprintf(stderr, "unknown case %s\n", argv[1]);
    return 2;
}

int redirect_stderr(const char *path) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    CHECK(fd >= 0, "open %s", path);
    int saved = dup(2);
    dup2(fd, 2);
    close(fd);
    return saved;
}
