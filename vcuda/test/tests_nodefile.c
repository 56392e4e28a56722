/* tests_nodefile.c - the fake driver's node-file mode (how it runs inside
 * the simulated node's containers): GPUs come from the node file and are
 * visible only where their device nodes are, like the real driver. Each
 * scenario runs in a fresh child, since the driver reads its world once. */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cuda_api.h"
#include "util.h"

#define UUID0 "GPU-7063a1b2-0000-4000-8000-000000000000"
#define UUID1 "GPU-7063a1b2-0000-4000-8000-000000000001"
#define UUID2 "GPU-7063a1b2-0000-4000-8000-000000000002"

/* A device root: nvidiactl and the given minors as character devices
 * (symlinks to /dev/null: stat() sees a character device, as for a node a
 * runtime creates), and minor 1 as a plain file, which must not count. */
static const char *make_dev_root(const char *name, int ctl, const int *minors, int n) {
    const char *root = tpath(name);
    CHECK(mkdir(root, 0700) == 0, "mkdir %s: %s", root, strerror(errno));
    char p[4096];
    if (ctl) {
        snprintf(p, sizeof(p), "%s/nvidiactl", root);
        CHECK(symlink("/dev/null", p) == 0, "symlink: %s", strerror(errno));
    }
    for (int i = 0; i < n; i++) {
        snprintf(p, sizeof(p), "%s/nvidia%d", root, minors[i]);
        CHECK(symlink("/dev/null", p) == 0, "symlink: %s", strerror(errno));
    }
    snprintf(p, sizeof(p), "%s/nvidia1", root);
    write_file(p, "not a device\n");
    return strdup(root);
}

static const char *node_file(void) {
    const char *p = tpath("gpus");
    write_file(p, "# simulated node\n"
                  "2 " UUID2 " 42949672960 108 8.0 NVIDIA A100-SXM4-40GB\n"
                  "1 " UUID1 " 85899345920 132 9.0 NVIDIA H100 80GB HBM3\n"
                  "this line is not a gpu\n"
                  "0 " UUID0 " 85899345920 132 9.0 NVIDIA H100 80GB HBM3   # first\n");
    return strdup(p);
}

static void node_env(const char *file, const char *root) {
    unsetenv("FAKE_CUDA_DEVICES");
    unsetenv("FAKE_CUDA_SHM");
    if (file)
        setenv("FAKE_GPU_NODE_FILE", file, 1);
    else
        setenv("FAKE_GPU_NODE_FILE", tpath("no-such-file"), 1);
    setenv("FAKE_DEV_ROOT", root, 1);
    /* the simulated driver's state directory the node mounts */
    const char *drv = tpath("sim-driver");
    CHECK(mkdir(drv, 0755) == 0 || errno == EEXIST, "mkdir %s: %s", drv, strerror(errno));
    setenv("FAKE_SIM_DRIVER_DIR", drv, 1);
}

