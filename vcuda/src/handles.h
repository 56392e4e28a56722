/* handles.h - per-process record of what each live allocation was charged. */
#ifndef VCUDA_HANDLES_H
#define VCUDA_HANDLES_H

#include <stdatomic.h>
#include <stdint.h>

/* One table per kind of handle, so that a device pointer and, say, a
 * CUmemGenericAllocationHandle with the same numeric value never collide. */
enum {
    VC_K_PTR = 0, /* cuMemAlloc*, pitch, managed, async, from-pool */
    VC_K_ARRAY,
    VC_K_MIPMAP,
    VC_K_GENERIC, /* cuMemCreate; ctx holds its references (creation, retains, mappings: hooks_vmm.c) */
    VC_K_IPC,     /* cuIpcOpenMemHandle mappings */
    VC_K_EXTMEM,  /* cuImportExternalMemory */
    VC_K_POOLPTR, /* stream-ordered pool allocations: 512-rounded size, pool slot */
    VC_K_LIMIT,   /* context | limit << 60 -> memory its cuCtxSetLimit takes */
    VC_K_CTX,     /* context (or green context) -> its own device memory */
    VC_K_GREEN,   /* green context -> the CUcontext cuCtxFromGreenCtx gave (ctx field) */
    VC_K_GRAPH,   /* (graph or capturing stream) ^ (gpu + 1) << 56 -> its allocation nodes' pages */
    VC_K_GRAPHEXEC, /* graph exec ^ (gpu + 1) << 56 -> the graph memory it holds */
    VC_K_MODULE,  /* module (dies with its context) or library -> its device memory */
    VC_K_COUNT
};

typedef struct vc_entry {
    _Atomic uint64_t key; /* 0 = empty, ~0 = deleted, ~1 = being filled */
    uint64_t val;         /* size (low 56 bits) | (gpu + 8) << 56 */
    uint64_t ctx;         /* context the memory dies with, 0 if none */
} vc_entry;

/* Lock-free: an insert CASes an empty/deleted key, a remove CASes its key to
 * deleted. Returns 0, or -1 if the table is full. */
int vc_track_ctx(int kind, uint64_t key, uint64_t size, int gpu, uint64_t ctx);
#define vc_track(kind, key, size, gpu) vc_track_ctx(kind, key, size, gpu, 0)
/* Removes every entry of context ctx, calling fn(kind, size, gpu) for each. */
void vc_untrack_ctx(uint64_t ctx, void (*fn)(int kind, uint64_t size, int gpu));
/* Removes key and returns what it was charged (and its context, if ctx is
 * not NULL); -1 if unknown. */
int vc_untrack(int kind, uint64_t key, uint64_t *size, int *gpu, uint64_t *ctx);
/* Looks key up without removing it; -1 if unknown. */
int vc_lookup(int kind, uint64_t key, uint64_t *size, int *gpu);
/* The same, with the ctx field; and setting it. Only for kinds whose ctx is
 * not a context (never swept by vc_untrack_ctx) and whose writers serialise
 * on their own lock (VC_K_GENERIC: hooks_vmm.c). */
int vc_lookup_ctx(int kind, uint64_t key, uint64_t *size, int *gpu, uint64_t *ctx);
int vc_set_ctx(int kind, uint64_t key, uint64_t ctx);
int vc_handles_init(void);
void vc_handles_atfork_child(void);

#endif
