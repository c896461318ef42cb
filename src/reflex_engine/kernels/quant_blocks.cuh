// GGUF block layouts (ggml-common.h) and their dequantization, 32 consecutive elements at a
// time, for the kernels and for the host test (tests/test_kernel_dequant.py) alike.
//
// Arithmetic follows quants/*.py operation for operation in float32, with rounded intrinsics on
// the device (which would otherwise contract a*b+c into one FMA), so results are bit-identical
// to reflex_engine.quants.dequantize. Host builds must not contract either (-ffp-contract=off).
//
// Alignment: weight tensors start 16-byte aligned (memory.py carves 256-byte aligned regions)
// and rows are whole blocks, so every block is aligned to the largest power of two dividing its
// size, up to 16. Each struct declares that alignment and loads are never wider than it.
//
// Every type T has: T::elems (elements per block), sizeof(T) (bytes per block), and
// T::chunk(row, c, n, v): elements 32c..32c+31 of a row of n elements into v. Scalar types
// (elems == 1) take any n and give 0 past it, and have T::value(row, k) for one element.
// T::piece(row, p, n, q, d, m), for the decode matvec: elements 16p..16p+15 as d·q[i] + m, where
// the 16 share one scale d and offset m (m = 0 unless T::has_min), so a dot product can apply them
// once per piece. Integers become floats through the mantissa (byte_floats), not the conversion
// unit. d·q[i] + m equals chunk's element to float rounding (exactly, where chunk's is d·q).
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

// ---- float32 arithmetic exactly as numpy rounds it -------------------------------------------

__host__ __device__ __forceinline__ float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

__host__ __device__ __forceinline__ float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

__host__ __device__ __forceinline__ float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}

__host__ __device__ __forceinline__ float bits_to_float(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    union { uint32_t u; float f; } pun = {u};
    return pun.f;
#endif
}

__host__ __device__ __forceinline__ float f16_to_float(uint32_t bits) {
    __half_raw raw;
    raw.x = (unsigned short)bits;
    return __half2float(__half(raw));
}

// ---- loads --------------------------------------------------------------------------------

// N little-endian 32-bit words from p, which is A-byte aligned (A = 2, 4, 8 or 16): on the
// device in the widest loads A allows, on the host byte by byte (any alignment, any endianness).
template <int A, int N>
__host__ __device__ __forceinline__ void load_words(const uint8_t* p, uint32_t (&w)[N]) {
    static_assert(A == 2 || A == 4 || A == 8 || A == 16, "blocks are at least 2-byte aligned");
#ifdef __CUDA_ARCH__
    if constexpr (A == 16 && N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N / 4; ++i) {
            const uint4 u = reinterpret_cast<const uint4*>(p)[i];
            w[4 * i] = u.x, w[4 * i + 1] = u.y, w[4 * i + 2] = u.z, w[4 * i + 3] = u.w;
        }
    } else if constexpr (A >= 8 && N % 2 == 0) {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            const uint2 u = reinterpret_cast<const uint2*>(p)[i];
            w[2 * i] = u.x, w[2 * i + 1] = u.y;
        }
    } else if constexpr (A >= 4) {
#pragma unroll
        for (int i = 0; i < N; ++i) w[i] = reinterpret_cast<const uint32_t*>(p)[i];
    } else {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
#pragma unroll
        for (int i = 0; i < N; ++i) w[i] = h[2 * i] | (uint32_t)h[2 * i + 1] << 16;
    }
#else
    for (int i = 0; i < N; ++i)
        w[i] = p[4 * i] | p[4 * i + 1] << 8 | p[4 * i + 2] << 16 | (uint32_t)p[4 * i + 3] << 24;
#endif
}

// N little-endian words of weights (read-only) from a 2-byte aligned p: aligned 32-bit loads
// realigned by funnel shifts, one more only where p is not 4-byte aligned, so they reach at most 2
// bytes either side of the N words, and only then (past a tensor's end: its 256-byte aligned carve).
template <int N>
__host__ __device__ __forceinline__ void load_words_shifted(const uint8_t* p, uint32_t (&w)[N]) {
#ifdef __CUDA_ARCH__
    const uint32_t* base = reinterpret_cast<const uint32_t*>(reinterpret_cast<uintptr_t>(p) & ~(uintptr_t)3);
    const int shift = 8 * (int)(reinterpret_cast<uintptr_t>(p) & 3);
    uint32_t raw[N + 1];
#pragma unroll
    for (int i = 0; i < N; ++i) raw[i] = __ldg(base + i);
    raw[N] = shift ? __ldg(base + N) : 0u;
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = __funnelshift_r(raw[i], raw[i + 1], shift);
#else
    load_words<2>(p, w);
#endif
}

