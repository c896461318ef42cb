// x as the int16 blocks matvec_x16.cu's kernels read: per block of 32 consecutive elements of the
// flat (T, n_cols) array, d = max |x| / 32767, xq = quant16(x, d) (0 where d is 0, from an all-zero
// block or by underflow), and xds = (d, d·Σq). quantize_x16 makes them from x; a kernel that makes
// a matvec's input may write them beside it (ops.py then skips quantize_x16): the same bits either way.
#pragma once
#include "common.cuh"
#include "quant_blocks.cuh"

// rint(v / d), clamped: a subnormal d keeps so few bits that max |x| / d may pass 32767.
__device__ __forceinline__ int quant16(float v, float d) {
    return (int)rintf(fminf(fmaxf(__fdiv_rn(v, d), -32767.0f), 32767.0f));
}

// The int16 form of elements N·i .. N·i + N - 1, v, held by one lane of the 32 / N lanes (aligned in
// the warp) that hold their block. Every lane of the warp calls it; lanes with `in` false (past
// the end) take part in the group's shuffles and store nothing.
template <int N>
__device__ __forceinline__ void store_x16(const float (&v)[N], bool in, int i, uint8_t* __restrict__ xq,
                                          float2* __restrict__ xds) {
    constexpr int LANES = 32 / N;
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < N; ++k) amax = fmaxf(amax, fabsf(v[k]));
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = __fdiv_rn(amax, 32767.0f);
    int q[N] = {}, sum = 0;
#pragma unroll
    for (int k = 0; k < N; ++k) {
        if (d > 0.0f) q[k] = quant16(v[k], d);
        sum += q[k];
    }
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (!in) return;
    if constexpr (N == 4) {
        reinterpret_cast<uint2*>(xq)[i] = make_uint2((q[0] & 0xFFFF) | (uint32_t)q[1] << 16, (q[2] & 0xFFFF) | (uint32_t)q[3] << 16);
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k) reinterpret_cast<int16_t*>(xq)[N * i + k] = (int16_t)q[k];
    }
    if (i % LANES == 0) xds[i / LANES] = make_float2(d, d * (float)sum);
}

// ---- The weights' side of the int16 dot products (matvec_x16.cu's kernels) ----

// c + the dot product of the four signed bytes of w with four int16: x01 (elements 0, 1) and x23.
__host__ __device__ __forceinline__ int dot4_x16(uint32_t w, uint32_t x01, uint32_t x23, int c) {
#ifdef __CUDA_ARCH__
    return __dp2a_hi((int)x23, (int)w, __dp2a_lo((int)x01, (int)w, c));
#else
    const uint32_t x[2] = {x01, x23};
    for (int i = 0; i < 4; ++i) c += (int8_t)(w >> 8 * i) * (int16_t)(x[i / 2] >> 16 * (i % 2));
    return c;
#endif
}

// Each byte of w (0..127) minus c, as a signed byte: setting bit 7 first keeps borrows inside bytes.
__host__ __device__ __forceinline__ uint32_t sub_bytes(uint32_t w, uint32_t c) {
    return ((w | 0x80808080u) - c * 0x01010101u) ^ 0x80808080u;
}

// 32 elements of a weight row, as two runs of 16 that each share one scale: signed-byte values a
// and b (elements k0.. and k1.. of the row), each run's value sa·a_i - ma (sb·b_i - mb). The runs
// lie in x blocks k0 / 32 and k1 / 32, and where they are halves of one, ma and mb are half the
// offset of that block's 32 elements, which the dot product applies through the block's sum.
struct x16_unit {
    uint32_t a[4], b[4];
    float sa, sb, ma, mb;

    // Σ over the unit of weight · x_deq for one token: xa, xb the int16 words of its runs, da, db
    // their blocks' (d, d·Σq). |Σ| <= 16 · 128 · 32767 < 2^31.
    template <bool has_min>
    __host__ __device__ __forceinline__ float dot(const uint32_t (&xa)[8], const uint32_t (&xb)[8], float2 da, float2 db) const {
        int ia = 0, ib = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            ia = dot4_x16(a[i], xa[2 * i], xa[2 * i + 1], ia);
            ib = dot4_x16(b[i], xb[2 * i], xb[2 * i + 1], ib);
        }
        float s = fmaf(sa * da.x, (float)ia, sb * db.x * (float)ib);
        if constexpr (has_min) s -= fmaf(ma, da.y, mb * db.y);
        return s;
    }
};

