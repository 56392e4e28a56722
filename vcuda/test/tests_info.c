/* tests_info.c - cuMemGetInfo, cuDeviceTotalMem and NVML report the share:
 * total = cap, used = the container's use (all processes), free = the rest. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "cuda_api.h"
#include "util.h"

#define CAP0 (60 * MiB)
#define CAP1 (256 * MiB)

static void two_gpus(void) {
    gpu_line g[2] = {{0, CAP0, 100}, {1, CAP1, 100}};
    setup_limits(g, 2);
    ctx_costs_nothing(); /* reported use is compared with what was allocated, to the byte */
}

TEST(info_cuda_reports_cap) {
    two_gpus();
    ctx_on(0);
    CUdeviceptr d;
    CHECK_CU(cuMemAlloc_v2(&d, 10 * MiB));
    size_t fr = 0, tot = 0;
    CHECK_CU(cuMemGetInfo_v2(&fr, &tot));
    CHECK(tot == CAP0 && fr == CAP0 - 10 * MiB, "info free %zu total %zu", fr, tot);
    /* null out-parameters: never a crash; the driver decides the result */
    tot = 0;
    CHECK_CU(cuMemGetInfo_v2(NULL, &tot));
    CHECK(tot == CAP0, "total alone %zu", tot);
    fr = 0;
    CHECK_CU(cuMemGetInfo_v2(&fr, NULL));
    CHECK(fr == CAP0 - 10 * MiB, "free alone %zu", fr);
    CHECK(cuMemGetInfo_v2(NULL, NULL) == CUDA_ERROR_INVALID_VALUE, "both null");
    size_t tm = 0;
    CHECK_CU(cuDeviceTotalMem_v2(&tm, 0));
    CHECK(tm == CAP0, "cuDeviceTotalMem %zu", tm);
    CHECK_CU(cuDeviceTotalMem_v2(&tm, 1));
    CHECK(tm == CAP1, "cuDeviceTotalMem dev1 %zu", tm);
    CHECK(cuDeviceTotalMem_v2(NULL, 0) == CUDA_ERROR_INVALID_VALUE, "null bytes");
    CHECK_CU(cuMemFree_v2(d));
    CHECK_CU(cuMemGetInfo_v2(&fr, &tot));
    CHECK(fr == CAP0, "after free %zu", fr);
}

TEST(info_cap_above_physical) {
    gpu_line g[1] = {{0, 1ull << 40, 100}};
    setup_limits(g, 1);
    ctx_on(0); /* the context takes its real size (the fake's default) */
    size_t fr = 0, tot = 0;
    CHECK_CU(cuMemGetInfo_v2(&fr, &tot));
    CHECK(tot == 16ull << 30 && fr == (16ull << 30) - FAKE_CTX_BYTES_SM90, "info %zu/%zu: never more than the GPU has",
          fr, tot);
}

static int holder(int i, void *arg) {
    chan *c = arg;
    ctx_on(i);
    CUdeviceptr d;
    if (cuMemAlloc_v2(&d, 10 * MiB) != CUDA_SUCCESS)
        return 1;
    chan_send_up(c, 1);
    chan_recv_down(c);
    return 0;
}

