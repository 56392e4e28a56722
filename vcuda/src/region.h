/*
 * region.h - the shared accounting region: one file per container, mmapped
 * MAP_SHARED by every process of the container that uses CUDA. Layout is
 * versioned; see vcuda/README.md. Everything here is plain-old-data so that
 * the node agent (or a test) can read it without vcuda.
 */
#ifndef VCUDA_REGION_H
#define VCUDA_REGION_H

#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

#include "limits.h"

#define VC_REGION_MAGIC 0x31414455435653ULL /* "SVCUDA1\0" little-endian */
#define VC_REGION_VERSION 1
#define VC_MAX_SLOTS 1024
/* Bit 63 of a device's `used` word: a reclaim is recomputing the totals; no
 * reservation or release may land until it is cleared. Caps are < 2^63. */
#define VC_FROZEN (1ULL << 63)

enum { VC_SLOT_FREE = 0, VC_SLOT_CLAIMING = 1, VC_SLOT_LIVE = 2 };

/* A slot's ctx[] entry: bits 0-6 the GPU record index + 1, bits 7-12 the
 * live contexts (VC_CTX_SATURATED: too many to count, sticky), bits 13-31
 * the bytes charged for them in 2 MiB pages. A process with contexts on more
 * than VC_CTX_RECS GPUs records the first VC_CTX_RECS. */
#define VC_CTX_RECS 8
#define VC_CTX_SATURATED 63u
#define VC_CTX_MAX_PAGES ((1u << 19) - 1)
#define VC_CTX_GPU(w) ((int)((w) & 0x7fu) - 1)
#define VC_CTX_COUNT(w) (((w) >> 7) & 0x3fu)
#define VC_CTX_PAGES(w) ((w) >> 13)
#define VC_CTX_WORD(g, n, pages) ((uint32_t)((g) + 1) | ((uint32_t)(n) << 7) | ((uint32_t)(pages) << 13))

typedef struct vc_region_hdr {
    uint64_t magic;
    uint32_t version;
    uint32_t header_size; /* sizeof(vc_region_hdr) */
    uint64_t total_size;  /* bytes of the whole file */
    uint32_t ngpus;       /* gpu records in use */
    uint32_t nslots;      /* VC_MAX_SLOTS */
    uint32_t gpu_offset, gpu_size;
    uint32_t slot_offset, slot_size;
    char container[256];
    uint8_t pad[4096 - 48 - 256];
} vc_region_hdr;

typedef struct vc_region_gpu {
    char uuid[48]; /* GPU-<lower-case hex>, NUL-terminated */
    uint64_t mem_cap;
    uint32_t cores;
    uint32_t pad0;
    /* Bytes reserved by live processes on this GPU (+ VC_FROZEN). Own cache
     * line: every allocation and free CASes it. */
    _Alignas(64) _Atomic uint64_t used;
    /* Compute limiter: CLOCK_MONOTONIC ns at which the work admitted so far is
     * paid for ("theoretical arrival time"). Own cache line. */
    _Alignas(64) _Atomic uint64_t tat;
    /* Exported statistics (monotonic counters). */
    _Alignas(64) _Atomic uint64_t throttled_ns;
    _Atomic uint64_t throttle_events;
    _Atomic uint64_t oom_events;
    _Atomic uint64_t reclaims;
    /* Device time charged by the limiter (ns, monotonic): the container's
     * busy time as the limiter counts it (what NVML utilisation reports). */
    _Atomic uint64_t busy_ns;
    uint8_t pad1[24];
} vc_region_gpu;

typedef struct vc_region_slot {
    _Atomic uint32_t pid;   /* owner, 0 = free */
    _Atomic uint32_t state; /* VC_SLOT_* */
    uint64_t starttime;     /* owner's /proc/<pid>/stat field 22: guards pid reuse */
    /* Threads of the owner inside a reserve/release update; a reclaim waits
     * for it to drain (for live owners) before recomputing totals. */
    _Atomic uint64_t inflight;
    /* Owner's PID namespace (inode of /proc/self/ns/pid; 0 = unknown). A
     * claim's region is shared by containers with their own PID namespaces:
     * pid alone (every container has a pid 1) names the owner only to a
     * process of the same namespace. */
    uint64_t pidns;
    /* Contexts the owner holds, per GPU record, and what vcuda charged them
     * (VC_CTX_*; 0 = unused entry): the rest of used[] is allocations. The
     * node agent derives the driver's per-context overhead from these and
     * NVML's measurement of the process. Written only by the owner. (Was
     * padding, always zero: a slot of an older vcuda reads as no record.) */
    _Atomic uint32_t ctx[8];
    _Atomic uint64_t used[VC_MAX_GPUS]; /* bytes this process holds, per gpu record */
} vc_region_slot;

_Static_assert(sizeof(vc_region_hdr) == 4096, "region header size");
_Static_assert(sizeof(vc_region_gpu) == 256, "region gpu record size");
_Static_assert(sizeof(vc_region_slot) == 576, "region slot size");

#define VC_REGION_GPU_OFFSET 4096u
#define VC_REGION_SLOT_OFFSET (VC_REGION_GPU_OFFSET + VC_MAX_GPUS * (uint32_t)sizeof(vc_region_gpu))
#define VC_REGION_SIZE (VC_REGION_SLOT_OFFSET + VC_MAX_SLOTS * (uint64_t)sizeof(vc_region_slot))

/* ---- process side (region.c) ---- */

/* Maps the region named in l and checks/initialises its header. Does not
 * claim a slot (info-only processes such as nvidia-smi never need one).
 * Returns 0, or -1 after logging. */
int vc_region_open(const vc_limits *l);
/* /proc/<pid>/stat's state (field 3) and start time (field 22, clock ticks
 * since boot): 1 read, 0 no such process, -1 unreadable. */
int vc_proc_stat(pid_t pid, char *state, uint64_t *starttime);
/* Reserves size bytes on gpu record g against cap. 0 = ok, -1 = over cap. */
int vc_reserve(int g, uint64_t size);
/* Gives back size bytes on gpu record g. */
void vc_release(int g, uint64_t size);
/* Current container-wide use of gpu record g. */
uint64_t vc_region_used(int g);
/* Finds processes that died holding memory and drops their share; also
 * completes a recompute left half-done by a dead reclaimer. Returns the
 * number of dead slots reclaimed. */
int vc_region_reclaim(void);
/* Rate-limited reclaim for info queries (nvidia-smi, cuMemGetInfo). */
void vc_region_maybe_reclaim(void);
/* Releases this process's slot at exit. */
void vc_region_detach(void);
/* Called in the child after fork(). */
void vc_region_atfork_child(void);
void vc_region_add_throttle(int g, uint64_t ns);
/* Live processes holding memory on gpu record g, as the container sees them
 * (pids of the container's namespace). Returns how many there are; at most
 * max are written. */
int vc_region_procs(int g, uint32_t *pids, uint64_t *used, int max);
vc_region_gpu *vc_region_gpu_rec(int g);
/* What this process holds on gpu record g. */
uint64_t vc_region_self_used(int g);
/* Records in this process's slot that a context charged bytes on gpu record
 * g was created (delta 1) or went (delta -1). */
void vc_region_ctx_note(int g, int delta, uint64_t bytes);

#endif
