/*
 * procaddr.c - make sure every way of reaching the driver reaches the hooks.
 *
 *  - Symbol interposition: vcuda is preloaded, so cu* / nvml* calls of
 *    programs linked against libcuda/libnvidia-ml bind to vcuda's exports.
 *  - dlsym(handle, "cu...") on a dlopen()ed libcuda looks only inside that
 *    library, skipping the preload; the CUDA runtime and NVML users do exactly
 *    this. vcuda exports dlsym and answers hooked names itself.
 *  - cuGetProcAddress / cuGetProcAddress_v2: the CUDA runtime (>= 11.3)
 *    resolves every driver function through it, by base name, version and
 *    per-thread-stream flag. vcuda asks the driver, then swaps in the hook
 *    for the variant (_v2, _ptsz, ...) the driver picked.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "real.h"
#include "vcuda.h"

/* Hooks defined in hooks_*.c. Declared without prototypes (all return an
 * int-sized result): only their addresses are used here. */
#define H(name) extern int name();
H(cuMemAlloc_v2) H(cuMemAlloc) H(cuMemAllocPitch_v2) H(cuMemAllocPitch) H(cuMemAllocManaged)
H(cuMemFree_v2) H(cuArrayCreate_v2) H(cuArrayCreate) H(cuArray3DCreate_v2) H(cuArray3DCreate)
H(cuArrayDestroy) H(cuMipmappedArrayCreate) H(cuMipmappedArrayDestroy) H(cuMemCreate)
H(cuMemRelease) H(cuMemMap) H(cuMemUnmap) H(cuMemRetainAllocationHandle) H(cuMemExportToShareableHandle) H(cuMemImportFromShareableHandle) H(cuMemAllocAsync) H(cuMemAllocAsync_ptsz) H(cuMemAllocFromPoolAsync)
H(cuMemAllocFromPoolAsync_ptsz) H(cuMemFreeAsync) H(cuMemFreeAsync_ptsz) H(cuMemPoolCreate)
H(cuMemPoolDestroy) H(cuMemPoolSetAttribute) H(cuMemPoolTrimTo) H(cuMemPoolExportPointer) H(cuMemPoolImportPointer) H(cuStreamSynchronize)
H(cuStreamSynchronize_ptsz) H(cuCtxSynchronize) H(cuEventSynchronize) H(cuGraphAddMemAllocNode) H(cuGraphAddNode) H(cuGraphAddNode_v2) H(cuStreamEndCapture) H(cuStreamEndCapture_ptsz) H(cuGraphDestroy)
H(cuGraphInstantiateWithFlags) H(cuGraphInstantiateWithParams) H(cuGraphInstantiateWithParams_ptsz) H(cuGraphInstantiate_v2) H(cuGraphExecDestroy)
H(cuDeviceGraphMemTrim) H(cuDeviceGetDefaultMemPool) H(cuDeviceGetMemPool) H(cuIpcGetMemHandle) H(cuIpcOpenMemHandle)
H(cuIpcOpenMemHandle_v2) H(cuIpcCloseMemHandle) H(cuImportExternalMemory)
H(cuDestroyExternalMemory) H(cuMemGetInfo_v2) H(cuMemGetInfo) H(cuDeviceTotalMem_v2)
H(cuDeviceTotalMem) H(cuLaunchKernel) H(cuLaunchKernel_ptsz) H(cuLaunchKernelEx)
H(cuLaunchKernelEx_ptsz) H(cuLaunchCooperativeKernel) H(cuLaunchCooperativeKernel_ptsz)
H(cuGraphLaunch) H(cuGraphLaunch_ptsz) H(cuCtxDestroy) H(cuCtxDestroy_v2) H(cuCtxCreate) H(cuCtxCreate_v2)
H(cuCtxCreate_v3) H(cuCtxCreate_v4) H(cuGreenCtxCreate) H(cuGreenCtxDestroy) H(cuCtxFromGreenCtx)
H(cuDevicePrimaryCtxRetain) H(cuModuleLoad) H(cuModuleLoadData) H(cuModuleLoadDataEx)
H(cuModuleLoadFatBinary) H(cuModuleUnload) H(cuLibraryLoadData) H(cuLibraryLoadFromFile) H(cuLibraryUnload) H(cuDevicePrimaryCtxRelease)
H(cuDevicePrimaryCtxRelease_v2) H(cuDevicePrimaryCtxReset) H(cuDevicePrimaryCtxReset_v2)
H(nvmlDeviceGetMemoryInfo) H(nvmlDeviceGetMemoryInfo_v2)
H(cuCtxSetLimit) H(cuLaunch) H(cuLaunchGrid) H(cuLaunchGridAsync) H(cuLaunchCooperativeKernelMultiDevice)
H(nvmlDeviceGetComputeRunningProcesses) H(nvmlDeviceGetComputeRunningProcesses_v2)
H(nvmlDeviceGetComputeRunningProcesses_v3) H(nvmlDeviceGetGraphicsRunningProcesses)
H(nvmlDeviceGetGraphicsRunningProcesses_v2) H(nvmlDeviceGetGraphicsRunningProcesses_v3)
H(nvmlDeviceGetMPSComputeRunningProcesses) H(nvmlDeviceGetMPSComputeRunningProcesses_v2)
H(nvmlDeviceGetMPSComputeRunningProcesses_v3) H(nvmlDeviceGetRunningProcessDetailList)
H(nvmlDeviceGetUtilizationRates)
#undef H
VC_EXPORT CUresult cuGetProcAddress(const char *, void **, int, cuuint64_t);
VC_EXPORT CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t,
                                       CUdriverProcAddressQueryResult *);

