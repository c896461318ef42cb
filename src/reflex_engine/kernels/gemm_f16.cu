// Long-prompt matmul: the weight rows dequantized to f16 once per pass (dequant_f16_*), then a
// tiled f16 tensor-core GEMM over them (gemm_f16). The fused kernel (gemm.cu) dequantizes every
// weight again for each 64-token tile; from a few hundred tokens on, one dequantization and a
// GEMM with larger tiles and a copy pipeline does far less work per token.

#include <mma.h>
#include "common.cuh"
#include "quant_blocks.cuh"

// Rows row0..row0+n_rows-1 of a (.., n_cols) GGUF matrix as f16, row-major. One thread per
// 32-element chunk. LAUNCH: block = 256, grid = ceil(n_rows * n_cols / 32 / 256); n_cols % 32 == 0.
template <class B>
__device__ __forceinline__ void dequant_f16(const uint8_t* __restrict__ W, __half* __restrict__ out, int row0,
                                            int n_rows, int n_cols) {
    const int chunks = n_cols / 32;
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)n_rows * chunks) return;
    const int r = (int)(idx / chunks), c = (int)(idx % chunks);
    float v[32];
    B::chunk(W + (size_t)(row0 + r) * row_bytes<B>(n_cols), c, n_cols, v);
    uint4* dst = reinterpret_cast<uint4*>(out + (size_t)r * n_cols + 32 * c);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        __half2 h[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) h[j] = __floats2half2_rn(v[8 * q + 2 * j], v[8 * q + 2 * j + 1]);
        dst[q] = *reinterpret_cast<uint4*>(h);
    }
}

#define DEQUANT_KERNEL(name, B)                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                                    \
        dequant_f16_##name(const uint8_t* W, __half* out, int row0, int n_rows, int n_cols) {            \
        follow_previous_kernel();                                                                        \
        dequant_f16<B>(W, out, row0, n_rows, n_cols);                                                    \
    }
KERNEL_TYPES(DEQUANT_KERNEL)
#undef DEQUANT_KERNEL

// Y[t][r] (row stride ldy) = sum_k X[t][k] W[r][k] for t < n_tok, r < n_rows; X float32
// (n_tok, K), W f16 (n_rows, K), K % 32 == 0. A block computes BM tokens x BN rows in steps of
// 32 columns: W's tile arrives by cp.async into one of two shared-memory stages while the other
// is multiplied; X's tile is loaded into registers during the multiply and converted to f16
// when stored. WM x WN warps, each (BM / WM) tokens x (BN / WN) rows of WMMA 16x16x16 tiles with
// f32 accumulators. Two shapes: 128 x 128 (8 warps) for large grids, 64 x 64 (4 warps) so that
// small matrices still give every SM blocks.
// LAUNCH: block = 32 * WM * WN, grid = (ceil(n_rows / BN), ceil(n_tok / BM)).
constexpr int GF_BK = 32;
constexpr int GF_LD = GF_BK + 8;  // halves per staged row: a 16-byte shift a row keeps banks apart
constexpr int GF_OUT_LD = 16 + 4;  // floats per row of a warp's output staging tile

template <int BM, int BN, int NW>
struct GemmF16Smem {
    union {
        struct {
            __half x[2][BM][GF_LD];  // [stage][token][k]
            __half w[2][BN][GF_LD];  // [stage][row][k]: Wᵀ as a column-major matrix_b
        } in;
        float out[NW][16][GF_OUT_LD];  // per warp, one 16x16 result at a time
    };
};

