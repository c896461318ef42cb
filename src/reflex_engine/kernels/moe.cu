// Mixture of experts: the router's choice and the chosen experts' matrices. The choice stays on the
// device (expert ids in an int buffer) and the expert kernels read it there, so a decode step has
// no host decision in it and is captured as a CUDA graph like any other.
//
// A stacked weight is n matrices of (n_rows, n_cols) in GGUF blocks, each one's bytes contiguous
// (`matrix_bytes` apart): ggml's 3-D expert tensors {n_cols, n_rows, n_expert}, and the per-head
// matrices of MLA's attn_k_b / attn_v_b. The experts' faster forms live beside the dense kernels they share a
// loop with: a decode pass's on int16 x (matvec_x16.cu), a prompt's on tensor cores (gemm_tile.cu); the float
// kernels here take the types those have no kernel for.
#include "common.cuh"
#include "quant_blocks.cuh"

constexpr int MOE_WARPS = 4;  // output rows per block, one a warp
constexpr int MOE_XPAD = 36;  // floats per staged chunk: lanes' float4 reads of their own chunk hit distinct banks
constexpr int ROUTE_THREADS = 256;
constexpr int ROUTE_MAX_EXPERTS = 1024;  // backends/cuda/ops.py checks these three
constexpr int ROUTE_MAX_USED = 64;
constexpr int ROUTE_MAX_GROUPS = 64;

// numpy's argsort(-s, kind="stable") order: larger first, NaN after everything, ties by the lower index.
__device__ __forceinline__ bool route_before(float a, int i, float b, int j) {
    if (isnan(a)) return isnan(b) && i < j;
    if (isnan(b)) return true;
    return a > b || (a == b && i < j);
}

// The position of s[i] among s[0..n-1] in that order (a total order, so positions are distinct).
__device__ __forceinline__ int rank_of(const float* s, int i, int n) {
    int r = 0;
    for (int j = 0; j < n; ++j) r += route_before(s[j], j, s[i], i);
    return r;
}

// One token's routing, as CpuOps.route: p = softmax or sigmoid of the logits; s = p + bias; with
// groups, only the n_groups_used groups with the highest sum of their top two s stay; the n_used
// highest s are chosen (best first), weighted by their p, optionally renormalised
// (w / max(sum w, 2^-14)), then times scale. Ranks are counted, not sorted: deterministic, and
// ties go to the lower id as numpy's stable sort sends them.
// LAUNCH: block = ROUTE_THREADS, grid.x = n_tok; n_expert <= ROUTE_MAX_EXPERTS, n_used <=
// ROUTE_MAX_USED, n_groups <= ROUTE_MAX_GROUPS dividing n_expert.
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
moe_route(const float* logits, const float* bias, int* experts, float* weights, int n_expert, int n_used,
          int sigmoid, int norm, float scale, int n_groups, int n_groups_used) {
    follow_previous_kernel();
    __shared__ float probs[ROUTE_MAX_EXPERTS], scores[ROUTE_MAX_EXPERTS], group_score[ROUTE_MAX_GROUPS];
    __shared__ int chosen[ROUTE_MAX_USED];
    __shared__ bool dropped[ROUTE_MAX_GROUPS];
    const float* l = logits + (size_t)blockIdx.x * n_expert;
    if (sigmoid) {
        for (int i = threadIdx.x; i < n_expert; i += blockDim.x) probs[i] = __fdiv_rn(1.0f, 1.0f + expf(-l[i]));
    } else {
        float m = -INFINITY;
        for (int i = threadIdx.x; i < n_expert; i += blockDim.x) m = fmaxf(m, l[i]);
        m = block_max(m);
        float sum = 0.0f;
        for (int i = threadIdx.x; i < n_expert; i += blockDim.x) sum += probs[i] = expf(l[i] - m);
        sum = block_sum(sum);
        for (int i = threadIdx.x; i < n_expert; i += blockDim.x) probs[i] = __fdiv_rn(probs[i], sum);
    }
    for (int i = threadIdx.x; i < n_expert; i += blockDim.x) scores[i] = bias ? probs[i] + bias[i] : probs[i];
    __syncthreads();
    if (n_groups > 1) {
        const int size = n_expert / n_groups;
        if (threadIdx.x < n_groups) {
            const float* g = scores + threadIdx.x * size;
            int best = 0, second = -1;
            for (int j = 1; j < size; ++j) {
                if (route_before(g[j], j, g[best], best)) second = best, best = j;
                else if (second < 0 || route_before(g[j], j, g[second], second)) second = j;
            }
            group_score[threadIdx.x] = second < 0 ? g[best] : g[best] + g[second];
        }
        __syncthreads();
        if (threadIdx.x < n_groups) dropped[threadIdx.x] = rank_of(group_score, threadIdx.x, n_groups) >= n_groups_used;
        __syncthreads();
        for (int i = threadIdx.x; i < n_expert; i += blockDim.x)
            if (dropped[i / size]) scores[i] = -INFINITY;
        __syncthreads();
    }
    for (int i = threadIdx.x; i < n_expert; i += blockDim.x) {
        const int r = rank_of(scores, i, n_expert);
        if (r < n_used) chosen[r] = i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (int j = 0; j < n_used; ++j) sum += probs[chosen[j]];
        const float div = norm ? fmaxf(sum, 6.103515625e-5f) : 1.0f;
        for (int j = 0; j < n_used; ++j) {
            const size_t at = (size_t)blockIdx.x * n_used + j;
            experts[at] = chosen[j];
            weights[at] = __fmul_rn(norm ? __fdiv_rn(probs[chosen[j]], div) : probs[chosen[j]], scale);
        }
    }
}