static int visible(int i, void *arg) {
    (void)i;
    (void)arg;
    int n = -1, v = 0;
    /* the driver answers nothing about devices before cuInit */
    CHECK(cuDeviceGetCount(&n) == CUDA_ERROR_NOT_INITIALIZED, "count before cuInit");
    CHECK_CU(cuDriverGetVersion(&v));
    CHECK(v == FAKE_CUDA_VERSION_DEFAULT, "cuda version %d", v);
    CHECK_CU(cuInit(0));
    CHECK_CU(cuDeviceGetCount(&n));
    CHECK(n == 2, "%d devices: nvidia1 is not a character device", n);
    char name[96];
    CHECK_CU(cuDeviceGetName(name, sizeof(name), 0));
    CHECK(strcmp(name, "NVIDIA H100 80GB HBM3") == 0, "name 0 %s", name);
    CHECK_CU(cuDeviceGetName(name, sizeof(name), 1));
    CHECK(strcmp(name, "NVIDIA A100-SXM4-40GB") == 0, "name 1 %s (minor order)", name);
    int sms, maj, min;
    CHECK_CU(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 1));
    CHECK_CU(cuDeviceGetAttribute(&maj, 75, 1));
    CHECK_CU(cuDeviceGetAttribute(&min, 76, 1));
    CHECK(sms == 108 && maj == 8 && min == 0, "dev1 sms %d cc %d.%d", sms, maj, min);
    size_t tot;
    CHECK_CU(cuDeviceTotalMem_v2(&tot, 0));
    CHECK(tot == 85899345920ull, "mem %zu", tot);
    CUuuid u;
    CHECK_CU(cuDeviceGetUuid(&u, 1));
    CHECK((unsigned char)u.bytes[15] == 0x02 && (unsigned char)u.bytes[0] == 0x70, "uuid bytes");

    CHECK(nvmlInit_v2() == NVML_SUCCESS, "nvmlInit");
    unsigned cnt = 0, minor = 9;
    CHECK(nvmlDeviceGetCount_v2(&cnt) == NVML_SUCCESS && cnt == 2, "nvml count %u", cnt);
    nvmlDevice_t d;
    CHECK(nvmlDeviceGetHandleByIndex_v2(1, &d) == NVML_SUCCESS, "handle");
    char uuid[96], ver[80];
    CHECK(nvmlDeviceGetUUID(d, uuid, sizeof(uuid)) == NVML_SUCCESS && strcmp(uuid, UUID2) == 0, "uuid %s", uuid);
    CHECK(nvmlDeviceGetMinorNumber(d, &minor) == NVML_SUCCESS && minor == 2, "minor %u", minor);
    CHECK(nvmlDeviceGetName(d, name, 4) == NVML_ERROR_INSUFFICIENT_SIZE, "short name buffer");
    CHECK(nvmlSystemGetDriverVersion(ver, sizeof(ver)) == NVML_SUCCESS &&
              strcmp(ver, FAKE_DRIVER_VERSION_DEFAULT) == 0, "driver %s", ver);

    /* the driver accounts memory per process; NVML lists the holders. A
     * context takes the size of one on its architecture (the A100: 8.x) */
    CUcontext c;
    CHECK_CU(cuCtxCreate_v2(&c, 0, 1));
    CUdeviceptr p;
    CHECK_CU(cuMemAlloc_v2(&p, 10 * MiB));
    unsigned k = 0;
    CHECK(nvmlDeviceGetComputeRunningProcesses_v3(d, &k, NULL) == NVML_ERROR_INSUFFICIENT_SIZE && k == 1,
          "count query %u", k);
    nvmlProcessInfo_t pi[4];
    k = 4;
    CHECK(nvmlDeviceGetComputeRunningProcesses_v3(d, &k, pi) == NVML_SUCCESS && k == 1, "list %u", k);
    CHECK(pi[0].pid == (unsigned)getpid() && pi[0].usedGpuMemory == FAKE_CTX_BYTES_SM80 + 10 * MiB, "pid %u used %llu",
          pi[0].pid, pi[0].usedGpuMemory);
    nvmlDevice_t d0;
    CHECK(nvmlDeviceGetHandleByIndex_v2(0, &d0) == NVML_SUCCESS, "handle 0");
    k = 4;
    CHECK(nvmlDeviceGetComputeRunningProcesses_v3(d0, &k, pi) == NVML_SUCCESS && k == 0, "gpu 0 list %u", k);
    CHECK_CU(cuMemFree_v2(p));
    /* a process with a context is a compute process, listed with the
     * context's memory as long as the context lives */
    k = 4;
    CHECK(nvmlDeviceGetComputeRunningProcesses_v3(d, &k, pi) == NVML_SUCCESS && k == 1 &&
              pi[0].usedGpuMemory == FAKE_CTX_BYTES_SM80, "after free %u: %llu", k, pi[0].usedGpuMemory);
    CHECK_CU(cuCtxDestroy_v2(c));
    k = 4;
    CHECK(nvmlDeviceGetComputeRunningProcesses_v3(d, &k, pi) == NVML_SUCCESS && k == 0, "after destroy %u", k);
    CHECK(nvmlShutdown() == NVML_SUCCESS, "shutdown");
    CHECK(nvmlDeviceGetCount_v2(&cnt) == NVML_ERROR_UNINITIALIZED, "count after shutdown");
    return 0;
}

