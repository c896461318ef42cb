// RoPE of one head, normed first where the model norms q and k per head (Qwen3): rope_f32's (elementwise.cu), and
// the one a one-token pass's v matvec makes in its launch (RopeOut), to the same bits.
#pragma once
#include "common.cuh"

// NEOX pairs (i, i + n_rot/2), NORM pairs (2i, 2i+1). eps is the head's RMSNorm's, where it has one.
struct RopeParams {
    const float* freq_factors;  // n_rot / 2 divisors of the frequencies, or null
    int head_dim, n_rot;
    bool neox;
    double base, freq_scale;
    float eps;
};

// The RMSNorm divisor of head x (head_dim floats): sqrt(mean of squares + eps), by one warp (lanes sum dims
// lane, lane + 32, ... in turn, then across the warp), so that rope_f32's one barrier after the angles serves
// it too. Every lane gets it.
__device__ __forceinline__ float head_norm_scale(const float* x, const RopeParams& r) {
    float sq = 0.0f;
    for (int i = threadIdx.x % WARP; i < r.head_dim; i += WARP) sq += x[i] * x[i];
    return sqrtf(warp_sum(sq) / r.head_dim + r.eps);
}

// A normed head's dim x as the rotation takes it, w its norm's weight: x / scale * w.
__device__ __forceinline__ float rope_normed(float x, float scale, float w) { return __fmul_rn(__fdiv_rn(x, scale), w); }

// Dim i of a head's input to the rotation: normed where the head has a norm (norm_w), else x.
__device__ __forceinline__ float rope_input(float x, const float* norm_w, float scale, int i) {
    return norm_w ? rope_normed(x, scale, norm_w[i]) : x;
}

// Pair i's two dims, and the pair (a, b) of their inputs rotated by its angle cs = (cos, sin).
__device__ __forceinline__ int2 rope_pair_dims(int i, const RopeParams& r) {
    return r.neox ? make_int2(i, i + r.n_rot / 2) : make_int2(2 * i, 2 * i + 1);
}
__device__ __forceinline__ float2 rope_rotated(float a, float b, float2 cs) {
    return make_float2(__fsub_rn(__fmul_rn(a, cs.x), __fmul_rn(b, cs.y)), __fadd_rn(__fmul_rn(a, cs.y), __fmul_rn(b, cs.x)));
}

// The head x rotated by the angles cs, normalized first where norm_w is given (scale from head_norm_scale):
// put(i, value) for each of its dims, by the block's threads.
template <class Put>
__device__ __forceinline__ void rope_rotate(const float* x, const float* norm_w, float scale, const RopeParams& r,
                                            const float2* cs, Put put) {
    for (int i = threadIdx.x; i < r.n_rot / 2; i += blockDim.x) {
        const int2 d = rope_pair_dims(i, r);
        const float2 v = rope_rotated(rope_input(x[d.x], norm_w, scale, d.x), rope_input(x[d.y], norm_w, scale, d.y), cs[i]);
        put(d.x, v.x);
        put(d.y, v.y);
    }
    for (int i = r.n_rot + threadIdx.x; i < r.head_dim; i += blockDim.x) put(i, rope_input(x[i], norm_w, scale, i));
}

// q and k's rope (rope_f32's, with its cache write) made by the launch of a one-token pass's matvec that makes v, so
// that no launch of its own stands between that matvec and the attention (ops.py CudaOps.attention). Either q and k
// are that launch's weights 0 and 1 and v its 2, and the last block to store a head's rows ropes it (tickets), or
// they were made before it and v is its only weight (tickets null), and blocks past v's rows rope a head each,
// beside those rows. Its angles are the pass's table, made by the pass's first rope (rope_f32: not this), for the
// one token.
struct RopeOut {
    const float *q, *k;  // the products: q_heads and k_heads heads of head_dim floats
    float *q_out, *k_out;  // their rotations
    const float *q_norm, *k_norm;  // each head's RMSNorm weight (head_dim floats), or null
    int q_heads, k_heads, head_dim, n_rot, neox;
    float eps;
    const float2* angles;  // the token's row of the table
    __half *k_cache, *v_cache;  // the layer's
    int* slot_seg;
    const int *seg, *start_at;
    int* tickets;  // blocks of each head done (0 after), or null
};
// A kernel's parameters for it, in its fields' order, and the struct made of them.
#define ROPE_OUT_PARAMS                                                                                        \
    const float *rope_q, const float *rope_k, float *rope_q_out, float *rope_k_out, const float *rope_q_norm,  \
        const float *rope_k_norm, int rope_q_heads, int rope_k_heads, int rope_head_dim, int rope_n_rot,       \
        int rope_neox, float rope_eps, const float2 *rope_angles, __half *rope_k_cache, __half *rope_v_cache,  \
        int *rope_slot_seg, const int *rope_seg, const int *rope_start_at, int *rope_tickets