// Each warp's dot products of its N weight rows with the block's vector x (n_cols floats), x staged
// through shared memory 32 chunks at a time and shared by the block's rows. Every thread of the
// block calls it (warps with live false stage x, meet the barriers and get 0).
template <class B, int N>
__device__ __forceinline__ void rows_dot(const uint8_t* const (&rows)[N], bool live, const float* __restrict__ x,
                                         int n_cols, float (&dot)[N]) {
    __shared__ __align__(16) float xs[WARP * MOE_XPAD];
    const int lane = threadIdx.x % WARP;
    float acc[N] = {};
    for (int c0 = 0; 32 * c0 < n_cols; c0 += WARP) {
        __syncthreads();  // every warp is done with the previous x
        for (int e = threadIdx.x; e < 32 * WARP; e += blockDim.x) {
            const int k = 32 * c0 + e;
            xs[e / 32 * MOE_XPAD + e % 32] = k < n_cols ? x[k] : 0.0f;
        }
        __syncthreads();
        const int c = c0 + lane;
        if (live && 32 * c < n_cols) {
            const float4* x4 = reinterpret_cast<const float4*>(xs + lane * MOE_XPAD);
#pragma unroll
            for (int n = 0; n < N; ++n) {
                float w[32];
                B::chunk(rows[n], c, n_cols, w);
#pragma unroll
                for (int q = 0; q < 8; ++q) {
                    const float4 v = x4[q];
                    acc[n] = fmaf(w[4 * q], v.x, fmaf(w[4 * q + 1], v.y, fmaf(w[4 * q + 2], v.z, fmaf(w[4 * q + 3], v.w, acc[n]))));
                }
            }
        }
    }
#pragma unroll
    for (int n = 0; n < N; ++n) dot[n] = warp_sum(acc[n]);
}

// y (n_tok, n_slots, n_rows): for block x = t * n_slots + j, matrix m = ids ? ids[t * n_slots + j] : j
// of W times the vector at x + t * x_stride + j * x_slot_stride. Experts: ids the router's choice,
// x_slot_stride 0 (every slot reads the token's row). Heads: ids null, the slot's slice of the row.
// LAUNCH: block = MOE_WARPS * 32, grid = (n_tok * n_slots, ceil(n_rows / MOE_WARPS)).
template <class B>
__device__ __forceinline__ void stacked_matvec(const uint8_t* __restrict__ W, int64_t matrix_bytes, const int* ids,
                                               const float* __restrict__ x, float* __restrict__ y, int n_rows,
                                               int n_cols, int n_slots, int x_stride, int x_slot_stride) {
    const int slot = blockIdx.x, t = slot / n_slots, j = slot % n_slots;
    const int r = blockIdx.y * MOE_WARPS + threadIdx.x / WARP;
    const bool live = r < n_rows;
    const int m = ids ? ids[slot] : j;
    const uint8_t* rows[1] = {W + m * matrix_bytes + (size_t)r * row_bytes<B>(n_cols)};
    float dot[1];
    rows_dot<B, 1>(rows, live, x + (size_t)t * x_stride + (size_t)j * x_slot_stride, n_cols, dot);
    if (live && threadIdx.x % WARP == 0) y[(size_t)slot * n_rows + r] = dot[0];
}

