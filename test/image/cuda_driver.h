/*
 * The few CUDA driver API types and calls test/image's programs use, declared as cuda.h does (the
 * image carries no CUDA headers). Each program links against libcuda.so.1, as any CUDA program.
 */
#ifndef TESSERA_TEST_IMAGE_CUDA_DRIVER_H
#define TESSERA_TEST_IMAGE_CUDA_DRIVER_H
#include <stddef.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

CUresult cuInit(unsigned flags);
CUresult cuDeviceGet(CUdevice *d, int ordinal);
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d);
CUresult cuCtxSetCurrent(CUcontext c);
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size);

#endif
