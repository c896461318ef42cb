// Short-prompt matmul on tensor cores, straight from the GGUF blocks: Y (n_tok, n_rows) =
// X (n_tok, n_cols) · Wᵀ (+ add), for prompts too long for the matvec passes and too short for
// an f16 copy of every weight (gemm_f16.cu) to pay: each weight byte is read and dequantized once
// per 32 tokens, where passes of 8 tokens read it once per 8 and spend integer math per token.
// A block owns 32 weight rows and 32 tokens; its 8 warps take every 8th 64-column step of the rows
// (together 512 columns, two K-quant superblocks, at a time), each dequantizing its 32 x 64 part
// (quant_blocks.cuh's pieces, d·q + m with the integers made floats through the mantissa, a lane
// the same 32 columns of two rows 16 apart) into its own shared tile as f16 and multiplying both
// 16-row halves with X's columns, read from global memory and rounded to f16 in registers once
// for both (mma.cuh: W is the A operand, X the B one). The warps' partial sums meet in shared
// memory at the end, in a fixed order: the result does not depend on timing. Each lane asks L2
// for its chunks' bytes GQ_AHEAD steps early, so a warp's step does not wait a whole trip to memory.
// Why 32 rows: every block reads all of X's columns for its rows, which at 16 rows a block was
// several times the weights' bytes through L2 and what bounded the kernel (H200, docs/perf-notes.md
// run 7); 32 halves that traffic and X's loads per mma.
// One launch serves up to three weights of one type and width (q, k and v; gate and up: common.cuh
// fused_part), Y_i their products, add (as Y0) given with one weight only.
// LAUNCH: block = 256, grid = (Σ ceil(rows_i / 32), ceil(n_tok / 32)); n_cols % 32 == 0.
#include "common.cuh"
#include "mma.cuh"
#include "quant_blocks.cuh"

constexpr int GQ_ROWS = 32, GQ_TOKENS = 32, GQ_WARPS = 8, GQ_STEP = 64, GQ_AHEAD = 4;
constexpr int GQ_LD = GQ_STEP + 8;  // halves per staged row: a 16-byte shift a row keeps ldmatrix's rows in distinct banks

union GemmSmem {
    __half w[GQ_WARPS][GQ_ROWS][GQ_LD];              // each warp's dequantized part
    float part[GQ_WARPS][GQ_TOKENS][GQ_ROWS + 1];    // after the loop: each warp's sums
};

template <class B>
__device__ __forceinline__ void gemm(const uint8_t* __restrict__ W, const float* __restrict__ X, float* __restrict__ Y,
                                     const float* __restrict__ add, int row0, int n_rows, int n_cols, int n_tok) {
    __shared__ __align__(16) GemmSmem sm;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int tok0 = blockIdx.y * GQ_TOKENS;
    const int n_tiles = min(GQ_TOKENS / 8, (n_tok - tok0 + 7) / 8);  // 8-token mma tiles holding a token
    const int n_chunks = n_cols / 32;

    // lane: chunk (lane % 2) of the step in rows lane / 2 and lane / 2 + 16; the A fragment's ldmatrix row and column
    const int r = lane / 2, half_step = lane % 2;
    bool row_ok[2];
    const uint8_t* w_row[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        row_ok[h] = row0 + r + 16 * h < n_rows;
        w_row[h] = W + (size_t)(row_ok[h] ? row0 + r + 16 * h : 0) * row_bytes<B>(n_cols);
    }
    const int a_row = (lane & 7) + (lane >> 3 & 1) * 8, a_col = 8 * (lane >> 4);
    const int g = lane / 4, c2 = 2 * (lane % 4);  // the B fragment's token and column pair
    const float* x_rows[GQ_TOKENS / 8];
#pragma unroll
    for (int nt = 0; nt < GQ_TOKENS / 8; ++nt)  // tokens past n_tok read the last one's row, never stored
        x_rows[nt] = X + (size_t)min(tok0 + 8 * nt + g, n_tok - 1) * n_cols + c2;

    auto prefetch = [&](int c) {  // chunk c's share of the rows: for the K types, its part of the block
#pragma unroll
        for (int h = 0; h < 2; ++h)
            if (row_ok[h] && c < n_chunks) prefetch_l2(w_row[h] + (size_t)c * 32 * sizeof(B) / B::elems);
    };
#pragma unroll
    for (int k = 0; k < GQ_AHEAD; ++k) prefetch(2 * (warp + k * GQ_WARPS) + half_step);

    float acc[2][GQ_TOKENS / 8][4] = {};
    for (int c0 = 2 * warp; c0 < n_chunks; c0 += 2 * GQ_WARPS) {
        const int c = c0 + half_step;
        prefetch(c + 2 * GQ_AHEAD * GQ_WARPS);
        uint4 hw[2][4];  // the lane's chunk of each of its rows as f16, from two 16-element pieces: d·q + m, one FMA an element
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int pp = 0; pp < 2; ++pp) {
                float q[16], d = 0.0f, m = 0.0f;
                if (row_ok[h] && c < n_chunks) {
                    B::piece(w_row[h], 2 * c + pp, n_cols, q, d, m);
                } else {
#pragma unroll
                    for (int j = 0; j < 16; ++j) q[j] = 0.0f;
                }
#pragma unroll
                for (int j = 0; j < 16; ++j) q[j] = fmaf(d, q[j], m);
                hw[h][2 * pp] = pack_half8(q), hw[h][2 * pp + 1] = pack_half8(q + 8);
            }
        __syncwarp();  // the previous step's fragments are out of the tile
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            uint4* dst = reinterpret_cast<uint4*>(&sm.w[warp][r + 16 * h][32 * half_step]);
#pragma unroll
            for (int q = 0; q < 4; ++q) dst[q] = hw[h][q];
        }
        __syncwarp();
