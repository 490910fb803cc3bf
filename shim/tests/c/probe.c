/* Drives the CUDA driver API the way real programs reach it, chosen at compile time:
 *   -DMODE_DIRECT    linked against libcuda.so.1 (calls bind at load time),
 *   -DMODE_DLSYM     dlopen("libcuda.so.1") + dlsym of each versioned name,
 *   -DMODE_PROCADDR  dlopen + dlsym("cuGetProcAddress_v2") only, then every entry point through it
 *                    by base name, CUDA version and flags, as the CUDA runtime does (with
 *                    PROBE_PROC_V1=1: through the CUDA 11.3 cuGetProcAddress, itself looked up).
 * The library dlopen'ed (MODE_DLSYM, MODE_PROCADDR) is $PROBE_LIBCUDA (a path, say), else
 * "libcuda.so.1"; with PROBE_NEXT=1, MODE_DLSYM opens it RTLD_GLOBAL and looks every entry point up
 * with dlsym(RTLD_NEXT, ...). The context is the device's primary one (what the CUDA runtime uses),
 * or with PROBE_CONTEXT=create one from cuCtxCreate. A stream is created for the "stream" kind.
 * Commands (argv), one output line each:
 *   check BYTES        for every allocation kind: BYTES (the limit) succeeds, 1 more byte fails,
 *                      free succeeds, BYTES+1 fails, BYTES succeeds again; prints the return codes
 *   paths MIB CHUNK    for each path frameworks allocate through: CHUNK MiB at a time up to MIB
 *                      (kept), then 1 MiB more, cuMemGetInfo_v2 while full, then free it all
 *   alloc KIND BYTES   allocate and keep (stack); free: free the last kept one
 *   fill KIND MIB CHUNK  allocate CHUNK MiB at a time, kept, until MIB or a refusal; prints the
 *                      bytes held and the last return code; freeall: free every kept one
 *   info | info_v1     cuMemGetInfo_v2 / cuMemGetInfo
 *   where              which library each entry point the program holds lives in
 *   next               which library dlsym(RTLD_NEXT, ...) finds "dlsym" and "cuMemAlloc_v2" in
 *   zero_accounting    write 0 over device 0's shared counter in $GPUMEM_ACCOUNTING_DIR's file
 *   eat MIB            touch host memory, 16 MiB at a time, until the kernel kills the process; if
 *                      it has not after MIB, print "ate" and exit with status 3
 *   wait PATH          print "waiting", then wait until PATH exists
 *   hold               print "holding", then wait for stdin to close */
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "cuda_min.h"

#define FIELD(name, args) CUresult (*name) args;
static struct { CUDA_API(FIELD) } api;
#undef FIELD

static CUdevice device;
static CUmemoryPool pool;
static CUstream stream;

#if !defined(MODE_DIRECT)
static const char *libcuda(void) {
    const char *path = getenv("PROBE_LIBCUDA");
    return path && *path ? path : "libcuda.so.1";
}
#endif

static void die(const char *what) {
    fprintf(stderr, "probe: %s\n", what);
    exit(99);
}

#if defined(MODE_DIRECT)
static void load(void) {
#define ASSIGN(name, args) api.name = name;
    CUDA_API(ASSIGN)
#undef ASSIGN
}
#elif defined(MODE_DLSYM)
static void load(void) {
    const char *next = getenv("PROBE_NEXT");
    int via_next = next && strcmp(next, "1") == 0;
    void *lib = dlopen(libcuda(), via_next ? RTLD_NOW | RTLD_GLOBAL : RTLD_NOW);
    if (!lib) die(dlerror());
    if (via_next) lib = RTLD_NEXT;
#define LOOKUP(name, args) *(void **)&api.name = dlsym(lib, #name);
    CUDA_API(LOOKUP)
#undef LOOKUP
}
#elif defined(MODE_PROCADDR)
static CUresult (*get_v1)(const char *, void **, int, unsigned long long);

static void *proc(const char *name, int version, unsigned long long flags) {
    void *pfn = NULL;
    int status = -1;
    CUresult rc = get_v1 ? get_v1(name, &pfn, version, flags)
                         : api.cuGetProcAddress_v2(name, &pfn, version, flags, &status);
    if (rc != CUDA_SUCCESS || (!get_v1 && status != 0)) return NULL;
    return pfn;
}

