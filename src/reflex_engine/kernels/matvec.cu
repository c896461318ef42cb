// Decode matmul: y (n_tok, n_rows) = x (n_tok, n_cols) · Wᵀ for up to 8 tokens a pass, W in GGUF blocks.
// A block computes MATVEC_ROWS rows. Its threads stride together over the rows' 16-element pieces
// (B::piece), so each warp reads one contiguous run of a row's blocks and of x at a time; every
// piece is unpacked once and used for every token, its scale (and min) applied once per token to
// the piece's dot product. x is read through L1, which the blocks on an SM share, and no barrier
// is met until the warps' sums are added at the end.
// LAUNCH: block = any multiple of 32 up to MATVEC_THREADS (128): 32 · min(4, ceil(n_cols / 512))
// leaves no thread without a piece on narrow rows; grid.x = ceil(n_rows / MATVEC_ROWS) (MATVEC_ROWS = 2),
// grid.y = ceil(n_tok / 8).
#include "common.cuh"
#include "quant_blocks.cuh"

constexpr int MATVEC_MAX_TOKENS = 8;
constexpr int MATVEC_THREADS = 128;  // the most a block may have
constexpr int MATVEC_ROWS = 2;  // rows a block computes, sharing each x piece it loads
constexpr int MATVEC_PIECE = 16;  // elements a thread unpacks at a time (B::piece)
constexpr int MATVEC_AHEAD = 2;  // passes over the rows whose weights are requested before they are read

// Asks L2 for the bytes of piece p of a row (its share of the row, for the block types), so a
// thread has more than its current pass in flight without holding registers for it.
template <class B>
__device__ __forceinline__ void prefetch_piece(const uint8_t* row, int p, int n_pieces) {
    if (p < n_pieces)
        prefetch_l2(row + (size_t)p * MATVEC_PIECE * sizeof(B) / B::elems);
}

// x[k0..k0+15] of one token's row, 0 past n_cols.
__device__ __forceinline__ void x_piece(const float* __restrict__ x_row, int k0, int n_cols, float v[MATVEC_PIECE]) {
    const float* at = x_row + k0;
    if (k0 + MATVEC_PIECE <= n_cols && reinterpret_cast<uintptr_t>(at) % 16 == 0) {
#pragma unroll
        for (int i = 0; i < MATVEC_PIECE / 4; ++i) {
            const float4 a = __ldg(reinterpret_cast<const float4*>(at) + i);
            v[4 * i] = a.x, v[4 * i + 1] = a.y, v[4 * i + 2] = a.z, v[4 * i + 3] = a.w;
        }
    } else {  // scalar types' ragged widths
#pragma unroll
        for (int j = 0; j < MATVEC_PIECE; ++j) v[j] = k0 + j < n_cols ? __ldg(at + j) : 0.0f;
    }
}

template <class B>
__device__ __forceinline__ void matvec(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                       float* __restrict__ y, int n_rows, int n_cols, int n_tok) {
    __shared__ float partial[MATVEC_THREADS / WARP][MATVEC_ROWS][MATVEC_MAX_TOKENS];
    const int r0 = blockIdx.x * MATVEC_ROWS, n_pieces = (n_cols + MATVEC_PIECE - 1) / MATVEC_PIECE;
    const uint8_t* rows[MATVEC_ROWS];
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; ++r)  // rows past n_rows re-read the last one and are never stored
        rows[r] = W + (size_t)min(r0 + r, n_rows - 1) * row_bytes<B>(n_cols);

    float acc[MATVEC_ROWS][MATVEC_MAX_TOKENS] = {};
#pragma unroll
    for (int k = 1; k < MATVEC_AHEAD; ++k)
