/*
 * tests_alloc_paths.c - allocation paths other than the classic allocators,
 * each the way a program (or a tenant) can take device memory: graph nodes
 * added by type (cuGraphAddNode[_v2]) and child graphs moved into a parent;
 * stream capture on the per-thread default stream through cuGetProcAddress.
 * Each security_ case fails on a vcuda that misses the path: the fake
 * driver takes the memory, so its physical peak passes the cap.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "cuda_api.h"
#include "util.h"

#define CAP (60 * MiB)

CUresult cuGraphCreate(CUgraph *, unsigned);
CUresult cuGraphDestroy(CUgraph);
CUresult cuGraphAddNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUgraphNodeParams *);
CUresult cuGraphAddNode_v2(CUgraphNode *, CUgraph, const CUgraphNode *, const CUgraphEdgeData *, size_t,
                           CUgraphNodeParams *);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *, CUgraph, unsigned long long);
CUresult cuGraphExecDestroy(CUgraphExec);
CUresult cuDeviceGraphMemTrim(CUdevice);

static void one_gpu(void) {
    gpu_line g[1] = {{0, CAP, 100}};
    setup_limits(g, 1);
    ctx_costs_nothing(); /* graph pages counted to the byte */
    ctx_on(0);
}
static uint64_t phys(int peak) {
    fake_stats st;
    fakeDeviceStats(0, &st);
    return peak ? st.peak : st.used;
}

static CUgraphNodeParams alloc_node(uint64_t bytes) {
    CUgraphNodeParams p;
    memset(&p, 0, sizeof(p));
    p.type = CU_GRAPH_NODE_TYPE_MEM_ALLOC;
    p.alloc.poolProps.allocType = 1;
    p.alloc.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.alloc.bytesize = bytes;
    return p;
}

/* Instantiating then launching g: charged before the driver takes the pages,
 * refused over the cap. Returns the instantiation's result. */
static CUresult run_graph(CUgraph g, CUgraphExec *e) {
    CUresult r = cuGraphInstantiateWithFlags(e, g, 0);
    if (r == CUDA_SUCCESS)
        CHECK_CU(cuGraphLaunch(*e, NULL));
    return r;
}

/* cuGraphAddNode (12.2) and cuGraphAddNode_v2 (12.3, the default of CUDA
 * 13 headers) with CU_GRAPH_NODE_TYPE_MEM_ALLOC params: the graph's pages
 * are charged at instantiation like cuGraphAddMemAllocNode's. */
TEST(security_graph_add_node_mem_alloc) {
    one_gpu();
    CUgraph g1, g2;
    CUgraphNode n;
    CHECK_CU(cuGraphCreate(&g1, 0));
    CUgraphNodeParams p = alloc_node(40 * MiB);
    CHECK_CU(cuGraphAddNode(&n, g1, NULL, 0, &p));
    CHECK(p.alloc.dptr != 0, "no address for the node");
    CUgraphExec e1, e2;
    CHECK_CU(run_graph(g1, &e1));
    CHECK(region_used(0) == 40 * MiB, "cuGraphAddNode's allocation node: region %llu, the driver holds %llu",
          (unsigned long long)region_used(0), (unsigned long long)phys(0));
    CHECK_CU(cuGraphCreate(&g2, 0));
    p = alloc_node(30 * MiB);
    CHECK_CU(cuGraphAddNode_v2(&n, g2, NULL, NULL, 0, &p));
    CHECK(run_graph(g2, &e2) == CUDA_ERROR_OUT_OF_MEMORY, "a 30 MiB graph (cuGraphAddNode_v2) next to 40 MiB under 60");
    CHECK(phys(1) <= CAP, "physical peak %llu MiB over the cap", (unsigned long long)(phys(1) / MiB));
    CHECK_CU(cuGraphExecDestroy(e1));
    CHECK_CU(cuDeviceGraphMemTrim(0));
    CHECK(region_used(0) == 0 && phys(0) == 0, "after trim: region %llu fake %llu", (unsigned long long)region_used(0),
          (unsigned long long)phys(0));
    CHECK_CU(run_graph(g2, &e2));
    CHECK(region_used(0) == 30 * MiB, "cuGraphAddNode_v2's node: region %llu", (unsigned long long)region_used(0));
    CHECK_CU(cuGraphExecDestroy(e2));
    CHECK_CU(cuDeviceGraphMemTrim(0));
    CHECK_CU(cuGraphDestroy(g1));
    CHECK_CU(cuGraphDestroy(g2));
    /* through cuGetProcAddress as the CUDA 12.3+ runtime resolves it */
    void *fn = NULL;
    CHECK_CU(cuGetProcAddress("cuGraphAddNode", &fn, 12030, 0));
    CHECK(fn == dlsym(RTLD_DEFAULT, "cuGraphAddNode_v2"), "cuGetProcAddress(cuGraphAddNode, 12.3) is not vcuda's _v2 hook");
    CHECK_CU(cuGetProcAddress("cuGraphAddNode", &fn, 12020, 0));
    CHECK(fn == dlsym(RTLD_DEFAULT, "cuGraphAddNode"), "cuGetProcAddress(cuGraphAddNode, 12.2) is not vcuda's hook");
}

