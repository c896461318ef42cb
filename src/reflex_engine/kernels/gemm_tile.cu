// Prompts' Q4_K, Q6_K, Q8_0 and Q5_0 matmuls on tensor cores straight from the GGUF blocks: Y (n_tok, n_rows) =
// X · Wᵀ (+ add), X as f16 with its pairs interleaved (to_f16_interleaved), from ops.GEMM_TILE_MIN_TOKENS tokens
// on. Why: gemm_f16.cu multiplies an f16 copy of the weights that a pass first writes to memory, 2 bytes a weight
// written and read back whatever the prompt's length; on the H200 an 8B Q4_K_M pass of 128 tokens took 35 ms that
// way, 512 tokens 46 (docs/perf-notes.md run 27). Here a weight's GGUF bytes are read once a tile of 64 tokens,
// and from L2 after the first of the tiles that share its rows: the token tiles are the grid's fast dimension.
//
// A block is GT_WARPS warps x 32 rows by 64 tokens. Its warps walk the same superblocks in step, half a
// superblock (128 columns) a step, so X's 64 tokens x 256 columns go through shared memory once a superblock
// for all of them (cp.async, two stages), and each lane has the next half's weights in flight in registers
// while it multiplies this one's. Lane (g, c) holds rows g + 8r (r = 0..3: two tiles of 16) and, of each
// half, two runs of 16 consecutive elements (the type's run_at), a run one scale (and min) a row; it makes
// its own A fragments of them: word i of a run (elements 4i..4i+3, a byte each) gives the mma's k-slots
// (2c, 2c + 1) and (2c + 8, 2c + 9) the pairs (4i, 4i + 2) and (4i + 1, 4i + 3), a mask of the word or of it
// shifted by a byte (a byte permute a pair cost twice the instructions), and as a B lane token g gives x at
// the same elements, which X's interleaved order puts in consecutive halves. A weight enters the mma as f16:
// its quant exact (an integer through the mantissa: | 0x6400 is 1024 + q), then q·(d·sc) - dmin·m in one f16
// FMA, d·sc and dmin·m rounded to f16 first: about the one rounding gemm_f16.cu's copy gives a weight. Sums
// are float32 in the mma.
//
// A launch of fewer blocks than SMs (a short prompt's o and down: 4,096 rows are 32 blocks a token tile) runs
// gemm_tile_split_*: clusters of GT_SPLITS blocks, each taking a share of the superblocks, whose first adds the
// others' sums from their shared memory in rank order: the same bits whatever the timing.
//
// The types of 32-element blocks (Q8_0, Q5_0) may end a row in half a superblock (n_cols % 256 == 128): llama.cpp
// quantizes rows that are not whole superblocks so, as DeepSeek-V2-Lite's experts' downs (1,408 columns) and its
// attn_k_b (128). That last step multiplies half 0 alone, X's other half staged as zeros.
#include "common.cuh"
#include "mma.cuh"
#include "quant_blocks.cuh"

constexpr int GT_WARPS = 4, GT_ROWS = 32 * GT_WARPS, GT_TOKENS = 64, GT_STAGES = 2;
constexpr int GT_SPLITS = 4;
constexpr int GT_CHUNKS = 32;  // 16-byte chunks of a token's 256 columns in a stage
constexpr int GT_STAGE_CHUNKS = GT_TOKENS * GT_CHUNKS;

// Where chunk k of token t lies in a stage. The 8 lanes of a 16-byte shared load are tokens 2m, 2m + 1 at four
// runs: Q4_K's chunks {0, 2, 8, 10} + 4·run, Q6_K's and Q8_0's {0, 2, 4, 6} + 8·run (and each + 1). Bit 3
// folded into bit 0, and odd tokens' chunks XOR 5, put each load's 8 lanes in 8 distinct bank groups for both.
__device__ __forceinline__ int gt_chunk(int t, int k) { return GT_CHUNKS * t + (k ^ (k >> 3 & 1) ^ (t & 1) * 5); }

// q as exact f16 pairs (v holds bias + q in each half), then times mul plus add in one f16 FMA.
__device__ __forceinline__ uint32_t weight_pair(uint32_t v, __half2 bias, __half2 mul, __half2 add) {
    return as_u32(__hfma2(__hsub2(*reinterpret_cast<const __half2*>(&v), bias), mul, add));
}