static void load(void) {
    void *lib = dlopen(libcuda(), RTLD_NOW);
    if (!lib) die(dlerror());
    *(void **)&api.cuGetProcAddress_v2 = dlsym(lib, "cuGetProcAddress_v2");
    if (!api.cuGetProcAddress_v2) die("no cuGetProcAddress_v2");
    /* The runtime's own lookup of the lookup function, by base name. */
    *(void **)&api.cuGetProcAddress_v2 = proc("cuGetProcAddress", 12080, 0);
    *(void **)&api.cuGetProcAddress = proc("cuGetProcAddress", 11080, 0);
    const char *v1 = getenv("PROBE_PROC_V1");
    if (v1 && strcmp(v1, "1") == 0) get_v1 = api.cuGetProcAddress;
    const int v = 12080, old = 3000; /* old: before CUDA 3.2, the 32-bit (v1) ABI */
    const unsigned long long pt = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
#define P(field, name, version, flags) *(void **)&api.field = proc(name, version, flags);
    P(cuInit, "cuInit", v, 0)
    P(cuDeviceGet, "cuDeviceGet", v, 0)
    P(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", v, 0)
    P(cuCtxSetCurrent, "cuCtxSetCurrent", v, 0)
    P(cuCtxCreate_v2, "cuCtxCreate", 11000, 0) /* _v3 from CUDA 11.4 and _v4 from 12.5 take more */
    P(cuCtxDestroy_v2, "cuCtxDestroy", v, 0)
    P(cuStreamCreate, "cuStreamCreate", v, 0)
    P(cuStreamDestroy_v2, "cuStreamDestroy", v, 0)
    P(cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool", v, 0)
    P(cuMemAlloc_v2, "cuMemAlloc", v, 0)
    P(cuMemAlloc, "cuMemAlloc", old, 0)
    P(cuMemAllocPitch_v2, "cuMemAllocPitch", v, 0)
    P(cuMemAllocPitch, "cuMemAllocPitch", old, 0)
    P(cuMemAllocManaged, "cuMemAllocManaged", v, 0)
    P(cuMemAllocAsync, "cuMemAllocAsync", v, 0)
    P(cuMemAllocAsync_ptsz, "cuMemAllocAsync", v, pt)
    P(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", v, 0)
    P(cuMemAllocFromPoolAsync_ptsz, "cuMemAllocFromPoolAsync", v, pt)
    P(cuMemFree_v2, "cuMemFree", v, 0)
    P(cuMemFree, "cuMemFree", old, 0)
    P(cuMemFreeAsync, "cuMemFreeAsync", v, 0)
    P(cuMemFreeAsync_ptsz, "cuMemFreeAsync", v, pt)
    P(cuMemCreate, "cuMemCreate", v, 0)
    P(cuMemRelease, "cuMemRelease", v, 0)
    P(cuMemAddressReserve, "cuMemAddressReserve", v, 0)
    P(cuMemAddressFree, "cuMemAddressFree", v, 0)
    P(cuMemMap, "cuMemMap", v, 0)
    P(cuMemUnmap, "cuMemUnmap", v, 0)
    P(cuMemSetAccess, "cuMemSetAccess", v, 0)
    P(cuArrayCreate_v2, "cuArrayCreate", v, 0)
    P(cuArrayCreate, "cuArrayCreate", old, 0)
    P(cuArray3DCreate_v2, "cuArray3DCreate", v, 0)
    P(cuArray3DCreate, "cuArray3DCreate", old, 0)
    P(cuArrayDestroy, "cuArrayDestroy", v, 0)
    P(cuMipmappedArrayCreate, "cuMipmappedArrayCreate", v, 0)
    P(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy", v, 0)
    P(cuMemGetInfo_v2, "cuMemGetInfo", v, 0)
    P(cuMemGetInfo, "cuMemGetInfo", old, 0)
#undef P
}
#else
#error "define MODE_DIRECT, MODE_DLSYM or MODE_PROCADDR"
#endif

static const char *const KINDS[] = {
    "alloc", "alloc_v1", "pitch", "pitch_v1", "managed", "async", "async_ptsz", "pool", "pool_ptsz",
    "create", "array", "array_v1", "array3d", "array3d_v1", "mipmap", "stream", "vmm",
};
/* What frameworks allocate through: the 64-bit calls (a limit of GiBs does not fit the v1 ABI). */
static const char *const PATHS[] = {
    "alloc", "pitch", "managed", "async", "stream", "async_ptsz", "pool", "pool_ptsz",
    "create", "vmm", "array", "array3d", "mipmap",
};
#define NPATHS (sizeof PATHS / sizeof *PATHS)
#define NKINDS (sizeof KINDS / sizeof *KINDS)

typedef struct {
    int kind;
    CUdeviceptr ptr;
    CUdeviceptr_v1 ptr32;
    CUmemGenericAllocationHandle handle;
    void *array;
    size_t size; /* vmm: the mapped range */
} object;

static int kind_index(const char *name) {
    for (size_t i = 0; i < NKINDS; i++)
        if (strcmp(KINDS[i], name) == 0) return (int)i;
    die("unknown allocation kind");
    return -1;
}

/* Allocates `bytes` bytes of kind `kind` (for pitch: a width of `bytes`, one row; for arrays: a
 * width of `bytes` one-byte elements). */
static CUresult allocate(int kind, unsigned long long bytes, object *o) {
    memset(o, 0, sizeof *o);
    o->kind = kind;
    size_t pitch = 0;
    unsigned pitch32 = 0;
    CUmemAllocationProp prop = {0};
    CUDA_ARRAY_DESCRIPTOR a2 = {bytes, 0, CU_AD_FORMAT_UNSIGNED_INT8, 1};
    CUDA_ARRAY_DESCRIPTOR_v1 a1 = {(unsigned)bytes, 0, CU_AD_FORMAT_UNSIGNED_INT8, 1};
    CUDA_ARRAY3D_DESCRIPTOR b2 = {bytes, 0, 0, CU_AD_FORMAT_UNSIGNED_INT8, 1, 0};
    CUDA_ARRAY3D_DESCRIPTOR_v1 b1 = {(unsigned)bytes, 0, 0, CU_AD_FORMAT_UNSIGNED_INT8, 1, 0};
    switch (kind) {
    case 0: return api.cuMemAlloc_v2(&o->ptr, bytes);
    case 1: return api.cuMemAlloc(&o->ptr32, (unsigned)bytes);
    case 2: return api.cuMemAllocPitch_v2(&o->ptr, &pitch, bytes, 1, 4);
    case 3: return api.cuMemAllocPitch(&o->ptr32, &pitch32, (unsigned)bytes, 1, 4);
    case 4: return api.cuMemAllocManaged(&o->ptr, bytes, CU_MEM_ATTACH_GLOBAL);
    case 5: return api.cuMemAllocAsync(&o->ptr, bytes, NULL);
    case 6: return api.cuMemAllocAsync_ptsz(&o->ptr, bytes, NULL);
    case 7: return api.cuMemAllocFromPoolAsync(&o->ptr, bytes, pool, NULL);
    case 8: return api.cuMemAllocFromPoolAsync_ptsz(&o->ptr, bytes, pool, NULL);
    case 9:
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = device;
        return api.cuMemCreate(&o->handle, bytes, &prop, 0);
    case 10: return api.cuArrayCreate_v2(&o->array, &a2);
    case 11: return api.cuArrayCreate(&o->array, &a1);
    case 12: return api.cuArray3DCreate_v2(&o->array, &b2);
    case 13: return api.cuArray3DCreate(&o->array, &b1);
    case 14: return api.cuMipmappedArrayCreate(&o->array, &b2, 1);
    case 15: return api.cuMemAllocAsync(&o->ptr, bytes, stream);
    case 16: {
        /* What llama.cpp and PyTorch's expandable segments do: a physical allocation mapped into a
         * reserved virtual range, then made accessible. */
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = device;
        CUresult rc = api.cuMemCreate(&o->handle, bytes, &prop, 0);
        if (rc != CUDA_SUCCESS) return rc;
        CUmemAccessDesc access = {{CU_MEM_LOCATION_TYPE_DEVICE, device}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
        o->size = bytes;
        if ((rc = api.cuMemAddressReserve(&o->ptr, bytes, 0, 0, 0)) != CUDA_SUCCESS ||
            (rc = api.cuMemMap(o->ptr, bytes, 0, o->handle, 0)) != CUDA_SUCCESS ||
            (rc = api.cuMemSetAccess(o->ptr, bytes, &access, 1)) != CUDA_SUCCESS) {
            fprintf(stderr, "probe: mapping %llu bytes: %d\n", bytes, rc);
            exit(99);
        }
        return CUDA_SUCCESS;
    }
    }
    return -1;
}

static CUresult release(const object *o) {
    switch (o->kind) {
    case 1: case 3: return api.cuMemFree(o->ptr32);
    case 5: return api.cuMemFreeAsync(o->ptr, NULL);
    case 15: return api.cuMemFreeAsync(o->ptr, stream);
    case 16: {
        CUresult rc;
        if ((rc = api.cuMemUnmap(o->ptr, o->size)) != CUDA_SUCCESS) return rc;
        if ((rc = api.cuMemAddressFree(o->ptr, o->size)) != CUDA_SUCCESS) return rc;
        return api.cuMemRelease(o->handle);
    }
    case 6: case 8: return api.cuMemFreeAsync_ptsz(o->ptr, NULL);
    case 9: return api.cuMemRelease(o->handle);
    case 10: case 11: case 12: case 13: return api.cuArrayDestroy(o->array);
    case 14: return api.cuMipmappedArrayDestroy(o->array);
    default: return api.cuMemFree_v2(o->ptr);
    }
}

static const char *library_of(void *fn) {
    Dl_info info;
    if (!fn) return "(null)";
    if (!dladdr(fn, &info) || !info.dli_fname) return "(unknown)";
    const char *slash = strrchr(info.dli_fname, '/');
    return slash ? slash + 1 : info.dli_fname;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    load();
    CUcontext ctx;
    if (!api.cuInit || api.cuInit(0) != CUDA_SUCCESS) die("cuInit");
    if (api.cuDeviceGet(&device, 0) != CUDA_SUCCESS) die("cuDeviceGet");
    const char *context = getenv("PROBE_CONTEXT");
    if (context && strcmp(context, "create") == 0) {
        if (api.cuCtxCreate_v2(&ctx, 0, device) != CUDA_SUCCESS) die("cuCtxCreate_v2");
    } else {
        if (api.cuDevicePrimaryCtxRetain(&ctx, device) != CUDA_SUCCESS) die("cuDevicePrimaryCtxRetain");
        if (api.cuCtxSetCurrent(ctx) != CUDA_SUCCESS) die("cuCtxSetCurrent");
    }
    if (api.cuDeviceGetDefaultMemPool(&pool, device) != CUDA_SUCCESS) die("cuDeviceGetDefaultMemPool");
    if (api.cuStreamCreate(&stream, 0) != CUDA_SUCCESS) die("cuStreamCreate");

    static object kept[1024];
    int nkept = 0;
    const unsigned long long MIB = 1ULL << 20;
    for (int i = 1; i < argc; i++) {
        const char *cmd = argv[i];
        if (strcmp(cmd, "check") == 0 && i + 1 < argc) {
            unsigned long long limit = strtoull(argv[++i], NULL, 0);
            for (size_t k = 0; k < NKINDS; k++) {
                object a, b, c, d;
                CUresult at = allocate((int)k, limit, &a);
                CUresult more = allocate((int)k, 1, &b);
                if (more == CUDA_SUCCESS) release(&b);
                CUresult freed = at == CUDA_SUCCESS ? release(&a) : -1;
                CUresult over = allocate((int)k, limit + 1, &c);
                if (over == CUDA_SUCCESS) release(&c);
                CUresult again = allocate((int)k, limit, &d);
                CUresult freed2 = again == CUDA_SUCCESS ? release(&d) : -1;
                printf("check %s at_limit=%d one_more=%d free=%d over=%d again=%d free=%d\n", KINDS[k], at, more,
                       freed, over, again, freed2);
            }
        } else if (strcmp(cmd, "paths") == 0 && i + 2 < argc) {
            unsigned long long limit = strtoull(argv[i + 1], NULL, 0) * MIB;
            unsigned long long chunk = strtoull(argv[i + 2], NULL, 0) * MIB;
            i += 2;
            if (chunk == 0 || limit / chunk > 1000) die("paths: bad chunk");
            for (size_t p = 0; p < NPATHS; p++) {
                int kind = kind_index(PATHS[p]);
                unsigned long long held = 0;
                int base = nkept;
                CUresult rc = CUDA_SUCCESS;
                while (held < limit) {
                    unsigned long long n = limit - held < chunk ? limit - held : chunk;
                    if ((rc = allocate(kind, n, &kept[nkept])) != CUDA_SUCCESS) break;
                    nkept++;
                    held += n;
                }
                object extra;
                CUresult more = allocate(kind, MIB, &extra);
                if (more == CUDA_SUCCESS) release(&extra);
                size_t free = 0, total = 0;
                CUresult info = api.cuMemGetInfo_v2(&free, &total);
                CUresult freed = CUDA_SUCCESS;
                while (nkept > base) {
                    CUresult r = release(&kept[--nkept]);
                    if (r != CUDA_SUCCESS) freed = r;
                }
                printf("path %s held=%llu rc=%d one_more_mib=%d info=%d free=%zu total=%zu freed=%d\n", PATHS[p],
                       held, rc, more, info, free, total, freed);
            }
        } else if (strcmp(cmd, "fill") == 0 && i + 3 < argc) {
            int kind = kind_index(argv[i + 1]);
            unsigned long long want = strtoull(argv[i + 2], NULL, 0) * MIB;
            unsigned long long chunk = strtoull(argv[i + 3], NULL, 0) * MIB;
            i += 3;
            unsigned long long held = 0;
            CUresult rc = CUDA_SUCCESS;
            while (held < want && chunk > 0) {
                if (nkept == 1024) die("too many kept allocations");
                unsigned long long n = want - held < chunk ? want - held : chunk;
                if ((rc = allocate(kind, n, &kept[nkept])) != CUDA_SUCCESS) break;
                nkept++;
                held += n;
            }
            printf("fill %s held=%llu rc=%d\n", KINDS[kind], held, rc);
        } else if (strcmp(cmd, "freeall") == 0) {
            CUresult freed = CUDA_SUCCESS;
            while (nkept > 0) {
                CUresult r = release(&kept[--nkept]);
                if (r != CUDA_SUCCESS) freed = r;
            }
            printf("freeall rc=%d\n", freed);
        } else if (strcmp(cmd, "zero_accounting") == 0) {
            /* The file's layout (accounting/src/lib.rs): device 0's shared `used` counter at 192. */
            const char *dir = getenv("GPUMEM_ACCOUNTING_DIR");
            char path[4096];
            snprintf(path, sizeof path, "%s/gpumem-accounting", dir ? dir : "");
            int fd = open(path, O_WRONLY);
            unsigned long long zero = 0;
            ssize_t n = fd < 0 ? -1 : pwrite(fd, &zero, sizeof zero, 192);
            if (fd >= 0) close(fd);
            printf("zero_accounting written=%zd\n", n);
        } else if (strcmp(cmd, "eat") == 0 && i + 1 < argc) {
            unsigned long long most = strtoull(argv[++i], NULL, 0);
            printf("eating\n");
            for (unsigned long long ate = 0; ate < most; ate += 16) {
                char *block = malloc(16 << 20);
                if (!block) break;
                memset(block, 1, 16 << 20);
            }
            printf("ate\n");
            exit(3);
        } else if (strcmp(cmd, "wait") == 0 && i + 1 < argc) {
            const char *path = argv[++i];
            printf("waiting\n");
            while (access(path, F_OK) != 0) usleep(100000);
        } else if (strcmp(cmd, "alloc") == 0 && i + 2 < argc) {
            int kind = kind_index(argv[i + 1]);
            unsigned long long bytes = strtoull(argv[i + 2], NULL, 0);
            i += 2;
            if (nkept == 1024) die("too many kept allocations");
            CUresult rc = allocate(kind, bytes, &kept[nkept]);
            if (rc == CUDA_SUCCESS) nkept++;
            printf("alloc %s %llu rc=%d\n", KINDS[kind], bytes, rc);
        } else if (strcmp(cmd, "free") == 0) {
            if (nkept == 0) die("nothing to free");
            printf("free rc=%d\n", release(&kept[--nkept]));
        } else if (strcmp(cmd, "info") == 0) {
            size_t free = 0, total = 0;
            CUresult rc = api.cuMemGetInfo_v2(&free, &total);
            printf("info rc=%d free=%zu total=%zu\n", rc, free, total);
        } else if (strcmp(cmd, "info_v1") == 0) {
            unsigned free = 0, total = 0;
            CUresult rc = api.cuMemGetInfo(&free, &total);
            printf("info_v1 rc=%d free=%u total=%u\n", rc, free, total);
        } else if (strcmp(cmd, "where") == 0) {
#define WHERE(name, args) printf("where %s %s\n", #name, library_of(*(void **)&api.name));
            CUDA_API(WHERE)
#undef WHERE
        } else if (strcmp(cmd, "next") == 0) {
            /* From the executable, the next "dlsym" after it is the preloaded shim's: glibc must see
             * this program, not the shim, as the caller. */
            printf("next dlsym %s\n", library_of(dlsym(RTLD_NEXT, "dlsym")));
            printf("next cuMemAlloc_v2 %s\n", library_of(dlsym(RTLD_NEXT, "cuMemAlloc_v2")));
        } else if (strcmp(cmd, "hold") == 0) {
            printf("holding\n");
            char buf[64];
            while (read(0, buf, sizeof buf) > 0) {
            }
        } else {
            die("unknown command");
        }
    }
    return 0;
}
