/*
 * fake_cuda.c - a stand-in for libcuda.so.1 so that vcuda's real
 * interception path (symbol interposition, dlsym, cuGetProcAddress) runs in
 * CI without a GPU. See fake.h for the model and its configuration.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fake.h"
#include "fake_device_model.h"

#define EXPORT __attribute__((visibility("default")))

/* Busy time as the union of kernel intervals (what "utilisation" means: the
 * share of time at least one kernel ran). Intervals that ended before the
 * latest insert are folded into `done`; the rest are kept sorted. */
#define NIV 1024 /* a process can have this many kernels queued ahead between other processes' */
typedef struct {
    uint64_t done;
    int n;
    uint64_t s[NIV], e[NIV];
} ivset;
typedef struct {
    _Atomic uint64_t used, peak, mapped, busy_until, busy_total, launches, switches;
    _Atomic int lock;       /* guards the scheduling fields below */
    int last_pid;           /* process whose work was queued last */
    uint64_t excl_until;    /* end of the last kernel that filled the device */
    ivset busy;
    struct ts_dev {         /* the timeslice scheduler (FAKE_CUDA_SCHED=timeslice) */
        int owner;          /* process slot + 1 whose context has (or last had) the device; 0 none */
        int idle;           /* no context had work at t */
        uint64_t t;         /* resolved up to this real time */
        uint64_t slice_start;
        uint64_t last_end;  /* real end of the last service: a switch to another context runs from here */
        uint64_t busy;      /* real ns any context was served */
        uint64_t reg[FAKE_MAX_PROCS / 64]; /* process slots with an entry on this device */
    } ts;
} shared_dev;
/* One process's service on one device under the timeslice scheduler: its
 * work is settled at submission on its own virtual timeline (ns of its own
 * service, no gaps), and segments map that to the real time it ran. */
#define TS_NSEG 1024
typedef struct {
    uint64_t rs, re, vs; /* real [rs, re) ran virtual [vs, vs + re - rs) */
} ts_seg;
typedef struct {
    int pid;          /* whose entry (a reused slot starts afresh) */
    int want;         /* zero-length work waits at `served` for the device (an event of an idle context) */
    uint64_t served;  /* virtual ns served so far */
    uint64_t backlog; /* end of its queued work, virtual */
    uint64_t excl;    /* end of its last device-filling kernel, virtual */
    uint64_t busy;    /* real ns served */
    uint32_t nseg, head;
    ts_seg seg[TS_NSEG]; /* ring, oldest first from head - nseg */
} ts_proc;
/* The driver's per-process accounting (what NVML's process list shows). */
typedef struct {
    _Atomic int pid;
    int pad;
    _Atomic uint64_t used[FAKE_MAX_DEVS];
    _Atomic int ctxs[FAKE_MAX_DEVS]; /* live contexts: NVML lists the process even without memory */
    ivset busy[FAKE_MAX_DEVS]; /* this process's kernels (under the device lock) */
    ts_proc ts[FAKE_MAX_DEVS]; /* under the device lock */
} shared_proc;
typedef struct {
    shared_dev dev[FAKE_MAX_DEVS];
    shared_proc proc[FAKE_MAX_PROCS];
} shared_state;

static struct {
    int ndev;
    uint64_t mem[FAKE_MAX_DEVS];
    int sms[FAKE_MAX_DEVS];
    char uuid[FAKE_MAX_DEVS][64];
    char name[FAKE_MAX_DEVS][96];
    int minor[FAKE_MAX_DEVS], cc[FAKE_MAX_DEVS][2];
    unsigned char raw[FAKE_MAX_DEVS][16];
    int node_mode;  /* devices from the node file */
    int ctl_ok;     /* the control device exists: the driver is "loaded" */
    char version[32];
    int cuda_version;
    uint64_t wave_ns, overhead_ns;
    int ctx_bytes_set;  /* FAKE_CUDA_CTX_BYTES given: every context takes ctx_bytes */
    uint64_t ctx_bytes;
    int eager_modules;  /* CUDA_MODULE_LOADING=EAGER (default LAZY, as CUDA 12.2+) */
    shared_state *sh;
    _Atomic int inited; /* cuInit succeeded */
    const char *block_path;
    long block_after;
    _Atomic long allocs;
    _Atomic uint64_t next_addr;
    int ts_on;          /* FAKE_CUDA_SCHED=timeslice */
    uint64_t slice_ns;  /* FAKE_CUDA_TIMESLICE_NS */
} F;

static pthread_once_t F_once = PTHREAD_ONCE_INIT;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#define PAGE2M (2ull << 20)
#define FAKE_THREADS_PER_SM 2048 /* resident threads an SM holds (Hopper) */
static uint64_t round_up(uint64_t x, uint64_t a) {
    return x > UINT64_MAX - (a - 1) ? UINT64_MAX / a * a : (x + a - 1) / a * a;
}

