// Decode matmul: y (n_tok, n_rows) = x (n_tok, n_cols) · Wᵀ for up to 8 tokens, W in GGUF blocks.
// Each weight chunk is dequantized once (quant_blocks.cuh) and used for every token.
// LAUNCH: block = 128 (4 warps, one output row each), grid.x = ceil(n_rows / 4).
#include "common.cuh"
#include "quant_blocks.cuh"

constexpr int MATVEC_MAX_TOKENS = 8;
constexpr int MATVEC_WARPS = 4;
constexpr int MATVEC_XTOK = 2;  // tokens of x staged in shared memory at once
constexpr int MATVEC_XPAD = 36;  // floats per staged chunk: lanes' float4 reads of their own chunk hit distinct banks

// The 32 weights a lane multiplies in the step over chunks c0..c0+31. Block types: its own chunk
// c0 + lane. Scalar types: column `lane` of the 32 chunks, so that the warp's loads coalesce.
template <class B>
__device__ __forceinline__ void matvec_weights(const uint8_t* row, bool live, int c0, int n_cols, float w[32]) {
    const int lane = threadIdx.x % WARP;
    if constexpr (B::elems == 1) {
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const int k = 32 * (c0 + i) + lane;
            w[i] = live && k < n_cols ? B::value(row, k) : 0.0f;
        }
    } else if (live && 32 * (c0 + lane) < n_cols) {
        B::chunk(row, c0 + lane, n_cols, w);
    } else {
#pragma unroll
        for (int j = 0; j < 32; ++j) w[j] = 0.0f;
    }
}

// The lane's part of w · x for one token's staged x (32 chunks of MATVEC_XPAD floats).
template <class B>
__device__ __forceinline__ float matvec_dot(const float w[32], const float* xs) {
    const int lane = threadIdx.x % WARP;
    float s = 0.0f;
    if constexpr (B::elems == 1) {
#pragma unroll
        for (int i = 0; i < 32; ++i) s = fmaf(w[i], xs[i * MATVEC_XPAD + lane], s);
    } else {
        const float4* x4 = reinterpret_cast<const float4*>(xs + lane * MATVEC_XPAD);
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            const float4 x = x4[q];
            s = fmaf(w[4 * q], x.x, fmaf(w[4 * q + 1], x.y, fmaf(w[4 * q + 2], x.z, fmaf(w[4 * q + 3], x.w, s))));
        }
    }
    return s;
}

template <class B>
__device__ __forceinline__ void matvec(const uint8_t* __restrict__ W, const float* __restrict__ x,
                                       float* __restrict__ y, int n_rows, int n_cols, int n_tok) {
    // x of the current 32 chunks, shared by the block's rows; zero past n_cols
    __shared__ __align__(16) float xs[MATVEC_XTOK][WARP * MATVEC_XPAD];
    const int lane = threadIdx.x % WARP, r = blockIdx.x * MATVEC_WARPS + threadIdx.x / WARP;
    const bool live = r < n_rows;  // dead warps still stage x and meet every barrier
    const uint8_t* row = W + (size_t)r * row_bytes<B>(n_cols);
    float acc[MATVEC_MAX_TOKENS] = {};
    for (int c0 = 0; 32 * c0 < n_cols; c0 += WARP) {
        float w[32];
        matvec_weights<B>(row, live, c0, n_cols, w);
#pragma unroll
        for (int t0 = 0; t0 < MATVEC_MAX_TOKENS; t0 += MATVEC_XTOK) {
            if (t0 >= n_tok) break;
            __syncthreads();  // every warp is done with the previous x
            const int n_staged = min(MATVEC_XTOK, n_tok - t0) * 32 * WARP;
            for (int i = threadIdx.x; i < n_staged; i += blockDim.x) {
                const int t = i / (32 * WARP), e = i % (32 * WARP), k = 32 * c0 + e;
                xs[t][e / 32 * MATVEC_XPAD + e % 32] = k < n_cols ? x[(size_t)(t0 + t) * n_cols + k] : 0.0f;
            }
            __syncthreads();
#pragma unroll
            for (int t = 0; t < MATVEC_XTOK; ++t)
                if (t0 + t < n_tok) acc[t0 + t] += matvec_dot<B>(w, xs[t]);
        }
    }
#pragma unroll
    for (int t = 0; t < MATVEC_MAX_TOKENS; ++t) {
        if (t >= n_tok) break;
        const float s = warp_sum(acc[t]);
        if (live && lane == 0) y[(size_t)t * n_rows + r] = s;
    }
}

#define MATVEC_KERNEL(name, B)                                                                           \
    extern "C" __global__ void __launch_bounds__(MATVEC_WARPS * WARP)                                    \
        matvec_##name(const uint8_t* W, const float* x, float* y, int n_rows, int n_cols, int n_tok) { \
        matvec<B>(W, x, y, n_rows, n_cols, n_tok);                                                       \
    }
KERNEL_TYPES(MATVEC_KERNEL)
#undef MATVEC_KERNEL