// The bits `mask` keeps of a word's elements 0 and 2 (EVEN) or 1 and 3, each byte in the low byte of a half, then
// XOR `magic` (on bits the mask clears: OR), in one LOP3: magic a register, so the mask may be its one immediate.
template <uint32_t MASK>
__device__ __forceinline__ uint32_t pair_bits(uint32_t w, bool even, uint32_t magic) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(r) : "r"(even ? w : w >> 8), "n"(MASK), "r"(magic));  // (a & b) ^ c
    return r;
}

// x (n values, n % 4 == 0) as f16, each 4 values' middle two swapped, (x0, x2, x1, x3): gemm_tile's B pairs.
// LAUNCH: block = 256, grid = ceil(n / 1024).
extern "C" __global__ void __launch_bounds__(256) to_f16_interleaved(const float4* __restrict__ x, uint2* __restrict__ out,
                                                                      long long n) {
    follow_previous_kernel();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (4 * i < n) {
        const float4 v = x[i];
        out[i] = make_uint2(pack_half2(v.x, v.z), pack_half2(v.y, v.w));
    }
}

// Q4_K: half G of superblock s is qs[64G ..]; lane c's 16 bytes qs[64G + 16c ..] hold elements 16(c % 2).. of
// sub-block 2j in their low nibbles (run 0) and of sub-block 2j + 1 in their high ones (run 1), j = 2G + c / 2.
struct TileQ4K {
    using Block = block_q4_K;
    uint4 head[4], qs[4];  // each row's d, dmin and 6-bit scales; its 16 bytes of quants

    __device__ __forceinline__ void load(const uint8_t* const (&rows)[4], int s, int G, int c) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const uint4* b = reinterpret_cast<const uint4*>(rows[r] + sizeof(Block) * (size_t)s);
            head[r] = __ldcg(b), qs[r] = __ldcg(b + 1 + 4 * G + c);
        }
    }
    __device__ static int run_at(int run, int c) { return 64 * (c / 2) + 32 * run + 16 * (c % 2); }

    __device__ __forceinline__ void fragments(int G, int run, int c, uint32_t (&a)[4][2][4], uint32_t magic) const {
        const __half2 bias = __float2half2_rn(1024.0f);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const uint32_t hd[4] = {head[r].x, head[r].y, head[r].z, head[r].w};
            uint32_t sc, mn;
            scale_min_k4_bytes(hd, 2 * G + c / 2, sc, mn);
            const float d = f16_to_float(hd[0] & 0xFFFF), dmin = f16_to_float(hd[0] >> 16);
            // the high nibbles come as 16·q: their d·sc is divided by 16, a power of two
            const __half2 mul = __float2half2_rn(d * (float)((run ? sc >> 8 : sc) & 0xFF) * (run ? 0.0625f : 1.0f));
            const __half2 add = __float2half2_rn(-dmin * (float)((run ? mn >> 8 : mn) & 0xFF));
            const uint32_t w[4] = {qs[r].x, qs[r].y, qs[r].z, qs[r].w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const uint32_t v = run ? pair_bits<0x00F000F0u>(w[i], e == 0, magic) : pair_bits<0x000F000Fu>(w[i], e == 0, magic);
                    a[i][r / 2][r % 2 + 2 * e] = weight_pair(v, bias, mul, add);
                }
        }
    }
};

// Q6_K: half h of superblock s is ql[64h ..], qh[32h ..]; lane c's 16 bytes ql[64h + 16c ..] hold elements 16c..
// of the half in their low nibbles (run 0) and 64 + 16c.. in their high ones (run 1), whose top two bits lie in
// qh[32h + 16(c % 2) ..] at bit 2(c / 2) and 4 + 2(c / 2); runs take scales[8h + c] and scales[8h + 4 + c].
// Blocks of 210 bytes: the loads are shifted words (their reach stays in the block or the one before).
struct TileQ6K {
    using Block = block_q6_K;
    uint32_t ql[4][4], qh[4][4];
    int scales[4][2];
    float d[4];

