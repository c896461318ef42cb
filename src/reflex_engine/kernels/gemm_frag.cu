// Short prompts' Q4_K and Q8_0 matmuls on tensor cores, with no shared tile: Y (n_tok, n_rows) = X · Wᵀ (+ add),
// X as f16 (gemm_f16.cu's to_f16), for rows of 4,096 columns or more (ops.py). Each lane loads its own rows'
// quants and makes its own A fragments of them, exact. Q4_K: as matvec_x16_mma.cu's lanes load them (rows
// g + 8r of a block of 32, the 16 bytes 64G + 16c of each superblock's 128); two bytes into the halves of a
// word (prmt), a nibble each into an f16 through the mantissa (| 0x6400 is 1024 + q), then one f16 FMA to
// sc·q (<= 945, an integer f16 holds). A weight is d·sc·q - dmin·m, so per superblock one mma sums sc·q·x
// and another m·x (A: the sub-block's m, broadcast), and d and dmin scale the two in float32 once. Q8_0: see
// its frag_step. The only rounding is X's, to f16 (gemm.cu also rounds every weight to f16). X's f16 goes
// from memory straight into the B fragments. Why: gemm.cu stages f16 tiles for ldmatrix from pieces each
// lane loads 4-16 bytes at a time across 16 rows, and on the H200 that is L1-bound (84%) at 6% of DRAM's
// rate (docs/perf-notes.md, run 9); here a weight byte is loaded once per 16 tokens, Q4_K's 16 bytes a lane
// and 64 contiguous a row, past L1 (which keeps X, read again by every block).
//
// Q4_K: lane (g, c)'s word i of a 16-byte piece holds elements 4i..4i+3 of the piece's low-nibble run (elements
// 16h.. of sub-block 2j, h = c % 2, j = 2G + c / 2) and of its high-nibble run (sub-block 2j + 1): the
// mmas of a run take its word i's pairs (4i, 4i + 1) in a0 and (4i + 2, 4i + 3) in a2; as a B lane, token
// g gives x at the same elements. A block is 32 rows by 16 tokens; its warps take every n-th superblock
// of the rows and meet in shared memory in order.
#include "common.cuh"
#include "mma.cuh"
#include "quant_blocks.cuh"

constexpr int GF_ROWS = 32, GF_TOKENS = 16;
constexpr int GF_WARPS = 8;  // the most warps a block has, splitting its rows' superblocks

// sc·q of two elements of a 4-bit run, exact in f16: bytes holding them in the halves of a word (as prmt
// selects them, 0x4140 or 0x4342), their low nibbles (HIGH false) or high ones; k = (sc, -1024·sc) for low
// nibbles, (sc / 16, -64·sc) for high ones, as f16 pairs.
template <bool HIGH>
__device__ __forceinline__ uint32_t scaled_pair(uint32_t bytes, __half2 k_mul, __half2 k_add) {
    const uint32_t v = (bytes & (HIGH ? 0x00F000F0u : 0x000F000Fu)) | 0x64006400u;  // 1024 + q (HIGH: 1024 + 16q)
    return as_u32(__hfma2(*reinterpret_cast<const __half2*>(&v), k_mul, k_add));
}

