// Embedding lookup: out (n_ids, n_cols) float32, out[i] = row ids[i] of W dequantized exactly as
// reflex_engine.quants.dequantize does (quant_blocks.cuh).
// LAUNCH: block = 128, grid.x = n_ids.
#include "common.cuh"
#include "quant_blocks.cuh"

constexpr int GET_ROWS_THREADS = 128;

template <class B>
__device__ __forceinline__ void get_rows(const uint8_t* __restrict__ W, const int* __restrict__ ids,
                                         float* __restrict__ out, int n_cols, int n_ids) {
    // a thread's chunk goes through shared memory (rows padded to 33: no bank conflicts) so
    // that the block writes out contiguous runs
    __shared__ float staged[GET_ROWS_THREADS][33];
    if (blockIdx.x >= n_ids) return;
    const uint8_t* row = W + (size_t)ids[blockIdx.x] * row_bytes<B>(n_cols);
    float* dst = out + (size_t)blockIdx.x * n_cols;
    for (int c0 = 0; 32 * c0 < n_cols; c0 += GET_ROWS_THREADS) {
        const int c = c0 + threadIdx.x;
        if (32 * c < n_cols) {
            float v[32];
            B::chunk(row, c, n_cols, v);
#pragma unroll
            for (int j = 0; j < 32; ++j) staged[threadIdx.x][j] = v[j];
        }
        __syncthreads();
        const int n = min(n_cols - 32 * c0, 32 * GET_ROWS_THREADS);
        for (int e = threadIdx.x; e < n; e += GET_ROWS_THREADS) dst[32 * c0 + e] = staged[e / 32][e % 32];
        __syncthreads();  // staged is rewritten next round
    }
}

#define GET_ROWS_KERNEL(name, B)                                                                     \
    extern "C" __global__ void __launch_bounds__(GET_ROWS_THREADS)                                   \
        get_rows_##name(const uint8_t* W, const int* ids, float* out, int n_cols, int n_ids) {    \
        follow_previous_kernel();                                                                 \
        get_rows<B>(W, ids, out, n_cols, n_ids);                                                     \
    }
KERNEL_TYPES(GET_ROWS_KERNEL)
#undef GET_ROWS_KERNEL
