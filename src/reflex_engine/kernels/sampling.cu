// Logit-row kernels for the sampler and for log-probabilities: rows are float32 (n_rows, n_cols).
// Orderings follow the numpy backend (backends/cpu/sampler.py): ties go to the lower index.
#include "common.cuh"
#include "reduce.cuh"

// f(j, x[j]) for this thread's j = threadIdx.x + m * blockDim.x < n, in increasing j. A single
// block reads a whole row, so it keeps AHEAD loads in flight per thread.
template <int AHEAD = 8, class F>
__device__ __forceinline__ void for_each_strided(const float* x, int n, F f) {
    const int stride = blockDim.x;
    int j = threadIdx.x;
    for (; j + (AHEAD - 1) * stride < n; j += AHEAD * stride) {
        float v[AHEAD];
#pragma unroll
        for (int u = 0; u < AHEAD; ++u) v[u] = x[j + u * stride];
#pragma unroll
        for (int u = 0; u < AHEAD; ++u) f(j + u * stride, v[u]);
    }
    for (; j < n; j += stride) f(j, x[j]);
}

// out[r] = argmax of row r. NaN never wins (a row of NaN alone gives 0). Grid: one block per row.
extern "C" __global__ void __launch_bounds__(1024)
argmax_rows(const float* x, int n_cols, int* out) {
    follow_previous_kernel();
    const float* row = x + (size_t)blockIdx.x * n_cols;
    float best = -INFINITY;
    int best_i = INT_MAX;  // nothing seen; loses to any non-NaN value, -inf included
    for_each_strided(row, n_cols, [&](int j, float v) {
        if (argmax_better(v, j, best, best_i)) best = v, best_i = j;
    });
    block_argmax(best, best_i);
    if (threadIdx.x == 0) out[blockIdx.x] = best_i == INT_MAX ? 0 : best_i;
}

// llama.cpp's repeat and presence penalties on each of the (distinct) ids.
extern "C" __global__ void __launch_bounds__(256)
apply_penalties(float* logits, const int* ids, int n_ids, float repeat_penalty,
                float presence_penalty) {
    follow_previous_kernel();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n_ids) return;
    float v = logits[ids[t]];
    v = v > 0.0f ? v / repeat_penalty : v * repeat_penalty;
    logits[ids[t]] = v - presence_penalty;
}

// A constraint's mask (constraints.Guide): logits[j] = -inf where bit j % 32 of word j / 32 is 0.
extern "C" __global__ void __launch_bounds__(256)
mask_logits(float* logits, const uint32_t* allowed, int n) {
    follow_previous_kernel();
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j < n && !((allowed[j >> 5] >> (j & 31)) & 1u)) logits[j] = -INFINITY;
}

// An unsigned key that orders as the float does. -0 is keyed as +0 and NaN lowest, so that key
// order with ties by index is numpy's np.argsort(-x, kind="stable").
__device__ __forceinline__ uint32_t order_key(float x) {
    uint32_t b = __float_as_uint(x);
    if (isnan(x)) return 0;
    if (b == 0x80000000u) b = 0;
    return b ^ ((b >> 31) ? 0xffffffffu : 0x80000000u);
}

#define TOPK_MAX 256
#define RADIX_BINS 256

// Candidate a goes before candidate b in the output.
__device__ __forceinline__ bool ranks_before(uint32_t ka, int ia, uint32_t kb, int ib) {
    return ka > kb || (ka == kb && ia < ib);
}