// One little-endian u16 at a 2-byte aligned p.
__host__ __device__ __forceinline__ uint32_t load_u16(const uint8_t* p) {
#ifdef __CUDA_ARCH__
    return *reinterpret_cast<const uint16_t*>(p);
#else
    return p[0] | p[1] << 8;
#endif
}

// Byte j of a little-endian word array (j a constant after unrolling).
template <int N>
__host__ __device__ __forceinline__ uint32_t byte_at(const uint32_t (&w)[N], int j) {
    return w[j / 4] >> (8 * (j % 4)) & 0xFF;
}

// (float)(byte i of w) - bias for i = 0..3, exactly (bytes and biases are small integers): on the
// device, byte i becomes the mantissa of 2^23 + byte, which a subtraction takes back off.
__host__ __device__ __forceinline__ void byte_floats(uint32_t w, float bias, float* f) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#ifdef __CUDA_ARCH__
        f[i] = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440 + i)) - (8388608.0f + bias);
#else
        f[i] = (float)(w >> (8 * i) & 0xFF) - bias;
#endif
    }
}

// Sixteen small integers, four words of bytes, as floats minus bias.
__host__ __device__ __forceinline__ void bytes16_floats(const uint32_t (&q)[4], float bias, float v[16]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) byte_floats(q[k], bias, v + 4 * k);
}

// Bits 0..3 of x to bit 0 of bytes 0..3 (the partial products land on distinct bits: no carries).
__host__ __device__ __forceinline__ uint32_t spread4(uint32_t x) {
    return (x & 15) * 0x00204081u & 0x01010101u;
}

// ---- scalar types: F32, F16, BF16 ---------------------------------------------------------

template <class T>
struct scalar_block {
    static constexpr int elems = 1;
    static constexpr bool has_min = false;

    __host__ __device__ static float value(const uint8_t* row, int k) {
        const uint8_t* p = row + (size_t)k * sizeof(T);
        if constexpr (sizeof(T) == 4) {
            uint32_t w[1];
            load_words<4>(p, w);
            return T::decode(w[0]);
        } else {
            return T::decode(load_u16(p));
        }
    }

    __host__ __device__ static void chunk(const uint8_t* row, int c, int n, float v[32]) {
        constexpr int N = 8 * (int)sizeof(T);  // words in 32 elements
        const uint8_t* p = row + (size_t)32 * c * sizeof(T);
        if (32 * c + 32 <= n && reinterpret_cast<uintptr_t>(p) % 16 == 0) {
            uint32_t w[N];
            load_words<16>(p, w);
#pragma unroll
            for (int j = 0; j < 32; ++j) {
                if constexpr (sizeof(T) == 4) v[j] = T::decode(w[j]);
                else v[j] = T::decode(w[j / 2] >> (16 * (j % 2)) & 0xFFFF);
            }
        } else {  // the row's tail, or a row start that F16/BF16 widths leave unaligned
#pragma unroll
            for (int j = 0; j < 32; ++j) v[j] = 32 * c + j < n ? value(row, 32 * c + j) : 0.0f;
        }
    }

    __host__ __device__ static void piece(const uint8_t* row, int p, int n, float q[16], float& d, float& m) {
        constexpr int N = 4 * (int)sizeof(T);  // words in 16 elements
        const uint8_t* at = row + (size_t)16 * p * sizeof(T);
        d = 1.0f, m = 0.0f;
        if (16 * p + 16 <= n && reinterpret_cast<uintptr_t>(at) % 16 == 0) {
            uint32_t w[N];
            load_words<16>(at, w);
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                if constexpr (sizeof(T) == 4) q[j] = T::decode(w[j]);
                else q[j] = T::decode(w[j / 2] >> (16 * (j % 2)) & 0xFFFF);
            }
        } else {
#pragma unroll
            for (int j = 0; j < 16; ++j) q[j] = 16 * p + j < n ? value(row, 16 * p + j) : 0.0f;
        }
    }
};

