/*
 * The CUDA driver API types and calls test/gpu's probes use, declared as cuda.h does (the bundle
 * carries no CUDA headers; each probe links against libcuda.so.1, as any CUDA program). One copy
 * for callbench, memprobe and slicebench; procprobe resolves its names through cuGetProcAddress.
 */
#ifndef TESSERA_TEST_GPU_CUDA_DRIVER_H
#define TESSERA_TEST_GPU_CUDA_DRIVER_H
#include <stddef.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUstream;
typedef void *CUevent;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

CUresult cuInit(unsigned flags);
CUresult cuDeviceGetCount(int *n);
CUresult cuDeviceGet(CUdevice *d, int ordinal);
CUresult cuDeviceGetUuid_v2(unsigned char uuid[16], CUdevice d);
CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice d);
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d);
CUresult cuCtxSetCurrent(CUcontext c);
CUresult cuCtxSynchronize(void);
CUresult cuMemGetInfo_v2(size_t *free, size_t *total);
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size);
CUresult cuMemFree_v2(CUdeviceptr p);
CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, CUfunction f, int block, size_t dyn);
CUresult cuEventCreate(CUevent *e, unsigned flags);
CUresult cuEventRecord(CUevent e, CUstream s);
CUresult cuEventQuery(CUevent e);
CUresult cuEventSynchronize(CUevent e);
CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b);
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, CUstream s, void **params, void **extra);

#endif