typedef struct {
    const char *sym;  /* exported name */
    const char *base; /* name cuGetProcAddress is asked for */
    void *hook;
    void **real;
    int min_version; /* first CUDA version whose headers map base to sym */
    int ptsz;        /* per-thread default stream variant */
} hook_entry;

#define E(sym, base, ver, ptsz) {#sym, base, (void *)sym, (void **)&vc_real.sym, ver, ptsz}
static const hook_entry hooks[] = {
    E(cuMemAlloc, "cuMemAlloc", 0, 0),
    E(cuMemAlloc_v2, "cuMemAlloc", 3020, 0),
    E(cuMemAllocPitch, "cuMemAllocPitch", 0, 0),
    E(cuMemAllocPitch_v2, "cuMemAllocPitch", 3020, 0),
    E(cuMemAllocManaged, "cuMemAllocManaged", 0, 0),
    E(cuMemFree_v2, "cuMemFree", 3020, 0),
    E(cuArrayCreate, "cuArrayCreate", 0, 0),
    E(cuArrayCreate_v2, "cuArrayCreate", 3020, 0),
    E(cuArray3DCreate, "cuArray3DCreate", 0, 0),
    E(cuArray3DCreate_v2, "cuArray3DCreate", 3020, 0),
    E(cuArrayDestroy, "cuArrayDestroy", 0, 0),
    E(cuMipmappedArrayCreate, "cuMipmappedArrayCreate", 0, 0),
    E(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy", 0, 0),
    E(cuMemCreate, "cuMemCreate", 0, 0),
    E(cuMemRelease, "cuMemRelease", 0, 0),
    E(cuMemMap, "cuMemMap", 0, 0),
    E(cuMemUnmap, "cuMemUnmap", 0, 0),
    E(cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle", 0, 0),
    E(cuMemExportToShareableHandle, "cuMemExportToShareableHandle", 0, 0),
    E(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle", 0, 0),
    E(cuMemAllocAsync, "cuMemAllocAsync", 0, 0),
    E(cuMemAllocAsync_ptsz, "cuMemAllocAsync", 0, 1),
    E(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 0, 0),
    E(cuMemAllocFromPoolAsync_ptsz, "cuMemAllocFromPoolAsync", 0, 1),
    E(cuMemFreeAsync, "cuMemFreeAsync", 0, 0),
    E(cuMemFreeAsync_ptsz, "cuMemFreeAsync", 0, 1),
    E(cuMemPoolCreate, "cuMemPoolCreate", 0, 0),
    E(cuMemPoolDestroy, "cuMemPoolDestroy", 0, 0),
    E(cuMemPoolSetAttribute, "cuMemPoolSetAttribute", 0, 0),
    E(cuMemPoolTrimTo, "cuMemPoolTrimTo", 0, 0),
    E(cuMemPoolExportPointer, "cuMemPoolExportPointer", 0, 0),
    E(cuMemPoolImportPointer, "cuMemPoolImportPointer", 0, 0),
    E(cuStreamSynchronize, "cuStreamSynchronize", 0, 0),
    E(cuStreamSynchronize_ptsz, "cuStreamSynchronize", 0, 1),
    E(cuCtxSynchronize, "cuCtxSynchronize", 0, 0),
    E(cuEventSynchronize, "cuEventSynchronize", 0, 0),
    E(cuGraphAddMemAllocNode, "cuGraphAddMemAllocNode", 0, 0),
    E(cuGraphAddNode, "cuGraphAddNode", 12020, 0),
    E(cuGraphAddNode_v2, "cuGraphAddNode", 12030, 0),
    E(cuStreamEndCapture, "cuStreamEndCapture", 0, 0),
    E(cuStreamEndCapture_ptsz, "cuStreamEndCapture", 0, 1),
    E(cuGraphDestroy, "cuGraphDestroy", 0, 0),
    E(cuGraphInstantiate_v2, "cuGraphInstantiate", 0, 0),
    E(cuGraphInstantiateWithFlags, "cuGraphInstantiate", 12000, 0),
    E(cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags", 0, 0),
    E(cuGraphInstantiateWithParams, "cuGraphInstantiateWithParams", 0, 0),
    E(cuGraphInstantiateWithParams_ptsz, "cuGraphInstantiateWithParams", 0, 1),
    E(cuGraphExecDestroy, "cuGraphExecDestroy", 0, 0),
    E(cuDeviceGraphMemTrim, "cuDeviceGraphMemTrim", 0, 0),
    E(cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool", 0, 0),
    E(cuDeviceGetMemPool, "cuDeviceGetMemPool", 0, 0),
    E(cuIpcGetMemHandle, "cuIpcGetMemHandle", 0, 0),
    E(cuIpcOpenMemHandle, "cuIpcOpenMemHandle", 0, 0),
    E(cuIpcOpenMemHandle_v2, "cuIpcOpenMemHandle", 11000, 0),
    E(cuIpcCloseMemHandle, "cuIpcCloseMemHandle", 0, 0),
    E(cuImportExternalMemory, "cuImportExternalMemory", 0, 0),
    E(cuDestroyExternalMemory, "cuDestroyExternalMemory", 0, 0),
    E(cuMemGetInfo, "cuMemGetInfo", 0, 0),
    E(cuMemGetInfo_v2, "cuMemGetInfo", 3020, 0),
    E(cuDeviceTotalMem, "cuDeviceTotalMem", 0, 0),
    E(cuDeviceTotalMem_v2, "cuDeviceTotalMem", 3020, 0),
    E(cuLaunchKernel, "cuLaunchKernel", 0, 0),
    E(cuLaunchKernel_ptsz, "cuLaunchKernel", 0, 1),
    E(cuLaunchKernelEx, "cuLaunchKernelEx", 0, 0),
    E(cuLaunchKernelEx_ptsz, "cuLaunchKernelEx", 0, 1),
    E(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", 0, 0),
    E(cuLaunchCooperativeKernel_ptsz, "cuLaunchCooperativeKernel", 0, 1),
    E(cuGraphLaunch, "cuGraphLaunch", 0, 0),
    E(cuGraphLaunch_ptsz, "cuGraphLaunch", 0, 1),
    E(cuCtxCreate, "cuCtxCreate", 0, 0),
    E(cuCtxCreate_v2, "cuCtxCreate", 3020, 0),
    E(cuCtxCreate_v3, "cuCtxCreate", 11040, 0),
    E(cuCtxCreate_v4, "cuCtxCreate", 12050, 0),
    E(cuGreenCtxCreate, "cuGreenCtxCreate", 0, 0),
    E(cuGreenCtxDestroy, "cuGreenCtxDestroy", 0, 0),
    E(cuCtxFromGreenCtx, "cuCtxFromGreenCtx", 0, 0),
    E(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 0, 0),
    E(cuModuleLoad, "cuModuleLoad", 0, 0),
    E(cuModuleLoadData, "cuModuleLoadData", 0, 0),
    E(cuModuleLoadDataEx, "cuModuleLoadDataEx", 0, 0),
    E(cuModuleLoadFatBinary, "cuModuleLoadFatBinary", 0, 0),
    E(cuModuleUnload, "cuModuleUnload", 0, 0),
    E(cuLibraryLoadData, "cuLibraryLoadData", 0, 0),
    E(cuLibraryLoadFromFile, "cuLibraryLoadFromFile", 0, 0),
    E(cuLibraryUnload, "cuLibraryUnload", 0, 0),
    E(cuCtxDestroy, "cuCtxDestroy", 0, 0),
    E(cuCtxDestroy_v2, "cuCtxDestroy", 4000, 0),
    E(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease", 0, 0),
    E(cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease", 11000, 0),
    E(cuDevicePrimaryCtxReset, "cuDevicePrimaryCtxReset", 0, 0),
    E(cuDevicePrimaryCtxReset_v2, "cuDevicePrimaryCtxReset", 11000, 0),
    E(cuGetProcAddress, "cuGetProcAddress", 0, 0),
    E(cuGetProcAddress_v2, "cuGetProcAddress", 12000, 0),
    E(nvmlDeviceGetMemoryInfo, "nvmlDeviceGetMemoryInfo", 0, 0),
    E(nvmlDeviceGetMemoryInfo_v2, "nvmlDeviceGetMemoryInfo_v2", 0, 0),
    E(cuCtxSetLimit, "cuCtxSetLimit", 0, 0),
    E(cuLaunch, "cuLaunch", 0, 0),
    E(cuLaunchGrid, "cuLaunchGrid", 0, 0),
    E(cuLaunchGridAsync, "cuLaunchGridAsync", 0, 0),
    E(cuLaunchCooperativeKernelMultiDevice, "cuLaunchCooperativeKernelMultiDevice", 0, 0),
    E(nvmlDeviceGetComputeRunningProcesses, "nvmlDeviceGetComputeRunningProcesses", 0, 0),
    E(nvmlDeviceGetComputeRunningProcesses_v2, "nvmlDeviceGetComputeRunningProcesses_v2", 0, 0),
    E(nvmlDeviceGetComputeRunningProcesses_v3, "nvmlDeviceGetComputeRunningProcesses_v3", 0, 0),
    E(nvmlDeviceGetGraphicsRunningProcesses, "nvmlDeviceGetGraphicsRunningProcesses", 0, 0),
    E(nvmlDeviceGetGraphicsRunningProcesses_v2, "nvmlDeviceGetGraphicsRunningProcesses_v2", 0, 0),
    E(nvmlDeviceGetGraphicsRunningProcesses_v3, "nvmlDeviceGetGraphicsRunningProcesses_v3", 0, 0),
    E(nvmlDeviceGetMPSComputeRunningProcesses, "nvmlDeviceGetMPSComputeRunningProcesses", 0, 0),
    E(nvmlDeviceGetMPSComputeRunningProcesses_v2, "nvmlDeviceGetMPSComputeRunningProcesses_v2", 0, 0),
    E(nvmlDeviceGetMPSComputeRunningProcesses_v3, "nvmlDeviceGetMPSComputeRunningProcesses_v3", 0, 0),
    E(nvmlDeviceGetRunningProcessDetailList, "nvmlDeviceGetRunningProcessDetailList", 0, 0),
    E(nvmlDeviceGetUtilizationRates, "nvmlDeviceGetUtilizationRates", 0, 0),
};
#undef E
#define NHOOKS (sizeof(hooks) / sizeof(hooks[0]))

static const hook_entry *by_sym(const char *name) {
    for (size_t i = 0; i < NHOOKS; i++)
        if (strcmp(hooks[i].sym, name) == 0)
            return &hooks[i];
    return NULL;
}

/* Pick the hook for what the driver returned for `symbol`. */
static void *swap(const char *symbol, void *realp, int version, cuuint64_t flags) {
    if (!realp)
        return realp;
    for (size_t i = 0; i < NHOOKS; i++) {
        if (hooks[i].hook == realp)
            return realp; /* already ours */
        if (*hooks[i].real == realp)
            return hooks[i].hook;
    }
    /* The driver handed out an address we did not resolve by name (an
     * internal alias). Choose the variant the headers would: the newest
     * version not after `version`, per-thread stream if asked for. */
    int ptsz = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    const hook_entry *best = NULL;
    for (size_t i = 0; i < NHOOKS; i++) {
        const hook_entry *h = &hooks[i];
        if (strcmp(h->base, symbol) != 0 || h->min_version > version)
            continue;
        if (best && h->ptsz != ptsz && best->ptsz == ptsz)
            continue;
        if (!best || (h->ptsz == ptsz && best->ptsz != ptsz) || h->min_version > best->min_version)
            best = h;
    }
    if (!best)
        return realp; /* not a hooked function */
    if (!*best->real)
        *best->real = realp; /* driver lacks the named export; forward to what it gave */
    return best->hook;
}

VC_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                                       cuuint64_t flags, CUdriverProcAddressQueryResult *status) {
    vc_init_cuda();
    CUresult r;
    if (vc_real.cuGetProcAddress_v2)
        r = vc_real.cuGetProcAddress_v2(symbol, pfn, version, flags, status);
    else if (vc_real.cuGetProcAddress)
        r = vc_real.cuGetProcAddress(symbol, pfn, version, flags);
    else
        return CUDA_ERROR_NOT_INITIALIZED;
    if (r == CUDA_SUCCESS && pfn && symbol)
        *pfn = swap(symbol, *pfn, version, flags);
    return r;
}

VC_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags) {
    vc_init_cuda();
    CUresult r;
    if (vc_real.cuGetProcAddress)
        r = vc_real.cuGetProcAddress(symbol, pfn, version, flags);
    else if (vc_real.cuGetProcAddress_v2)
        r = vc_real.cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
    else
        return CUDA_ERROR_NOT_INITIALIZED;
    if (r == CUDA_SUCCESS && pfn && symbol)
        *pfn = swap(symbol, *pfn, version, flags);
    return r;
}

/*
 * dlsym: lookups in an explicit library handle for a hooked name get the
 * hook (if that library really has the symbol). Everything else, including
 * RTLD_DEFAULT / RTLD_NEXT (whose meaning depends on the caller's address),
 * is a tail call into the real dlsym so the caller's return address is what
 * glibc sees. The build checks that this compiles to a jump (see Makefile).
 */
VC_EXPORT void *dlsym(void *handle, const char *name) {
    /* glibc declares name nonnull, but a caller may still pass NULL. */
    const char *volatile nm = name;
    if (handle != RTLD_DEFAULT && handle != RTLD_NEXT && nm &&
        ((name[0] == 'c' && name[1] == 'u') || (name[0] == 'n' && name[1] == 'v'))) {
        const hook_entry *h = by_sym(name);
        if (h) {
            void *realp = vc_real_dlsym(handle, name);
            return realp ? h->hook : NULL;
        }
    }
    return vc_real_dlsym(handle, name);
}
