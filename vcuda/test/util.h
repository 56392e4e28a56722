/* util.h - helpers for the vcuda C tests (run one case per process). */
#ifndef VCUDA_TEST_UTIL_H
#define VCUDA_TEST_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>

#include "../src/region.h"
#include "fake.h"

#define MiB (1ull << 20)

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                       \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#define CHECK_CU(call)                                                                             \
    do {                                                                                           \
        CUresult r__ = (call);                                                                     \
        CHECK(r__ == CUDA_SUCCESS, "%s returned %d", #call, r__);                                  \
    } while (0)

typedef void (*test_fn)(void);
/* lib: which build of vcuda the case runs under: "vcuda" (production) or
 * "testhooks" (pause points, limits path inside the build dir). */
void register_test_lib(const char *name, test_fn fn, const char *lib);
#define register_test(name, fn) register_test_lib(name, fn, "vcuda")
#define TEST_LIB(name, lib)                                                                        \
    static void name(void);                                                                        \
    __attribute__((constructor)) static void reg_##name(void) { register_test_lib(#name, name, lib); } \
    static void name(void)
#define TEST(name) TEST_LIB(name, "vcuda")
extern const char *current_test_name;

/* Per-case scratch directory (VCUDA_TEST_TMP or a fresh mkdtemp). */
const char *tmpdir(void);
/* tmpdir()/name, in a static rotating buffer. */
const char *tpath(const char *name);

typedef struct {
    int dev;   /* fake device index whose UUID is listed */
    uint64_t cap;
    int cores;
} gpu_line;
/* Writes a limits file listing gpus (fake UUIDs) with region tmpdir()/region,
 * points TESSERA_VCUDA_LIMITS at it and sets FAKE_CUDA_SHM. Call before any
 * CUDA call. Returns the limits file path. */
const char *setup_limits(const gpu_line *gpus, int n);
void write_file(const char *path, const char *text);
char *read_text(const char *path);
/* The fake's default UUID for device i. */
const char *fake_uuid(int i);

/* Reading the shared region directly (as the node agent would). */
vc_region_hdr *region_map(void);
uint64_t region_used(int g);
int region_live_slots(void);

/* Makes the fake's contexts take no device memory (FAKE_CUDA_CTX_BYTES=0)
 * in this process and its children, before the first CUDA call. A real
 * context is never free (the fake's default is the architecture's size):
 * only for cases whose byte arithmetic is about something else, with a
 * comment saying why. */
void ctx_costs_nothing(void);
/* A fatbin the fake driver reads (fake_cuda.c, "modules and libraries"):
 * payload bytes after the 16-byte header, globals bytes of __device__
 * globals, n functions named k1, k2, ... of code bytes each. The caller
 * frees it. */
unsigned char *fake_fatbin(uint64_t payload, uint64_t globals, int n, uint64_t code);

/* Creates a context on device d and makes it current. */
CUcontext ctx_on(int d);

/* Children: fork a process running fn(i, arg); returns its pid. The parent
 * remembers it (by fn's name) until wait_child() reaps it: while it waits on
 * a pipe or a file, a child that dies with a non-zero status or a signal
 * fails the case at once, naming the child and how it died, instead of
 * leaving it blocked until the Go runner's timeout. A test that kills or
 * expects a failing child reaps it with wait_child() before waiting on
 * anything else. */
typedef int (*child_fn)(int i, void *arg);
pid_t spawn_named(child_fn fn, int i, void *arg, const char *name);
#define spawn(fn, i, arg) spawn_named(fn, i, arg, #fn)
/* For processes forked without spawn(): die with the parent. */
void prctl_die_with_parent(void);
/* Waits for pid; returns its exit code (128+sig if killed). */
int wait_child(pid_t pid);
void wait_for_file(const char *path, double timeout_s);

/* Pipes used as barriers/mailboxes between a parent and its children. */
typedef struct {
    int up[2];   /* child -> parent */
    int down[2]; /* parent -> child */
} chan;
void chan_init(chan *c);
void chan_send_up(chan *c, uint64_t v);
/* The first receive closes the parent's copy of the write end (so every
 * writer must have been spawned by then): a writer that exits without
 * sending is then seen as end of file, not waited on forever. */
uint64_t chan_recv_up(chan *c);
void chan_send_down(chan *c, uint64_t v);
uint64_t chan_recv_down(chan *c);

uint64_t now_ns(void);

/* Sends this process's stderr to path (truncated); returns the old stderr
 * for dup2(saved, 2). */
int redirect_stderr(const char *path);

#endif