    __device__ __forceinline__ void load(const uint8_t* const (&rows)[4], int s, int h, int c) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const uint8_t* b = rows[r] + sizeof(Block) * (size_t)s;
            load_words_shifted(b + 64 * h + 16 * c, ql[r]);
            load_words_shifted(b + 128 + 32 * h + 16 * (c % 2), qh[r]);
            const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * h + c);
            scales[r][0] = __ldg(sc), scales[r][1] = __ldg(sc + 4);
            d[r] = f16_to_float(load_u16(b + 208));
        }
    }
    __device__ static int run_at(int run, int c) { return 64 * run + 16 * c; }

    __device__ __forceinline__ void fragments(int, int run, int c, uint32_t (&a)[4][2][4], uint32_t magic) const {
        const __half2 bias = __float2half2_rn(1056.0f), add = __float2half2_rn(0.0f);  // 1024 + 32: q6 - 32
        const int shift = 4 * run + 2 * (c / 2);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const __half2 mul = __float2half2_rn(d[r] * (float)scales[r][run]);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const uint32_t q = (ql[r][i] >> (4 * run) & 0x0F0F0F0Fu) | (qh[r][i] >> shift & 0x03030303u) << 4;
#pragma unroll
                for (int e = 0; e < 2; ++e) a[i][r / 2][r % 2 + 2 * e] = weight_pair(pair_bits<0x003F003Fu>(q, e == 0, magic), bias, mul, add);
            }
        }
    }
};

// The types of 32-element blocks: half G of superblock s is blocks 8s + 4G .. + 3; lane c's run 0 is elements 16c..
// of the half (block 4G + c / 2, its elements 16(c % 2)..), run 1 elements 64 + 16c.. (block 4G + 2 + c / 2). Each
// type keeps what it needs of a run's block (T::take).
template <class T, class B>
struct Runs32 {
    using Block = B;
    __device__ __forceinline__ void load(const uint8_t* const (&rows)[4], int s, int G, int c) {
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int run = 0; run < 2; ++run)
                static_cast<T*>(this)->take(rows[r] + sizeof(B) * ((size_t)8 * s + 4 * G + 2 * run + c / 2), r, run, c);
    }
    __device__ static int run_at(int run, int c) { return 64 * run + 16 * c; }
};

// Q8_0: a run is its block's quants 16(c % 2).. Blocks of 34 bytes: shifted words, reaching at most the next block's
// d (or the carve's padding past the last block).
struct TileQ80 : Runs32<TileQ80, block_q8_0> {
    uint32_t qs[4][2][4];
    float d[4][2];

    __device__ __forceinline__ void take(const uint8_t* b, int r, int run, int c) {
        load_words_shifted(b + 2 + 16 * (c % 2), qs[r][run]);
        d[r][run] = f16_to_float(load_u16(b));
    }

    __device__ __forceinline__ void fragments(int, int run, int, uint32_t (&a)[4][2][4], uint32_t) const {
        const __half2 bias = __float2half2_rn(1152.0f), add = __float2half2_rn(0.0f);  // int8 q + 128 over 1024
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const __half2 mul = __float2half2_rn(d[r][run]);  // an f16 already: exact
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const uint32_t w = qs[r][run][i];
#pragma unroll
                for (int e = 0; e < 2; ++e)  // the sign bit flipped: q + 128
                    a[i][r / 2][r % 2 + 2 * e] = weight_pair(pair_bits<0x00FF00FFu>(w, e == 0, 0x64806480u), bias, mul, add);
            }
        }
    }
};

// Q5_0: a run the low (c even) or high (c odd) nibbles of its block's 16 qs bytes, bit 4 of its elements qh's bits
// 16(c % 2).. Blocks of 22 bytes: shifted words, reaching at most the next block's d.
struct TileQ50 : Runs32<TileQ50, block_q5_0> {
    uint32_t qs[4][2][4], qh[4][2];
    float d[4][2];

    __device__ __forceinline__ void take(const uint8_t* b, int r, int run, int) {
        uint32_t h[1];
        load_words_shifted(b + 6, qs[r][run]);
        load_words_shifted(b + 2, h);
        qh[r][run] = h[0], d[r][run] = f16_to_float(load_u16(b));
    }

    __device__ __forceinline__ void fragments(int, int run, int c, uint32_t (&a)[4][2][4], uint32_t magic) const {
        const __half2 bias = __float2half2_rn(1040.0f), add = __float2half2_rn(0.0f);  // 1024 + 16: q5 - 16
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const __half2 mul = __float2half2_rn(d[r][run]);  // an f16 already: exact
            const uint32_t hi = qh[r][run] >> 16 * (c % 2);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const uint32_t q = (qs[r][run][i] >> 4 * (c % 2) & 0x0F0F0F0Fu) | spread4(hi >> 4 * i) << 4;
#pragma unroll
                for (int e = 0; e < 2; ++e) a[i][r / 2][r % 2 + 2 * e] = weight_pair(pair_bits<0x001F001Fu>(q, e == 0, magic), bias, mul, add);
            }
        }
    }
};