static int no_ctl(int i, void *arg) {
    (void)i;
    (void)arg;
    CHECK(cuInit(0) == CUDA_ERROR_NO_DEVICE, "cuInit without nvidiactl");
    CHECK(nvmlInit_v2() == NVML_ERROR_DRIVER_NOT_LOADED, "nvmlInit without nvidiactl");
    return 0;
}

static int no_gpu(int i, void *arg) {
    (void)i;
    (void)arg;
    int n = -1;
    CHECK(cuInit(0) == CUDA_ERROR_NO_DEVICE, "cuInit with no gpu");
    CHECK(cuDeviceGetCount(&n) == CUDA_ERROR_NOT_INITIALIZED, "count after failed cuInit");
    unsigned cnt = 9;
    CHECK(nvmlInit_v2() == NVML_SUCCESS, "nvmlInit with no gpu");
    CHECK(nvmlDeviceGetCount_v2(&cnt) == NVML_SUCCESS && cnt == 0, "nvml count %u", cnt);
    return 0;
}

static int version(int i, void *arg) {
    (void)i;
    (void)arg;
    int v = 0;
    char ver[80];
    CHECK_CU(cuDriverGetVersion(&v));
    CHECK(v == 12080, "r570 is CUDA 12.8: %d", v);
    CHECK(nvmlInit_v2() == NVML_SUCCESS, "nvmlInit");
    CHECK(nvmlSystemGetDriverVersion(ver, sizeof(ver)) == NVML_SUCCESS && strcmp(ver, "570.86.15") == 0,
          "driver %s", ver);
    return 0;
}

/* Holds a context and 10 MiB on device 1 (the A100) until killed. */
static int holder(int i, void *arg) {
    (void)i;
    chan *c = arg;
    CHECK_CU(cuInit(0));
    CUcontext ctx;
    CHECK_CU(cuCtxCreate_v2(&ctx, 0, 1));
    CUdeviceptr p;
    CHECK_CU(cuMemAlloc_v2(&p, 10 * MiB));
    chan_send_up(c, 1);
    for (;;)
        pause();
}

/* Another process's memory is the driver's to report (each process's
 * device state is private in this mode): NVML lists the holder by its pid
 * with its context and allocation, and not once it is killed, as the
 * driver frees a dead process's memory. */
static int other_process(int i, void *arg) {
    (void)i;
    (void)arg;
    chan c;
    chan_init(&c);
    pid_t h = spawn(holder, 0, &c);
    CHECK(chan_recv_up(&c) == 1, "holder ready");
    CHECK(nvmlInit_v2() == NVML_SUCCESS, "nvmlInit");
    nvmlDevice_t d;
    CHECK(nvmlDeviceGetHandleByIndex_v2(1, &d) == NVML_SUCCESS, "handle");
    nvmlProcessInfo_t pi[4];
    unsigned k = 4;
    CHECK(nvmlDeviceGetComputeRunningProcesses_v3(d, &k, pi) == NVML_SUCCESS && k == 1, "list %u", k);
    CHECK(pi[0].pid == (unsigned)h && pi[0].usedGpuMemory == FAKE_CTX_BYTES_SM80 + 10 * MiB,
          "pid %u (holder %d) used %llu", pi[0].pid, (int)h, pi[0].usedGpuMemory);
    CHECK(kill(h, SIGKILL) == 0, "kill");
    wait_child(h);
    k = 4;
    CHECK(nvmlDeviceGetComputeRunningProcesses_v3(d, &k, pi) == NVML_SUCCESS && k == 0, "after SIGKILL %u", k);
    return 0;
}