struct block_f32 : scalar_block<block_f32> {
    uint32_t bits;  // IEEE float32
    __host__ __device__ static float decode(uint32_t b) { return bits_to_float(b); }
};

struct block_f16 : scalar_block<block_f16> {
    uint16_t bits;  // IEEE half
    __host__ __device__ static float decode(uint32_t b) { return f16_to_float(b); }
};

struct block_bf16 : scalar_block<block_bf16> {
    uint16_t bits;  // the top half of a float32
    __host__ __device__ static float decode(uint32_t b) { return bits_to_float(b << 16); }
};

static_assert(sizeof(block_f32) == 4 && sizeof(block_f16) == 2 && sizeof(block_bf16) == 2, "scalar sizes");

// ---- legacy types: one block of 32, nibbles in ggml order (lo nibbles of qs, then hi) ---------

struct block_q4_0 {
    half d;
    uint8_t qs[16];  // x = (nibble - 8)·d
    static constexpr int elems = 32;
    static constexpr bool has_min = false;

    __host__ __device__ static void chunk(const uint8_t* row, int c, int, float v[32]) {
        const block_q4_0& b = reinterpret_cast<const block_q4_0*>(row)[c];
        const float d = __half2float(b.d);
        uint32_t q[4];
        load_words<2>(b.qs, q);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            v[j] = mul_rn(d, (float)((int)(byte_at(q, j) & 15) - 8));
            v[j + 16] = mul_rn(d, (float)((int)(byte_at(q, j) >> 4) - 8));
        }
    }

    // piece j of a block: nibble j of qs[0..15]
    __host__ __device__ static void piece(const uint8_t* row, int p, int, float q[16], float& d, float& m) {
        const block_q4_0& b = reinterpret_cast<const block_q4_0*>(row)[p / 2];
        uint32_t w[4];
        load_words_shifted(b.qs, w);  // reach: d before; the next block's d or the carve's padding after
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = w[k] >> (4 * (p % 2)) & 0x0F0F0F0F;
        bytes16_floats(w, 8.0f, q);
        d = __half2float(b.d), m = 0.0f;
    }
};
static_assert(sizeof(block_q4_0) == 18, "block_q4_0");

struct alignas(4) block_q4_1 {
    half d, m;
    uint8_t qs[16];  // x = nibble·d + m
    static constexpr int elems = 32;
    static constexpr bool has_min = true;

    __host__ __device__ static void chunk(const uint8_t* row, int c, int, float v[32]) {
        const block_q4_1& b = reinterpret_cast<const block_q4_1*>(row)[c];
        const float d = __half2float(b.d), m = __half2float(b.m);
        uint32_t q[4];
        load_words<4>(b.qs, q);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            v[j] = add_rn(mul_rn(d, (float)(byte_at(q, j) & 15)), m);
            v[j + 16] = add_rn(mul_rn(d, (float)(byte_at(q, j) >> 4)), m);
        }
    }

    __host__ __device__ static void piece(const uint8_t* row, int p, int, float q[16], float& d, float& m) {
        const block_q4_1& b = reinterpret_cast<const block_q4_1*>(row)[p / 2];
        uint32_t w[4];
        load_words<4>(b.qs, w);
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = w[k] >> (4 * (p % 2)) & 0x0F0F0F0F;
        bytes16_floats(w, 0.0f, q);
        d = __half2float(b.d), m = __half2float(b.m);
    }
};
static_assert(sizeof(block_q4_1) == 20, "block_q4_1");

// The 5-bit values of Q5_0/Q5_1: nibble j | bit j of the little-endian u32 qh << 4.
__host__ __device__ __forceinline__ void q5_values(const uint32_t (&q)[4], uint32_t qh, int v[32]) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        v[j] = (byte_at(q, j) & 15) | (qh >> j & 1) << 4;
        v[j + 16] = (byte_at(q, j) >> 4) | (qh >> (j + 16) & 1) << 4;
    }
}

struct block_q5_0 {
    half d;
    uint8_t qh[4];   // bit j: bit 4 of element j
    uint8_t qs[16];  // x = (q5 - 16)·d
    static constexpr int elems = 32;
    static constexpr bool has_min = false;