#pragma unroll
        for (int kk = 0; kk < GQ_STEP; kk += 16) {
            const int k = 32 * c0 + kk;
            if (k >= n_cols) break;  // an odd chunk count: the step's second chunk is past the row
            uint32_t a[2][4];
#pragma unroll
            for (int h = 0; h < 2; ++h) ldmatrix_x4(a[h], &sm.w[warp][16 * h + a_row][kk + a_col]);
#pragma unroll
            for (int nt = 0; nt < GQ_TOKENS / 8; ++nt) {
                if (nt >= n_tiles) break;
                const float2 lo = *reinterpret_cast<const float2*>(x_rows[nt] + k);
                const float2 hi = *reinterpret_cast<const float2*>(x_rows[nt] + k + 8);
                const uint32_t b[2] = {pack_half2(lo.x, lo.y), pack_half2(hi.x, hi.y)};
                mma_16816(acc[0][nt], a[0], b);
                mma_16816(acc[1][nt], a[1], b);
            }
        }
    }

    __syncthreads();  // part overlays the tiles
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int nt = 0; nt < GQ_TOKENS / 8; ++nt) {  // C fragment: rows g, g + 8 of half h; tokens 8nt + c2, + 1
            const int rr = 16 * h + g;
            sm.part[warp][8 * nt + c2][rr] = acc[h][nt][0];
            sm.part[warp][8 * nt + c2 + 1][rr] = acc[h][nt][1];
            sm.part[warp][8 * nt + c2][rr + 8] = acc[h][nt][2];
            sm.part[warp][8 * nt + c2 + 1][rr + 8] = acc[h][nt][3];
        }
    __syncthreads();
    for (int i = threadIdx.x; i < GQ_TOKENS * GQ_ROWS; i += blockDim.x) {
        const int t = i / GQ_ROWS, rr = i % GQ_ROWS, tok = tok0 + t, row = row0 + rr;
        if (tok >= n_tok || row >= n_rows) continue;
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < GQ_WARPS; ++w) s += sm.part[w][t][rr];
        const size_t at = (size_t)tok * n_rows + row;
        Y[at] = add ? add[at] + s : s;
    }
}

#define GEMM_KERNEL(name, B)                                                                                      \
    extern "C" __global__ void __launch_bounds__(GQ_WARPS * WARP, 2)                                              \
        gemm_##name(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, const float* X, float* Y0, float* Y1,    \
                    float* Y2, const float* add, int rows0, int rows1, int rows2, int n_cols, int n_tok) {         \
        follow_previous_kernel();                                                                                 \
        int u = blockIdx.x;                                                                                       \
        const int i = fused_part(u, GQ_ROWS, rows0, rows1);                                                       \
        gemm<B>(pick(i, W0, W1, W2), X, pick(i, Y0, Y1, Y2), i == 0 ? add : nullptr, u * GQ_ROWS,                 \
                pick(i, rows0, rows1, rows2), n_cols, n_tok);                                                     \
    }
KERNEL_TYPES(GEMM_KERNEL)
#undef GEMM_KERNEL
