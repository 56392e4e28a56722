/*
 * memprobe: the memory phase's CUDA driver-API program (test/gpu/README.md), run in runc containers
 * made from Tessera's CDI specs, so it sees the GPUs, and vcuda in a share, as a pod does.
 *
 *   memprobe ctx <seconds>
 *       a context on every visible GPU (the primary context, as the runtime API makes it), then
 *       "ready" and a sleep: the host reads NVML's usedGpuMemory for this process meanwhile.
 *   memprobe vmm pool|loop <chunk> <max> <hold_seconds>
 *       llama.cpp's VMM pool on GPU 0: cuMemCreate a chunk, cuMemMap it, cuMemSetAccess, and
 *       cuMemRelease the handle at once while it stays mapped; "pool" maps every chunk into one
 *       reservation (ggml_cuda_pool_vmm), "loop" gives each chunk its own. Until an error or <max>
 *       bytes; "ready" and a sleep (the host samples NVML), then every mapping unmapped (the
 *       driver frees the memory only now), then cuMemAlloc_v2 in chunks until an error: what the
 *       unmap gave back.
 *
 * The VMM calls are looked up with dlsym(RTLD_DEFAULT), as a program linked against libcuda
 * resolves them (a preloaded vcuda's own come first); a driver without them is reported, not a
 * crash. Output is "key=value" words; the exit code is 0 unless CUDA failed before a report.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_driver.h"

/* CUmemAllocationProp and CUmemAccessDesc, as cuda.h lays them out. */
typedef struct {
    int type; /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
    int requestedHandleTypes;
    struct {
        int type; /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
        int id;
    } location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType, gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} memprop;
typedef struct {
    struct {
        int type, id;
    } location;
    int flags; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
} memaccess;

static int use_device(int ordinal) {
    CUdevice d;
    CUcontext ctx;
    CUresult r = cuDeviceGet(&d, ordinal);
    if (r == 0) r = cuDevicePrimaryCtxRetain(&ctx, d);
    if (r == 0) r = cuCtxSetCurrent(ctx);
    return r;
}

static int ctx(unsigned seconds) {
    int n = 0;
    CUresult r = cuDeviceGetCount(&n);
    printf("pid=%d devices=%d error=%d\n", (int)getpid(), n, r);
    for (int i = 0; i < n; i++) {
        CUdevice d = 0;
        unsigned char u[16] = {0};
        int maj = 0, min = 0;
        cuDeviceGet(&d, i);
        cuDeviceGetUuid_v2(u, d);
        cuDeviceGetAttribute(&maj, 75, d);
        cuDeviceGetAttribute(&min, 76, d);
        printf("ctx device=%d uuid=GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x cc=%d.%d error=%d\n",
               i, u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15],
               maj, min, use_device(i));
    }
    printf("ready\n");
    sleep(seconds);
    return 0;
}

typedef CUresult (*create_fn)(CUmemGenericAllocationHandle *, size_t, const memprop *, unsigned long long);
typedef CUresult (*release_fn)(CUmemGenericAllocationHandle);
typedef CUresult (*reserve_fn)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*map_fn)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
typedef CUresult (*unmap_fn)(CUdeviceptr, size_t);
typedef CUresult (*access_fn)(CUdeviceptr, size_t, const memaccess *, size_t);

#define MAX_CHUNKS 8192

static int vmm(const char *pattern, size_t chunk, size_t max, unsigned hold) {
    const char *names[] = {"cuMemCreate", "cuMemRelease", "cuMemAddressReserve", "cuMemMap", "cuMemUnmap", "cuMemSetAccess"};
    void *fn[6];
    for (int i = 0; i < 6; i++)
        if (!(fn[i] = dlsym(RTLD_DEFAULT, names[i]))) {
            printf("vmm pattern=%s missing=%s\n", pattern, names[i]);
            return 0;
        }
    create_fn create = (create_fn)fn[0];
    release_fn release = (release_fn)fn[1];
    reserve_fn reserve = (reserve_fn)fn[2];
    map_fn map = (map_fn)fn[3];
    unmap_fn unmap = (unmap_fn)fn[4];
    access_fn access = (access_fn)fn[5];
    int pool = strcmp(pattern, "pool") == 0;
    CUresult r = use_device(0);
    if (r != 0) {
        printf("error=%d during=context\n", r);
        return 1;
    }
    size_t free0 = 0, total = 0;
    cuMemGetInfo_v2(&free0, &total);
    size_t n = max / chunk;
    if (n > MAX_CHUNKS) n = MAX_CHUNKS;
    static CUdeviceptr va[MAX_CHUNKS];
    CUdeviceptr base = 0;
    const char *during = "max";
    if (pool && (r = reserve(&base, n * chunk, 0, 0, 0)) != 0) {
        printf("vmm pattern=%s error=%d during=reserve\n", pattern, r);
        return 0;
    }
    memprop prop = {0};
    prop.type = 1;
    prop.location.type = 1;
    memaccess acc = {{1, 0}, 3};
    size_t mapped = 0, k = 0;
    for (; k < n; k++) {
        CUmemGenericAllocationHandle h = 0;
        if ((r = create(&h, chunk, &prop, 0)) != 0) { during = "create"; break; }
        va[k] = base + k * chunk;
        if (!pool && (r = reserve(&va[k], chunk, 0, 0, 0)) != 0) { during = "reserve"; release(h); break; }
        if ((r = map(va[k], chunk, 0, h, 0)) != 0) { during = "map"; release(h); break; }
        if ((r = access(va[k], chunk, &acc, 1)) != 0) { during = "access"; release(h); k++; mapped += chunk; break; }
        /* released while mapped: the memory stays until the unmap */
        if ((r = release(h)) != 0) { during = "release"; k++; mapped += chunk; break; }
        mapped += chunk;
    }
    printf("vmm pattern=%s chunk=%zu meminfo_free=%zu meminfo_total=%zu mapped=%zu stopped_by=%d during=%s\n", pattern, chunk,
           free0, total, mapped, r, during);
    printf("ready\n");
    sleep(hold);
    CUresult ur = 0;
    size_t unmapped = 0;
    for (size_t i = 0; i < mapped / chunk; i++) {
        CUresult e = unmap(va[i], chunk);
        if (e == 0) unmapped += chunk;
        else if (ur == 0) ur = e;
    }
    size_t refilled = 0;
    CUresult fr = 0;
    for (;;) {
        CUdeviceptr p;
        if ((fr = cuMemAlloc_v2(&p, chunk)) != 0) break;
        refilled += chunk;
        if (refilled >= max) break;
    }
    printf("unmapped=%zu unmap_error=%d refilled=%zu refill_stopped_by=%d\n", unmapped, ur, refilled, fr);
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    CUresult r = cuInit(0);
    if (r != 0) {
        printf("error=%d during=cuInit\n", r);
        return 1;
    }
    if (argc == 3 && strcmp(argv[1], "ctx") == 0) return ctx((unsigned)atoi(argv[2]));
    if (argc == 6 && strcmp(argv[1], "vmm") == 0 && (!strcmp(argv[2], "pool") || !strcmp(argv[2], "loop")))
        return vmm(argv[2], strtoull(argv[3], NULL, 0), strtoull(argv[4], NULL, 0), (unsigned)atoi(argv[5]));
    fprintf(stderr, "usage: memprobe ctx <seconds> | vmm pool|loop <chunk> <max> <hold_seconds>\n");
    return 2;
}
