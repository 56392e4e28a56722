/* fake_nvidia_smi.c - a stand-in for nvidia-smi for the simulated node: it
 * prints only what NVML answers (linked against libnvidia-ml.so.1, so inside
 * a container vcuda's NVML hooks apply exactly as to the real tool).
 *
 *   nvidia-smi -L   GPU <i>: <name> (UUID: <uuid>)
 *   nvidia-smi      per GPU: name and uuid, "memory: <used> MiB / <total> MiB",
 *                   "utilization: <gpu> %", then "processes:" and one
 *                   "  pid <pid> <used> MiB" line per compute process
 *                   ("  none" when there is none)
 * Exit status: 0; 9 when NVML cannot initialise (as nvidia-smi does when the
 * driver is not loaded); 1 on any other NVML error. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/cuda_types.h"

nvmlReturn_t nvmlInit_v2(void);
nvmlReturn_t nvmlShutdown(void);
const char *nvmlErrorString(nvmlReturn_t);
nvmlReturn_t nvmlSystemGetDriverVersion(char *, unsigned int);
nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *);
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *);
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int, nvmlDevice_t *);
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t, char *, unsigned int);
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t, char *, unsigned int);
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t, nvmlMemory_t *);
nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t, nvmlUtilization_t *);
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t, unsigned int *, nvmlProcessInfo_t *);

static void fail(const char *what, nvmlReturn_t r) {
    printf("%s failed: %s\n", what, nvmlErrorString(r));
    exit(r == NVML_ERROR_DRIVER_NOT_LOADED ? 9 : 1);
}

int main(int argc, char **argv) {
    int list = argc > 1 && strcmp(argv[1], "-L") == 0;
    nvmlReturn_t r = nvmlInit_v2();
    if (r != NVML_SUCCESS) {
        printf("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n");
        return r == NVML_ERROR_DRIVER_NOT_LOADED ? 9 : 1;
    }
    unsigned n = 0;
    if ((r = nvmlDeviceGetCount_v2(&n)) != NVML_SUCCESS)
        fail("nvmlDeviceGetCount", r);
    if (!list) {
        char ver[80] = "";
        int cuda = 0;
        if ((r = nvmlSystemGetDriverVersion(ver, sizeof(ver))) != NVML_SUCCESS)
            fail("nvmlSystemGetDriverVersion", r);
        nvmlSystemGetCudaDriverVersion(&cuda);
        printf("Driver Version: %s   CUDA Version: %d.%d\n", ver, cuda / 1000, cuda % 1000 / 10);
        if (n == 0)
            printf("No devices were found\n");
    }
    for (unsigned i = 0; i < n; i++) {
        nvmlDevice_t d;
        char name[96] = "", uuid[96] = "";
        if ((r = nvmlDeviceGetHandleByIndex_v2(i, &d)) != NVML_SUCCESS)
            fail("nvmlDeviceGetHandleByIndex", r);
        if ((r = nvmlDeviceGetName(d, name, sizeof(name))) != NVML_SUCCESS)
            fail("nvmlDeviceGetName", r);
        if ((r = nvmlDeviceGetUUID(d, uuid, sizeof(uuid))) != NVML_SUCCESS)
            fail("nvmlDeviceGetUUID", r);
        if (list) {
            printf("GPU %u: %s (UUID: %s)\n", i, name, uuid);
            continue;
        }
        nvmlMemory_t m;
        nvmlUtilization_t u = {0, 0};
        if ((r = nvmlDeviceGetMemoryInfo(d, &m)) != NVML_SUCCESS)
            fail("nvmlDeviceGetMemoryInfo", r);
        nvmlDeviceGetUtilizationRates(d, &u);
        printf("GPU %u: %s\n  uuid: %s\n  memory: %llu MiB / %llu MiB\n  utilization: %u %%\n  processes:\n", i,
               name, uuid, m.used >> 20, m.total >> 20, u.gpu);
        unsigned cnt = 0;
        nvmlProcessInfo_t *p = NULL;
        r = nvmlDeviceGetComputeRunningProcesses_v3(d, &cnt, NULL);
        while (r == NVML_ERROR_INSUFFICIENT_SIZE) {
            free(p);
            cnt += 4; /* it may grow between the calls */
            p = calloc(cnt, sizeof(*p));
            r = nvmlDeviceGetComputeRunningProcesses_v3(d, &cnt, p);
        }
        if (r != NVML_SUCCESS)
            fail("nvmlDeviceGetComputeRunningProcesses", r);
        if (cnt == 0)
            printf("    none\n");
        for (unsigned k = 0; k < cnt; k++)
            printf("    pid %u %llu MiB\n", p[k].pid, p[k].usedGpuMemory >> 20);
        free(p);
    }
    nvmlShutdown();
    return 0;
}
