/*
 * hooks_graph.c - graph memory: allocation nodes, captures that allocate,
 * instantiated graphs and the device's graph memory pool.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>

#include "handles.h"
#include "hooks_mem.h"
#include "real.h"
#include "region.h"
#include "vcuda.h"

/* A graph's allocation nodes (cuGraphAddMemAllocNode, or cuMemAllocAsync
 * into a stream being captured) take no memory when added: the driver maps
 * their pages (2 MiB each node) from the device's graph memory when the
 * instantiated graph is first uploaded or launched, the graph keeps them
 * until it is destroyed, and the device keeps freed graph memory for later
 * graphs until cuDeviceGraphMemTrim. vcuda counts each graph's nodes, and
 * charges an instantiated graph's pages when it is instantiated (before the
 * driver can take them), as the device's graph memory grows; destroying
 * the graph exec returns them to that memory, and cuDeviceGraphMemTrim
 * credits what the driver then says it still holds
 * (CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT). */
#define CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT 2
static struct {
    uint64_t live, reserved;
} gmem[VC_MAX_GPUS];
static pthread_mutex_t graph_mu = PTHREAD_MUTEX_INITIALIZER;

static uint64_t gkey(const void *h, int g) { return (uint64_t)(uintptr_t)h ^ ((uint64_t)(g + 1) << 56); }

/* Adds pages to the allocation nodes of graph (or capturing stream) h. */
void vc_graph_add(const void *h, int g, uint64_t pages) {
    uint64_t had = 0, c;
    int gg;
    if (vc_untrack(VC_K_GRAPH, gkey(h, g), &had, &gg, &c) != 0)
        had = 0;
    if (vc_track(VC_K_GRAPH, gkey(h, g), had + pages, g) != 0)
        vc_mem_table_full(); /* the graph will be charged nothing for these: logged */
}

/* The per-thread default stream (CU_STREAM_PER_THREAD, or NULL through a
 * _ptsz entry point) can be captured like any stream; the legacy one (NULL,
 * CU_STREAM_LEGACY) cannot. Its handle value is the same in every thread,
 * so its allocation nodes are kept under a per-thread key. */
static _Thread_local char per_thread_key __attribute__((tls_model("initial-exec")));
static int per_thread(CUstream s, int ptsz) { return (uintptr_t)s == 2 || (!s && ptsz); }

const void *vc_capture_key(CUstream s, int ptsz) { return per_thread(s, ptsz) ? (const void *)&per_thread_key : s; }

int vc_stream_captured(CUstream s, int ptsz) {
    int st = 0, ptd = per_thread(s, ptsz);
    CUresult (*fn)(CUstream, int *) = ptsz && vc_real.cuStreamIsCapturing_ptsz ? vc_real.cuStreamIsCapturing_ptsz
                                                                             : vc_real.cuStreamIsCapturing;
    return ((uintptr_t)s > 2 || ptd) && fn && fn(s, &st) == CUDA_SUCCESS && st == 1 /* ACTIVE */;
}

VC_EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps,
                                          size_t n, CUDA_MEM_ALLOC_NODE_PARAMS *p) {
    PROLOGUE(cuGraphAddMemAllocNode);
    CUresult r = vc_real.cuGraphAddMemAllocNode(node, graph, deps, n, p);
    int g;
    if (r == CUDA_SUCCESS && ACTIVE() && p && vc_location_gpu(&p->poolProps.location, &g) == CUDA_SUCCESS &&
        g != VC_GPU_HOST && g >= 0)
        vc_graph_add(graph, g, vc_round_up(p->bytesize, VC_PAGE));
    return r;
}

/* A node added by type (cuGraphAddNode[_v2], 12.2+): an allocation node
 * counts as one added by cuGraphAddMemAllocNode; a child graph whose
 * ownership moves to the parent (12.9+) brings its allocation nodes along
 * (the parent's instantiation takes their pages). A cloned child cannot
 * hold allocation nodes (the driver refuses it). */
static void node_added(CUgraph graph, const CUgraphNodeParams *p) {
    int g;
    if (!ACTIVE() || !p)
        return;
    if (p->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
        if (vc_location_gpu(&p->alloc.poolProps.location, &g) == CUDA_SUCCESS && g != VC_GPU_HOST && g >= 0)
            vc_graph_add(graph, g, vc_round_up(p->alloc.bytesize, VC_PAGE));
    } else if (p->type == CU_GRAPH_NODE_TYPE_GRAPH && p->graph.ownership == CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE &&
               p->graph.graph) {
        for (g = 0; g < vc_g.limits.ngpus; g++) {
            uint64_t pages, c;
            int gg;
            if (vc_untrack(VC_K_GRAPH, gkey(p->graph.graph, g), &pages, &gg, &c) == 0)
                vc_graph_add(graph, g, pages);
        }
    }
}

VC_EXPORT CUresult cuGraphAddNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps, size_t n,
                                  CUgraphNodeParams *p) {
    PROLOGUE(cuGraphAddNode);
    CUresult r = vc_real.cuGraphAddNode(node, graph, deps, n, p);
    if (r == CUDA_SUCCESS)
        node_added(graph, p);
    return r;
}
VC_EXPORT CUresult cuGraphAddNode_v2(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps,
                                     const CUgraphEdgeData *edges, size_t n, CUgraphNodeParams *p) {
    PROLOGUE(cuGraphAddNode_v2);
    CUresult r = vc_real.cuGraphAddNode_v2(node, graph, deps, edges, n, p);
    if (r == CUDA_SUCCESS)
        node_added(graph, p);
    return r;
}

