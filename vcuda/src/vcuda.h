/* vcuda.h - internal declarations shared by the library's source files. */
#ifndef VCUDA_INTERNAL_H
#define VCUDA_INTERNAL_H

#include <stdint.h>
#include <time.h>

#include "cuda_types.h"
#include "limits.h"

#define VC_EXPORT __attribute__((visibility("default")))
#define VC_LIKELY(x) __builtin_expect(!!(x), 1)
#define VC_UNLIKELY(x) __builtin_expect(!!(x), 0)

/* Every hook starts here: the real driver resolved, else the call cannot be served. */
#define PROLOGUE(fn)                                                                               \
    vc_init_cuda();                                                                                \
    if (VC_UNLIKELY(!vc_real.fn))                                                                  \
        return CUDA_ERROR_NOT_INITIALIZED;

/* Accounting applies (limits file read and not exiting). After vcuda's
 * exit handler (which gives the process's share back) allocations are
 * refused: an earlier-registered atexit handler of the application must not
 * allocate uncounted past the cap. Frees still reach the driver. */
#define ACTIVE() (vc_g.mode == VC_MODE_ENFORCE && !vc_exiting)
/* Device memory must be refused: limits unusable (fail closed), or past vcuda's exit handler. */
#define REFUSED() (vc_g.mode == VC_MODE_FAIL_CLOSED || (vc_g.mode == VC_MODE_ENFORCE && vc_exiting))

/* The driver reserves device memory for pools, graphs, contexts and modules in 2 MiB pages. */
#define VC_PAGE (2ull << 20)

/* x rounded up to a multiple of a (saturating). */
static inline uint64_t vc_round_up(uint64_t x, uint64_t a) {
    return x > UINT64_MAX - (a - 1) ? UINT64_MAX / a * a : (x + a - 1) / a * a;
}

/* How the process runs, decided once at first use. */
enum {
    VC_MODE_UNINIT = 0,
    VC_MODE_PASSTHROUGH = 1, /* no limits file: behave as if vcuda were absent */
    VC_MODE_ENFORCE = 2,
    VC_MODE_FAIL_CLOSED = 3, /* limits file unusable: refuse every allocation */
};

typedef struct vc_state {
    int mode;
    int any_limited; /* some gpu has cores < 100: the launch hooks have work */
    vc_limits limits;
} vc_state;

extern vc_state vc_g;
/* Set by the exit handler: accounting is over, hooks just forward. */
extern volatile int vc_exiting;

/* One-time, lazy initialisation (limits, region, real driver). Cheap after
 * the first call: a pthread_once fast path. */
void vc_init(void);

void vc_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Reads a file of at most 64 KiB (*text malloc'ed): 1 read, 0 absent, -1
 * unreadable or larger. */
int vc_read_small(const char *path, char **text, size_t *len);

static inline uint64_t vc_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* vDSO: no syscall */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#if defined(__x86_64__) || defined(__i386__)
#define VC_CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define VC_CPU_RELAX() __asm__ __volatile__("yield" ::: "memory")
#else
#define VC_CPU_RELAX() ((void)0)
#endif

/* Last timer tick (vDSO, no hardware clock read): never ahead of
 * vc_now_ns(), behind it by at most one tick. */
static inline uint64_t vc_now_coarse_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Test hook points, compiled only into the test build (-DVCUDA_TEST_HOOKS):
 * the production library reads nothing from the environment but the limits
 * path. */
#ifdef VCUDA_TEST_HOOKS
void vc_test_pause(const char *point);
void vc_test_delay(const char *point);
#define VC_TEST_PAUSE(p) vc_test_pause(p)
#define VC_TEST_DELAY(p) vc_test_delay(p)
#else
#define VC_TEST_PAUSE(p) ((void)0)
#define VC_TEST_DELAY(p) ((void)0)
#endif

/* Maps a CUDA device ordinal to its gpu record: >= 0, or -1 when the device's
 * UUID is not in the limits file (cap 0), or -2 when it cannot be told. */
/* The limiter's device gates of ctx (hooks_launch.c): forget them when the
 * context goes; freeh: before the driver destroys it (their words are freed). */
void vc_dgate_ctx_gone(CUcontext ctx, int freeh);
int vc_dev_gpu(CUdevice dev);
/* The SM count of a device ordinal (cached; >= 1). */
int vc_dev_sms(CUdevice dev);
/* The gpu record of the current context's device; returns a CUresult. */
CUresult vc_cur_gpu(int *g, CUdevice *dev);

#endif
