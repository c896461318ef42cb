// Long-prompt matmul: the weight rows dequantized to f16 once per pass (dequant_f16_*), x rounded
// to f16 once (to_f16), then a tiled f16 tensor-core GEMM over them (gemm_f16). The fused kernel
// (gemm.cu) dequantizes every weight again for each 32-token tile; from ~128 tokens on, one
// dequantization and a GEMM with large tiles and a copy pipeline does far less work per token.

#include "common.cuh"
#include "mma.cuh"
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
    for (int q = 0; q < 4; ++q) dst[q] = pack_half8(v + 8 * q);
}

#define DEQUANT_KERNEL(name, B)                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                                    \
        dequant_f16_##name(const uint8_t* W, __half* out, int row0, int n_rows, int n_cols) {            \
        follow_previous_kernel();                                                                        \
        dequant_f16<B>(W, out, row0, n_rows, n_cols);                                                    \
    }
KERNEL_TYPES(DEQUANT_KERNEL)
#undef DEQUANT_KERNEL

// x (n values) as f16, for the GEMM's A operand. LAUNCH: block = 256, grid = ceil(n / 1024).
extern "C" __global__ void __launch_bounds__(256) to_f16(const float4* __restrict__ x, uint2* __restrict__ out, long long n) {
    follow_previous_kernel();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // four values a thread
    if (4 * i + 3 < n) {
        const float4 v = x[i];
        out[i] = make_uint2(pack_half2(v.x, v.y), pack_half2(v.z, v.w));
    } else if (4 * i < n) {
        const float* xs = reinterpret_cast<const float*>(x);
        __half* os = reinterpret_cast<__half*>(out);
        for (long long j = 4 * i; j < n; ++j) os[j] = __float2half_rn(xs[j]);
    }
}

// Y[t][r] (row stride ldy) = sum_k X[t][k] W[r][k] (+ add[t][r], same stride, where given: the
// residual stream) for t < n_tok, r < n_rows; X (n_tok, K) and W
// (n_rows, K) f16, K % 32 == 0. A block computes BM tokens x BN rows in steps of 32 columns: both
// tiles arrive by cp.async in a ring of GF_STAGES shared-memory stages, two steps ahead of the one
// being multiplied. WM x WN warps, each (BM / WM) tokens x (BN / WN) rows of mma.m16n8k16 tiles
// (X the A operand, W the B one, both through ldmatrix) with f32 accumulators. Stage rows are 64
// bytes, four 16-byte chunks; chunk j of row i is stored at j ^ (i / 2 % 4), so the eight rows an
// ldmatrix reads at one chunk fall in eight distinct bank groups. Two shapes: 128 x 128 (8 warps)
// for large grids, 64 x 64 (4 warps) so that small matrices still give every SM blocks.
// LAUNCH: block = 32 * WM * WN, grid = (ceil(n_rows / BN), ceil(n_tok / BM)).
constexpr int GF_BK = 32, GF_STAGES = 3;

__device__ __forceinline__ int gf_chunk(int row, int chunk) { return chunk ^ (row >> 1 & 3); }

