/* The few CUDA driver declarations the test programs need, with the real ABI (cuda.h 12.x),
 * written out by hand so that no CUDA toolkit is needed to build the tests. Versioned names are
 * declared as such (no cuMemAlloc -> cuMemAlloc_v2 macros): each program says which ABI it calls. */
#ifndef GPUMEM_CUDA_MIN_H
#define GPUMEM_CUDA_MIN_H
#include <stddef.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned int CUdeviceptr_v1;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUmemoryPool;
typedef void *CUarray;
typedef void *CUmipmappedArray;
typedef unsigned long long CUmemGenericAllocationHandle;

typedef struct { size_t Width, Height; int Format; unsigned NumChannels; } CUDA_ARRAY_DESCRIPTOR;
typedef struct { unsigned Width, Height; int Format; unsigned NumChannels; } CUDA_ARRAY_DESCRIPTOR_v1;
typedef struct { size_t Width, Height, Depth; int Format; unsigned NumChannels, Flags; } CUDA_ARRAY3D_DESCRIPTOR;
typedef struct { unsigned Width, Height, Depth; int Format; unsigned NumChannels, Flags; } CUDA_ARRAY3D_DESCRIPTOR_v1;

typedef struct { int type; int id; } CUmemLocation;
typedef struct {
    int type;
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage; unsigned char reserved[4]; } allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CU_AD_FORMAT_UNSIGNED_INT8 0x01
#define CU_MEM_ALLOCATION_TYPE_PINNED 1
#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_ATTACH_GLOBAL 1
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 3
#define CU_GET_PROC_ADDRESS_DEFAULT 0
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 2

/* The entry points, one field per ABI version. */
#define CUDA_API(X) \
    X(cuInit, (unsigned flags)) \
    X(cuDeviceGet, (CUdevice *dev, int ordinal)) \
    X(cuDevicePrimaryCtxRetain, (CUcontext *ctx, CUdevice dev)) \
    X(cuCtxSetCurrent, (CUcontext ctx)) \
    X(cuCtxCreate_v2, (CUcontext *ctx, unsigned flags, CUdevice dev)) \
    X(cuCtxDestroy_v2, (CUcontext ctx)) \
    X(cuStreamCreate, (CUstream *s, unsigned flags)) \
    X(cuStreamDestroy_v2, (CUstream s)) \
    X(cuDeviceGetDefaultMemPool, (CUmemoryPool *pool, CUdevice dev)) \
    X(cuMemAlloc_v2, (CUdeviceptr *p, size_t n)) \
    X(cuMemAlloc, (CUdeviceptr_v1 *p, unsigned n)) \
    X(cuMemAllocPitch_v2, (CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned e)) \
    X(cuMemAllocPitch, (CUdeviceptr_v1 *p, unsigned *pitch, unsigned w, unsigned h, unsigned e)) \
    X(cuMemAllocManaged, (CUdeviceptr *p, size_t n, unsigned flags)) \
    X(cuMemAllocAsync, (CUdeviceptr *p, size_t n, CUstream s)) \
    X(cuMemAllocAsync_ptsz, (CUdeviceptr *p, size_t n, CUstream s)) \
    X(cuMemAllocFromPoolAsync, (CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s)) \
    X(cuMemAllocFromPoolAsync_ptsz, (CUdeviceptr *p, size_t n, CUmemoryPool pool, CUstream s)) \
    X(cuMemFree_v2, (CUdeviceptr p)) \
    X(cuMemFree, (CUdeviceptr_v1 p)) \
    X(cuMemFreeAsync, (CUdeviceptr p, CUstream s)) \
    X(cuMemFreeAsync_ptsz, (CUdeviceptr p, CUstream s)) \
    X(cuMemCreate, (CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *prop, unsigned long long flags)) \
    X(cuMemRelease, (CUmemGenericAllocationHandle h)) \
    X(cuMemAddressReserve, (CUdeviceptr *p, size_t n, size_t alignment, CUdeviceptr addr, unsigned long long flags)) \
    X(cuMemAddressFree, (CUdeviceptr p, size_t n)) \
    X(cuMemMap, (CUdeviceptr p, size_t n, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags)) \
    X(cuMemUnmap, (CUdeviceptr p, size_t n)) \
    X(cuMemSetAccess, (CUdeviceptr p, size_t n, const CUmemAccessDesc *desc, size_t count)) \
    X(cuArrayCreate_v2, (CUarray *a, const CUDA_ARRAY_DESCRIPTOR *d)) \
    X(cuArrayCreate, (CUarray *a, const CUDA_ARRAY_DESCRIPTOR_v1 *d)) \
    X(cuArray3DCreate_v2, (CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *d)) \
    X(cuArray3DCreate, (CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR_v1 *d)) \
    X(cuArrayDestroy, (CUarray a)) \
    X(cuMipmappedArrayCreate, (CUmipmappedArray *a, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels)) \
    X(cuMipmappedArrayDestroy, (CUmipmappedArray a)) \
    X(cuMemGetInfo_v2, (size_t *free, size_t *total)) \
    X(cuMemGetInfo, (unsigned *free, unsigned *total)) \
    X(cuGetProcAddress, (const char *symbol, void **pfn, int cudaVersion, unsigned long long flags)) \
    X(cuGetProcAddress_v2, (const char *symbol, void **pfn, int cudaVersion, unsigned long long flags, int *status))

#define DECLARE(name, args) CUresult name args;
CUDA_API(DECLARE)
#undef DECLARE

#endif
