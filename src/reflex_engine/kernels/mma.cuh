// Tensor-core building blocks shared by the GEMMs, the prefill attention and the decode matvec:
// warp-level mma.sync on f16 with f32 accumulators and on bytes with int32 ones, ldmatrix, and
// cp.async global -> shared copies.
// Fragment layouts (PTX ISA, "mma.m16n8k16"), g = lane / 4, c = lane % 4:
//   A (16 x 16, row-major) a[0..3]: (g, 2c..2c+1), (g + 8, 2c..), (g, 2c + 8..), (g + 8, 2c + 8..)
//   B (16 x 8, k x n)      b[0..1]: (k 2c..2c+1, n g), (k 2c + 8.., n g)
//   C (16 x 8)             c[0..3]: (g, 2c), (g, 2c + 1), (g + 8, 2c), (g + 8, 2c + 1)
// Each register holds two f16 values, the lower column (A) or k (B) in the low half.
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

// c += a b for one 16 x 8 x 16 tile. sm_75 has only the k8 shape: two of them.
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b[0]));
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[2]), "r"(a[3]), "r"(b[1]));
#endif
}

// c += a b for one 16 x 8 x 32 tile of bytes, exactly, in int32: a unsigned, b signed or (B_UNSIGNED)
// unsigned. Fragments as above with four bytes a register, the lowest k in the low byte:
//   A a[0..3]: (g, 4c..4c+3), (g + 8, 4c..), (g, 4c + 16..), (g + 8, 4c + 16..)
//   B b[0..1]: (k 4c..4c+3, n g), (k 4c + 16.., n g);  C as for f16.
// sm_75 has only m8n8k16: four of them (a[0] and a[2] make rows g, a[1] and a[3] rows g + 8).
template <bool B_UNSIGNED>
__device__ __forceinline__ void mma_u8_16832(int (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if __CUDA_ARCH__ >= 800
    if constexpr (B_UNSIGNED)
        asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    else
        asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // (rows, k half): (g, 0), (g + 8, 0), (g, 1), (g + 8, 1)
        int& c0 = c[2 * (i % 2)];
        int& c1 = c[2 * (i % 2) + 1];
        if constexpr (B_UNSIGNED)
            asm volatile("mma.sync.aligned.m8n8k16.row.col.s32.u8.u8.s32 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
                         : "+r"(c0), "+r"(c1) : "r"(a[i]), "r"(b[i / 2]));
        else
            asm volatile("mma.sync.aligned.m8n8k16.row.col.s32.u8.s8.s32 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
                         : "+r"(c0), "+r"(c1) : "r"(a[i]), "r"(b[i / 2]));
    }
#endif
}

// Four 8 x 8 f16 matrices from shared memory: lane l gives the address of row l % 8 of matrix
// l / 8 (16 bytes each); register i receives matrix i in the mma fragment layout.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// The same, each matrix transposed: for a B operand stored k-major ([k][n]), as V is.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// An f16x2 as the register an mma operand takes.
__device__ __forceinline__ uint32_t as_u32(__half2 h) { return *reinterpret_cast<const uint32_t*>(&h); }

// Two f32 as one f16x2 register, x in the low half.
__device__ __forceinline__ uint32_t pack_half2(float x, float y) { return as_u32(__floats2half2_rn(x, y)); }

// Eight f32 as four f16x2 registers, in order: 16 bytes of a row of f16.
__device__ __forceinline__ uint4 pack_half8(const float* v) {
    return make_uint4(pack_half2(v[0], v[1]), pack_half2(v[2], v[3]), pack_half2(v[4], v[5]), pack_half2(v[6], v[7]));
}

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

// 4 bytes, the same way: for a block's few ints beside its tiles (cp.async.cg copies 16 only).
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
#if __CUDA_ARCH__ >= 800
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
    const int n = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem), "r"(n));
#else
    *reinterpret_cast<uint32_t*>(smem) = valid ? *reinterpret_cast<const uint32_t*>(gmem) : 0u;
#endif
}

// Waits until at most N of this thread's committed groups of copies are still in flight.
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
