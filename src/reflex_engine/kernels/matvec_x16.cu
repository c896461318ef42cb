// Decode matmul through integer dot products, as ggml's mmvq but with int16 x: quantize_x16 (or the op
// that made x: x16.cuh) turns x into blocks of 32 int16 with a float scale once, then matvec_x16_<type>
// multiplies the weights' integer quants (as signed bytes) with them two at a time (__dp2a_lo/hi) and
// applies the block scales and mins in float once per 16 elements. x costs 2.25 bytes an element instead
// of 4, and no quant becomes a float. Result: W_deq · x_deq, x_deq being x as its int16 blocks give it
// back (float rounding apart). Not int8 x (ggml's q8_1, __dp4a): on the tiny goldens (tests/goldens)
// its rounding moves logits by 0.7-2.8% of their range, past CUDA's 5e-3; int16's by 1e-4.
#include "common.cuh"
#include "quant_blocks.cuh"
#include "rope.cuh"
#include "x16.cuh"

constexpr int X16_MAX_TOKENS = 8;
constexpr int X16_THREADS = 128;  // the most a block may have
constexpr int X16_ROWS = 2;  // rows a block of a pass of 8 tokens computes, sharing each x block it loads
// rows a block of one token's matvec computes: with 2, a 4,096-column row is one unit a thread, each
// block one round trip to memory, and the blocks' waves bound the time (H200, 8B Q4_K_M: 1.2-1.4 TB/s;
// with 4: 1.6-2.2 TB/s, decode 234 -> 292 tok/s; with 8, 117 registers and 3 blocks an SM: 292)
constexpr int X16_DECODE_ROWS = 4;
constexpr int X16_DECODE_BLOCKS_AN_SM = 6;  // matvec_x16_1_<type>'s launch bounds (below)
constexpr int X16_DECODE_BLOCKS_AN_SM_64R = 8;  // but Q8_0's and matvec_x16_1w_q6_K's, in 64 registers without spilling
constexpr int X16_AHEAD = 2;  // passes over the rows whose weights are requested before they are read

// x (n_tok, n_cols) to its int16 blocks (x16.cuh), n = n_tok·n_cols elements.
// LAUNCH: block = 256; grid.x = ceil(n / 1024). 8 threads a block, 4 elements each; n a multiple of 32.
extern "C" __global__ void __launch_bounds__(256) quantize_x16(const float* __restrict__ x, uint8_t* __restrict__ xq,
                                                              float2* __restrict__ xds, int n) {
    follow_previous_kernel();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;  // elements 4i..4i+3
    const bool in = 4 * i < n;
    const float4 v = in ? reinterpret_cast<const float4*>(x)[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    store_x16<4>({v.x, v.y, v.z, v.w}, in, i, xq, xds);
}

// Asks L2 for unit u's bytes (its share of the row: for the K types the unit's block), as matvec.cu does.
template <class B>
__device__ __forceinline__ void prefetch_unit(const uint8_t* row, int u, int n_units) {
    if (u < n_units)
        prefetch_l2(row + (size_t)u * 32 * sizeof(B) / B::elems);
}

// The thread's share of rows r0.. r0 + ROWS - 1 of x_deq · Wᵀ for n_tok tokens, times weight, added to acc
// (store_row_sums sums the shares); every thread of the block calls it, and it waits for the kernel before
// (follow_previous_kernel) once the thread's first unit of weights, which no kernel writes, is asked for: a
// block launched while that kernel runs has them in flight meanwhile.
template <class B, int ROWS, int TOKENS>
__device__ __forceinline__ void add_x16_dots(const uint8_t* __restrict__ W, const uint8_t* __restrict__ xq,
                                            const float2* __restrict__ xds, int r0, int n_rows, int n_cols, int n_tok,
                                            float weight, float (&acc)[ROWS][TOKENS]) {
    using T = x16_type<B>;
    const int n_units = n_cols / 32;
    const uint8_t* rows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)  // rows past n_rows re-read the last one and are never stored
        rows[r] = W + (size_t)min(r0 + r, n_rows - 1) * row_bytes<B>(n_cols);

#pragma unroll
    for (int k = 1; k < X16_AHEAD; ++k)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) prefetch_unit<B>(rows[r], threadIdx.x + k * blockDim.x, n_units);
    x16_unit w[ROWS];
    if (threadIdx.x < n_units)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) T::load(rows[r], threadIdx.x, w[r]);
    follow_previous_kernel();
    for (int u = threadIdx.x; u < n_units; u += blockDim.x) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            prefetch_unit<B>(rows[r], u + X16_AHEAD * blockDim.x, n_units);
            if (u != threadIdx.x) T::load(rows[r], u, w[r]);
        }
        int k0, k1;
        T::runs(u, k0, k1);
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) {
            if (t >= n_tok) break;
            const size_t at = (size_t)t * n_cols;
            uint32_t xa[8], xb[8];
            x_words(xq + 2 * (at + k0), xa);
            x_words(xq + 2 * (at + k1), xb);
            const float2 da = __ldg(xds + (at + k0) / 32), db = T::one_block ? da : __ldg(xds + (at + k1) / 32);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[r][t] = fmaf(weight, w[r].template dot<T::has_min>(xa, xb, da, db), acc[r][t]);
        }
        clock_step((u - threadIdx.x) / blockDim.x, true);
    }
}

