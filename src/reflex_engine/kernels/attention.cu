// The KV cache write and the attention over it (see ops.Batch for which slots a token reads).
// Cache rows are f16, (capacity, n_kv_heads * head width) per layer; slot_seg (capacity,) is
// the segment of each written slot, shared by every layer.
#include "common.cuh"
#include "x16.cuh"

#define ATTN_WARPS 4
#define ATTN_MAX_GROUP 4  // query heads a block (ops.py's ATTENTION_MAX_GROUP), 8 dims each a lane
#define ATTN_GROUP_FLOATS 512  // a block's query heads x head width, at most (ops.py's ATTENTION_GROUP_FLOATS)
#define ATTN_MAX_SPLITS 64  // ops.py's ATTENTION_MAX_SPLITS
#define ATTN_SPLIT_MIN_SLOTS 32  // ops.py's ATTENTION_SPLIT_SLOTS: shorter splits only add partials

// Slots start..start+n_tok-1 get the rows of k and v. Grid: one block per token. Here and below
// the first slot is read from device memory (*start_at), so a captured decode step replays at
// every position.
extern "C" __global__ void __launch_bounds__(256)
kv_store(const float* k, const float* v, __half* k_cache, __half* v_cache, int* slot_seg,
         const int* seg, const int* start_at, int n_tok, int k_width, int v_width) {
    follow_previous_kernel();
    const int i = blockIdx.x, start = *start_at;
    const size_t slot = (size_t)start + i;
    for (int c = threadIdx.x; c < k_width; c += blockDim.x)
        k_cache[slot * k_width + c] = __float2half_rn(k[(size_t)i * k_width + c]);
    for (int c = threadIdx.x; c < v_width; c += blockDim.x)
        v_cache[slot * v_width + c] = __float2half_rn(v[(size_t)i * v_width + c]);
    if (threadIdx.x == 0) slot_seg[slot] = seg[i];
}

// exp(a - m) for a running maximum m >= a, taking a = -inf (nothing seen yet) to weight 0
// even when m is -inf too, where a - m would be NaN.
__device__ __forceinline__ float weight_of(float a, float m) {
    return a == -INFINITY ? 0.0f : expf(a - m);
}

// Where the warps of a block merge their partial softmaxes: per warp and query head of the block, its
// (max, sum) and its weighted V (acc[warp][head * dv + c]).
struct AttnMerge {
    float max[ATTN_WARPS][ATTN_MAX_GROUP], sum[ATTN_WARPS][ATTN_MAX_GROUP];
    float acc[ATTN_WARPS][ATTN_GROUP_FLOATS];
};

// Where one split of several leaves its partial softmax for combine_splits: its (max, sum) pair and its
// unnormalized weighted V (dv floats).
struct SplitPartial {
    float2* pair;
    float* acc;
};

// Where `attention`'s split s of (query i, head h) leaves its partial in global memory: its pair at
// pairs[row], its weighted V at acc[row * dv], row = (i * n_heads + h) * n_splits + s. acc follows all
// the pairs.
struct AttnPartials {
    float2* pairs;
    float* acc;
    __device__ AttnPartials(float* base, int n_tok, int n_heads, int n_splits)
        : pairs(reinterpret_cast<float2*>(base)), acc(base + 2 * (size_t)n_tok * n_heads * n_splits) {}
    __device__ SplitPartial at(size_t row, int dv) const { return {pairs + row, acc + row * dv}; }
};

// The slots a split takes: the splits (gridDim.z) cut the slots of the batch's last query evenly,
// ATTN_SPLIT_MIN_SLOTS at least; split blockIdx.z's begin at blockIdx.z times this.
__device__ __forceinline__ int split_length(int start, int n_tok) {
    return max(ATTN_SPLIT_MIN_SLOTS, (start + n_tok + (int)gridDim.z - 1) / (int)gridDim.z);
}

// The 8 f16 of a 16-byte load, as floats.
__device__ __forceinline__ void widen8(uint4 w, float (&f)[8]) {
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&u[e]));
        f[2 * e] = p.x, f[2 * e + 1] = p.y;
    }
}

