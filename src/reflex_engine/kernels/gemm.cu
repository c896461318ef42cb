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
// A short prompt's grid is small (a 4,096-row weight and 16 tokens: 128 blocks on 132 SMs), so a
// weight's columns may be split over splits_i blocks (blockIdx.z), each taking an even share of the
// 512-column steps; each leaves its sums in `partials`, and the last of a tile's splits to finish
// (counted in `counts`, which it sets back to 0) adds them up in the splits' order: the result
// depends on splits_i, never on timing. splits_i is the host's choice from weight i's own shape, so a
// product is the same bits in a launch of its own as beside others.
// One launch serves up to three weights of one type and width (q, k and v; gate and up: common.cuh
// fused_part), Y_i their products, add (as Y0) given with one weight only.
// LAUNCH: block = 256, grid = (Σ ceil(rows_i / 32), ceil(n_tok / 32), max splits_i); n_cols % 32 == 0;
// splits_i at most the 512-column steps of a row; for the weights of more than one split, partials room
// for Σ tiles_i · splits_i · 32 · 32 floats and counts Σ tiles_i ints, all 0 before the first launch
// (tiles_i: weight i's blocks of one split).
#include "common.cuh"
#include "mma.cuh"
#include "quant_blocks.cuh"

constexpr int GQ_ROWS = 32, GQ_TOKENS = 32, GQ_WARPS = 8, GQ_STEP = 64, GQ_AHEAD = 4;
constexpr int GQ_LD = GQ_STEP + 8;  // halves per staged row: a 16-byte shift a row keeps ldmatrix's rows in distinct banks

union GemmSmem {
    __half w[GQ_WARPS][GQ_ROWS][GQ_LD];              // each warp's dequantized part
    float part[GQ_WARPS][GQ_TOKENS][GQ_ROWS + 1];    // after the loop: each warp's sums
};

// Where the splits of one tile (32 rows x 32 tokens) meet: `sums` holds each split's 32 x 32 sums in
// turn, `count` how many splits have finished. Null for a weight of one split.
struct GemmSplit {
    float* sums;
    int* count;
    int n;  // splits
};

// Rows row0.. of Y for the tokens of blockIdx.y, over chunks [c_begin, c_end) of the columns: into Y
// (+ add), or, split, into split.sums[blockIdx.z] and by the tile's last split into Y.
template <class B>
__device__ __forceinline__ void gemm(const uint8_t* __restrict__ W, const float* __restrict__ X, float* __restrict__ Y,
                                     const float* __restrict__ add, int row0, int n_rows, int n_cols, int n_tok,
                                     int c_begin, int c_end, GemmSplit split) {
    __shared__ __align__(16) GemmSmem sm;
    __shared__ bool last;
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
            if (row_ok[h] && c < c_end) prefetch_l2(w_row[h] + (size_t)c * 32 * sizeof(B) / B::elems);
    };
#pragma unroll
    for (int k = 0; k < GQ_AHEAD; ++k) prefetch(c_begin + 2 * (warp + k * GQ_WARPS) + half_step);

    float acc[2][GQ_TOKENS / 8][4] = {};
    for (int c0 = c_begin + 2 * warp; c0 < c_end; c0 += 2 * GQ_WARPS) {
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
    // element i of the tile: its index in Y, or -1 past Y's tokens or rows
    auto at_of = [&](int i) -> long long {
        const int tok = tok0 + i / GQ_ROWS, row = row0 + i % GQ_ROWS;
        return tok < n_tok && row < n_rows ? (long long)tok * n_rows + row : -1;
    };
    float* own = split.sums ? split.sums + blockIdx.z * GQ_TOKENS * GQ_ROWS : nullptr;
    for (int i = threadIdx.x; i < GQ_TOKENS * GQ_ROWS; i += blockDim.x) {
        const long long at = at_of(i);
        if (at < 0) continue;
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < GQ_WARPS; ++w) s += sm.part[w][i / GQ_ROWS][i % GQ_ROWS];
        if (own)
            own[i] = s;
        else
            Y[at] = add ? add[at] + s : s;
    }
    if (!own) return;
    __threadfence();  // this split's sums, visible to every block before it is counted
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(split.count, 1) == split.n - 1;
        if (last) *split.count = 0;  // every split has counted: none reads it again in this launch
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int i = threadIdx.x; i < GQ_TOKENS * GQ_ROWS; i += blockDim.x) {
        const long long at = at_of(i);
        if (at < 0) continue;
        float s = 0.0f;
        for (int z = 0; z < split.n; ++z) s += __ldcg(split.sums + z * GQ_TOKENS * GQ_ROWS + i);  // other blocks wrote them
        Y[at] = add ? add[at] + s : s;
    }
}

// Weight i's split tiles in partials and counts come after those of the weights before it that split.
__device__ __forceinline__ GemmSplit split_of(int i, int u, float* partials, int* counts, int rows0, int rows1,
                                              int splits0, int splits1, int splits) {
    if (splits == 1) return {nullptr, nullptr, 1};
    const int tiles0 = (rows0 + GQ_ROWS - 1) / GQ_ROWS * gridDim.y, tiles1 = (rows1 + GQ_ROWS - 1) / GQ_ROWS * gridDim.y;
    size_t tile = (size_t)u * gridDim.y + blockIdx.y, sums = 0;  // tiles and tiles x splits before this one
    if (i > 0 && splits0 > 1) tile += tiles0, sums += (size_t)tiles0 * splits0;
    if (i > 1 && splits1 > 1) tile += tiles1, sums += (size_t)tiles1 * splits1;
    sums += ((size_t)u * gridDim.y + blockIdx.y) * splits;
    return {partials + sums * GQ_TOKENS * GQ_ROWS, counts + tile, splits};
}

#define GEMM_KERNEL(name, B)                                                                                      \
    extern "C" __global__ void __launch_bounds__(GQ_WARPS * WARP, 2)                                              \
        gemm_##name(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, const float* X, float* Y0, float* Y1,    \
                    float* Y2, const float* add, float* partials, int* counts, int rows0, int rows1, int rows2,   \
                    int n_cols, int splits0, int splits1, int splits2, int n_tok) {                               \
        follow_previous_kernel();                                                                                 \
        int u = blockIdx.x;                                                                                       \
        const int i = fused_part(u, GQ_ROWS, rows0, rows1), splits = pick(i, splits0, splits1, splits2);          \
        if ((int)blockIdx.z >= splits) return;                                                                    \
        const int n_chunks = n_cols / 32, n_steps = (n_chunks + 2 * GQ_WARPS - 1) / (2 * GQ_WARPS);               \
        const int c_begin = 2 * GQ_WARPS * (blockIdx.z * n_steps / splits);                                       \
        const int c_end = min(n_chunks, 2 * GQ_WARPS * ((blockIdx.z + 1) * n_steps / splits));                    \
        gemm<B>(pick(i, W0, W1, W2), X, pick(i, Y0, Y1, Y2), i == 0 ? add : nullptr, u * GQ_ROWS,                 \
                pick(i, rows0, rows1, rows2), n_cols, n_tok, c_begin, c_end,                                      \
                split_of(i, u, partials, counts, rows0, rows1, splits0, splits1, splits));                        \
    }
KERNEL_TYPES(GEMM_KERNEL)
#undef GEMM_KERNEL
