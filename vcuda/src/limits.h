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

#endif
