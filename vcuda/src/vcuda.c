/*
 * vcuda.c - process-wide state: lazy initialisation, the limits file, the
 * real driver, device ordinal -> limits mapping, fork and exit handling.
 *
 * Nothing heavy happens at load time: /etc/ld.so.preload puts vcuda into
 * every process of the container (shells, ls, ...), so the constructor does
 * nothing and the work is done at the first CUDA or NVML call.
 */
#define _GNU_SOURCE
#include "vcuda.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "handles.h"
#include "hooks_mem.h"
#include "measured.h"
#include "real.h"
#include "region.h"

#ifndef VC_LIMITS_PATH_BUILTIN
#define VC_LIMITS_PATH_BUILTIN VC_LIMITS_PATH
#endif

vc_state vc_g;
vc_real_fns vc_real;
volatile int vc_exiting;

void vc_log(const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof(buf) - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if (n > (int)sizeof(buf) - 2)
        n = (int)sizeof(buf) - 2;
    buf[n++] = '\n';
    /* One write(2): lines from concurrent processes do not interleave. */
    char line[1100];
    int m = snprintf(line, sizeof(line), "vcuda: %.*s", n, buf);
    if (m > 0 && write(2, line, (size_t)(m < (int)sizeof(line) ? m : (int)sizeof(line) - 1)) < 0) {
        /* nothing sensible to do */
    }
}

/* ---- the real dlsym and the real libraries ---- */

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn real_dlsym_p;

void *vc_real_dlsym(void *handle, const char *name) {
    if (VC_UNLIKELY(!real_dlsym_p)) {
        /* dlvsym is not hooked, so it can find the real dlsym. */
        dlsym_fn f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
        if (!f)
            f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
        if (!f)
            f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.17");
        real_dlsym_p = f;
        if (!f)
            return NULL;
    }
    return real_dlsym_p(handle, name);
}

static pthread_once_t cuda_once = PTHREAD_ONCE_INIT, nvml_once = PTHREAD_ONCE_INIT;

static void load_cuda(void) {
    void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!h) {
        vc_log("cannot load libcuda.so.1: %s", dlerror());
        return;
    }
#define VC_RESOLVE(name, params) *(void **)&vc_real.name = vc_real_dlsym(h, #name);
    VC_CU_FUNCS(VC_RESOLVE)
}

static void load_nvml(void) {
    void *h = dlopen("libnvidia-ml.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!h) {
        vc_log("cannot load libnvidia-ml.so.1: %s", dlerror());
        return;
    }
    VC_NVML_FUNCS(VC_RESOLVE)
#undef VC_RESOLVE
}

void vc_init_cuda(void) {
    vc_init();
    pthread_once(&cuda_once, load_cuda);
}
void vc_init_nvml(void) {
    vc_init();
    pthread_once(&nvml_once, load_nvml);
}

/* ---- limits ---- */

/* Reads the limits file. Returns 1 = read, 0 = does not exist, -1 = exists
 * but unreadable. */
static int read_file(const char *path, char **text, size_t *len) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT || errno == ENOTDIR ? 0 : -1;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    if (!buf) {
        close(fd);
        return -1;
    }
    for (;;) {
        ssize_t r = read(fd, buf + n, cap - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 || (r > 0 && n + (size_t)r == cap)) { /* error or > 64 KiB */
            free(buf);
            close(fd);
            return -1;
        }
        if (r == 0)
            break;
        n += (size_t)r;
    }
    close(fd);
    *text = buf;
    *len = n;
    return 1;
}

int vc_read_small(const char *path, char **text, size_t *len) { return read_file(path, text, len); }

static void on_exit_handler(void) {
    if (vc_g.mode == VC_MODE_ENFORCE)
        vc_region_detach();
    vc_exiting = 1;
}

static void on_fork_child(void) {
    if (vc_g.mode == VC_MODE_ENFORCE) {
        vc_region_atfork_child();
        vc_handles_atfork_child();
        vc_vmm_atfork_child();
        vc_measured_atfork_child();
    }
}

