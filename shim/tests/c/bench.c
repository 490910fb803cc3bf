/* Times cuMemAlloc_v2 + cuMemFree_v2 pairs (1 MiB each), linked directly against libcuda.so.1:
 * with the shim preloaded, every call goes through its exports. Prints the best and median
 * nanoseconds per pair over ROUNDS rounds of PAIRS pairs (argv[1], argv[2]). */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "cuda_min.h"

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static int compare(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 15, pairs = argc > 2 ? atoi(argv[2]) : 200000;
    if (rounds < 1 || rounds > 1000 || pairs < 1) return 99;
    CUdevice device;
    CUcontext ctx;
    if (cuInit(0) || cuDeviceGet(&device, 0) || cuDevicePrimaryCtxRetain(&ctx, device) || cuCtxSetCurrent(ctx)) return 99;
    double per_pair[1000];
    for (int r = 0; r < rounds; r++) {
        double start = now_ns();
        for (int i = 0; i < pairs; i++) {
            CUdeviceptr p;
            if (cuMemAlloc_v2(&p, 1 << 20) != CUDA_SUCCESS || cuMemFree_v2(p) != CUDA_SUCCESS) return 98;
        }
        per_pair[r] = (now_ns() - start) / pairs;
    }
    qsort(per_pair, rounds, sizeof *per_pair, compare);
    printf("min=%.1f median=%.1f\n", per_pair[0], per_pair[rounds / 2]);
    return 0;
}