    __host__ __device__ static void chunk(const uint8_t* row, int c, int, float v[32]) {
        const block_q5_0& b = reinterpret_cast<const block_q5_0*>(row)[c];
        const float d = __half2float(b.d);
        uint32_t q[4], qh[1];
        load_words<2>(b.qs, q);
        load_words<2>(b.qh, qh);
        int q5[32];
        q5_values(q, qh[0], q5);
#pragma unroll
        for (int j = 0; j < 32; ++j) v[j] = mul_rn(d, (float)(q5[j] - 16));
    }

    __host__ __device__ static void piece(const uint8_t* row, int p, int, float q[16], float& d, float& m) {
        const block_q5_0& b = reinterpret_cast<const block_q5_0*>(row)[p / 2];
        uint32_t w[4], qh[1];
        load_words_shifted(b.qs, w);  // reach: qh before; the next block's d or the carve's padding after
        load_words_shifted(b.qh, qh);  // reach: d before, qs after
        const uint32_t hi = qh[0] >> (16 * (p % 2));  // bit 4 of the piece's elements
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = (w[k] >> (4 * (p % 2)) & 0x0F0F0F0F) | spread4(hi >> (4 * k)) << 4;
        bytes16_floats(w, 16.0f, q);
        d = __half2float(b.d), m = 0.0f;
    }
};
static_assert(sizeof(block_q5_0) == 22, "block_q5_0");

struct alignas(8) block_q5_1 {
    half d, m;
    uint8_t qh[4];   // bit j: bit 4 of element j
    uint8_t qs[16];  // x = q5·d + m
    static constexpr int elems = 32;
    static constexpr bool has_min = true;

    __host__ __device__ static void chunk(const uint8_t* row, int c, int, float v[32]) {
        const block_q5_1& b = reinterpret_cast<const block_q5_1*>(row)[c];
        const float d = __half2float(b.d), m = __half2float(b.m);
        uint32_t q[4], qh[1];
        load_words<8>(b.qs, q);
        load_words<4>(b.qh, qh);
        int q5[32];
        q5_values(q, qh[0], q5);
#pragma unroll
        for (int j = 0; j < 32; ++j) v[j] = add_rn(mul_rn(d, (float)q5[j]), m);
    }

    __host__ __device__ static void piece(const uint8_t* row, int p, int, float q[16], float& d, float& m) {
        const block_q5_1& b = reinterpret_cast<const block_q5_1*>(row)[p / 2];
        uint32_t w[4], qh[1];
        load_words<8>(b.qs, w);
        load_words<4>(b.qh, qh);
        const uint32_t hi = qh[0] >> (16 * (p % 2));  // bit 4 of the piece's elements
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = (w[k] >> (4 * (p % 2)) & 0x0F0F0F0F) | spread4(hi >> (4 * k)) << 4;
        bytes16_floats(w, 0.0f, q);
        d = __half2float(b.d), m = __half2float(b.m);
    }
};
static_assert(sizeof(block_q5_1) == 24, "block_q5_1");

struct block_q8_0 {
    half d;
    int8_t qs[32];  // x = q·d
    static constexpr int elems = 32;
    static constexpr bool has_min = false;

    __host__ __device__ static void chunk(const uint8_t* row, int c, int, float v[32]) {
        const block_q8_0& b = reinterpret_cast<const block_q8_0*>(row)[c];
        const float d = __half2float(b.d);
        uint32_t q[8];
        load_words<2>(reinterpret_cast<const uint8_t*>(b.qs), q);
#pragma unroll
        for (int j = 0; j < 32; ++j) v[j] = mul_rn(d, (float)(int8_t)byte_at(q, j));
    }

    __host__ __device__ static void piece(const uint8_t* row, int p, int, float q[16], float& d, float& m) {
        const block_q8_0& b = reinterpret_cast<const block_q8_0*>(row)[p / 2];
        uint32_t w[4];
        // 4-byte loads, not 2-byte ones (the block is 2-byte aligned). Reach: d or the first half
        // before; the second half, the next block's d or the carve's padding after
        load_words_shifted(reinterpret_cast<const uint8_t*>(b.qs) + 16 * (p % 2), w);
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] ^= 0x80808080;  // int8 q as q + 128
        bytes16_floats(w, 128.0f, q);
        d = __half2float(b.d), m = 0.0f;
    }
};
static_assert(sizeof(block_q8_0) == 34, "block_q8_0");

// ---- K-quants: super-blocks of 256; chunk c is sub-chunk c % 8 of block c / 8 ---------------
//
// Q2_K/Q3_K 2-bit order: sub-chunk s reads bits 2(s%4), 2(s%4)+1 of qs[32(s/4) + l], l = 0..31;
// its two groups of 16 (l < 16, l >= 16) take scales 2s and 2s+1.