// One (query token, split) for a block's HG query heads blockIdx.y * HG.., all of one KV head: see `attention`.
// The block reads each K and V row of its split once for all its heads. A row's dims lie 8 a lane over
// LPR lanes (16 bytes of f16 each load), so a warp's load takes WARP / LPR slots, its row groups; each lane
// keeps q's and the output's 8 dims of every head in registers, and each (warp, row group) runs an online
// softmax over its slots, STEP loads of K and of V in flight together. Then the row groups merge through
// shuffles and the warps through shared memory. Lanes past a head's width hold q = 0 and re-read its last
// 8 dims (finite), and store nothing.
template <int LPR, int HG, class Where>
__device__ __forceinline__ void attend(const float* q, const __half* k_cache, const __half* v_cache,
                                       const int* slot_seg, const int* seg, float* out, Where partial_at, int start,
                                       int n_tok, int n_heads, int n_kv_heads, int dk, int dv, float scale,
                                       AttnMerge& merge, uint8_t* xq, float2* xds) {
    // 16-byte loads of K and of V a lane has in flight together: with 4 heads' q and output in registers, 8 spill
    // under the launch bounds (168 registers)
    constexpr int STEP = HG == 4 ? 6 : 8;
    constexpr int GROUPS = WARP / LPR, WARP_SLOTS = GROUPS * STEP;
    const int i = blockIdx.x, h0 = blockIdx.y * HG, split = blockIdx.z, n_splits = gridDim.z;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, r = lane / LPR, d0 = 8 * (lane % LPR);
    const int split_len = split_length(start, n_tok);
    const int last = start + i, first = split * split_len, end = min(first + split_len - 1, last);
    const int kv_head = h0 / (n_heads / n_kv_heads);
    const size_t k_width = (size_t)n_kv_heads * dk, v_width = (size_t)n_kv_heads * dv;

    float qv[HG][8], acc[HG][8], run_max[HG], run_sum[HG];
#pragma unroll
    for (int hh = 0; hh < HG; ++hh) {
        const float* q_row = q + ((size_t)i * n_heads + h0 + hh) * dk + min(d0, dk - 8);
        const float4 a = *reinterpret_cast<const float4*>(q_row), b = *reinterpret_cast<const float4*>(q_row + 4);
        const float in = d0 < dk ? scale : 0.0f;
        qv[hh][0] = in * a.x, qv[hh][1] = in * a.y, qv[hh][2] = in * a.z, qv[hh][3] = in * a.w;
        qv[hh][4] = in * b.x, qv[hh][5] = in * b.y, qv[hh][6] = in * b.z, qv[hh][7] = in * b.w;
        run_max[hh] = -INFINITY, run_sum[hh] = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[hh][e] = 0.0f;
    }

    const int own_seg = seg[i];
    const __half* k_at = k_cache + (size_t)kv_head * dk + min(d0, dk - 8);
    const __half* v_at = v_cache + (size_t)kv_head * dv + min(d0, dv - 8);
    // A trip count the same for the whole block (a split past the query's slot makes none, and leaves max -inf and
    // sum 0: weight 0 in the combine, which skips its acc), so that the compiler knows every lane of a warp is at
    // its shuffles: a loop on the warp's own bound made each a collective sequence, and the kernel ~3x slower.
    const int trips = max(0, end - first + 1 + ATTN_WARPS * WARP_SLOTS - 1) / (ATTN_WARPS * WARP_SLOTS);
    for (int trip = 0; trip < trips; ++trip) {
        const int j0 = first + (trip * ATTN_WARPS + warp) * WARP_SLOTS;
        // every load of the step first and unconditionally, so they are in flight together: slots past
        // `end` re-read it, and are hidden below with the other segments' slots
        uint4 kx[STEP], vx[STEP];
        int slot_s[STEP];
#pragma unroll
        for (int u = 0; u < STEP; ++u) {
            const int j = min(j0 + GROUPS * u + r, end);
            slot_s[u] = slot_seg[j];
            kx[u] = *reinterpret_cast<const uint4*>(k_at + j * k_width);
            vx[u] = *reinterpret_cast<const uint4*>(v_at + j * v_width);
        }
        float score[STEP][HG], step_max[HG];
#pragma unroll
        for (int hh = 0; hh < HG; ++hh) step_max[hh] = run_max[hh];
#pragma unroll
        for (int u = 0; u < STEP; ++u) {
            const bool seen = j0 + GROUPS * u + r <= end && (slot_s[u] == 0 || slot_s[u] == own_seg);
            float kf[8];
            widen8(kx[u], kf);
#pragma unroll
            for (int hh = 0; hh < HG; ++hh) {
                float dot = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; ++e) dot = fmaf(qv[hh][e], kf[e], dot);
#pragma unroll
                for (int o = LPR / 2; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
                score[u][hh] = seen ? dot : -INFINITY;
                step_max[hh] = fmaxf(step_max[hh], score[u][hh]);
            }
        }
#pragma unroll
        for (int hh = 0; hh < HG; ++hh) {
            const float rescale = weight_of(run_max[hh], step_max[hh]);
            run_sum[hh] *= rescale;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[hh][e] *= rescale;
            run_max[hh] = step_max[hh];
        }
#pragma unroll
        for (int u = 0; u < STEP; ++u) {
            float vf[8];
            widen8(vx[u], vf);
#pragma unroll
            for (int hh = 0; hh < HG; ++hh) {
                const float p = weight_of(score[u][hh], run_max[hh]);
                run_sum[hh] += p;
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[hh][e] = fmaf(p, vf[e], acc[hh][e]);
            }
        }
    }

    // the warp's row groups, then its lanes of row group 0 into shared memory
#pragma unroll
    for (int o = LPR; o < WARP; o *= 2) {
#pragma unroll
        for (int hh = 0; hh < HG; ++hh) {
            const float other_max = __shfl_xor_sync(0xffffffffu, run_max[hh], o);
            const float other_sum = __shfl_xor_sync(0xffffffffu, run_sum[hh], o);
            const float m = fmaxf(run_max[hh], other_max), a = weight_of(run_max[hh], m), b = weight_of(other_max, m);
            run_sum[hh] = a * run_sum[hh] + b * other_sum;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[hh][e] = a * acc[hh][e] + b * __shfl_xor_sync(0xffffffffu, acc[hh][e], o);
            run_max[hh] = m;
        }
    }
    if (lane < LPR) {
#pragma unroll
        for (int hh = 0; hh < HG; ++hh) {
            if (lane == 0) merge.max[warp][hh] = run_max[hh], merge.sum[warp][hh] = run_sum[hh];
            if (d0 < dv)
#pragma unroll
                for (int e = 0; e < 8; ++e) merge.acc[warp][hh * dv + d0 + e] = acc[hh][e];
        }
    }
    __syncthreads();

    // A warp that saw no slot has max -inf and weighs 0. With one split, some warp saw the
    // query's own slot; with more, a split whose slots are all hidden has max -inf and sum 0.
    // Element f of the block's heads' outputs is head f / dv's dim f % dv; a warp's 32 consecutive
    // ones lie in one head (dv % 32 == 0 where xq is given).
    const bool one_split = n_splits == 1;
    for (int f = threadIdx.x; f < HG * dv; f += blockDim.x) {
        const int hh = f / dv;
        float m = merge.max[0][hh];
#pragma unroll
        for (int w = 1; w < ATTN_WARPS; ++w) m = fmaxf(m, merge.max[w][hh]);
        float o = 0.0f, total = 0.0f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) {
            const float wt = weight_of(merge.max[w][hh], m);
            total += wt * merge.sum[w][hh];
            o += wt * merge.acc[w][f];
        }
        if (one_split) {
            out[((size_t)i * n_heads + h0) * dv + f] = o /= total;
            if (xq) store_x16<1>({o}, true, (int)(((size_t)i * n_heads + h0) * dv + f), xq, xds);
        } else {
            const SplitPartial part = partial_at(hh);
            part.acc[f % dv] = o;
            if (f % dv == 0) *part.pair = make_float2(m, total);
        }
    }
}

