/*
 * hooks_mem.h - what the memory hooks (hooks_mem.c, hooks_pool.c,
 * hooks_graph.c) share: the gpu record of host memory, charging the region,
 * and the graph-memory calls the stream-ordered allocator makes while a
 * stream is captured. Internal to the library (hidden visibility).
 */
#ifndef VCUDA_HOOKS_MEM_H
#define VCUDA_HOOKS_MEM_H

#include <stdint.h>

#include "cuda_types.h"

/* gpu record sentinels: -1 device not in the limits file (cap 0), -2 device
 * cannot be identified, VC_GPU_HOST memory that is not device memory. */
#define VC_GPU_HOST (-3)

/* Reserves size bytes on gpu record g in the region; CUDA_ERROR_OUT_OF_MEMORY
 * for an unknown device or past the cap. */
CUresult vc_mem_charge(int g, uint64_t size);

/* Logs once that the handle table is full. */
void vc_mem_table_full(void);

/* The gpu record a CUmemLocation charges: the device named by the location,
 * VC_GPU_HOST for host memory, the current device for anything unrecognised. */
CUresult vc_location_gpu(const CUmemLocation *loc, int *g);

/* Adds pages to the allocation nodes of graph (or capturing stream) h
 * (hooks_graph.c). */
void vc_graph_add(const void *h, int g, uint64_t pages);

/* The key a capturing stream's allocation nodes are kept under until
 * cuStreamEndCapture: the stream, or a per-thread key for the per-thread
 * default stream (ptsz: the call came through a _ptsz entry point). */
const void *vc_capture_key(CUstream s, int ptsz);

/* Whether stream s is being captured (the per-thread variant with ptsz). */
int vc_stream_captured(CUstream s, int ptsz);

/* Exports of this container (hooks_mem.c): token is the 64 bytes another
 * process imports with (a CUipcMemHandle, a CUmemPoolPtrExportData). Records
 * that memory charged to gpu record g here was exported; and the gpu record
 * an export was charged to, -1 when no process of the container made it. */
void vc_export_add(const void *token, int g);
int vc_exported_here(const void *token);

/* Forgets the VMM mappings in a forked child (hooks_vmm.c). */
void vc_vmm_atfork_child(void);

#endif