static void in_child(child_fn fn) {
    int rc = wait_child(spawn(fn, 0, NULL));
    CHECK(rc == 0, "scenario exited %d", rc);
}

/* Under the production library without a limits file (what a container
 * without a share sees): vcuda passes through to the node-file driver. */
TEST(nodefile_visibility_follows_dev_nodes) {
    const char *file = node_file();
    const int all[] = {0, 2};
    node_env(file, make_dev_root("dev", 1, all, 2));
    in_child(visible);
    node_env(file, make_dev_root("dev-noctl", 0, all, 2));
    in_child(no_ctl);
    node_env(file, make_dev_root("dev-empty", 1, NULL, 0));
    in_child(no_gpu);
    node_env(NULL, make_dev_root("dev-nofile", 1, all, 2));
    in_child(no_gpu);
    node_env(file, make_dev_root("dev-ver", 1, all, 2));
    setenv("FAKE_DRIVER_VERSION", "570.86.15", 1);
    in_child(version);
    unsetenv("FAKE_DRIVER_VERSION");
}

TEST(nodefile_other_process_listed_until_killed) {
    const int all[] = {0, 2};
    node_env(node_file(), make_dev_root("dev-other", 1, all, 2));
    in_child(other_process);
}

/* ---- MIG: CUDA sees the instance, not its GPU ---- */

#define MIG_A "MIG-4f1e0a2b-1111-4000-8000-0000000000aa"
#define MIG_B "MIG-4f1e0a2b-1111-4000-8000-0000000000bb"
#define MIG_BIG "MIG-4f1e0a2b-1111-4000-8000-0000000000cc"
#define GiB (1024ull * MiB)

/* GPU 0 whole; GPU 2 (an A100 40GB, 108 SMs) in MIG mode with a 1g.5gb
 * (caps 21, 22), a 2g.10gb (caps 30, 31) and a line claiming more memory
 * than its GPU has (caps 40, 41), which no real GPU can hold. */
static const char *mig_node_file(void) {
    const char *p = tpath("gpus-mig");
    write_file(p, "0 " UUID0 " 85899345920 132 9.0 NVIDIA H100 80GB HBM3\n"
                  "mig 2 " MIG_A " 21 22 5368709120 14 1g.5gb\n"
                  "2 " UUID2 " 42949672960 108 8.0 NVIDIA A100-SXM4-40GB\n"
                  "mig 2 " MIG_B " 30 31 10737418240 28 2g.10gb\n"
                  "mig 2 " MIG_BIG " 40 41 85899345920 14 1g.80gb\n"
                  "mig 2 MIG-too-few-fields 50 51 5368709120\n");
    return strdup(p);
}

/* A device root as a container of the runtime gets it: nvidiactl, the
 * given GPU minors and the given capability minors. */
static const char *make_mig_root(const char *name, const int *minors, int n, const int *caps, int ncaps) {
    const char *root = make_dev_root(name, 1, minors, n);
    char p[4096];
    snprintf(p, sizeof(p), "%s/nvidia-caps", root);
    CHECK(mkdir(p, 0700) == 0, "mkdir %s: %s", p, strerror(errno));
    for (int i = 0; i < ncaps; i++) {
        snprintf(p, sizeof(p), "%s/nvidia-caps/nvidia-cap%d", root, caps[i]);
        CHECK(symlink("/dev/null", p) == 0, "symlink: %s", strerror(errno));
    }
    return root;
}

/* The 1g.5gb instance's container: one device, the instance's memory and
 * SMs under its MIG UUID; an allocation that fits the GPU but not the
 * instance is refused as out of memory. */
