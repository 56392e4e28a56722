/*
 * vcuda_bench <alloc|launch> <iterations> - times intercepted calls.
 * Run once without vcuda (the fake driver directly) and once with vcuda
 * preloaded; the Go benchmark reports the difference. Prints the best of
 * five timed rounds, in ns per operation: "ns_per_op <x>".
 * With BENCH_LIMITS=<cores percent>, writes a limits file (cap well above
 * what the loop holds) so vcuda enforces; otherwise vcuda is pass-through.
 */
#define _GNU_SOURCE
#include <string.h>

#include "cuda_api.h"
#include "util.h"

int main(int argc, char **argv) {
    if (argc != 3)
        return 2;
    long iters = atol(argv[2]);
    const char *lim = getenv("BENCH_LIMITS");
    if (lim) {
        gpu_line g[1] = {{0, 8ull << 30, atoi(lim)}};
        setup_limits(g, 1);
    }
    ctx_on(0);
    int launch = strcmp(argv[1], "launch") == 0;
    CUfunction f = (CUfunction)(uintptr_t)0x1000;
    double best = 1e30;
    for (int round = 0; round < 6; round++) {
        uint64_t t0 = now_ns();
        for (long i = 0; i < iters; i++) {
            if (launch) {
                if (cuLaunchKernel(f, 16, 1, 1, 128, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS)
                    return 1;
            } else {
                CUdeviceptr p;
                if (cuMemAlloc_v2(&p, 4096) != CUDA_SUCCESS || cuMemFree_v2(p) != CUDA_SUCCESS)
                    return 1;
            }
        }
        double ns = (double)(now_ns() - t0) / (double)iters;
        if (round > 0 && ns < best) /* round 0 warms up */
            best = ns;
    }
    printf("ns_per_op %.2f\n", best);
    return 0;
}
