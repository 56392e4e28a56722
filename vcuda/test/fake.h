/*
 * fake.h - test-only API of the fake libcuda.so.1 (not part of CUDA).
 * The fake driver implements the entry points vcuda hooks on plain host
 * bookkeeping: per-device capacity, fake device addresses (never
 * dereferenced), and a modelled device timeline for launches.
 *
 * Two ways to configure it, decided at first use:
 *
 * Environment mode (the unit tests), when FAKE_CUDA_DEVICES is set:
 *   FAKE_CUDA_DEVICES   number of devices (max 16)
 *   FAKE_CUDA_MEM       bytes per device, one value or a comma list (16 GiB)
 *   FAKE_CUDA_SMS       SMs per device, one value or a comma list (16)
 *   FAKE_CUDA_UUIDS     comma list of GPU-... UUIDs (default derived from index)
 *   FAKE_CUDA_WAVE_NS   device time of one full wave (SMs blocks) (100000)
 *   FAKE_CUDA_SHM       file holding the device counters, shared by processes
 *   FAKE_CUDA_BLOCK_ALLOC  file to create, then block forever, inside the
 *                          (FAKE_CUDA_BLOCK_AFTER+1)-th device allocation
 *   FAKE_CUDA_CTX_BYTES device memory a context takes (default: as a real
 *                       CUDA 12 context on the device's architecture,
 *                       FAKE_CTX_BYTES_*; 0 for cases that need exact byte
 *                       arithmetic about something else)
 *   FAKE_CUDA_MAP_HOST=0       the device cannot map host memory
 *   FAKE_CUDA_STREAM_MEMOPS=0  cuStreamWaitValue32_v2 is not supported
 *   FAKE_CUDA_HOST_ALLOC_FAIL=1  cuMemHostAlloc fails (out of memory)
 *   FAKE_CUDA_PROC_INTERNAL=1  cuGetProcAddress (version >= 12050) hands out
 *                       internal entry points that are in no symbol table
 *
 * Node-file mode (inside containers of the simulated node), when
 * FAKE_CUDA_DEVICES is not set: the GPUs are read from a node file,
 *   FAKE_GPU_NODE_FILE  path (default /etc/tessera-sim/gpus), one GPU a line,
 *                       '#' comments: <minor> <uuid> <memoryBytes> <smCount>
 *                       <ccMajor>.<ccMinor> <name with spaces...>, and per
 *                       MIG instance of a GPU in MIG mode: mig <parentMinor>
 *                       <MIG-uuid> <giCapMinor> <ciCapMinor> <memoryBytes>
 *                       <smCount> <profile>
 *   FAKE_DEV_ROOT       where the device nodes are (default /dev)
 * A GPU with mig lines is no CUDA device itself: an instance is, where its
 * GPU's node and <root>/nvidia-caps/nvidia-cap<gi> and <ci> are character
 * devices, with the instance's memory and SMs, under its MIG UUID; one MIG
 * device a process at most (the first), as CUDA enumerates them. NVML (and
 * nvidia-smi) lists the GPU itself, whole, wherever its node is, and the
 * instance CUDA sees by its MIG UUID only (fakeNvml* below).
 * As with the real driver, a GPU is visible only if <root>/nvidia<minor> is a
 * character device and <root>/nvidiactl exists; GPUs enumerate in minor
 * order. No node file or no visible GPU: cuInit returns
 * CUDA_ERROR_NO_DEVICE; NVML initialises with 0 devices, or fails with
 * NVML_ERROR_DRIVER_NOT_LOADED when nvidiactl is missing. State is private
 * to each process unless FAKE_CUDA_SHM is set, except what a real kernel
 * driver knows of every process: the device memory it holds per GPU,
 * published as one record file per process in the simulated driver's state
 * directory,
 *   FAKE_SIM_DRIVER_DIR (default FAKE_SIM_DRIVER_DIR_DEFAULT, which the
 *                       simulated node mounts read-write into containers;
 *                       absent: nothing is published)
 * where the node agent's simulated NVML reads them (internal/gpu,
 * sim_procs.go) and maps them to host pids; NVML here lists them too, with
 * host pids, which it can know only in the initial PID namespace (see
 * fake_nvml.c).
 *
 * Both modes: FAKE_DRIVER_VERSION (default FAKE_DRIVER_VERSION_DEFAULT) is
 * what nvmlSystemGetDriverVersion prints; cuDriverGetVersion reports the
 * CUDA version of that driver branch (FAKE_CUDA_VERSION_DEFAULT).
 *
 * Launch model (see "the device timeline" in fake_cuda.c): a kernel runs
 * in whole waves of SMs x resident blocks per SM (occupancy from its block
 * size, registers and shared memory), each wave taking the function's
 * wave time (FAKE_CUDA_WAVE_NS unless set per function), plus a fixed
 * overhead (FAKE_CUDA_LAUNCH_NS, default 0); streams overlap unless a
 * kernel fills the device; processes time-slice. Busy time is the union
 * of kernel intervals. Events complete when their stream reaches them.
 * Under global stream-capture mode an unsafe call from any thread (event
 * query/synchronize, stream/context synchronize) invalidates the capture.
 *
 * Memory model (see vcuda/README.md, "The fake driver"): allocations over
 * 1 MiB take 2 MiB pages; contexts, their stack/printf/heap limits, modules
 * and libraries take device memory; pools keep freed pages up to their
 * release threshold until a synchronisation or trim; graph allocation nodes
 * take their pages at first upload/launch, kept by the device until
 * cuDeviceGraphMemTrim. fakeDeviceStats' peak is the physical high-water
 * mark of the device across every process sharing FAKE_CUDA_SHM.
 */