static int mig_instance(int i, void *arg) {
    (void)i;
    (void)arg;
    int n = -1;
    CHECK_CU(cuInit(0));
    CHECK_CU(cuDeviceGetCount(&n));
    CHECK(n == 1, "%d devices, want the instance alone", n);
    char name[96];
    CHECK_CU(cuDeviceGetName(name, sizeof(name), 0));
    CHECK(strcmp(name, "NVIDIA A100-SXM4-40GB MIG 1g.5gb") == 0, "name %s", name);
    size_t tot = 0, fr = 0;
    CHECK_CU(cuDeviceTotalMem_v2(&tot, 0));
    CHECK(tot == 5 * GiB, "cuDeviceTotalMem %zu, want the instance's 5 GiB (not the GPU's 40)", tot);
    int sms = 0, maj = 0;
    CHECK_CU(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0));
    CHECK_CU(cuDeviceGetAttribute(&maj, 75, 0));
    CHECK(sms == 14 && maj == 8, "SMs %d cc %d, want the instance's 14 on the GPU's 8.x", sms, maj);
    CUuuid u;
    CHECK_CU(cuDeviceGetUuid(&u, 0));
    CHECK((unsigned char)u.bytes[0] == 0x4f && (unsigned char)u.bytes[15] == 0xaa, "uuid bytes: not the instance's");
    CUcontext c;
    CHECK_CU(cuCtxCreate_v2(&c, 0, 0));
    CHECK_CU(cuMemGetInfo_v2(&fr, &tot));
    CHECK(tot == 5 * GiB && fr == 5 * GiB - FAKE_CTX_BYTES_SM80, "cuMemGetInfo free %zu total %zu, want the instance's",
          fr, tot);
    CUdeviceptr p;
    CHECK(cuMemAlloc_v2(&p, 6 * GiB) == CUDA_ERROR_OUT_OF_MEMORY, "6 GiB on a 5 GiB instance");
    CHECK_CU(cuMemAlloc_v2(&p, 4 * GiB));
    CHECK_CU(cuMemFree_v2(p));
    CHECK_CU(cuCtxDestroy_v2(c));
    return 0;
}

/* The host (every node): the whole GPU 0 and one MIG device, the first,
 * never GPU 2 whole and never a second instance. */
static int mig_host(int i, void *arg) {
    (void)i;
    (void)arg;
    int n = -1;
    CHECK_CU(cuInit(0));
    CHECK_CU(cuDeviceGetCount(&n));
    CHECK(n == 2, "%d devices, want GPU 0 and one MIG device", n);
    size_t tot = 0;
    CHECK_CU(cuDeviceTotalMem_v2(&tot, 0));
    CHECK(tot == 85899345920ull, "GPU 0 total %zu", tot);
    CHECK_CU(cuDeviceTotalMem_v2(&tot, 1));
    CHECK(tot == 5 * GiB, "device 1 total %zu, want the first instance's", tot);
    return 0;
}

static int mig_no_device(int i, void *arg) {
    (void)i;
    const char *why = arg;
    CHECK(cuInit(0) == CUDA_ERROR_NO_DEVICE, "cuInit: %s", why);
    return 0;
}

static void in_child_arg(child_fn fn, void *arg) {
    int rc = wait_child(spawn(fn, 0, arg));
    CHECK(rc == 0, "scenario exited %d", rc);
}

/* NVML (and nvidia-smi, which prints what it answers) enumerates physical
 * GPUs: a GPU in MIG mode is listed whole wherever its node is, with the
 * whole GPU's memory, though CUDA sees it only as an instance (or not at
 * all); a MIG UUID finds a MIG device handle, which no index enumerates.
 * Work on the instance is charged to its GPU: the process and its memory
 * show on the GPU's handle. */
nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *, nvmlDevice_t *);
nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t, unsigned int *);