// attend at the literals of the launch: LPR from the head widths, HG from the grid (n_heads / gridDim.y query
// heads a block, ops.py's choice: 1, 2 or 4, and HG x LPR x 8 <= ATTN_GROUP_FLOATS). partial_at(hh) gives where
// a split of several leaves its partial for head h0 + hh: worked out there, at the end, since a pointer held
// through attend's loop spills.
template <int LPR, class Where>
__device__ __forceinline__ void attend_group(const float* q, const __half* k_cache, const __half* v_cache,
                                             const int* slot_seg, const int* seg, float* out, Where partial_at,
                                             int start, int n_tok, int n_heads, int n_kv_heads, int dk, int dv,
                                             float scale, AttnMerge& merge, uint8_t* xq, float2* xds) {
    const int group = n_heads / (int)gridDim.y;
    if (group == 1)
        attend<LPR, 1>(q, k_cache, v_cache, slot_seg, seg, out, partial_at, start, n_tok, n_heads, n_kv_heads, dk, dv,
                       scale, merge, xq, xds);
    else if (group == 2)
        attend<LPR, 2>(q, k_cache, v_cache, slot_seg, seg, out, partial_at, start, n_tok, n_heads, n_kv_heads, dk, dv,
                       scale, merge, xq, xds);
    else if constexpr (4 * LPR * 8 <= ATTN_GROUP_FLOATS)
        attend<LPR, 4>(q, k_cache, v_cache, slot_seg, seg, out, partial_at, start, n_tok, n_heads, n_kv_heads, dk, dv,
                       scale, merge, xq, xds);
}

