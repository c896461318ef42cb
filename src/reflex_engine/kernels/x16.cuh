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

// Before a one-token matvec's wait, by one warp: asks L2 for the lines its store reads last for rows row0.., the
// residual it adds (or null) and the next norm's weight (or null), beside its first weights. A request, not a read:
// it races nothing the kernel before writes, and the norm's weight, which no kernel writes, came from DRAM on the
// step's path (docs/perf-notes.md run 32).
__device__ __forceinline__ void ask_l2_for_store_reads(const float* add, const float* norm_w, int row0) {
    const int lane = threadIdx.x % WARP;
    if (lane == 0 && add) prefetch_l2(add + row0);
    if (lane == 1 && norm_w) prefetch_l2(norm_w + row0);
}

// An RMSNorm split between the decode matvec that makes its input (the residual stream y, rows of whole
// groups of 32) and the decode matvecs that read its output (ops.py fuses the three in a one-token pass):
// the first writes, per group of 32 rows, the int16 blocks of y∘w and the group's Σ y² (`NormOut`); the
// readers multiply those blocks as they would the norm's and scale each sum by 1 / sqrt(Σ y² / n + eps)
// (`norm_scale`), as norm_f32 divides x: the int16 blocks of y∘w / s are those of y∘w with d / s, so the
// products are the norm's to rounding, and the norm's launch and its wait between the two are gone.
struct NormOut {
    const float* w;  // the norm's weight; null: the matvec writes no norm
    uint8_t* xq;
    float2* xds;
    float* sums;  // Σ y² of each group
    int* tickets;  // blocks of each group done, for kernels whose blocks hold fewer than 32 rows (0 after)
};

// Lane l of the warp holds y[32·g + l] of group g (every lane calls it).
__device__ __forceinline__ void store_normed(float y, int row, const NormOut& n) {
    const float s = warp_sum(__fmul_rn(y, y));
    if (row % 32 == 0) n.sums[row / 32] = s;
    store_x16<1>({__fmul_rn(y, n.w[row])}, true, row, n.xq, n.xds);
}

// After a block's warp 0 stored its rows r0.. r0 + ROWS - 1 of y: the last of the 32 / ROWS blocks of their group
// to do so (common.cuh last_to_arrive) writes the group's share of the norm. Every lane of warp 0 calls it, and
// only they.
template <int ROWS>
__device__ __forceinline__ void store_normed_when_whole(const float* y, int r0, const NormOut& n) {
    static_assert(32 % ROWS == 0, "a group's rows lie in whole blocks");
    const int group = r0 / 32;
    if (last_to_arrive(&n.tickets[group], 32 / ROWS))
        store_normed(__ldcg(y + 32 * group + threadIdx.x), 32 * group + threadIdx.x, n);
}

// 1 / sqrt(Σ sums / n + eps) over the n / 32 groups' sums, in every lane of the warp (every lane calls it),
// the same bits in every warp.
__device__ __forceinline__ float norm_scale(const float* sums, int n, float eps) {
    float s = 0.0f;
    for (int i = threadIdx.x % WARP; i < n / 32; i += WARP) s += sums[i];
    return rsqrtf(warp_sum(s) / n + eps);
}