static void nvml_gpu_at(unsigned idx, const char *uuid, unsigned long long total, nvmlDevice_t *out) {
    nvmlDevice_t d;
    char u[96];
    nvmlMemory_t m;
    CHECK(nvmlDeviceGetHandleByIndex_v2(idx, &d) == NVML_SUCCESS, "handle %u", idx);
    CHECK(nvmlDeviceGetUUID(d, u, sizeof(u)) == NVML_SUCCESS && strcmp(u, uuid) == 0, "nvml %u uuid %s, want %s", idx,
          u, uuid);
    CHECK(nvmlDeviceGetMemoryInfo(d, &m) == NVML_SUCCESS && m.total == total, "nvml %u total %llu, want %llu", idx,
          m.total, total);
    if (out)
        *out = d;
}

static int mig_nvml_host(int i, void *arg) {
    (void)i;
    (void)arg;
    int n = -1;
    CHECK_CU(cuInit(0));
    CHECK_CU(cuDeviceGetCount(&n));
    CHECK(n == 2, "%d CUDA devices, want GPU 0 and the instance", n);
    for (int k = 0; k < n; k++) {
        CUuuid u;
        CHECK_CU(cuDeviceGetUuid(&u, k));
        CHECK(!((unsigned char)u.bytes[0] == 0x70 && (unsigned char)u.bytes[15] == 0x02),
              "CUDA device %d is the MIG-mode GPU itself", k);
    }
    CHECK(nvmlInit_v2() == NVML_SUCCESS, "nvmlInit");
    unsigned cnt = 0;
    CHECK(nvmlDeviceGetCount_v2(&cnt) == NVML_SUCCESS && cnt == 2, "nvml count %u, want both GPUs", cnt);
    nvmlDevice_t gpu2, mig;
    nvml_gpu_at(0, UUID0, 85899345920ull, NULL);
    nvml_gpu_at(1, UUID2, 40 * GiB, &gpu2);
    nvmlUtilization_t ut;
    CHECK(nvmlDeviceGetUtilizationRates(gpu2, &ut) == NVML_ERROR_NOT_SUPPORTED, "utilisation of a MIG-mode GPU");
    CHECK(nvmlDeviceGetHandleByUUID(MIG_A, &mig) == NVML_SUCCESS && mig != gpu2, "the instance's MIG device handle");
    unsigned idx = 0;
    CHECK(nvmlDeviceGetIndex(mig, &idx) != NVML_SUCCESS, "a MIG device has an index %u", idx);
    nvmlMemory_t m;
    CHECK(nvmlDeviceGetMemoryInfo(mig, &m) == NVML_SUCCESS && m.total == 5 * GiB, "MIG device total %llu", m.total);
    CHECK(nvmlDeviceGetHandleByUUID(MIG_B, &mig) == NVML_ERROR_NOT_FOUND, "a second instance CUDA does not see");

    /* the instance's context and allocation show on its GPU */
    CUcontext c;
    CUdeviceptr p;
    CHECK_CU(cuCtxCreate_v2(&c, 0, 1));
    CHECK_CU(cuMemAlloc_v2(&p, 64 * MiB));
    nvmlProcessInfo_t pi[4];
    unsigned k = 4;
    CHECK(nvmlDeviceGetComputeRunningProcesses_v3(gpu2, &k, pi) == NVML_SUCCESS && k == 1 &&
              pi[0].pid == (unsigned)getpid() && pi[0].usedGpuMemory == FAKE_CTX_BYTES_SM80 + 64 * MiB,
          "processes on the MIG-mode GPU: %u", k);
    CHECK(nvmlDeviceGetMemoryInfo(gpu2, &m) == NVML_SUCCESS && m.used == FAKE_CTX_BYTES_SM80 + 64 * MiB &&
              m.free == 40 * GiB - m.used, "MIG-mode GPU used %llu free %llu", m.used, m.free);
    CHECK_CU(cuMemFree_v2(p));
    CHECK_CU(cuCtxDestroy_v2(c));
    CHECK(nvmlShutdown() == NVML_SUCCESS, "shutdown");
    return 0;
}