#pragma unroll
        for (int r = 0; r < MATVEC_ROWS; ++r) prefetch_piece<B>(rows[r], threadIdx.x + k * blockDim.x, n_pieces);
    for (int p = threadIdx.x; p < n_pieces; p += blockDim.x) {
        float q[MATVEC_ROWS][MATVEC_PIECE], d[MATVEC_ROWS], m[MATVEC_ROWS];
#pragma unroll
        for (int r = 0; r < MATVEC_ROWS; ++r) {
            prefetch_piece<B>(rows[r], p + MATVEC_AHEAD * blockDim.x, n_pieces);
            B::piece(rows[r], p, n_cols, q[r], d[r], m[r]);
        }
#pragma unroll
        for (int t = 0; t < MATVEC_MAX_TOKENS; ++t) {
            if (t >= n_tok) break;
            float xv[MATVEC_PIECE], x_sum = 0.0f;
            x_piece(x + (size_t)t * n_cols, MATVEC_PIECE * p, n_cols, xv);
            if constexpr (B::has_min) {
#pragma unroll
                for (int i = 0; i < MATVEC_PIECE; ++i) x_sum += xv[i];
            }
#pragma unroll
            for (int r = 0; r < MATVEC_ROWS; ++r) {
                float dot = 0.0f;
#pragma unroll
                for (int i = 0; i < MATVEC_PIECE; ++i) dot = fmaf(q[r][i], xv[i], dot);
                acc[r][t] = fmaf(d[r], dot, acc[r][t]);
                if constexpr (B::has_min) acc[r][t] = fmaf(m[r], x_sum, acc[r][t]);
            }
        }
    }

    store_row_sums(acc, partial, y, r0, n_rows, n_tok);
}

// 5 blocks an SM: at most 96 registers, which these kernels fit without spilling. More than 8 tokens are
// passes of 8, one a blockIdx.y (grid.y = ceil(n_tok / 8)), each reading the rows again.
#define MATVEC_KERNEL(name, B)                                                                              \
    extern "C" __global__ void __launch_bounds__(MATVEC_THREADS, 5)                                         \
        matvec_##name(const uint8_t* W, const float* x, float* y, int n_rows, int n_cols, int n_tok) {    \
        follow_previous_kernel();                                                                         \
        const int t0 = blockIdx.y * MATVEC_MAX_TOKENS;                                                      \
        matvec<B>(W, x + (size_t)t0 * n_cols, y + (size_t)t0 * n_rows, n_rows, n_cols,                     \
                  min(MATVEC_MAX_TOKENS, n_tok - t0));                                                      \
    }
KERNEL_TYPES(MATVEC_KERNEL)
#undef MATVEC_KERNEL

// A prompt's experts, each over its own tokens: expert e = blockIdx.y multiplies rows offsets[e] ..
// offsets[e + 1] - 1 of xs (the (token, slot) pairs routed to it, grouped by kernels/moe.cu's moe_group)
// into the same rows of ys, in passes of 8, so its weights are read once per 8 of its tokens rather than
// once per token. W: n_expert matrices of (n_rows, n_cols), matrix_bytes apart.
// LAUNCH: as matvec, grid = (ceil(n_rows / MATVEC_ROWS), n_expert).
#define GROUPED_MATVEC_KERNEL(name, B)                                                                       \
    extern "C" __global__ void __launch_bounds__(MATVEC_THREADS, 5)                                          \
        grouped_matvec_##name(const uint8_t* W, int64_t matrix_bytes, const int* offsets, const float* xs,   \
                              float* ys, int n_rows, int n_cols) {                                           \
        follow_previous_kernel();                                                                            \
        const int e = blockIdx.y, end = offsets[e + 1];                                                      \
        for (int a = offsets[e]; a < end; a += MATVEC_MAX_TOKENS) {                                          \
            matvec<B>(W + e * matrix_bytes, xs + (size_t)a * n_cols, ys + (size_t)a * n_rows, n_rows, n_cols, \
                      min(MATVEC_MAX_TOKENS, end - a));                                                      \
            __syncthreads();  /* the next pass rewrites matvec's partial sums */                             \
        }                                                                                                    \
    }
KERNEL_TYPES(GROUPED_MATVEC_KERNEL)
#undef GROUPED_MATVEC_KERNEL
