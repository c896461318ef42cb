// The driver's floor for a cold process: cuInit, the primary context, one cubin, one kernel, its
// result checked and printed. What any CUDA program pays before it can do work; bench/cold_start.py
// runs it beside Reflex and llama.cpp. Build: gcc -O2 -o floor floor.c -ldl (no CUDA headers needed).
// Usage: floor KERNEL.cubin   (a cubin of bench/floor_kernel.cu)
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
#define N 1024

static void* sym(void* lib, const char* name) {
    void* f = dlsym(lib, name);
    if (!f) { fprintf(stderr, "floor: libcuda lacks %s\n", name); exit(1); }
    return f;
}

#define CHECK(call) do { CUresult r_ = (call); if (r_) { fprintf(stderr, "floor: %s failed: %d\n", #call, r_); return 1; } } while (0)

int main(int argc, char** argv) {
    if (argc != 2) { fprintf(stderr, "usage: floor KERNEL.cubin\n"); return 2; }
    FILE* f = fopen(argv[1], "rb");
    if (!f) { perror(argv[1]); return 1; }
    fseek(f, 0, SEEK_END); long size = ftell(f); fseek(f, 0, SEEK_SET);
    char* image = malloc(size);
    if (fread(image, 1, size, f) != (size_t)size) { fprintf(stderr, "floor: short read\n"); return 1; }
    fclose(f);

    void* lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) { fprintf(stderr, "floor: %s\n", dlerror()); return 1; }
    CUresult (*cuInit)(unsigned) = sym(lib, "cuInit");
    CUresult (*cuDeviceGet)(int*, int) = sym(lib, "cuDeviceGet");
    CUresult (*cuDevicePrimaryCtxRetain)(void**, int) = sym(lib, "cuDevicePrimaryCtxRetain");
    CUresult (*cuCtxSetCurrent)(void*) = sym(lib, "cuCtxSetCurrent");
    CUresult (*cuModuleLoadData)(void**, const void*) = sym(lib, "cuModuleLoadData");
    CUresult (*cuModuleGetFunction)(void**, void*, const char*) = sym(lib, "cuModuleGetFunction");
    CUresult (*cuMemAlloc)(CUdeviceptr*, size_t) = sym(lib, "cuMemAlloc_v2");
    CUresult (*cuMemsetD32)(CUdeviceptr, unsigned, size_t) = sym(lib, "cuMemsetD32_v2");
    CUresult (*cuLaunchKernel)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**, void**)
        = sym(lib, "cuLaunchKernel");
    CUresult (*cuMemcpyDtoH)(void*, CUdeviceptr, size_t) = sym(lib, "cuMemcpyDtoH_v2");

    int dev; void* ctx; void* module; void* fn; CUdeviceptr x; int n = N;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuModuleLoadData(&module, image));
    CHECK(cuModuleGetFunction(&fn, module, "add_one"));
    CHECK(cuMemAlloc(&x, N * sizeof(float)));
    CHECK(cuMemsetD32(x, 0x40000000, N));  // 2.0f
    void* args[] = {&x, &n};
    CHECK(cuLaunchKernel(fn, N / 256, 1, 1, 256, 1, 1, 0, NULL, args, NULL));
    float out[N];
    CHECK(cuMemcpyDtoH(out, x, sizeof out));
    for (int i = 0; i < N; i++)
        if (out[i] != 3.0f) { fprintf(stderr, "floor: wrong result %g at %d\n", out[i], i); return 1; }
    printf("FLOOR_OK result=%g\n", out[N - 1]);
    fflush(stdout);
    return 0;
}