#define ROPE_OUT                                                                                               \
    RopeOut{rope_q, rope_k, rope_q_out, rope_k_out, rope_q_norm, rope_k_norm, rope_q_heads, rope_k_heads,      \
            rope_head_dim, rope_n_rot, rope_neox, rope_eps, rope_angles, rope_k_cache, rope_v_cache,           \
            rope_slot_seg, rope_seg, rope_start_at, rope_tickets}

constexpr int ROPE_LANE_DIMS = 8;  // a lane's dims of a head of up to 256 (ops.py ROPE_MAX_DIMS)

// Head h of q (h < q_heads) or of k (the rest) normed and rotated into its output, k's also into the cache's slot
// as f16, with the slot's segment for k's first head: rope_f32's arithmetic, by the calling warp. Its loads (the
// head, its norm's weights, the angles) all go at once, the normed inputs meet in shared memory: on a launch's
// path, each trip to memory is paid in full.
__device__ __forceinline__ void rope_head(const RopeOut& o, int h) {
    __shared__ float normed[ROPE_LANE_DIMS * WARP];
    const int lane = threadIdx.x % WARP;
    const bool is_k = h >= o.q_heads;
    const int head = is_k ? h - o.q_heads : h, half = o.n_rot / 2;
    const float* x = (is_k ? o.k : o.q) + (int64_t)head * o.head_dim;
    const float* norm_w = is_k ? o.k_norm : o.q_norm;
    const RopeParams r{nullptr, o.head_dim, o.n_rot, o.neox != 0, 0.0, 0.0, o.eps};
    const int64_t slot = *o.start_at;
    float v[ROPE_LANE_DIMS], w[ROPE_LANE_DIMS];
    float2 cs[ROPE_LANE_DIMS / 2];
#pragma unroll
    for (int j = 0; j < ROPE_LANE_DIMS; ++j) {
        const int d = lane + WARP * j;
        v[j] = d < o.head_dim ? __ldcg(x + d) : 0.0f;
        w[j] = d < o.head_dim && norm_w ? norm_w[d] : 1.0f;
        if (j < ROPE_LANE_DIMS / 2) cs[j] = d < half ? o.angles[d] : make_float2(1.0f, 0.0f);
    }
    float scale = 1.0f;
    if (norm_w) {  // head_norm_scale's sum, in its order (the zeros past head_dim add nothing)
        float sq = 0.0f;
#pragma unroll
        for (int j = 0; j < ROPE_LANE_DIMS; ++j) sq += v[j] * v[j];
        scale = sqrtf(warp_sum(sq) / o.head_dim + o.eps);
    }
#pragma unroll
    for (int j = 0; j < ROPE_LANE_DIMS; ++j)
        if (lane + WARP * j < o.head_dim) normed[lane + WARP * j] = norm_w ? rope_normed(v[j], scale, w[j]) : v[j];
    __syncwarp();
    float* y = (is_k ? o.k_out : o.q_out) + (int64_t)head * o.head_dim;
    __half* k_slot = o.k_cache + (slot * o.k_heads + head) * o.head_dim;
    const auto put = [&](int d, float value) {
        y[d] = value;
        if (is_k) k_slot[d] = __float2half_rn(value);
    };
#pragma unroll
    for (int j = 0; j < ROPE_LANE_DIMS / 2; ++j) {
        const int i = lane + WARP * j;
        if (i >= half) break;
        const int2 d = rope_pair_dims(i, r);
        const float2 rotated = rope_rotated(normed[d.x], normed[d.y], cs[j]);
        put(d.x, rotated.x);
        put(d.y, rotated.y);
    }
    for (int d = o.n_rot + lane; d < o.head_dim; d += WARP) put(d, normed[d]);
    if (is_k && head == 0 && lane == 0) o.slot_seg[slot] = o.seg[0];
    __syncwarp();  // normed is free for the warp's next head
}

// After the calling warp stored rows row0.. row0 + ROWS - 1 of the launch's weight i (lane l < ROWS: row0 + l's
// value): v's rows (of v_rows a token) into the cache's slot as f16. Returns the q or k head these rows complete,
// whose rope is then the caller's (rope_head), or -1. Every lane of the warp calls it.
template <int ROWS>
__device__ __forceinline__ int rope_after_store(const RopeOut& o, int i, int row0, int v_rows, float value) {
    if (i == (o.tickets ? 2 : 0)) {
        if (threadIdx.x % WARP < ROWS) o.v_cache[(int64_t)*o.start_at * v_rows + row0 + threadIdx.x % WARP] = __float2half_rn(value);
        return -1;
    }
    const int h = row0 / o.head_dim + (i == 1 ? o.q_heads : 0);
    return last_to_arrive(&o.tickets[h], o.head_dim / ROWS) ? h : -1;
}

