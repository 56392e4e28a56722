/*
 * procprobe: the procaddr phase's program (test/gpu/README.md). For every hooked base name read
 * from the file named by its argument (lines "<exported symbol> <base name>", vcuda's hook table as bundle.sh extracts it
 * from vcuda/src/procaddr.c) it asks cuGetProcAddress_v2, found as libcudart finds it (dlopen
 * libcuda.so.1, dlsym), for the base at CUDA versions 12000, 12080 and 13000, with the default
 * flag and with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, and prints one line per query:
 *
 *   q base=<b> version=<v> flags=<f> rc=<CUresult> status=<query result> lib=<object> sym=<name>
 *     variant=<exported name of the table whose dlsym(libcuda) address is the answer, or ->
 *     dlsym_same=<1 if dlsym(RTLD_DEFAULT, sym) is the same address>
 *
 * Run without vcuda it says which variant the driver picks; run with vcuda preloaded it says what
 * the program gets instead. gpuproof procaddr compares the two.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long cuuint64_t;
typedef CUresult (*gpa2_fn)(const char *, void **, int, cuuint64_t, int *);

#define MAXROWS 512

int main(int argc, char **argv) {
    static char syms[MAXROWS][128], bases[MAXROWS][128];
    FILE *tf = argc == 2 ? fopen(argv[1], "r") : NULL;
    if (!tf) {
        fprintf(stderr, "usage: procprobe <hook table file> (lines \"<symbol> <base>\")\n");
        return 2;
    }
    int n = 0;
    while (n < MAXROWS && fscanf(tf, "%127s %127s", syms[n], bases[n]) == 2)
        n++;
    fclose(tf);
    if (n == 0) {
        fprintf(stderr, "procprobe: no hook table in %s\n", argv[1]);
        return 2;
    }
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!h) {
        fprintf(stderr, "procprobe: dlopen libcuda.so.1: %s\n", dlerror());
        return 2;
    }
    CUresult (*init)(unsigned) = (CUresult (*)(unsigned))dlsym(h, "cuInit");
    gpa2_fn gpa2 = (gpa2_fn)dlsym(h, "cuGetProcAddress_v2");
    if (!init || !gpa2) {
        fprintf(stderr, "procprobe: libcuda.so.1 lacks cuInit or cuGetProcAddress_v2\n");
        return 2;
    }
    CUresult r = init(0);
    printf("init rc=%d\n", r);
    static const int versions[] = {12000, 12080, 13000};
    static const cuuint64_t flags[] = {0, 2};
    for (int i = 0; i < n; i++) {
        if (strncmp(bases[i], "cu", 2) != 0 || strncmp(bases[i], "cuGetProcAddress", 16) == 0)
            continue; /* NVML is reached by dlsym only; cuGetProcAddress itself has its own C test */
        int dup = 0;
        for (int j = 0; j < i; j++)
            dup |= strcmp(bases[j], bases[i]) == 0;
        if (dup)
            continue;
        for (size_t v = 0; v < sizeof(versions) / sizeof(versions[0]); v++) {
            for (size_t f = 0; f < sizeof(flags) / sizeof(flags[0]); f++) {
                void *fn = NULL;
                int st = -1;
                r = gpa2(bases[i], &fn, versions[v], flags[f], &st);
                Dl_info info;
                memset(&info, 0, sizeof(info));
                const char *lib = "-", *sym = "-", *variant = "-";
                if (fn && dladdr(fn, &info)) {
                    lib = info.dli_fname ? info.dli_fname : "-";
                    sym = info.dli_sname ? info.dli_sname : "-";
                }
                for (int j = 0; fn && j < n; j++)
                    if (strcmp(bases[j], bases[i]) == 0 && dlsym(h, syms[j]) == fn)
                        variant = syms[j];
                int same = fn && strcmp(sym, "-") != 0 && dlsym(RTLD_DEFAULT, sym) == fn;
                printf("q base=%s version=%d flags=%llu rc=%d status=%d lib=%s sym=%s variant=%s dlsym_same=%d\n", bases[i],
                       versions[v], flags[f], r, st, lib, sym, variant, same);
            }
        }
    }
    return 0;
}