struct alignas(4) block_q2_K {
    uint8_t scales[16];  // per 16 values: lo nibble scale, hi nibble min
    uint8_t qs[64];      // x = (d·scale)·q - dmin·min
    half d, dmin;
    static constexpr int elems = 256;
    static constexpr bool has_min = true;

    __host__ __device__ static void chunk(const uint8_t* row, int c, int, float v[32]) {
        const block_q2_K& b = reinterpret_cast<const block_q2_K*>(row)[c / 8];
        const int s = c % 8;
        const float d = __half2float(b.d), dmin = __half2float(b.dmin);
        const uint32_t sc = load_u16(b.scales + 2 * s);
        const float dl[2] = {mul_rn(d, (float)(sc & 15)), mul_rn(d, (float)(sc >> 8 & 15))};
        const float ml[2] = {mul_rn(dmin, (float)(sc >> 4 & 15)), mul_rn(dmin, (float)(sc >> 12))};
        uint32_t q[8];
        load_words<4>(b.qs + 32 * (s / 4), q);
        const int shift = 2 * (s % 4);
#pragma unroll
        for (int l = 0; l < 32; ++l)
            v[l] = sub_rn(mul_rn(dl[l / 16], (float)(byte_at(q, l) >> shift & 3)), ml[l / 16]);
    }

    // piece j of a block: group of 16 j % 2 of sub-chunk j / 2, one scale and min
    __host__ __device__ static void piece(const uint8_t* row, int p, int, float q[16], float& d, float& m) {
        const block_q2_K& b = reinterpret_cast<const block_q2_K*>(row)[p / 16];
        const int s = p % 16 / 2, l0 = 16 * (p % 2);
        const uint32_t sc = b.scales[2 * s + p % 2];
        uint32_t w[4];
        load_words<4>(b.qs + 32 * (s / 4) + l0, w);
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = w[k] >> (2 * (s % 4)) & 0x03030303;
        bytes16_floats(w, 0.0f, q);
        d = mul_rn(__half2float(b.d), (float)(sc & 15)), m = -mul_rn(__half2float(b.dmin), (float)(sc >> 4));
    }
};
static_assert(sizeof(block_q2_K) == 84, "block_q2_K");

struct block_q3_K {
    uint8_t hmask[32];   // bit s of hmask[l]: bit 2 of element l of sub-chunk s
    uint8_t qs[64];      // low 2 bits, Q2_K order
    uint8_t scales[12];  // sixteen 6-bit scales, offset 32
    half d;              // x = (d·(scale - 32))·(q3 - 4)
    static constexpr int elems = 256;
    static constexpr bool has_min = false;

    // Scale i: low 4 bits from nibble i/8 of byte i%8, top 2 from byte 8 + i%4 at bit 2(i/4).
    __host__ __device__ static int scale(const uint8_t* sc, int i) {
        return (sc[i % 8] >> (4 * (i / 8)) & 15) | (sc[8 + i % 4] >> (2 * (i / 4)) & 3) << 4;
    }

    __host__ __device__ static void chunk(const uint8_t* row, int c, int, float v[32]) {
        const block_q3_K& b = reinterpret_cast<const block_q3_K*>(row)[c / 8];
        const int s = c % 8;
        const float d = __half2float(b.d);
        const float dl[2] = {mul_rn(d, (float)(scale(b.scales, 2 * s) - 32)),
                             mul_rn(d, (float)(scale(b.scales, 2 * s + 1) - 32))};
        uint32_t q[8], h[8];
        load_words<2>(b.qs + 32 * (s / 4), q);
        load_words<2>(b.hmask, h);
        const int shift = 2 * (s % 4);
#pragma unroll
        for (int l = 0; l < 32; ++l) {
            const int q3 = (byte_at(q, l) >> shift & 3) | (byte_at(h, l) >> s & 1) << 2;
            v[l] = mul_rn(dl[l / 16], (float)(q3 - 4));
        }
    }