static void init_limits(void) {
    const char *path = VC_LIMITS_PATH_BUILTIN;
    char *text = NULL;
    size_t len = 0;
    int r = read_file(path, &text, &len);
    if (r == 0) {
        /* Only when the node agent's file is absent (host processes, tests)
         * is the environment consulted; a container cannot override a
         * mounted file this way. */
        const char *env = secure_getenv(VC_LIMITS_ENV);
        if (!env || !*env) {
            vc_g.mode = VC_MODE_PASSTHROUGH;
            return;
        }
        path = env;
        r = read_file(path, &text, &len);
        if (r == 0) {
            vc_g.mode = VC_MODE_PASSTHROUGH;
            return;
        }
    }
    vc_g.mode = VC_MODE_FAIL_CLOSED;
    if (r < 0) {
        vc_log("%s:0: cannot read limits file: %s", path, errno ? strerror(errno) : "too large");
        return;
    }
    int line = 0;
    char err[512];
    if (vc_limits_parse(text, len, &vc_g.limits, &line, err, sizeof(err)) != 0) {
        vc_log("%s:%d: %s", path, line, err);
        free(text);
        return;
    }
    free(text);
    for (int i = 0; i < vc_g.limits.ngpus; i++)
        if (vc_g.limits.gpu[i].cores < 100)
            vc_g.any_limited = 1;
    if (vc_handles_init() != 0) {
        vc_log("cannot map handle tables: %s", strerror(errno));
        return;
    }
    if (vc_region_open(&vc_g.limits) != 0)
        return; /* logged */
    pthread_atfork(NULL, NULL, on_fork_child);
    atexit(on_exit_handler);
    if (vc_g.any_limited) /* the node agent's measured file: beside the limits file in use */
        vc_measured_init(path);
    vc_g.mode = VC_MODE_ENFORCE;
}

static pthread_once_t limits_once = PTHREAD_ONCE_INIT;
static _Atomic int inited;

void vc_init(void) {
    if (VC_LIKELY(atomic_load_explicit(&inited, memory_order_acquire)))
        return;
    pthread_once(&limits_once, init_limits);
    atomic_store_explicit(&inited, 1, memory_order_release);
}

/* ---- devices ---- */

#define VC_MAX_ORDINALS 256
/* gpu record + 2 (so that 0 means "not looked up yet"). */
static _Atomic int dev_gpu_cache[VC_MAX_ORDINALS];
static _Atomic int dev_sms_cache[VC_MAX_ORDINALS];

int vc_dev_gpu(CUdevice dev) {
    if (dev < 0 || dev >= VC_MAX_ORDINALS)
        return -2;
    int g = atomic_load_explicit(&dev_gpu_cache[dev], memory_order_relaxed);
    if (VC_LIKELY(g != 0))
        return g - 2;
    CUuuid u;
    CUresult r = CUDA_ERROR_NOT_FOUND;
    if (vc_real.cuDeviceGetUuid_v2)
        r = vc_real.cuDeviceGetUuid_v2(&u, dev);
    if (r != CUDA_SUCCESS && vc_real.cuDeviceGetUuid)
        r = vc_real.cuDeviceGetUuid(&u, dev);
    if (r != CUDA_SUCCESS)
        return -2; /* not cached: try again next time */
    char s[VC_UUID_LEN + 1];
    vc_uuid_format((const unsigned char *)u.bytes, s);
    g = vc_limits_find(&vc_g.limits, s);
    if (g < 0) {
        g = -1;
        vc_log("device %d (%s) is not in the limits file: its memory cap is 0", dev, s);
    }
    atomic_store(&dev_gpu_cache[dev], g + 2);
    return g;
}

int vc_dev_sms(CUdevice dev) {
    if (dev < 0 || dev >= VC_MAX_ORDINALS)
        return 1;
    int n = atomic_load_explicit(&dev_sms_cache[dev], memory_order_relaxed);
    if (VC_LIKELY(n > 0))
        return n;
    n = 0;
    if (!vc_real.cuDeviceGetAttribute ||
        vc_real.cuDeviceGetAttribute(&n, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev) !=
            CUDA_SUCCESS ||
        n < 1)
        return 1;
    atomic_store(&dev_sms_cache[dev], n);
    return n;
}

CUresult vc_cur_gpu(int *g, CUdevice *dev) {
    if (!vc_real.cuCtxGetDevice)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = vc_real.cuCtxGetDevice(dev);
    if (r != CUDA_SUCCESS)
        return r;
    *g = vc_dev_gpu(*dev);
    return CUDA_SUCCESS;
}

#ifdef VCUDA_TEST_HOOKS
/* Test build only: VCUDA_TEST_PAUSE=<point> makes the process create the file
 * VCUDA_TEST_PAUSE_MARK and stop forever at that point, so a test can
 * SIGKILL it in the middle of a critical section. */
void vc_test_pause(const char *point) {
    const char *p = getenv("VCUDA_TEST_PAUSE");
    if (!p || strcmp(p, point) != 0)
        return;
    const char *mark = getenv("VCUDA_TEST_PAUSE_MARK");
    if (mark) {
        int fd = open(mark, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
        if (fd >= 0)
            close(fd);
    }
    for (;;)
        pause();
}

/* Test build only: VCUDA_TEST_DELAY=<point> makes the process sleep
 * VCUDA_TEST_DELAY_MS milliseconds at that point (a thread descheduled
 * there on a loaded machine). */
void vc_test_delay(const char *point) {
    const char *p = getenv("VCUDA_TEST_DELAY"), *ms = getenv("VCUDA_TEST_DELAY_MS");
    if (!p || !ms || strcmp(p, point) != 0)
        return;
    long v = strtol(ms, NULL, 10);
    struct timespec ts = {v / 1000, (v % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}
#endif