// Rows r0.. r0 + ROWS - 1 of y (+ add) = x_deq · Wᵀ for n_tok tokens; every thread of the block calls it.
// x_sums: x is a norm's output (x16.cuh NormOut), its sums there.
template <class B, int ROWS, int TOKENS>
__device__ __forceinline__ void matvec_x16(const uint8_t* __restrict__ W, const uint8_t* __restrict__ xq,
                                          const float2* __restrict__ xds, float* __restrict__ y, const float* __restrict__ add,
                                          int r0, int n_rows, int n_cols, int n_tok, const float* x_sums = nullptr,
                                          float eps = 0.0f) {
    __shared__ float partial[X16_THREADS / WARP][ROWS][TOKENS];
    float acc[ROWS][TOKENS] = {};
    add_x16_dots<B, ROWS, TOKENS>(W, xq, xds, r0, n_rows, n_cols, n_tok, 1.0f, acc);
    store_row_sums(acc, partial, y, r0, n_rows, n_tok, add, x_sums ? norm_scale(x_sums, n_cols, eps) : 1.0f);
}

// One token's rows of the launch's weights (matvec_x16_1_<type> below), a block X16_DECODE_ROWS of them; then by
// warp 0 the next norm's share (norm.w) and q and k's rope (rope; where v is the launch's one weight, the blocks
// past its rows rope a head each).
template <class B>
__device__ __forceinline__ void matvec_x16_decode(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2,
                                                  const uint8_t* xq, const float2* xds, float* y0, float* y1, float* y2,
                                                  const float* add, int rows0, int rows1, int rows2, int n_cols,
                                                  const float* x_sums, float eps, const NormOut& norm, const RopeOut* rope) {
    const BlockClock clocked;
    int u = blockIdx.x;
    const int v_blocks = (rows0 + X16_DECODE_ROWS - 1) / X16_DECODE_ROWS;
    if (rope && !rope->tickets && u >= v_blocks) {
        follow_previous_kernel();
        if (threadIdx.x < WARP) rope_head(*rope, u - v_blocks);
        return;
    }
    const int i = fused_part(u, X16_DECODE_ROWS, rows0, rows1);
    if (threadIdx.x < WARP) ask_l2_for_store_reads(i == 0 ? add : nullptr, norm.w, u * X16_DECODE_ROWS);
    matvec_x16<B, X16_DECODE_ROWS, 1>(pick(i, W0, W1, W2), xq, xds, pick(i, y0, y1, y2), i == 0 ? add : nullptr,
                                      u * X16_DECODE_ROWS, pick(i, rows0, rows1, rows2), n_cols, 1, x_sums, eps);
    if (threadIdx.x >= WARP) return;  // warp 0 stored the block's rows, lane r row r0 + r
    const int r0 = u * X16_DECODE_ROWS;
    if (norm.w) store_normed_when_whole<X16_DECODE_ROWS>(y0, r0, norm);
    if (!rope) return;
    const float v = threadIdx.x < X16_DECODE_ROWS ? pick(i, y0, y1, y2)[r0 + threadIdx.x] : 0.0f;
    const int h = rope_after_store<X16_DECODE_ROWS>(*rope, i, r0, pick(i, rows0, rows1, rows2), v);
    if (h >= 0) rope_head(*rope, h);
}

