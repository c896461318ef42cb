// The decode matvec of Q4_K on tensor cores: y = x_deq · Wᵀ for one token, from the int16 x blocks
// matvec_x16.cu reads (x16.cuh), to the same sums: every weight quant times its x quant is an exact
// integer product, summed exactly in int32 over each 32-element sub-block, then scaled in float once.
// Why: there the int16 dot products (__dp2a) cost ~4 instructions a weight, and at that rate the
// H200 waits on instruction issue, not memory (docs/perf-notes.md, run 9); here ~1.9 (run 10: 8B's gate
// and up 30.7 -> 23.6 us). ops.py takes it for rows of 4,096 columns or more: narrower, it was slower.
//
// A (16 rows x 32 k) of a byte mma (mma.cuh) holds the quants as bytes, straight from the nibbles.
// B's 8 columns would be 8 tokens; with one token they carry the superblock's 8 sub-blocks instead
// ("slots"): B[k][n] is x's quant of k's element where that element lies in sub-block n, else 0, so
// C[row][n] is sub-block n's integer dot product, which the row's scale and min of n turn into a float.
// x's int16 quants go in as two byte planes, C = 256·C(high bytes, signed) + C(low bytes, unsigned):
// |C| <= 15 · 32767 · 32 < 2^24, exact in float too. The high nibbles go in as 16·q (one instruction
// fewer a word than shifting them down): their C is 16 times the sum, < 2^28 and a multiple of 16, so
// still exact in float, and the 16 comes off x's scale, a power of two: the same products to the bit.
//
// Lane (g, c) holds rows g + 8r of the block (r = 0..3: two tiles of 16) and the 16 bytes qs[64G + 16c ..]
// (G = 0, 1) of each row's superblock: elements 16h.. (h = c % 2) of sub-blocks 2j (low nibbles) and
// 2j + 1 (high) with j = 2G + c / 2, a word (4 elements) a k-group of the mma. As a B lane it holds
// the x of slot g, nonzero only in the mmas of that sub-block (G = g / 4, high nibbles iff g is odd)
// and only where its c covers the sub-block's elements it gives (c / 2 = g / 2 % 2): elements 16h..
// of sub-block g. Its C columns are slots 2c and 2c + 1: the lane scales sub-blocks 2c and 2c + 1.
// A block is 32 rows; its warps take every n-th superblock of them and meet in shared memory.
#include "common.cuh"
#include "mma.cuh"
#include "quant_blocks.cuh"
#include "rope.cuh"
#include "x16.cuh"

constexpr int XM_ROWS = 32;  // rows a block: two 16-row tiles a warp, each B (x) serving both
constexpr int XM_WARPS = 8;  // the most warps a block has, splitting its rows' superblocks

// The low nibbles (HIGH false) of a word's 4 bytes as 4 unsigned bytes, or its high ones as 16 times them.
template <bool HIGH>
__device__ __forceinline__ uint32_t nibbles(uint32_t w) {
    return w & (HIGH ? 0xF0F0F0F0u : 0x0F0F0F0Fu);
}

// What a lane reads of one superblock: its 4 rows' d, dmin and scales (head) and 16 bytes of each 64
// of quants; as a B lane x's 16 quants as bytes, 4 a word; the (d, d·Σq) of x's sub-blocks 2c, 2c + 1.
struct XmPart {
    uint4 head[4], qs[4][2];
    uint32_t high[4], low[4];
    float4 xd;
};

__device__ __forceinline__ void load_weights(XmPart& p, const uint8_t* const (&rows)[4], int s, int c) {
    load_q4_K_pieces<false>(rows, s, c, p.head, p.qs);
}

__device__ __forceinline__ void load_x(XmPart& p, const uint8_t* __restrict__ xq, const float2* __restrict__ xds, int s,
                                       int g, int c, bool b_lane) {
#pragma unroll
    for (int i = 0; i < 4; ++i) p.high[i] = p.low[i] = 0u;
    if (b_lane) {
        uint32_t w[8];
        x_words(xq + 2 * ((size_t)256 * s + 32 * g + 16 * (c % 2)), w);
#pragma unroll
        for (int i = 0; i < 4; ++i) p.high[i] = __byte_perm(w[2 * i], w[2 * i + 1], 0x7531), p.low[i] = __byte_perm(w[2 * i], w[2 * i + 1], 0x6420);
    }
    p.xd = __ldg(reinterpret_cast<const float4*>(xds + 8 * s + 2 * c));
}

