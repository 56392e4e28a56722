/*
 * callbench: host-side cost of the CUDA driver calls vcuda intercepts, on whichever libcuda.so.1 the
 * dynamic linker finds (the real driver, or vcuda/test's fake). Run it with and without vcuda
 * preloaded; gpuproof overhead reports the difference per call.
 *
 *   callbench uuid                  prints "uuid=GPU-..." of device 0
 *   callbench alloc <iterations>    cuMemAlloc_v2(4 KiB) + cuMemFree_v2 pairs
 *   callbench launch <iterations>   cuLaunchKernel of an empty kernel, 1 block of 32 threads
 *
 * Output: "ns_per_call=<best of 5 timed rounds> kernel=<how the kernel was made>". Launches are
 * timed in batches of 256 with a synchronise between batches outside the timed part, so the
 * figure is the CPU cost of submitting, never a wait for a full launch queue.
 *
 * The kernel: on a real driver an empty kernel loaded from PTX (the driver compiles it, no nvcc
 * needed); the fake driver has no cuModuleLoadData (looked up with dlsym), so there the launch gets
 * an opaque handle, as vcuda's own bench does. The output says which.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_driver.h"

static const char *ptx[] = {
    ".version 8.0\n.target sm_80\n.address_size 64\n.visible .entry tessera_noop()\n{\n\tret;\n}\n",
    ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry tessera_noop()\n{\n\tret;\n}\n",
};

/* kernel returns an empty kernel and says where it came from. */
static CUfunction kernel(const char **how) {
    static const char *const names[] = {"tessera_noop"};
    CUfunction f;
    switch (load_ptx(ptx, sizeof ptx / sizeof ptx[0], names, &f, 1, "cuModuleLoadData(empty PTX kernel)")) {
    case -1:
        *how = "opaque-handle(fake-driver)";
        return (CUfunction)(uintptr_t)0x1000;
    case 0:
        *how = "ptx-sm_80-empty";
        return f;
    default:
        *how = "ptx-sm_70-empty";
        return f;
    }
}

int main(int argc, char **argv) {
    CUdevice d;
    CUcontext c;
    CUresult r;
    if ((r = cuInit(0)) != 0) die("cuInit", r);
    if ((r = cuDeviceGet(&d, 0)) != 0) die("cuDeviceGet", r);
    if ((r = cuDevicePrimaryCtxRetain(&c, d)) != 0) die("cuDevicePrimaryCtxRetain", r);
    if ((r = cuCtxSetCurrent(c)) != 0) die("cuCtxSetCurrent", r);
    if (argc == 2 && strcmp(argv[1], "uuid") == 0) {
        unsigned char u[16];
        if ((r = cuDeviceGetUuid_v2(u, d)) != 0) die("cuDeviceGetUuid_v2", r);
        printf("uuid=GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x\n", u[0], u[1], u[2], u[3],
               u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
        return 0;
    }
    if (argc != 3 || (strcmp(argv[1], "alloc") != 0 && strcmp(argv[1], "launch") != 0)) {
        fprintf(stderr, "usage: callbench uuid | alloc <iterations> | launch <iterations>\n");
        return 2;
    }
    long iters = atol(argv[2]);
    int launch = strcmp(argv[1], "launch") == 0;
    const char *how = "none";
    CUfunction f = launch ? kernel(&how) : NULL;
    double best = 1e30;
    for (int round = 0; round < 6; round++) { /* round 0 warms up */
        uint64_t spent = 0;
        long calls = 0;
        while (calls < iters) {
            long batch = launch ? 256 : iters;
            uint64_t t0 = now_ns();
            for (long i = 0; i < batch; i++) {
                if (launch) {
                    if ((r = cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL)) != 0) die("cuLaunchKernel", r);
                } else {
                    CUdeviceptr p;
                    if ((r = cuMemAlloc_v2(&p, 4096)) != 0) die("cuMemAlloc_v2", r);
                    if ((r = cuMemFree_v2(p)) != 0) die("cuMemFree_v2", r);
                }
            }
            spent += now_ns() - t0;
            calls += batch;
            if (launch && (r = cuCtxSynchronize()) != 0) die("cuCtxSynchronize", r);
        }
        /* an alloc+free pair is two intercepted calls */
        double ns = (double)spent / (double)calls / (launch ? 1.0 : 2.0);
        if (round > 0 && ns < best) best = ns;
    }
    printf("ns_per_call=%.2f kernel=%s\n", best, how);
    return 0;
}