// y_i (n_tok, rows_i) = x_deq · W_iᵀ for the launch's weights (common.cuh fused_part; + add, as y0, where not
// null: the residual stream, given with one weight only), from quantize_x16's xq and xds of x (n_tok,
// n_cols), in passes of 8 tokens, one a blockIdx.y. A block computes X16_ROWS (2) rows; its threads stride
// together over the rows' 32-element units.
// LAUNCH: block = 32 · min(4, ceil(n_cols / 1024)) threads (a multiple of 32, at most X16_THREADS);
// grid = (Σ ceil(rows_i / X16_ROWS), ceil(n_tok / 8)); n_cols a multiple of the type's block. 5 blocks an SM, as matvec.cu.
// matvec_x16_1_<type>: the same for one token, X16_DECODE_ROWS rows a block; grid = Σ ceil(rows_i / X16_DECODE_ROWS);
// 6 blocks an SM, 80 registers: left to itself ptxas took 80-114 by type, and 4-5 blocks (H200, Qwen3-8B Q4_K_M
// decode 416.4 tok/s at 6 against 413.6, docs/perf-notes.md run 17). Q8_0's 8, 64 registers without spilling: 8B
// Q8_0's 1,024-block launches then fit the SMs at once (decode 314.6 / 314.9 tok/s against 304.1 / 304.2, run 18);
// at 8 the K types spilled, and 8B Q4_K_M's Q6_K rows lost 1%. matvec_x16_1w_q6_K: Q6_K's at 8 an SM, spill-free too,
// for launches that only then fit the SMs at once (8B's Q6_K downs: 1,024 blocks), so that they may write the next norm's
// share (ops.py: one wave or no norm); every Q6_K launch at 8 lost 4% on 0.6B Q4_K_M (docs/perf-notes.md run 32).
// It may read a norm's output (x_sums, eps) and, with one weight of whole groups of 32 rows, write the next
// norm's share (norm_w ...: x16.cuh NormOut); before its wait it asks L2 for what its store reads at the end.
#define MATVEC_X16_1_KERNEL(suffix, B, blocks)                                                              \
    extern "C" __global__ void __launch_bounds__(X16_THREADS, blocks)                                       \
        matvec_x16_1##suffix(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, const uint8_t* xq, const float2* xds, \
               float* y0, float* y1, float* y2, const float* add, int rows0, int rows1, int rows2, int n_cols, \
               const float* x_sums, float eps, const float* norm_w, uint8_t* norm_xq, float2* norm_xds,     \
               float* norm_sums, int* tickets) {                                                            \
        matvec_x16_decode<B>(W0, W1, W2, xq, xds, y0, y1, y2, add, rows0, rows1, rows2, n_cols, x_sums, eps, \
                             {norm_w, norm_xq, norm_xds, norm_sums, tickets}, nullptr);                     \
    }
// matvec_x16_1_rope_<type>: the same with q and k's rope and the cache's writes (rope.cuh RopeOut), for a one-token
// pass's launch making v (grid: + the heads of q and k where v is its one weight): a kernel of its own, since that
// code took the 64-register kernels to spilling.
#define MATVEC_X16_1_ROPE_KERNEL(name, B, blocks)                                                           \
    extern "C" __global__ void __launch_bounds__(X16_THREADS, blocks)                                       \
        matvec_x16_1_rope_##name(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, const uint8_t* xq, \
                                 const float2* xds, float* y0, float* y1, float* y2, int rows0, int rows1,   \
                                 int rows2, int n_cols, const float* x_sums, float eps, ROPE_OUT_PARAMS) {   \
        const RopeOut rope = ROPE_OUT;                                                                      \
        matvec_x16_decode<B>(W0, W1, W2, xq, xds, y0, y1, y2, nullptr, rows0, rows1, rows2, n_cols, x_sums, eps, {}, \
                             &rope);                                                                        \
    }