/* A node (or container) with the MIG-mode GPU's node but no instance's
 * capabilities: no CUDA device, one NVML GPU. */
static int mig_nvml_no_instance(int i, void *arg) {
    (void)i;
    (void)arg;
    CHECK(cuInit(0) == CUDA_ERROR_NO_DEVICE, "cuInit without an instance");
    CHECK(nvmlInit_v2() == NVML_SUCCESS, "nvmlInit");
    unsigned cnt = 0;
    CHECK(nvmlDeviceGetCount_v2(&cnt) == NVML_SUCCESS && cnt == 1, "nvml count %u, want the MIG-mode GPU", cnt);
    nvml_gpu_at(0, UUID2, 40 * GiB, NULL);
    nvmlDevice_t mig;
    CHECK(nvmlDeviceGetHandleByUUID(MIG_A, &mig) == NVML_ERROR_NOT_FOUND, "an instance without its capabilities");
    CHECK(nvmlShutdown() == NVML_SUCCESS, "shutdown");
    return 0;
}

/* The 1g.5gb instance's container: NVML lists the GPU (its node is there),
 * CUDA the instance. */
static int mig_nvml_container(int i, void *arg) {
    (void)i;
    (void)arg;
    int n = -1;
    CHECK_CU(cuInit(0));
    CHECK_CU(cuDeviceGetCount(&n));
    CHECK(n == 1, "%d CUDA devices, want the instance", n);
    CHECK(nvmlInit_v2() == NVML_SUCCESS, "nvmlInit");
    unsigned cnt = 0;
    CHECK(nvmlDeviceGetCount_v2(&cnt) == NVML_SUCCESS && cnt == 1, "nvml count %u", cnt);
    nvml_gpu_at(0, UUID2, 40 * GiB, NULL);
    CHECK(nvmlShutdown() == NVML_SUCCESS, "shutdown");
    return 0;
}

TEST(nodefile_mig_nvml_lists_the_gpu) {
    const char *file = mig_node_file();
    const int gpu2[] = {2}, both[] = {0, 2};
    const int capsA[] = {21, 22}, all[] = {21, 22, 30, 31, 40, 41};
    node_env(file, make_mig_root("dev-mignvml-host", both, 2, all, 6));
    in_child(mig_nvml_host);
    node_env(file, make_mig_root("dev-mignvml-nocaps", gpu2, 1, NULL, 0));
    in_child(mig_nvml_no_instance);
    node_env(file, make_mig_root("dev-mignvml-a", gpu2, 1, capsA, 2));
    in_child(mig_nvml_container);
}

TEST(nodefile_mig_device_is_the_instance) {
    const char *file = mig_node_file();
    const int gpu2[] = {2}, both[] = {0, 2};
    const int capsA[] = {21, 22}, giA[] = {21}, capsBig[] = {40, 41}, all[] = {21, 22, 30, 31, 40, 41};
    node_env(file, make_mig_root("dev-mig-a", gpu2, 1, capsA, 2));
    in_child(mig_instance);
    node_env(file, make_mig_root("dev-mig-host", both, 2, all, 6));
    in_child(mig_host);
    node_env(file, make_mig_root("dev-mig-nocaps", gpu2, 1, NULL, 0));
    in_child_arg(mig_no_device, "a GPU in MIG mode without an instance's capabilities is no device");
    node_env(file, make_mig_root("dev-mig-gi", gpu2, 1, giA, 1));
    in_child_arg(mig_no_device, "the GI's capability without the CI's");
    node_env(file, make_mig_root("dev-mig-capsonly", NULL, 0, capsA, 2));
    in_child_arg(mig_no_device, "an instance's capabilities without its GPU's node");
    node_env(file, make_mig_root("dev-mig-big", gpu2, 1, capsBig, 2));
    in_child_arg(mig_no_device, "an instance larger than its GPU");
}
