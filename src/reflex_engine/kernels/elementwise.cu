// Row-wise and elementwise ops of the decoder: RMSNorm, RoPE, SwiGLU, residual add, row gather.
// Arithmetic follows the numpy backend operation for operation (explicit _rn intrinsics where
// the compiler would otherwise contract a*b-c into one FMA), so results match it to rounding.
#include "common.cuh"
#include "rope.cuh"
#include "x16.cuh"

// y = x / sqrt(s + eps) * w over each group of d features, s the mean of the squares (RMSNorm) or, with
// no w, their sum (the L2 norm of Gated DeltaNet's q and k). With xq, y's int16 blocks too (x16.cuh; groups
// of a multiple of 32 features). A group is split over gridDim.y blocks, each summing all its squares
// and writing d / gridDim.y of its features: one block was one SM's chain of a 4,096-wide row's
// normalizing and rounding (H200: 6.4 us a launch).
// LAUNCH: block = 32 * ceil(min(d, 1024) / 32), grid = (number of groups (rows * features / d), splits);
// d a multiple of 32 * splits.
extern "C" __global__ void norm_f32(const float* x, const float* w, float* y, int d, float eps, uint8_t* xq, float2* xds) {
    follow_previous_kernel();
    const int64_t g = (int64_t)blockIdx.x * d;
    const float* xg = x + g;
    float* yg = y + g;
    float sq = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) sq += xg[i] * xg[i];
    const float total = block_sum(sq);
    const float scale = sqrtf((w ? total / d : total) + eps);
    const int share = d / gridDim.y, end = share * (blockIdx.y + 1);
    for (int i = share * blockIdx.y + threadIdx.x; i < end; i += blockDim.x) {  // a warp: 32 consecutive features
        const float v = w ? __fmul_rn(__fdiv_rn(xg[i], scale), w[i]) : __fdiv_rn(xg[i], scale);
        yg[i] = v;
        if (xq) store_x16<1>({v}, true, (int)(g + i), xq, xds);
    }
}

#define ROPE_MAX_PAIRS 128  // n_rot up to 256: ops.py ROPE_MAX_DIMS

// cs[i] = (cos, sin) of pair i's angle at position pos, by the block's threads (the caller syncs before
// reading them). Computed in double as the reference does, pos * freq_scale * base^(-2i/n_rot) / ff[i], into
// the pass's table row of the token as well where `write`; or, where `ready`, read from that row, which
// the pass's first rope wrote for the same positions and parameters (ops.py CudaOps.ropes): the same
// numbers without the double-precision pow and sincos, which took ~3% of a 0.6B decode step (run 19).
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

// Before the wait for the kernel before (the matvec making q and k): asks L2 for the head's norm weights and,
// where the pass's first rope wrote them, its angles (a line a thread: the block has at least 32), which that
// kernel does not write, so that their trip from memory runs beside it and not after it.
__device__ __forceinline__ void ask_l2_for_rope_constants(const float* norm0, const float* norm1, int heads0,
                                                          int head_dim, const float2* angles, int angles_ready, int n_rot) {
    const float* norm_w = blockIdx.y >= heads0 ? norm1 : norm0;
    const int line = threadIdx.x * 128;
    if (norm_w && line < head_dim * (int)sizeof(float)) prefetch_l2(reinterpret_cast<const char*>(norm_w) + line);
    if (angles_ready && line < n_rot / 2 * (int)sizeof(float2))
        prefetch_l2(reinterpret_cast<const char*>(angles + blockIdx.x * ROPE_MAX_PAIRS) + line);
}