// The experts' down projections mixed: y (n_tok, n_rows) = sum over j of weights[t, j] * D_e h[t, j],
// e = ids[t, j], h (n_tok, n_used, n_cols); slots in order, so the sum is deterministic.
// LAUNCH: block = MOE_WARPS * 32, grid = (n_tok, ceil(n_rows / MOE_WARPS)).
template <class B>
__device__ __forceinline__ void experts_down(const uint8_t* __restrict__ W, int64_t matrix_bytes, const int* ids,
                                             const float* weights, const float* __restrict__ h, float* __restrict__ y,
                                             int n_rows, int n_cols, int n_used) {
    const int t = blockIdx.x, r = blockIdx.y * MOE_WARPS + threadIdx.x / WARP;
    const bool live = r < n_rows;
    float acc = 0.0f;
    for (int j = 0; j < n_used; ++j) {
        const size_t slot = (size_t)t * n_used + j;
        const uint8_t* rows[1] = {W + ids[slot] * matrix_bytes + (size_t)r * row_bytes<B>(n_cols)};
        float dot[1];
        rows_dot<B, 1>(rows, live, h + slot * n_cols, n_cols, dot);
        acc = __fadd_rn(acc, __fmul_rn(dot[0], weights[slot]));
    }
    if (live && threadIdx.x % WARP == 0) y[(size_t)t * n_rows + r] = acc;
}

// A prompt's routes grouped by expert, for matvec.cu's grouped_matvec or gemm_tile.cu's gemm_tile_experts_*: of
// the n_pairs (token, slot) pairs p = t * n_used + j, offsets[e] is where expert e's begin (offsets[n_expert] =
// n_pairs), order[place] = p and place_of[p] = place. The places inside an expert follow the atomics' order; each
// pair's product is computed on its own, so no result depends on it. With tiles: each expert's places in tiles of
// tile_places, tiles[i] = (expert, its first place from offsets[expert]), then (-1, 0) up to max_tiles.
// LAUNCH: block 1024, grid 1; n_expert <= ROUTE_MAX_EXPERTS; max_tiles >= ceil(n_pairs / tile_places) + n_expert.
extern "C" __global__ void moe_group(const int* ids, int n_pairs, int n_expert, int* offsets, int* order, int* place_of,
                                     int2* tiles, int tile_places, int max_tiles) {
    follow_previous_kernel();
    __shared__ int count[ROUTE_MAX_EXPERTS], cursor[ROUTE_MAX_EXPERTS];
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) atomicAdd(&count[ids[p]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0;
        for (int e = 0; e < n_expert; ++e) cursor[e] = offsets[e] = run, run += count[e];
        offsets[n_expert] = run;
        if (tiles) {
            int n = 0;
            for (int e = 0; e < n_expert; ++e)
                for (int first = 0; first < count[e]; first += tile_places) tiles[n++] = make_int2(e, first);
            while (n < max_tiles) tiles[n++] = make_int2(-1, 0);
        }
    }
    __syncthreads();
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        const int place = atomicAdd(&cursor[ids[p]], 1);
        order[place] = p;
        place_of[p] = place;
    }
}

// xs[place] = x[order[place] / n_used]: each pair's token row, in expert order. LAUNCH: block 256, grid n_pairs.
extern "C" __global__ void moe_gather(const float* x, const int* order, float* xs, int n_used, int n_cols) {
    follow_previous_kernel();
    const float* src = x + (size_t)(order[blockIdx.x] / n_used) * n_cols;
    float* dst = xs + (size_t)blockIdx.x * n_cols;
    for (int c = threadIdx.x; c < n_cols; c += blockDim.x) dst[c] = src[c];
}

// y[t] = sum over j of weights[t, j] * ys[place_of[t * n_used + j]], slots in order as experts_down sums them.
// LAUNCH: block 256, grid n_tok.
extern "C" __global__ void moe_combine(const float* ys, const int* place_of, const float* weights, float* y, int n_used,
                                       int n_cols) {
    follow_previous_kernel();
    const int t = blockIdx.x;
    for (int c = threadIdx.x; c < n_cols; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < n_used; ++j) {
            const int pair = t * n_used + j;
            acc = __fadd_rn(acc, __fmul_rn(ys[(size_t)place_of[pair] * n_cols + c], weights[pair]));
        }
        y[(size_t)t * n_cols + c] = acc;
    }
}

#define MOE_KERNELS(name, B)                                                                                    \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * WARP)                                              \
        stacked_matvec_##name(const uint8_t* W, int64_t matrix_bytes, const int* ids, const float* x, float* y, \
                              int n_rows, int n_cols, int n_slots, int x_stride, int x_slot_stride) {          \
        follow_previous_kernel();                                                                              \
        stacked_matvec<B>(W, matrix_bytes, ids, x, y, n_rows, n_cols, n_slots, x_stride, x_slot_stride);        \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * WARP)                                              \
        experts_down_##name(const uint8_t* W, int64_t matrix_bytes, const int* ids, const float* weights,       \
                            const float* h, float* y, int n_rows, int n_cols, int n_used) {                     \
        follow_previous_kernel();                                                                               \
        experts_down<B>(W, matrix_bytes, ids, weights, h, y, n_rows, n_cols, n_used);                           \
    }
KERNEL_TYPES(MOE_KERNELS)
#undef MOE_KERNELS