// Rows row0.. row0 + GT_ROWS - 1 of Y for tokens tok0.. tok0 + 63, over superblocks s_begin.. s_end - 1 (SPLIT: the
// block's share; the cluster's first block stores the tile); every thread of the block calls it. X's and Y's rows
// are x_stride and y_stride apart (a head's slice of wider rows: gemm_tile_heads).
template <class T, bool SPLIT>
__device__ __forceinline__ void gemm_tile(const uint8_t* __restrict__ W, const __half* __restrict__ X, float* __restrict__ Y,
                                          const float* __restrict__ add, int row0, int n_rows, int n_cols, int x_stride,
                                          int y_stride, int tok0, int n_tok, int s_begin, int s_end) {
    using B = typename T::Block;
    extern __shared__ uint4 xs[];  // GT_STAGES stages of GT_STAGE_CHUNKS chunks
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane / 4, c = lane % 4;
    const size_t stride = row_bytes<B>(n_cols);
    const uint8_t* rows[4];
#pragma unroll
    for (int r = 0; r < 4; ++r)  // rows past n_rows re-read the last one and are never stored
        rows[r] = W + (size_t)min(row0 + 32 * warp + g + 8 * r, n_rows - 1) * stride;

    // superblock s's columns of the tile's tokens (past n_tok: 0): lane l of warp w copies chunk l of tokens w + GT_WARPS·j,
    // so its chunk's place in a token's row is the same for all of them (GT_WARPS even: one parity)
    static_assert(GT_CHUNKS == WARP && GT_WARPS % 2 == 0, "a lane a chunk, every token of one parity");
    const __half* x_from = X + (size_t)(tok0 + warp) * x_stride + 8 * lane;
    const int x_to = gt_chunk(warp, lane);
    auto stage_x = [&](int s) {
        uint4* stage = xs + s % GT_STAGES * GT_STAGE_CHUNKS + x_to;
        const bool in_row = 256 * s + 8 * lane < n_cols;  // a half superblock's other half: zeros
#pragma unroll
        for (int j = 0; j < GT_TOKENS / GT_WARPS; ++j) {
            const bool valid = in_row && tok0 + warp + GT_WARPS * j < n_tok;
            cp_async16(stage + GT_CHUNKS * GT_WARPS * j, valid ? x_from + (size_t)GT_WARPS * j * x_stride + 256 * s : X, valid);
        }
        cp_async_commit();
    };

    float acc[2][GT_TOKENS / 8][4] = {};  // [tile][token tile]: rows 16·tile + g (+ 8), tokens 8·tt + 2c (+ 1)
    const uint32_t magic = 0x64006400u;  // | 1024 in both halves' exponents
    // step 2s + h multiplies half h of superblock s from `cur` and has the next half's weights loaded into `next`;
    // `last`: the row's last superblock is half of one, and this its step
    auto step = [&](int s, int h, T& cur, T& next, bool last) {
        if (h == 0) {
            if (s + 1 < s_end) stage_x(s + 1);
            else cp_async_commit();  // an empty group: the wait counts groups
            if (s + 2 < s_end) {  // L2 has them by the time `next` asks: one half's multiplies alone left its loads waiting
                constexpr int SUPER = sizeof(B) * (256 / B::elems);  // a superblock's bytes; the lanes ask within it
                const int bytes = 256 * (s + 2) + 128 == n_cols ? SUPER / 2 : SUPER;
#pragma unroll
                for (int r = 0; r < 4; ++r) prefetch_l2(rows[r] + SUPER * (size_t)(s + 2) + min(64 * c, bytes - 1));
            }
            cp_async_wait<1>();
            __syncthreads();  // superblock s's X is in, from every thread's copies
        }
        if (h == 0) {
            if (!last) next.load(rows, s, 1, c);
        } else if (s + 1 < s_end) {
            next.load(rows, s + 1, 0, c);
        }
        const uint4* stage = xs + s % GT_STAGES * GT_STAGE_CHUNKS;
#pragma unroll
        for (int run = 0; run < 2; ++run) {
            uint32_t a[4][2][4];
            cur.fragments(h, run, c, a, magic);
            const int k0 = 16 * h + T::run_at(run, c) / 8;
#pragma unroll
            for (int tt = 0; tt < GT_TOKENS / 8; ++tt) {
                const int t = 8 * tt + g;
                const uint4 v0 = stage[gt_chunk(t, k0)], v1 = stage[gt_chunk(t, k0 + 1)];
                const uint32_t xw[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const uint32_t b[2] = {xw[2 * i], xw[2 * i + 1]};
                    mma_16816(acc[0][tt], a[i][0], b);
                    mma_16816(acc[1][tt], a[i][1], b);
                }
            }
        }
        if (h == 1 || last) __syncthreads();  // every warp is done with this stage before superblock s + 2's X refills it
    };

    T p0, p1;
    p0.load(rows, s_begin, 0, c);
    stage_x(s_begin);
    for (int s = s_begin; s < s_end; ++s) {
        const bool last = B::elems == 32 && 256 * s + 128 == n_cols;  // never, for the K-quants' whole superblocks
        step(s, 0, p0, p1, last);
        if (!last) step(s, 1, p1, p0, false);
    }
    if constexpr (SPLIT) {  // each block's sums into its own (free) stages; the first block adds the others' to its own
        float* own = reinterpret_cast<float*>(xs);
        auto at = [&](int t, int tt, int k) { return (((warp * 2 + t) * (GT_TOKENS / 8) + tt) * 4 + k) * WARP + lane; };
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int tt = 0; tt < GT_TOKENS / 8; ++tt)
#pragma unroll
                for (int k = 0; k < 4; ++k) own[at(t, tt, k)] = acc[t][tt][k];
        cluster_arrive(true);
        cluster_wait();
        if (blockIdx.z == 0)
            for (int z = 1; z < GT_SPLITS; ++z) {
                const float* theirs = in_block_of_rank(own, z);
#pragma unroll
                for (int t = 0; t < 2; ++t)
#pragma unroll
                    for (int tt = 0; tt < GT_TOKENS / 8; ++tt)
#pragma unroll
                        for (int k = 0; k < 4; ++k) acc[t][tt][k] += theirs[at(t, tt, k)];
            }
        cluster_arrive(false);  // the others' shared memory stays theirs until the first has read it
        cluster_wait();
        if (blockIdx.z != 0) return;
    }