static void sleep_until(uint64_t t) {
    for (;;) {
        uint64_t n = now_ns();
        if (n >= t)
            return;
        struct timespec ts = {(time_t)((t - n) / 1000000000ull), (long)((t - n) % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
}

static void list_u64(const char *env, uint64_t def, uint64_t *out, int n) {
    const char *s = getenv(env);
    uint64_t last = def;
    for (int i = 0; i < n; i++) {
        if (s && *s) {
            char *end;
            last = strtoull(s, &end, 10);
            s = *end == ',' ? end + 1 : end;
        }
        out[i] = last;
    }
}

static int parse_uuid(const char *s, unsigned char raw[16]) {
    if (strncmp(s, "GPU-", 4) != 0 && strncmp(s, "MIG-", 4) != 0)
        return -1;
    s += 4;
    for (int i = 0; i < 16; i++) {
        if (*s == '-')
            s++;
        unsigned v;
        if (sscanf(s, "%2x", &v) != 1)
            return -1;
        raw[i] = (unsigned char)v;
        s += 2;
    }
    return 0;
}

static int is_chr(const char *root, const char *name) {
    char p[4096];
    struct stat st;
    snprintf(p, sizeof(p), "%s/%s", root, name);
    return stat(p, &st) == 0 && S_ISCHR(st.st_mode);
}

/* Node-file mode: the GPUs of the simulated node, visible where their
 * device nodes are, as the real driver enumerates what /dev exposes.
 *
 * A GPU in MIG mode (one with "mig" lines) is no CUDA device itself: CUDA
 * sees its MIG devices, each visible where the parent's node and both of
 * its capability nodes (nvidia-caps/nvidia-cap<GI>, <CI>) are, as a device
 * of the instance's memory and SMs under its MIG UUID. As the real driver
 * (R450 to R580 at least) a process enumerates one MIG device at most: the
 * first visible, in the parents' minor order, then the file's. */
#define NODE_MAX_LINES 64
typedef struct {
    unsigned minor;
    char uuid[64];
    unsigned long long mem;
    int sms, ccmaj, ccmin;
    char name[96];
} node_gpu;
typedef struct {
    unsigned parent, gi, ci;
    char uuid[64];
    unsigned long long mem;
    int sms;
    char profile[32];
} node_mig;

static void add_node_dev(unsigned minor, const char *uuid, uint64_t mem, int sms, int ccmaj, int ccmin,
                         const char *name) {
    int i = F.ndev++;
    F.minor[i] = (int)minor;
    F.mem[i] = mem;
    F.sms[i] = sms;
    F.cc[i][0] = ccmaj;
    F.cc[i][1] = ccmin;
    snprintf(F.uuid[i], 64, "%s", uuid);
    snprintf(F.name[i], 96, "%s", name);
    parse_uuid(F.uuid[i], F.raw[i]);
}

/* NVML's view of the node: the physical GPUs whose node is visible, a GPU in
 * MIG mode included with its whole memory (nvmlDeviceGetCount counts it;
 * CUDA does not), then the MIG devices CUDA sees, reachable by UUID alone
 * (nvmlDeviceGetHandleByUUID), as a real driver hands out MIG device handles
 * that no index enumerates. Each shares the state of the CUDA device on the
 * same GPU (cuda): work on an instance is charged to its GPU, as the real
 * driver's figures for the GPU cover all its instances. */
#define NV_MAX (2 * FAKE_MAX_DEVS)
static struct {
    int n;    /* physical GPUs: what nvmlDeviceGetCount answers */
    int nall; /* and MIG device handles after them */
    fake_desc d[NV_MAX];
    int cuda[NV_MAX]; /* the CUDA ordinal on the same GPU, -1 none */
    int mode[NV_MAX]; /* FAKE_NVML_GPU, FAKE_NVML_MIG_PARENT, FAKE_NVML_MIG_DEVICE */
} NV;

static void nv_add(int at, unsigned minor, const char *uuid, uint64_t mem, int sms, int ccmaj, int ccmin,
                   const char *name, int cuda, int mode) {
    fake_desc *x = &NV.d[at];
    memset(x, 0, sizeof(*x));
    snprintf(x->uuid, sizeof(x->uuid), "%s", uuid);
    snprintf(x->name, sizeof(x->name), "%s", name);
    x->mem = mem;
    x->sms = sms;
    x->minor = (int)minor;
    x->cc_major = ccmaj;
    x->cc_minor = ccmin;
    NV.cuda[at] = cuda;
    NV.mode[at] = mode;
}

static void load_node_file(void) {
    const char *path = getenv("FAKE_GPU_NODE_FILE");
    const char *root = getenv("FAKE_DEV_ROOT");
    if (!path || !*path)
        path = FAKE_NODE_FILE_DEFAULT;
    if (!root || !*root)
        root = "/dev";
    F.node_mode = 1;
    F.ctl_ok = is_chr(root, "nvidiactl");
    F.ndev = 0;
    FILE *f = fopen(path, "re");
    if (!f)
        return;
    static node_gpu gl[NODE_MAX_LINES];
    static node_mig ml[NODE_MAX_LINES];
    int ng = 0, nm = 0;
    char line[512];
    while (fgets(line, sizeof(line), f)) {
        char *h = strchr(line, '#');
        if (h)
            *h = '\0';
        node_mig m;
        if (sscanf(line, " mig %u %63s %u %u %llu %d %31s", &m.parent, m.uuid, &m.gi, &m.ci, &m.mem, &m.sms,
                   m.profile) == 7) {
            if (m.sms > 0 && m.mem > 0 && strncmp(m.uuid, "MIG-", 4) == 0 && nm < NODE_MAX_LINES)
                ml[nm++] = m;
            continue; /* malformed: the node has no such instance */
        }
        node_gpu g;
        int off = 0;
        if (sscanf(line, " %u %63s %llu %d %d.%d %n", &g.minor, g.uuid, &g.mem, &g.sms, &g.ccmaj, &g.ccmin, &off) !=
                6 ||
            g.sms <= 0 || g.mem == 0 || ng >= NODE_MAX_LINES)
            continue; /* blank, comment or malformed: the node has no such GPU */
        char *name = line + off;
        size_t n = strlen(name);
        while (n && (name[n - 1] == '\n' || name[n - 1] == ' ' || name[n - 1] == '\t' || name[n - 1] == '\r'))
            name[--n] = '\0';
        snprintf(g.name, sizeof(g.name), "%s", *name ? name : "NVIDIA GPU");
        /* insert in minor order */
        int i = ng++;
        while (i > 0 && gl[i - 1].minor > g.minor) {
            gl[i] = gl[i - 1];
            i--;
        }
        gl[i] = g;
    }
    fclose(f);
    int mig_seen = 0, mig_at = -1;
    for (int i = 0; i < ng && F.ndev < FAKE_MAX_DEVS; i++) {
        node_gpu *g = &gl[i];
        char dn[32];
        snprintf(dn, sizeof(dn), "nvidia%u", g->minor);
        if (!F.ctl_ok || !is_chr(root, dn))
            continue;
        int phys = NV.n++, cuda_before = F.ndev;
        nv_add(phys, g->minor, g->uuid, g->mem, g->sms, g->ccmaj, g->ccmin, g->name, -1, FAKE_NVML_GPU);
        int mig_mode = 0;
        for (int j = 0; j < nm; j++) {
            node_mig *m = &ml[j];
            if (m->parent != g->minor)
                continue;
            mig_mode = 1;
            char gi[48], ci[48];
            snprintf(gi, sizeof(gi), "nvidia-caps/nvidia-cap%u", m->gi);
            snprintf(ci, sizeof(ci), "nvidia-caps/nvidia-cap%u", m->ci);
            /* an instance larger than its GPU is no instance of it */
            if (mig_seen || m->mem > g->mem || m->sms > g->sms || !is_chr(root, gi) || !is_chr(root, ci))
                continue;
            char name[96];
            snprintf(name, sizeof(name), "%s MIG %s", g->name, m->profile);
            add_node_dev(g->minor, m->uuid, m->mem, m->sms, g->ccmaj, g->ccmin, name);
            mig_seen = 1;
            mig_at = j;
        }
        if (!mig_mode)
            add_node_dev(g->minor, g->uuid, g->mem, g->sms, g->ccmaj, g->ccmin, g->name);
        if (mig_mode)
            NV.mode[phys] = FAKE_NVML_MIG_PARENT;
        if (F.ndev > cuda_before)
            NV.cuda[phys] = cuda_before;
    }
    NV.nall = NV.n;
    for (int i = 0; i < NV.n && mig_at >= 0; i++) {
        node_mig *m = &ml[mig_at];
        if (NV.mode[i] != FAKE_NVML_MIG_PARENT || (unsigned)NV.d[i].minor != m->parent || NV.cuda[i] < 0)
            continue;
        int c = NV.cuda[i];
        nv_add(NV.nall++, m->parent, m->uuid, m->mem, m->sms, F.cc[c][0], F.cc[c][1], F.name[c], c,
               FAKE_NVML_MIG_DEVICE);
    }
}

/* getpid() is a system call; the fake's hot paths use a cached copy,
 * refreshed in a forked child. */
static pid_t cached_pid;
static void refresh_pid(void) { cached_pid = getpid(); }
static pid_t fake_pid(void) { return cached_pid ? cached_pid : getpid(); }

static void init(void) {
    refresh_pid();
    pthread_atfork(NULL, NULL, refresh_pid);
    const char *e = getenv("FAKE_DRIVER_VERSION");
    snprintf(F.version, sizeof(F.version), "%s", e && *e ? e : FAKE_DRIVER_VERSION_DEFAULT);
    /* The CUDA version a driver branch supports (r580: 13.0, r570: 12.8, ...). */
    int major = atoi(F.version);
    F.cuda_version = major >= 580 ? 13000 : major >= 575 ? 12090 : major >= 570 ? 12080
                   : major >= 560 ? 12060 : major >= 550 ? 12040 : 12000;
    e = getenv("FAKE_CUDA_DEVICES");
    if (!e) {
        load_node_file();
    } else {
        F.ctl_ok = 1;
        F.ndev = atoi(e);
        if (F.ndev < 0)
            F.ndev = 0;
        if (F.ndev > FAKE_MAX_DEVS)
            F.ndev = FAKE_MAX_DEVS;
        list_u64("FAKE_CUDA_MEM", 16ull << 30, F.mem, FAKE_MAX_DEVS);
        uint64_t sms[FAKE_MAX_DEVS];
        list_u64("FAKE_CUDA_SMS", 16, sms, FAKE_MAX_DEVS);
        const char *u = getenv("FAKE_CUDA_UUIDS");
        for (int i = 0; i < FAKE_MAX_DEVS; i++) {
            F.sms[i] = sms[i] ? (int)sms[i] : 1;
            F.minor[i] = i;
            F.cc[i][0] = 9;
            F.cc[i][1] = 0;
            snprintf(F.name[i], 96, "Fake GPU %d", i);
            snprintf(F.uuid[i], 64, "GPU-%08x-0000-4000-8000-%012x", 0xfa4e0000u + (unsigned)i, i);
            if (u && *u) {
                const char *c = strchr(u, ',');
                size_t n = c ? (size_t)(c - u) : strlen(u);
                if (n < 64) {
                    memcpy(F.uuid[i], u, n);
                    F.uuid[i][n] = '\0';
                }
                u = c ? c + 1 : u + n;
            }
            parse_uuid(F.uuid[i], F.raw[i]);
        }
        for (int i = 0; i < F.ndev; i++)
            nv_add(i, (unsigned)F.minor[i], F.uuid[i], F.mem[i], F.sms[i], F.cc[i][0], F.cc[i][1], F.name[i], i,
                   FAKE_NVML_GPU);
        NV.n = NV.nall = F.ndev;
    }
    e = getenv("FAKE_CUDA_WAVE_NS");
    F.wave_ns = e ? strtoull(e, NULL, 10) : 100000;
    if (F.wave_ns == 0)
        F.wave_ns = 1;
    e = getenv("FAKE_CUDA_CTX_BYTES");
    F.ctx_bytes_set = e && *e;
    F.ctx_bytes = F.ctx_bytes_set ? strtoull(e, NULL, 10) : 0;
    e = getenv("CUDA_MODULE_LOADING");
    F.eager_modules = e && strcmp(e, "EAGER") == 0;
    e = getenv("FAKE_CUDA_LAUNCH_NS");
    F.overhead_ns = e ? strtoull(e, NULL, 10) : 0;
    F.block_path = getenv("FAKE_CUDA_BLOCK_ALLOC");
    e = getenv("FAKE_CUDA_BLOCK_AFTER");
    F.block_after = e ? atol(e) : 0;
    atomic_store(&F.next_addr, 0x100000000000ull);
    /* How the device serves processes (the "device timeline" section):
     * timeslice (round-robin contexts with work, a slice each, as a GPU
     * without MPS; the default: the whole suite passes on it), or fifo (a
     * process's work behind all another queued before it; for comparison).
     * Anything else is a typo that would measure the wrong device: refused. */
    e = getenv("FAKE_CUDA_SCHED");
    if (e && strcmp(e, "fifo") == 0) {
        F.ts_on = 0;
    } else if (!e || !*e || strcmp(e, "timeslice") == 0) {
        F.ts_on = 1;
    } else {
        fprintf(stderr, "fake libcuda: FAKE_CUDA_SCHED=%s: want fifo or timeslice\n", e);
        abort();
    }
    /* 2 ms: the figure the sources give for a GPU's default (DRIVE OS: 2 ms
     * the upper bound for medium-priority channels, 1.5 ms for low; a third
     * party gives nvidia-smi compute-policy's short as 2 ms; vcuda/README.md,
     * "The timeslice model"). */
    e = getenv("FAKE_CUDA_TIMESLICE_NS");
    F.slice_ns = e && *e ? strtoull(e, NULL, 10) : 2000000;
    if (F.slice_ns == 0) {
        fprintf(stderr, "fake libcuda: FAKE_CUDA_TIMESLICE_NS=%s: want a positive number of ns\n", e);
        abort();
    }
    e = getenv("FAKE_CUDA_SHM");
    if (e && *e) {
        int fd = open(e, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
        if (fd >= 0 && ftruncate(fd, sizeof(shared_state)) == 0) {
            void *m = mmap(NULL, sizeof(shared_state), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (m != MAP_FAILED)
                F.sh = m;
        }
        if (fd >= 0)
            close(fd);
    }
    if (!F.sh)
        F.sh = calloc(1, sizeof(shared_state));
}
#define INIT() pthread_once(&F_once, init)

/* ---- contexts, streams ---- */

typedef struct fake_ctx {
    int dev;
    int refs;      /* primary contexts */
    uint64_t own;  /* the context's own device memory (ctx_cost) */
    int refs_proc; /* counted in the process's NVML entry */
    size_t lim[3]; /* stack, printf FIFO, malloc heap as set (0: the default) */
    uint64_t lim_mem[3]; /* device memory they take beyond the context's own */
} fake_ctx;
/* Stream capture, process-wide: captures in global mode in progress, and
 * each thread's capture mode (cuThreadExchangeStreamCaptureMode). */
static _Atomic int global_captures;
static _Atomic int capture_poisoned; /* bumped when an unsafe call invalidates them */
static void ctx_free_all(fake_ctx *c);
static void mods_forget_ctx(fake_ctx *c);
static fake_ctx primary[FAKE_MAX_DEVS];
#define TLS __thread __attribute__((tls_model("initial-exec")))
static TLS fake_ctx *cur;
static TLS fake_ctx *stack[16];
static TLS int depth;
static TLS int thread_capture_mode; /* 0 global (the default), 1 thread local, 2 relaxed */

/* A graph (CUgraph): the device memory its allocation nodes will take
 * when it runs (2 MiB pages each), and on which device. */
struct fake_graph_def {
    uint64_t mem;
    int dev;
    int moved; /* a child graph whose parent took it (ownership MOVE): the parent destroys it */
};
typedef struct fake_stream {
    fake_ctx *ctx;
    int capturing;
    int mode;       /* capture mode: 0 global, 1 thread local, 2 relaxed */
    int violations; /* event calls made on it while capturing */
    int poison0;    /* capture_poisoned when the capture began */
    _Atomic uint64_t until; /* when the work queued on it so far ends */
    struct fake_graph_def *graph; /* the graph being captured */
} fake_stream;
/* The per-thread default stream of each device (CU_STREAM_PER_THREAD, or
 * NULL through a _ptsz entry point): a stream like any other, which can be
 * captured; the legacy default stream (NULL, CU_STREAM_LEGACY) cannot. */
static TLS fake_stream *ptds[FAKE_MAX_DEVS];
static CUstream per_thread(CUstream s, int ptsz) {
    if (!((uintptr_t)s == 2 || (!s && ptsz)) || !cur)
        return s;
    fake_stream **x = &ptds[cur->dev];
    if (!*x) {
        *x = calloc(1, sizeof(**x));
        (*x)->ctx = cur;
    }
    return (CUstream)*x;
}
/* The legacy default stream of each device (per process). */
static _Atomic uint64_t null_until[FAKE_MAX_DEVS];

static int ctx_dev(void) { return cur ? cur->dev : -1; }

static int stream_dev(CUstream s) {
    if ((uintptr_t)s <= 2)
        return ctx_dev();
    return ((fake_stream *)s)->ctx->dev;
}

/* Like the real driver: no visible GPU (or no control device) is
 * CUDA_ERROR_NO_DEVICE, and device queries need a successful cuInit (in
 * node-file mode; the unit tests' environment mode is lenient there). */
EXPORT CUresult cuInit(unsigned flags) {
    INIT();
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (F.ndev == 0 || !F.ctl_ok)
        return CUDA_ERROR_NO_DEVICE;
    atomic_store(&F.inited, 1);
    return CUDA_SUCCESS;
}
#define NEED_INIT()                                                                                \
    do {                                                                                           \
        INIT();                                                                                    \
        if (F.node_mode && !atomic_load(&F.inited))                                                \
            return CUDA_ERROR_NOT_INITIALIZED;                                                     \
    } while (0)
EXPORT CUresult cuDriverGetVersion(int *v) {
    INIT();
    if (!v)
        return CUDA_ERROR_INVALID_VALUE;
    *v = F.cuda_version; /* works before cuInit, as on the real driver */
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetCount(int *n) {
    NEED_INIT();
    if (!n)
        return CUDA_ERROR_INVALID_VALUE;
    *n = F.ndev;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    NEED_INIT();
    if (!d || ordinal < 0 || ordinal >= F.ndev)
        return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}
#define CHECK_DEV(d)                                                                               \
    do {                                                                                           \
        NEED_INIT();                                                                               \
        if ((d) < 0 || (d) >= F.ndev)                                                              \
            return CUDA_ERROR_INVALID_DEVICE;                                                      \
    } while (0)
EXPORT CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d) {
    CHECK_DEV(d);
    if (!u)
        return CUDA_ERROR_INVALID_VALUE;
    memcpy(u->bytes, F.raw[d], 16);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d) { return cuDeviceGetUuid(u, d); }
EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    CHECK_DEV(d);
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "%s", F.name[d]);
    return CUDA_SUCCESS;
}
static int env_off(const char *name);
EXPORT CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
    CHECK_DEV(d);
    if (!v)
        return CUDA_ERROR_INVALID_VALUE;
    switch (attr) {
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = F.sms[d]; break;
    case 75 /* COMPUTE_CAPABILITY_MAJOR */: *v = F.cc[d][0]; break;
    case 76 /* COMPUTE_CAPABILITY_MINOR */: *v = F.cc[d][1]; break;
    case 33 /* PCI_BUS_ID */: *v = F.minor[d] + 1; break;
    case 39 /* MAX_THREADS_PER_MULTIPROCESSOR */: *v = FAKE_THREADS_PER_SM; break;
    /* mapped pinned memory (FAKE_CUDA_MAP_HOST=0: not), the NOR wait of the
     * v2 stream memory operations; the v1 ones (module parameter
     * NVreg_EnableStreamMemOPs) and 64-bit ones are not modelled: 0 */
    case 19 /* CAN_MAP_HOST_MEMORY */: *v = !env_off("FAKE_CUDA_MAP_HOST"); break;
    case 123 /* CAN_USE_STREAM_WAIT_VALUE_NOR(_V2) */: *v = !env_off("FAKE_CUDA_STREAM_MEMOPS"); break;
    default: *v = 0;
    }
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) {
    CHECK_DEV(d);
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    *bytes = F.mem[d];
    return CUDA_SUCCESS;
}
/* A context takes device memory of its own when it is created (the
 * driver's state, local memory for the default stack of every resident
 * thread, the printf FIFO...), given back when it goes with everything
 * allocated in it. As on a real GPU it is never free: by default the
 * rounded-up size of a CUDA 12 context with lazy loading for the device's
 * architecture (FAKE_CTX_BYTES_*, the figures vcuda's README gives);
 * FAKE_CUDA_CTX_BYTES replaces it (0 only for cases that need exact byte
 * arithmetic about something else). */
static uint64_t ctx_cost(int d) {
    if (F.ctx_bytes_set)
        return F.ctx_bytes;
    int major = F.cc[d][0];
    return major >= 9 ? FAKE_CTX_BYTES_SM90 : major == 8 ? FAKE_CTX_BYTES_SM80 : major == 7 ? FAKE_CTX_BYTES_SM70
                                                                                        : FAKE_CTX_BYTES_SM90;
}
static CUresult take(int d, uint64_t size);
static void give(int d, uint64_t size);
static pthread_mutex_t ctx_mu = PTHREAD_MUTEX_INITIALIZER;
static void proc_charge(int d, int64_t bytes, int ctxs);
static CUresult ctx_born(fake_ctx *c, int d) {
    c->dev = d;
    uint64_t own = ctx_cost(d);
    if (own) {
        CUresult r = take(d, own);
        if (r != CUDA_SUCCESS)
            return r;
    }
    c->own = own;
    c->refs_proc = 1;
    proc_charge(d, 0, 1);
    return CUDA_SUCCESS;
}
static void host_forget_ctx(fake_ctx *c);
static void ctx_gone(fake_ctx *c) {
    host_forget_ctx(c);
    if (cur == c)
        cur = NULL;
    ctx_free_all(c);
    if (c->own)
        give(c->dev, c->own);
    c->own = 0;
    if (c->refs_proc)
        proc_charge(c->dev, 0, -1);
    c->refs_proc = 0;
}
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
    CHECK_DEV(d);
    if (!c)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&ctx_mu);
    if (primary[d].refs == 0) {
        CUresult r = ctx_born(&primary[d], d);
        if (r != CUDA_SUCCESS) {
            pthread_mutex_unlock(&ctx_mu);
            return r;
        }
    }
    primary[d].refs++;
    pthread_mutex_unlock(&ctx_mu);
    *c = (CUcontext)&primary[d];
    return CUDA_SUCCESS;
}
/* Like the real driver, a primary context dies with its last reference, or
 * on reset, and takes its allocations with it. */
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    CHECK_DEV(d);
    pthread_mutex_lock(&ctx_mu);
    if (primary[d].refs <= 0) {
        pthread_mutex_unlock(&ctx_mu);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if (--primary[d].refs == 0)
        ctx_gone(&primary[d]);
    pthread_mutex_unlock(&ctx_mu);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice d) {
    CHECK_DEV(d);
    pthread_mutex_lock(&ctx_mu);
    primary[d].refs = 0;
    ctx_gone(&primary[d]);
    pthread_mutex_unlock(&ctx_mu);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned *flags, int *active) {
    CHECK_DEV(d);
    if (flags)
        *flags = 0;
    if (active)
        *active = primary[d].refs > 0;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxCreate_v2(CUcontext *c, unsigned flags, CUdevice d) {
    (void)flags;
    CHECK_DEV(d);
    if (!c)
        return CUDA_ERROR_INVALID_VALUE;
    fake_ctx *x = calloc(1, sizeof(*x));
    CUresult r = ctx_born(x, d);
    if (r != CUDA_SUCCESS) {
        free(x);
        return r;
    }
    cur = x;
    *c = (CUcontext)x;
    return CUDA_SUCCESS;
}
/* The pre-3.2 entry point has the same shape. */
EXPORT CUresult cuCtxCreate(CUcontext *c, unsigned flags, CUdevice d) { return cuCtxCreate_v2(c, flags, d); }
/* CUDA 11.4: execution-affinity parameters (ignored here). */
EXPORT CUresult cuCtxCreate_v3(CUcontext *c, void *params, int n, unsigned flags, CUdevice d) {
    if (n < 0 || (n > 0 && !params))
        return CUDA_ERROR_INVALID_VALUE;
    return cuCtxCreate_v2(c, flags, d);
}
/* CUDA 12.5: CUctxCreateParams (NULL: none). */
EXPORT CUresult cuCtxCreate_v4(CUcontext *c, void *params, unsigned flags, CUdevice d) {
    (void)params;
    return cuCtxCreate_v2(c, flags, d);
}
EXPORT CUresult cuCtxDestroy_v2(CUcontext c) {
    if (!c)
        return CUDA_ERROR_INVALID_VALUE;
    ctx_gone((fake_ctx *)c);
    return CUDA_SUCCESS; /* the struct is leaked on purpose: handles stay unique */
}
/* Green contexts (CUDA 12.4): a context on a subset of the SMs, with its
 * own device memory like any other. The CUcontext that cuCtxFromGreenCtx
 * returns is a different handle from the green context's. */
typedef struct fake_green {
    uint64_t magic;
    fake_ctx ctx;
} fake_green;
#define GREEN_MAGIC 0x6e65657267ull
EXPORT CUresult cuGreenCtxCreate(CUgreenCtx *g, CUdevResourceDesc desc, CUdevice d, unsigned flags) {
    CHECK_DEV(d);
    if (!g || !desc || flags != 1 /* CU_GREEN_CTX_DEFAULT_STREAM, required */)
        return CUDA_ERROR_INVALID_VALUE;
    fake_green *x = calloc(1, sizeof(*x));
    CUresult r = ctx_born(&x->ctx, d);
    if (r != CUDA_SUCCESS) {
        free(x);
        return r;
    }
    x->magic = GREEN_MAGIC;
    *g = (CUgreenCtx)x;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGreenCtxDestroy(CUgreenCtx g) {
    fake_green *x = (fake_green *)g;
    if (!x || x->magic != GREEN_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    x->magic = 0;
    ctx_gone(&x->ctx);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxFromGreenCtx(CUcontext *c, CUgreenCtx g) {
    fake_green *x = (fake_green *)g;
    if (!c || !x || x->magic != GREEN_MAGIC)
        return CUDA_ERROR_INVALID_VALUE;
    *c = (CUcontext)&x->ctx;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxSetCurrent(CUcontext c) {
    INIT();
    cur = (fake_ctx *)c;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxGetCurrent(CUcontext *c) {
    if (!c)
        return CUDA_ERROR_INVALID_VALUE;
    *c = (CUcontext)cur;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxGetDevice(CUdevice *d) {
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    if (!cur)
        return CUDA_ERROR_INVALID_CONTEXT;
    *d = cur->dev;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxPushCurrent_v2(CUcontext c) {
    if (depth == 16)
        return CUDA_ERROR_UNKNOWN;
    stack[depth++] = cur;
    cur = (fake_ctx *)c;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *c) {
    if (depth == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (c)
        *c = (CUcontext)cur;
    cur = stack[--depth];
    return CUDA_SUCCESS;
}
static int unsafe_call(void);
static void sync_trim(int d);
static void wait_held(int d, _Atomic uint64_t *su);
static void waits_poll(void);
static void ts_wait_all(int d);
static void ts_stream_wait(int d, uint64_t v);
EXPORT CUresult cuCtxSynchronize(void) {
    if (!cur)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (unsafe_call())
        return 900; /* CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED */
    wait_held(cur->dev, NULL);
    if (F.ts_on)
        ts_wait_all(cur->dev);
    else
        sleep_until(atomic_load(&F.sh->dev[cur->dev].busy_until));
    sync_trim(cur->dev);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamCreate(CUstream *s, unsigned flags) {
    (void)flags;
    if (!s)
        return CUDA_ERROR_INVALID_VALUE;
    if (!cur)
        return CUDA_ERROR_INVALID_CONTEXT;
    fake_stream *x = calloc(1, sizeof(*x));
    x->ctx = cur;
    *s = (CUstream)x;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamDestroy_v2(CUstream s) {
    free(s);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamGetCtx(CUstream s, CUcontext *c) {
    if (!c)
        return CUDA_ERROR_INVALID_VALUE;
    *c = (uintptr_t)s <= 2 ? (CUcontext)cur : (CUcontext)((fake_stream *)s)->ctx;
    return CUDA_SUCCESS;
}
/* Stream capture, reduced to what vcuda must respect: while a stream is
 * capturing, launches into it are recorded, not run, and nobody but the
 * application may put events into it. In global mode (the default, and
 * PyTorch's), while the capture is in progress no thread of the process
 * that is not in relaxed mode may make a potentially unsafe call (event
 * query/synchronize, stream/context synchronize): the call fails with
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and the capture is invalidated. */
#define CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED 900
#define CUDA_ERROR_STREAM_CAPTURE_INVALIDATED 901
static int unsafe_call(void) {
    if (atomic_load(&global_captures) == 0 || thread_capture_mode == 2)
        return 0;
    atomic_fetch_add(&capture_poisoned, 1);
    return 1;
}
EXPORT CUresult cuThreadExchangeStreamCaptureMode(int *mode) {
    if (!mode || *mode < 0 || *mode > 2)
        return CUDA_ERROR_INVALID_VALUE;
    int old = thread_capture_mode;
    thread_capture_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamBeginCapture_v2(CUstream s, int mode) {
    s = per_thread(s, 0);
    if (mode < 0 || mode > 2)
        return CUDA_ERROR_INVALID_VALUE;
    if ((uintptr_t)s <= 2)
        return 900; /* CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: the legacy stream cannot be captured */
    fake_stream *x = (fake_stream *)s;
    if (x->capturing)
        return CUDA_ERROR_INVALID_VALUE;
    x->violations = 0;
    x->poison0 = atomic_load(&capture_poisoned);
    x->mode = mode;
    x->capturing = 1;
    x->graph = calloc(1, sizeof(struct fake_graph_def));
    if (mode == 0)
        atomic_fetch_add(&global_captures, 1);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamEndCapture(CUstream s, void **graph) {
    s = per_thread(s, 0);
    if ((uintptr_t)s <= 2 || !((fake_stream *)s)->capturing)
        return CUDA_ERROR_INVALID_VALUE;
    fake_stream *x = (fake_stream *)s;
    x->capturing = 0;
    if (x->mode == 0)
        atomic_fetch_sub(&global_captures, 1);
    if (graph)
        *graph = x->graph;
    else
        free(x->graph);
    x->graph = NULL;
    int bad = x->violations || (x->mode == 0 && atomic_load(&capture_poisoned) != x->poison0);
    return bad ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_SUCCESS;
}
EXPORT CUresult cuStreamIsCapturing(CUstream s, int *status) {
    s = per_thread(s, 0);
    if (!status)
        return CUDA_ERROR_INVALID_VALUE;
    *status = (uintptr_t)s > 2 && ((fake_stream *)s)->capturing ? 1 : 0;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamIsCapturing_ptsz(CUstream s, int *status) {
    return cuStreamIsCapturing(per_thread(s, 1), status);
}
EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream s, int mode) {
    return cuStreamBeginCapture_v2(per_thread(s, 1), mode);
}
EXPORT CUresult cuStreamEndCapture_ptsz(CUstream s, void **graph) { return cuStreamEndCapture(per_thread(s, 1), graph); }
static int capturing(CUstream s) { return (uintptr_t)s > 2 && ((fake_stream *)s)->capturing; }

static _Atomic uint64_t *stream_until(CUstream s, int d) {
    return (uintptr_t)s <= 2 ? &null_until[d] : &((fake_stream *)s)->until;
}
EXPORT CUresult cuStreamSynchronize(CUstream s) {
    int d = stream_dev(s);
    if (d < 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (unsafe_call())
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    wait_held(d, stream_until(s, d));
    if (F.ts_on)
        ts_stream_wait(d, atomic_load(stream_until(s, d)));
    else
        sleep_until(atomic_load(stream_until(s, d)));
    sync_trim(d);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamSynchronize_ptsz(CUstream s) { return cuStreamSynchronize(s); }

/* ---- context limits ----
 * Limits that size device memory of the context, taken when set (in 2 MiB
 * pages) and given back when the context goes:
 *   CU_LIMIT_STACK_SIZE (0): local memory for every thread the device can
 *     hold at once (2048 an SM): (stack - 1 KiB default) x 2048 x SMs more;
 *   CU_LIMIT_PRINTF_FIFO_SIZE (1): the FIFO beyond its 1 MiB default;
 *   CU_LIMIT_MALLOC_HEAP_SIZE (2): the device heap, any size. */
static const size_t lim_default[3] = {1024, 1 << 20, 8 << 20};
static uint64_t limit_mem(int limit, uint64_t v, int d) {
    uint64_t b;
    switch (limit) {
    case 0:
        if (v <= 1024)
            return 0;
        if (__builtin_mul_overflow(v - 1024, (uint64_t)FAKE_THREADS_PER_SM * (uint64_t)F.sms[d], &b))
            return UINT64_MAX;
        return round_up(b, PAGE2M);
    case 1:
        return v > (1u << 20) ? round_up(v - (1u << 20), PAGE2M) : 0;
    default:
        return round_up(v, PAGE2M);
    }
}
EXPORT CUresult cuCtxSetLimit(int limit, size_t value) {
    if (!cur)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (limit < 0 || limit > 6)
        return CUDA_ERROR_INVALID_VALUE;
    if (limit > 2)
        return CUDA_SUCCESS;
    uint64_t want = limit_mem(limit, value, cur->dev), had = cur->lim_mem[limit];
    if (want > had) {
        CUresult r = take(cur->dev, want - had);
        if (r != CUDA_SUCCESS)
            return r;
    } else if (want < had) {
        give(cur->dev, had - want);
    }
    cur->lim_mem[limit] = want;
    cur->lim[limit] = value;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxGetLimit(size_t *v, int limit) {
    if (!v)
        return CUDA_ERROR_INVALID_VALUE;
    if (!cur)
        return CUDA_ERROR_INVALID_CONTEXT;
    *v = limit >= 0 && limit <= 2 ? (cur->lim[limit] ? cur->lim[limit] : lim_default[limit]) : 0;
    return CUDA_SUCCESS;
}

/* ---- memory bookkeeping ---- */

enum { K_DEV = 1, K_HOSTVMM, K_IPC, K_VIEW, K_EXT, K_POOL, K_MOD };
struct fake_pool;
typedef struct rec {
    uint64_t key, size;
    uint64_t phys; /* device memory it took (rounded as the driver does) */
    int dev, kind;
    fake_ctx *ctx; /* NULL: device-level (VMM handles, pools) */
    struct fake_pool *pool; /* K_POOL: the pool it came from */
    struct rec *next;
} rec;
#define NBUCKET 4096
static rec *buckets[NBUCKET];
static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;

static void reg_add_full(uint64_t key, uint64_t size, uint64_t phys, int dev, int kind, fake_ctx *ctx,
                         struct fake_pool *pool) {
    rec *r = malloc(sizeof(*r));
    r->ctx = ctx;
    r->key = key;
    r->size = size;
    r->phys = phys;
    r->pool = pool;
    r->dev = dev;
    r->kind = kind;
    pthread_mutex_lock(&reg_mu);
    r->next = buckets[(key >> 4) % NBUCKET];
    buckets[(key >> 4) % NBUCKET] = r;
    pthread_mutex_unlock(&reg_mu);
}
static void reg_add(uint64_t key, uint64_t size, int dev, int kind) {
    reg_add_full(key, size, size, dev, kind, cur, NULL);
}
static int reg_take(uint64_t key, int kind, rec *out, int remove) {
    pthread_mutex_lock(&reg_mu);
    for (rec **pp = &buckets[(key >> 4) % NBUCKET]; *pp; pp = &(*pp)->next) {
        rec *r = *pp;
        if (r->key == key && (kind == 0 || r->kind == kind)) {
            *out = *r;
            if (remove) {
                *pp = r->next;
                free(r);
            }
            pthread_mutex_unlock(&reg_mu);
            return 0;
        }
    }
    pthread_mutex_unlock(&reg_mu);
    return -1;
}

/* Freed address ranges are reused (most recent first, same size), as a real
 * driver's allocator reuses its virtual addresses. */
#define NREUSE 256
static struct {
    uint64_t addr, size;
} reuse[NREUSE];
static int nreuse;
static uint64_t new_addr(uint64_t size) {
    size = (size + 0xfff) & ~0xfffull;
    pthread_mutex_lock(&reg_mu);
    for (int i = nreuse - 1; i >= 0 && i >= nreuse - 8; i--) {
        if (reuse[i].size == size) {
            uint64_t a = reuse[i].addr;
            reuse[i] = reuse[--nreuse];
            pthread_mutex_unlock(&reg_mu);
            return a;
        }
    }
    pthread_mutex_unlock(&reg_mu);
    return atomic_fetch_add(&F.next_addr, size);
}
static void old_addr(uint64_t addr, uint64_t size) {
    size = (size + 0xfff) & ~0xfffull;
    pthread_mutex_lock(&reg_mu);
    if (nreuse == NREUSE)
        memmove(reuse, reuse + 1, sizeof(reuse[0]) * --nreuse);
    reuse[nreuse].addr = addr;
    reuse[nreuse].size = size;
    nreuse++;
    pthread_mutex_unlock(&reg_mu);
}

static void maybe_block(void) {
    if (!F.block_path)
        return;
    if (atomic_fetch_add(&F.allocs, 1) < F.block_after)
        return;
    int fd = open(F.block_path, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd >= 0)
        close(fd);
    for (;;)
        pause();
}

/* This process's slot in the driver's process table (claimed at first
 * allocation; a forked child claims its own). */
static int my_slot = -1;
static pid_t my_slot_pid;
static pid_t fake_pid(void);
static shared_proc *self_proc(void) {
    pid_t me = fake_pid();
    if (my_slot >= 0 && my_slot_pid == me)
        return &F.sh->proc[my_slot];
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        int p = atomic_load(&F.sh->proc[i].pid);
        if (p == 0 || p == me || (kill(p, 0) != 0 && errno == ESRCH)) {
            if (p == me || atomic_compare_exchange_strong(&F.sh->proc[i].pid, &p, me)) {
                if (p != me)
                    for (int d = 0; d < FAKE_MAX_DEVS; d++) {
                        atomic_store(&F.sh->proc[i].used[d], 0);
                        atomic_store(&F.sh->proc[i].ctxs[d], 0);
                    }
                my_slot = i;
                my_slot_pid = me;
                return &F.sh->proc[i];
            }
        }
    }
    return NULL; /* table full: the process is not listed */
}

/* ---- the driver's per-process accounting, published ----
 * In node-file mode each process's device state is private, but a real
 * kernel driver knows what every process holds and NVML on the host lists
 * it by host pid. So every change of what the device charges this process
 * (proc_charge, the one place) rewrites its record (fake.h,
 * fake_proc_record) in the simulated driver's state directory, which the
 * node agent's simulated NVML reads. A process that dies keeps its record:
 * the reader drops records whose process is gone, as the driver frees a
 * dead process's memory. */
static pthread_mutex_t rec_mu = PTHREAD_MUTEX_INITIALIZER;
static int rec_fd = -1;
static pid_t rec_pid; /* the process rec_fd was opened for (a forked child opens its own) */
static fake_proc_record my_rec;

static const char *sim_driver_dir(void) {
    const char *e = getenv("FAKE_SIM_DRIVER_DIR");
    return e && *e ? e : FAKE_SIM_DRIVER_DIR_DEFAULT;
}
/* Field 22 of a /proc/<pid>/stat text: the start time in clock ticks after
 * boot, counted after the ')' that ends the command name (which may hold
 * spaces); 0 if there is none. */
static uint64_t stat_start_time(const char *b) {
    const char *p = strrchr(b, ')');
    for (int field = 2; field < 22 && p; field++) /* p: the space before field+1 */
        p = strchr(p + 1, ' ');
    return p ? strtoull(p + 1, NULL, 10) : 0;
}
static uint64_t self_start_time(void) {
    char b[1024];
    int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, b, sizeof(b) - 1);
    close(fd);
    if (n <= 0)
        return 0;
    b[n] = '\0';
    return stat_start_time(b);
}
/* Opens this process's record (under rec_mu); -1 where the directory is
 * absent (a host without the simulated node) or the key cannot be read. */
static int rec_open(pid_t me) {
    if (rec_fd >= 0 && rec_pid == me)
        return rec_fd;
    if (rec_fd >= 0)
        close(rec_fd); /* the parent's, inherited across fork */
    rec_fd = -1;
    struct stat ns;
    uint64_t start = self_start_time();
    if (stat("/proc/self/ns/pid", &ns) != 0 || start == 0)
        return -1;
    memset(&my_rec, 0, sizeof(my_rec));
    memcpy(my_rec.magic, FAKE_PROC_MAGIC, sizeof(my_rec.magic));
    my_rec.pidns = (uint64_t)ns.st_ino;
    my_rec.nspid = (uint64_t)me;
    my_rec.start = start;
    for (int d = 0; d < FAKE_MAX_DEVS; d++)
        my_rec.dev[d].minor = d < F.ndev ? (uint32_t)F.minor[d] : UINT32_MAX;
    char path[4096];
    snprintf(path, sizeof(path), "%s/%llu-%llu-%llu.proc", sim_driver_dir(), (unsigned long long)my_rec.pidns,
             (unsigned long long)my_rec.nspid, (unsigned long long)my_rec.start);
    rec_fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
    rec_pid = me;
    return rec_fd;
}
static void spin_lock(_Atomic int *l);
static void spin_unlock(_Atomic int *l);
static uint64_t iv_busy(const ivset *v, uint64_t now);
static void ts_resolve(int d, uint64_t now);
static uint64_t rec_written; /* when this process's record was last written (under rec_mu) */
/* Rewrites this process's record (under rec_mu): what the device charges it
 * and its busy time by now on every device. */
static void rec_write(shared_proc *me, uint64_t now) {
    if (rec_open(fake_pid()) < 0)
        return;
    for (int i = 0; i < F.ndev; i++) {
        int c = atomic_load(&me->ctxs[i]);
        my_rec.dev[i].ctxs = c > 0 ? (uint32_t)c : 0;
        my_rec.dev[i].used = atomic_load(&me->used[i]);
        spin_lock(&F.sh->dev[i].lock); /* the process's intervals change under the device lock */
        if (F.ts_on) {
            ts_resolve(i, now);
            ts_proc *P = &me->ts[i];
            my_rec.dev[i].busy = P->pid == fake_pid() ? P->busy : 0;
        } else {
            my_rec.dev[i].busy = iv_busy(&me->busy[i], now);
        }
        spin_unlock(&F.sh->dev[i].lock);
    }
    my_rec.at = now;
    my_rec.seq++;
    my_rec.seq_end = my_rec.seq;
    if (pwrite(rec_fd, &my_rec, sizeof(my_rec), 0) != (ssize_t)sizeof(my_rec)) {
        /* a full disk: the host sees a short record and ignores it */
    }
    rec_written = now;
}
/* What the device charges this process on d changes by bytes and ctxs. */
static void proc_charge(int d, int64_t bytes, int ctxs) {
    shared_proc *me = self_proc();
    if (!me)
        return;
    if (bytes)
        atomic_fetch_add(&me->used[d], (uint64_t)bytes);
    if (ctxs)
        atomic_fetch_add(&me->ctxs[d], ctxs);
    if (!F.node_mode)
        return;
    pthread_mutex_lock(&rec_mu);
    rec_write(me, now_ns());
    pthread_mutex_unlock(&rec_mu);
}
/* The process launched work: its busy time is published at most every
 * FAKE_PROC_BUSY_WRITE_NS (a driver samples utilisation; a write per launch
 * would cost a launch-heavy loop a system call each). */
static void proc_busy_tick(void) {
    if (!F.node_mode)
        return;
    shared_proc *me = self_proc();
    uint64_t now = now_ns();
    if (!me || pthread_mutex_trylock(&rec_mu) != 0)
        return;
    if (now - rec_written >= FAKE_PROC_BUSY_WRITE_NS || rec_pid != fake_pid())
        rec_write(me, now);
    pthread_mutex_unlock(&rec_mu);
}

/* Takes size bytes of device d's capacity. */
static CUresult take(int d, uint64_t size) {
    if (d < 0 || d >= F.ndev)
        return CUDA_ERROR_INVALID_CONTEXT;
    shared_dev *s = &F.sh->dev[d];
    uint64_t u = atomic_load(&s->used);
    do {
        if (size > F.mem[d] || u > F.mem[d] - size)
            return CUDA_ERROR_OUT_OF_MEMORY;
    } while (!atomic_compare_exchange_weak(&s->used, &u, u + size));
    uint64_t p = atomic_load(&s->peak);
    while (u + size > p && !atomic_compare_exchange_weak(&s->peak, &p, u + size))
        ;
    proc_charge(d, (int64_t)size, 0);
    return CUDA_SUCCESS;
}
static void give(int d, uint64_t size) {
    atomic_fetch_sub(&F.sh->dev[d].used, size);
    proc_charge(d, -(int64_t)size, 0);
}

/* Rounding: the driver maps device memory in 2 MiB pages. An allocation
 * over 1 MiB gets whole pages of its own; smaller ones are carved from
 * pages at 512-byte alignment (the fake does not model the partly used page
 * they share). */
static uint64_t linear_phys(uint64_t size) {
    return size > (1ull << 20) ? round_up(size, PAGE2M) : round_up(size, 512);
}
static CUresult dev_alloc_phys(uint64_t *key, uint64_t size, uint64_t phys, int d, int kind, fake_ctx *ctx) {
    INIT();
    if (!key || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    maybe_block();
    CUresult r = kind == K_DEV || kind == K_EXT || kind == K_MOD ? take(d, phys) : CUDA_SUCCESS;
    if (r != CUDA_SUCCESS)
        return r;
    *key = new_addr(size);
    reg_add_full(*key, size, phys, d, kind, ctx, NULL);
    return CUDA_SUCCESS;
}
static CUresult dev_alloc_ctx(uint64_t *key, uint64_t size, int d, int kind, fake_ctx *ctx) {
    return dev_alloc_phys(key, size, size, d, kind, ctx);
}
/* Linear memory and arrays of the current context: rounded to pages. */
static CUresult dev_alloc(uint64_t *key, uint64_t size, int d, int kind) {
    return dev_alloc_phys(key, size, kind == K_DEV ? linear_phys(size) : size, d, kind, cur);
}
static void pool_free(struct fake_pool *p, uint64_t size);
static CUresult dev_free(uint64_t key, int kind) {
    rec r;
    if (reg_take(key, kind, &r, 1) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (r.kind == K_POOL)
        pool_free(r.pool, r.phys);
    if (r.kind == K_DEV || r.kind == K_EXT || r.kind == K_MOD)
        give(r.dev, r.phys);
    if (r.kind == K_IPC)
        atomic_fetch_sub(&F.sh->dev[r.dev].mapped, r.size);
    old_addr(key, r.size);
    return CUDA_SUCCESS;
}

static void ctx_free_all(fake_ctx *c) {
    rec *dead = NULL;
    for (int l = 0; l < 3; l++) {
        if (c->lim_mem[l])
            give(c->dev, c->lim_mem[l]);
        c->lim_mem[l] = 0;
        c->lim[l] = 0;
    }
    pthread_mutex_lock(&reg_mu);
    for (int b = 0; b < NBUCKET; b++) {
        for (rec **pp = &buckets[b]; *pp;) {
            rec *r = *pp;
            if (r->ctx == c) {
                *pp = r->next;
                r->next = dead;
                dead = r;
            } else {
                pp = &r->next;
            }
        }
    }
    pthread_mutex_unlock(&reg_mu);
    while (dead) {
        rec *r = dead;
        dead = r->next;
        if (r->kind == K_DEV || r->kind == K_EXT || r->kind == K_MOD)
            give(r->dev, r->phys);
        if (r->kind == K_IPC)
            atomic_fetch_sub(&F.sh->dev[r->dev].mapped, r->size);
        free(r);
    }
    mods_forget_ctx(c);
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size) {
    return dev_alloc((uint64_t *)p, size, ctx_dev(), K_DEV);
}
EXPORT CUresult cuMemAllocManaged(CUdeviceptr *p, size_t size, unsigned flags) {
    (void)flags;
    return dev_alloc((uint64_t *)p, size, ctx_dev(), K_DEV);
}
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h,
                                   unsigned elem) {
    (void)elem;
    if (!pitch || w == 0 || h == 0)
        return CUDA_ERROR_INVALID_VALUE;
    *pitch = (w + 511) & ~(size_t)511;
    return dev_alloc((uint64_t *)p, *pitch * h, ctx_dev(), K_DEV);
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { return dev_free(p, 0); }
EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    rec r;
    if (reg_take(p, 0, &r, 0) != 0)
        return CUDA_ERROR_NOT_FOUND;
    if (base)
        *base = p;
    if (size)
        *size = r.size;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemGetInfo_v2(size_t *free, size_t *total) {
    if (!free && !total)
        return CUDA_ERROR_INVALID_VALUE;
    if (!cur)
        return CUDA_ERROR_INVALID_CONTEXT;
    int d = cur->dev;
    uint64_t u = atomic_load(&F.sh->dev[d].used);
    if (free)
        *free = F.mem[d] - u;
    if (total)
        *total = F.mem[d];
    return CUDA_SUCCESS;
}

static uint64_t fmt_bytes(int fmt) {
    switch (fmt) {
    case 0x01: case 0x08: return 1;
    case 0x02: case 0x09: case 0x10: return 2;
    case 0x03: case 0x0a: case 0x20: return 4;
    default: return 16;
    }
}
static uint64_t arr_size(size_t w, size_t h, size_t d, int fmt, unsigned ch) {
    return (uint64_t)(w ? w : 1) * (h ? h : 1) * (d ? d : 1) * fmt_bytes(fmt) * (ch ? ch : 1);
}
EXPORT CUresult cuArrayCreate_v2(CUarray *a, const CUDA_ARRAY_DESCRIPTOR *d) {
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    return dev_alloc((uint64_t *)a, arr_size(d->Width, d->Height, 1, d->Format, d->NumChannels),
                     ctx_dev(), K_DEV);
}
EXPORT CUresult cuArray3DCreate_v2(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *d) {
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    return dev_alloc((uint64_t *)a,
                     arr_size(d->Width, d->Height, d->Depth, d->Format, d->NumChannels), ctx_dev(),
                     K_DEV);
}
EXPORT CUresult cuArrayDestroy(CUarray a) { return dev_free((uint64_t)(uintptr_t)a, K_DEV); }
EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *a, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                       unsigned levels) {
    if (!d)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t total = 0;
    int layered = (d->Flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP)) != 0;
    for (unsigned l = 0; l < (levels ? levels : 1); l++) {
        size_t w = d->Width >> l, h = d->Height >> l, z = layered ? d->Depth : d->Depth >> l;
        total += arr_size(w ? w : 1, d->Height ? (h ? h : 1) : 0, d->Depth ? (z ? z : 1) : 0,
                          d->Format, d->NumChannels);
    }
    return dev_alloc((uint64_t *)a, total, ctx_dev(), K_DEV);
}
EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray a) {
    return dev_free((uint64_t)(uintptr_t)a, K_DEV);
}

/* ---- virtual memory management ----
 * As the real driver: a cuMemCreate'd allocation lives while its handle has
 * references (cuMemCreate's, plus one per cuMemRetainAllocationHandle, each
 * dropped by cuMemRelease) OR any of its mappings is still mapped. Releasing
 * the last handle reference of a mapped allocation frees nothing; the memory
 * goes with its last cuMemUnmap. A released handle can no longer be mapped
 * or released (until retained again from a mapped address). cuMemMap needs
 * a range reserved with cuMemAddressReserve, not yet mapped, within the
 * allocation; cuMemUnmap must cover whole mappings; cuMemAddressFree refuses
 * a range that still has mappings. */
typedef struct vmm_alloc {
    uint64_t h, size;
    int dev, host;
    int hrefs, maps;
    int imported;  /* cuMemImportFromShareableHandle: the exporter's memory (no device memory of its own) */
    struct vmm_alloc *next;
} vmm_alloc;
typedef struct vmm_range {
    uint64_t va, size;
    vmm_alloc *a; /* NULL for a reservation */
    struct vmm_range *next;
} vmm_range;
static vmm_alloc *vmm_allocs;
static vmm_range *vmm_reserved, *vmm_mapped;
static pthread_mutex_t vmm_mu = PTHREAD_MUTEX_INITIALIZER;

static vmm_alloc *vmm_find(uint64_t h) {
    for (vmm_alloc *a = vmm_allocs; a; a = a->next)
        if (a->h == h)
            return a;
    return NULL;
}
/* Frees the allocation once nothing references it (vmm_mu held). */
static void vmm_maybe_free(vmm_alloc *a) {
    if (a->hrefs > 0 || a->maps > 0)
        return;
    for (vmm_alloc **pp = &vmm_allocs; *pp; pp = &(*pp)->next)
        if (*pp == a) {
            *pp = a->next;
            break;
        }
    if (!a->host && !a->imported)
        give(a->dev, a->size);
    old_addr(a->h, a->size);
    free(a);
}
EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size,
                            const CUmemAllocationProp *prop, unsigned long long flags) {
    INIT();
    if (!prop || !h || size == 0 || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    int host = 0, d = prop->location.id;
    if (prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE) {
        if (d < 0 || d >= F.ndev)
            return CUDA_ERROR_INVALID_DEVICE;
    } else if (prop->location.type >= CU_MEM_LOCATION_TYPE_HOST &&
               prop->location.type <= CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT) {
        host = 1;
        d = 0;
    } else {
        return CUDA_ERROR_INVALID_VALUE;
    }
    maybe_block();
    if (!host) {
        CUresult r = take(d, size);
        if (r != CUDA_SUCCESS)
            return r;
    }
    vmm_alloc *a = calloc(1, sizeof(*a));
    a->h = new_addr(size);
    a->size = size;
    a->dev = d;
    a->host = host;
    a->hrefs = 1;
    pthread_mutex_lock(&vmm_mu);
    a->next = vmm_allocs;
    vmm_allocs = a;
    pthread_mutex_unlock(&vmm_mu);
    *h = a->h;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    pthread_mutex_lock(&vmm_mu);
    vmm_alloc *a = vmm_find(h);
    if (!a || a->hrefs == 0) {
        pthread_mutex_unlock(&vmm_mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    a->hrefs--;
    vmm_maybe_free(a);
    pthread_mutex_unlock(&vmm_mu);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
                                    unsigned long long flags) {
    (void)addr; /* a hint only */
    INIT();
    if (!ptr || size == 0 || size % PAGE2M || flags != 0 || (align & (align - 1)))
        return CUDA_ERROR_INVALID_VALUE;
    if (align < PAGE2M)
        align = PAGE2M;
    vmm_range *r = calloc(1, sizeof(*r));
    r->va = round_up(atomic_fetch_add(&F.next_addr, size + align), align);
    r->size = size;
    pthread_mutex_lock(&vmm_mu);
    r->next = vmm_reserved;
    vmm_reserved = r;
    pthread_mutex_unlock(&vmm_mu);
    *ptr = r->va;
    return CUDA_SUCCESS;
}
static int vmm_overlaps(uint64_t va, uint64_t size, const vmm_range *r) {
    return va < r->va + r->size && r->va < va + size;
}
EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    pthread_mutex_lock(&vmm_mu);
    for (vmm_range *m = vmm_mapped; m; m = m->next)
        if (vmm_overlaps(ptr, size, m)) {
            pthread_mutex_unlock(&vmm_mu);
            return CUDA_ERROR_INVALID_VALUE; /* still mapped */
        }
    for (vmm_range **pp = &vmm_reserved; *pp; pp = &(*pp)->next) {
        vmm_range *r = *pp;
        if (r->va == ptr && r->size == size) {
            *pp = r->next;
            free(r);
            pthread_mutex_unlock(&vmm_mu);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&vmm_mu);
    return CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                         unsigned long long flags) {
    if (size == 0 || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&vmm_mu);
    vmm_alloc *a = vmm_find(h);
    int inside = 0;
    for (vmm_range *r = vmm_reserved; r; r = r->next)
        inside |= ptr >= r->va && ptr + size <= r->va + r->size;
    int clash = 0;
    for (vmm_range *m = vmm_mapped; m; m = m->next)
        clash |= vmm_overlaps(ptr, size, m);
    if (!a || a->hrefs == 0 || !inside || clash || offset > a->size || size > a->size - offset) {
        pthread_mutex_unlock(&vmm_mu);
        return !a || a->hrefs == 0 ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_VALUE;
    }
    vmm_range *m = calloc(1, sizeof(*m));
    m->va = ptr;
    m->size = size;
    m->a = a;
    m->next = vmm_mapped;
    vmm_mapped = m;
    a->maps++;
    pthread_mutex_unlock(&vmm_mu);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    if (size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&vmm_mu);
    int found = 0;
    for (vmm_range *m = vmm_mapped; m; m = m->next) {
        if (!vmm_overlaps(ptr, size, m))
            continue;
        if (m->va < ptr || m->va + m->size > ptr + size) { /* a sub-range of a mapping */
            pthread_mutex_unlock(&vmm_mu);
            return CUDA_ERROR_INVALID_VALUE;
        }
        found = 1;
    }
    if (!found) {
        pthread_mutex_unlock(&vmm_mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (vmm_range **pp = &vmm_mapped; *pp;) {
        vmm_range *m = *pp;
        if (!vmm_overlaps(ptr, size, m)) {
            pp = &m->next;
            continue;
        }
        *pp = m->next;
        m->a->maps--;
        vmm_maybe_free(m->a);
        free(m);
    }
    pthread_mutex_unlock(&vmm_mu);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const void *desc, size_t count) {
    if (!desc || count == 0 || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&vmm_mu);
    int ok = 0;
    for (vmm_range *m = vmm_mapped; m; m = m->next)
        ok |= ptr >= m->va && ptr < m->va + m->size;
    pthread_mutex_unlock(&vmm_mu);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr) {
    if (!h)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t va = (uint64_t)(uintptr_t)addr;
    pthread_mutex_lock(&vmm_mu);
    for (vmm_range *m = vmm_mapped; m; m = m->next)
        if (va >= m->va && va < m->va + m->size) {
            m->a->hrefs++;
            *h = m->a->h;
            pthread_mutex_unlock(&vmm_mu);
            return CUDA_SUCCESS;
        }
    pthread_mutex_unlock(&vmm_mu);
    return CUDA_ERROR_INVALID_VALUE;
}
/* Shareable handles: the exported payload names the allocation's size and
 * device; POSIX file descriptors (a memfd holding it) and fabric handles (its
 * 64 bytes). An import in another process maps the exporter's memory: it
 * takes no device memory of its own. (Simplified: the memory goes with the
 * exporter's last reference, where the driver keeps it while an importer
 * holds it.) */
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1
#define CU_MEM_HANDLE_TYPE_FABRIC 8
/* A fabric handle is unique to one allocation of one process, as the driver's
 * is: two allocations never share its bytes. */
typedef struct {
    char magic[8];
    uint64_t size;
    int dev;
    int32_t pid;
    uint64_t handle;
} vmm_payload;
EXPORT CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type,
                                             unsigned long long flags) {
    if (!out || flags)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&vmm_mu);
    vmm_alloc *a = vmm_find(h);
    vmm_payload pl = {"FAKEVMM", a ? a->size : 0, a ? a->dev : 0, (int32_t)getpid(), (uint64_t)h};
    pthread_mutex_unlock(&vmm_mu);
    if (!a || a->host)
        return CUDA_ERROR_INVALID_VALUE;
    if (type == CU_MEM_HANDLE_TYPE_FABRIC) {
        memset(out, 0, 64);
        memcpy(out, &pl, sizeof(pl));
        return CUDA_SUCCESS;
    }
    if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_NOT_SUPPORTED;
    int fd = memfd_create("fake-vmm-export", MFD_CLOEXEC);
    if (fd < 0 || write(fd, &pl, sizeof(pl)) != (ssize_t)sizeof(pl)) {
        if (fd >= 0)
            close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *(int *)out = fd;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os, int type) {
    INIT();
    vmm_payload pl;
    if (!h || !os)
        return CUDA_ERROR_INVALID_VALUE;
    if (type == CU_MEM_HANDLE_TYPE_FABRIC)
        memcpy(&pl, os, sizeof(pl));
    else if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ||
             pread((int)(uintptr_t)os, &pl, sizeof(pl), 0) != (ssize_t)sizeof(pl))
        return CUDA_ERROR_INVALID_VALUE;
    if (memcmp(pl.magic, "FAKEVMM", 8) != 0 || pl.dev < 0 || pl.dev >= F.ndev)
        return CUDA_ERROR_INVALID_VALUE;
    vmm_alloc *a = calloc(1, sizeof(*a));
    a->h = new_addr(pl.size);
    a->size = pl.size;
    a->dev = pl.dev;
    a->imported = 1;
    a->hrefs = 1;
    pthread_mutex_lock(&vmm_mu);
    a->next = vmm_allocs;
    vmm_allocs = a;
    pthread_mutex_unlock(&vmm_mu);
    *h = a->h;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h) {
    if (!prop)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&vmm_mu);
    vmm_alloc *a = vmm_find(h);
    if (a) {
        memset(prop, 0, sizeof(*prop));
        prop->type = 1;
        prop->location.type = a->host ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE;
        prop->location.id = a->host ? 0 : a->dev;
    }
    pthread_mutex_unlock(&vmm_mu);
    return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *prop, int option) {
    (void)option;
    if (!g || !prop)
        return CUDA_ERROR_INVALID_VALUE;
    *g = PAGE2M;
    return CUDA_SUCCESS;
}

/* ---- stream-ordered pools ----
 * A pool takes device memory in 2 MiB pages as its live allocations (each
 * rounded to 512 bytes) outgrow what it holds, and keeps freed memory:
 * only at a synchronisation (stream, event, context) does it give back
 * what it holds above max(live allocations, release threshold) (default
 * threshold 0; PyTorch sets UINT64_MAX, so nothing is given back);
 * cuMemPoolTrimTo gives back down to its argument. The handle points to the
 * pool, whose first member is its location. Pools are process-local. */
typedef struct fake_pool {
    CUmemLocation loc;
    int dev; /* -1: host memory */
    int dead; /* destroyed while allocations were live */
    uint64_t used, reserved, threshold, used_high, reserved_high;
} fake_pool;
#define NPOOLS 64
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static fake_pool default_pool[FAKE_MAX_DEVS];
static fake_pool *cur_pool[FAKE_MAX_DEVS];
static fake_pool *pools[NPOOLS]; /* created with cuMemPoolCreate */
static int npools;

static fake_pool *dev_pool(int d) {
    pthread_mutex_lock(&pool_mu);
    if (!default_pool[d].loc.type) {
        default_pool[d].loc.type = CU_MEM_LOCATION_TYPE_DEVICE;
        default_pool[d].loc.id = d;
        default_pool[d].dev = d;
    }
    fake_pool *p = cur_pool[d] ? cur_pool[d] : &default_pool[d];
    pthread_mutex_unlock(&pool_mu);
    return p;
}
/* Gives back what p holds above max(live allocations, keep). Under pool_mu. */
static void pool_trim_locked(fake_pool *p, uint64_t keep) {
    if (p->dev < 0)
        return;
    uint64_t k = round_up(p->used, PAGE2M), want = keep < p->reserved ? round_up(keep, PAGE2M) : p->reserved;
    if (want > k)
        k = want;
    if (p->dead)
        k = round_up(p->used, PAGE2M);
    if (k < p->reserved) {
        give(p->dev, p->reserved - k);
        p->reserved = k;
    }
}
/* A synchronisation: pools of device d (all devices if d < 0) give back
 * what they hold above their release threshold. */
static void sync_trim(int d) {
    pthread_mutex_lock(&pool_mu);
    for (int i = 0; i < F.ndev; i++)
        if (d < 0 || d == i)
            pool_trim_locked(&default_pool[i], default_pool[i].threshold);
    for (int i = 0; i < npools; i++)
        if (d < 0 || pools[i]->dev == d)
            pool_trim_locked(pools[i], pools[i]->threshold);
    pthread_mutex_unlock(&pool_mu);
}
static CUresult pool_alloc(uint64_t *key, uint64_t size, fake_pool *p) {
    INIT();
    if (!key || size == 0 || !p)
        return CUDA_ERROR_INVALID_VALUE;
    if (p->dev < 0)
        return dev_alloc_ctx(key, size, 0, K_HOSTVMM, NULL);
    maybe_block();
    uint64_t sz = round_up(size, 512);
    pthread_mutex_lock(&pool_mu);
    if (p->dead) {
        pthread_mutex_unlock(&pool_mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    uint64_t need = p->used + sz;
    if (need > p->reserved) {
        uint64_t grow = round_up(need, PAGE2M) - p->reserved;
        CUresult r = take(p->dev, grow);
        if (r != CUDA_SUCCESS) {
            pthread_mutex_unlock(&pool_mu);
            return r;
        }
        p->reserved += grow;
        if (p->reserved > p->reserved_high)
            p->reserved_high = p->reserved;
    }
    p->used = need;
    if (need > p->used_high)
        p->used_high = need;
    pthread_mutex_unlock(&pool_mu);
    *key = new_addr(size);
    reg_add_full(*key, size, sz, p->dev, K_POOL, NULL, p);
    return CUDA_SUCCESS;
}
static void pool_free(fake_pool *p, uint64_t size) {
    pthread_mutex_lock(&pool_mu);
    p->used -= size;
    if (p->dead)
        pool_trim_locked(p, 0);
    pthread_mutex_unlock(&pool_mu);
}
EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props) {
    INIT();
    if (!pool || !props)
        return CUDA_ERROR_INVALID_VALUE;
    int dev = -1;
    if (props->location.type == CU_MEM_LOCATION_TYPE_DEVICE) {
        if (props->location.id < 0 || props->location.id >= F.ndev)
            return CUDA_ERROR_INVALID_DEVICE;
        dev = props->location.id;
    } else if (props->location.type < CU_MEM_LOCATION_TYPE_HOST ||
               props->location.type > CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    fake_pool *p = calloc(1, sizeof(*p));
    p->loc = props->location;
    p->dev = dev;
    pthread_mutex_lock(&pool_mu);
    if (npools == NPOOLS) {
        pthread_mutex_unlock(&pool_mu);
        free(p);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pools[npools++] = p;
    pthread_mutex_unlock(&pool_mu);
    *pool = (CUmemoryPool)p;
    return CUDA_SUCCESS;
}
/* Like the real driver: a pool destroyed with live allocations goes when
 * the last of them is freed (the struct is leaked: handles stay unique). */
EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    fake_pool *p = (fake_pool *)pool;
    if (!p || (p >= default_pool && p < default_pool + FAKE_MAX_DEVS))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pool_mu);
    for (int i = 0; i < npools; i++)
        if (pools[i] == p)
            pools[i] = pools[--npools];
    for (int d = 0; d < FAKE_MAX_DEVS; d++)
        if (cur_pool[d] == p)
            cur_pool[d] = NULL;
    p->dead = 1;
    pool_trim_locked(p, 0);
    pthread_mutex_unlock(&pool_mu);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice d) {
    CHECK_DEV(d);
    if (!pool)
        return CUDA_ERROR_INVALID_VALUE;
    dev_pool(d);
    *pool = (CUmemoryPool)&default_pool[d];
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice d) {
    CHECK_DEV(d);
    if (!pool)
        return CUDA_ERROR_INVALID_VALUE;
    *pool = (CUmemoryPool)dev_pool(d);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceSetMemPool(CUdevice d, CUmemoryPool pool) {
    CHECK_DEV(d);
    fake_pool *p = (fake_pool *)pool;
    if (!p || p->dev != d)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pool_mu);
    cur_pool[d] = p;
    pthread_mutex_unlock(&pool_mu);
    return CUDA_SUCCESS;
}
#define CU_MEMPOOL_ATTR_RELEASE_THRESHOLD 4
EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value) {
    fake_pool *p = (fake_pool *)pool;
    if (!p || !value || attr < 1 || attr > 8)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pool_mu);
    if (attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
        p->threshold = *(cuuint64_t *)value;
    else if (attr == 6) /* RESERVED_MEM_HIGH: reset to the current value */
        p->reserved_high = p->reserved;
    else if (attr == 8) /* USED_MEM_HIGH */
        p->used_high = p->used;
    pthread_mutex_unlock(&pool_mu);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value) {
    fake_pool *p = (fake_pool *)pool;
    if (!p || !value || attr < 1 || attr > 8)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pool_mu);
    uint64_t v = 0;
    switch (attr) {
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: v = p->threshold; break;
    case 5: v = p->reserved; break; /* RESERVED_MEM_CURRENT */
    case 6: v = p->reserved_high; break;
    case 7: v = p->used; break; /* USED_MEM_CURRENT */
    case 8: v = p->used_high; break;
    default: *(int *)value = 1; pthread_mutex_unlock(&pool_mu); return CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&pool_mu);
    *(cuuint64_t *)value = v;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) {
    fake_pool *p = (fake_pool *)pool;
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pool_mu);
    pool_trim_locked(p, keep);
    pthread_mutex_unlock(&pool_mu);
    return CUDA_SUCCESS;
}
/* Captured: an allocation node of the graph (an address now, memory when
 * the graph runs). */
static CUresult capture_alloc(uint64_t *key, uint64_t size, int d, CUstream s) {
    if (!key || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    fake_stream *x = (fake_stream *)s;
    x->graph->mem += round_up(size, PAGE2M);
    x->graph->dev = d;
    *key = new_addr(size);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *p, size_t size, CUstream s) {
    INIT();
    s = per_thread(s, 0);
    int d = stream_dev(s);
    if (d < 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (capturing(s))
        return capture_alloc((uint64_t *)p, size, d, s);
    return pool_alloc((uint64_t *)p, size, dev_pool(d));
}
EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t size, CUstream s) {
    return cuMemAllocAsync(p, size, per_thread(s, 1));
}
EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t size, CUmemoryPool pool,
                                        CUstream s) {
    s = per_thread(s, 0);
    if (capturing(s) && pool && ((fake_pool *)pool)->dev >= 0)
        return capture_alloc((uint64_t *)p, size, ((fake_pool *)pool)->dev, s);
    return pool_alloc((uint64_t *)p, size, (fake_pool *)pool);
}
EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t size, CUmemoryPool pool,
                                             CUstream s) {
    return cuMemAllocFromPoolAsync(p, size, pool, per_thread(s, 1));
}
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
    s = per_thread(s, 0);
    if (capturing(s))
        return CUDA_SUCCESS; /* a free node of the graph */
    return dev_free(p, 0);
}
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { return cuMemFreeAsync(p, per_thread(s, 1)); }

/* ---- modules and libraries ----
 * Loading code takes device memory of the current context: its code, its
 * constant banks and its __device__ globals (zero-initialised ones are not
 * in the image at all). A module dies with its context; a library
 * (cuLibraryLoad*) is loaded into the current context's device and lives
 * until unloaded.
 *
 * Lazy loading (CUDA 12.2+ default; CUDA_MODULE_LOADING=EAGER turns it
 * off): the load takes the module's globals and its bookkeeping, at least
 * one 2 MiB page; each function's code is loaded, and its memory taken, at
 * its first cuModuleGetFunction or cuKernelGetFunction, or at the first
 * launch of a CUkernel (cuLibraryGetKernel only looks the kernel up). A
 * module's footprint is its globals plus the code loaded so far, in 2 MiB
 * pages, one at least; loading code that does not fit is
 * CUDA_ERROR_OUT_OF_MEMORY from the call that triggered it.
 *
 * Images the fake reads:
 * - a fatbin (what the runtime registers and what vcuda can measure): u32
 *   magic 0xba55ed50, u16 version, u16 header size, u64 payload bytes, then
 *   the payload; the fake's payload starts with its function table,
 *   "FAKEFNS\0", u64 global bytes, u64 function count (at most FN_MAX), then
 *   per function char name[24] and u64 code bytes. The code lies inside the
 *   payload, so a table claiming more code than the payload holds is
 *   refused (CUDA_ERROR_INVALID_IMAGE), as a real driver refuses a corrupt
 *   image;
 * - "FAKEMOD" then two u64, code bytes and global bytes (a short image
 *   that only announces its sizes): one function of that much code, found
 *   under any name;
 * - anything else (a file: its length): that much code, one function, any
 *   name. */
#define FN_MAX 16
#define FATBIN_MAGIC 0xba55ed50u
typedef struct fmod {
    uint64_t key; /* the module's or library's handle */
    fake_ctx *ctx; /* NULL: a library */
    int dev;
    uint64_t globals, loaded; /* bytes: globals, code loaded so far */
    int nfn, anyname;         /* anyname: the image names no functions */
    struct fn {
        char name[24];
        uint64_t code;
        int loaded;
    } fn[FN_MAX];
    struct fmod *next;
} fmod;
static fmod *mods;
static pthread_mutex_t mod_mu = PTHREAD_MUTEX_INITIALIZER;

static uint64_t mod_footprint(uint64_t bytes) { return bytes ? round_up(bytes, PAGE2M) : PAGE2M; }

/* Reads an image into m (functions, globals). Returns CUDA_SUCCESS or
 * CUDA_ERROR_INVALID_IMAGE. len: the image's bytes (0: a fatbin in memory,
 * as long as its header says). */
static CUresult parse_image(const unsigned char *b, size_t len, fmod *m) {
    uint32_t magic;
    memcpy(&magic, b, 4);
    m->nfn = 1;
    m->anyname = 1;
    if (magic == FATBIN_MAGIC) {
        uint16_t hs;
        uint64_t payload, glob, n;
        memcpy(&hs, b + 6, 2);
        memcpy(&payload, b + 8, 8);
        const unsigned char *p = b + hs;
        if (hs < 16 || payload < 32 || (len && (hs > len || payload > len - hs)) || memcmp(p, "FAKEFNS", 8) != 0)
            return 218; /* CUDA_ERROR_INVALID_IMAGE: not an image for this device */
        memcpy(&glob, p + 8, 8);
        memcpy(&n, p + 16, 8);
        if (n == 0 || n > FN_MAX || 24 + n * 32 > payload)
            return 218;
        uint64_t code = 0;
        for (uint64_t i = 0; i < n; i++) {
            memcpy(m->fn[i].name, p + 24 + i * 32, 24);
            m->fn[i].name[23] = '\0';
            memcpy(&m->fn[i].code, p + 24 + i * 32 + 24, 8);
            if (m->fn[i].code > payload)
                return 218;
            code += m->fn[i].code;
        }
        if (code > payload - (24 + n * 32))
            return 218; /* more code than the image holds */
        m->nfn = (int)n;
        m->anyname = 0;
        m->globals = glob;
        return CUDA_SUCCESS;
    }
    if (len >= 24 && memcmp(b, "FAKEMOD", 8) == 0) {
        memcpy(&m->fn[0].code, b + 8, 8);
        memcpy(&m->globals, b + 16, 8);
        return CUDA_SUCCESS;
    }
    m->fn[0].code = len ? len : 1;
    return CUDA_SUCCESS;
}

/* Grows the module record key's footprint by delta (under mod_mu). */
static CUresult mod_take(fmod *m, uint64_t code) {
    uint64_t before = mod_footprint(m->globals + m->loaded), after = mod_footprint(m->globals + m->loaded + code);
    if (after > before) {
        CUresult r = take(m->dev, after - before);
        if (r != CUDA_SUCCESS)
            return r;
        pthread_mutex_lock(&reg_mu);
        for (rec *r2 = buckets[(m->key >> 4) % NBUCKET]; r2; r2 = r2->next)
            if (r2->key == m->key && r2->kind == K_MOD)
                r2->phys += after - before;
        pthread_mutex_unlock(&reg_mu);
    }
    m->loaded += code;
    return CUDA_SUCCESS;
}

static CUresult load_image(uint64_t *h, const void *image, size_t len, fake_ctx *ctx) {
    INIT();
    if (!h || !image)
        return CUDA_ERROR_INVALID_VALUE;
    if (!cur)
        return CUDA_ERROR_INVALID_CONTEXT;
    fmod *m = calloc(1, sizeof(*m));
    CUresult r = parse_image(image, len, m);
    if (r != CUDA_SUCCESS) {
        free(m);
        return r;
    }
    m->ctx = ctx;
    m->dev = cur->dev;
    for (int i = 0; F.eager_modules && i < m->nfn; i++) {
        m->fn[i].loaded = 1;
        m->loaded += m->fn[i].code;
    }
    r = dev_alloc_phys(h, 1, mod_footprint(m->globals + m->loaded), cur->dev, K_MOD, ctx);
    if (r != CUDA_SUCCESS) {
        free(m);
        return r;
    }
    m->key = *h;
    pthread_mutex_lock(&mod_mu);
    m->next = mods;
    mods = m;
    pthread_mutex_unlock(&mod_mu);
    return CUDA_SUCCESS;
}
static CUresult load_file(uint64_t *h, const char *path, fake_ctx *ctx) {
    if (!path)
        return CUDA_ERROR_INVALID_VALUE;
    FILE *f = fopen(path, "rb");
    if (!f)
        return CUDA_ERROR_NOT_FOUND;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = calloc(1, len > 24 ? (size_t)len : 24);
    size_t n = buf ? fread(buf, 1, (size_t)(len > 0 ? len : 0), f) : 0;
    fclose(f);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = load_image(h, buf, n, ctx);
    free(buf);
    return r;
}
static CUresult unload(uint64_t key) {
    CUresult r = dev_free(key, K_MOD);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&mod_mu);
    for (fmod **pp = &mods; *pp; pp = &(*pp)->next)
        if ((*pp)->key == key) {
            fmod *m = *pp;
            *pp = m->next;
            free(m);
            break;
        }
    pthread_mutex_unlock(&mod_mu);
    return CUDA_SUCCESS;
}
static void mods_forget_ctx(fake_ctx *c) {
    pthread_mutex_lock(&mod_mu);
    for (fmod **pp = &mods; *pp;) {
        fmod *m = *pp;
        if (m->ctx == c) {
            *pp = m->next;
            free(m);
        } else {
            pp = &m->next;
        }
    }
    pthread_mutex_unlock(&mod_mu);
}
/* Loads function i of m if it is not yet (under mod_mu). */
static CUresult fn_load(fmod *m, struct fn *f) {
    if (f->loaded)
        return CUDA_SUCCESS;
    CUresult r = mod_take(m, f->code);
    if (r == CUDA_SUCCESS)
        f->loaded = 1;
    return r;
}
/* Looks name up in module/library key, loading its code if load. The
 * handle is the function's entry (a CUfunction and a CUkernel alike). */
static CUresult fn_get(void **out, uint64_t key, const char *name, int load) {
    INIT();
    if (!out || !name)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&mod_mu);
    for (fmod *m = mods; m; m = m->next) {
        if (m->key != key)
            continue;
        r = CUDA_ERROR_NOT_FOUND;
        for (int i = 0; i < m->nfn; i++)
            if (m->anyname || strcmp(m->fn[i].name, name) == 0) {
                r = load ? fn_load(m, &m->fn[i]) : CUDA_SUCCESS;
                if (r == CUDA_SUCCESS)
                    *out = &m->fn[i];
                break;
            }
        break;
    }
    pthread_mutex_unlock(&mod_mu);
    return r;
}
/* A CUkernel launched (or turned into a function) for the first time is
 * loaded then. Anything that is not a live library's kernel (a module's
 * CUfunction, already loaded) is left alone. */
static CUresult kernel_load(const void *k) {
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&mod_mu);
    for (fmod *m = mods; m; m = m->next)
        if (!m->ctx && (const char *)k >= (const char *)m->fn && (const char *)k < (const char *)(m->fn + m->nfn)) {
            r = fn_load(m, (struct fn *)k);
            break;
        }
    pthread_mutex_unlock(&mod_mu);
    return r;
}

/* The fake's images announce their size; real ones are parsed by the
 * driver. An image of unknown length is read up to its header. */
static size_t img_len(const void *image) {
    uint32_t magic;
    memcpy(&magic, image, 4);
    if (magic == FATBIN_MAGIC)
        return 0;
    return memcmp(image, "FAKEMOD", 8) == 0 ? 24 : strlen((const char *)image) + 1;
}
EXPORT CUresult cuModuleLoadData(CUmodule *m, const void *image) {
    if (!image)
        return CUDA_ERROR_INVALID_VALUE;
    return load_image((uint64_t *)m, image, img_len(image), cur);
}
EXPORT CUresult cuModuleLoadDataEx(CUmodule *m, const void *image, unsigned n, void *opts, void **vals) {
    (void)n, (void)opts, (void)vals;
    return cuModuleLoadData(m, image);
}
EXPORT CUresult cuModuleLoadFatBinary(CUmodule *m, const void *image) { return cuModuleLoadData(m, image); }
EXPORT CUresult cuModuleLoad(CUmodule *m, const char *path) { return load_file((uint64_t *)m, path, cur); }
EXPORT CUresult cuModuleUnload(CUmodule m) { return unload((uint64_t)(uintptr_t)m); }
EXPORT CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
    return fn_get((void **)f, (uint64_t)(uintptr_t)m, name, 1);
}
EXPORT CUresult cuLibraryLoadData(CUlibrary *l, const void *code, void *jo, void **jv, unsigned nj, void *lo,
                                  void **lv, unsigned nl) {
    (void)jo, (void)jv, (void)nj, (void)lo, (void)lv, (void)nl;
    if (!code)
        return CUDA_ERROR_INVALID_VALUE;
    return load_image((uint64_t *)l, code, img_len(code), NULL);
}
EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *l, const char *path, void *jo, void **jv, unsigned nj, void *lo,
                                      void **lv, unsigned nl) {
    (void)jo, (void)jv, (void)nj, (void)lo, (void)lv, (void)nl;
    return load_file((uint64_t *)l, path, NULL);
}
EXPORT CUresult cuLibraryUnload(CUlibrary l) { return unload((uint64_t)(uintptr_t)l); }
EXPORT CUresult cuLibraryGetKernel(CUkernel *k, CUlibrary l, const char *name) {
    return fn_get((void **)k, (uint64_t)(uintptr_t)l, name, F.eager_modules);
}
EXPORT CUresult cuKernelGetFunction(CUfunction *f, CUkernel k) {
    if (!f || !k)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = kernel_load(k);
    if (r == CUDA_SUCCESS)
        *f = (CUfunction)k;
    return r;
}

/* IPC: the handle carries the exported size, and, as a real driver's handle
 * does, what makes it unique to one allocation of one process (the address
 * and the exporter's pid): two allocations never share a handle's bytes. */
typedef struct {
    char magic[8];
    uint64_t size;
    int dev;
    int32_t pid;
    uint64_t addr;
} ipc_payload;
_Static_assert(sizeof(ipc_payload) <= sizeof(((CUipcMemHandle *)0)->reserved), "ipc payload size");
EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
    rec r;
    if (!h || reg_take(p, 0, &r, 0) != 0 || (r.kind != K_DEV && r.kind != K_POOL))
        return CUDA_ERROR_INVALID_VALUE;
    memset(h, 0, sizeof(*h));
    ipc_payload pl = {"FAKEIPC", r.size, r.dev, (int32_t)getpid(), (uint64_t)p};
    memcpy(h->reserved, &pl, sizeof(pl));
    return CUDA_SUCCESS;
}
EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned flags) {
    (void)flags;
    INIT();
    ipc_payload pl;
    memcpy(&pl, h.reserved, sizeof(pl));
    if (!p || memcmp(pl.magic, "FAKEIPC", 8) != 0 || !cur)
        return CUDA_ERROR_INVALID_VALUE;
    *p = new_addr(pl.size);
    reg_add(*p, pl.size, cur->dev, K_IPC);
    atomic_fetch_add(&F.sh->dev[cur->dev].mapped, pl.size);
    return CUDA_SUCCESS;
}
/* Pool pointers shared with another process: the export data carries the
 * size; the import maps it (no device memory of the importer's), freed with
 * cuMemFree[Async]. (Lenient: any pool of the importer is accepted, where
 * the driver wants one imported with cuMemPoolImportFromShareableHandle.) */
EXPORT CUresult cuMemPoolExportPointer(CUmemPoolPtrExportData *data, CUdeviceptr p) {
    rec r;
    if (!data || reg_take(p, K_POOL, &r, 0) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    memset(data, 0, sizeof(*data));
    ipc_payload pl = {"FAKEPPX", r.size, r.dev, (int32_t)getpid(), (uint64_t)p};
    memcpy(data->reserved, &pl, sizeof(pl));
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemPoolImportPointer(CUdeviceptr *p, CUmemoryPool pool, CUmemPoolPtrExportData *data) {
    INIT();
    ipc_payload pl;
    if (!p || !pool || !data)
        return CUDA_ERROR_INVALID_VALUE;
    memcpy(&pl, data->reserved, sizeof(pl));
    if (memcmp(pl.magic, "FAKEPPX", 8) != 0 || !cur)
        return CUDA_ERROR_INVALID_VALUE;
    *p = new_addr(pl.size);
    reg_add(*p, pl.size, cur->dev, K_IPC);
    atomic_fetch_add(&F.sh->dev[cur->dev].mapped, pl.size);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuIpcOpenMemHandle(CUdeviceptr *p, CUipcMemHandle h, unsigned flags) {
    return cuIpcOpenMemHandle_v2(p, h, flags);
}
EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr p) { return dev_free(p, K_IPC); }

EXPORT CUresult cuImportExternalMemory(CUexternalMemory *ext,
                                       const CUDA_EXTERNAL_MEMORY_HANDLE_DESC *desc) {
    if (!desc)
        return CUDA_ERROR_INVALID_VALUE;
    return dev_alloc((uint64_t *)ext, desc->size, ctx_dev(), K_EXT);
}
EXPORT CUresult cuDestroyExternalMemory(CUexternalMemory ext) {
    return dev_free((uint64_t)(uintptr_t)ext, K_EXT);
}
EXPORT CUresult cuExternalMemoryGetMappedBuffer(CUdeviceptr *p, CUexternalMemory ext,
                                                const CUDA_EXTERNAL_MEMORY_BUFFER_DESC *d) {
    rec r;
    if (!p || !d || reg_take((uint64_t)(uintptr_t)ext, K_EXT, &r, 0) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    *p = new_addr(d->size);
    reg_add(*p, d->size, r.dev, K_VIEW);
    return CUDA_SUCCESS;
}

/* ---- the device timeline ----
 *
 * A kernel of G blocks runs in waves: each of the S SMs holds `occ` blocks
 * at once (occupancy from the block size, registers per thread and shared
 * memory per block, as the hardware limits them), so it takes
 *     overhead + ceil(G / (S * occ)) * wave_ns
 * where overhead and wave_ns are the function's own (fakeFunctionSet, or
 * derived from the handle). A grid of 1 block costs a whole wave.
 * Streams: work on one stream runs in order; kernels on different streams
 * of one process overlap unless one of them fills the device (G >= S * occ),
 * which waits for everything queued before it and holds off later ones.
 * Processes time-slice: work of a process waits for all work queued before
 * it by another. Busy time is the union of kernel intervals, per device and
 * per process.
 * That is FIFO between processes (FAKE_CUDA_SCHED=fifo), stricter than a
 * GPU without MPS, whose scheduler round-robins the contexts that have work
 * by timeslice (of the order of 1-2 ms; compute preemption since Pascal), so
 * a process's work waits at most about a timeslice per other context, not
 * for another's whole queue. FAKE_CUDA_SCHED=timeslice models that (the
 * timeslice scheduler below: each process's work settled on a virtual
 * timeline of its own, served by a replay of the round-robin); FIFO is
 * kept for comparison (vcuda/README.md, "The timeslice model"). */

/* The lock word holds its holder's pid: a process that exits while one of
 * its threads holds it (the host-function worker queues a released stream's
 * work under it) would otherwise leave every other process spinning for
 * ever (a grid cell hung so). A hold lasts microseconds, so a waiter that
 * has seen the same holder for a second takes the lock over (by time, not
 * by asking whether the pid lives: processes sharing the device may be in
 * other PID namespaces). */
static void spin_lock(_Atomic int *l) {
    int me = getpid(), z = 0, seen = 0;
    uint64_t since = 0;
    for (unsigned n = 1; !atomic_compare_exchange_weak(l, &z, me); n++) {
        if (z != 0 && n % 64 == 0) {
            uint64_t t = now_ns();
            if (z != seen)
                seen = z, since = t;
            else if (t - since > 1000000000ull)
                atomic_compare_exchange_strong(l, &z, 0);
        }
        z = 0;
        sched_yield();
    }
}
static void spin_unlock(_Atomic int *l) { atomic_store(l, 0); }

/* Adds [st, en) to the set; intervals that ended by `now` (and before st)
 * are folded into `done`. */
static void iv_add(ivset *v, uint64_t st, uint64_t en, uint64_t now) {
    int w = 0;
    for (int i = 0; i < v->n; i++) {
        if (v->e[i] <= now && v->e[i] < st) {
            v->done += v->e[i] - v->s[i];
            continue;
        }
        v->s[w] = v->s[i];
        v->e[w] = v->e[i];
        w++;
    }
    v->n = w;
    int i = 0;
    while (i < v->n && v->e[i] < st)
        i++;
    int j = i;
    while (j < v->n && v->s[j] <= en) { /* merge every interval it touches */
        if (v->s[j] < st)
            st = v->s[j];
        if (v->e[j] > en)
            en = v->e[j];
        j++;
    }
    if (j == i && v->n == NIV) {
        /* full: fold the oldest into `done` */
        if (i == 0) {
            v->done += en - st;
            return;
        }
        v->done += v->e[0] - v->s[0];
        memmove(&v->s[0], &v->s[1], sizeof(uint64_t) * (size_t)(v->n - 1));
        memmove(&v->e[0], &v->e[1], sizeof(uint64_t) * (size_t)(v->n - 1));
        v->n--;
        i--;
        j--;
    }
    int tail = v->n - j;
    memmove(&v->s[i + 1], &v->s[j], sizeof(uint64_t) * (size_t)tail);
    memmove(&v->e[i + 1], &v->e[j], sizeof(uint64_t) * (size_t)tail);
    v->s[i] = st;
    v->e[i] = en;
    v->n = i + 1 + tail;
}
/* Busy ns elapsed by `now`. */
static uint64_t iv_busy(const ivset *v, uint64_t now) {
    uint64_t b = v->done;
    for (int i = 0; i < v->n; i++)
        if (v->s[i] < now)
            b += (v->e[i] < now ? v->e[i] : now) - v->s[i];
    return b;
}

/* ---- the timeslice scheduler (FAKE_CUDA_SCHED=timeslice) ----
 * A GPU without MPS serves one context at a time: it round-robins the
 * contexts that have work, each for a timeslice (F.slice_ns), and switches
 * early when the running one runs out of work; the switch idles the device
 * FAKE_CUDA_CTXSW_NS (only between different processes, and not at all if
 * the device was idle that long already). Each process settles its own work
 * at submission as the FIFO timeline does, but on a virtual timeline of its
 * own (ns of its own service: its streams, their overlap, device-filling
 * kernels), which runs only while the process has the device; so a later
 * arrival from another process never moves work already settled, it only
 * changes when each process's virtual time is served. ts_resolve replays the
 * device from the last resolved time to now (every submission resolves first,
 * so between two resolves the set of processes with work only shrinks) and
 * records, per process, the real segments that served its virtual time;
 * readers (synchronize, event times, busy time, the host-function worker,
 * the launch queue) map virtual time to real through them. A kernel
 * preempted at a slice's end resumes in its context's next slice. */
static ts_proc *ts_of(int slot, int d) { return &F.sh->proc[slot].ts[d]; }
static int ts_has_work(const ts_proc *p) { return p->backlog > p->served || p->want; }
static void ts_seg_add(ts_proc *p, uint64_t rs, uint64_t re, uint64_t vs) {
    if (p->nseg) {
        ts_seg *l = &p->seg[(p->head + TS_NSEG - 1) % TS_NSEG];
        if (l->re == rs && l->vs + (l->re - l->rs) == vs) { /* no gap: one segment */
            l->re = re;
            return;
        }
    }
    p->seg[p->head] = (ts_seg){rs, re, vs};
    p->head = (p->head + 1) % TS_NSEG;
    if (p->nseg < TS_NSEG)
        p->nseg++;
}
/* The next process slot after `after` (round-robin), other than skip, with
 * work on d; -1 none. */
static int ts_next(const struct ts_dev *S, int d, int after, int skip) {
    int start = after < 0 ? 0 : after + 1;
    for (int k = 0; k < FAKE_MAX_PROCS;) {
        int i = (start + k) % FAKE_MAX_PROCS;
        uint64_t w = S->reg[i / 64] >> (i % 64);
        if (!w) {
            k += 64 - i % 64;
            continue;
        }
        int z = __builtin_ctzll(w);
        k += z;
        i += z;
        if (k >= FAKE_MAX_PROCS)
            break;
        if (i != skip && ts_has_work(ts_of(i, d)))
            return i;
        k++;
    }
    return -1;
}
/* Replays device d's scheduler up to now (device lock held). */
static void ts_resolve(int d, uint64_t now) {
    struct ts_dev *S = &F.sh->dev[d].ts;
    uint64_t slice = F.slice_ns;
    int changed[8], nch = 0;
    if (now < S->t)
        now = S->t;
    for (int guard = 0; guard < 1 << 20; guard++) {
        int o = S->owner - 1;
        ts_proc *P = o >= 0 ? ts_of(o, d) : NULL;
        if (P && ts_has_work(P)) {
            if (S->idle) { /* it resumes after an idle device: a fresh slice, no switch */
                S->idle = 0;
                S->slice_start = S->t;
            }
            if (S->t < S->slice_start) { /* the switch to it is under way */
                if (now < S->slice_start) {
                    S->t = now;
                    break;
                }
                S->t = S->slice_start;
            }
            if (P->want) {
                ts_seg_add(P, S->t, S->t, P->served);
                P->want = 0;
            }
            int others = ts_next(S, d, o, o) >= 0;
            if (!others && S->t >= S->slice_start + slice) /* nobody to give way to: a new slice */
                S->slice_start += (S->t - S->slice_start) / slice * slice;
            uint64_t slice_end = S->slice_start + slice;
            uint64_t end = S->t + (P->backlog - P->served);
            if (others && end > slice_end)
                end = slice_end > S->t ? slice_end : S->t;
            if (end > now)
                end = now;
            if (end > S->t) {
                ts_seg_add(P, S->t, end, P->served);
                P->served += end - S->t;
                P->busy += end - S->t;
                S->busy += end - S->t;
                S->last_end = end;
                S->t = end;
                int seen = 0;
                for (int k = 0; k < nch; k++)
                    seen |= changed[k] == o;
                if (!seen && nch < 8)
                    changed[nch++] = o;
            }
            if (P->served < P->backlog && !(others && S->t >= slice_end)) {
                if (!others && S->t >= S->slice_start + slice)
                    S->slice_start += (S->t - S->slice_start) / slice * slice;
                break; /* still running at now */
            }
        }
        /* the owner ran out of work, or its slice ended with others waiting */
        int q = ts_next(S, d, o, o);
        if (q < 0) {
            if (!(P && ts_has_work(P))) {
                S->idle = 1;
                S->t = now;
            }
            break;
        }
        if (o >= 0)
            atomic_fetch_add(&F.sh->dev[d].switches, 1);
        S->owner = q + 1;
        S->idle = 0;
        uint64_t sw = S->last_end + fdm_switch_ns();
        S->slice_start = S->t > sw ? S->t : sw;
    }
    for (int k = 0; k < nch; k++) {
        ts_proc *P = ts_of(changed[k], d);
        fdm_publish_busy(d, P->pid, P->busy, now);
    }
}
/* This process's entry on d (device lock held), its slot in *slot; NULL
 * when the process table is full. A slot reused by a new process starts
 * afresh. */
static ts_proc *ts_me(int d, int *slot) {
    shared_proc *me = self_proc();
    if (!me)
        return NULL;
    int i = (int)(me - F.sh->proc), pid = fake_pid();
    ts_proc *P = ts_of(i, d);
    if (P->pid != pid) {
        P->pid = pid;
        P->want = 0;
        P->served = P->backlog = P->excl = P->busy = 0;
        P->nseg = P->head = 0;
        F.sh->dev[d].ts.reg[i / 64] |= 1ull << (i % 64);
    }
    if (slot)
        *slot = i;
    return P;
}
/* The real time P's virtual clock reached v, at or after sub (a command
 * submitted at sub is reached no earlier); 0: not yet. The clock stands
 * still between segments, so a time at a segment's end is also its next
 * segment's start: the earliest one at or after sub counts. */
static uint64_t ts_real(const ts_proc *P, uint64_t v, uint64_t sub) {
    if (v > P->served)
        return 0;
    uint64_t best = 0;
    uint32_t k = 0;
    for (; k < P->nseg; k++) { /* newest first: readers ask about recent times */
        const ts_seg *g = &P->seg[(P->head + 2 * TS_NSEG - 1 - k) % TS_NSEG];
        if (g->vs + (g->re - g->rs) < v || g->re < sub)
            break;
        if (g->vs <= v) {
            uint64_t r = g->rs + (v - g->vs);
            best = r > sub ? r : sub;
        }
    }
    if (!P->nseg && !P->want) /* never served, nothing waiting: time 0 of its clock is now */
        return sub ? sub : now_ns();
    if (!best && k == P->nseg && P->nseg) { /* older than the ring: its oldest segment */
        const ts_seg *g = &P->seg[(P->head + TS_NSEG - P->nseg) % TS_NSEG];
        best = g->rs > sub ? g->rs : sub;
    }
    return best;
}
/* When process slot's clock on d reaches v at or after sub: its real time;
 * 0 if it has not yet (block: wait for it, sleeping, never spinning: the
 * earliest it can be reached is when the process has been served the rest). */
static uint64_t ts_when(int d, int slot, uint64_t v, uint64_t sub, int block) {
    shared_dev *s = &F.sh->dev[d];
    for (;;) {
        uint64_t now = now_ns();
        spin_lock(&s->lock);
        ts_resolve(d, now);
        ts_proc *P = ts_of(slot, d);
        if (v > P->backlog) /* a timeline inherited across fork, of the parent's clock */
            v = P->backlog;
        uint64_t r = ts_real(P, v, sub);
        uint64_t left = v > P->served ? v - P->served : 0;
        spin_unlock(&s->lock);
        if (r || !block)
            return r;
        if (left < 10000)
            left = 10000;
        struct timespec ts = {(time_t)(left / 1000000000ull), (long)(left % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
}
/* Waits until all of this process's work on d has been served. */
static void ts_wait_all(int d) {
    shared_dev *s = &F.sh->dev[d];
    int slot = -1;
    spin_lock(&s->lock);
    ts_proc *P = ts_me(d, &slot);
    uint64_t v = P ? P->backlog : 0;
    spin_unlock(&s->lock);
    if (P)
        ts_when(d, slot, v, 0, 1);
}
/* Waits until this process's clock on d reaches v. */
static void ts_stream_wait(int d, uint64_t v) {
    int slot = -1;
    spin_lock(&F.sh->dev[d].lock);
    ts_me(d, &slot);
    spin_unlock(&F.sh->dev[d].lock);
    if (slot >= 0)
        ts_when(d, slot, v, 0, 1);
}
/* Blocks while stream su's own work not yet served exceeds the launch queue
 * (a real queue of its own holds ~1024 entries, then the launch blocks);
 * returns where its next work starts on the process's virtual timeline, and
 * how much of its work is queued ahead of it. */
static void ts_queue_wait(int d, _Atomic uint64_t *su, uint64_t *start, uint64_t *ahead) {
    shared_dev *s = &F.sh->dev[d];
    uint64_t q = fdm_queue_ns();
    for (;;) {
        spin_lock(&s->lock);
        ts_resolve(d, now_ns());
        ts_proc *P = ts_me(d, NULL);
        uint64_t served = P ? P->served : 0, v = atomic_load(su);
        if (P && v > P->backlog) /* inherited across fork */
            v = P->backlog;
        spin_unlock(&s->lock);
        uint64_t a = v > served ? v - served : 0;
        if (a <= q) {
            *start = v > served ? v : served;
            *ahead = a;
            return;
        }
        uint64_t w = a - q;
        struct timespec ts = {(time_t)(w / 1000000000ull), (long)(w % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
}

/* Per-function behaviour (process-local, like function handles). */
#define NFUNC 1024
static struct {
    uint64_t key;
    fake_func cfg;
} funcs[NFUNC];
static pthread_mutex_t func_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return x;
}
EXPORT int fakeFunctionSet(CUfunction f, const fake_func *cfg) {
    if (!f || !cfg || cfg->wave_ns == 0)
        return -1;
    pthread_mutex_lock(&func_mu);
    uint64_t k = (uint64_t)(uintptr_t)f;
    for (unsigned n = 0, i = (unsigned)(mix64(k) % NFUNC); n < NFUNC; n++, i = (i + 1) % NFUNC) {
        if (funcs[i].key == 0 || funcs[i].key == k) {
            funcs[i].key = k;
            funcs[i].cfg = *cfg;
            pthread_mutex_unlock(&func_mu);
            return 0;
        }
    }
    pthread_mutex_unlock(&func_mu);
    return -1;
}
static fake_func func_cfg(CUfunction f) {
    uint64_t k = (uint64_t)(uintptr_t)f;
    pthread_mutex_lock(&func_mu);
    for (unsigned n = 0, i = (unsigned)(mix64(k) % NFUNC); n < NFUNC && funcs[i].key; n++, i = (i + 1) % NFUNC) {
        if (funcs[i].key == k) {
            fake_func c = funcs[i].cfg;
            pthread_mutex_unlock(&func_mu);
            return c;
        }
    }
    pthread_mutex_unlock(&func_mu);
    /* Not configured: registers from the handle (32..128 a thread), no
     * static shared memory, the device's wave time and launch overhead. */
    fake_func c = {(int)(32 + 8 * (mix64(k) % 13)), 0, F.wave_ns, F.overhead_ns};
    return c;
}
/* Resident blocks per SM (Hopper-class limits), 0 if the block cannot run. */
static int occupancy(const fake_func *c, uint64_t threads, uint64_t dyn_smem) {
    if (threads == 0 || threads > 1024)
        return 0;
    uint64_t warps = (threads + 31) / 32;
    uint64_t regs_block = (uint64_t)(c->regs > 0 ? c->regs : 32) * 32 * warps;
    uint64_t smem_block = (uint64_t)c->smem + dyn_smem;
    if (regs_block > 65536 || smem_block > 227 * 1024)
        return 0;
    uint64_t occ = 32;
    if (64 / warps < occ)
        occ = 64 / warps;
    if (65536 / regs_block < occ)
        occ = 65536 / regs_block;
    if (smem_block && (228 * 1024) / (smem_block + 1024) < occ)
        occ = (228 * 1024) / (smem_block + 1024);
    return (int)occ;
}
EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, CUfunction f, int block, size_t dyn) {
    if (!n || !f || block <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    fake_func c = func_cfg(f);
    *n = occupancy(&c, (uint64_t)block, dyn);
    return CUDA_SUCCESS;
}

static shared_proc *self_proc(void);
/* Queues dur ns of work on stream timeline `su` of device d; full: the
 * kernel fills the device. Returns its end. */
static uint64_t schedule_locked(int d, _Atomic uint64_t *su, uint64_t dur, int full, uint64_t now);
static uint64_t schedule_at(int d, _Atomic uint64_t *su, uint64_t dur, int full, uint64_t now) {
    shared_dev *s = &F.sh->dev[d];
    spin_lock(&s->lock);
    uint64_t end = schedule_locked(d, su, dur, full, now);
    spin_unlock(&s->lock);
    return end;
}
/* schedule_at with the device's lock held. */
static uint64_t ts_schedule_locked(int d, _Atomic uint64_t *su, uint64_t dur, int full, uint64_t now);
static uint64_t schedule_locked(int d, _Atomic uint64_t *su, uint64_t dur, int full, uint64_t now) {
    if (F.ts_on)
        return ts_schedule_locked(d, su, dur, full, now);
    shared_dev *s = &F.sh->dev[d];
    shared_proc *me = self_proc();
    int pid = fake_pid();
    uint64_t all = atomic_load(&s->busy_until);
    uint64_t start = atomic_load(su);
    if (start < now)
        start = now;
    int other = s->last_pid && s->last_pid != pid;
    if (other)
        atomic_fetch_add(&s->switches, 1);
    if (full || other) {
        if (start < all)
            start = all;
        if (other && start < all + fdm_switch_ns())
            start = all + fdm_switch_ns(); /* the device switches contexts */
    } else if (start < s->excl_until) {
        start = s->excl_until;
    }
    uint64_t end = start + dur;
    atomic_store(su, end);
    if (end > all)
        atomic_store(&s->busy_until, end);
    if ((full || other) && end > s->excl_until)
        s->excl_until = end;
    s->last_pid = pid;
    if (dur) {
        iv_add(&s->busy, start, end, now);
        if (me)
            iv_add(&me->busy[d], start, end, now);
        fdm_busy(d, start, end, now);
    }
    if (dur) {
        atomic_fetch_add(&s->busy_total, dur);
        atomic_fetch_add(&s->launches, 1);
    }
    return end;
}

/* schedule_locked under the timeslice scheduler: the work is placed on the
 * process's virtual timeline (its streams overlap as on the FIFO timeline;
 * a device-filling kernel waits for all of the process's work and holds off
 * its later work); the scheduler decides when that is served. Returns the
 * virtual end. */
static uint64_t ts_schedule_locked(int d, _Atomic uint64_t *su, uint64_t dur, int full, uint64_t now) {
    shared_dev *s = &F.sh->dev[d];
    ts_resolve(d, now);
    ts_proc *P = ts_me(d, NULL);
    if (!P) /* the process table is full: the work runs nowhere */
        return atomic_load(su);
    uint64_t start = atomic_load(su);
    if (start > P->backlog) /* a stream inherited across fork carries the parent's clock */
        start = P->backlog;
    if (start < P->served)
        start = P->served; /* its clock stood still while it had no work */
    if (full) {
        if (start < P->backlog)
            start = P->backlog;
    } else if (start < P->excl) {
        start = P->excl;
    }
    uint64_t end = start + dur;
    atomic_store(su, end);
    if (!dur && end == P->served && P->backlog == P->served)
        P->want = 1; /* an idle context's event: reached when it next has the device */
    if (end > P->backlog)
        P->backlog = end;
    if (full && end > P->excl)
        P->excl = end;
    ts_resolve(d, now);
    if (dur) {
        atomic_fetch_add(&s->busy_total, dur);
        atomic_fetch_add(&s->launches, 1);
    }
    return end;
}

/* ---- host functions ----
 * cuLaunchHostFunc holds its stream until the function returns: work and
 * events enqueued on that stream meanwhile are scheduled when it does, back
 * to back, as on a real stream; other streams run on. (It used to hold every
 * stream of the process: a sampled launch on one stream then held kernels of
 * the others back, and they overlapped less than on a GPU.) A worker thread
 * runs the functions in order. */

typedef struct {
    _Atomic uint64_t ts; /* UINT64_MAX while held behind a host function; timeslice: the real time once known, else 0 */
    int recorded;
    int dev, slot;       /* timeslice: whose virtual clock */
    uint64_t v, sub;     /* timeslice: its virtual time, and when it was submitted */
    /* for cuStreamWaitEvent: records made and settled (a wait is for the
     * record that was the latest when it was made), and where the latest
     * settled one lies on its device's timeline (FIFO: real ns; timeslice:
     * the process's virtual ns) */
    _Atomic uint64_t gen, done_gen, done_at;
} fake_event;
/* Record number gen of ev settled at `at` (device lock held). */
static void ev_done(fake_event *ev, uint64_t gen, uint64_t at) {
    if (atomic_load(&ev->done_gen) < gen)
        atomic_store(&ev->done_gen, gen);
    atomic_store(&ev->done_at, at);
}
/* An event settled at virtual time v of this process's timeline on d (the
 * timeslice scheduler): its real time is found when it is read. */
static void ev_settle(fake_event *ev, int d, uint64_t v, uint64_t now) {
    int slot = -1;
    ts_me(d, &slot); /* the device lock is held */
    ev->dev = d, ev->slot = slot, ev->v = v, ev->sub = now;
    atomic_store(&ev->ts, 0);
}
/* The event's real time; 0 while not reached (block: wait for it). */
static uint64_t ev_time(fake_event *ev, int block) {
    uint64_t t = atomic_load(&ev->ts);
    if (!F.ts_on || t == UINT64_MAX)
        return t == UINT64_MAX ? 0 : (block ? (sleep_until(t), t) : (now_ns() >= t ? t : 0));
    if (t)
        return t;
    if (ev->slot < 0)
        return ev->sub;
    t = ts_when(ev->dev, ev->slot, ev->v, ev->sub, block);
    if (t)
        atomic_store(&ev->ts, t);
    return t;
}

typedef struct held_item {
    uint64_t dur;         /* launch: device time */
    int full;
    _Atomic uint64_t *su; /* its stream's timeline */
    fake_event *ev;       /* or an event to timestamp */
    fake_event *after;    /* or an event the stream waits for (cuStreamWaitEvent) */
    uint64_t gen;         /* the event's record number: the one made (ev) or waited for (after) */
} held_item;
static pthread_mutex_t hold_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hold_cv = PTHREAD_COND_INITIALIZER;
static int held[FAKE_MAX_DEVS]; /* host functions pending, all streams */
#define HELD_STREAMS 32
static struct {
    _Atomic uint64_t *su; /* the held stream's timeline */
    int n;                /* host functions pending on it */
} held_su[FAKE_MAX_DEVS][HELD_STREAMS];
/* Host functions pending on stream su (under hold_mu); add: +1/-1. Returns
 * the count after; a table full of held streams holds nothing more. */
static int held_on(int d, _Atomic uint64_t *su, int add) {
    int free_slot = -1;
    for (int i = 0; i < HELD_STREAMS; i++) {
        if (held_su[d][i].n && held_su[d][i].su == su) {
            held_su[d][i].n += add;
            return held_su[d][i].n;
        }
        if (!held_su[d][i].n && free_slot < 0)
            free_slot = i;
    }
    if (add > 0 && free_slot >= 0) {
        held_su[d][free_slot].su = su;
        held_su[d][free_slot].n = add;
        return add;
    }
    return 0;
}
/* A synchronize waits for the host functions ahead of it (of stream su, or
 * of every stream: NULL) and the work they hold, as a real one does; it
 * returned while a sampled launch was still held, and a case read the
 * device's counters before that launch had run. */
static void wait_held(int d, _Atomic uint64_t *su) {
    for (;;) {
        waits_poll();
        pthread_mutex_lock(&hold_mu);
        int h = su ? held_on(d, su, 0) : held[d];
        pthread_mutex_unlock(&hold_mu);
        if (!h)
            return;
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
}
/* Streams held until an event that is itself held settles (cuStreamWaitEvent
 * on an event recorded behind a gate on another stream), under hold_mu. */
typedef struct ev_wait {
    fake_event *ev;
    uint64_t gen; /* until this record of ev settles */
    int dev;
    _Atomic uint64_t *su;
    struct ev_wait *next;
} ev_wait;
static ev_wait *ev_waits;
/* Holds stream su of d until ev settles (under hold_mu); the wait itself is
 * a held item in the stream's place. */
static void ev_wait_add(fake_event *ev, uint64_t gen, int d, _Atomic uint64_t *su) {
    ev_wait *x = calloc(1, sizeof(*x));
    if (!x)
        abort(); /* a test double out of memory: no silent reordering */
    *x = (ev_wait){ev, gen, d, su, ev_waits};
    ev_waits = x;
    held[d]++;
    held_on(d, su, 1);
}
static held_item *items[FAKE_MAX_DEVS];
static int nitems[FAKE_MAX_DEVS], capitems[FAKE_MAX_DEVS];
typedef struct hostjob {
    void (*fn)(void *);
    void *data;
    int dev;
    _Atomic uint64_t *su; /* the stream it holds */
    uint64_t ready;       /* when the device reaches it: its stream's work queued before it ends (timeslice: virtual) */
    int slot;             /* timeslice: the process's slot */
    struct hostjob *next;
} hostjob;
static hostjob *jobs_head, *jobs_tail;
static pid_t worker_pid;

static void push_item(int d, held_item it) {
    if (nitems[d] == capitems[d]) {
        capitems[d] = capitems[d] ? 2 * capitems[d] : 64;
        items[d] = realloc(items[d], sizeof(held_item) * (size_t)capitems[d]);
    }
    items[d][nitems[d]++] = it;
}
static int hold_launch(int d, _Atomic uint64_t *su, uint64_t dur, int full) {
    if (!__atomic_load_n(&held[d], __ATOMIC_ACQUIRE))
        return 0;
    pthread_mutex_lock(&hold_mu);
    int h = held_on(d, su, 0);
    if (h)
        push_item(d, (held_item){dur, full, su, NULL, NULL, 0});
    pthread_mutex_unlock(&hold_mu);
    return h;
}
static void stream_after_locked(int d, _Atomic uint64_t *su, const fake_event *ev);
static int hold_event(int d, _Atomic uint64_t *su, fake_event *ev) {
    if (!__atomic_load_n(&held[d], __ATOMIC_ACQUIRE))
        return 0;
    pthread_mutex_lock(&hold_mu);
    int h = held_on(d, su, 0);
    if (h) {
        atomic_store(&ev->ts, UINT64_MAX);
        push_item(d, (held_item){0, 0, su, ev, NULL, atomic_fetch_add(&ev->gen, 1) + 1});
    }
    pthread_mutex_unlock(&hold_mu);
    return h;
}
/* One hold of stream su (a host function returned, or a wait's condition
 * held) is gone; the last lets the stream's held work go (under hold_mu). */
static void release_hold_locked(int d, _Atomic uint64_t *su) {
    held[d]--;
    if (held_on(d, su, -1) == 0) {
        /* The device runs the stream's held work back to back from now:
         * one clock reading for all of it, so events bracket exactly the
         * work between them, and one hold of the device's queue: the
         * work is in the device's queue once released, and another
         * process's launch cannot get between its items because this
         * worker thread was descheduled half way (it did on a loaded
         * machine: a sampled 7 us kernel measured 5 ms of a co-tenant's
         * work). */
        uint64_t now = now_ns();
        int w = 0;
        held_item *blocked = NULL; /* a wait reached whose record is still held: the rest stays held */
        spin_lock(&F.sh->dev[d].lock);
        for (int i = 0; i < nitems[d]; i++) {
            held_item *it = &items[d][i];
            if (it->su != su || blocked) {
                items[d][w++] = *it;
            } else if (it->after && atomic_load(&it->after->done_gen) < it->gen) {
                items[d][w] = *it;
                blocked = &items[d][w++];
            } else if (it->ev) {
                uint64_t v = schedule_locked(d, it->su, 0, 0, now);
                if (atomic_load(&it->ev->gen) == it->gen) { /* its latest record: readers see it */
                    if (F.ts_on)
                        ev_settle(it->ev, d, v, now);
                    else
                        atomic_store(&it->ev->ts, v);
                }
                ev_done(it->ev, it->gen, v);
            } else if (it->after) {
                stream_after_locked(d, it->su, it->after);
            } else {
                schedule_locked(d, it->su, it->dur, it->full, now);
            }
        }
        spin_unlock(&F.sh->dev[d].lock);
        nitems[d] = w;
        if (blocked) /* held again, from the wait on, until that record settles */
            ev_wait_add(blocked->after, blocked->gen, d, su);
        /* streams that waited for an event this release settled go on */
        for (ev_wait **pw = &ev_waits; *pw;) {
            ev_wait *x = *pw;
            if (atomic_load(&x->ev->done_gen) < x->gen) {
                pw = &x->next;
                continue;
            }
            *pw = x->next;
            release_hold_locked(x->dev, x->su);
            free(x);
            pw = &ev_waits; /* the list may have changed below us */
        }
    }
}
/* Starts fn on a detached thread once per process (under hold_mu): at first use, and again in a
 * forked child, which inherits the flag but not the thread. */
static void thread_of_process(pid_t *owner, void *(*fn)(void *)) {
    if (*owner == getpid())
        return;
    pthread_t t;
    *owner = getpid();
    pthread_create(&t, NULL, fn, NULL);
    pthread_detach(t);
}
static void *worker(void *arg) {
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&hold_mu);
        while (!jobs_head)
            pthread_cond_wait(&hold_cv, &hold_mu);
        hostjob *j = jobs_head;
        jobs_head = j->next;
        if (!jobs_head)
            jobs_tail = NULL;
        pthread_mutex_unlock(&hold_mu);
        /* A host function runs when its stream reaches it, not when it is
         * queued (it ran at once, so a function that waits with a deadline,
         * as vcuda's sampling gate does, gave up while the work ahead of it
         * was still running, behind a co-tenant's queue). */
        uint64_t t = now_ns();
        if (F.ts_on && j->slot >= 0) {
            ts_when(j->dev, j->slot, j->ready, 0, 1);
        } else if (j->ready > t) {
            struct timespec ts = {(time_t)((j->ready - t) / 1000000000ull), (long)((j->ready - t) % 1000000000ull)};
            nanosleep(&ts, NULL);
        }
        j->fn(j->data);
        pthread_mutex_lock(&hold_mu);
        release_hold_locked(j->dev, j->su);
        pthread_mutex_unlock(&hold_mu);
        free(j);
    }
    return NULL;
}
static _Atomic uint64_t hostfn_calls;
EXPORT CUresult cuLaunchHostFunc(CUstream s, void (*fn)(void *), void *data) {
    int d = stream_dev(s);
    if (d < 0 || !fn)
        return CUDA_ERROR_INVALID_VALUE;
    atomic_fetch_add(&hostfn_calls, 1);
    hostjob *j = calloc(1, sizeof(*j));
    j->fn = fn;
    j->data = data;
    j->dev = d;
    pthread_mutex_lock(&hold_mu);
    thread_of_process(&worker_pid, worker);
    held[d]++;
    j->su = stream_until(s, d);
    j->ready = atomic_load(j->su);
    j->slot = -1;
    if (F.ts_on) {
        spin_lock(&F.sh->dev[d].lock);
        ts_me(d, &j->slot);
        spin_unlock(&F.sh->dev[d].lock);
    }
    held_on(d, j->su, 1);
    if (jobs_tail)
        jobs_tail->next = j;
    else
        jobs_head = j;
    jobs_tail = j;
    pthread_cond_signal(&hold_cv);
    pthread_mutex_unlock(&hold_mu);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuLaunchHostFunc_ptsz(CUstream s, void (*fn)(void *), void *data) {
    return cuLaunchHostFunc(s, fn, data);
}

/* ---- mapped host memory and stream memory operations ----
 * cuMemHostAlloc gives page-locked host memory; with DEVICEMAP the device
 * can address it (cuMemHostGetDevicePointer; under unified addressing the
 * device pointer equals the host one, as here). cuStreamWaitValue32_v2
 * holds its stream's later work until a condition on a 32-bit word holds,
 * as a host function does, but the device evaluates it: no thread of the
 * process runs anything. The fake has no device, so the condition is
 * re-read when any driver call of the process looks (launches, event
 * record/query/synchronize, stream/context synchronize) and by a poller
 * thread every ~20 us, and the held work is queued when the condition is
 * first seen true. A condition never met holds the stream for ever: its
 * synchronize waits, as a real one hangs.
 * FAKE_CUDA_MAP_HOST=0: the device cannot map host memory
 * (CAN_MAP_HOST_MEMORY 0, cuMemHostGetDevicePointer NOT_SUPPORTED);
 * FAKE_CUDA_STREAM_MEMOPS=0: cuStreamWaitValue32_v2 is NOT_SUPPORTED;
 * FAKE_CUDA_HOST_ALLOC_FAIL=1: cuMemHostAlloc fails (OUT_OF_MEMORY). */
#define FAKE_HOSTALLOC_PORTABLE 0x1
#define FAKE_HOSTALLOC_DEVICEMAP 0x2
#define FAKE_HOSTALLOC_WRITECOMBINED 0x4
#define FAKE_WAIT_GEQ 0x0
#define FAKE_WAIT_EQ 0x1
#define FAKE_WAIT_AND 0x2
#define FAKE_WAIT_NOR 0x3
#define FAKE_WAIT_FLUSH (1u << 30)
static int env_off(const char *name) {
    const char *e = getenv(name);
    return e && strcmp(e, "0") == 0;
}
static int env_on(const char *name) {
    const char *e = getenv(name);
    return e && strcmp(e, "1") == 0;
}
typedef struct host_alloc {
    void *p;
    size_t size;
    unsigned flags;
    fake_ctx *ctx;
    struct host_alloc *next;
} host_alloc;
static pthread_mutex_t host_mu = PTHREAD_MUTEX_INITIALIZER;
static host_alloc *host_allocs;
/* The allocation holding [p, p+len), or NULL (under host_mu). */
static host_alloc *host_find(const void *p, size_t len) {
    for (host_alloc *a = host_allocs; a; a = a->next)
        if ((const char *)p >= (const char *)a->p && (const char *)p + len <= (const char *)a->p + a->size)
            return a;
    return NULL;
}
EXPORT CUresult cuMemHostAlloc(void **pp, size_t size, unsigned flags) {
    INIT();
    if (!pp || size == 0 ||
        (flags & ~(unsigned)(FAKE_HOSTALLOC_PORTABLE | FAKE_HOSTALLOC_DEVICEMAP | FAKE_HOSTALLOC_WRITECOMBINED)))
        return CUDA_ERROR_INVALID_VALUE;
    if (!cur)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (env_on("FAKE_CUDA_HOST_ALLOC_FAIL"))
        return CUDA_ERROR_OUT_OF_MEMORY;
    host_alloc *a = calloc(1, sizeof(*a));
    if (!a || posix_memalign(&a->p, 4096, round_up(size, 4096)) != 0) {
        free(a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    memset(a->p, 0, round_up(size, 4096));
    a->size = size;
    a->flags = flags;
    a->ctx = cur;
    pthread_mutex_lock(&host_mu);
    a->next = host_allocs;
    host_allocs = a;
    pthread_mutex_unlock(&host_mu);
    *pp = a->p;
    return CUDA_SUCCESS;
}
static void host_free(host_alloc **pa) {
    host_alloc *a = *pa;
    *pa = a->next;
    free(a->p);
    free(a);
}
EXPORT CUresult cuMemFreeHost(void *p) {
    pthread_mutex_lock(&host_mu);
    for (host_alloc **pa = &host_allocs; *pa; pa = &(*pa)->next)
        if ((*pa)->p == p) {
            host_free(pa);
            pthread_mutex_unlock(&host_mu);
            return CUDA_SUCCESS;
        }
    pthread_mutex_unlock(&host_mu);
    return CUDA_ERROR_INVALID_VALUE;
}
/* A context's host allocations go with it (without PORTABLE they are its). */
static void host_forget_ctx(fake_ctx *c) {
    pthread_mutex_lock(&host_mu);
    for (host_alloc **pa = &host_allocs; *pa;)
        if ((*pa)->ctx == c && !((*pa)->flags & FAKE_HOSTALLOC_PORTABLE))
            host_free(pa);
        else
            pa = &(*pa)->next;
    pthread_mutex_unlock(&host_mu);
}
EXPORT int fakeHostAllocs(void) {
    int n = 0;
    pthread_mutex_lock(&host_mu);
    for (host_alloc *a = host_allocs; a; a = a->next)
        n++;
    pthread_mutex_unlock(&host_mu);
    return n;
}
EXPORT CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *dp, void *p, unsigned flags) {
    if (!dp || !p || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!cur)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (env_off("FAKE_CUDA_MAP_HOST"))
        return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&host_mu);
    host_alloc *a = host_find(p, 1);
    int ok = a && (a->flags & FAKE_HOSTALLOC_DEVICEMAP) &&
             (a->ctx == cur || (a->flags & FAKE_HOSTALLOC_PORTABLE));
    pthread_mutex_unlock(&host_mu);
    if (!ok)
        return CUDA_ERROR_INVALID_VALUE; /* not pinned, or not mapped for the device */
    *dp = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemHostGetDevicePointer(unsigned *dp, void *p, unsigned flags) {
    (void)dp, (void)p, (void)flags;
    return CUDA_ERROR_NOT_SUPPORTED; /* the 32-bit entry point: vcuda's kind of caller never uses it */
}

typedef struct wait_item {
    int dev;
    _Atomic uint64_t *su;
    _Atomic uint32_t *word;
    uint32_t value;
    unsigned op;
    struct wait_item *next;
} wait_item;
static wait_item *waits; /* pending, under hold_mu */
static _Atomic int nwaits;
static _Atomic uint64_t wait_calls;
static pid_t poller_pid;
static int wait_met(const wait_item *w) {
    uint32_t v = atomic_load(w->word);
    switch (w->op) {
    case FAKE_WAIT_GEQ: return (int32_t)(v - w->value) >= 0;
    case FAKE_WAIT_EQ: return v == w->value;
    case FAKE_WAIT_AND: return (v & w->value) != 0;
    default: return ~(v | w->value) != 0; /* NOR */
    }
}
/* Re-read every pending wait's word; release the streams whose condition
 * now holds. Cheap when nothing waits. */
static void waits_poll(void) {
    if (!atomic_load_explicit(&nwaits, memory_order_acquire))
        return;
    pthread_mutex_lock(&hold_mu);
    for (wait_item **pw = &waits; *pw;) {
        wait_item *w = *pw;
        if (!wait_met(w)) {
            pw = &w->next;
            continue;
        }
        *pw = w->next;
        atomic_fetch_sub(&nwaits, 1);
        release_hold_locked(w->dev, w->su);
        free(w);
    }
    pthread_mutex_unlock(&hold_mu);
}
static pthread_cond_t poll_cv = PTHREAD_COND_INITIALIZER;
static void *poller(void *arg) {
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&hold_mu);
        while (!waits)
            pthread_cond_wait(&poll_cv, &hold_mu);
        pthread_mutex_unlock(&hold_mu);
        waits_poll();
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}
EXPORT CUresult cuStreamWaitValue32_v2(CUstream s, CUdeviceptr addr, uint32_t value, unsigned flags) {
    INIT();
    int d = stream_dev(s);
    if (d < 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    unsigned op = flags & ~FAKE_WAIT_FLUSH;
    if (op > FAKE_WAIT_NOR)
        return CUDA_ERROR_INVALID_VALUE;
    if (env_off("FAKE_CUDA_STREAM_MEMOPS") || (flags & FAKE_WAIT_FLUSH))
        return CUDA_ERROR_NOT_SUPPORTED; /* FLUSH: CAN_FLUSH_REMOTE_WRITES is 0 here */
    if (!addr || (addr & 3))
        return CUDA_ERROR_INVALID_VALUE;
    if (capturing(s))
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; /* memop nodes are not modelled */
    /* only memory the device can address: mapped host memory (device
     * memory is not backed by anything the fake can read) */
    pthread_mutex_lock(&host_mu);
    host_alloc *a = host_find((void *)(uintptr_t)addr, 4);
    int ok = a && (a->flags & FAKE_HOSTALLOC_DEVICEMAP) && !env_off("FAKE_CUDA_MAP_HOST");
    pthread_mutex_unlock(&host_mu);
    if (!ok)
        return CUDA_ERROR_INVALID_VALUE;
    wait_item *w = calloc(1, sizeof(*w));
    if (!w)
        return CUDA_ERROR_OUT_OF_MEMORY;
    w->dev = d;
    w->su = stream_until(s, d);
    w->word = (_Atomic uint32_t *)(uintptr_t)addr;
    w->value = value;
    w->op = op;
    pthread_mutex_lock(&hold_mu);
    thread_of_process(&poller_pid, poller);
    held[d]++;
    held_on(d, w->su, 1);
    w->next = waits;
    waits = w;
    atomic_fetch_add_explicit(&nwaits, 1, memory_order_release);
    pthread_cond_signal(&poll_cv);
    pthread_mutex_unlock(&hold_mu);
    atomic_fetch_add(&wait_calls, 1);
    waits_poll(); /* a condition that already holds lets the stream go at once */
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamWaitValue32_v2_ptsz(CUstream s, CUdeviceptr addr, uint32_t value, unsigned flags) {
    return cuStreamWaitValue32_v2(per_thread(s, 1), addr, value, flags);
}
/* cuStreamWaitValue32_v2 calls that queued a wait, this process. */
EXPORT uint64_t fakeWaitValueCalls(void) { return atomic_load(&wait_calls); }
/* Waits whose condition does not hold yet (the words re-read first). */
EXPORT int fakeWaitsPending(void) {
    waits_poll();
    int n = atomic_load(&nwaits);
    return n;
}
/* cuLaunchHostFunc calls accepted, this process. */
EXPORT uint64_t fakeHostFuncCalls(void) { return atomic_load(&hostfn_calls); }

/* ---- launches and events ---- */

/* Where stream su's next work starts on the process's device timeline, and
 * how much of the stream's work is queued ahead of it (the timeslice
 * scheduler waits here while its launch queue is full; the FIFO timeline
 * leaves that to the device model). */
static void stream_start(int d, _Atomic uint64_t *su, uint64_t *start, uint64_t *ahead) {
    if (F.ts_on) {
        ts_queue_wait(d, su, start, ahead);
        return;
    }
    uint64_t at = atomic_load(su), now = now_ns();
    *start = at > now ? at : now;
    *ahead = *start - now;
}
static void run(int d, CUstream s, uint64_t dur, int full) {
    waits_poll();
    _Atomic uint64_t *su = stream_until(s, d);
    if (!hold_launch(d, su, dur, full))
        schedule_at(d, su, dur, full, now_ns());
    proc_busy_tick();
}

#define GRID(x, y, z) ((uint64_t)(x) * (y) * (z))
static CUresult launch(CUfunction f, uint64_t grid, uint64_t threads, unsigned shm, CUstream s, int coop) {
    if (!f)
        return CUDA_ERROR_INVALID_HANDLE;
    int d = stream_dev(s);
    if (d < 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (grid == 0 || threads == 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult lr = kernel_load(f);
    if (lr != CUDA_SUCCESS)
        return lr;
    fake_func c = func_cfg(f);
    int occ = occupancy(&c, threads, shm);
    if (occ == 0)
        return 701; /* CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES */
    uint64_t per_wave = (uint64_t)F.sms[d] * (uint64_t)occ;
    if (coop && grid > per_wave)
        return 720; /* CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE */
    if (!capturing(s)) {
        uint64_t start, ahead;
        stream_start(d, stream_until(s, d), &start, &ahead);
        run(d, s, fdm_kernel_ns(d, (uint64_t)(uintptr_t)f, (uint64_t)(uintptr_t)stream_until(s, d), start, ahead, grid, per_wave, c.wave_ns, c.overhead_ns), grid >= per_wave);
    }
    return CUDA_SUCCESS;
}
EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                               unsigned by, unsigned bz, unsigned shm, CUstream s, void **params,
                               void **extra) {
    (void)params, (void)extra;
    return launch(f, GRID(gx, gy, gz), GRID(bx, by, bz), shm, s, 0);
}
EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                    unsigned bx, unsigned by, unsigned bz, unsigned shm, CUstream s,
                                    void **params, void **extra) {
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shm, s, params, extra);
}
EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params,
                                 void **extra) {
    if (!c)
        return CUDA_ERROR_INVALID_VALUE;
    return cuLaunchKernel(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY,
                          c->blockDimZ, c->sharedMemBytes, c->hStream, params, extra);
}
EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **params,
                                      void **extra) {
    return cuLaunchKernelEx(c, f, params, extra);
}
EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                          unsigned bx, unsigned by, unsigned bz, unsigned shm,
                                          CUstream s, void **params) {
    (void)params;
    return launch(f, GRID(gx, gy, gz), GRID(bx, by, bz), shm, s, 1);
}
EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                               unsigned bx, unsigned by, unsigned bz, unsigned shm,
                                               CUstream s, void **params) {
    return cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, shm, s, params);
}
/* Legacy launches: the block shape was set with cuFuncSetBlockShape (the
 * fake assumes 32 threads). */
EXPORT CUresult cuLaunchGridAsync(CUfunction f, int w, int h, CUstream s) {
    if (w <= 0 || h <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    return launch(f, (uint64_t)w * (uint64_t)h, 32, 0, s, 0);
}
EXPORT CUresult cuLaunchGrid(CUfunction f, int w, int h) { return cuLaunchGridAsync(f, w, h, NULL); }
EXPORT CUresult cuLaunch(CUfunction f) { return cuLaunchGridAsync(f, 1, 1, NULL); }
EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(void *params, unsigned n, unsigned flags) {
    (void)flags;
    if (!params || n == 0)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS; /* the tests only check that vcuda refuses it */
}
/* A graph runs as one piece of work that fills the device for its blocks'
 * full waves (4 resident blocks an SM). Its allocation nodes take their
 * memory (2 MiB pages) from the device's graph memory when it is first
 * uploaded or launched; it keeps it until destroyed, and the device keeps
 * it for later graphs until cuDeviceGraphMemTrim. */
typedef struct {
    uint64_t blocks;
    uint64_t mem;
    int dev, holding;
} fake_graph;
static uint64_t gmem_live[FAKE_MAX_DEVS], gmem_reserved[FAKE_MAX_DEVS];
EXPORT CUresult fakeGraphExecCreate(CUgraphExec *e, unsigned long long blocks) {
    fake_graph *g = calloc(1, sizeof(*g));
    g->blocks = blocks;
    *e = (CUgraphExec)g;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphCreate(CUgraph *g, unsigned flags) {
    if (!g || flags)
        return CUDA_ERROR_INVALID_VALUE;
    *g = (CUgraph)calloc(1, sizeof(struct fake_graph_def));
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphDestroy(CUgraph g) {
    if (!g || ((struct fake_graph_def *)g)->moved)
        return CUDA_ERROR_INVALID_VALUE; /* a moved child graph belongs to its parent */
    free(g);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t n,
                                       CUDA_MEM_ALLOC_NODE_PARAMS *p) {
    (void)deps, (void)n;
    INIT();
    if (!node || !g || !p || p->bytesize == 0 || p->poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        p->poolProps.location.id < 0 || p->poolProps.location.id >= F.ndev)
        return CUDA_ERROR_INVALID_VALUE;
    struct fake_graph_def *x = (struct fake_graph_def *)g;
    x->mem += round_up(p->bytesize, PAGE2M);
    x->dev = p->poolProps.location.id;
    p->dptr = new_addr(p->bytesize);
    *node = (CUgraphNode)(uintptr_t)p->dptr;
    return CUDA_SUCCESS;
}
/* cuGraphAddNode[_v2]: allocation nodes as cuGraphAddMemAllocNode; a child
 * graph either cloned (a child with allocation nodes is refused, as the
 * driver does) or moved into the parent, allocation nodes included. */
static CUresult add_node(CUgraphNode *node, CUgraph g, CUgraphNodeParams *p) {
    INIT();
    if (!node || !g || !p)
        return CUDA_ERROR_INVALID_VALUE;
    struct fake_graph_def *x = (struct fake_graph_def *)g;
    if (p->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC)
        return cuGraphAddMemAllocNode(node, g, NULL, 0, &p->alloc);
    if (p->type == CU_GRAPH_NODE_TYPE_GRAPH) {
        struct fake_graph_def *c = (struct fake_graph_def *)p->graph.graph;
        if (!c || c == x || c->moved)
            return CUDA_ERROR_INVALID_VALUE;
        if (p->graph.ownership == CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE) {
            if (c->mem) {
                x->mem += c->mem;
                x->dev = c->dev;
            }
            c->mem = 0;
            c->moved = 1;
        } else if (p->graph.ownership != CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE || c->mem) {
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    *node = (CUgraphNode)(uintptr_t)new_addr(64);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphAddNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t n,
                               CUgraphNodeParams *p) {
    (void)deps, (void)n;
    return add_node(node, g, p);
}
EXPORT CUresult cuGraphAddNode_v2(CUgraphNode *node, CUgraph g, const CUgraphNode *deps,
                                  const CUgraphEdgeData *edges, size_t n, CUgraphNodeParams *p) {
    (void)deps, (void)edges, (void)n;
    return add_node(node, g, p);
}
static CUresult instantiate(CUgraphExec *e, CUgraph g) {
    if (!e || !g)
        return CUDA_ERROR_INVALID_VALUE;
    fake_graph *x = calloc(1, sizeof(*x));
    x->blocks = 1;
    x->mem = ((struct fake_graph_def *)g)->mem;
    x->dev = ((struct fake_graph_def *)g)->dev;
    *e = (CUgraphExec)x;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *e, CUgraph g, unsigned long long flags) {
    (void)flags;
    return instantiate(e, g);
}
EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *e, CUgraph g, void *params) {
    if (!params)
        return CUDA_ERROR_INVALID_VALUE;
    return instantiate(e, g);
}
/* The params' upload stream, when NULL, is the per-thread default stream. */
EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *e, CUgraph g, void *params) {
    return cuGraphInstantiateWithParams(e, g, params);
}
EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *e, CUgraph g, CUgraphNode *err, char *log, size_t n) {
    (void)err, (void)log, (void)n;
    return instantiate(e, g);
}
static CUresult graph_take(fake_graph *x) {
    if (!x->mem || x->holding)
        return CUDA_SUCCESS;
    pthread_mutex_lock(&pool_mu);
    uint64_t need = gmem_live[x->dev] + x->mem;
    if (need > gmem_reserved[x->dev]) {
        CUresult r = take(x->dev, need - gmem_reserved[x->dev]);
        if (r != CUDA_SUCCESS) {
            pthread_mutex_unlock(&pool_mu);
            return r;
        }
        gmem_reserved[x->dev] = need;
    }
    gmem_live[x->dev] = need;
    x->holding = 1;
    pthread_mutex_unlock(&pool_mu);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphUpload(CUgraphExec e, CUstream s) {
    (void)s;
    if (!e)
        return CUDA_ERROR_INVALID_HANDLE;
    return graph_take((fake_graph *)e);
}
EXPORT CUresult cuGraphExecDestroy(CUgraphExec e) {
    fake_graph *x = (fake_graph *)e;
    if (!x)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pool_mu);
    if (x->holding)
        gmem_live[x->dev] -= x->mem;
    pthread_mutex_unlock(&pool_mu);
    free(x);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGraphMemTrim(CUdevice d) {
    CHECK_DEV(d);
    pthread_mutex_lock(&pool_mu);
    if (gmem_reserved[d] > gmem_live[d]) {
        give(d, gmem_reserved[d] - gmem_live[d]);
        gmem_reserved[d] = gmem_live[d];
    }
    pthread_mutex_unlock(&pool_mu);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetGraphMemAttribute(CUdevice d, int attr, void *value) {
    CHECK_DEV(d);
    if (!value || attr < 0 || attr > 3)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pool_mu);
    *(cuuint64_t *)value = attr >= 2 ? gmem_reserved[d] : gmem_live[d];
    pthread_mutex_unlock(&pool_mu);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphLaunch(CUgraphExec e, CUstream s) {
    if (!e)
        return CUDA_ERROR_INVALID_HANDLE;
    int d = stream_dev(s);
    if (d < 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    CUresult r = graph_take((fake_graph *)e);
    if (r != CUDA_SUCCESS)
        return r;
    uint64_t b = ((fake_graph *)e)->blocks, per_wave = (uint64_t)F.sms[d] * 4;
    uint64_t start, ahead;
    stream_start(d, stream_until(s, d), &start, &ahead);
    run(d, s, fdm_graph_ns(e, ahead, b, per_wave, F.wave_ns, F.overhead_ns), 1);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec e, CUstream s) { return cuGraphLaunch(e, s); }

EXPORT CUresult cuEventCreate(CUevent *e, unsigned flags) {
    (void)flags;
    if (!e)
        return CUDA_ERROR_INVALID_VALUE;
    *e = (CUevent)calloc(1, sizeof(fake_event));
    return CUDA_SUCCESS;
}
EXPORT CUresult cuEventDestroy_v2(CUevent e) {
    free(e);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuEventRecord(CUevent e, CUstream s) {
    if (!e)
        return CUDA_ERROR_INVALID_HANDLE;
    int d = stream_dev(s);
    if (d < 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (capturing(s))
        ((fake_stream *)s)->violations++;
    waits_poll();
    fake_event *ev = (fake_event *)e;
    ev->recorded = 1;
    _Atomic uint64_t *su = stream_until(s, d);
    if (hold_event(d, su, ev))
        return CUDA_SUCCESS;
    /* Reached when its stream's earlier work has run and the process has the
     * device (an event is a command of its context, time-sliced like a
     * kernel): a zero-length item on the timeline. */
    uint64_t now = now_ns();
    spin_lock(&F.sh->dev[d].lock);
    uint64_t v = schedule_locked(d, su, 0, 0, now);
    if (F.ts_on)
        ev_settle(ev, d, v, now);
    else
        atomic_store(&ev->ts, v);
    ev_done(ev, atomic_fetch_add(&ev->gen, 1) + 1, v);
    spin_unlock(&F.sh->dev[d].lock);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuEventRecord_ptsz(CUevent e, CUstream s) { return cuEventRecord(e, s); }
/* Stream su's later work starts no earlier than the device reaches ev (the
 * device lock held; ev settled, on device d). */
static void stream_after_locked(int d, _Atomic uint64_t *su, const fake_event *ev) {
    uint64_t at = atomic_load(&ev->done_at);
    if (F.ts_on) {
        int slot = -1;
        ts_me(d, &slot);
        if (ev->slot != slot || ev->dev != d)
            return; /* not this timeline's (refused when made; another device's, reached by then) */
    }
    if (atomic_load(su) < at)
        atomic_store(su, at);
}
/* cuStreamWaitEvent: the stream's later work waits on the device until the
 * device reaches the event's latest record (as of this call); the host
 * goes on (how frameworks join streams: PyTorch's
 * torch.cuda.Stream.wait_stream is an event record and this). An event
 * never recorded is reached. An event still held behind a host function or
 * a stream-memory wait holds this stream too, from the wait on, until that
 * record is released (records are numbered: a wait is for the latest when
 * it is made; re-recording the event meanwhile made an earlier wait wait for
 * the later record, and fork-join rounds behind gates for ever; it then
 * waits until where the latest settled record lies: its own, or a later one
 * if the event was re-recorded and that settled first);
 * a wait on a held stream keeps its place in it
 * (work queued before it is not held by it: a whole-stream hold made two
 * streams joining each other behind host-function gates wait for each other
 * for ever). Events of another device not yet reached are not modelled
 * under the timeslice scheduler: refused. */
EXPORT CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags) {
    fake_event *ev = (fake_event *)e;
    if (!ev)
        return CUDA_ERROR_INVALID_HANDLE;
    if (flags & ~1u) /* CU_EVENT_WAIT_DEFAULT, CU_EVENT_WAIT_EXTERNAL */
        return CUDA_ERROR_INVALID_VALUE;
    int d = stream_dev(s);
    if (d < 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (capturing(s) || !ev->recorded)
        return CUDA_SUCCESS; /* captured work does not run here */
    waits_poll();
    _Atomic uint64_t *su = stream_until(s, d);
    pthread_mutex_lock(&hold_mu);
    uint64_t gen = atomic_load(&ev->gen);
    if (held_on(d, su, 0)) { /* the stream is held: the wait takes its place in it (a record still held
                              * then holds the stream again from there) */
        push_item(d, (held_item){0, 0, su, NULL, ev, gen});
        pthread_mutex_unlock(&hold_mu);
        return CUDA_SUCCESS;
    }
    if (atomic_load(&ev->done_gen) < gen) { /* the record waits behind a hold: so does this stream */
        ev_wait_add(ev, gen, d, su);
        push_item(d, (held_item){0, 0, su, NULL, ev, gen});
        pthread_mutex_unlock(&hold_mu);
        return CUDA_SUCCESS;
    }
    if (F.ts_on && !atomic_load(&ev->ts) && ev->dev != d) {
        pthread_mutex_unlock(&hold_mu);
        fprintf(stderr, "fake libcuda: cuStreamWaitEvent on an event of another device is not modelled\n");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    pthread_mutex_unlock(&hold_mu);
    spin_lock(&F.sh->dev[d].lock);
    stream_after_locked(d, su, ev);
    spin_unlock(&F.sh->dev[d].lock);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamWaitEvent_ptsz(CUstream s, CUevent e, unsigned flags) {
    return cuStreamWaitEvent(per_thread(s, 1), e, flags);
}
EXPORT CUresult cuEventQuery(CUevent e) {
    fake_event *ev = (fake_event *)e;
    if (!ev)
        return CUDA_ERROR_INVALID_HANDLE;
    if (unsafe_call())
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    waits_poll();
    return !ev->recorded || ev_time(ev, 0) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
EXPORT CUresult cuEventSynchronize(CUevent e) {
    fake_event *ev = (fake_event *)e;
    if (!ev)
        return CUDA_ERROR_INVALID_HANDLE;
    if (unsafe_call())
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (!ev->recorded)
        return CUDA_SUCCESS;
    while (waits_poll(), atomic_load(&ev->ts) == UINT64_MAX) {
        struct timespec ts = {0, 10000};
        nanosleep(&ts, NULL);
    }
    ev_time(ev, 1);
    sync_trim(-1);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b) {
    fake_event *x = (fake_event *)a, *y = (fake_event *)b;
    if (!ms || !x || !y || !x->recorded || !y->recorded)
        return CUDA_ERROR_INVALID_HANDLE;
    uint64_t xt = ev_time(x, 0), yt = ev_time(y, 0);
    if (!xt || !yt)
        return CUDA_ERROR_NOT_READY;
    /* the real driver's resolution is about half a microsecond */
    *ms = (float)((double)(((int64_t)(yt - xt)) / 500 * 500) / 1e6);
    return CUDA_SUCCESS;
}

/* ---- test-only API ---- */

EXPORT int fakeEventTime(CUevent e, uint64_t *ns) {
    fake_event *ev = (fake_event *)e;
    if (!ev || !ns || !ev->recorded)
        return -1;
    uint64_t t = ev_time(ev, 0);
    if (!t)
        return -1;
    *ns = t;
    return 0;
}

EXPORT int fakeDeviceCount(void) {
    INIT();
    return F.ndev;
}
EXPORT int fakeDeviceInfo(int d, char uuid[64], uint64_t *mem, int *sms) {
    INIT();
    if (d < 0 || d >= F.ndev)
        return -1;
    if (uuid)
        memcpy(uuid, F.uuid[d], 64);
    if (mem)
        *mem = F.mem[d];
    if (sms)
        *sms = F.sms[d];
    return 0;
}
EXPORT int fakeDeviceDesc(int d, fake_desc *o) {
    INIT();
    if (d < 0 || d >= F.ndev || !o)
        return -1;
    memset(o, 0, sizeof(*o));
    memcpy(o->uuid, F.uuid[d], 64);
    memcpy(o->name, F.name[d], 96);
    o->mem = F.mem[d];
    o->sms = F.sms[d];
    o->minor = F.minor[d];
    o->cc_major = F.cc[d][0];
    o->cc_minor = F.cc[d][1];
    return 0;
}
/* ---- node-file mode: every process's record, as the host sees it ----
 * NVML names processes by host pid. The records hold a process's PID
 * namespace and its pid there; only a reader in the initial PID namespace
 * (whose /proc shows every process) can tell the host pid: it finds the
 * process in /proc whose namespace and innermost NSpid match and whose
 * start time is the record's (else it died and the driver freed its
 * memory). Elsewhere (a container's own PID namespace) no host pid can be
 * known, so nothing is listed, and vcuda's "NVML does not list me" path
 * runs as on a real driver. */
#define INIT_PIDNS_INO 0xEFFFFFFCu /* the kernel's PROC_PID_INIT_INO */
static int read_small(const char *path, char *b, size_t cap) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, b, cap - 1);
    close(fd);
    if (n < 0)
        return -1;
    b[n] = '\0';
    return (int)n;
}
/* The host pid of (pidns, nspid, start) from /proc; 0 when no such live process. */
static pid_t host_pid_of(const fake_proc_record *r) {
    DIR *dir = opendir("/proc");
    if (!dir)
        return 0;
    pid_t found = 0;
    struct dirent *e;
    char path[512], b[4096];
    while (!found && (e = readdir(dir))) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        struct stat ns;
        if (*end || pid <= 0)
            continue;
        snprintf(path, sizeof(path), "/proc/%ld/ns/pid", pid);
        if (stat(path, &ns) != 0 || (uint64_t)ns.st_ino != r->pidns)
            continue;
        snprintf(path, sizeof(path), "/proc/%ld/status", pid);
        if (read_small(path, b, sizeof(b)) < 0)
            continue;
        char *l = strstr(b, "\nNSpid:");
        if (!l)
            continue;
        l += 7;
        char *eol = strchr(l, '\n');
        if (eol)
            *eol = '\0';
        char *last = strrchr(l, '\t');
        if (!last || strtoull(last + 1, NULL, 10) != r->nspid)
            continue;
        snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
        if (read_small(path, b, sizeof(b)) < 0)
            continue;
        if (stat_start_time(b) == r->start)
            found = (pid_t)pid;
    }
    closedir(dir);
    return found;
}
static int node_processes(int minor, fake_proc *out, int max) {
    struct stat self;
    if (stat("/proc/self/ns/pid", &self) != 0 || self.st_ino != INIT_PIDNS_INO)
        return 0;
    DIR *dir = opendir(sim_driver_dir());
    if (!dir)
        return 0;
    int n = 0;
    struct dirent *e;
    for (int seen = 0; (e = readdir(dir)) && seen < 4 * FAKE_MAX_PROCS && n < FAKE_MAX_PROCS; seen++) {
        size_t len = strlen(e->d_name);
        if (len < 6 || strcmp(e->d_name + len - 5, ".proc") != 0)
            continue;
        fake_proc_record r;
        struct stat st;
        int fd = openat(dirfd(dir), e->d_name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
        if (fd < 0)
            continue;
        ssize_t got = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) ? pread(fd, &r, sizeof(r), 0) : -1;
        close(fd);
        char want[96];
        snprintf(want, sizeof(want), "%llu-%llu-%llu.proc", (unsigned long long)r.pidns, (unsigned long long)r.nspid,
                 (unsigned long long)r.start);
        /* only the file named for its key: one record per process */
        if (got != (ssize_t)sizeof(r) || memcmp(r.magic, FAKE_PROC_MAGIC, sizeof(r.magic)) != 0 ||
            r.seq != r.seq_end || strcmp(e->d_name, want) != 0)
            continue;
        const fake_proc_dev *pd = NULL;
        for (int i = 0; i < FAKE_MAX_DEVS && !pd; i++)
            if (r.dev[i].minor == (uint32_t)minor)
                pd = &r.dev[i];
        if (!pd || (pd->used == 0 && pd->ctxs == 0))
            continue;
        pid_t host = host_pid_of(&r);
        if (!host)
            continue;
        if (n < max && out) {
            out[n].pid = host;
            out[n].used = pd->used;
        }
        n++;
    }
    closedir(dir);
    return n;
}
EXPORT int fakeDeviceProcesses(int d, fake_proc *out, int max) {
    INIT();
    if (d < 0 || d >= F.ndev)
        return -1;
    if (F.node_mode)
        return node_processes(F.minor[d], out, max);
    int n = 0;
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        int p = atomic_load(&F.sh->proc[i].pid);
        uint64_t u = atomic_load(&F.sh->proc[i].used[d]);
        if (p == 0 || (u == 0 && atomic_load(&F.sh->proc[i].ctxs[d]) <= 0) || (kill(p, 0) != 0 && errno == ESRCH))
            continue;
        if (n < max && out) {
            out[n].pid = p;
            out[n].used = u;
        }
        n++;
    }
    return n;
}
EXPORT const char *fakeDriverVersion(int *cuda) {
    INIT();
    if (cuda)
        *cuda = F.cuda_version;
    return F.version;
}
EXPORT int fakeDriverLoaded(void) {
    INIT();
    return F.ctl_ok;
}
EXPORT int fakeDeviceStats(int d, fake_stats *o) {
    INIT();
    if (d < 0 || d >= F.ndev || !o)
        return -1;
    shared_dev *s = &F.sh->dev[d];
    o->used = atomic_load(&s->used);
    o->peak = atomic_load(&s->peak);
    o->mapped = atomic_load(&s->mapped);
    o->busy_total = atomic_load(&s->busy_total);
    o->busy_until = atomic_load(&s->busy_until);
    o->launches = atomic_load(&s->launches);
    o->switches = atomic_load(&s->switches);
    uint64_t now = now_ns();
    spin_lock(&s->lock);
    if (F.ts_on) {
        ts_resolve(d, now);
        o->busy = s->ts.busy;
        /* no single end: at least the work every context has left, back to back */
        uint64_t left = 0;
        for (int i = 0; i < FAKE_MAX_PROCS; i++)
            if (s->ts.reg[i / 64] >> (i % 64) & 1)
                left += ts_of(i, d)->backlog - ts_of(i, d)->served;
        o->busy_until = now + left;
    } else {
        o->busy = iv_busy(&s->busy, now);
    }
    spin_unlock(&s->lock);
    o->at = now;
    return 0;
}
/* ---- NVML's view (see NV) ---- */
EXPORT int fakeNvmlDeviceCount(void) {
    INIT();
    return NV.n;
}
EXPORT int fakeNvmlHandleCount(void) {
    INIT();
    return NV.nall;
}
EXPORT int fakeNvmlDeviceDesc(int i, fake_desc *o, int *mode) {
    INIT();
    if (i < 0 || i >= NV.nall || !o)
        return -1;
    *o = NV.d[i];
    if (mode)
        *mode = NV.mode[i];
    return 0;
}
EXPORT int fakeNvmlDeviceStats(int i, fake_stats *o) {
    INIT();
    if (i < 0 || i >= NV.nall || !o)
        return -1;
    if (NV.cuda[i] >= 0)
        return fakeDeviceStats(NV.cuda[i], o);
    /* no CUDA device of this process on the GPU: nothing of it charged here */
    memset(o, 0, sizeof(*o));
    o->at = now_ns();
    return 0;
}
EXPORT int fakeNvmlDeviceProcesses(int i, fake_proc *out, int max) {
    INIT();
    if (i < 0 || i >= NV.nall)
        return -1;
    if (F.node_mode) /* the driver's records name the GPU (the parent's minor for an instance) */
        return node_processes(NV.d[i].minor, out, max);
    return NV.cuda[i] >= 0 ? fakeDeviceProcesses(NV.cuda[i], out, max) : 0;
}
EXPORT int fakeProcessBusy(int d, int pid, uint64_t *busy, uint64_t *at) {
    INIT();
    if (d < 0 || d >= F.ndev)
        return -1;
    shared_dev *s = &F.sh->dev[d];
    uint64_t now = now_ns();
    int found = -1;
    spin_lock(&s->lock);
    if (F.ts_on)
        ts_resolve(d, now);
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        if (atomic_load(&F.sh->proc[i].pid) == pid) {
            *busy = F.ts_on ? (ts_of(i, d)->pid == pid ? ts_of(i, d)->busy : 0) : iv_busy(&F.sh->proc[i].busy[d], now);
            found = 0;
            break;
        }
    }
    spin_unlock(&s->lock);
    if (at)
        *at = now;
    return found;
}

/* ---- cuGetProcAddress ---- */

EXPORT CUresult cuGetProcAddress(const char *sym, void **pfn, int version, cuuint64_t flags);
EXPORT CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int version, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *status);

typedef struct {
    const char *base;
    void *fn, *ptsz;
} proc;
#define P(n) {#n, (void *)n, NULL}
#define PV(b, n) {b, (void *)n, NULL}
#define PT(n) {#n, (void *)n, (void *)n##_ptsz}
static const proc procs[] = {
    P(cuInit), P(cuDriverGetVersion), P(cuDeviceGetCount), P(cuDeviceGet),
    P(cuDeviceGetUuid), PV("cuDeviceGetUuid", cuDeviceGetUuid), P(cuDeviceGetName),
    P(cuDeviceGetAttribute), PV("cuDeviceTotalMem", cuDeviceTotalMem_v2),
    P(cuDevicePrimaryCtxRetain), PV("cuDevicePrimaryCtxRelease", cuDevicePrimaryCtxRelease_v2),
    PV("cuDevicePrimaryCtxReset", cuDevicePrimaryCtxReset_v2), P(cuDevicePrimaryCtxGetState),
    PV("cuCtxCreate", cuCtxCreate_v2), PV("cuCtxDestroy", cuCtxDestroy_v2), P(cuGreenCtxCreate),
    P(cuGreenCtxDestroy), P(cuCtxFromGreenCtx), P(cuCtxSetCurrent),
    P(cuCtxGetCurrent), P(cuCtxGetDevice), PV("cuCtxPushCurrent", cuCtxPushCurrent_v2),
    PV("cuCtxPopCurrent", cuCtxPopCurrent_v2), P(cuCtxSynchronize), P(cuStreamCreate),
    PV("cuStreamDestroy", cuStreamDestroy_v2), P(cuStreamGetCtx), PT(cuStreamSynchronize),
    PV("cuMemAlloc", cuMemAlloc_v2), P(cuMemAllocManaged), PV("cuMemAllocPitch", cuMemAllocPitch_v2),
    PV("cuMemFree", cuMemFree_v2), PV("cuMemGetAddressRange", cuMemGetAddressRange_v2),
    PV("cuMemGetInfo", cuMemGetInfo_v2), PV("cuArrayCreate", cuArrayCreate_v2),
    PV("cuArray3DCreate", cuArray3DCreate_v2), P(cuArrayDestroy), P(cuMipmappedArrayCreate),
    P(cuMipmappedArrayDestroy), P(cuMemCreate), P(cuMemRelease), P(cuMemAddressReserve), P(cuMemAddressFree),
    P(cuMemMap), P(cuMemUnmap), P(cuMemSetAccess), P(cuMemRetainAllocationHandle),
    P(cuMemGetAllocationGranularity), P(cuMemExportToShareableHandle), P(cuMemImportFromShareableHandle),
    P(cuMemGetAllocationPropertiesFromHandle), P(cuMemPoolCreate),
    P(cuMemPoolDestroy), P(cuDeviceGetDefaultMemPool), P(cuDeviceGetMemPool), P(cuDeviceSetMemPool),
    P(cuMemPoolSetAttribute), P(cuMemPoolGetAttribute), P(cuMemPoolTrimTo), P(cuMemPoolExportPointer), P(cuMemPoolImportPointer), PT(cuMemAllocAsync),
    PT(cuMemAllocFromPoolAsync), PT(cuMemFreeAsync), P(cuIpcGetMemHandle),
    PV("cuIpcOpenMemHandle", cuIpcOpenMemHandle_v2), P(cuIpcCloseMemHandle),
    P(cuImportExternalMemory), P(cuDestroyExternalMemory), P(cuExternalMemoryGetMappedBuffer),
    P(cuCtxSetLimit), P(cuCtxGetLimit), P(cuModuleLoad), P(cuModuleLoadData), P(cuModuleLoadDataEx),
    P(cuModuleLoadFatBinary), P(cuModuleUnload), P(cuLibraryLoadData), P(cuLibraryLoadFromFile), P(cuLibraryUnload), P(cuModuleGetFunction), P(cuLibraryGetKernel), P(cuKernelGetFunction), P(cuLaunch), P(cuLaunchGrid), P(cuLaunchGridAsync), P(cuLaunchCooperativeKernelMultiDevice),
    PT(cuLaunchHostFunc), PT(cuLaunchKernel), PT(cuLaunchKernelEx), PT(cuLaunchCooperativeKernel), PT(cuGraphLaunch),
    P(cuGraphExecDestroy), P(cuGraphCreate), P(cuGraphDestroy), P(cuGraphAddMemAllocNode),
    P(cuGraphInstantiateWithFlags), PT(cuGraphInstantiateWithParams), PV("cuGraphInstantiate", cuGraphInstantiate_v2),
    P(cuGraphUpload), P(cuDeviceGraphMemTrim), P(cuDeviceGetGraphMemAttribute), P(cuEventCreate), PV("cuEventDestroy", cuEventDestroy_v2),
    PT(cuEventRecord), P(cuEventQuery), P(cuThreadExchangeStreamCaptureMode),
    P(cuOccupancyMaxActiveBlocksPerMultiprocessor), {"cuStreamBeginCapture", (void *)cuStreamBeginCapture_v2, (void *)cuStreamBeginCapture_v2_ptsz},
    PT(cuStreamEndCapture), PT(cuStreamIsCapturing), P(cuEventSynchronize), P(cuEventElapsedTime),
    P(cuMemHostAlloc), P(cuMemFreeHost), PV("cuMemHostGetDevicePointer", cuMemHostGetDevicePointer_v2),
    {"cuStreamWaitValue32", (void *)cuStreamWaitValue32_v2, (void *)cuStreamWaitValue32_v2_ptsz},
};

/* FAKE_CUDA_PROC_INTERNAL=1: like a real driver, cuGetProcAddress hands out
 * internal entry points that are not in the dynamic symbol table (these
 * static copies), so no dlsym of an exported name finds the same address. */
#define INTERNAL(ret, name, params, args)                                                          \
    static ret internal_##name params { return name args; }
INTERNAL(CUresult, cuMemAlloc_v2, (CUdeviceptr *p, size_t n), (p, n))
INTERNAL(CUresult, cuMemFree_v2, (CUdeviceptr p), (p))
INTERNAL(CUresult, cuMemAllocAsync, (CUdeviceptr *p, size_t n, CUstream s), (p, n, s))
INTERNAL(CUresult, cuMemFreeAsync, (CUdeviceptr p, CUstream s), (p, s))
INTERNAL(CUresult, cuMemGetInfo_v2, (size_t *f, size_t *t), (f, t))
INTERNAL(CUresult, cuCtxCreate_v4, (CUcontext *c, void *p, unsigned f, CUdevice d), (c, p, f, d))
INTERNAL(CUresult, cuCtxSetLimit, (int l, size_t v), (l, v))
INTERNAL(CUresult, cuStreamSynchronize, (CUstream s), (s))
static const struct {
    const char *base;
    void *fn;
} internal_procs[] = {
    {"cuMemAlloc", (void *)internal_cuMemAlloc_v2},       {"cuMemFree", (void *)internal_cuMemFree_v2},
    {"cuMemAllocAsync", (void *)internal_cuMemAllocAsync}, {"cuMemFreeAsync", (void *)internal_cuMemFreeAsync},
    {"cuMemGetInfo", (void *)internal_cuMemGetInfo_v2},   {"cuCtxCreate", (void *)internal_cuCtxCreate_v4},
    {"cuCtxSetLimit", (void *)internal_cuCtxSetLimit},    {"cuStreamSynchronize", (void *)internal_cuStreamSynchronize},
};
EXPORT CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int version, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *status) {
    INIT();
    const char *internal = getenv("FAKE_CUDA_PROC_INTERNAL");
    if (internal && *internal == '1' && sym && pfn && version >= 12050 &&
        !(flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)) {
        for (size_t i = 0; i < sizeof(internal_procs) / sizeof(internal_procs[0]); i++) {
            if (strcmp(internal_procs[i].base, sym) == 0) {
                *pfn = internal_procs[i].fn;
                if (status)
                    *status = CU_GET_PROC_ADDRESS_SUCCESS;
                return CUDA_SUCCESS;
            }
        }
    }
    if (!sym || !pfn)
        return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    if (strcmp(sym, "cuGetProcAddress") == 0) {
        *pfn = version >= 12000 ? (void *)cuGetProcAddress_v2 : (void *)cuGetProcAddress;
    } else if (strcmp(sym, "cuGraphAddNode") == 0) { /* 12.3 headers: _v2 */
        *pfn = version >= 12030 ? (void *)cuGraphAddNode_v2 : version >= 12020 ? (void *)cuGraphAddNode : NULL;
    } else if (strcmp(sym, "cuGraphInstantiate") == 0) { /* 12.0 headers: WithFlags */
        *pfn = version >= 12000 ? (void *)cuGraphInstantiateWithFlags : (void *)cuGraphInstantiate_v2;
    } else if (strcmp(sym, "cuCtxCreate") == 0) { /* as cuda.h maps it per version */
        *pfn = version >= 12050 ? (void *)cuCtxCreate_v4 : version >= 11040 ? (void *)cuCtxCreate_v3
             : version >= 3020 ? (void *)cuCtxCreate_v2 : (void *)cuCtxCreate;
    } else {
        for (size_t i = 0; i < sizeof(procs) / sizeof(procs[0]); i++) {
            if (strcmp(procs[i].base, sym) != 0)
                continue;
            *pfn = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && procs[i].ptsz
                       ? procs[i].ptsz
                       : procs[i].fn;
            break;
        }
    }
    if (status)
        *status = *pfn ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return *pfn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}
/* Test-only: the fake's own lookup, for a test to see what vcuda was given. */
EXPORT CUresult fakeGetProcAddress(const char *sym, void **pfn, int version, cuuint64_t flags,
                                   CUdriverProcAddressQueryResult *status) {
    return cuGetProcAddress_v2(sym, pfn, version, flags, status);
}
EXPORT CUresult cuGetProcAddress(const char *sym, void **pfn, int version, cuuint64_t flags) {
    return cuGetProcAddress_v2(sym, pfn, version, flags, NULL);
}