// Per type: n_cols / 32 units a row; runs(u, k0, k1); load(row, u, unit); one_block where a unit's
// runs are the two halves of one x block.
template <class B> struct x16_type;

// Unit u of Q8_0: block u, its first 16 quants run a, the next 16 run b.
template <> struct x16_type<block_q8_0> {
    static constexpr bool has_min = false, one_block = true;
    __host__ __device__ static void runs(int u, int& k0, int& k1) { k0 = 32 * u, k1 = 32 * u + 16; }
    __host__ __device__ static void load(const uint8_t* row, int u, x16_unit& w) {
        const uint8_t* b = row + (size_t)34 * u;
        uint32_t q[8];
        load_words_shifted(b + 2, q);  // reach: the block's d, the next block's d or the carve's padding
#pragma unroll
        for (int i = 0; i < 4; ++i) w.a[i] = q[i], w.b[i] = q[i + 4];
        w.sa = w.sb = f16_to_float(load_u16(b)), w.ma = w.mb = 0.0f;
    }
};

// Unit u of Q4_0: block u, low nibbles run a, high nibbles run b, each minus 8.
template <> struct x16_type<block_q4_0> {
    static constexpr bool has_min = false, one_block = true;
    __host__ __device__ static void runs(int u, int& k0, int& k1) { k0 = 32 * u, k1 = 32 * u + 16; }
    __host__ __device__ static void load(const uint8_t* row, int u, x16_unit& w) {
        const uint8_t* b = row + (size_t)18 * u;
        uint32_t q[4];
        load_words_shifted(b + 2, q);  // reach: as Q8_0's
#pragma unroll
        for (int i = 0; i < 4; ++i) w.a[i] = sub_bytes(q[i] & 0x0F0F0F0F, 8), w.b[i] = sub_bytes(q[i] >> 4 & 0x0F0F0F0F, 8);
        w.sa = w.sb = f16_to_float(load_u16(b)), w.ma = w.mb = 0.0f;
    }
};

// Unit u of Q5_0: as Q4_0, bit 4 of element j from bit j of qh, each minus 16.
template <> struct x16_type<block_q5_0> {
    static constexpr bool has_min = false, one_block = true;
    __host__ __device__ static void runs(int u, int& k0, int& k1) { k0 = 32 * u, k1 = 32 * u + 16; }
    __host__ __device__ static void load(const uint8_t* row, int u, x16_unit& w) {
        const uint8_t* b = row + (size_t)22 * u;
        uint32_t q[4], qh[1];
        load_words_shifted(b + 2, qh);  // reach: d before, qs after
        load_words_shifted(b + 6, q);  // reach: qh before; the next block's d or the carve's padding after
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w.a[i] = sub_bytes((q[i] & 0x0F0F0F0F) | spread4(qh[0] >> (4 * i)) << 4, 16);
            w.b[i] = sub_bytes((q[i] >> 4 & 0x0F0F0F0F) | spread4(qh[0] >> (16 + 4 * i)) << 4, 16);
        }
        w.sa = w.sb = f16_to_float(load_u16(b)), w.ma = w.mb = 0.0f;
    }
};

