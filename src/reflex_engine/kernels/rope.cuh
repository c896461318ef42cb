// RoPE of one head, shared by rope_f32 (elementwise.cu) and the attention that ropes its own query token
// (attention.cu attention_rope): the same arithmetic either way, so their results agree to the bit.
#pragma once
#include "common.cuh"

#define ROPE_MAX_PAIRS 128  // n_rot up to 256

// NEOX pairs (i, i + n_rot/2), NORM pairs (2i, 2i+1). eps is the head's RMSNorm's, where it has one.
struct RopeParams {
    const float* freq_factors;  // n_rot / 2 divisors of the frequencies, or null
    int head_dim, n_rot;
    bool neox;
    double base, freq_scale;
    float eps;
};

// cs[i] = (cos, sin) of pair i's angle at position pos, computed in double as the reference does:
// pos * freq_scale * base^(-2i/n_rot) / ff[i]. By the block's threads; the caller syncs before reading.
__device__ __forceinline__ void rope_angles(const RopeParams& r, int pos, float2* cs) {
    for (int i = threadIdx.x; i < r.n_rot / 2; i += blockDim.x) {
        double inv_freq = pow(r.base, -2.0 * i / r.n_rot);
        if (r.freq_factors) inv_freq /= (double)r.freq_factors[i];
        double s, c;
        sincos((double)pos * r.freq_scale * inv_freq, &s, &c);
        cs[i] = make_float2((float)c, (float)s);
    }
}

// The head x (head_dim floats) rotated by the angles cs: put(i, value) for each of its dims, by the block's
// threads. With norm_w, the head is first RMS-normalized (every thread must call this, with the same
// norm_w): its squares summed by the first warp, in an order that does not depend on the block's size.
template <class Put>
__device__ __forceinline__ void rope_head(const float* x, const float* norm_w, const RopeParams& r, const float2* cs, Put put) {
    __shared__ float head_scale;
    float scale = 1.0f;
    if (norm_w) {
        __syncthreads();  // head_scale may still be read by a previous call
        if (threadIdx.x < WARP) {
            float sq = 0.0f;
            for (int i = threadIdx.x; i < r.head_dim; i += WARP) sq += x[i] * x[i];
            sq = warp_sum(sq);
            if (threadIdx.x == 0) head_scale = sqrtf(sq / r.head_dim + r.eps);
        }
        __syncthreads();
        scale = head_scale;
    }
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