// 16 bytes global -> shared, asynchronous from sm_80 on (a plain copy before, where the waits
// below have nothing to wait for).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
#if __CUDA_ARCH__ >= 800
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
    const int n = valid ? 16 : 0;  // 0: fill the 16 bytes with zeros, read nothing
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(n));
#else
    *reinterpret_cast<uint4*>(smem) = valid ? *reinterpret_cast<const uint4*>(gmem) : make_uint4(0, 0, 0, 0);
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int BM, int BN, int WM, int WN>
__device__ __forceinline__ void gemm_f16_tile(const __half* __restrict__ W, const float* __restrict__ X,
                                              float* __restrict__ Y, int n_rows, int K, int n_tok, int ldy) {
    using namespace nvcuda;
    constexpr int NT = 32 * WM * WN, FM = BM / WM / 16, FN = BN / WN / 16;
    constexpr int W_PER_THREAD = BN * 4 / NT, X_PER_THREAD = BM * 8 / NT;  // 16-byte pieces
    static_assert(BN * 4 % NT == 0 && BM * 8 % NT == 0 && FM > 0 && FN > 0, "tile shape");
    __shared__ __align__(128) GemmF16Smem<BM, BN, WM * WN> sm;
    const int row0 = blockIdx.x * BN, tok0 = blockIdx.y * BM;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int wt = warp / WN * (BM / WM), wr = warp % WN * (BN / WN);  // the warp's part of the tile

    auto load_w = [&](int stage, int k0) {
#pragma unroll
        for (int j = 0; j < W_PER_THREAD; ++j) {  // BN rows x 4 pieces of 8 halves
            const int i = threadIdx.x + NT * j, r = i / 4, c = i % 4;
            const bool valid = row0 + r < n_rows;
            cp_async16(&sm.in.w[stage][r][8 * c], W + (size_t)(valid ? row0 + r : 0) * K + k0 + 8 * c, valid);
        }
        cp_async_commit();
    };
    float4 xv[X_PER_THREAD];
    auto load_x = [&](int k0) {
#pragma unroll
        for (int j = 0; j < X_PER_THREAD; ++j) {  // BM tokens x 8 float4
            const int i = threadIdx.x + NT * j, t = i / 8, c = i % 8;
            xv[j] = tok0 + t < n_tok ? *reinterpret_cast<const float4*>(X + (size_t)(tok0 + t) * K + k0 + 4 * c)
                                     : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    auto store_x = [&](int stage) {
#pragma unroll
        for (int j = 0; j < X_PER_THREAD; ++j) {
            const int i = threadIdx.x + NT * j, t = i / 8, c = i % 8;
            __half2* dst = reinterpret_cast<__half2*>(&sm.in.x[stage][t][4 * c]);
            dst[0] = __floats2half2_rn(xv[j].x, xv[j].y);
            dst[1] = __floats2half2_rn(xv[j].z, xv[j].w);
        }
    };

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[FM][FN];
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

    const int n_steps = K / GF_BK;
    load_w(0, 0);
    load_x(0);
    store_x(0);
    for (int s = 0; s < n_steps; ++s) {
        const int cur = s % 2;
        const bool more = s + 1 < n_steps;
        if (more) {  // the next step's tiles travel while this one is multiplied
            load_w(cur ^ 1, (s + 1) * GF_BK);
            load_x((s + 1) * GF_BK);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // this step's W (every thread's copies) and X are in shared memory
#pragma unroll
        for (int kk = 0; kk < GF_BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a[FM];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b[FN];
#pragma unroll
            for (int i = 0; i < FM; ++i) wmma::load_matrix_sync(a[i], &sm.in.x[cur][wt + 16 * i][kk], GF_LD);
#pragma unroll
            for (int j = 0; j < FN; ++j) wmma::load_matrix_sync(b[j], &sm.in.w[cur][wr + 16 * j][kk], GF_LD);
#pragma unroll
            for (int i = 0; i < FM; ++i)
#pragma unroll
                for (int j = 0; j < FN; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
        __syncthreads();  // every warp is done with stage cur before it is overwritten
        if (more) store_x(cur ^ 1);
    }

    // out overlays the inputs: the loop's last barrier has passed and no copy is pending
    float(*stage)[GF_OUT_LD] = sm.out[warp];
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j) {
            wmma::store_matrix_sync(&stage[0][0], acc[i][j], GF_OUT_LD, wmma::mem_row_major);
            __syncwarp();
            const int t = lane / 2, c0 = (lane % 2) * 8;
            const int tok = tok0 + wt + 16 * i + t, row = row0 + wr + 16 * j + c0;
            if (tok < n_tok) {
#pragma unroll
                for (int c = 0; c < 8; ++c)
                    if (row + c < n_rows) Y[(size_t)tok * ldy + row + c] = stage[t][c0 + c];
            }
            __syncwarp();
        }
}

extern "C" __global__ void __launch_bounds__(256)
gemm_f16_128(const __half* W, const float* X, float* Y, int n_rows, int K, int n_tok, int ldy) {
    follow_previous_kernel();
    gemm_f16_tile<128, 128, 2, 4>(W, X, Y, n_rows, K, n_tok, ldy);
}

extern "C" __global__ void __launch_bounds__(128)
gemm_f16_64(const __half* W, const float* X, float* Y, int n_rows, int K, int n_tok, int ldy) {
    follow_previous_kernel();
    gemm_f16_tile<64, 64, 2, 2>(W, X, Y, n_rows, K, n_tok, ldy);
}
