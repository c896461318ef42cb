// Decode matmul: y (n_tok, n_rows) = x (n_tok, n_cols) · Wᵀ for up to 8 tokens, W in GGUF blocks.
// A block computes MATVEC_ROWS rows. Its threads stride together over the rows' 8-element pieces
// (B::piece), so each warp reads one contiguous run of a row's blocks and of x at a time; every
// piece is dequantized once and used for every token. x is read through L1, which the blocks on
// an SM share, and no barrier is met until the warps' sums are added at the end.
// LAUNCH: block = MATVEC_THREADS (128), grid.x = ceil(n_rows / MATVEC_ROWS) (MATVEC_ROWS = 2).
#include "common.cuh"
#include "quant_blocks.cuh"

constexpr int MATVEC_MAX_TOKENS = 8;
constexpr int MATVEC_THREADS = 128;
constexpr int MATVEC_ROWS = 2;    // rows a block computes, sharing each x piece it loads
constexpr int MATVEC_UNROLL = 2;  // pieces a thread loads before it multiplies: more bytes in flight

// x[k0..k0+7] of one token's row, 0 past n_cols.
__device__ __forceinline__ void x_piece(const float* __restrict__ x_row, int k0, int n_cols, float v[8]) {
    const float* at = x_row + k0;
    if (k0 + 8 <= n_cols && reinterpret_cast<uintptr_t>(at) % 16 == 0) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(at)), b = __ldg(reinterpret_cast<const float4*>(at) + 1);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {  // scalar types' ragged widths
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = k0 + j < n_cols ? __ldg(at + j) : 0.0f;
    }
}

template <class B>
__device__ __forceinline__ void matvec(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                       float* __restrict__ y, int n_rows, int n_cols, int n_tok) {
    __shared__ float partial[MATVEC_THREADS / WARP][MATVEC_ROWS][MATVEC_MAX_TOKENS];
    const int r0 = blockIdx.x * MATVEC_ROWS, n_pieces = (n_cols + 7) / 8;
    const uint8_t* rows[MATVEC_ROWS];
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; ++r)  // rows past n_rows re-read the last one and are never stored
        rows[r] = W + (size_t)min(r0 + r, n_rows - 1) * row_bytes<B>(n_cols);

    float acc[MATVEC_ROWS][MATVEC_MAX_TOKENS] = {};
    for (int p0 = threadIdx.x; p0 < n_pieces; p0 += MATVEC_UNROLL * MATVEC_THREADS) {
        float w[MATVEC_UNROLL][MATVEC_ROWS][8];
#pragma unroll
        for (int u = 0; u < MATVEC_UNROLL; ++u) {
            const int p = p0 + u * MATVEC_THREADS;
#pragma unroll
            for (int r = 0; r < MATVEC_ROWS; ++r) {
                if (p < n_pieces) {
                    B::piece(rows[r], p, n_cols, w[u][r]);
                } else {
#pragma unroll
                    for (int i = 0; i < 8; ++i) w[u][r][i] = 0.0f;
                }
            }
        }
#pragma unroll
        for (int t = 0; t < MATVEC_MAX_TOKENS; ++t) {
            if (t >= n_tok) break;
#pragma unroll
            for (int u = 0; u < MATVEC_UNROLL; ++u) {
                float xv[8];
                x_piece(x + (size_t)t * n_cols, 8 * (p0 + u * MATVEC_THREADS), n_cols, xv);
#pragma unroll
                for (int r = 0; r < MATVEC_ROWS; ++r)
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[r][t] = fmaf(w[u][r][i], xv[i], acc[r][t]);
            }
        }
    }

    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
#pragma unroll
    for (int t = 0; t < MATVEC_MAX_TOKENS; ++t) {
        if (t >= n_tok) break;
#pragma unroll
        for (int r = 0; r < MATVEC_ROWS; ++r) {
            const float s = warp_sum(acc[r][t]);
            if (lane == 0) partial[warp][r][t] = s;
        }
    }
    __syncthreads();
    const int r = threadIdx.x / MATVEC_MAX_TOKENS, t = threadIdx.x % MATVEC_MAX_TOKENS;
    if (r < MATVEC_ROWS && r0 + r < n_rows && t < n_tok) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < MATVEC_THREADS / WARP; ++w) s += partial[w][r][t];
        y[(size_t)t * n_rows + r0 + r] = s;
    }
}

#define MATVEC_KERNEL(name, B)                                                                           \
    extern "C" __global__ void __launch_bounds__(MATVEC_THREADS, 6)                                       \
        matvec_##name(const uint8_t* W, const float* x, float* y, int n_rows, int n_cols, int n_tok) { \
        matvec<B>(W, x, y, n_rows, n_cols, n_tok);                                                       \
    }
KERNEL_TYPES(MATVEC_KERNEL)
#undef MATVEC_KERNEL