template <class Where>
__device__ __forceinline__ void attend_any(const float* q, const __half* k_cache, const __half* v_cache,
                                           const int* slot_seg, const int* seg, float* out, Where partial_at,
                                           int start, int n_tok, int n_heads, int n_kv_heads, int dk, int dv,
                                           float scale, AttnMerge& merge, uint8_t* xq, float2* xds) {
    const int width = max(dk, dv);
    if (width <= 32)
        attend_group<4>(q, k_cache, v_cache, slot_seg, seg, out, partial_at, start, n_tok, n_heads, n_kv_heads, dk, dv,
                        scale, merge, xq, xds);
    else if (width <= 64)
        attend_group<8>(q, k_cache, v_cache, slot_seg, seg, out, partial_at, start, n_tok, n_heads, n_kv_heads, dk, dv,
                        scale, merge, xq, xds);
    else if (width <= 128)
        attend_group<16>(q, k_cache, v_cache, slot_seg, seg, out, partial_at, start, n_tok, n_heads, n_kv_heads, dk, dv,
                         scale, merge, xq, xds);
    else
        attend_group<32>(q, k_cache, v_cache, slot_seg, seg, out, partial_at, start, n_tok, n_heads, n_kv_heads, dk, dv,
                         scale, merge, xq, xds);
}

// The partials `attention`'s splits of one (query, head) left in global memory (AttnPartials, from row0):
// other blocks of the launch wrote them, so read past L1.
struct PartialsInMemory {
    const float2* pairs;
    const float* acc;
    int dv;
    __device__ float2 pair(int s) const { return __ldcg(pairs + s); }
    __device__ float value(int s, int c) const { return __ldcg(acc + (size_t)s * dv + c); }
};