// Unit u of Q4_K/Q5_K: the 16 bytes qs[32j + 16h ..] of block u / 8 (j = u % 8 / 2, h = u % 2):
// elements 16h.. of sub-chunk 2j in their low nibbles (run a), of sub-chunk 2j + 1 in their high
// ones (run b); Q5_K adds bit 2j (2j + 1) of qh[16h ..] as bit 4. Each run is half its x block.
template <class B>
__host__ __device__ __forceinline__ void load_k4_unit(const uint8_t* row, int u, x16_unit& w) {
    const B& b = reinterpret_cast<const B*>(row)[u / 8];
    const int j = u % 8 / 2, h = u % 2;
    uint32_t hd[4], q[4];
    load_words<16>(reinterpret_cast<const uint8_t*>(&b), hd);
    load_words<16>(b.qs + 32 * j + 16 * h, q);
#pragma unroll
    for (int i = 0; i < 4; ++i) w.a[i] = q[i] & 0x0F0F0F0F, w.b[i] = q[i] >> 4 & 0x0F0F0F0F;
    if constexpr (sizeof(B) == sizeof(block_q5_K)) {
        uint32_t hb[4];
        load_words<16>(b.qh + 16 * h, hb);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w.a[i] |= (hb[i] >> (2 * j) & 0x01010101) << 4;
            w.b[i] |= (hb[i] >> (2 * j + 1) & 0x01010101) << 4;
        }
    }
    scale_min_k4_pair(hd, j, w.sa, w.ma, w.sb, w.mb);
    w.ma *= 0.5f, w.mb *= 0.5f;
}

template <> struct x16_type<block_q4_K> {
    static constexpr bool has_min = true, one_block = false;
    __host__ __device__ static void runs(int u, int& k0, int& k1) {
        k0 = 256 * (u / 8) + 64 * (u % 8 / 2) + 16 * (u % 2), k1 = k0 + 32;
    }
    __host__ __device__ static void load(const uint8_t* row, int u, x16_unit& w) { load_k4_unit<block_q4_K>(row, u, w); }
};

template <> struct x16_type<block_q5_K> {
    static constexpr bool has_min = true, one_block = false;
    __host__ __device__ static void runs(int u, int& k0, int& k1) { x16_type<block_q4_K>::runs(u, k0, k1); }
    __host__ __device__ static void load(const uint8_t* row, int u, x16_unit& w) { load_k4_unit<block_q5_K>(row, u, w); }
};

// Four 6-bit quants q as the signed bytes 4q - 128 = 4(q - 32): their low 4 bits from bits 2-5 of low's bytes, their
// top 2 from bits 6-7 of high's, the top one flipped there (4q - 128's sign bit is q's top bit flipped). With the
// shifts that place those bits, 4.5 instructions a word of four quants, where q - 32 as a byte took 7-8.
__host__ __device__ __forceinline__ uint32_t q6_times_4(uint32_t low, uint32_t high) {
    return (low & 0x3C3C3C3Cu) | (high & 0xC0C0C0C0u);
}

// Unit u of Q6_K: in block u / 8, v = u % 8 picks half h = v / 4, kk = v / 2 % 2 and l0 = 16(v % 2):
// the 16 bytes ql[64h + 32kk + l0 ..] hold elements l0.. of quarter kk of the half in their low
// nibbles (run a) and of quarter kk + 2 in their high ones (run b), qh[32h + l0 ..] their bits 4-5.
// The quants go in as 4(q - 32) and the scales as d·sc / 4 (d / 4 is exact): the same products, to the bit, but
// where scale times x's scale is a float32 subnormal (or overflows): an x block of |x| < ~1e-26 (or > ~1e36).
template <> struct x16_type<block_q6_K> {
    static constexpr bool has_min = false, one_block = false;
    __host__ __device__ static void runs(int u, int& k0, int& k1) {
        const int v = u % 8;
        k0 = 256 * (u / 8) + 128 * (v / 4) + 32 * (v / 2 % 2) + 16 * (v % 2), k1 = k0 + 64;
    }
    __host__ __device__ static void load(const uint8_t* row, int u, x16_unit& w) {
        const block_q6_K& b = reinterpret_cast<const block_q6_K*>(row)[u / 8];
        const int v = u % 8, h = v / 4, kk = v / 2 % 2, l0 = 16 * (v % 2);
        // reach: before ql[0], the previous block's d (a tensor's first block is 16-byte aligned:
        // none); past either run, more of this block
        uint32_t lo[4], hi[4];
        load_words_shifted(b.ql + 64 * h + 32 * kk + l0, lo);
        load_words_shifted(b.qh + 32 * h + l0, hi);
        const uint32_t top = 0x22222222u << (2 * kk);  // the runs' top bits: bits 2kk + 1 and 2kk + 5 of qh
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t flipped = hi[i] ^ top;
            w.a[i] = q6_times_4(lo[i] << 2, flipped << (6 - 2 * kk));
            w.b[i] = q6_times_4(lo[i] >> 2, flipped << (2 - 2 * kk));
        }
        const float d4 = __half2float(b.d) * 0.25f;
        const int s = 8 * h + 2 * kk + l0 / 16;
        w.sa = mul_rn(d4, (float)b.scales[s]), w.sb = mul_rn(d4, (float)b.scales[s + 4]), w.ma = w.mb = 0.0f;
    }
};

