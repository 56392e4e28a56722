/* limits.h - the per-container limits file written by the node agent. */
#ifndef VCUDA_LIMITS_H
#define VCUDA_LIMITS_H

#include <stddef.h>
#include <stdint.h>

#define VC_MAX_GPUS 64
#define VC_UUID_LEN 40 /* "GPU-" + 36 chars */

#define VC_LIMITS_PATH "/etc/tessera/vcuda/limits"
#define VC_LIMITS_ENV "TESSERA_VCUDA_LIMITS"

typedef struct vc_gpu_limit {
    char uuid[VC_UUID_LEN + 1]; /* canonical: GPU- and lower-case hex */
    uint64_t mem_cap;
    uint32_t cores; /* 1..100 */
} vc_gpu_limit;

typedef struct vc_limits {
    char container[256];
    char region[4096];
    int ngpus;
    vc_gpu_limit gpu[VC_MAX_GPUS];
} vc_limits;

/* Parses the text of a limits file. Returns 0 on success; on error returns -1
 * and writes "<line>: <problem>" style details into *errline / err. */
int vc_limits_parse(const char *text, size_t len, vc_limits *out, int *errline, char *err,
                    size_t errlen);

/* Formats 16 raw UUID bytes as "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx". */
void vc_uuid_format(const unsigned char raw[16], char out[VC_UUID_LEN + 1]);

/* Returns the index of uuid (case-insensitive) in l, or -1. */
int vc_limits_find(const vc_limits *l, const char *uuid);

/* The node agent's measured per-context overhead (api/v1's
 * ContextOverheadPathInContainer, mounted read-only):
 *   tessera-context-overhead 1
 *   written <unix seconds>
 *   gpu <uuid> <bytes per context>
 * Sets *bytes to uuid's overhead, 0 when the file does not name the GPU.
 * Returns 0, or -1 with a message in err when the file is malformed or its
 * written time is older than VC_OVERHEAD_MAX_AGE (or in the future). */
#define VC_OVERHEAD_PATH "/etc/tessera/node/context-overhead"
#define VC_OVERHEAD_MAX_AGE 600
#define VC_OVERHEAD_MAX_BYTES (64ull << 30)
int vc_overhead_parse(const char *text, size_t len, const char *uuid, uint64_t now, uint64_t *bytes,
                      char *err, size_t errlen);

/* The node agent's measured compute time of this container's processes
 * (contract "the measured compute file", docs/architecture.md): per GPU and
 * process, the ns the driver saw at least one of its kernels run (NVML's
 * per-process SM utilisation, summed), mounted read-only in the directory
 * "measured" beside the limits file:
 *   tessera-compute-measured 1
 *   written <host CLOCK_MONOTONIC ns>
 *   gpu <uuid> pid <pid> start <stat field 22> busy <ns> at <CLOCK_MONOTONIC ns>
 * Every line ends in "\n", fields are separated by one space, numbers are
 * decimal without sign or leading zeros, uuids canonical (lower-case). */
#define VC_MEASURED_MAX_BYTES (256u << 10)
#define VC_MEASURED_MAX_LINES 4096
typedef struct vc_measured_line {
    int found;
    uint64_t busy, at;
} vc_measured_line;
/* Parses the whole file; for each of the n uuids, out[i] is the line of
 * (uuids[i], pid, start), found 0 when there is none. Returns 0, or -1 with
 * "line N: problem" in err when anything in the file is off spec (the
 * caller then ignores the whole file). */
int vc_measured_parse(const char *text, size_t len, uint64_t pid, uint64_t start, const char (*uuids)[VC_UUID_LEN + 1],
                      int n, uint64_t *written, vc_measured_line *out, char *err, size_t errlen);

#endif
