// x as the int16 blocks matvec_x16.cu's kernels read: per block of 32 consecutive elements of the
// flat (T, n_cols) array, d = max |x| / 32767, xq = quant16(x, d) (0 where d is 0, from an all-zero
// block or by underflow), and xds = (d, d·Σq). quantize_x16 makes them from x; a kernel that makes
// a matvec's input may write them beside it (ops.py then skips quantize_x16): the same bits either way.
#pragma once
#include "common.cuh"
#include "quant_blocks.cuh"

// rint(v / d), clamped: a subnormal d keeps so few bits that max |x| / d may pass 32767.
__device__ __forceinline__ int quant16(float v, float d) {
    return (int)rintf(fminf(fmaxf(__fdiv_rn(v, d), -32767.0f), 32767.0f));
}

// The int16 form of elements N·i .. N·i + N - 1, v, held by one lane of the 32 / N lanes (aligned in
// the warp) that hold their block. Every lane of the warp calls it; lanes with `in` false (past
// the end) take part in the group's shuffles and store nothing.
template <int N>
__device__ __forceinline__ void store_x16(const float (&v)[N], bool in, int i, uint8_t* __restrict__ xq,
                                          float2* __restrict__ xds) {
    constexpr int LANES = 32 / N;
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < N; ++k) amax = fmaxf(amax, fabsf(v[k]));
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = __fdiv_rn(amax, 32767.0f);
    int q[N] = {}, sum = 0;
#pragma unroll
    for (int k = 0; k < N; ++k) {
        if (d > 0.0f) q[k] = quant16(v[k], d);
        sum += q[k];
    }
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (!in) return;
    if constexpr (N == 4) {
        reinterpret_cast<uint2*>(xq)[i] = make_uint2((q[0] & 0xFFFF) | (uint32_t)q[1] << 16, (q[2] & 0xFFFF) | (uint32_t)q[3] << 16);
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k) reinterpret_cast<int16_t*>(xq)[N * i + k] = (int16_t)q[k];
    }
    if (i % LANES == 0) xds[i / LANES] = make_float2(d, d * (float)sum);
}

// 16 int16 of x (8 words) at a 32-byte aligned p, through the read-only path (L1, shared by the blocks on an SM).
__host__ __device__ __forceinline__ void x_words(const uint8_t* p, uint32_t (&w)[8]) {
#ifdef __CUDA_ARCH__
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int4 v = __ldg(reinterpret_cast<const int4*>(p) + i);
        w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
#else
    load_words<16>(p, w);
#endif
}
