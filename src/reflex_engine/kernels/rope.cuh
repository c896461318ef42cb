// RoPE of one head, shared by rope_f32 (elementwise.cu) and the attention that ropes its own query token
// (attention.cu attention_rope): the same arithmetic either way, so their results agree to the bit.
#pragma once
#include "common.cuh"

#define ROPE_MAX_PAIRS 128  // n_rot up to 256: ops.py ROPE_MAX_DIMS

// NEOX pairs (i, i + n_rot/2), NORM pairs (2i, 2i+1). eps is the head's RMSNorm's, where it has one.
struct RopeParams {
    const float* freq_factors;  // n_rot / 2 divisors of the frequencies, or null
    int head_dim, n_rot;
    bool neox;
    double base, freq_scale;
    float eps;
};

// cs[i] = (cos, sin) of pair i's angle at position pos, by the block's threads (the caller syncs before
// reading them). Computed in double as the reference does, pos * freq_scale * base^(-2i/n_rot) / ff[i], into
// the pass's table row of the token as well where `write`; or, where `ready`, read from that row, which
// the pass's first rope wrote for the same positions and parameters (ops.py CudaOps.ropes): the same
// numbers without the double-precision pow and sincos, which took 3% of a 0.6B decode step.
__device__ __forceinline__ void rope_angles(const RopeParams& r, int pos, float2* table_row, bool ready, bool write,
                                            float2* cs) {
    for (int i = threadIdx.x; i < r.n_rot / 2; i += blockDim.x) {
        if (ready) {
            cs[i] = table_row[i];
            continue;
        }
        double inv_freq = pow(r.base, -2.0 * i / r.n_rot);
        if (r.freq_factors) inv_freq /= (double)r.freq_factors[i];
        double s, c;
        sincos((double)pos * r.freq_scale * inv_freq, &s, &c);
        cs[i] = make_float2((float)c, (float)s);
        if (write) table_row[i] = cs[i];
    }
}

// The RMSNorm divisor of head x (head_dim floats): sqrt(mean of squares + eps), by one warp, whose lanes
// sum dims lane, lane + 32, ... in turn and then across the warp: an order no block's size changes. Every
// lane gets it.
__device__ __forceinline__ float head_norm_scale(const float* x, const RopeParams& r) {
    float sq = 0.0f;
    for (int i = threadIdx.x % WARP; i < r.head_dim; i += WARP) sq += x[i] * x[i];
    return sqrtf(warp_sum(sq) / r.head_dim + r.eps);
}

// The head x rotated by the angles cs, normalized first where norm_w is given (x / scale * norm_w, scale from
// head_norm_scale): put(i, value) for each of its dims, by the block's threads.
template <class Put>
__device__ __forceinline__ void rope_rotate(const float* x, const float* norm_w, float scale, const RopeParams& r,
                                            const float2* cs, Put put) {
    const auto in = [&](int i) { return norm_w ? __fmul_rn(__fdiv_rn(x[i], scale), norm_w[i]) : x[i]; };
    const int half = r.n_rot / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const int ia = r.neox ? i : 2 * i, ib = r.neox ? i + half : 2 * i + 1;
        const float a = in(ia), b = in(ib), c = cs[i].x, s = cs[i].y;
        put(ia, __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
        put(ib, __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c)));
    }
    for (int i = r.n_rot + threadIdx.x; i < r.head_dim; i += blockDim.x) put(i, in(i));
}