/* The capture's allocation nodes become the graph's. */
static CUresult end_capture(CUresult r, const void *key, CUgraph *graph) {
    if (!ACTIVE())
        return r;
    for (int g = 0; g < vc_g.limits.ngpus; g++) {
        uint64_t pages, c;
        int gg;
        if (vc_untrack(VC_K_GRAPH, gkey(key, g), &pages, &gg, &c) == 0 && r == CUDA_SUCCESS && graph && *graph)
            vc_graph_add(*graph, g, pages);
    }
    return r;
}
VC_EXPORT CUresult cuStreamEndCapture(CUstream s, CUgraph *graph) {
    PROLOGUE(cuStreamEndCapture);
    return end_capture(vc_real.cuStreamEndCapture(s, graph), vc_capture_key(s, 0), graph);
}
VC_EXPORT CUresult cuStreamEndCapture_ptsz(CUstream s, CUgraph *graph) {
    PROLOGUE(cuStreamEndCapture_ptsz);
    return end_capture(vc_real.cuStreamEndCapture_ptsz(s, graph), vc_capture_key(s, 1), graph);
}

VC_EXPORT CUresult cuGraphDestroy(CUgraph graph) {
    PROLOGUE(cuGraphDestroy);
    CUresult r = vc_real.cuGraphDestroy(graph);
    if (r == CUDA_SUCCESS && ACTIVE())
        for (int g = 0; g < vc_g.limits.ngpus; g++) {
            uint64_t pages, c;
            int gg;
            vc_untrack(VC_K_GRAPH, gkey(graph, g), &pages, &gg, &c);
        }
    return r;
}

/* The graph exec's pages leave it (destroyed, or never kept). */
static void exec_gone(CUgraphExec e) {
    for (int g = 0; g < vc_g.limits.ngpus; g++) {
        uint64_t pages, c;
        int gg;
        if (vc_untrack(VC_K_GRAPHEXEC, gkey(e, g), &pages, &gg, &c) == 0) {
            pthread_mutex_lock(&graph_mu);
            gmem[g].live -= pages;
            pthread_mutex_unlock(&graph_mu);
        }
    }
}

/* After a successful instantiation: charge the graph's pages as the
 * device's graph memory grows; refuse (destroying the exec) over the cap. */
static CUresult instantiated(CUresult r, CUgraphExec *e, CUgraph graph) {
    if (r != CUDA_SUCCESS || !ACTIVE() || !e || !*e)
        return r;
    for (int g = 0; g < vc_g.limits.ngpus; g++) {
        uint64_t pages;
        int gg;
        if (vc_lookup(VC_K_GRAPH, gkey(graph, g), &pages, &gg) != 0 || !pages)
            continue;
        pthread_mutex_lock(&graph_mu);
        uint64_t need = gmem[g].live + pages;
        int ok = need <= gmem[g].reserved || vc_mem_charge(g, need - gmem[g].reserved) == CUDA_SUCCESS;
        if (ok) {
            if (need > gmem[g].reserved)
                gmem[g].reserved = need;
            gmem[g].live = need;
        }
        pthread_mutex_unlock(&graph_mu);
        if (!ok || vc_track(VC_K_GRAPHEXEC, gkey(*e, g), pages, g) != 0) {
            if (ok) {
                pthread_mutex_lock(&graph_mu);
                gmem[g].live -= pages;
                pthread_mutex_unlock(&graph_mu);
            }
            exec_gone(*e);
            if (vc_real.cuGraphExecDestroy)
                vc_real.cuGraphExecDestroy(*e);
            *e = NULL;
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    return r;
}

VC_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *e, CUgraph graph, unsigned long long flags) {
    PROLOGUE(cuGraphInstantiateWithFlags);
    return instantiated(vc_real.cuGraphInstantiateWithFlags(e, graph, flags), e, graph);
}
VC_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *e, CUgraph graph, void *params) {
    PROLOGUE(cuGraphInstantiateWithParams);
    return instantiated(vc_real.cuGraphInstantiateWithParams(e, graph, params), e, graph);
}
VC_EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *e, CUgraph graph, void *params) {
    PROLOGUE(cuGraphInstantiateWithParams_ptsz);
    return instantiated(vc_real.cuGraphInstantiateWithParams_ptsz(e, graph, params), e, graph);
}
VC_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *e, CUgraph graph, CUgraphNode *err, char *log, size_t n) {
    PROLOGUE(cuGraphInstantiate_v2);
    return instantiated(vc_real.cuGraphInstantiate_v2(e, graph, err, log, n), e, graph);
}

VC_EXPORT CUresult cuGraphExecDestroy(CUgraphExec e) {
    PROLOGUE(cuGraphExecDestroy);
    CUresult r = vc_real.cuGraphExecDestroy(e);
    if (r == CUDA_SUCCESS && ACTIVE())
        exec_gone(e);
    return r;
}

VC_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev) {
    PROLOGUE(cuDeviceGraphMemTrim);
    CUresult r = vc_real.cuDeviceGraphMemTrim(dev);
    int g;
    cuuint64_t held;
    if (r != CUDA_SUCCESS || !ACTIVE() || (g = vc_dev_gpu(dev)) < 0 || !vc_real.cuDeviceGetGraphMemAttribute ||
        vc_real.cuDeviceGetGraphMemAttribute(dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &held) != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&graph_mu);
    uint64_t keep = held > gmem[g].live ? held : gmem[g].live;
    if (keep < gmem[g].reserved) {
        vc_release(g, gmem[g].reserved - keep);
        gmem[g].reserved = keep;
    }
    pthread_mutex_unlock(&graph_mu);
    return r;
}
