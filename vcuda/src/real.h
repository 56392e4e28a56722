/*
 * real.h - pointers to the real driver (libcuda.so.1) and NVML
 * (libnvidia-ml.so.1) entry points, resolved with dlopen + the real dlsym.
 * Every hooked symbol has its real counterpart here under the same name.
 */
#ifndef VCUDA_REAL_H
#define VCUDA_REAL_H

#include "cuda_types.h"

/* X(name, parameter list). All return CUresult (an int). */
#define VC_CU_FUNCS(X)                                                                             \
    X(cuGetProcAddress, (const char *, void **, int, cuuint64_t))                                  \
    X(cuGetProcAddress_v2, (const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *)) \
    X(cuCtxGetDevice, (CUdevice *))                                                                \
    X(cuCtxGetCurrent, (CUcontext *))                                                              \
    X(cuCtxPushCurrent_v2, (CUcontext))                                                            \
    X(cuCtxPopCurrent_v2, (CUcontext *))                                                           \
    X(cuStreamGetCtx, (CUstream, CUcontext *))                                                     \
    X(cuStreamIsCapturing, (CUstream, int *))                                                      \
    X(cuStreamIsCapturing_ptsz, (CUstream, int *))                                                 \
    X(cuDeviceGetUuid, (CUuuid *, CUdevice))                                                       \
    X(cuDevicePrimaryCtxGetState, (CUdevice, unsigned int *, int *))                               \
    X(cuDevicePrimaryCtxRetain, (CUcontext *, CUdevice))                                           \
    X(cuCtxDestroy_v2, (CUcontext))                                                                \
    X(cuCtxCreate, (CUcontext *, unsigned int, CUdevice))                                         \
    X(cuCtxCreate_v2, (CUcontext *, unsigned int, CUdevice))                                      \
    X(cuCtxCreate_v3, (CUcontext *, void *, int, unsigned int, CUdevice))                         \
    X(cuCtxCreate_v4, (CUcontext *, void *, unsigned int, CUdevice))                              \
    X(cuGreenCtxCreate, (CUgreenCtx *, CUdevResourceDesc, CUdevice, unsigned int))                \
    X(cuGreenCtxDestroy, (CUgreenCtx))                                                             \
    X(cuCtxFromGreenCtx, (CUcontext *, CUgreenCtx))                                                \
    X(cuModuleLoad, (CUmodule *, const char *))                                                    \
    X(cuModuleLoadData, (CUmodule *, const void *))                                                \
    X(cuModuleLoadDataEx, (CUmodule *, const void *, unsigned int, void *, void **))               \
    X(cuModuleLoadFatBinary, (CUmodule *, const void *))                                           \
    X(cuModuleUnload, (CUmodule))                                                                  \
    X(cuLibraryLoadData, (CUlibrary *, const void *, void *, void **, unsigned int, void *, void **, unsigned int)) \
    X(cuLibraryLoadFromFile, (CUlibrary *, const char *, void *, void **, unsigned int, void *, void **, unsigned int)) \
    X(cuLibraryUnload, (CUlibrary))                                                                \
    X(cuCtxDestroy, (CUcontext))                                                                   \
    X(cuDevicePrimaryCtxRelease_v2, (CUdevice))                                                    \
    X(cuDevicePrimaryCtxRelease, (CUdevice))                                                       \
    X(cuDevicePrimaryCtxReset_v2, (CUdevice))                                                      \
    X(cuDevicePrimaryCtxReset, (CUdevice))                                                         \
    X(cuDeviceGetUuid_v2, (CUuuid *, CUdevice))                                                    \
    X(cuDeviceGetAttribute, (int *, int, CUdevice))                                                \
    X(cuMemGetAddressRange_v2, (CUdeviceptr *, size_t *, CUdeviceptr))                             \
    X(cuEventCreate, (CUevent *, unsigned int))                                                    \
    X(cuEventRecord, (CUevent, CUstream))                                                          \
    X(cuEventRecord_ptsz, (CUevent, CUstream))                                                     \
    X(cuEventQuery, (CUevent))                                                                     \
    X(cuLaunchHostFunc, (CUstream, void (*)(void *), void *))                                      \
    X(cuLaunchHostFunc_ptsz, (CUstream, void (*)(void *), void *))                                 \
    X(cuMemHostAlloc, (void **, size_t, unsigned int))                                             \
    X(cuMemFreeHost, (void *))                                                                     \
    X(cuMemHostGetDevicePointer_v2, (CUdeviceptr *, void *, unsigned int))                         \
    X(cuStreamWaitValue32_v2, (CUstream, CUdeviceptr, uint32_t, unsigned int))                     \
    X(cuStreamWaitValue32_v2_ptsz, (CUstream, CUdeviceptr, uint32_t, unsigned int))                \
    X(cuEventSynchronize, (CUevent))                                                               \
    X(cuEventElapsedTime, (float *, CUevent, CUevent))                                             \
    X(cuEventDestroy_v2, (CUevent))                                                                \
    X(cuMemAlloc_v2, (CUdeviceptr *, size_t))                                                      \
    X(cuMemAlloc, (unsigned int *, unsigned int))                                                  \
    X(cuMemAllocPitch_v2, (CUdeviceptr *, size_t *, size_t, size_t, unsigned int))                 \
    X(cuMemAllocPitch, (unsigned int *, unsigned int *, unsigned int, unsigned int, unsigned int)) \
    X(cuMemAllocManaged, (CUdeviceptr *, size_t, unsigned int))                                    \
    X(cuMemFree_v2, (CUdeviceptr))                                                                 \
    X(cuArrayCreate_v2, (CUarray *, const CUDA_ARRAY_DESCRIPTOR *))                                \
    X(cuArrayCreate, (CUarray *, const void *))                                                    \
    X(cuArray3DCreate_v2, (CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *))                            \
    X(cuArray3DCreate, (CUarray *, const void *))                                                  \
    X(cuArrayDestroy, (CUarray))                                                                   \
    X(cuMipmappedArrayCreate, (CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned int)) \
    X(cuMipmappedArrayDestroy, (CUmipmappedArray))                                                 \
    X(cuMemCreate, (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long)) \
    X(cuMemRelease, (CUmemGenericAllocationHandle))                                                \
    X(cuMemMap, (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))   \
    X(cuMemUnmap, (CUdeviceptr, size_t))                                                           \
    X(cuMemRetainAllocationHandle, (CUmemGenericAllocationHandle *, void *))                       \
    X(cuMemExportToShareableHandle, (void *, CUmemGenericAllocationHandle, int, unsigned long long)) \
    X(cuMemImportFromShareableHandle, (CUmemGenericAllocationHandle *, void *, int))               \
    X(cuMemGetAllocationPropertiesFromHandle, (CUmemAllocationProp *, CUmemGenericAllocationHandle)) \
    X(cuMemAllocAsync, (CUdeviceptr *, size_t, CUstream))                                          \
    X(cuMemAllocAsync_ptsz, (CUdeviceptr *, size_t, CUstream))                                     \
    X(cuMemAllocFromPoolAsync, (CUdeviceptr *, size_t, CUmemoryPool, CUstream))                    \
    X(cuMemAllocFromPoolAsync_ptsz, (CUdeviceptr *, size_t, CUmemoryPool, CUstream))               \
    X(cuMemFreeAsync, (CUdeviceptr, CUstream))                                                     \
    X(cuMemFreeAsync_ptsz, (CUdeviceptr, CUstream))                                                \
    X(cuMemPoolCreate, (CUmemoryPool *, const CUmemPoolProps *))                                   \
    X(cuMemPoolDestroy, (CUmemoryPool))                                                            \
    X(cuMemPoolSetAttribute, (CUmemoryPool, int, void *))                                         \
    X(cuMemPoolGetAttribute, (CUmemoryPool, int, void *))                                         \
    X(cuMemPoolTrimTo, (CUmemoryPool, size_t))                                                     \
    X(cuMemPoolExportPointer, (CUmemPoolPtrExportData *, CUdeviceptr))                            \
    X(cuMemPoolImportPointer, (CUdeviceptr *, CUmemoryPool, CUmemPoolPtrExportData *))            \
    X(cuStreamSynchronize, (CUstream))                                                             \
    X(cuStreamSynchronize_ptsz, (CUstream))                                                        \
    X(cuCtxSynchronize, (void))                                                                    \
    X(cuDeviceGetDefaultMemPool, (CUmemoryPool *, CUdevice))                                       \
    X(cuDeviceGetMemPool, (CUmemoryPool *, CUdevice))                                              \
    X(cuIpcGetMemHandle, (CUipcMemHandle *, CUdeviceptr))                                         \
    X(cuIpcOpenMemHandle, (CUdeviceptr *, CUipcMemHandle, unsigned int))                           \
    X(cuIpcOpenMemHandle_v2, (CUdeviceptr *, CUipcMemHandle, unsigned int))                        \
    X(cuIpcCloseMemHandle, (CUdeviceptr))                                                          \
    X(cuImportExternalMemory, (CUexternalMemory *, const CUDA_EXTERNAL_MEMORY_HANDLE_DESC *))      \
    X(cuDestroyExternalMemory, (CUexternalMemory))                                                 \
    X(cuMemGetInfo_v2, (size_t *, size_t *))                                                       \
    X(cuMemGetInfo, (unsigned int *, unsigned int *))                                              \
    X(cuDeviceTotalMem_v2, (size_t *, CUdevice))                                                   \
    X(cuDeviceTotalMem, (unsigned int *, CUdevice))                                                \
    X(cuLaunchKernel, (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **, void **)) \
    X(cuLaunchKernel_ptsz, (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **, void **)) \
    X(cuLaunchKernelEx, (const CUlaunchConfig *, CUfunction, void **, void **))                    \
    X(cuLaunchKernelEx_ptsz, (const CUlaunchConfig *, CUfunction, void **, void **))               \
    X(cuLaunchCooperativeKernel, (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **)) \
    X(cuLaunchCooperativeKernel_ptsz, (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **)) \
    X(cuGraphLaunch, (CUgraphExec, CUstream))                                                      \
    X(cuGraphAddMemAllocNode, (CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUDA_MEM_ALLOC_NODE_PARAMS *)) \
    X(cuGraphAddNode, (CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUgraphNodeParams *))  \
    X(cuGraphAddNode_v2, (CUgraphNode *, CUgraph, const CUgraphNode *, const CUgraphEdgeData *, size_t, CUgraphNodeParams *)) \
    X(cuGraphInstantiateWithFlags, (CUgraphExec *, CUgraph, unsigned long long))                   \
    X(cuGraphInstantiateWithParams, (CUgraphExec *, CUgraph, void *))                              \
    X(cuGraphInstantiate_v2, (CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t))              \
    X(cuGraphExecDestroy, (CUgraphExec))                                                           \
    X(cuGraphDestroy, (CUgraph))                                                                   \
    X(cuDeviceGraphMemTrim, (CUdevice))                                                            \
    X(cuDeviceGetGraphMemAttribute, (CUdevice, int, void *))                                       \
    X(cuStreamEndCapture, (CUstream, CUgraph *))                                                   \
    X(cuStreamEndCapture_ptsz, (CUstream, CUgraph *))                                              \
    X(cuGraphInstantiateWithParams_ptsz, (CUgraphExec *, CUgraph, void *))                         \
    X(cuGraphLaunch_ptsz, (CUgraphExec, CUstream))                                                 \
    X(cuOccupancyMaxActiveBlocksPerMultiprocessor, (int *, CUfunction, int, size_t))                \
    X(cuThreadExchangeStreamCaptureMode, (int *))                                                  \
    X(cuCtxSetLimit, (int, size_t))                                                                \
    X(cuCtxGetLimit, (size_t *, int))                                                              \
    X(cuLaunch, (CUfunction))                                                                      \
    X(cuLaunchGrid, (CUfunction, int, int))                                                        \
    X(cuLaunchGridAsync, (CUfunction, int, int, CUstream))                                         \
    X(cuLaunchCooperativeKernelMultiDevice, (void *, unsigned int, unsigned int))

