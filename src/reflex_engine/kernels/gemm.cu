// Prefill matmul on tensor cores: Y (n_tok, n_rows) = X (n_tok, n_cols) · Wᵀ, W in GGUF blocks.
// A block computes 64 tokens x 64 rows, 32 columns per step: one chunk of each weight row
// dequantized (quant_blocks.cuh) and the X tile, both as half in shared memory; WMMA 16x16x16
// with float32 accumulators, so one code path serves sm_75 and newer.
// LAUNCH: block = 128, grid = (ceil(n_rows / 64), ceil(n_tok / 64)).
#include <mma.h>
#include "common.cuh"
#include "quant_blocks.cuh"

constexpr int GEMM_TILE = 64;
constexpr int GEMM_LDH = 32 + 8;          // halves per staged row: 16-byte row shifts avoid bank conflicts
constexpr int GEMM_LDO = GEMM_TILE + 4;   // floats per row of the output staging tile

struct GemmSmem {
    union {
        struct {
            __half x[GEMM_TILE][GEMM_LDH];  // [token][k]
            __half w[GEMM_TILE][GEMM_LDH];  // [row][k]: Wᵀ as a column-major matrix_b
        } in;
        float out[GEMM_TILE][GEMM_LDO];  // after the last step
    };
};

__device__ __forceinline__ uint32_t gemm_pack(float lo, float hi) {
    return __half_as_ushort(__float2half_rn(lo)) | (uint32_t)__half_as_ushort(__float2half_rn(hi)) << 16;
}

// Threads 0-63 each hold chunk c of weight row row0 + tid; threads 64-127 hold 16 column pairs
// of X: pair i is token 4i + u/16, columns 2(u%16), +1 of the step (u = tid - 64), so that each
// warp's loads are two contiguous 128-byte token rows.
template <class B>
__device__ __forceinline__ void gemm_load(const uint8_t* W, const float* X, int n_rows, int n_cols, int n_tok,
                                          int row0, int tok0, int c, float v[32]) {
    const int tid = threadIdx.x;
    if (tid < GEMM_TILE) {
        if (row0 + tid < n_rows) {
            B::chunk(W + (size_t)(row0 + tid) * row_bytes<B>(n_cols), c, n_cols, v);
        } else {
#pragma unroll
            for (int j = 0; j < 32; ++j) v[j] = 0.0f;
        }
    } else {
        const int u = tid - GEMM_TILE, k = 32 * c + 2 * (u % 16);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const int t = tok0 + 4 * i + u / 16;
            const float* xr = X + (size_t)t * n_cols;
            v[2 * i] = t < n_tok && k < n_cols ? xr[k] : 0.0f;
            v[2 * i + 1] = t < n_tok && k + 1 < n_cols ? xr[k + 1] : 0.0f;
        }
    }
}

__device__ __forceinline__ void gemm_store(GemmSmem& sm, const float v[32]) {
    const int tid = threadIdx.x;
    if (tid < GEMM_TILE) {
        uint4* dst = reinterpret_cast<uint4*>(sm.in.w[tid]);
#pragma unroll
        for (int q = 0; q < 4; ++q)
            dst[q] = make_uint4(gemm_pack(v[8 * q], v[8 * q + 1]), gemm_pack(v[8 * q + 2], v[8 * q + 3]),
                                gemm_pack(v[8 * q + 4], v[8 * q + 5]), gemm_pack(v[8 * q + 6], v[8 * q + 7]));
    } else {
        const int u = tid - GEMM_TILE;
#pragma unroll
        for (int i = 0; i < 16; ++i)
            *reinterpret_cast<uint32_t*>(&sm.in.x[4 * i + u / 16][2 * (u % 16)]) = gemm_pack(v[2 * i], v[2 * i + 1]);
    }
}

template <class B>
__device__ __forceinline__ void gemm(const uint8_t* __restrict__ W, const float* __restrict__ X,
                                     float* __restrict__ Y, int n_rows, int n_cols, int n_tok) {
    using namespace nvcuda;
    __shared__ __align__(32) GemmSmem sm;
    const int row0 = blockIdx.x * GEMM_TILE, tok0 = blockIdx.y * GEMM_TILE;
    const int warp = threadIdx.x / WARP, wt = warp / 2 * 32, wr = warp % 2 * 32;  // the warp's 32x32 of the tile
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

    const int n_chunks = (n_cols + 31) / 32;
    float v[32];
    gemm_load<B>(W, X, n_rows, n_cols, n_tok, row0, tok0, 0, v);
    for (int c = 0; c < n_chunks; ++c) {
        __syncthreads();  // the previous step's fragments are loaded
        gemm_store(sm, v);
        __syncthreads();
        if (c + 1 < n_chunks) gemm_load<B>(W, X, n_rows, n_cols, n_tok, row0, tok0, c + 1, v);  // in flight during the MMAs
#pragma unroll
        for (int kk = 0; kk < 32; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(a[i], &sm.in.x[wt + 16 * i][kk], GEMM_LDH);
#pragma unroll
            for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(b[j], &sm.in.w[wr + 16 * j][kk], GEMM_LDH);
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
    }

    __syncthreads();  // out overlays the inputs
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
            wmma::store_matrix_sync(&sm.out[wt + 16 * i][wr + 16 * j], acc[i][j], GEMM_LDO, wmma::mem_row_major);
    __syncthreads();
    for (int i = threadIdx.x; i < GEMM_TILE * GEMM_TILE; i += blockDim.x) {
        const int t = i / GEMM_TILE, r = i % GEMM_TILE;
        if (tok0 + t < n_tok && row0 + r < n_rows) Y[(size_t)(tok0 + t) * n_rows + row0 + r] = sm.out[t][r];
    }
}

// min 4 blocks per SM caps registers at 128 (no spills) where ptxas would take ~165
#define GEMM_KERNEL(name, B)                                                                           \
    extern "C" __global__ void __launch_bounds__(2 * GEMM_TILE, 4)                                     \
        gemm_##name(const uint8_t* W, const float* X, float* Y, int n_rows, int n_cols, int n_tok) { \
        follow_previous_kernel();                                                                    \
        gemm<B>(W, X, Y, n_rows, n_cols, n_tok);                                                       \
    }
KERNEL_TYPES(GEMM_KERNEL)
#undef GEMM_KERNEL
