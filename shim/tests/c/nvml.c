/* Prints what NVML says about device 0's memory, through nvmlDeviceGetMemoryInfo and _v2, reached
 * like nvidia-smi does: linked (-DMODE_DIRECT) or through dlopen + dlsym (-DMODE_DLSYM). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
typedef void *nvmlDevice_t;
#define NVML_MEMORY_V2 ((unsigned)(sizeof(nvmlMemory_v2_t) | (2 << 24)))

#define NVML_API(X) \
    X(nvmlInit_v2, (void)) \
    X(nvmlDeviceGetHandleByIndex_v2, (unsigned index, nvmlDevice_t *device)) \
    X(nvmlDeviceGetMemoryInfo, (nvmlDevice_t device, nvmlMemory_t *memory)) \
    X(nvmlDeviceGetMemoryInfo_v2, (nvmlDevice_t device, nvmlMemory_v2_t *memory))

#define FIELD(name, args) int (*name) args;
static struct { NVML_API(FIELD) } api;
#undef FIELD

#ifdef MODE_DIRECT
#define DECLARE(name, args) int name args;
NVML_API(DECLARE)
#undef DECLARE
static void load(void) {
#define ASSIGN(name, args) api.name = name;
    NVML_API(ASSIGN)
#undef ASSIGN
}
#else
static void load(void) {
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "nvml: %s\n", dlerror());
        exit(99);
    }
#define LOOKUP(name, args) *(void **)&api.name = dlsym(lib, #name);
    NVML_API(LOOKUP)
#undef LOOKUP
}
#endif

int main(void) {
    load();
    nvmlDevice_t device;
    if (api.nvmlInit_v2() != 0 || api.nvmlDeviceGetHandleByIndex_v2(0, &device) != 0) return 99;
    nvmlMemory_t m1 = {0};
    int rc1 = api.nvmlDeviceGetMemoryInfo(device, &m1);
    printf("v1 rc=%d total=%llu free=%llu used=%llu\n", rc1, m1.total, m1.free, m1.used);
    nvmlMemory_v2_t m2 = {NVML_MEMORY_V2, 0, 0, 0, 0};
    int rc2 = api.nvmlDeviceGetMemoryInfo_v2(device, &m2);
    printf("v2 rc=%d total=%llu free=%llu used=%llu reserved=%llu\n", rc2, m2.total, m2.free, m2.used, m2.reserved);
    return 0;
}