#define VC_NVML_FUNCS(X)                                                                           \
    X(nvmlInit_v2, (void))                                                                         \
    X(nvmlDeviceGetHandleByUUID, (const char *, nvmlDevice_t *))                                   \
    X(nvmlDeviceGetUUID, (nvmlDevice_t, char *, unsigned int))                                     \
    X(nvmlDeviceGetMemoryInfo, (nvmlDevice_t, nvmlMemory_t *))                                     \
    X(nvmlDeviceGetMemoryInfo_v2, (nvmlDevice_t, nvmlMemory_v2_t *))                               \
    X(nvmlDeviceGetComputeRunningProcesses, (nvmlDevice_t, unsigned int *, nvmlProcessInfo_v1_t *)) \
    X(nvmlDeviceGetComputeRunningProcesses_v2, (nvmlDevice_t, unsigned int *, nvmlProcessInfo_t *)) \
    X(nvmlDeviceGetComputeRunningProcesses_v3, (nvmlDevice_t, unsigned int *, nvmlProcessInfo_t *)) \
    X(nvmlDeviceGetGraphicsRunningProcesses, (nvmlDevice_t, unsigned int *, nvmlProcessInfo_v1_t *)) \
    X(nvmlDeviceGetGraphicsRunningProcesses_v2, (nvmlDevice_t, unsigned int *, nvmlProcessInfo_t *)) \
    X(nvmlDeviceGetGraphicsRunningProcesses_v3, (nvmlDevice_t, unsigned int *, nvmlProcessInfo_t *)) \
    X(nvmlDeviceGetMPSComputeRunningProcesses, (nvmlDevice_t, unsigned int *, nvmlProcessInfo_v1_t *)) \
    X(nvmlDeviceGetMPSComputeRunningProcesses_v2, (nvmlDevice_t, unsigned int *, nvmlProcessInfo_t *)) \
    X(nvmlDeviceGetMPSComputeRunningProcesses_v3, (nvmlDevice_t, unsigned int *, nvmlProcessInfo_t *)) \
    X(nvmlDeviceGetRunningProcessDetailList, (nvmlDevice_t, nvmlProcessDetailList_t *))            \
    X(nvmlDeviceGetUtilizationRates, (nvmlDevice_t, nvmlUtilization_t *))

#define VC_DECL_REAL(name, params) int(*name) params;
typedef struct vc_real_fns {
    VC_CU_FUNCS(VC_DECL_REAL)
    VC_NVML_FUNCS(VC_DECL_REAL)
} vc_real_fns;
#undef VC_DECL_REAL

extern vc_real_fns vc_real;

/* Resolve the real driver / NVML (idempotent, thread-safe, lazy). */
void vc_init_cuda(void);
void vc_init_nvml(void);
/* The real dlsym, for our own lookups. */
void *vc_real_dlsym(void *handle, const char *name);

#endif