TEST(info_nvml_reports_container_use) {
    two_gpus();
    chan c;
    chan_init(&c);
    pid_t p = spawn(holder, 0, &c); /* another process of the container */
    chan_recv_up(&c);
    CHECK(nvmlInit_v2() == NVML_SUCCESS, "nvmlInit");
    nvmlDevice_t dev0, dev1;
    CHECK(nvmlDeviceGetHandleByIndex_v2(0, &dev0) == NVML_SUCCESS, "handle 0");
    CHECK(nvmlDeviceGetHandleByIndex_v2(1, &dev1) == NVML_SUCCESS, "handle 1");
    nvmlMemory_t m;
    CHECK(nvmlDeviceGetMemoryInfo(dev0, &m) == NVML_SUCCESS, "v1");
    CHECK(m.total == CAP0 && m.used == 10 * MiB && m.free == CAP0 - 10 * MiB,
          "v1 total %llu used %llu free %llu", m.total, m.used, m.free);
    nvmlMemory_v2_t m2;
    memset(&m2, 0, sizeof(m2));
    m2.version = nvmlMemory_v2;
    CHECK(nvmlDeviceGetMemoryInfo_v2(dev0, &m2) == NVML_SUCCESS, "v2");
    CHECK(m2.total == CAP0 && m2.used == 10 * MiB && m2.free == CAP0 - 10 * MiB && m2.reserved == 0,
          "v2 total %llu used %llu free %llu reserved %llu", m2.total, m2.used, m2.free, m2.reserved);
    CHECK(nvmlDeviceGetMemoryInfo(dev1, &m) == NVML_SUCCESS && m.total == CAP1 && m.used == 0,
          "dev1 total %llu used %llu", m.total, m.used);
    CHECK(nvmlDeviceGetMemoryInfo(dev0, NULL) == NVML_ERROR_INVALID_ARGUMENT, "null v1");
    CHECK(nvmlDeviceGetMemoryInfo_v2(dev0, NULL) == NVML_ERROR_INVALID_ARGUMENT, "null v2");
    m2.version = 0;
    CHECK(nvmlDeviceGetMemoryInfo_v2(dev0, &m2) == NVML_ERROR_ARGUMENT_VERSION_MISMATCH, "version");
    chan_send_down(&c, 1);
    CHECK(wait_child(p) == 0, "holder failed");
    CHECK(nvmlDeviceGetMemoryInfo(dev0, &m) == NVML_SUCCESS && m.used == 0,
          "after the holder exited: used %llu", m.used);
}

TEST(info_nvml_unlisted_gpu_shows_nothing) {
    gpu_line g[1] = {{1, CAP1, 100}};
    setup_limits(g, 1);
    CHECK(nvmlInit_v2() == NVML_SUCCESS, "nvmlInit");
    nvmlDevice_t dev0;
    CHECK(nvmlDeviceGetHandleByIndex_v2(0, &dev0) == NVML_SUCCESS, "handle");
    nvmlMemory_t m;
    CHECK(nvmlDeviceGetMemoryInfo(dev0, &m) == NVML_SUCCESS, "v1");
    CHECK(m.total == 0 && m.free == 0, "total %llu free %llu", m.total, m.free);
}

/* A process killed while holding memory stops counting as soon as anyone
 * looks (nvidia-smi, cuMemGetInfo) or needs the room. */
TEST(info_dead_process_not_shown) {
    two_gpus();
    chan c;
    chan_init(&c);
    pid_t p = spawn(holder, 0, &c);
    chan_recv_up(&c);
    kill(p, SIGKILL);
    CHECK(wait_child(p) == 128 + SIGKILL, "not killed");
    CHECK(nvmlInit_v2() == NVML_SUCCESS, "nvmlInit");
    nvmlDevice_t dev0;
    CHECK(nvmlDeviceGetHandleByIndex_v2(0, &dev0) == NVML_SUCCESS, "handle");
    nvmlMemory_t m;
    CHECK(nvmlDeviceGetMemoryInfo(dev0, &m) == NVML_SUCCESS, "v1");
    CHECK(m.used == 0 && m.free == CAP0, "dead process still shown: used %llu", m.used);
    CHECK(region_used(0) == 0 && region_live_slots() == 0, "region %llu, %d slots",
          (unsigned long long)region_used(0), region_live_slots());
}

/* Every hook handed NULLs returns the driver's error, never crashes, and
 * charges nothing. */