// 16 int16 of x (8 words) at a 32-byte aligned p, through the read-only path (L1, shared by the blocks on an SM).
__host__ __device__ __forceinline__ void x_words(const uint8_t* p, uint32_t (&w)[8]) {
#ifdef __CUDA_ARCH__
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int4 v = __ldg(reinterpret_cast<const int4*>(p) + i);
        w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
#else
    load_words<16>(p, w);
#endif
}

// Before a one-token matvec's wait, by one warp: asks L2 for the lines its store reads last for rows row0.., the
// residual it adds (or null) and the next norm's weight (or null), beside its first weights. A request, not a read:
// it races nothing the kernel before writes, and the norm's weight, which no kernel writes, came from DRAM on the
// step's path (docs/perf-notes.md run 32).
__device__ __forceinline__ void ask_l2_for_store_reads(const float* add, const float* norm_w, int row0) {
    const int lane = threadIdx.x % WARP;
    if (lane == 0 && add) prefetch_l2(add + row0);
    if (lane == 1 && norm_w) prefetch_l2(norm_w + row0);
}

// An RMSNorm split between the decode matvec that makes its input (the residual stream y, rows of whole
// groups of 32) and the decode matvecs that read its output (ops.py fuses the three in a one-token pass):
// the first writes, per group of 32 rows, the int16 blocks of y∘w and the group's Σ y² (`NormOut`); the
// readers multiply those blocks as they would the norm's and scale each sum by 1 / sqrt(Σ y² / n + eps)
// (`norm_scale`), as norm_f32 divides x: the int16 blocks of y∘w / s are those of y∘w with d / s, so the
// products are the norm's to rounding, and the norm's launch and its wait between the two are gone.
struct NormOut {
    const float* w;  // the norm's weight; null: the matvec writes no norm
    uint8_t* xq;
    float2* xds;
    float* sums;  // Σ y² of each group
    int* tickets;  // blocks of each group done, for kernels whose blocks hold fewer than 32 rows (0 after)
};

// Lane l of the warp holds y[32·g + l] of group g (every lane calls it).
__device__ __forceinline__ void store_normed(float y, int row, const NormOut& n) {
    const float s = warp_sum(__fmul_rn(y, y));
    if (row % 32 == 0) n.sums[row / 32] = s;
    store_x16<1>({__fmul_rn(y, n.w[row])}, true, row, n.xq, n.xds);
}

// After a block's warp 0 stored its rows r0.. r0 + ROWS - 1 of y: the last of the 32 / ROWS blocks of their group
// to do so (common.cuh last_to_arrive) writes the group's share of the norm. Every lane of warp 0 calls it, and
// only they.
template <int ROWS>
__device__ __forceinline__ void store_normed_when_whole(const float* y, int r0, const NormOut& n) {
    static_assert(32 % ROWS == 0, "a group's rows lie in whole blocks");
    const int group = r0 / 32;
    if (last_to_arrive(&n.tickets[group], 32 / ROWS))
        store_normed(__ldcg(y + 32 * group + threadIdx.x), 32 * group + threadIdx.x, n);
}

// 1 / sqrt(Σ sums / n + eps) over the n / 32 groups' sums, in every lane of the warp (every lane calls it),
// the same bits in every warp.
__device__ __forceinline__ float norm_scale(const float* sums, int n, float eps) {
    float s = 0.0f;
    for (int i = threadIdx.x % WARP; i < n / 32; i += WARP) s += sums[i];
    return rsqrtf(warp_sum(s) / n + eps);
}