// Rotate the first n_rot dims of every head (above); with norm_w, each head is first RMS-normalized.
// Two tensors of the same tokens at once (q and k, each with its own norm): blocks y < heads0 take
// x0's heads0 heads a token, the rest x1's (gridDim.y - heads0; none: x1, y1 unused). With k_cache,
// x1 is k and the blocks of its heads write what kv_store would (attention.cu) of token i into slot
// *start_at + i: the rotated head rounded to f16, the head's share of v's row (v_width floats a token)
// and, for the first head, the token's segment; the attention after then needs no kv_store. angles: the
// pass's table (rope_angles), n_tok rows of ROPE_MAX_PAIRS, which the first head's blocks write unless
// angles_ready. x0's heads lie stride0 floats apart (head_dim where x0 is a tensor of its own, more where it is a
// split's part read in place), x1's stride1; y's are dense.
// LAUNCH: block = (n_rot / 2 rounded up to 32, capped at 256), grid = (n_tok, heads0 + heads1).
extern "C" __global__ void rope_f32(const float* x0, float* y0, const float* norm0, int heads0, const float* x1, float* y1,
                                    const float* norm1, const int* pos, const float* freq_factors, int head_dim, int n_rot,
                                    int neox, double base, double freq_scale, float eps, int stride0, int stride1,
                                    float2* angles, int angles_ready, __half* k_cache, __half* v_cache, const float* v,
                                    int v_width, int* slot_seg, const int* seg, const int* start_at) {
    ask_l2_for_rope_constants(norm0, norm1, heads0, head_dim, angles, angles_ready, n_rot);
    follow_previous_kernel_early();
    __shared__ float2 cs[ROPE_MAX_PAIRS];
    __shared__ float scale;
    const bool second = blockIdx.y >= heads0;
    const float* x = second ? x1 : x0;
    float* y = second ? y1 : y0;
    const float* norm_w = second ? norm1 : norm0;
    const int n_heads = second ? gridDim.y - heads0 : heads0, h = second ? blockIdx.y - heads0 : blockIdx.y;
    const int64_t head = ((int64_t)blockIdx.x * n_heads + h) * head_dim;
    const float* x_head = x + ((int64_t)blockIdx.x * n_heads + h) * (second ? stride1 : stride0);
    const bool store = second && k_cache;
    const int64_t slot = store ? (int64_t)*start_at + blockIdx.x : 0;
    __half* k_slot = store ? k_cache + slot * n_heads * head_dim + (int64_t)h * head_dim : nullptr;
    const RopeParams r{freq_factors, head_dim, n_rot, neox != 0, base, freq_scale, eps};
    rope_angles(r, pos[blockIdx.x], angles + blockIdx.x * ROPE_MAX_PAIRS, angles_ready, blockIdx.y == 0, cs);
    if (norm_w && threadIdx.x < WARP) {
        const float s = head_norm_scale(x_head, r);
        if (threadIdx.x == 0) scale = s;
    }
    __syncthreads();
    rope_rotate(x_head, norm_w, scale, r, cs, [&](int i, float value) {
        y[head + i] = value;
        if (store) k_slot[i] = __float2half_rn(value);
    });
    if (store) {
        const int dv = v_width / n_heads;
        const float* v_head = v + (int64_t)blockIdx.x * v_width + (int64_t)h * dv;
        for (int i = threadIdx.x; i < dv; i += blockDim.x) v_cache[slot * v_width + (int64_t)h * dv + i] = __float2half_rn(v_head[i]);
        if (h == 0 && threadIdx.x == 0) slot_seg[slot] = seg[blockIdx.x];
    }
}

// LAUNCH for the elementwise kernels: block 256, grid.x = ceil(n / 256).
extern "C" __global__ void add_f32(const float* a, const float* b, float* y, int64_t n) {
    follow_previous_kernel();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a[i] + b[i];
}

// silu(gate) * up as gate / (1 + exp(-gate)) * up: exp overflowing to inf gives -0, as in numpy. With
// xq, y's int16 blocks too (x16.cuh; n a multiple of 32).
extern "C" __global__ void swiglu_f32(const float* gate, const float* up, float* y, int64_t n, uint8_t* xq, float2* xds) {
    const BlockClock clocked;
    follow_previous_kernel_early();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const bool in = i < n;  // lanes past n still take part in store_x16's shuffles
    const float g = in ? gate[i] : 0.0f, v = in ? __fmul_rn(__fdiv_rn(g, 1.0f + expf(-g)), up[i]) : 0.0f;
    if (in) y[i] = v;
    if (xq) store_x16<1>({v}, in, (int)i, xq, xds);
}

// dst[i] = src[rows[i]], rows of `width` floats. LAUNCH: block 256, grid.x = number of rows.
extern "C" __global__ void take_rows_f32(const float* src, const int* rows, float* dst, int width) {
    follow_previous_kernel();
    const float* s = src + (int64_t)rows[blockIdx.x] * width;
    float* d = dst + (int64_t)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) d[i] = s[i];
}

// `reflex smoke`: the first kernel on a new GPU. y[i] = 2 * x[i] + i. LAUNCH: block 256.
extern "C" __global__ void smoke(const float* x, float* y, int n) {
    follow_previous_kernel();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i] + (float)i;
}