#define MATVEC_X16_KERNEL(name, B, blocks)                                                                  \
    extern "C" __global__ void __launch_bounds__(X16_THREADS, 5)                                            \
        matvec_x16_##name(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, const uint8_t* xq,       \
                          const float2* xds, float* y0, float* y1, float* y2, const float* add, int rows0,  \
                          int rows1, int rows2, int n_cols, int n_tok) {                                    \
        int u = blockIdx.x;                                                                                 \
        const int i = fused_part(u, X16_ROWS, rows0, rows1), n_rows = pick(i, rows0, rows1, rows2);         \
        const size_t t0 = (size_t)blockIdx.y * X16_MAX_TOKENS;                                              \
        matvec_x16<B, X16_ROWS, X16_MAX_TOKENS>(pick(i, W0, W1, W2), xq + 2 * t0 * n_cols, xds + t0 * n_cols / 32, \
                                                pick(i, y0, y1, y2) + t0 * n_rows,                          \
                                                add && i == 0 ? add + t0 * n_rows : nullptr, u * X16_ROWS,  \
                                                n_rows, n_cols, min(X16_MAX_TOKENS, n_tok - (int)t0));      \
    }                                                                                                       \
    MATVEC_X16_1_KERNEL(_##name, B, blocks)
// A decode pass's experts (moe.cu's stacked_matvec and experts_down over int16 x): y_i (n_tok, n_slots, n_rows)
// for one or two stacked weights W_i of one shape (W1 null: one), block y = i · n_tok · n_slots + t · n_slots + j
// computing X16_DECODE_ROWS rows of matrix ids[t, j] of W_i (matrix_bytes apart) times x's row t (x_sums, eps: a
// norm's output, its one token). experts_down_x16: y (n_tok, n_rows) = (add +) Σ_j weights[t, j] · W_{ids[t, j]}
// h[t, j], h (n_tok, n_used, n_cols) as int16 blocks; slots in order, each thread's shares weighted as they are
// added, so the sum is the same on every call.
// LAUNCH: block as matvec_x16_1_<type>; grid = (ceil(n_rows / X16_DECODE_ROWS), weights · n_tok · n_slots) or,
// experts_down_x16, n_tok.
#define EXPERTS_X16_KERNELS(name, B, blocks)                                                                \
    extern "C" __global__ void __launch_bounds__(X16_THREADS, blocks)                                       \
        stacked_matvec_x16_##name(const uint8_t* W0, const uint8_t* W1, int64_t matrix_bytes, const int* ids, \
                                  const uint8_t* xq, const float2* xds, float* y0, float* y1, int n_rows,    \
                                  int n_cols, int n_slots, const float* x_sums, float eps) {                \
        follow_previous_kernel(); /* the router's choice first: which weights to ask for */                 \
        const int pairs = W1 ? gridDim.y / 2 : gridDim.y, i = blockIdx.y / pairs, slot = blockIdx.y % pairs; \
        const size_t t = slot / n_slots;                                                                    \
        matvec_x16<B, X16_DECODE_ROWS, 1>((i ? W1 : W0) + ids[slot] * matrix_bytes, xq + 2 * t * n_cols,   \
                                          xds + t * n_cols / 32, (i ? y1 : y0) + (size_t)slot * n_rows, nullptr, \
                                          blockIdx.x * X16_DECODE_ROWS, n_rows, n_cols, 1, x_sums, eps);    \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(X16_THREADS, blocks)                                       \
        experts_down_x16_##name(const uint8_t* W, int64_t matrix_bytes, const int* ids, const float* weights, \
                                const uint8_t* xq, const float2* xds, const float* add, float* y, int n_rows,  \
                                int n_cols, int n_used) {                                                   \
        follow_previous_kernel();                                                                           \
        __shared__ float partial[X16_THREADS / WARP][X16_DECODE_ROWS][1];                                   \
        const int r0 = blockIdx.x * X16_DECODE_ROWS;                                                        \
        float acc[X16_DECODE_ROWS][1] = {};                                                                 \
        for (int j = 0; j < n_used; ++j) {                                                                  \
            const size_t slot = (size_t)blockIdx.y * n_used + j;                                            \
            add_x16_dots<B, X16_DECODE_ROWS, 1>(W + ids[slot] * matrix_bytes, xq + 2 * slot * n_cols,       \
                                                xds + slot * n_cols / 32, r0, n_rows, n_cols, 1, weights[slot], acc); \
        }                                                                                                   \
        store_row_sums(acc, partial, y + (size_t)blockIdx.y * n_rows, r0, n_rows, 1,                        \
                       add ? add + (size_t)blockIdx.y * n_rows : nullptr);                                  \
    }
#define X16_KERNELS(name, B, blocks) \
    MATVEC_X16_KERNEL(name, B, blocks) MATVEC_X16_1_ROPE_KERNEL(name, B, blocks) EXPERTS_X16_KERNELS(name, B, blocks)
X16_KERNELS(q4_0, block_q4_0, X16_DECODE_BLOCKS_AN_SM)
X16_KERNELS(q5_0, block_q5_0, X16_DECODE_BLOCKS_AN_SM)
X16_KERNELS(q8_0, block_q8_0, X16_DECODE_BLOCKS_AN_SM_64R)
X16_KERNELS(q4_K, block_q4_K, X16_DECODE_BLOCKS_AN_SM)
X16_KERNELS(q5_K, block_q5_K, X16_DECODE_BLOCKS_AN_SM)
X16_KERNELS(q6_K, block_q6_K, X16_DECODE_BLOCKS_AN_SM)
MATVEC_X16_1_KERNEL(w_q6_K, block_q6_K, X16_DECODE_BLOCKS_AN_SM_64R)
#undef X16_KERNELS
#undef EXPERTS_X16_KERNELS
#undef MATVEC_X16_KERNEL
#undef MATVEC_X16_1_KERNEL
#undef MATVEC_X16_1_ROPE_KERNEL