// out for (query i, head h) from the n_splits partials the splits left (`from`: PartialsInMemory or
// PartialsInShared): each split's sum and weighted V rescaled to the largest max. Splits of weight 0
// (past the query's slot, all hidden, or negligible) are skipped, so their acc is never read. With xq,
// out's int16 blocks too (x16.cuh; dv a multiple of 32). Every thread of the block (128) calls it.
#define COMBINE_STEP 16  // splits whose acc loads a thread has in flight together
template <class Partials>
__device__ __forceinline__ void combine_splits(Partials from, float* out, int i, int h, int n_heads,
                                               int n_splits, int dv, uint8_t* xq, float2* xds) {
    __shared__ float2 pair[ATTN_MAX_SPLITS];
    __shared__ float wt[ATTN_MAX_SPLITS + COMBINE_STEP];  // 0 past n_splits
    if (threadIdx.x < n_splits) pair[threadIdx.x] = from.pair(threadIdx.x);
    __syncthreads();
    float m = -INFINITY;
    for (int s = 0; s < n_splits; ++s) m = fmaxf(m, pair[s].x);
    for (int s = threadIdx.x; s < ATTN_MAX_SPLITS + COMBINE_STEP; s += blockDim.x)
        wt[s] = s < n_splits ? weight_of(pair[s].x, m) : 0.0f;
    __syncthreads();
    float total = 0.0f;  // > 0: the split holding the query's own slot sees it
    for (int s = 0; s < n_splits; ++s) total += wt[s] * pair[s].y;
    const float inv_total = 1.0f / total;
    float* out_row = out + ((size_t)i * n_heads + h) * dv;
    for (int c = threadIdx.x; c < dv; c += blockDim.x) {
        float o = 0.0f;
        for (int s0 = 0; s0 < n_splits; s0 += COMBINE_STEP) {
            float a[COMBINE_STEP];
#pragma unroll
            for (int u = 0; u < COMBINE_STEP; ++u) a[u] = wt[s0 + u] != 0.0f ? from.value(s0 + u, c) : 0.0f;
#pragma unroll
            for (int u = 0; u < COMBINE_STEP; ++u) o += wt[s0 + u] * a[u];
        }
        out_row[c] = o *= inv_total;
        if (xq) store_x16<1>({o}, true, (int)(((size_t)i * n_heads + h) * dv + c), xq, xds);  // a warp: 32 consecutive c
    }
}

// Before a block's wait for the kernel before it (the rope writing this pass's own slots): asks L2 for the K
// and V rows (its KV head's) of its split's slots that earlier passes wrote, so that their trip from memory runs
// beside that kernel and attend's loads after the wait find them in L2. It reads nothing a kernel of the pass
// writes (*start_at: the copy before the pass). The split's slots as attend cuts them. Called by a decode step's
// clusters alone: in `attention` at a 4,096-token context (576-1,152 blocks asking for 512 lines each) it lost
// 3-4% (run 23, a block a query head).
__device__ __forceinline__ void ask_l2_for_earlier_slots(const __half* k_cache, const __half* v_cache, const int* start_at,
                                                         int n_tok, int n_heads, int n_kv_heads, int dk, int dv) {
    const int start = *start_at, split_len = split_length(start, n_tok);
    const int first = blockIdx.z * split_len, n_slots = min(first + split_len, start) - first;
    const int kv_head = blockIdx.y * (n_heads / (int)gridDim.y) / (n_heads / n_kv_heads);
    constexpr int LINE = 64;  // halves a 128-byte line
    const int k_lines = (dk + LINE - 1) / LINE, lines = k_lines + (dv + LINE - 1) / LINE;
    for (int u = threadIdx.x; u < n_slots * lines; u += blockDim.x) {
        const size_t slot = first + u / lines;
        const int line = u % lines;
        prefetch_l2(line < k_lines ? k_cache + (slot * n_kv_heads + kv_head) * dk + line * LINE
                                   : v_cache + (slot * n_kv_heads + kv_head) * dv + (line - k_lines) * LINE);
    }
}

