/*
 * cudaprobe: a small CUDA driver API program for Tessera's test image. It is linked dynamically
 * against libcuda.so.1 and finds it the way any CUDA program in a container does: through the
 * driver files the CDI specs mount. In a share container the dynamic linker first loads
 * /etc/ld.so.preload's libvcuda.so, so everything it sees passes through vcuda.
 *
 *   cudaprobe info              the driver's CUDA version, then one line per visible GPU: index, name,
 *                               cuDeviceTotalMem, cuMemGetInfo, UUID, SM count, compute capability, PCI address
 *   cudaprobe fill [granule]    allocate granule-sized blocks (default 64 MiB) on GPU 0 until an
 *                               error; print how much was allocated and the error code
 *   cudaprobe hold <bytes> <s>  allocate <bytes> on GPU 0, print "held", sleep <s> seconds, exit
 *   cudaprobe spin <s>          launch a kernel that fills GPU 0 and wait for it, back to back, for <s>
 *                               seconds (a compute-bound job); print "spinning", then the launches
 *
 * Output is "key=value" words so tests can parse it; the exit code is 0 unless CUDA itself failed
 * before the probe could say anything.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_driver.h"

typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUstream;

CUresult cuDeviceGetCount(int *n);
CUresult cuDeviceGetName(char *name, int len, CUdevice d);
CUresult cuDriverGetVersion(int *version);
CUresult cuDeviceGetUuid_v2(unsigned char uuid[16], CUdevice d);
CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice d);
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d);
CUresult cuMemGetInfo_v2(size_t *free, size_t *total);
CUresult cuModuleLoadData(CUmodule *m, const void *image);
CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name);
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shm, CUstream s, void **params, void **extra);
CUresult cuCtxSynchronize(void);

static int use_device(int ordinal, CUdevice *d) {
    CUcontext ctx;
    CUresult r = cuDeviceGet(d, ordinal);
    if (r == 0) r = cuDevicePrimaryCtxRetain(&ctx, *d);
    if (r == 0) r = cuCtxSetCurrent(ctx);
    if (r != 0) printf("error=%d during=context device=%d\n", r, ordinal);
    return r;
}

static int info(void) {
    int n = 0;
    CUresult r = cuDeviceGetCount(&n);
    if (r != 0) {
        printf("error=%d during=cuDeviceGetCount\n", r);
        return 1;
    }
    int version = 0;
    cuDriverGetVersion(&version);
    printf("cuda_driver_version=%d.%d\n", version / 1000, version % 1000 / 10);
    printf("devices=%d\n", n);
    for (int i = 0; i < n; i++) {
        CUdevice d;
        char name[128] = "";
        size_t total = 0, free = 0, ctxtotal = 0;
        if (use_device(i, &d) != 0) return 1;
        cuDeviceGetName(name, sizeof name, d);
        for (char *c = name; *c; c++)
            if (*c == ' ') *c = '_';
        cuDeviceTotalMem_v2(&total, d);
        cuMemGetInfo_v2(&free, &ctxtotal);
        unsigned char u[16] = {0};
        cuDeviceGetUuid_v2(u, d);
        /* CU_DEVICE_ATTRIBUTE_: 16 MULTIPROCESSOR_COUNT, 75/76 COMPUTE_CAPABILITY_MAJOR/MINOR,
         * 50 PCI_DOMAIN_ID, 33 PCI_BUS_ID, 34 PCI_DEVICE_ID */
        int sms = 0, ccmaj = 0, ccmin = 0, dom = 0, bus = 0, dev = 0;
        cuDeviceGetAttribute(&sms, 16, d);
        cuDeviceGetAttribute(&ccmaj, 75, d);
        cuDeviceGetAttribute(&ccmin, 76, d);
        cuDeviceGetAttribute(&dom, 50, d);
        cuDeviceGetAttribute(&bus, 33, d);
        cuDeviceGetAttribute(&dev, 34, d);
        printf("device=%d name=%s total_mem=%zu meminfo_total=%zu meminfo_free=%zu "
               "uuid=GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x "
               "sms=%d cc=%d.%d pci=%04x:%02x:%02x.0\n",
               i, name, total, ctxtotal, free, u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10],
               u[11], u[12], u[13], u[14], u[15], sms, ccmaj, ccmin, dom, bus, dev);
    }
    return 0;
}

static int fill(size_t granule) {
    CUdevice d;
    if (use_device(0, &d) != 0) return 1;
    size_t total = 0, free = 0, got = 0;
    cuMemGetInfo_v2(&free, &total);
    CUresult r = 0;
    for (;;) {
        CUdeviceptr p;
        if ((r = cuMemAlloc_v2(&p, granule)) != 0) break;
        got += granule;
    }
    printf("allocated=%zu meminfo_total=%zu meminfo_free=%zu granule=%zu stopped_by=%d\n", got, total, free, granule, r);
    return 0;
}

static int hold(size_t bytes, unsigned seconds) {
    CUdevice d;
    if (use_device(0, &d) != 0) return 1;
    CUdeviceptr p;
    CUresult r = cuMemAlloc_v2(&p, bytes);
    printf("held=%zu error=%d\n", r == 0 ? bytes : 0, r);
    fflush(stdout);
    sleep(seconds);
    return 0;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int spin(unsigned seconds) {
    CUdevice d;
    if (use_device(0, &d) != 0) return 1;
    /* A PTX text image; any real driver would JIT it, the simulated one takes its entry as is. */
    static const char ptx[] = ".version 8.0\n.target sm_80\n.address_size 64\n.visible .entry spin()\n{\n ret;\n}\n";
    CUmodule m;
    CUfunction f;
    CUresult r = cuModuleLoadData(&m, ptx);
    if (r == 0) r = cuModuleGetFunction(&f, m, "spin");
    printf("spinning=%d error=%d\n", r == 0, r);
    fflush(stdout);
    if (r != 0) return 0;
    unsigned long long launches = 0;
    for (double end = now_s() + seconds; now_s() < end; launches++) {
        /* 2^20 blocks of 256 threads: a thousand waves and more on any GPU, milliseconds a kernel */
        if ((r = cuLaunchKernel(f, 1u << 20, 1, 1, 256, 1, 1, 0, NULL, NULL, NULL)) != 0 || (r = cuCtxSynchronize()) != 0) break;
    }
    printf("launches=%llu error=%d\n", launches, r);
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    CUresult r = cuInit(0);
    if (r != 0) {
        printf("error=%d during=cuInit\n", r);
        return 1;
    }
    if (argc >= 2 && strcmp(argv[1], "info") == 0) return info();
    if (argc >= 2 && strcmp(argv[1], "fill") == 0)
        return fill(argc >= 3 ? strtoull(argv[2], NULL, 0) : 64ull << 20);
    if (argc >= 4 && strcmp(argv[1], "hold") == 0)
        return hold(strtoull(argv[2], NULL, 0), (unsigned)atoi(argv[3]));
    if (argc >= 3 && strcmp(argv[1], "spin") == 0) return spin((unsigned)atoi(argv[2]));
    fprintf(stderr, "usage: cudaprobe info | fill [granule] | hold <bytes> <seconds> | spin <seconds>\n");
    return 2;
}
