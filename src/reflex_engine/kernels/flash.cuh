// The steps of a flash-attention-2 tile that attention_prefill.cu and mla.cu share, on a warp's 16 query rows
// and a tile of slots in shared memory: lane l holds rows l/4 and l/4 + 8 (u = 0, 1) of the scores' and the
// output's mma C fragments, columns 2(l % 4), 2(l % 4) + 1 of each 8-wide piece. Scores come scaled by log2(e):
// the softmax runs in base 2.
#pragma once
#include "common.cuh"
#include "mma.cuh"

// Hidden slots to -inf: s[nt][e] is row e / 2, slot j0 + 8nt + 2c + e % 2, seen up to limit[row] and in segment 0
// or own_seg[row]; segs the tile's slots' segments.
template <int NT>
__device__ __forceinline__ void mask_hidden(float (&s)[NT][4], int j0, const int* segs, const int (&limit)[2],
                                            const int (&own_seg)[2], int c) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int j = 8 * nt + 2 * c + e % 2, slot_s = segs[j];
            if (j0 + j > limit[e / 2] || (slot_s != 0 && slot_s != own_seg[e / 2])) s[nt][e] = -INFINITY;
        }
}

// The online softmax over the tile's scores: each row's running max and sum, O rescaled, s replaced by the
// unnormalised probabilities. A row that has seen only hidden slots keeps max -inf: its exponents are taken
// against 0 instead, so every weight is 2^-inf = 0, never NaN. A row's max is shared by its 4 lanes; its sum's
// parts are added up once, at the end (row_sum).
template <int NT, int DT>
__device__ __forceinline__ void online_softmax(float (&s)[NT][4], float (&run_max)[2], float (&run_sum)[2], float (&o)[DT][4]) {
    float base[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        float m = run_max[u];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) m = fmaxf(m, fmaxf(s[nt][2 * u], s[nt][2 * u + 1]));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));  // the row's 4 lanes
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        base[u] = m == -INFINITY ? 0.0f : m;
        const float rescale = fast_exp2(run_max[u] - base[u]);
        run_max[u] = m;
        run_sum[u] *= rescale;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) o[dt][2 * u] *= rescale, o[dt][2 * u + 1] *= rescale;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[nt][e] = fast_exp2(s[nt][e] - base[e / 2]);
            run_sum[e / 2] += s[nt][e];
        }
}

// O += P V, 16 slots at a time: P the probabilities re-packed to f16 in place (two adjacent 8-slot pieces of the
// C layout are one 16-slot piece of the A layout). V's rows are slots, ld halves apart in shared memory from v (its
// first dim), the k x n = slot x dim operand transposed: matrix m of the x4 is slots 16kp + 8(m % 2).. by dims
// 8dt + 8(m / 2)..
template <int NT, int DT>
__device__ __forceinline__ void add_pv(const float (&s)[NT][4], const __half* v, int ld, float (&o)[DT][4], int lane) {
#pragma unroll
    for (int kp = 0; kp < NT / 2; ++kp) {
        const uint32_t p[4] = {pack_half2(s[2 * kp][0], s[2 * kp][1]), pack_half2(s[2 * kp][2], s[2 * kp][3]),
                               pack_half2(s[2 * kp + 1][0], s[2 * kp + 1][1]), pack_half2(s[2 * kp + 1][2], s[2 * kp + 1][3])};
#pragma unroll
        for (int dt = 0; dt < DT; dt += 2) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, v + (16 * kp + lane % 16) * ld + 8 * dt + 8 * (lane / 16));
            mma_16816(o[dt], p, {b[0], b[1]});
            mma_16816(o[dt + 1], p, {b[2], b[3]});
        }
    }
}

// A row's sum from its 4 lanes' parts.
__device__ __forceinline__ float row_sum(float part) {
    part += __shfl_xor_sync(0xffffffffu, part, 1);
    return part + __shfl_xor_sync(0xffffffffu, part, 2);
}

// Row u of O times norm into row (its first output dim): this lane's dims 2c, 2c + 1 of each 8.
template <int DT>
__device__ __forceinline__ void store_row(const float (&o)[DT][4], int u, float* row, float norm, int c) {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
        *reinterpret_cast<float2*>(row + 8 * dt + 2 * c) = make_float2(o[dt][2 * u] * norm, o[dt][2 * u + 1] * norm);
}