    __host__ __device__ static void piece(const uint8_t* row, int p, int, float q[16], float& d, float& m) {
        const block_q3_K& b = reinterpret_cast<const block_q3_K*>(row)[p / 16];
        const int s = p % 16 / 2, l0 = 16 * (p % 2);
        uint32_t w[4], h[4];
        load_words<2>(b.qs + 32 * (s / 4) + l0, w);
        load_words<2>(b.hmask + l0, h);
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = (w[k] >> (2 * (s % 4)) & 0x03030303) | (h[k] >> s & 0x01010101) << 2;
        bytes16_floats(w, 4.0f, q);
        d = mul_rn(__half2float(b.d), (float)(scale(b.scales, 2 * s + p % 2) - 32)), m = 0.0f;
    }
};
static_assert(sizeof(block_q3_K) == 110, "block_q3_K");

// ggml's get_scale_min_k4, applied: sub-chunk j of Q4_K/Q5_K has scale d·sc and offset dmin·m,
// its 6-bit (sc, m) packed in the 12 scale bytes.
__host__ __device__ __forceinline__ void scale_min_k4(half d, half dmin, const uint8_t* s, int j, float& dl, float& ml) {
    int sc, m;
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
        m = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
    dl = mul_rn(__half2float(d), (float)sc);
    ml = mul_rn(__half2float(dmin), (float)m);
}

// __byte_perm: bytes of (b:a) picked by the selector's nibbles, 0-7.
__host__ __device__ __forceinline__ uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
#ifdef __CUDA_ARCH__
    return __byte_perm(a, b, selector);
#else
    const uint64_t ba = (uint64_t)b << 32 | a;
    uint32_t w = 0;
    for (int i = 0; i < 4; ++i) w |= (uint32_t)(ba >> (8 * (selector >> (4 * i) & 7)) & 0xFF) << (8 * i);
    return w;
#endif
}

// The 6-bit scales and mins of sub-chunks 2j and 2j + 1 of a Q4_K/Q5_K block, from its first 16 bytes (d, dmin, the
// 12 scale bytes hd[1..3]), as one word's bytes: scale 2j, scale 2j + 1, min 2j, min 2j + 1. The pair's bytes of
// the scale and min words (hd[1], hd[2]) and of the last word (hd[3]: low nibbles the scales', high the mins') lie
// side by side the same way, so one selector picks both: for j < 2 the first give every bit, for j >= 2 bits 4-5
// (their top two, shifted down) and the last the rest. A lane of the tensor-core matvec keeps one j, and so the
// selector, the shift and the mask, out of its loop: 6 instructions a superblock's row (14 with the j < 2 choice).
struct K4Scales {
    uint32_t selector, shift, from_low;
    __host__ __device__ explicit K4Scales(int j)
        : selector(j % 2 ? 0x7632u : 0x5410u), shift(j < 2 ? 0u : 2u), from_low(j < 2 ? 0x3F3F3F3Fu : 0x30303030u) {}
    __host__ __device__ __forceinline__ uint32_t bytes(const uint32_t (&hd)[4]) const {
        const uint32_t low = byte_perm(hd[1], hd[2], selector) >> shift;
        const uint32_t last = byte_perm(hd[3], hd[3] >> 4, selector) & 0x0F0F0F0Fu;
        return (low & from_low) | (last & ~from_low);
    }
};

// The same as two words: sc and m each hold sub-chunk 2j's in byte 0, 2j + 1's in byte 1.
__host__ __device__ __forceinline__ void scale_min_k4_bytes(const uint32_t (&hd)[4], int j, uint32_t& sc, uint32_t& m) {
    const uint32_t b = K4Scales(j).bytes(hd);
    sc = b & 0xFFFF, m = b >> 16;
}

// scale_min_k4 of sub-chunks 2j and 2j + 1 from the same 16 bytes.
__host__ __device__ __forceinline__ void scale_min_k4_pair(const uint32_t (&hd)[4], int j, float& sa, float& ma,
                                                           float& sb, float& mb) {
    uint32_t sc, m;
    scale_min_k4_bytes(hd, j, sc, m);
    const float d = f16_to_float(hd[0] & 0xFFFF), dmin = f16_to_float(hd[0] >> 16);
    sa = mul_rn(d, (float)(sc & 0xFF)), sb = mul_rn(d, (float)(sc >> 8 & 0xFF));
    ma = mul_rn(dmin, (float)(m & 0xFF)), mb = mul_rn(dmin, (float)(m >> 8 & 0xFF));
}