// The k largest of x[0..n), descending, ties by lower index; stats = {max, sum of exp(x - max)}.
// Radix select (4 passes of 8 bits, most significant first) finds the k-th largest key; the
// elements above it plus the lowest-index ones equal to it are gathered, then sorted in
// shared memory. Grid: one block of 1024.
extern "C" __global__ void __launch_bounds__(1024)
top_k(const float* x, int n, int k, int* ids_out, float* vals_out, float* stats) {
    follow_previous_kernel();
    __shared__ unsigned hist[RADIX_BINS];
    __shared__ unsigned warp_count[32];
    __shared__ uint32_t s_prefix;
    __shared__ unsigned s_rem, s_n_eq, s_taken;
    __shared__ uint32_t cand_key[TOPK_MAX];
    __shared__ int cand_idx[TOPK_MAX];
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;

    // Invariant: n_eq >= rem elements match `prefix` on the digits chosen so far, and the k-th
    // largest key is the rem-th largest of them. The first two passes also read the stats.
    uint32_t prefix = 0;
    unsigned rem = k, n_eq = n;
    float max_x = -INFINITY, sum_exp = 0.0f;
    for (int shift = 24; shift >= 0; shift -= 8) {
        const uint32_t mask = shift == 24 ? 0u : 0xffffffffu << (shift + 8);
        if (tid < RADIX_BINS) hist[tid] = 0;
        __syncthreads();
        for_each_strided(x, n, [&](int, float v) {
            const uint32_t key = order_key(v);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1u);
            if (shift == 24) max_x = fmaxf(max_x, v);
            else if (shift == 16) sum_exp += expf(v - max_x);
        });
        if (shift == 24) max_x = block_max(max_x);
        else if (shift == 16) sum_exp = block_sum(sum_exp);
        __syncthreads();

        // Thread t counts digit 255 - t, so the inclusive scan is the number of matching
        // elements at or above that digit; the digit where it first reaches rem is the k-th's.
        unsigned count = 0, at_or_above = 0;
        if (tid < RADIX_BINS) {
            count = hist[RADIX_BINS - 1 - tid];
            at_or_above = warp_inclusive_scan(count);
            if (lane == WARP - 1) warp_count[warp] = at_or_above;
        }
        __syncthreads();
        if (tid < RADIX_BINS) {
            for (int w = 0; w < warp; ++w) at_or_above += warp_count[w];
            const unsigned above = at_or_above - count;
            if (above < rem && rem <= at_or_above) {
                s_prefix = prefix | (uint32_t)(RADIX_BINS - 1 - tid) << shift;
                s_rem = rem - above;
                s_n_eq = count;
            }
        }
        __syncthreads();
        prefix = s_prefix, rem = s_rem, n_eq = s_n_eq;
    }
    // prefix is now the k-th largest key, held by n_eq elements: the top k are the k - rem
    // elements above it and the rem lowest-index ones equal to it.
    const int n_gt = k - (int)rem;

    if (tid == 0) s_taken = 0;
    for (int t = k + tid; t < TOPK_MAX; t += blockDim.x) cand_key[t] = 0, cand_idx[t] = INT_MAX;
    __syncthreads();
    // The sort orders candidates, so they may arrive in any order; which of the equal ones
    // to take only matters when some are left out.
    const bool all_eq = n_eq == rem;
    for_each_strided(x, n, [&](int j, float v) {
        const uint32_t key = order_key(v);
        if (key > prefix || (all_eq && key == prefix)) {
            const unsigned slot = atomicAdd(&s_taken, 1u);
            cand_key[slot] = key, cand_idx[slot] = j;
        }
    });
    if (!all_eq) {
        // The equal ones in chunks of blockDim.x consecutive indices, ranked in index order.
        unsigned eq_seen = 0;
        for (int base = 0; base < n && eq_seen < rem; base += blockDim.x) {
            const int j = base + tid;
            const bool eq = j < n && order_key(x[j]) == prefix;
            const unsigned eq_lanes = __ballot_sync(0xffffffffu, eq);
            if (lane == 0) warp_count[warp] = __popc(eq_lanes);
            const unsigned chunk_eq = __syncthreads_count(eq);
            if (eq) {
                unsigned rank = eq_seen + __popc(eq_lanes & ((1u << lane) - 1));
                for (int w = 0; w < warp; ++w) rank += warp_count[w];
                if (rank < rem) cand_key[n_gt + rank] = prefix, cand_idx[n_gt + rank] = j;
            }
            eq_seen += chunk_eq;  // block-wide, so the loop condition is uniform
            __syncthreads();      // warp_count is read before the next chunk writes it
        }
    }
    __syncthreads();

    // Bitonic sort of the TOPK_MAX candidates (padding last) into output order.
    for (int size = 2; size <= TOPK_MAX; size <<= 1) {
        for (int stride = size / 2; stride > 0; stride >>= 1) {
            const int p = tid ^ stride;
            if (tid < TOPK_MAX && p > tid) {
                const uint32_t ka = cand_key[tid], kb = cand_key[p];
                const int ia = cand_idx[tid], ib = cand_idx[p];
                const bool forward = (tid & size) == 0;
                if (forward ? ranks_before(kb, ib, ka, ia) : ranks_before(ka, ia, kb, ib)) {
                    cand_key[tid] = kb, cand_idx[tid] = ib;
                    cand_key[p] = ka, cand_idx[p] = ia;
                }
            }
            __syncthreads();
        }
    }
    if (tid < k) {
        ids_out[tid] = cand_idx[tid];
        vals_out[tid] = x[cand_idx[tid]];
    }
    if (tid == 0) stats[0] = max_x, stats[1] = sum_exp;
}

// out[r] = log(sum_j exp(x[r, j])), shifted by the row's max and summed in double.
// Grid: one block per row.
extern "C" __global__ void __launch_bounds__(1024)
row_logsumexp(const float* x, int n_cols, double* out) {
    follow_previous_kernel();
    const float* row = x + (size_t)blockIdx.x * n_cols;
    float m = -INFINITY;
    for_each_strided(row, n_cols, [&](int, float v) { m = fmaxf(m, v); });
    m = block_max(m);
    double s = 0.0;
    // Fewer loads ahead here: double exp's registers would spill at 1024 threads.
    for_each_strided<4>(row, n_cols, [&](int, float v) { s += exp((double)v - (double)m); });
    s = block_sum(s);
    if (threadIdx.x == 0) out[blockIdx.x] = (double)m + log(s);
}

// out[i] = log-probability of tokens[i] in row rows[i], given each row's logsumexp.
extern "C" __global__ void __launch_bounds__(256)
gather_logprobs(const float* x, int n_cols, const int* rows, const int* tokens, const double* lse,
                int n_pairs, double* out) {
    follow_previous_kernel();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n_pairs) return;
    const int r = rows[t];
    out[t] = (double)x[(size_t)r * n_cols + tokens[t]] - lse[r];
}