#ifndef VCUDA_FAKE_H
#define VCUDA_FAKE_H

#include <stdint.h>

#include "../src/cuda_types.h"

#define FAKE_MAX_DEVS 16
#define FAKE_MAX_PROCS 256
#define FAKE_DRIVER_VERSION_DEFAULT "580.95.05"
#define FAKE_CUDA_VERSION_DEFAULT 13000
#define FAKE_NODE_FILE_DEFAULT "/etc/tessera-sim/gpus"
#define FAKE_SIM_DRIVER_DIR_DEFAULT "/run/tessera-sim/driver"

/* One process's record in the simulated driver's state directory, in the
 * file <pidns inode>-<ns pid>-<start time>.proc, native byte order, written
 * whole (pwrite) at every change of what the process holds and, while it
 * launches work, at most every FAKE_PROC_BUSY_WRITE_NS: the key the host
 * maps to a host pid (its PID namespace's inode, /proc/self/ns/pid; its pid
 * there; field 22 of /proc/self/stat, so a reused pid is not taken for it),
 * the CLOCK_MONOTONIC time of the write and, per device of the process, the
 * device's minor, the process's live contexts there, the bytes the driver
 * charges it (contexts, allocations, modules, pools' reserved pages) and the
 * ns during which at least one of its kernels ran there by that time (the
 * union of its kernels' intervals: what NVML's per-process SM utilisation
 * samples). seq is bumped by each write and stored at both ends: a reader
 * that sees them differ read a write half done. */
#define FAKE_PROC_MAGIC "TSDRVPR2"
#define FAKE_PROC_BUSY_WRITE_NS 50000000ull
typedef struct fake_proc_dev {
    uint32_t minor; /* UINT32_MAX: no device */
    uint32_t ctxs;
    uint64_t used;
    uint64_t busy;
} fake_proc_dev;
typedef struct fake_proc_record {
    char magic[8];
    uint64_t seq;
    uint64_t pidns, nspid, start;
    uint64_t at;
    fake_proc_dev dev[FAKE_MAX_DEVS];
    uint64_t seq_end;
} fake_proc_record; /* 440 bytes */
/* What a context takes by default, per compute capability major (9.x and
 * later, and unknown: SM90; 8.x; 7.x): the fake's own figures, in whole 2 MiB
 * pages as a driver maps them, deliberately not vcuda's table (hooks_ctx.c's
 * ctx_table, 512/384/320 MiB rounded up): a test that passes only because
 * vcuda's guess equals the fake's cost proves nothing. Of the size NVML
 * reports for a CUDA 12 context with lazy loading (a few hundred MiB). */
#define FAKE_CTX_BYTES_SM90 (478ull << 20)
#define FAKE_CTX_BYTES_SM80 (346ull << 20)
#define FAKE_CTX_BYTES_SM70 (302ull << 20)