// The superblock's products into the lane's 4 rows' sums (row g + 8r: acc[r]); own_mma: the mma (2G + high)
// whose B is the lane's x, or -1; scales: the lane's K4Scales(c). With TILES 1, the lane's rows of tile t0 alone
// (rows g + 16t0, g + 16t0 + 8), p holding them first.
// A row's sub-blocks a = 2c and b = 2c + 1 add d·(xd_a·sc_a·Σa + xd_b·sc_b·Σb) - dmin·(m_a·xΣ_a + m_b·xΣ_b),
// where (xd, xΣ) are x's (d, d·Σq) and Σa, Σb the exact integer sums: sc·Σ is one too (< 63·2^24), so a scale
// never becomes a float of its own (matvec_x16_bulk_q4_K's stage: 312 SASS instructions a warp, 362 with d·sc and
// dmin·m as floats).
template <int TILES = 2>
__device__ __forceinline__ void multiply_part(const XmPart& p, const K4Scales& scales, int own_mma, float (&acc)[4],
                                              int t0 = 0) {
    int ch[TILES][4] = {}, cl[TILES][4] = {};
#pragma unroll
    for (int m = 0; m < 4; ++m) {  // G = m / 2; high nibbles for odd m
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // the lane's words 2h, 2h + 1
            const bool own = m == own_mma;
            const uint32_t bh[2] = {own ? p.high[2 * h] : 0u, own ? p.high[2 * h + 1] : 0u};
            const uint32_t bl[2] = {own ? p.low[2 * h] : 0u, own ? p.low[2 * h + 1] : 0u};
#pragma unroll
            for (int t = 0; t < TILES; ++t) {
                const uint4 &u0 = p.qs[2 * t][m / 2], &u1 = p.qs[2 * t + 1][m / 2];
                const uint32_t w0[2] = {h ? u0.z : u0.x, h ? u0.w : u0.y}, w1[2] = {h ? u1.z : u1.x, h ? u1.w : u1.y};
                uint32_t a[4];
                if (m % 2)
                    a[0] = nibbles<true>(w0[0]), a[1] = nibbles<true>(w1[0]), a[2] = nibbles<true>(w0[1]), a[3] = nibbles<true>(w1[1]);
                else
                    a[0] = nibbles<false>(w0[0]), a[1] = nibbles<false>(w1[0]), a[2] = nibbles<false>(w0[1]), a[3] = nibbles<false>(w1[1]);
                mma_u8_16832<false>(ch[t], a, bh);
                mma_u8_16832<true>(cl[t], a, bl);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2 * TILES; ++r) {  // row g + 8r: tile r / 2, C's row g (+ 8 for odd r)
        const uint32_t hd[4] = {p.head[r].x, p.head[r].y, p.head[r].z, p.head[r].w};
        const uint32_t sm = scales.bytes(hd);
        const int k = 2 * (r % 2), t = r / 2;
        // sub-block b's nibbles came in as 16·q: both of its byte planes' sums are multiples of 16
        const int sum_a = 256 * ch[t][k] + cl[t][k], sum_b = 16 * ch[t][k + 1] + (cl[t][k + 1] >> 4);
        const float dots = fmaf(p.xd.x, (float)((int)(sm & 0xFF) * sum_a),
                                p.xd.z * (float)((int)(sm >> 8 & 0xFF) * sum_b));
        const float mins = fmaf(p.xd.y, (float)(sm >> 16 & 0xFF), p.xd.w * (float)(sm >> 24));
        const float d = f16_to_float(hd[0] & 0xFFFF), dmin = f16_to_float(hd[0] >> 16);
        if (TILES == 1 && t0)
            acc[(r + 2) % 4] = fmaf(d, dots, fmaf(-dmin, mins, acc[(r + 2) % 4]));
        else
            acc[r] = fmaf(d, dots, fmaf(-dmin, mins, acc[r]));
    }
}

// A group of 32 rows done, by one warp (lane l: row row0 + l): the warps' partial sums of each row in order,
// times scale (x16.cuh norm_scale: 1 but for a norm's readers), plus add where given, into y; then,
// with norm.w, the group's share of the norm of y (rows of whole groups: every lane's row is in). Returns the lane's.
template <int WARPS>
__device__ __forceinline__ float store_group(const float (&partial)[WARPS][XM_ROWS], int n_warps, float* __restrict__ y,
                                             const float* __restrict__ add, int row0, int n_rows, float scale,
                                             const NormOut& norm) {
    const int lane = threadIdx.x % WARP, row = row0 + lane;
    float v = 0.0f;
    for (int w = 0; w < n_warps; ++w) v += partial[w][lane];
    v *= scale;
    if (row < n_rows) {
        if (add) v += add[row];
        y[row] = v;
    }
    if (norm.w) store_normed(v, row, norm);
    return v;
}

// Rows row0.. row0 + 31 of y for one token; every thread of the block calls it, and it waits for the
// kernel before (follow_previous_kernel) once the warp's first superblock of weights, which no kernel
// writes, is asked for: a block launched while that kernel runs has them in flight meanwhile. x_sums: x is
// a norm's output (x16.cuh NormOut); norm.w: the next norm's share is written.
__device__ __forceinline__ void matvec_mma_q4_K(const uint8_t* __restrict__ W, const uint8_t* __restrict__ xq,
                                                const float2* __restrict__ xds, float* __restrict__ y,
                                                const float* __restrict__ add, int row0, int n_rows, int n_cols,
                                                const float* x_sums, float eps, const NormOut& norm) {
    __shared__ float partial[XM_WARPS][XM_ROWS];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, n_warps = blockDim.x / WARP;
    const int g = lane / 4, c = lane % 4, n_super = n_cols / 256;
    const size_t stride = row_bytes<block_q4_K>(n_cols);
    const uint8_t* rows[4];
#pragma unroll
    for (int r = 0; r < 4; ++r)  // rows past n_rows re-read the last one and are never stored
        rows[r] = W + (size_t)min(row0 + g + 8 * r, n_rows - 1) * stride;
    const int own_mma = c / 2 == g / 2 % 2 ? 2 * (g / 4) + g % 2 : -1;
    const K4Scales scales(c);

    float acc[4] = {};
    XmPart part;
    if (warp < n_super) load_weights(part, rows, warp, c);
    follow_previous_kernel();
    const float scale = x_sums ? norm_scale(x_sums, n_cols, eps) : 1.0f;
    for (int s = warp; s < n_super; s += n_warps) {
        if (s != warp) load_weights(part, rows, s, c);
        load_x(part, xq, xds, s, g, c, own_mma >= 0);
        multiply_part(part, scales, own_mma, acc);
    }

#pragma unroll
    for (int r = 0; r < 4; ++r) {  // the row's 4 lanes (its 8 slots), then the warps in order
        float v = acc[r];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        if (c == 0) partial[warp][g + 8 * r] = v;
    }
    __syncthreads();
    if (warp == 0) store_group(partial, n_warps, y, add, row0, n_rows, scale, norm);
}

// y_i (rows_i) = x_deq · W_iᵀ for one token and up to three Q4_K weights (common.cuh fused_part; + add,
// as y0, where not null), from the int16 blocks xq, xds of x (n_cols); as matvec_x16_1_<type>, it may read
// a norm's output (x_sums, eps) and, with one weight of whole groups, write the next norm's share (norm_w ...).
// LAUNCH: block = 32 · min(XM_WARPS, n_cols / 256); grid = Σ ceil(rows_i / XM_ROWS); n_cols % 256 == 0.
extern "C" __global__ void __launch_bounds__(XM_WARPS * WARP, 2)
    matvec_x16_mma_q4_K(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, const uint8_t* xq, const float2* xds,
                        float* y0, float* y1, float* y2, const float* add, int rows0, int rows1, int rows2, int n_cols,
                        const float* x_sums, float eps, const float* norm_w, uint8_t* norm_xq, float2* norm_xds,
                        float* norm_sums, int* tickets) {
    int u = blockIdx.x;
    const int i = fused_part(u, XM_ROWS, rows0, rows1);
    matvec_mma_q4_K(pick(i, W0, W1, W2), xq, xds, pick(i, y0, y1, y2), i == 0 ? add : nullptr, u * XM_ROWS,
                    pick(i, rows0, rows1, rows2), n_cols, x_sums, eps, {norm_w, norm_xq, norm_xds, norm_sums, tickets});
}

// The same products with the weights streamed into shared memory by the copy engine (sm_90's
// cp.async.bulk): the register kernel above asks for a superblock, waits, multiplies, asks for the
// next, so its SMs idle between its warps' round trips and reach ~2.5 TB/s on the H200 (docs/perf-notes.md,
// runs 10-15); here a block's ring of XB_STAGES stages keeps the next in flight while it multiplies one, its
// grid fills the SMs XB_BLOCKS_AN_SM deep and each block walks its groups of 32 rows in turn, so
// that memory need not wait for the multiplies (8B's gate + up: 2.7 TB/s, DRAM 56% busy, run 16).
// A stage is 32 rows x SB superblocks (one a warp; in the wide form two warps a superblock), a row's
// segment one bulk copy (lane r of warp 0 copies row r) onto an mbarrier; the even rows' segments lie
// first, then the odd rows' 64 bytes further on, so that the 8 lanes of a 16-byte shared load (rows g
// and g + 1, 64 bytes each) touch 32 different banks (yet ncu counted 3.9-way conflicts on 16% of the
// wavefronts).
template <int SB>
struct BulkStage {
    static constexpr int SEG = SB * (int)sizeof(block_q4_K);  // a row's bytes in a stage
    static constexpr int ODD = (XM_ROWS / 2) * SEG + 64;  // where a stage's odd rows begin
    static constexpr int BYTES = ODD + (XM_ROWS / 2) * SEG;
    static_assert(SEG % 16 == 0 && ODD % 128 == 64 && BYTES % 16 == 0, "bulk copies move 16-byte units");
    // where row r's segment lies in a stage
    static __device__ __forceinline__ int offset(int r) { return (r % 2 ? ODD : 0) + (r / 2) * SEG; }
    static __device__ __forceinline__ uint8_t* row(uint8_t* stage, int r) { return stage + offset(r); }
};
// a block's ring of stages: with 2 blocks an SM, 2 of 36.9 KB each keep ~74 KB in flight an SM, past what memory's
// latency asks (~30 KB a microsecond at 4 TB/s); 3 measured 1% slower (H200, 8B Q4_K_M decode 417.5 against
// 421.7 tok/s, docs/perf-notes.md run 18), the SM's L1 left 37 KB less for x
constexpr int XB_STAGES = 2;
constexpr int XB_BLOCKS_AN_SM = 2;
// the wide form's (matvec_x16_bulk16_q4_K) warps, two a superblock of its stages, its blocks one an SM, its ring and
// its registers: 16 warps of 72 and the next launch's block of 8 warps of 112 (the rope form's 106, allocated by 8)
// fill an SM's 64K, its 3 stages and that block's 2 its shared memory
constexpr int XB_WIDE_WARPS = 16, XB_WIDE_STAGES = 3, XB_WIDE_REGISTERS = 72;

__device__ __forceinline__ uint32_t shared_address(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// An mbarrier for one arrival (the producing lane's) and the bytes its copies bring.
__device__ __forceinline__ void bulk_barrier_init(uint64_t* bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// bytes global -> shared on the copy engine, counted on bar; the stage's producer first announces
// the stage's bytes (bulk_expect).
__device__ __forceinline__ void bulk_expect(uint64_t* bar, uint32_t bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(shared_address(dst)), "l"(src), "r"(bytes), "r"(shared_address(bar)) : "memory");
#else
    __trap();
#endif
}

// Until bar's phase of that parity has completed: its stage's bytes have all arrived.
__device__ __forceinline__ void bulk_wait(uint64_t* bar, uint32_t parity) {
#if __CUDA_ARCH__ >= 900
    asm volatile("{\n .reg .pred done;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 " @!done bra WAIT;\n}" ::"r"(shared_address(bar)), "r"(parity) : "memory");
#endif
}

// A bulk kernel's step k: stage `col` of the block's group `group` (k = group · per_group + col), counted as k goes,
// not divided out of it (a division by per_group: 29 of matvec_x16_bulk_q4_K's 401 SASS instructions a stage).
struct BulkStep {
    int col, group;
    __device__ __forceinline__ void next(int per_group) { col + 1 < per_group ? ++col : (col = 0, ++group); }
    // the step `ahead` steps on
    __device__ __forceinline__ BulkStep after(int ahead, int per_group) const {
        BulkStep s = *this;
#pragma unroll
        for (int i = 0; i < ahead; ++i) s.next(per_group);
        return s;
    }
};

// What matvec_mma_q4_K's lane loads of its superblock, from a stage: the pieces load_q4_K_pieces reads, from shared
// addresses. Rows g + 16·t0 + 8r lie 4r segments past row g + 16·t0 (BulkStage::offset), so the 12 loads are one
// address and constants: `at`, the lane's first row's superblock in the stage (staged_at), its quants 16 + 16c on.
// (Each row's address worked out in the loop, as before, took a stage 10 SASS instructions more.)
template <int SB, int TILES>
__device__ __forceinline__ void load_staged(XmPart& p, const uint8_t* stage, int at, int c) {
    const uint8_t *head = stage + at, *qs = head + 16 * (1 + c);
#pragma unroll
    for (int r = 0; r < 2 * TILES; ++r) {
        p.head[r] = *reinterpret_cast<const uint4*>(head + 4 * r * BulkStage<SB>::SEG);
        p.qs[r][0] = *reinterpret_cast<const uint4*>(qs + 4 * r * BulkStage<SB>::SEG);
        p.qs[r][1] = *reinterpret_cast<const uint4*>(qs + 4 * r * BulkStage<SB>::SEG + 64);
    }
}

// load_staged's `at`: superblock sl of row g + 16·t0.
template <int SB>
__device__ __forceinline__ int staged_at(int sl, int g, int t0) {
    return BulkStage<SB>::offset(g + 16 * t0) + (int)sizeof(block_q4_K) * sl;
}

// Every group of 32 rows blockIdx.x + k·gridDim.x of the fused weights (common.cuh fused_part); every
// thread of the block calls it. Its stages' copies start before the wait for the kernel before. With rope, the
// storing warp makes q and k's rope after the block's groups (rope.cuh RopeOut): a kernel of its own, since that
// code beside the loop took the kernel from 103 registers to 111-122, past what two blocks and an early one of the
// next launch fit (docs/perf-notes.md run 33).
// SB: superblocks a stage (WARPS, or WARPS / 2 with two warps a superblock); STAGES: its ring.
template <int WARPS, int SB = WARPS, int STAGES = XB_STAGES>
__device__ __forceinline__ void matvec_bulk_q4_K(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2,
                                                 const uint8_t* __restrict__ xq, const float2* __restrict__ xds,
                                                 float* y0, float* y1, float* y2, const float* __restrict__ add,
                                                 int rows0, int rows1, int rows2, int n_cols, const float* x_sums,
                                                 float eps, const NormOut& norm, const RopeOut* rope) {
    const BlockClock clocked;
    extern __shared__ __align__(128) uint8_t stages[];
    __shared__ uint64_t full[STAGES];
    __shared__ float partial[2][WARPS][XM_ROWS];  // by the group's parity: the last one's may still be read
    using Stage = BulkStage<SB>;
    constexpr int TILES = 2 * SB / WARPS;  // a warp's tiles of 16 rows: both, or (two warps a superblock) tile warp / SB
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int g = lane / 4, c = lane % 4, per_group = n_cols / 256 / SB;
    const int n_groups = (rows0 + XM_ROWS - 1) / XM_ROWS + (rows1 + XM_ROWS - 1) / XM_ROWS + (rows2 + XM_ROWS - 1) / XM_ROWS;
    const int n_steps = (n_groups - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x * per_group;
    const size_t stride = row_bytes<block_q4_K>(n_cols);
    if (threadIdx.x == 0)
        for (int i = 0; i < STAGES; ++i) bulk_barrier_init(&full[i]);
    __syncthreads();

    // step k (BulkStep at): in slot k % STAGES
    auto group_of = [&](const BulkStep& at, int& i) {
        int u = blockIdx.x + at.group * gridDim.x;
        i = fused_part(u, XM_ROWS, rows0, rows1);
        return u;
    };
    auto issue = [&](int k, const BulkStep& at) {  // warp 0
        int i;
        const int u = group_of(at, i), n_rows = pick(i, rows0, rows1, rows2);
        uint64_t* bar = &full[k % STAGES];
        if (lane == 0) bulk_expect(bar, XM_ROWS * Stage::SEG);
        __syncwarp();
        const uint8_t* row = pick(i, W0, W1, W2) + (size_t)min(u * XM_ROWS + lane, n_rows - 1) * stride;  // past n_rows: never stored
        bulk_copy(Stage::row(stages + k % STAGES * Stage::BYTES, lane), row + (size_t)at.col * Stage::SEG, Stage::SEG, bar);
    };
    if (warp == 0)
        for (int k = 0; k < min(STAGES, n_steps); ++k) issue(k, BulkStep{0, 0}.after(k, per_group));
    if (warp == WARPS - 1 && n_steps > 0) {  // the warp storing the first group
        int i;
        const int row0 = group_of(BulkStep{0, 0}, i) * XM_ROWS;
        ask_l2_for_store_reads(i == 0 ? add : nullptr, norm.w, row0);
    }
    follow_previous_kernel();
    // the norm's scale, which only the storing warp uses: the others go to their first stage without its trip to L2
    // (H200, 8B Q4_K_M decode +1.2%, docs/perf-notes.md run 42)
    const float scale = x_sums && warp == WARPS - 1 ? norm_scale(x_sums, n_cols, eps) : 1.0f;

    const int own_mma = c / 2 == g / 2 % 2 ? 2 * (g / 4) + g % 2 : -1;
    const K4Scales scales(c);
    float acc[4] = {};
    int due = -1;  // the q or k head the block's stores completed (rope_after_store)
    BulkStep at{0, 0};
    // the warp's superblock and tile; with TILES 2 (SB == WARPS) warp and 0 as such: the compiler does not know
    // warp < WARPS, and the 8-warp kernels' code stays as it was
    const int sl = TILES == 2 ? warp : warp % SB, t0 = TILES == 2 ? 0 : warp / SB;
    const int staged = staged_at<SB>(sl, g, t0);
    for (int k = 0; k < n_steps; ++k, at.next(per_group)) {
        bulk_wait(&full[k % STAGES], k / STAGES % 2);
        clock_step(k, false);
        XmPart part;
        load_staged<SB, TILES>(part, stages + k % STAGES * Stage::BYTES, staged, c);
        load_x(part, xq, xds, at.col * SB + sl, g, c, own_mma >= 0);
        multiply_part<TILES>(part, scales, own_mma, acc, t0);
        const bool last = at.col == per_group - 1;
        float(&mine)[WARPS][XM_ROWS] = partial[at.group % 2];
        if (last) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {  // the row's 4 lanes, then the warps in order
                float v = acc[r];
                v += __shfl_xor_sync(0xffffffffu, v, 1);
                v += __shfl_xor_sync(0xffffffffu, v, 2);
                if (c == 0) mine[warp][g + 8 * r] = v;
                acc[r] = 0.0f;
            }
        }
        __syncthreads();  // the slot is free, the group's partial sums are in
        clock_step(k, true);
        if (last && warp == WARPS - 1) {  // the other warps go on to the next stage; warp 0 asks for the next one
            int i;
            const int u = group_of(at, i), n_rows = pick(i, rows0, rows1, rows2);
            const float v = store_group(mine, WARPS, pick(i, y0, y1, y2), i == 0 ? add : nullptr, u * XM_ROWS, n_rows,
                                        scale, norm);
            if (rope) due = rope_after_store<XM_ROWS>(*rope, i, u * XM_ROWS, n_rows, v);
        }
        if (warp == 0 && k + STAGES < n_steps) issue(k + STAGES, at.after(STAGES, per_group));
    }
    if (rope && due >= 0 && warp == WARPS - 1) rope_head(*rope, due);
}

// As matvec_x16_mma_q4_K, sm_90 on, for n_cols % (256 · XM_WARPS) == 0 and weights at 16-byte addresses (bulk
// copies).
// LAUNCH: block = 32 · XM_WARPS; grid = min(Σ ceil(rows_i / XM_ROWS), XB_BLOCKS_AN_SM · SMs); dynamic
// shared memory XB_STAGES · BulkStage<XM_WARPS>::BYTES.
// matvec_x16_bulk16_q4_K: the same at XB_WIDE_WARPS warps a block, two a superblock of each stage (a tile of 16 rows
// each), one block an SM, for launches of at most one group of rows an SM whose rows take several stages (8B's Q4_K
// downs: 128 groups of 48 superblocks): one block of 8 warps an SM multiplied their stages in turn, each bound by its
// warps' chains of dependent mmas, at 1.8 TB/s. Run 34's form, 16 warps a stage of 16 superblocks, took the down 15.5 ->
// 8.9 us, but its 147 KB ring and 53K registers left the next launch no room to start beside it (its q, k (v) 11.2 /
// 7.1 us against 7.5 / 4.6); in XB_WIDE_STAGES stages of 8 and XB_WIDE_REGISTERS registers (then 8 bytes spilled) the
// down takes 13.2 us, the next launch 7.6 / 4.9 again (H200, Qwen3-8B Q4_K_M decode +0.4%; docs/perf-notes.md run 35).
// LAUNCH: block = 32 · XB_WIDE_WARPS; grid = Σ ceil(rows_i / XM_ROWS) (at most SMs); dynamic shared memory
// XB_WIDE_STAGES · BulkStage<XM_WARPS>::BYTES.
#define MATVEC_BULK_KERNEL(suffix, REGISTERS, warps, sb, ring)                                                \
    extern "C" __global__ void REGISTERS                                                                      \
        matvec_x16_bulk##suffix(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, const uint8_t* xq,   \
                                const float2* xds, float* y0, float* y1, float* y2, const float* add, int rows0, \
                                int rows1, int rows2, int n_cols, const float* x_sums, float eps,            \
                                const float* norm_w, uint8_t* norm_xq, float2* norm_xds, float* norm_sums,   \
                                int* tickets) {                                                              \
        matvec_bulk_q4_K<warps, sb, ring>(W0, W1, W2, xq, xds, y0, y1, y2, add, rows0, rows1, rows2, n_cols, x_sums,  \
                                          eps, {norm_w, norm_xq, norm_xds, norm_sums, tickets}, nullptr);     \
    }
#define XB_BOUNDS __launch_bounds__(XM_WARPS * WARP, XB_BLOCKS_AN_SM)
#define XB_WIDE_BOUNDS __maxnreg__(XB_WIDE_REGISTERS)
MATVEC_BULK_KERNEL(_q4_K, XB_BOUNDS, XM_WARPS, XM_WARPS, XB_STAGES)
MATVEC_BULK_KERNEL(16_q4_K, XB_WIDE_BOUNDS, XB_WIDE_WARPS, XM_WARPS, XB_WIDE_STAGES)
#undef XB_BOUNDS
#undef XB_WIDE_BOUNDS
#undef MATVEC_BULK_KERNEL

// The same with q and k's rope and the cache's writes (rope.cuh RopeOut), for a one-token pass's launch making q, k
// and v (its tickets), at most one group of rows a block (ops.py: a block's one due head).
extern "C" __global__ void __launch_bounds__(XM_WARPS * WARP, XB_BLOCKS_AN_SM)
    matvec_x16_bulk_rope_q4_K(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, const uint8_t* xq,
                              const float2* xds, float* y0, float* y1, float* y2, int rows0, int rows1, int rows2,
                              int n_cols, const float* x_sums, float eps, ROPE_OUT_PARAMS) {
    const RopeOut rope = ROPE_OUT;
    matvec_bulk_q4_K<XM_WARPS>(W0, W1, W2, xq, xds, y0, y1, y2, nullptr, rows0, rows1, rows2, n_cols, x_sums, eps, {},
                               &rope);
}