// softmax(scale * q.k) . v for query token i (cache slot start + i) and query head h, over
// the slots j <= start + i of segment 0 or seg[i]; query head h reads KV head
// h / (n_heads / n_kv_heads). A block takes n_heads / gridDim.y query heads of one KV head (1, 2 or 4: the
// host's choice), so that it reads their K and V rows once: a block a query head read them once a head, and
// at a 4,096-token context that cost ~4x the cache's bytes at the copy's rate (docs/perf-notes.md run 23).
// The slots are cut into gridDim.z splits (flash-decoding), so that a
// decode step at a long context has blocks for every SM; their length comes from *start_at on
// the device, so the grid (the host's choice, from the cache's capacity) fits every position a
// captured step replays at. Each (warp, row group) of a split runs an online softmax over its share of the
// split's slots (attend), then their results are merged. One split writes out; more write partials
// (AttnPartials, in `partials`), a split past the query's slot only its (-inf, 0) pairs, and the last of
// them to finish (counted in counts[i * gridDim.y + blockIdx.y], which it sets back to 0 for the next
// launch) merges each head's into out (combine_splits), in the splits' order: the result does not depend on
// which one is last. Whichever block writes out writes its int16 blocks beside it too, given xq (x16.cuh).
// LAUNCH: grid (n_tok, n_heads / group, n_splits), group 1, 2 or 4 dividing n_heads / n_kv_heads with group x
// (max(dk, dv) up to a power of two, 32 at least) <= ATTN_GROUP_FLOATS; block ATTN_WARPS * 32 (128),
// n_splits <= ATTN_MAX_SPLITS; partials: room for n_tok * n_heads * n_splits * (dv + 2) floats and counts
// n_tok * n_heads ints, all 0 before the first launch, when n_splits > 1; dk, dv multiples of 8, at most 256.
extern "C" __global__ void __launch_bounds__(ATTN_WARPS * WARP, 3)
attention(const float* q, const __half* k_cache, const __half* v_cache, const int* slot_seg,
          const int* seg, float* out, const int* start_at, int n_tok, int n_heads, int n_kv_heads, int dk,
          int dv, float scale, float* partials, int* counts, uint8_t* xq, float2* xds) {
    follow_previous_kernel();
    __shared__ AttnMerge merge;
    __shared__ bool last;
    const int group = n_heads / (int)gridDim.y, h0 = blockIdx.y * group;
    const auto row_of = [=](int h) { return ((size_t)blockIdx.x * n_heads + h) * gridDim.z; };  // its split 0's
    const auto partial_at = [=](int hh) {
        return AttnPartials(partials, n_tok, n_heads, gridDim.z).at(row_of(h0 + hh) + blockIdx.z, dv);
    };
    attend_any(q, k_cache, v_cache, slot_seg, seg, out, partial_at, *start_at, n_tok, n_heads, n_kv_heads, dk, dv,
               scale, merge, xq, xds);
    if (gridDim.z == 1) return;
    __threadfence();  // this split's partials, visible to every block before it is counted
    __syncthreads();
    if (threadIdx.x == 0) {
        int* count = counts + (size_t)blockIdx.x * gridDim.y + blockIdx.y;
        last = atomicAdd(count, 1) == (int)gridDim.z - 1;
        if (last) *count = 0;  // every split has counted: none reads it again in this launch
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const AttnPartials part(partials, n_tok, n_heads, gridDim.z);
    for (int h = h0; h < h0 + group; ++h) {
        if (h > h0) __syncthreads();  // combine_splits' shared arrays, free again
        combine_splits(PartialsInMemory{part.pairs + row_of(h), part.acc + row_of(h) * dv, dv}, out, blockIdx.x, h,
                       n_heads, gridDim.z, dv, xq, xds);
    }
}

// The cluster barrier's halves: every thread of the cluster arrives, then waits until all have (or exited).
// Arrived with release, waited with acquire: shared memory writes before the arrival, the cluster's own
// included, are visible after the wait.
__device__ __forceinline__ void cluster_arrive(bool release) {
#if __CUDA_ARCH__ >= 900
    if (release)
        asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    else
        asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// p, a shared address of this block, as the same address in the shared memory of the cluster's block of rank
// `rank`: a generic address that plain loads and stores reach.
template <class T>
__device__ __forceinline__ T* in_block_of_rank(T* p, int rank) {
#if __CUDA_ARCH__ >= 900
    uint64_t at;
    asm("mapa.u64 %0, %1, %2;" : "=l"(at) : "l"(p), "r"(rank));
    return reinterpret_cast<T*>(at);
#else
    return p;
#endif
}

#define ATTN_CLUSTER 8  // ops.py's ATTENTION_CLUSTER_SPLITS
#if __CUDA_ARCH__ >= 900
#define ATTN_CLUSTER_DIMS __cluster_dims__(1, 1, ATTN_CLUSTER)
#else
#define ATTN_CLUSTER_DIMS
#endif

// The partials of a cluster's splits for the block's query heads, gathered in its first block's shared memory:
// split s's pair of head h0 + hh at pair[s][hh], its weighted V at acc[s][hh * dv ..].
struct ClusterPartials {
    float2 pair[ATTN_CLUSTER][ATTN_MAX_GROUP];
    float acc[ATTN_CLUSTER][ATTN_GROUP_FLOATS];
};
struct PartialsInShared {
    const ClusterPartials& at;
    int hh, dv;
    __device__ float2 pair(int s) const { return at.pair[s][hh]; }
    __device__ float value(int s, int c) const { return at.acc[s][hh * dv + c]; }
};

// `attention` in ATTN_CLUSTER splits (sm_90+) whose blocks are one cluster: each split writes its partials into
// the first block's shared memory (distributed shared memory) and leaves; the first merges them there in
// the splits' order, as `attention`'s last split does from global memory: the same arithmetic, so the same
// bits, without the fence, the count and two trips to memory on a decode step's path.
// LAUNCH: grid (n_tok, n_heads / group, ATTN_CLUSTER), block ATTN_WARPS * 32 (128), group as `attention`'s;
// `attention`'s parameters (partials and counts unused), so that a call site passes one list to either.
extern "C" __global__ void ATTN_CLUSTER_DIMS __launch_bounds__(ATTN_WARPS * WARP, 3)
attention_cluster(const float* q, const __half* k_cache, const __half* v_cache, const int* slot_seg,
                  const int* seg, float* out, const int* start_at, int n_tok, int n_heads, int n_kv_heads, int dk,
                  int dv, float scale, float* partials, int* counts, uint8_t* xq, float2* xds) {
    // a decode step's clusters fit the SMs at once and start beside the rope; a short batch's may take waves,
    // whose later blocks would ask on their own path
    if (n_tok == 1) ask_l2_for_earlier_slots(k_cache, v_cache, start_at, n_tok, n_heads, n_kv_heads, dk, dv);
    follow_previous_kernel();
    cluster_arrive(false);  // this block has started: its shared memory may be written once every block has
    __shared__ AttnMerge merge;
    __shared__ float2 own_pair[ATTN_MAX_GROUP];
    __shared__ float own_acc[ATTN_GROUP_FLOATS];
    __shared__ ClusterPartials gathered;
    const int group = n_heads / (int)gridDim.y;
    attend_any(q, k_cache, v_cache, slot_seg, seg, out, [&](int hh) { return SplitPartial{&own_pair[hh], own_acc + hh * dv}; },
               *start_at, n_tok, n_heads, n_kv_heads, dk, dv, scale, merge, xq, xds);
    __syncthreads();
    cluster_wait();
    const int split = blockIdx.z;
    if (threadIdx.x < group) *in_block_of_rank(&gathered.pair[split][threadIdx.x], 0) = own_pair[threadIdx.x];
    float* acc = in_block_of_rank(gathered.acc[split], 0);
    for (int f = threadIdx.x; f < group * dv; f += blockDim.x)
        if (own_pair[f / dv].x != -INFINITY) acc[f] = own_acc[f];  // else the merge gives it weight 0, never reads it
    cluster_arrive(true);
    if (split != 0) return;
    cluster_wait();
    for (int hh = 0; hh < group; ++hh) {
        if (hh > 0) __syncthreads();  // combine_splits' shared arrays, free again
        combine_splits(PartialsInShared{gathered, hh, dv}, out, blockIdx.x, blockIdx.y * group + hh, n_heads,
                       ATTN_CLUSTER, dv, xq, xds);
    }
}