TEST(info_null_arguments_never_crash) {
    gpu_line g[2] = {{0, CAP0, 50}, {1, CAP1, 100}}; /* limiter on for device 0 */
    setup_limits(g, 2);
    ctx_costs_nothing(); /* "nothing charged" is checked as 0 bytes */
    ctx_on(0);
    size_t pitch;
    CHECK(cuMemAlloc_v2(NULL, MiB) != CUDA_SUCCESS, "alloc NULL");
    CHECK(cuMemAllocManaged(NULL, MiB, 1) != CUDA_SUCCESS, "managed NULL");
    CHECK(cuMemAllocPitch_v2(NULL, &pitch, 100, 100, 4) != CUDA_SUCCESS, "pitch NULL ptr");
    CUdeviceptr d;
    CHECK(cuMemAllocPitch_v2(&d, NULL, 100, 100, 4) != CUDA_SUCCESS, "pitch NULL pitch");
    CHECK(cuArrayCreate_v2(NULL, NULL) != CUDA_SUCCESS, "array NULL");
    CUarray a;
    CHECK(cuArray3DCreate_v2(&a, NULL) != CUDA_SUCCESS, "array3d NULL desc");
    CHECK(cuMipmappedArrayCreate(NULL, NULL, 1) != CUDA_SUCCESS, "mipmap NULL");
    CUmemGenericAllocationHandle h;
    CHECK(cuMemCreate(&h, MiB, NULL, 0) != CUDA_SUCCESS, "cuMemCreate NULL prop");
    CHECK(cuMemAllocAsync(NULL, MiB, NULL) != CUDA_SUCCESS, "async NULL");
    CHECK(cuMemAllocFromPoolAsync(&d, MiB, NULL, NULL) != CUDA_SUCCESS, "pool NULL pool");
    CHECK(cuMemPoolCreate(NULL, NULL) != CUDA_SUCCESS, "pool create NULL");
    CHECK(cuDeviceGetDefaultMemPool(NULL, 0) != CUDA_SUCCESS, "default pool NULL");
    CUipcMemHandle ih;
    memset(&ih, 0, sizeof(ih));
    CHECK(cuIpcOpenMemHandle_v2(NULL, ih, 1) != CUDA_SUCCESS, "ipc NULL");
    CHECK(cuImportExternalMemory(NULL, NULL) != CUDA_SUCCESS, "extmem NULL");
    CHECK(cuLaunchKernelEx(NULL, (CUfunction)(uintptr_t)0x10, NULL, NULL) != CUDA_SUCCESS, "launch ex NULL");
    CHECK(cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS, "launch NULL f");
    CHECK(cuGraphLaunch(NULL, NULL) != CUDA_SUCCESS, "graph NULL");
    CHECK(cuGetProcAddress_v2(NULL, NULL, 12000, 0, NULL) != CUDA_SUCCESS, "getproc NULL");
    CHECK(region_used(0) == 0 && region_used(1) == 0, "charged %llu", (unsigned long long)region_used(0));
}

/* nvidia-smi in a pod tells the truth about the pod: the process lists name
 * the container's processes (its own pids) with the memory charged to them,
 * not the other tenants the driver sees on the same GPU. */
static int other_container(int i, void *arg) {
    (void)i;
    chan *c = arg;
    /* a second container on the same fake GPU: its own limits and region */
    char text[1024];
    snprintf(text, sizeof(text), "tessera-vcuda-limits 1\ncontainer other\nregion %s\ngpu %s %llu 100\n",
             tpath("other-region"), fake_uuid(0), (unsigned long long)CAP0);
    write_file(tpath("other-limits"), text);
    setenv("TESSERA_VCUDA_LIMITS", tpath("other-limits"), 1);
    ctx_on(0);
    CUdeviceptr d;
    if (cuMemAlloc_v2(&d, 7 * MiB) != CUDA_SUCCESS)
        return 1;
    chan_send_up(c, 1);
    chan_recv_down(c);
    return 0;
}