/* A child graph whose ownership moves to its parent takes its allocation
 * nodes along: the parent's instantiation takes their pages. */
TEST(security_graph_child_graph_moved) {
    one_gpu();
    CUgraph child, parent, other;
    CUgraphNode n;
    CHECK_CU(cuGraphCreate(&child, 0));
    CUgraphNodeParams p = alloc_node(50 * MiB);
    CHECK_CU(cuGraphAddNode_v2(&n, child, NULL, NULL, 0, &p));
    CHECK_CU(cuGraphCreate(&parent, 0));
    CUgraphNodeParams c;
    memset(&c, 0, sizeof(c));
    c.type = CU_GRAPH_NODE_TYPE_GRAPH;
    c.graph.graph = child;
    c.graph.ownership = CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE;
    CHECK_CU(cuGraphCreate(&other, 0));
    CHECK(cuGraphAddNode_v2(&n, other, NULL, NULL, 0, &c) == CUDA_ERROR_INVALID_VALUE,
          "the fake cloned a child graph with allocation nodes");
    c.graph.ownership = CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE;
    CHECK_CU(cuGraphAddNode_v2(&n, parent, NULL, NULL, 0, &c));
    CHECK(cuGraphDestroy(child) == CUDA_ERROR_INVALID_VALUE, "the fake let a moved child graph be destroyed");
    CUgraphExec e;
    CHECK_CU(run_graph(parent, &e));
    CHECK(region_used(0) == 50 * MiB, "moved child's allocation nodes: region %llu, the driver holds %llu",
          (unsigned long long)region_used(0), (unsigned long long)phys(0));
    CUdeviceptr d;
    CHECK(cuMemAlloc_v2(&d, 12 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "12 MiB next to the parent's 50 MiB under 60");
    CHECK(phys(1) <= CAP, "physical peak %llu MiB", (unsigned long long)(phys(1) / MiB));
    CHECK_CU(cuGraphExecDestroy(e));
    CHECK_CU(cuGraphDestroy(parent));
    CHECK_CU(cuDeviceGraphMemTrim(0));
    CHECK(region_used(0) == 0 && phys(0) == 0, "left: region %llu fake %llu", (unsigned long long)region_used(0),
          (unsigned long long)phys(0));
}

/* The CUDA runtime built with --default-stream per-thread resolves every
 * stream function with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM and
 * captures on the per-thread default stream (NULL to the _ptsz entry
 * points). vcuda must hand back its _ptsz hooks, which call the driver's
 * _ptsz functions: a legacy hook would end a capture on the legacy stream,
 * which is not capturing. The captured allocation is charged with the
 * graph. */
typedef struct {
    unsigned long long flags;
    CUstream hUploadStream;
    CUgraphNode hErrNode_out;
    int result_out;
} instantiate_params;
TEST(security_ptsz_capture_through_procaddr) {
    one_gpu();
    const cuuint64_t ptds = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    CUresult (*begin)(CUstream, int), (*end)(CUstream, CUgraph *), (*alloc)(CUdeviceptr *, size_t, CUstream),
        (*mfree)(CUdeviceptr, CUstream), (*inst)(CUgraphExec *, CUgraph, instantiate_params *),
        (*launch)(CUgraphExec, CUstream);
    CHECK_CU(cuGetProcAddress("cuStreamBeginCapture", (void **)&begin, 12080, ptds));
    CHECK_CU(cuGetProcAddress("cuStreamEndCapture", (void **)&end, 12080, ptds));
    CHECK_CU(cuGetProcAddress("cuMemAllocAsync", (void **)&alloc, 12080, ptds));
    CHECK_CU(cuGetProcAddress("cuMemFreeAsync", (void **)&mfree, 12080, ptds));
    CHECK_CU(cuGetProcAddress("cuGraphInstantiateWithParams", (void **)&inst, 12080, ptds));
    CHECK_CU(cuGetProcAddress("cuGraphLaunch", (void **)&launch, 12080, ptds));
    CHECK((void *)end == dlsym(RTLD_DEFAULT, "cuStreamEndCapture_ptsz"),
          "cuGetProcAddress(cuStreamEndCapture, per-thread) is not vcuda's cuStreamEndCapture_ptsz");
    CHECK((void *)inst == dlsym(RTLD_DEFAULT, "cuGraphInstantiateWithParams_ptsz"),
          "cuGetProcAddress(cuGraphInstantiateWithParams, per-thread) is not vcuda's _ptsz hook");
    CHECK_CU(begin(NULL, 0 /* global */));
    CUdeviceptr d;
    CHECK_CU(alloc(&d, 40 * MiB, NULL));
    CHECK_CU(mfree(d, NULL));
    CHECK(region_used(0) == 0 && phys(0) == 0, "the capture took memory: region %llu fake %llu",
          (unsigned long long)region_used(0), (unsigned long long)phys(0));
    CUgraph g = NULL;
    CUresult r = end(NULL, &g);
    CHECK(r == CUDA_SUCCESS, "ending the per-thread stream's capture through cuGetProcAddress: %d", r);
    instantiate_params ip;
    memset(&ip, 0, sizeof(ip));
    CUgraphExec e, e2;
    CHECK_CU(inst(&e, g, &ip));
    CHECK(region_used(0) == 40 * MiB, "captured allocation node: region %llu", (unsigned long long)region_used(0));
    CHECK(inst(&e2, g, &ip) == CUDA_ERROR_OUT_OF_MEMORY, "a second 40 MiB graph under 60 MiB");
    CHECK_CU(launch(e, NULL));
    CHECK(phys(0) == 40 * MiB && phys(1) <= CAP, "the fake's graph took %llu, peak %llu", (unsigned long long)phys(0),
          (unsigned long long)phys(1));
    CHECK_CU(cuGraphExecDestroy(e));
    CHECK_CU(cuDeviceGraphMemTrim(0));
    CHECK(region_used(0) == 0 && phys(0) == 0, "left: region %llu fake %llu", (unsigned long long)region_used(0),
          (unsigned long long)phys(0));
}

/* CUDA IPC (a server sharing its weights with workers): inside one
 * container the exporter's allocation is charged once, so the importer's
 * mapping is not charged again (it was: a false OOM at half the cap); an
 * importer in another container is charged, so it cannot use memory its own
 * cap does not hold. Child 0 exports 40 MiB in container c0 (cap 60 MiB),
 * child 1 imports it in c0, child 2 in c1 (its own region, cap 60 MiB). */
CUresult cuIpcGetMemHandle(CUipcMemHandle *, CUdeviceptr);
CUresult cuMemPoolExportPointer(CUmemPoolPtrExportData *, CUdeviceptr);
CUresult cuMemPoolImportPointer(CUdeviceptr *, CUmemoryPool, CUmemPoolPtrExportData *);
static chan ipc_ch[3];
static int pool_pointers; /* share pool allocations (cuMemPoolExportPointer) instead of IPC handles */
static int vmm_fabric;    /* share a cuMemCreate allocation by a fabric handle */
CUresult cuMemExportToShareableHandle(void *, CUmemGenericAllocationHandle, int, unsigned long long);
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *, void *, int);
#define FABRIC 8
static CUdeviceptr vmm_va;
/* Imports and maps 40 MiB shared by a fabric handle. */
static CUresult vmm_import(CUdeviceptr *d, CUipcMemHandle *token) {
    CUmemGenericAllocationHandle h;
    CUresult r = cuMemImportFromShareableHandle(&h, token, FABRIC);
    if (r != CUDA_SUCCESS)
        return r;
    CHECK_CU(cuMemAddressReserve(&vmm_va, 40 * MiB, 0, 0, 0));
    r = cuMemMap(vmm_va, 40 * MiB, 0, h, 0);
    CHECK_CU(cuMemRelease(h));
    *d = vmm_va;
    return r;
}
static uint64_t container_used(void) {
    size_t fr = 0, tot = 0;
    CHECK_CU(cuMemGetInfo_v2(&fr, &tot));
    return tot - fr;
}
static CUipcMemHandle read_handle(void) {
    CUipcMemHandle h; /* the same 64 bytes as CUmemPoolPtrExportData */
    FILE *f = fopen(tpath("ipc-handle"), "r");
    CHECK(f && fread(&h, sizeof(h), 1, f) == 1, "read handle");
    fclose(f);
    return h;
}
static int ipc_child(int i, void *arg) {
    (void)arg;
    if (i == 2) { /* another container */
        char text[1024];
        snprintf(text, sizeof(text), "tessera-vcuda-limits 1\ncontainer c1\nregion %s/c1-region\ngpu %s %llu 100\n",
                 tmpdir(), fake_uuid(0), (unsigned long long)CAP);
        write_file(tpath("c1-limits"), text);
        setenv("TESSERA_VCUDA_LIMITS", tpath("c1-limits"), 1);
    }
    ctx_on(0);
    CUdeviceptr d, x;
    CUstream s = NULL;
    CUmemoryPool pool = NULL;
    if (pool_pointers) {
        CHECK_CU(cuStreamCreate(&s, 0));
        CHECK_CU(cuDeviceGetDefaultMemPool(&pool, 0));
    }
    if (i == 0) {
        CUipcMemHandle h;
        CUmemGenericAllocationHandle vh = 0;
        if (vmm_fabric) {
            CUmemAllocationProp p;
            memset(&p, 0, sizeof(p));
            p.type = 1;
            p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            CHECK_CU(cuMemCreate(&vh, 40 * MiB, &p, 0));
            CHECK_CU(cuMemExportToShareableHandle(&h, vh, FABRIC, 0));
        } else if (pool_pointers) {
            CHECK_CU(cuMemAllocAsync(&d, 40 * MiB, s));
            CHECK_CU(cuMemPoolExportPointer((CUmemPoolPtrExportData *)&h, d));
        } else {
            CHECK_CU(cuMemAlloc_v2(&d, 40 * MiB));
            CHECK_CU(cuIpcGetMemHandle(&h, d));
        }
        FILE *f = fopen(tpath("ipc-handle"), "w");
        CHECK(f && fwrite(&h, sizeof(h), 1, f) == 1, "write handle");
        fclose(f);
        chan_send_up(&ipc_ch[0], 1);
        chan_recv_down(&ipc_ch[0]); /* the importers are done */
        if (vmm_fabric)
            CHECK_CU(cuMemRelease(vh));
        else
            CHECK_CU(cuMemFree_v2(d));
        if (pool_pointers) {
            CHECK_CU(cuStreamSynchronize(s));
            CHECK_CU(cuMemPoolTrimTo(pool, 0));
        }
        chan_send_up(&ipc_ch[0], container_used());
        return 0;
    }
    chan_recv_down(&ipc_ch[i]);
    CUipcMemHandle h = read_handle();
    CUresult r = vmm_fabric      ? vmm_import(&d, &h)
                 : pool_pointers ? cuMemPoolImportPointer(&d, pool, (CUmemPoolPtrExportData *)&h)
                               : cuIpcOpenMemHandle_v2(&d, h, 1);
    if (i == 1) {
        CHECK(r == CUDA_SUCCESS, "opening a handle exported in the same container: %d (counted twice)", r);
        CHECK(container_used() == 40 * MiB, "same container: %llu MiB charged for one 40 MiB allocation",
              (unsigned long long)(container_used() / MiB));
        CHECK_CU(cuMemAlloc_v2(&x, 20 * MiB)); /* the rest of the cap */
        CHECK(cuMemAlloc_v2(&d, 1) == CUDA_ERROR_OUT_OF_MEMORY || (cuMemFree_v2(d), 0), "over the cap");
        CHECK_CU(cuMemFree_v2(x));
    } else {
        CHECK(r == CUDA_SUCCESS, "another container's handle: %d", r);
        CHECK(container_used() == 40 * MiB, "another container's import charged %llu MiB to the importer, want 40",
              (unsigned long long)(container_used() / MiB));
        CHECK(cuMemAlloc_v2(&x, 21 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "21 MiB next to a 40 MiB import under 60");
    }
    if (vmm_fabric) {
        CHECK_CU(cuMemUnmap(d, 40 * MiB));
        CHECK_CU(cuMemAddressFree(d, 40 * MiB));
    } else if (pool_pointers)
        CHECK_CU(cuMemFreeAsync(d, s));
    else
        CHECK_CU(cuIpcCloseMemHandle(d));
    CHECK(container_used() == (i == 1 ? 40 * MiB : 0), "after close: %llu", (unsigned long long)container_used());
    chan_send_up(&ipc_ch[i], 1);
    return 0;
}
static void shared_memory_counted_once(void) {
    gpu_line g[1] = {{0, CAP, 100}};
    setup_limits(g, 1);
    ctx_costs_nothing(); /* the IPC bytes to the cap exactly */
    pid_t pid[3];
    for (int i = 0; i < 3; i++) {
        chan_init(&ipc_ch[i]);
        pid[i] = spawn(ipc_child, i, NULL);
    }
    chan_recv_up(&ipc_ch[0]);
    for (int i = 1; i < 3; i++) {
        chan_send_down(&ipc_ch[i], 1);
        chan_recv_up(&ipc_ch[i]);
    }
    chan_send_down(&ipc_ch[0], 1);
    CHECK(chan_recv_up(&ipc_ch[0]) == 0, "exporter's container still charged");
    for (int i = 0; i < 3; i++)
        CHECK(wait_child(pid[i]) == 0, "child %d failed", i);
}
TEST(security_ipc_counted_once_per_container) { shared_memory_counted_once(); }
/* The same with stream-ordered pool allocations shared by
 * cuMemPoolExportPointer / cuMemPoolImportPointer (an import was not
 * charged at all: another container's memory was free to use). */
TEST(security_pool_import_pointer_counted) {
    pool_pointers = 1;
    shared_memory_counted_once();
}
/* The same with VMM memory shared by cuMemExportToShareableHandle /
 * cuMemImportFromShareableHandle (fabric handles): the import was not
 * charged at all; it is charged to the importer for what it maps. */
TEST(security_vmm_import_shareable_handle_counted) {
    vmm_fabric = 1;
    shared_memory_counted_once();
}