// Step s (elements 256s..256s + 255) of the rows times X's tokens into acc[t][tt] (rows 16t + g (+ 8), tokens
// 8tt + 2c (+ 1)), one overload a type. Q4_K: step s is superblock s.
__device__ __forceinline__ void frag_step(const block_q4_K*, const uint8_t* const (&rows)[4], const __half* const (&x)[2],
                                          int s, int c, float (&acc)[2][2][4]) {
    uint4 head[4], qs[4][2];
    load_q4_K_pieces<true>(rows, s, c, head, qs);  // L2 only: L1 keeps X
    float sums[2][2][4] = {}, mins[2][2][4] = {};  // Σ sc·q·x and Σ m·x over the superblock
#pragma unroll
    for (int G = 0; G < 2; ++G) {
        const int j = 2 * G + c / 2;
        __half2 k_mul[4][2], k_add[4][2];  // each row's constants of sub-blocks 2j (low run), 2j + 1 (high run)
        uint32_t m[4][2];  // and their (m, m)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const uint32_t hd[4] = {head[r].x, head[r].y, head[r].z, head[r].w};
            uint32_t sc, mn;
            scale_min_k4_bytes(hd, j, sc, mn);
            const float sa = (float)(sc & 0xFF), sb = (float)(sc >> 8);
            k_mul[r][0] = __float2half2_rn(sa), k_add[r][0] = __float2half2_rn(-1024.0f * sa);
            k_mul[r][1] = __float2half2_rn(0.0625f * sb), k_add[r][1] = __float2half2_rn(-64.0f * sb);
            m[r][0] = as_u32(__float2half2_rn((float)(mn & 0xFF))), m[r][1] = as_u32(__float2half2_rn((float)(mn >> 8)));
        }
#pragma unroll
        for (int run = 0; run < 2; ++run) {  // the low nibbles' run, then the high ones'
            uint32_t xw[2][8];  // per token tile: the run's 16 f16 of x, two a word
#pragma unroll
            for (int tt = 0; tt < 2; ++tt) {
                const uint4* p = reinterpret_cast<const uint4*>(x[tt] + 256 * s + 64 * j + 32 * run + 16 * (c % 2));
                const uint4 v0 = __ldg(p), v1 = __ldg(p + 1);
                xw[tt][0] = v0.x, xw[tt][1] = v0.y, xw[tt][2] = v0.z, xw[tt][3] = v0.w;
                xw[tt][4] = v1.x, xw[tt][5] = v1.y, xw[tt][6] = v1.z, xw[tt][7] = v1.w;
            }
            const uint32_t am[2][4] = {{m[0][run], m[1][run], m[0][run], m[1][run]}, {m[2][run], m[3][run], m[2][run], m[3][run]}};
#pragma unroll
            for (int word = 0; word < 4; ++word) {
                uint32_t a[2][4];  // per tile: rows g, g + 8; pairs (4w, 4w + 1) and (4w + 2, 4w + 3)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const uint4& u = qs[r][G];
                    const uint32_t w = word == 0 ? u.x : word == 1 ? u.y : word == 2 ? u.z : u.w;
                    const uint32_t b01 = __byte_perm(w, 0u, 0x4140), b23 = __byte_perm(w, 0u, 0x4342);
                    a[r / 2][r % 2] = run ? scaled_pair<true>(b01, k_mul[r][1], k_add[r][1]) : scaled_pair<false>(b01, k_mul[r][0], k_add[r][0]);
                    a[r / 2][r % 2 + 2] = run ? scaled_pair<true>(b23, k_mul[r][1], k_add[r][1]) : scaled_pair<false>(b23, k_mul[r][0], k_add[r][0]);
                }
#pragma unroll
                for (int tt = 0; tt < 2; ++tt) {
                    const uint32_t b[2] = {xw[tt][2 * word], xw[tt][2 * word + 1]};
#pragma unroll
                    for (int t = 0; t < 2; ++t) {
                        mma_16816(sums[t][tt], a[t], b);
                        mma_16816(mins[t][tt], am[t], b);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // row g + 8r: tile r / 2, C's row g (+ 8 for odd r)
        const float d = f16_to_float(head[r].x & 0xFFFF), dmin = f16_to_float(head[r].x >> 16);
#pragma unroll
        for (int tt = 0; tt < 2; ++tt)
#pragma unroll
            for (int k = 2 * (r % 2); k < 2 * (r % 2) + 2; ++k)
                acc[r / 2][tt][k] += fmaf(d, sums[r / 2][tt][k], -dmin * mins[r / 2][tt][k]);
    }
}

// Q8_0: step s is blocks 8s..8s + 7, each a sum of its own: lane (g, c) takes elements 8c..8c + 7 of every block
// (two mmas: pairs (8c, 8c + 1), (8c + 2, 8c + 3), then (8c + 4, ..), (8c + 6, ..)), q exact as f16 (bytes into
// the halves, | 0x6400 with the sign bit flipped is 1152 + q), and d scales each block's sums in float32.
__device__ __forceinline__ void frag_step(const block_q8_0*, const uint8_t* const (&rows)[4], const __half* const (&x)[2],
                                          int s, int c, float (&acc)[2][2][4]) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const size_t block = (size_t)8 * s + k;
        uint32_t a[2][2][4];  // [mma][tile]: rows g, g + 8
        float d[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const uint8_t* b = rows[r] + sizeof(block_q8_0) * block;
            uint32_t w[2];
            load_words_shifted(b + 2 + 8 * c, w);  // reach: as block_q8_0::piece's
            d[r] = f16_to_float(load_u16(b));
#pragma unroll
            for (int i = 0; i < 4; ++i) {  // pair i: bytes 2(i % 2), 2(i % 2) + 1 of word i / 2
                const uint32_t v = (__byte_perm(w[i / 2], 0u, i % 2 ? 0x4342 : 0x4140) & 0x00FF00FFu) ^ 0x64806480u;
                a[i / 2][r / 2][r % 2 + 2 * (i % 2)] = as_u32(__hsub2(*reinterpret_cast<const __half2*>(&v), __float2half2_rn(1152.0f)));
            }
        }
#pragma unroll
        for (int tt = 0; tt < 2; ++tt) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(x[tt] + 32 * block + 8 * c));
            const uint32_t b[2][2] = {{v.x, v.y}, {v.z, v.w}};
#pragma unroll
            for (int t = 0; t < 2; ++t) {
                float sum[4] = {};
                mma_16816(sum, a[0][t], b[0]);
                mma_16816(sum, a[1][t], b[1]);
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[t][tt][i] = fmaf(d[2 * t + i / 2], sum[i], acc[t][tt][i]);
            }
        }
    }
}