struct alignas(16) block_q4_K {
    half d, dmin;
    uint8_t scales[12];  // eight 6-bit (scale, min) pairs
    uint8_t qs[128];     // sub-chunk s: nibble s%2 of qs[32(s/2) + l]; x = (d·sc)·q - dmin·m
    static constexpr int elems = 256;
    static constexpr bool has_min = true;

    __host__ __device__ static void chunk(const uint8_t* row, int c, int, float v[32]) {
        const block_q4_K& b = reinterpret_cast<const block_q4_K*>(row)[c / 8];
        const int s = c % 8;
        float dl, ml;
        scale_min_k4(b.d, b.dmin, b.scales, s, dl, ml);
        uint32_t q[8];
        load_words<16>(b.qs + 32 * (s / 2), q);
        const int shift = 4 * (s % 2);
#pragma unroll
        for (int l = 0; l < 32; ++l) v[l] = sub_rn(mul_rn(dl, (float)(byte_at(q, l) >> shift & 15)), ml);
    }

    __host__ __device__ static void piece(const uint8_t* row, int p, int, float q[16], float& d, float& m) {
        const block_q4_K& b = reinterpret_cast<const block_q4_K*>(row)[p / 16];
        const int s = p % 16 / 2, l0 = 16 * (p % 2);
        uint32_t w[4];
        load_words<16>(b.qs + 32 * (s / 2) + l0, w);
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = w[k] >> (4 * (s % 2)) & 0x0F0F0F0F;
        bytes16_floats(w, 0.0f, q);
        scale_min_k4(b.d, b.dmin, b.scales, s, d, m);
        m = -m;
    }
};
static_assert(sizeof(block_q4_K) == 144, "block_q4_K");

// A lane's 16-byte loads of superblock s of 4 Q4_K rows for the tensor-core kernels (gemm_frag.cu,
// matvec_x16_mma.cu): each row's head (d, dmin, scales) and quant bytes 16c.. and 64 + 16c..; L2_ONLY:
// past L1 (__ldcg), which then keeps what else the kernel reads (a GEMM's x), else __ldg.
template <bool L2_ONLY>
__device__ __forceinline__ void load_q4_K_pieces(const uint8_t* const (&rows)[4], int s, int c, uint4 (&head)[4],
                                                 uint4 (&qs)[4][2]) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const uint4* b = reinterpret_cast<const uint4*>(rows[r] + (size_t)sizeof(block_q4_K) * s);
        if constexpr (L2_ONLY)
            head[r] = __ldcg(b), qs[r][0] = __ldcg(b + 1 + c), qs[r][1] = __ldcg(b + 5 + c);
        else
            head[r] = __ldg(b), qs[r][0] = __ldg(b + 1 + c), qs[r][1] = __ldg(b + 5 + c);
    }
}

struct alignas(16) block_q5_K {
    half d, dmin;
    uint8_t scales[12];  // as Q4_K
    uint8_t qh[32];      // bit s of qh[l]: bit 4 of element l of sub-chunk s
    uint8_t qs[128];     // as Q4_K
    static constexpr int elems = 256;
    static constexpr bool has_min = true;

    __host__ __device__ static void chunk(const uint8_t* row, int c, int, float v[32]) {
        const block_q5_K& b = reinterpret_cast<const block_q5_K*>(row)[c / 8];
        const int s = c % 8;
        float dl, ml;
        scale_min_k4(b.d, b.dmin, b.scales, s, dl, ml);
        uint32_t q[8], h[8];
        load_words<16>(b.qs + 32 * (s / 2), q);
        load_words<16>(b.qh, h);
        const int shift = 4 * (s % 2);
#pragma unroll
        for (int l = 0; l < 32; ++l) {
            const int q5 = (byte_at(q, l) >> shift & 15) | (byte_at(h, l) >> s & 1) << 4;
            v[l] = sub_rn(mul_rn(dl, (float)q5), ml);
        }
    }

    __host__ __device__ static void piece(const uint8_t* row, int p, int, float q[16], float& d, float& m) {
        const block_q5_K& b = reinterpret_cast<const block_q5_K*>(row)[p / 16];
        const int s = p % 16 / 2, l0 = 16 * (p % 2);
        uint32_t w[4], h[4];
        load_words<16>(b.qs + 32 * (s / 2) + l0, w);
        load_words<16>(b.qh + l0, h);
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = (w[k] >> (4 * (s % 2)) & 0x0F0F0F0F) | (h[k] >> s & 0x01010101) << 4;
        bytes16_floats(w, 0.0f, q);
        scale_min_k4(b.d, b.dmin, b.scales, s, d, m);
        m = -m;
    }
};
static_assert(sizeof(block_q5_K) == 176, "block_q5_K");