typedef struct fake_stats {
    uint64_t used;       /* bytes of device memory held (all processes) */
    uint64_t peak;       /* high-water mark of used */
    uint64_t mapped;     /* bytes mapped through IPC (not device memory) */
    uint64_t busy_total; /* ns of device time scheduled so far */
    uint64_t busy_until; /* CLOCK_MONOTONIC ns when the queue drains */
    uint64_t launches;
    uint64_t busy;       /* ns at least one kernel ran (union), by `at` */
    uint64_t at;         /* CLOCK_MONOTONIC ns of this reading */
    uint64_t switches;   /* times the device turned from one process's work to another's */
} fake_stats;
/* When a recorded event was reached on the device (CLOCK_MONOTONIC ns, the
 * clock now_ns() reads): 0, else -1 while it has not been. */
int fakeEventTime(CUevent e, uint64_t *ns);

/* How a function behaves on the fake device: registers per thread and
 * static shared memory (occupancy), the device time of one wave of
 * resident blocks and a fixed per-launch overhead. */
typedef struct fake_func {
    int regs;
    int smem;
    uint64_t wave_ns;
    uint64_t overhead_ns;
} fake_func;
int fakeFunctionSet(CUfunction f, const fake_func *cfg);
/* Busy time (union of its kernels) of process pid on dev, by *at. */
int fakeProcessBusy(int dev, int pid, uint64_t *busy, uint64_t *at);

/* What the driver knows of a device. */
typedef struct fake_desc {
    char uuid[64];
    char name[96];
    uint64_t mem;
    int sms, minor, cc_major, cc_minor;
} fake_desc;

/* A process holding device memory (the driver's per-process accounting,
 * which NVML's process list reports). */
typedef struct fake_proc {
    int pid;
    uint64_t used;
} fake_proc;

int fakeDeviceStats(int dev, fake_stats *out);
int fakeDeviceDesc(int dev, fake_desc *out);
/* Processes alive and holding memory on dev; returns how many there are (at
 * most max written). */
int fakeDeviceProcesses(int dev, fake_proc *out, int max);
/* The driver version string and its CUDA version (e.g. 13000). */
const char *fakeDriverVersion(int *cuda);
/* 1 when the control device is present (NVML would load). */
int fakeDriverLoaded(void);
int fakeDeviceInfo(int dev, char uuid[64], uint64_t *mem, int *sms);
int fakeDeviceCount(void);
/* NVML's view, which fake_nvml.c (and so nvidia-smi) lists: the fake*Device*
 * calls above take CUDA ordinals (a MIG instance, never its GPU); these take
 * NVML indices: first the fakeNvmlDeviceCount() physical GPUs whose node is
 * visible, a GPU in MIG mode (FAKE_NVML_MIG_PARENT) with its whole memory,
 * then up to fakeNvmlHandleCount() the MIG devices CUDA sees
 * (FAKE_NVML_MIG_DEVICE), found by UUID only. Stats and processes of a GPU
 * include its instance's. */
#define FAKE_NVML_GPU 0
#define FAKE_NVML_MIG_PARENT 1
#define FAKE_NVML_MIG_DEVICE 2
int fakeNvmlDeviceCount(void);
int fakeNvmlHandleCount(void);
int fakeNvmlDeviceDesc(int i, fake_desc *out, int *mode);
int fakeNvmlDeviceStats(int i, fake_stats *out);
int fakeNvmlDeviceProcesses(int i, fake_proc *out, int max);
CUresult fakeGraphExecCreate(CUgraphExec *exec, unsigned long long blocks);
/* One launch of exec runs n kernels back to back, each varying on its own
 * (fake_device_model.c). */
int fakeGraphSetKernels(CUgraphExec exec, unsigned n);
/* How f's launches vary ("none", "jitter", "bimodal", "lognormal"), over
 * FAKE_CUDA_VARY (fake_device_model.c). */
int fakeFunctionVary(CUfunction f, const char *how);
/* Device time of process pid on dev (the union of its kernels), exact up
 * to *at: under fifo the last time the process queued work, under
 * timeslice the last replay that served it (fake_device_model.c). */
int fakeModelBusy(int dev, int pid, uint64_t *busy, uint64_t *at);
/* cuStreamWaitValue32_v2 calls that queued a wait in this process, and
 * cuMemHostAlloc allocations alive in it. */
uint64_t fakeWaitValueCalls(void);
int fakeHostAllocs(void);
/* Waits not yet released (their words re-read first); cuLaunchHostFunc
 * calls accepted in this process. */
int fakeWaitsPending(void);
uint64_t fakeHostFuncCalls(void);

#endif
