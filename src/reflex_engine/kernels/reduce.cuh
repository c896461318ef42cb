// Block-wide reductions and scans beyond common.cuh's, for attention.cu and sampling.cu.
// Like block_sum: called by every thread of a block of blockDim.x threads (a multiple of 32,
// at most 1024), and every thread gets the result.
#pragma once
#include <climits>
#include "common.cuh"

// (value, index) pairs ordered as numpy's argmax: larger value first, then lower index.
__device__ __forceinline__ bool argmax_better(float v, int i, float best_v, int best_i) {
    return v > best_v || (v == best_v && i < best_i);
}

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (argmax_better(ov, oi, v, i)) v = ov, i = oi;
    }
}

__device__ __forceinline__ void block_argmax(float& v, int& i) {
    __shared__ float partial_v[32];
    __shared__ int partial_i[32];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, n_warps = blockDim.x / WARP;
    warp_argmax(v, i);
    __syncthreads();
    if (lane == 0) partial_v[warp] = v, partial_i[warp] = i;
    __syncthreads();
    v = lane < n_warps ? partial_v[lane] : -INFINITY;
    i = lane < n_warps ? partial_i[lane] : INT_MAX;
    warp_argmax(v, i);
}

// Inclusive prefix sum across the lanes of a full warp.
__device__ __forceinline__ unsigned warp_inclusive_scan(unsigned v) {
    const int lane = threadIdx.x % WARP;
#pragma unroll
    for (int o = 1; o < WARP; o <<= 1) {
        const unsigned other = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += other;
    }
    return v;
}