// Rows row0.. row0 + 31 of Y for tokens tok0.. tok0 + 15; every thread of the block calls it.
template <class B>
__device__ __forceinline__ void gemm_frag(const uint8_t* __restrict__ W, const __half* __restrict__ X,
                                               float* __restrict__ Y, const float* __restrict__ add, int row0,
                                               int n_rows, int n_cols, int tok0, int n_tok) {
    __shared__ float partial[GF_WARPS][GF_TOKENS][GF_ROWS + 1];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, n_warps = blockDim.x / WARP;
    const int g = lane / 4, c = lane % 4;
    const size_t stride = row_bytes<B>(n_cols);
    const uint8_t* rows[4];
#pragma unroll
    for (int r = 0; r < 4; ++r)  // rows past n_rows re-read the last one and are never stored
        rows[r] = W + (size_t)min(row0 + g + 8 * r, n_rows - 1) * stride;
    const __half* x[2];
#pragma unroll
    for (int tt = 0; tt < 2; ++tt)  // tokens past n_tok read the last one's row and are never stored
        x[tt] = X + (size_t)min(tok0 + 8 * tt + g, n_tok - 1) * n_cols;

    float acc[2][2][4] = {};
    for (int s = warp; s < n_cols / 256; s += n_warps) frag_step(static_cast<const B*>(nullptr), rows, x, s, c, acc);

#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int tt = 0; tt < 2; ++tt)
#pragma unroll
            for (int k = 0; k < 4; ++k) partial[warp][8 * tt + 2 * c + k % 2][16 * t + g + 8 * (k / 2)] = acc[t][tt][k];
    __syncthreads();
    for (int i = threadIdx.x; i < GF_TOKENS * GF_ROWS; i += blockDim.x) {
        const int tok = tok0 + i / GF_ROWS, row = row0 + i % GF_ROWS;
        if (tok >= n_tok || row >= n_rows) continue;
        float v = 0.0f;
        for (int w = 0; w < n_warps; ++w) v += partial[w][i / GF_ROWS][i % GF_ROWS];
        const size_t at = (size_t)tok * n_rows + row;
        Y[at] = add ? add[at] + v : v;
    }
}

// Y_i (n_tok, rows_i) = X · W_iᵀ for up to three weights of one type (common.cuh fused_part; + add, as Y0, where
// not null), X (n_tok, n_cols) as f16.
// LAUNCH: block = 32 · min(GF_WARPS, n_cols / 256); grid = (Σ ceil(rows_i / GF_ROWS), ceil(n_tok / GF_TOKENS));
// n_cols % 256 == 0.
#define GEMM_FRAG_KERNEL(name, B)                                                                                 \
    extern "C" __global__ void __launch_bounds__(GF_WARPS * WARP, 1)                                              \
        gemm_frag_##name(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, const __half* X, float* Y0,     \
                         float* Y1, float* Y2, const float* add, int rows0, int rows1, int rows2, int n_cols, int n_tok) { \
        follow_previous_kernel();                                                                                 \
        int u = blockIdx.x;                                                                                       \
        const int i = fused_part(u, GF_ROWS, rows0, rows1);                                                       \
        gemm_frag<B>(pick(i, W0, W1, W2), X, pick(i, Y0, Y1, Y2), i == 0 ? add : nullptr, u * GF_ROWS,            \
                     pick(i, rows0, rows1, rows2), n_cols, blockIdx.y * GF_TOKENS, n_tok);                        \
    }
GEMM_FRAG_KERNEL(q4_K, block_q4_K)
GEMM_FRAG_KERNEL(q8_0, block_q8_0)
#undef GEMM_FRAG_KERNEL
