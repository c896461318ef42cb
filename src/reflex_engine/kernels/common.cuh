// Shared by every kernel file: warp and block reductions, and the f16 types. Kernels take activations as
// row-major float32 (T, features) and weights as the GGUF's raw blocks (const uint8_t*).
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

#define WARP 32

#include "clocks.cuh"

// Every kernel's first statement. On sm_90+ kernels are launched with programmatic stream
// serialization (backends/cuda/device.py): a kernel's blocks may start while the kernel before
// it still runs, so they wait here for its end (its writes then visible), then let the next
// kernel's blocks launch, whose start-up overlaps this kernel's run. Before anything is read or
// written (the previous kernel may still be reading what this one overwrites), but for what no
// kernel writes: the decode matvecs ask for their first weights first.
__device__ __forceinline__ void follow_previous_kernel() {
    const WaitClock clocked = clock_wait_begins();
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    clock_wait_ends(clocked);
}

// follow_previous_kernel with the next kernel's launch let go first: its blocks may then start (and ask for what
// no kernel writes) while this one still waits for the one before. Its wait still waits for this kernel's end,
// which comes after this kernel's own wait. Taken by the short decode kernels a matvec follows (rope, SwiGLU, the
// cluster attention): +0.7-0.9% on Qwen3-0.6B and 8B decode; every kernel early lost 2-2.5%, the matvecs ~1%.
__device__ __forceinline__ void follow_previous_kernel_early() {
    const WaitClock clocked = clock_wait_begins();
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    clock_wait_ends(clocked);
}

// The cluster barrier's halves: every thread of the cluster arrives, then waits until all have (or exited).
// Arrived with release, waited with acquire: shared memory writes before the arrival, the cluster's own
// included, are visible after the wait.
__device__ __forceinline__ void cluster_arrive(bool release) {
#if __CUDA_ARCH__ >= 900
    if (release)
        asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    else
        asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// p, a shared address of this block, as the same address in the shared memory of the cluster's block of rank
// `rank`: a generic address that plain loads and stores reach.
template <class T>
__device__ __forceinline__ T* in_block_of_rank(T* p, int rank) {
#if __CUDA_ARCH__ >= 900
    uint64_t at;
    asm("mapa.u64 %0, %1, %2;" : "=l"(at) : "l"(p), "r"(rank));
    return reinterpret_cast<T*>(at);
#else
    return p;
#endif
}

// Whether the calling warp is the last of `arrivals` to get here with this ticket (the classic last-block
// reduction): each warp's writes before its call, fenced, are the last one's to read after it (through L2: __ldcg),
// and the last sets the ticket back to 0 for the next launch. Every lane of the warp calls it.
__device__ __forceinline__ bool last_to_arrive(int* ticket, int arrivals) {
    __threadfence();
    __syncwarp();
    int t = 0;
    if (threadIdx.x % WARP == 0) t = atomicAdd(ticket, 1);
    if (__shfl_sync(0xffffffffu, t, 0) != arrivals - 1) return false;
    if (threadIdx.x % WARP == 0) *ticket = 0;
    return true;
}

struct Sum {
    template <class T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct Max {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Every lane gets op over the warp's 32 values, or with LANES < WARP over its aligned group of LANES lanes'
// (every lane of the warp calls it).
template <int LANES = WARP, class T, class Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Every thread gets op over a block of blockDim.x threads (a multiple of 32, at most 1024);
// every thread must call it.
template <class T, class Op>
__device__ __forceinline__ T block_reduce(T v, T identity, Op op) {
    __shared__ T partial[32];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, n_warps = blockDim.x / WARP;
    v = warp_reduce(v, op);
    __syncthreads();  // partial may still be read by a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    return warp_reduce(lane < n_warps ? partial[lane] : identity, op);
}

template <class T> __device__ __forceinline__ T warp_sum(T v) { return warp_reduce(v, Sum()); }
__device__ __forceinline__ float warp_max(float v) { return warp_reduce(v, Max()); }
template <class T> __device__ __forceinline__ T block_sum(T v) { return block_reduce(v, T(0), Sum()); }
__device__ __forceinline__ float block_max(float v) { return block_reduce(v, -INFINITY, Max()); }

// The weights one launch multiplies with the same x (q, k and v; gate and up): up to three of one
// type and width, weight i having rows_i rows (0: absent) and its own product y_i. A kernel's units
// of `per` rows are counted over them in order: fused_part returns the weight unit u lies in and
// makes u its index there; pick(i, ...) the i-th of three values (selects: no local-memory array).
__device__ __forceinline__ int fused_part(int& u, int per, int rows0, int rows1) {
    const int units0 = (rows0 + per - 1) / per, units1 = (rows1 + per - 1) / per;
    if (u < units0) return 0;
    u -= units0;
    if (u < units1) return 1;
    u -= units1;
    return 2;
}
template <class T>
__device__ __forceinline__ T pick(int i, T a, T b, T c) { return i == 0 ? a : i == 1 ? b : c; }

// 2^x; -inf gives 0. exp2f's care for results below 2^-126 is wasted on softmax weights.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Asks L2 for the line holding p, so a thread has more bytes in flight than its registers hold.
// Not on sm_120: NVRTC 12.9 crashed (SIGSEGV) compiling the matvecs' prefetches for it (2026-12-01).
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if __CUDA_ARCH__ < 1200
    asm volatile("prefetch.global.L2 [%0];" ::"l"(__cvta_generic_to_global(p)));
#endif
}

// A matvec block's end: every thread's partial dot products acc[r][t] (row r0 + r, token t), summed
// over each warp, then over the block's warps through `partial`, times scale (x16.cuh norm_scale: 1 but for
// a norm's readers), into y (n_tok, n_rows), plus add (as y) where given: the residual stream. Every thread
// of the block calls it.
template <int ROWS, int TOKENS, int WARPS>
__device__ __forceinline__ void store_row_sums(const float (&acc)[ROWS][TOKENS], float (&partial)[WARPS][ROWS][TOKENS],
                                               float* __restrict__ y, int r0, int n_rows, int n_tok,
                                               const float* __restrict__ add = nullptr, float scale = 1.0f) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) {
        if (t >= n_tok) break;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float s = warp_sum(acc[r][t]);
            if (lane == 0) partial[warp][r][t] = s;
        }
    }
    __syncthreads();
    const int r = threadIdx.x / TOKENS, t = threadIdx.x % TOKENS;
    if (r < ROWS && r0 + r < n_rows && t < n_tok) {
        float s = 0.0f;
        for (int w = 0; w < (int)blockDim.x / WARP; ++w) s += partial[w][r][t];
        const size_t at = (size_t)t * n_rows + r0 + r;
        s *= scale;
        y[at] = add ? add[at] + s : s;
    }
}
