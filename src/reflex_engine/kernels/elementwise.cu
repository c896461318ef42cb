// Row-wise and elementwise ops of the decoder: RMSNorm, RoPE, SwiGLU, residual add, row gather.
// Arithmetic follows the numpy backend operation for operation (explicit _rn intrinsics where
// the compiler would otherwise contract a*b-c into one FMA), so results match it to rounding.
#include "common.cuh"

// y = x / sqrt(s + eps) * w over each group of d features, s the mean of the squares (RMSNorm) or, with
// no w, their sum (the L2 norm of Gated DeltaNet's q and k); one block per group.
// LAUNCH: block = 32 * ceil(min(d, 1024) / 32), grid.x = number of groups (rows * features / d).
extern "C" __global__ void norm_f32(const float* x, const float* w, float* y, int d, float eps) {
    const float* xg = x + (int64_t)blockIdx.x * d;
    float* yg = y + (int64_t)blockIdx.x * d;
    float sq = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) sq += xg[i] * xg[i];
    const float total = block_sum(sq);
    const float scale = sqrtf((w ? total / d : total) + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) yg[i] = w ? __fmul_rn(__fdiv_rn(xg[i], scale), w[i]) : __fdiv_rn(xg[i], scale);
}

// Rotate the first n_rot dims of every head; NEOX pairs (i, i + n_rot/2), NORM pairs (2i, 2i+1).
// The angle is computed in double as the reference does: pos * freq_scale * base^(-2i/n_rot) / ff[i].
// LAUNCH: block = (n_rot / 2 rounded up to 32, capped at 256), grid = (n_tok, n_heads).
extern "C" __global__ void rope_f32(const float* x, float* y, const int* pos, const float* freq_factors, int head_dim,
                                    int n_rot, int neox, double base, double freq_scale) {
    const int64_t head = ((int64_t)blockIdx.x * gridDim.y + blockIdx.y) * head_dim;
    const int half = n_rot / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        double inv_freq = pow(base, -2.0 * i / n_rot);
        if (freq_factors) inv_freq /= (double)freq_factors[i];
        double s, c;
        sincos((double)pos[blockIdx.x] * freq_scale * inv_freq, &s, &c);
        const float cs = (float)c, sn = (float)s;
        const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
        const float a = x[head + ia], b = x[head + ib];
        y[head + ia] = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
        y[head + ib] = __fadd_rn(__fmul_rn(a, sn), __fmul_rn(b, cs));
    }
    for (int i = n_rot + threadIdx.x; i < head_dim; i += blockDim.x) y[head + i] = x[head + i];
}

// LAUNCH for the elementwise kernels: block 256, grid.x = ceil(n / 256).
extern "C" __global__ void add_f32(const float* a, const float* b, float* y, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a[i] + b[i];
}

// silu(gate) * up as gate / (1 + exp(-gate)) * up: exp overflowing to inf gives -0, as in numpy.
extern "C" __global__ void swiglu_f32(const float* gate, const float* up, float* y, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __fmul_rn(__fdiv_rn(gate[i], 1.0f + expf(-gate[i])), up[i]);
}

// dst[i] = src[rows[i]], rows of `width` floats. LAUNCH: block 256, grid.x = number of rows.
extern "C" __global__ void take_rows_f32(const float* src, const int* rows, float* dst, int width) {
    const float* s = src + (int64_t)rows[blockIdx.x] * width;
    float* d = dst + (int64_t)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) d[i] = s[i];
}

// `reflex smoke`: the first kernel on a new GPU. y[i] = 2 * x[i] + i. LAUNCH: block 256.
extern "C" __global__ void smoke(const float* x, float* y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i] + (float)i;
}