template <int BM, int BN, int WM, int WN>
__device__ __forceinline__ void gemm_f16_tile(const __half* __restrict__ W, const __half* __restrict__ X,
                                              float* __restrict__ Y, const float* __restrict__ add, int n_rows,
                                              int K, int n_tok, int ldy) {
    constexpr int NT = 32 * WM * WN, TM = BM / WM, TN = BN / WN, FM = TM / 16, FN = TN / 8;
    static_assert(BM * 4 % NT == 0 && BN * 4 % NT == 0 && FM > 0 && FN % 2 == 0, "tile shape");
    __shared__ __align__(128) __half xs[GF_STAGES][BM][GF_BK];
    __shared__ __align__(128) __half ws[GF_STAGES][BN][GF_BK];
    const int row0 = blockIdx.x * BN, tok0 = blockIdx.y * BM;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int wt = warp / WN * TM, wr = warp % WN * TN;  // the warp's part of the tile

    auto load = [&](int stage, int k0) {
#pragma unroll
        for (int j = 0; j < BM * 4 / NT; ++j) {  // BM token rows x 4 chunks of 8 halves
            const int i = threadIdx.x + NT * j, t = i / 4, c = i % 4;
            const bool valid = tok0 + t < n_tok;
            cp_async16(&xs[stage][t][8 * gf_chunk(t, c)], X + (size_t)(valid ? tok0 + t : 0) * K + k0 + 8 * c, valid);
        }
#pragma unroll
        for (int j = 0; j < BN * 4 / NT; ++j) {
            const int i = threadIdx.x + NT * j, r = i / 4, c = i % 4;
            const bool valid = row0 + r < n_rows;
            cp_async16(&ws[stage][r][8 * gf_chunk(r, c)], W + (size_t)(valid ? row0 + r : 0) * K + k0 + 8 * c, valid);
        }
    };

    float acc[FM][FN][4] = {};
    const int n_steps = K / GF_BK;
#pragma unroll
    for (int s = 0; s < GF_STAGES - 1; ++s) {
        if (s < n_steps) load(s, s * GF_BK);
        cp_async_commit();  // empty groups too: the wait below counts groups
    }
    // ldmatrix addresses: lane l gives row l % 8 (+ 8 for the x4's second and fourth matrix of A,
    // the third and fourth of B) of the 16 x 16 (A) or 16-row x 16 (B, two n8 tiles) piece
    const int a_row = (lane & 7) + (lane >> 3 & 1) * 8, a_chunk = lane >> 4;
    const int b_row = (lane & 7) + (lane >> 4) * 8, b_chunk = lane >> 3 & 1;
    for (int s = 0; s < n_steps; ++s) {
        cp_async_wait<GF_STAGES - 2>();
        __syncthreads();  // step s's tiles are in; every warp is done with the stage refilled next
        if (s + GF_STAGES - 1 < n_steps) load((s + GF_STAGES - 1) % GF_STAGES, (s + GF_STAGES - 1) * GF_BK);
        cp_async_commit();
        const int cur = s % GF_STAGES;
#pragma unroll
        for (int kk = 0; kk < GF_BK / 8; kk += 2) {  // 16 columns: chunks kk, kk + 1
            uint32_t a[FM][4], b[FN][2];
#pragma unroll
            for (int i = 0; i < FM; ++i) {
                const int t = wt + 16 * i + a_row;
                ldmatrix_x4(a[i], &xs[cur][t][8 * gf_chunk(t, kk + a_chunk)]);
            }
#pragma unroll
            for (int j = 0; j < FN; j += 2) {
                const int r = wr + 8 * j + b_row;
                uint32_t q[4];
                ldmatrix_x4(q, &ws[cur][r][8 * gf_chunk(r, kk + b_chunk)]);
                b[j][0] = q[0], b[j][1] = q[1], b[j + 1][0] = q[2], b[j + 1][1] = q[3];
            }
#pragma unroll
            for (int i = 0; i < FM; ++i)
#pragma unroll
                for (int j = 0; j < FN; ++j) mma_16816(acc[i][j], a[i], b[j]);
        }
    }

    const int g = lane / 4, c2 = 2 * (lane % 4);  // C fragment: tokens g, g + 8; rows c2, c2 + 1
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j) {
            const int row = row0 + wr + 8 * j + c2;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int tok = tok0 + wt + 16 * i + g + 8 * h;
                if (tok >= n_tok) continue;
                const size_t at = (size_t)tok * ldy + row;
                float y0 = acc[i][j][2 * h], y1 = acc[i][j][2 * h + 1];
                if (add) {
                    y0 += row < n_rows ? add[at] : 0.0f;
                    y1 += row + 1 < n_rows ? add[at + 1] : 0.0f;
                }
                if (row + 1 < n_rows && at % 2 == 0) {  // an odd ldy leaves every other token's pair unaligned
                    *reinterpret_cast<float2*>(Y + at) = make_float2(y0, y1);
                } else {
                    if (row < n_rows) Y[at] = y0;
                    if (row + 1 < n_rows) Y[at + 1] = y1;
                }
            }
        }
}

extern "C" __global__ void __launch_bounds__(256)
gemm_f16_128(const __half* W, const __half* X, float* Y, const float* add, int n_rows, int K, int n_tok, int ldy) {
    follow_previous_kernel();
    gemm_f16_tile<128, 128, 2, 4>(W, X, Y, add, n_rows, K, n_tok, ldy);
}

extern "C" __global__ void __launch_bounds__(128)
gemm_f16_64(const __half* W, const __half* X, float* Y, const float* add, int n_rows, int K, int n_tok, int ldy) {
    follow_previous_kernel();
    gemm_f16_tile<64, 64, 2, 2>(W, X, Y, add, n_rows, K, n_tok, ldy);
}