struct block_q6_K {
    uint8_t ql[128];    // half h, quarter k: nibble k/2 of ql[64h + 32(k%2) + l]
    uint8_t qh[64];     // bits 2k, 2k+1 of qh[32h + l]: bits 4-5
    int8_t scales[16];  // per 16 values
    half d;             // x = (d·scale)·(q6 - 32)
    static constexpr int elems = 256;
    static constexpr bool has_min = false;

    __host__ __device__ static void chunk(const uint8_t* row, int c, int, float v[32]) {
        const block_q6_K& b = reinterpret_cast<const block_q6_K*>(row)[c / 8];
        const int s = c % 8, h = s / 4, k = s % 4;
        const float d = __half2float(b.d);
        const uint32_t sc = load_u16(reinterpret_cast<const uint8_t*>(b.scales) + 8 * h + 2 * k);
        const float dl[2] = {mul_rn(d, (float)(int8_t)(sc & 0xFF)), mul_rn(d, (float)(int8_t)(sc >> 8))};
        uint32_t lo[8], hi[8];
        load_words<2>(b.ql + 64 * h + 32 * (k % 2), lo);
        load_words<2>(b.qh + 32 * h, hi);
        const int lo_shift = 4 * (k / 2), hi_shift = 2 * k;
#pragma unroll
        for (int l = 0; l < 32; ++l) {
            const int q6 = (byte_at(lo, l) >> lo_shift & 15) | (byte_at(hi, l) >> hi_shift & 3) << 4;
            v[l] = mul_rn(dl[l / 16], (float)(q6 - 32));
        }
    }

    __host__ __device__ static void piece(const uint8_t* row, int p, int, float q[16], float& d, float& m) {
        const block_q6_K& b = reinterpret_cast<const block_q6_K*>(row)[p / 16];
        const int s = p % 16 / 2, h = s / 4, k = s % 4, l0 = 16 * (p % 2);
        // the bytes load_words_shifted may reach past either run are this block's (qh, scales); before
        // ql[0], those of the tensor's previous block (its first block is 16-byte aligned)
        uint32_t lo[4], hi[4];
        load_words_shifted(b.ql + 64 * h + 32 * (k % 2) + l0, lo);
        load_words_shifted(b.qh + 32 * h + l0, hi);
#pragma unroll
        for (int i = 0; i < 4; ++i) lo[i] = (lo[i] >> (4 * (k / 2)) & 0x0F0F0F0F) | (hi[i] >> (2 * k) & 0x03030303) << 4;
        bytes16_floats(lo, 32.0f, q);
        d = mul_rn(__half2float(b.d), (float)b.scales[8 * h + 2 * k + p % 2]), m = 0.0f;
    }
};
static_assert(sizeof(block_q6_K) == 210, "block_q6_K");

// Bytes of one row of n elements.
template <class T>
__host__ __device__ __forceinline__ size_t row_bytes(int n) {
    return (size_t)(n / T::elems) * sizeof(T);
}

// (kernel suffix, block struct) of every type with kernels: instantiate a template per type.
#define KERNEL_TYPES(X)                                                                       \
    X(f32, block_f32) X(f16, block_f16) X(bf16, block_bf16) X(q4_0, block_q4_0)              \
    X(q4_1, block_q4_1) X(q5_0, block_q5_0) X(q5_1, block_q5_1) X(q8_0, block_q8_0)          \
    X(q2_K, block_q2_K) X(q3_K, block_q3_K) X(q4_K, block_q4_K) X(q5_K, block_q5_K)          \
    X(q6_K, block_q6_K)

// A struct may only claim the alignment that 16-byte aligned tensors of whole blocks guarantee.
template <class T>
__host__ __device__ constexpr bool guaranteed_alignment() {
    constexpr size_t a = sizeof(T) & (~sizeof(T) + 1);  // the largest power of two dividing the size
    return alignof(T) == (a < 16 ? a : 16);
}
#define CHECK_ALIGNMENT(name, T) static_assert(guaranteed_alignment<T>(), #T " over-claims its alignment");
KERNEL_TYPES(CHECK_ALIGNMENT)
#undef CHECK_ALIGNMENT