#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int tt = 0; tt < GT_TOKENS / 8; ++tt)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int row = row0 + 32 * warp + 16 * t + g + 8 * (k / 2), tok = tok0 + 8 * tt + 2 * c + k % 2;
                if (row >= n_rows || tok >= n_tok) continue;
                const size_t at = (size_t)tok * y_stride + row;
                Y[at] = add ? add[at] + acc[t][tt][k] : acc[t][tt][k];
            }
}

// Y_i (n_tok, rows_i) = X · W_iᵀ for up to three weights of one type (common.cuh fused_part; + add, as Y0, where
// not null), X (n_tok, n_cols) as f16; _split: in clusters of GT_SPLITS blocks (sm_90+), each a share of the columns.
// LAUNCH: block = 32 · GT_WARPS; grid = (ceil(n_tok / GT_TOKENS), Σ ceil(rows_i / GT_ROWS), 1 or, _split, GT_SPLITS);
// dynamic shared memory GT_STAGES · GT_STAGE_CHUNKS · 16 bytes; n_cols % 256 == 0 (Q8_0, Q5_0: % 128), _split:
// n_cols >= 256 · GT_SPLITS.
#if __CUDA_ARCH__ >= 900
#define GT_SPLIT_DIMS __cluster_dims__(1, 1, GT_SPLITS)
#else
#define GT_SPLIT_DIMS
#endif
#define GEMM_TILE_KERNEL(name, T, SPLIT, DIMS)                                                                 \
    extern "C" __global__ void DIMS __launch_bounds__(GT_WARPS * WARP, 2)                                         \
        name(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, const __half* X, float* Y0, float* Y1,      \
             float* Y2, const float* add, int rows0, int rows1, int rows2, int n_cols, int n_tok) {               \
        follow_previous_kernel();                                                                                 \
        int u = blockIdx.y;                                                                                       \
        const int i = fused_part(u, GT_ROWS, rows0, rows1), n_super = (n_cols + 255) / 256;                      \
        const int rows = pick(i, rows0, rows1, rows2);                                                            \
        gemm_tile<T, SPLIT>(pick(i, W0, W1, W2), X, pick(i, Y0, Y1, Y2), i == 0 ? add : nullptr, u * GT_ROWS,     \
                            rows, n_cols, n_cols, rows, blockIdx.x * GT_TOKENS, n_tok,                            \
                            blockIdx.z * n_super / gridDim.z, (blockIdx.z + 1) * n_super / gridDim.z);            \
    }
