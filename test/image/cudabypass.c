/*
 * cudabypass: the ways a share container can go past its vcuda cap without static linking (issue
 * 28), for the e2e memory guard tests. Each allocates <bytes> on GPU 0, prints one "key=value"
 * line (region_used= is what the container's vcuda accounting region counts on its first GPU
 * afterwards), then sleeps <seconds>.
 *
 *   cudabypass region <bytes> <steps> <s>  through vcuda, in <steps> equal parts, writing 0 over the
 *                                          region's used word before each: vcuda sees a share
 *                                          under its cap every time
 *   cudabypass deepbind <bytes> <s>        dlopen libcudabypass.so with RTLD_NOW|RTLD_DEEPBIND
 *                                          and allocate through its linked cuMemAlloc_v2
 *   cudabypass next <bytes> <s>            dlopen libcudabypass.so with RTLD_NOW and allocate
 *                                          through dlsym(RTLD_NEXT, "cuMemAlloc_v2") in it
 *
 * alloc_from= names the file of the cuMemAlloc_v2 called (libvcuda.so: counted; libcuda.so.1: not).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_driver.h"

/* vcuda/src/region.h: the GPU records start at 4096, 256 bytes each; `used` is at 64 in a record. */
#define REGION_USED_OFFSET (4096 + 64)
#define LIMITS "/etc/tessera/vcuda/limits"

/* The region's path, from the "region <path>" line of the limits file vcuda reads. */
static int region_path(char *out, size_t n) {
    FILE *f = fopen(LIMITS, "r");
    if (!f) return -1;
    char line[4096 + 8];
    int found = -1;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "region ", 7) == 0) {
            line[strcspn(line, "\n")] = '\0';
            snprintf(out, n, "%s", line + 7);
            found = 0;
        }
    fclose(f);
    return found;
}

/* What the region counts on GPU record 0 (-1: unreadable). A region still empty counts 0: vcuda
 * fills it in when a process of the container first goes through it. */
static long long region_used(void) {
    char path[4096 + 8];
    uint64_t v;
    if (region_path(path, sizeof path) != 0) return -1;
    int fd = open(path, O_RDONLY);
    if (fd < 0) return -1;
    ssize_t got = pread(fd, &v, sizeof v, REGION_USED_OFFSET);
    close(fd);
    if (got == 0) return 0;
    return got == sizeof v ? (long long)(v & ~(1ULL << 63)) : -1;
}

/* Writes 0 over GPU record 0's used word: 0 ok, else the errno of the failing step. */
static int region_zero(void) {
    char path[4096 + 8];
    uint64_t zero = 0;
    if (region_path(path, sizeof path) != 0) return 1;
    int fd = open(path, O_RDWR);
    if (fd < 0) return 2;
    ssize_t put = pwrite(fd, &zero, sizeof zero, REGION_USED_OFFSET);
    close(fd);
    return put == sizeof zero ? 0 : 3;
}

static int region(size_t bytes, int steps, unsigned seconds) {
    CUdevice d;
    CUcontext c;
    CUresult r = cuDeviceGet(&d, 0);
    if (r == 0) r = cuDevicePrimaryCtxRetain(&c, d);
    if (r == 0) r = cuCtxSetCurrent(c);
    size_t held = 0;
    int zeroed = 0;
    for (int i = 0; r == 0 && i < steps; i++) {
        int z = region_zero();
        if (z != 0) {
            printf("region_write_failed=%d\n", z);
            break;
        }
        zeroed++;
        CUdeviceptr p;
        r = cuMemAlloc_v2(&p, bytes / steps);
        if (r == 0) held += bytes / steps;
    }
    Dl_info info;
    const char *from = dladdr((void *)cuMemAlloc_v2, &info) && info.dli_fname ? info.dli_fname : "?";
    printf("held=%zu error=%d zeroed=%d region_used=%lld alloc_from=%s\n", held, r, zeroed, region_used(), from);
    fflush(stdout);
    sleep(seconds);
    return 0;
}

static int library(int deepbind, size_t bytes, unsigned seconds) {
    void *h = dlopen("libcudabypass.so", RTLD_NOW | (deepbind ? RTLD_DEEPBIND : 0));
    if (!h) {
        printf("error=dlopen %s\n", dlerror());
        return 1;
    }
    CUresult (*alloc)(size_t, const char **) =
        (CUresult(*)(size_t, const char **))dlsym(h, deepbind ? "bypass_linked_alloc" : "bypass_next_alloc");
    if (!alloc) {
        printf("error=dlsym %s\n", dlerror());
        return 1;
    }
    const char *from = "?";
    CUresult r = alloc(bytes, &from);
    printf("held=%zu error=%d region_used=%lld alloc_from=%s\n", r == 0 ? bytes : 0, r, region_used(), from);
    fflush(stdout);
    sleep(seconds);
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 5 && strcmp(argv[1], "region") == 0) {
        CUresult r = cuInit(0);
        if (r != 0) {
            printf("error=%d during=cuInit\n", r);
            return 1;
        }
        return region(strtoull(argv[2], NULL, 0), atoi(argv[3]), (unsigned)atoi(argv[4]));
    }
    if (argc == 4 && (strcmp(argv[1], "deepbind") == 0 || strcmp(argv[1], "next") == 0))
        return library(strcmp(argv[1], "deepbind") == 0, strtoull(argv[2], NULL, 0), (unsigned)atoi(argv[3]));
    fprintf(stderr, "usage: cudabypass region <bytes> <steps> <seconds> | deepbind <bytes> <seconds> | next <bytes> <seconds>\n");
    return 2;
}