TEST(info_nvml_process_list_is_the_container) {
    two_gpus();
    chan co, ch;
    chan_init(&co);
    chan_init(&ch);
    pid_t other = spawn(other_container, 0, &co);
    chan_recv_up(&co);
    pid_t p = spawn(holder, 0, &ch); /* 10 MiB, this container */
    chan_recv_up(&ch);
    ctx_on(0);
    CUdeviceptr d;
    CHECK_CU(cuMemAlloc_v2(&d, 4 * MiB));
    CHECK(nvmlInit_v2() == NVML_SUCCESS, "nvmlInit");
    nvmlDevice_t dev0, dev1;
    CHECK(nvmlDeviceGetHandleByIndex_v2(0, &dev0) == NVML_SUCCESS, "handle 0");
    CHECK(nvmlDeviceGetHandleByIndex_v2(1, &dev1) == NVML_SUCCESS, "handle 1");
    /* the driver itself sees three tenants */
    fake_proc fp[8];
    CHECK(fakeDeviceProcesses(0, fp, 8) == 3, "the fake driver lists %d", fakeDeviceProcesses(0, fp, 8));

    unsigned n = 0;
    CHECK(nvmlDeviceGetComputeRunningProcesses_v3(dev0, &n, NULL) == NVML_ERROR_INSUFFICIENT_SIZE && n == 2,
          "v3 count query: %u", n);
    nvmlProcessInfo_t v3[4];
    n = 1;
    CHECK(nvmlDeviceGetComputeRunningProcesses_v3(dev0, &n, v3) == NVML_ERROR_INSUFFICIENT_SIZE && n == 2,
          "v3 short buffer: %u", n);
    n = 4;
    CHECK(nvmlDeviceGetComputeRunningProcesses_v3(dev0, &n, v3) == NVML_SUCCESS && n == 2, "v3 %u", n);
    uint64_t seen = 0;
    for (unsigned i = 0; i < n; i++) {
        CHECK(v3[i].pid == (unsigned)getpid() || v3[i].pid == (unsigned)p, "pid %u not in the container", v3[i].pid);
        CHECK(v3[i].usedGpuMemory == (v3[i].pid == (unsigned)p ? 10 * MiB : 4 * MiB), "pid %u used %llu",
              v3[i].pid, v3[i].usedGpuMemory);
        CHECK(v3[i].gpuInstanceId == 0xFFFFFFFFu, "instance id");
        seen += v3[i].usedGpuMemory;
    }
    CHECK(seen == 14 * MiB, "listed %llu", (unsigned long long)seen);
    nvmlProcessInfo_t v2[4];
    n = 4;
    CHECK(nvmlDeviceGetComputeRunningProcesses_v2(dev0, &n, v2) == NVML_SUCCESS && n == 2, "v2 %u", n);
    nvmlProcessInfo_v1_t v1[4];
    n = 4;
    CHECK(nvmlDeviceGetComputeRunningProcesses(dev0, &n, v1) == NVML_SUCCESS && n == 2, "v1 %u", n);
    CHECK(v1[0].usedGpuMemory + v1[1].usedGpuMemory == 14 * MiB, "v1 memory");
    nvmlProcessDetail_v1_t det[4];
    nvmlProcessDetailList_t dl = {nvmlProcessDetailList_v1, 0, 4, det};
    CHECK(nvmlDeviceGetRunningProcessDetailList(dev0, &dl) == NVML_SUCCESS && dl.numProcArrayEntries == 2,
          "detail list %u", dl.numProcArrayEntries);
    dl.mode = 2; /* MPS compute: none in the container */
    dl.numProcArrayEntries = 4;
    CHECK(nvmlDeviceGetRunningProcessDetailList(dev0, &dl) == NVML_SUCCESS && dl.numProcArrayEntries == 0,
          "detail list, MPS %u", dl.numProcArrayEntries);
    dl.mode = 3; /* no such mode: refused as the driver refuses it */
    CHECK(nvmlDeviceGetRunningProcessDetailList(dev0, &dl) == NVML_ERROR_INVALID_ARGUMENT, "mode 3");
    dl.mode = 0;
    dl.version = 0;
    CHECK(nvmlDeviceGetRunningProcessDetailList(dev0, &dl) == NVML_ERROR_ARGUMENT_VERSION_MISMATCH, "version");
    /* no memory on gpu 1: nobody listed there */
    n = 4;
    CHECK(nvmlDeviceGetComputeRunningProcesses_v3(dev1, &n, v3) == NVML_SUCCESS && n == 0, "gpu 1 %u", n);
    /* a process that dies is no longer listed */
    kill(p, SIGKILL);
    CHECK(wait_child(p) == 128 + SIGKILL, "not killed");
    usleep(250000); /* past the info-reclaim rate limit */
    n = 4;
    CHECK(nvmlDeviceGetComputeRunningProcesses_v3(dev0, &n, v3) == NVML_SUCCESS && n == 1 &&
              v3[0].pid == (unsigned)getpid(), "after the kill: %u", n);
    chan_send_down(&co, 1);
    CHECK(wait_child(other) == 0, "other container");
}

/* A GPU outside the limits file lists nobody, even if the driver does. */
TEST(info_nvml_process_list_unlisted_gpu) {
    gpu_line g[1] = {{1, CAP1, 100}};
    setup_limits(g, 1);
    CHECK(nvmlInit_v2() == NVML_SUCCESS, "nvmlInit");
    nvmlDevice_t dev0;
    CHECK(nvmlDeviceGetHandleByIndex_v2(0, &dev0) == NVML_SUCCESS, "handle");
    unsigned n = 4;
    nvmlProcessInfo_t v3[4];
    CHECK(nvmlDeviceGetComputeRunningProcesses_v3(dev0, &n, v3) == NVML_SUCCESS && n == 0, "listed %u", n);
}