// A prompt's experts, its (token, slot) pairs grouped by expert (moe.cu moe_group: expert e's pairs are places
// offsets[e].. offsets[e + 1] - 1): Y's place p (n_rows) = X's place p (n_cols, f16 interleaved) · W_eᵀ, W_e the
// stacked weight's matrix e (matrix_bytes apart). Block x is the launch's tile x of 64 places, tiles[x] = (expert,
// its first place from offsets[e]), or expert -1: no tile (the grid is sized for the most a prompt may have).
// LAUNCH: block = 32 · GT_WARPS; grid = (tiles, ceil(n_rows / GT_ROWS)); gemm_tile_*'s shared memory and n_cols.
#define GEMM_TILE_EXPERTS_KERNEL(name, T)                                                                        \
    extern "C" __global__ void __launch_bounds__(GT_WARPS * WARP, 2)                                              \
        gemm_tile_experts_##name(const uint8_t* W, int64_t matrix_bytes, const int2* tiles, const int* offsets,   \
                                 const __half* X, float* Y, int n_rows, int n_cols) {                              \
        follow_previous_kernel();                                                                                 \
        const int2 tile = tiles[blockIdx.x];                                                                      \
        if (tile.x < 0) return;                                                                                   \
        const int first = offsets[tile.x];                                                                        \
        gemm_tile<T, false>(W + tile.x * matrix_bytes, X + (size_t)first * n_cols, Y + (size_t)first * n_rows,   \
                            nullptr, blockIdx.y * GT_ROWS, n_rows, n_cols, n_cols, n_rows, tile.y,                \
                            offsets[tile.x + 1] - first, 0, (n_cols + 255) / 256);                                \
    }
// Per-head matrices (MLA's attn_k_b and attn_v_b in a prompt): Y's row t, slice h (n_rows) = X's row t, slice h
// (n_cols, f16 interleaved) · W_hᵀ, W_h the stacked weight's matrix h (matrix_bytes apart).
// LAUNCH: block = 32 · GT_WARPS; grid = (ceil(n_tok / GT_TOKENS), ceil(n_rows / GT_ROWS), n_heads); gemm_tile_*'s
// shared memory and n_cols.
#define GEMM_TILE_HEADS_KERNEL(name, T)                                                                          \
    extern "C" __global__ void __launch_bounds__(GT_WARPS * WARP, 2)                                              \
        gemm_tile_heads_##name(const uint8_t* W, int64_t matrix_bytes, const __half* X, float* Y, int n_rows,      \
                               int n_cols, int n_tok) {                                                           \
        follow_previous_kernel();                                                                                 \
        const int h = blockIdx.z, n_heads = gridDim.z;                                                            \
        gemm_tile<T, false>(W + h * matrix_bytes, X + (size_t)h * n_cols, Y + (size_t)h * n_rows, nullptr,       \
                            blockIdx.y * GT_ROWS, n_rows, n_cols, n_heads * n_cols, n_heads * n_rows,             \
                            blockIdx.x * GT_TOKENS, n_tok, 0, (n_cols + 255) / 256);                              \
    }
#define GEMM_TILE_KERNELS(name, T)                                 \
    GEMM_TILE_KERNEL(gemm_tile_##name, T, false, )                 \
    GEMM_TILE_KERNEL(gemm_tile_split_##name, T, true, GT_SPLIT_DIMS) \
    GEMM_TILE_EXPERTS_KERNEL(name, T)                              \
    GEMM_TILE_HEADS_KERNEL(name, T)
GEMM_TILE_KERNELS(q4_K, TileQ4K)
GEMM_TILE_KERNELS(q6_K, TileQ6K)
GEMM_TILE_KERNELS(q8_0, TileQ80)
GEMM_TILE_KERNELS(q5_0, TileQ50)
#undef GEMM_TILE_KERNELS
#undef GEMM_TILE_HEADS_KERNEL
#undef GEMM_TILE_EXPERTS_KERNEL
#undef GEMM_TILE_KERNEL
