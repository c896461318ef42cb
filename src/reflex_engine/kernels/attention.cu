// The KV cache write and the attention over it (see ops.Batch for which slots a token reads).
// Cache rows are f16, (capacity, n_kv_heads * head width) per layer; slot_seg (capacity,) is
// the segment of each written slot, shared by every layer.
#include "common.cuh"
#include "mma.cuh"
#include "x16.cuh"

#define ATTN_WARPS 4
#define ATTN_MAX_PER_LANE 8  // head widths up to 256, 32 lanes
#define ATTN_MAX_SPLITS 64  // ops.py's ATTENTION_MAX_SPLITS
#define ATTN_SPLIT_MIN_SLOTS 32  // one STEP of 8 slots a warp: shorter splits only add partials

// Slots start..start+n_tok-1 get the rows of k and v (k_width and v_width floats), in cache rows k_stride and
// v_stride halves apart: their own caches' widths, or, for MLA, one latent row [c ; k_rope] of both (v_cache
// inside it). Grid: one block per token. Here and below the first slot is read from device memory (*start_at),
// so a captured decode step replays at every position.
extern "C" __global__ void __launch_bounds__(256)
kv_store(const float* k, const float* v, __half* k_cache, __half* v_cache, int* slot_seg,
         const int* seg, const int* start_at, int n_tok, int k_width, int v_width, int k_stride, int v_stride) {
    follow_previous_kernel();
    const int i = blockIdx.x, start = *start_at;
    const size_t slot = (size_t)start + i;
    for (int c = threadIdx.x; c < k_width; c += blockDim.x)
        k_cache[slot * k_stride + c] = __float2half_rn(k[(size_t)i * k_width + c]);
    for (int c = threadIdx.x; c < v_width; c += blockDim.x)
        v_cache[slot * v_stride + c] = __float2half_rn(v[(size_t)i * v_width + c]);
    if (threadIdx.x == 0) slot_seg[slot] = seg[i];
}

// exp(a - m) for a running maximum m >= a, taking a = -inf (nothing seen yet) to weight 0
// even when m is -inf too, where a - m would be NaN.
__device__ __forceinline__ float weight_of(float a, float m) {
    return a == -INFINITY ? 0.0f : expf(a - m);
}

// Where the warps of a block merge their partial softmaxes.
struct AttnMerge {
    float max[ATTN_WARPS], sum[ATTN_WARPS];
    float acc[ATTN_WARPS][ATTN_MAX_PER_LANE * WARP];
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

// n halves at p as floats' sources: one 16-byte load where they are 8 (p is then 16-byte aligned: a row's
// piece of 8 dims), else one by one, past n re-reading the last (finite; its q is 0 or its acc never stored).
template <int L>
__device__ __forceinline__ void load_halves(const __half* p, int n, __half (&x)[L]) {
    if (L == 8 && n == 8) {
        const uint4 w = *reinterpret_cast<const uint4*>(p);
        memcpy(x, &w, sizeof(w));
    } else {
#pragma unroll
        for (int e = 0; e < L; ++e) x[e] = p[min(e, n - 1)];
    }
}

// One (query token, query head, split) for a block: see `attention`. A group of G lanes takes one slot,
// lane li of it dims li·nk .. li·nk + nk - 1 of q and K, li·nv .. of V and the output (nk, nv <= KL, VL:
// literals at the common call sites, so the per-lane loops shrink to them there), so a warp takes 32 / G
// slots at once and a slot's score is a sum over G lanes. Why: with a lane a dim of every 32 (G = 32, 2-byte
// loads) the kernel was bound by issuing instructions at a 4,096-token context, ~89 a slot and head (H200
// ncu, docs/perf-notes.md run 24); 8 consecutive dims a lane make one 16-byte load of a K or V row's
// piece and a 4-step sum for 128-wide heads. STEP runs of 32 / G slots at a time, their loads in flight
// together.
template <int STEP, int G, int KL, int VL, class Where>
__device__ __forceinline__ void attend(const float* q, const __half* k_cache,
                                       const __half* v_cache, const int* slot_seg, const int* seg,
                                       float* out, Where partial_at, int start, int n_tok, int n_heads,
                                       int n_kv_heads, int nk, int nv, float scale, AttnMerge& merge,
                                       uint8_t* xq, float2* xds) {
    static_assert(WARP % G == 0 && G * KL <= ATTN_MAX_PER_LANE * WARP && G * VL <= ATTN_MAX_PER_LANE * WARP,
                  "a warp's slots");
    constexpr int SPW = WARP / G, RUN = STEP * SPW;  // slots a warp takes at once, and in a step
    const int i = blockIdx.x, h = blockIdx.y, split = blockIdx.z, n_splits = gridDim.z;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, gi = lane / G, li = lane % G;
    const int split_len = split_length(start, n_tok);
    const int last = start + i, first = split * split_len, end = min(first + split_len - 1, last);
    if (first > end) {  // a split past the query's slot: weight 0 in the combine, which skips its acc
        if (threadIdx.x == 0) *partial_at().pair = make_float2(-INFINITY, 0.0f);
        return;
    }
    const int dk = nk * G, dv = nv * G, kv_head = h / (n_heads / n_kv_heads);
    const size_t k_width = (size_t)n_kv_heads * dk, v_width = (size_t)n_kv_heads * dv;

    const float* q_row = q + ((size_t)i * n_heads + h) * dk + li * nk;
    float qv[KL], acc[VL];
#pragma unroll
    for (int e = 0; e < KL; ++e) qv[e] = e < nk ? q_row[e] : 0.0f;
#pragma unroll
    for (int e = 0; e < VL; ++e) acc[e] = 0.0f;

    const int own_seg = seg[i];
    const __half* k_head = k_cache + (size_t)kv_head * dk + li * nk;
    const __half* v_head = v_cache + (size_t)kv_head * dv + li * nv;
    float run_max = -INFINITY, run_sum = 0.0f;  // this lane group's
    for (int j0 = first + warp * RUN; j0 <= end; j0 += ATTN_WARPS * RUN) {
        // Every load of the step first and unconditionally, so they are in flight together: slots past
        // `end` re-read it. Then the scores, with hidden slots at -inf.
        __half kx[STEP][KL], vx[STEP][VL];
        int slot_s[STEP];
#pragma unroll
        for (int u = 0; u < STEP; ++u) {
            const int j = min(j0 + u * SPW + gi, end);
            slot_s[u] = slot_seg[j];
            load_halves<KL>(k_head + j * k_width, nk, kx[u]);
            load_halves<VL>(v_head + j * v_width, nv, vx[u]);
        }
        float score[STEP], step_max = run_max;
#pragma unroll
        for (int u = 0; u < STEP; ++u) {
            float dot = 0.0f;
#pragma unroll
            for (int e = 0; e < KL; ++e) dot += qv[e] * __half2float(kx[u][e]);
            dot = warp_reduce<G>(dot, Sum());
            const bool seen = j0 + u * SPW + gi <= end && (slot_s[u] == 0 || slot_s[u] == own_seg);
            score[u] = seen ? dot * scale : -INFINITY;
            step_max = fmaxf(step_max, score[u]);
        }
        const float rescale = weight_of(run_max, step_max);
        run_sum *= rescale;
#pragma unroll
        for (int e = 0; e < VL; ++e) acc[e] *= rescale;
#pragma unroll
        for (int u = 0; u < STEP; ++u) {
            const float p = weight_of(score[u], step_max);
            run_sum += p;
#pragma unroll
            for (int e = 0; e < VL; ++e) acc[e] += p * __half2float(vx[u][e]);
        }
        run_max = step_max;
    }

    // The warp's lane groups merged (each group's sum and acc weighted to the largest max), then the warps.
    float m = run_max;
#pragma unroll
    for (int o = G; o < WARP; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float own = weight_of(run_max, m);
    run_sum *= own;
#pragma unroll
    for (int e = 0; e < VL; ++e) acc[e] *= own;
#pragma unroll
    for (int o = G; o < WARP; o <<= 1) {
        run_sum += __shfl_xor_sync(0xffffffffu, run_sum, o);
#pragma unroll
        for (int e = 0; e < VL; ++e) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], o);
    }
    if (lane == 0) merge.max[warp] = m, merge.sum[warp] = run_sum;
    if (lane < G)
#pragma unroll
        for (int e = 0; e < VL; ++e)
            if (e < nv) merge.acc[warp][li * nv + e] = acc[e];
    __syncthreads();

    // A warp that saw no slot has max -inf and weighs 0. With one split, some warp saw the
    // query's own slot; with more, a split whose slots are all hidden has max -inf and sum 0.
    m = merge.max[0];
#pragma unroll
    for (int w = 1; w < ATTN_WARPS; ++w) m = fmaxf(m, merge.max[w]);
    float wt[ATTN_WARPS], total = 0.0f;
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; ++w) {
        wt[w] = weight_of(merge.max[w], m);
        total += wt[w] * merge.sum[w];
    }
    const float norm = n_splits == 1 ? 1.0f / total : 1.0f;
    float* out_row = n_splits == 1 ? out + ((size_t)i * n_heads + h) * dv : partial_at().acc;
    for (int c = threadIdx.x; c < dv; c += blockDim.x) {
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) o += wt[w] * merge.acc[w][c];
        out_row[c] = o *= norm;
        if (n_splits == 1 && xq) store_x16<1>({o}, true, (int)(((size_t)i * n_heads + h) * dv + c), xq, xds);  // a warp: 32 consecutive c
    }
    if (n_splits > 1 && threadIdx.x == 0) *partial_at().pair = make_float2(m, total);
}

// attend at the head widths' literals: see it. partial_at() gives where a split of several leaves its
// partial: worked out there, at the end, since a pointer held through attend's loop spills. A warp's step
// is 8 slots where a row's piece is 8 dims of 64- or 128-wide heads (ATTN_SPLIT_MIN_SLOTS: a split's
// 32 slots are one step of each warp); the other widths take a slot a warp, 2 a step, with up to
// ATTN_MAX_PER_LANE dims a lane, so that their registers (which size the whole kernel's) stay in check.
template <class Where>
__device__ __forceinline__ void attend_any(const float* q, const __half* k_cache, const __half* v_cache,
                                           const int* slot_seg, const int* seg, float* out, Where partial_at,
                                           int start, int n_tok, int n_heads, int n_kv_heads, int dk, int dv,
                                           float scale, AttnMerge& merge, uint8_t* xq, float2* xds) {
    if (dk == 64 && dv == 64)
        attend<2, 8, 8, 8>(q, k_cache, v_cache, slot_seg, seg, out, partial_at, start, n_tok, n_heads, n_kv_heads,
                           8, 8, scale, merge, xq, xds);
    else if (dk == 128 && dv == 128)
        attend<4, 16, 8, 8>(q, k_cache, v_cache, slot_seg, seg, out, partial_at, start, n_tok, n_heads, n_kv_heads,
                            8, 8, scale, merge, xq, xds);
    else if (dk == 256 && dv == 256)
        attend<2, WARP, 8, 8>(q, k_cache, v_cache, slot_seg, seg, out, partial_at, start, n_tok, n_heads, n_kv_heads,
                              8, 8, scale, merge, xq, xds);
    else
        attend<2, WARP, ATTN_MAX_PER_LANE, ATTN_MAX_PER_LANE>(q, k_cache, v_cache, slot_seg, seg, out, partial_at,
                                                              start, n_tok, n_heads, n_kv_heads, dk / WARP, dv / WARP,
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
// writes (start: from the copy before the pass). The split's slots as attend cuts them. Called by a decode step's
// clusters alone: in `attention` at a 4,096-token context (576-1,152 blocks asking for 512 lines each) it lost
// 3-4% (run 23).
__device__ __forceinline__ void ask_l2_for_earlier_slots(const __half* k_cache, const __half* v_cache, int start,
                                                         int n_tok, int n_heads, int n_kv_heads, int dk, int dv) {
    const int split_len = split_length(start, n_tok);
    const int first = blockIdx.z * split_len, n_slots = min(first + split_len, start) - first;
    const int kv_head = blockIdx.y / (n_heads / n_kv_heads);
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
// h / (n_heads / n_kv_heads). The slots are cut into gridDim.z splits (flash-decoding), so that a
// decode step at a long context has blocks for every SM; their length comes from *start_at on
// the device, so the grid (the host's choice, from the cache's capacity) fits every position a
// captured step replays at. Each warp of a split runs an online softmax over its share of the
// split's slots (runs of consecutive ones, every ATTN_WARPS-th run; a group of lanes a slot), then
// the warps' results are merged. One split writes out; more write partials (AttnPartials, in `partials`), a split
// past the query's slot only its (-inf, 0) pair, and the last of them to finish (counted in
// counts[i * n_heads + h], which it sets back to 0 for the next launch) merges them into out
// (combine_splits), in the splits' order: the result does not depend on which one is last.
// Whichever block writes out writes its int16 blocks beside it too, given xq (x16.cuh).
// LAUNCH: grid (n_tok, n_heads, n_splits), block ATTN_WARPS * 32 (128), n_splits <= ATTN_MAX_SPLITS;
// partials: room for n_tok * n_heads * n_splits * (dv + 2) floats and counts n_tok * n_heads ints,
// all 0 before the first launch, when n_splits > 1; dk, dv multiples of 32, at most 256.
extern "C" __global__ void __launch_bounds__(ATTN_WARPS * WARP, 5)
attention(const float* q, const __half* k_cache, const __half* v_cache, const int* slot_seg,
          const int* seg, float* out, const int* start_at, int n_tok, int n_heads, int n_kv_heads, int dk,
          int dv, float scale, float* partials, int* counts, uint8_t* xq, float2* xds) {
    follow_previous_kernel();
    __shared__ AttnMerge merge;
    __shared__ bool last;
    const auto partial_at = [=] {
        const size_t row = ((size_t)blockIdx.x * n_heads + blockIdx.y) * gridDim.z + blockIdx.z;
        return AttnPartials(partials, n_tok, n_heads, gridDim.z).at(row, dv);
    };
    attend_any(q, k_cache, v_cache, slot_seg, seg, out, partial_at, *start_at, n_tok, n_heads, n_kv_heads, dk, dv,
               scale, merge, xq, xds);
    if (gridDim.z == 1) return;
    __threadfence();  // this split's partials, visible to every block before it is counted
    __syncthreads();
    if (threadIdx.x == 0) {
        int* count = counts + (size_t)blockIdx.x * n_heads + blockIdx.y;
        last = atomicAdd(count, 1) == (int)gridDim.z - 1;
        if (last) *count = 0;  // every split has counted: none reads it again in this launch
    }
    __syncthreads();
    if (last) {
        __threadfence();
        const size_t row0 = ((size_t)blockIdx.x * n_heads + blockIdx.y) * gridDim.z;
        const AttnPartials part(partials, n_tok, n_heads, gridDim.z);
        combine_splits(PartialsInMemory{part.pairs + row0, part.acc + row0 * dv, dv}, out, blockIdx.x, blockIdx.y,
                       n_heads, gridDim.z, dv, xq, xds);
    }
}

#define ATTN_CLUSTER 8  // ops.py's ATTENTION_CLUSTER_SPLITS
#if __CUDA_ARCH__ >= 900
#define ATTN_CLUSTER_DIMS __cluster_dims__(1, 1, ATTN_CLUSTER)
#else
#define ATTN_CLUSTER_DIMS
#endif

// The partials of a cluster's splits, gathered in its first block's shared memory.
struct ClusterPartials {
    float2 pair[ATTN_CLUSTER];
    float acc[ATTN_CLUSTER][ATTN_MAX_PER_LANE * WARP];
};
struct PartialsInShared {
    const ClusterPartials& at;
    __device__ float2 pair(int s) const { return at.pair[s]; }
    __device__ float value(int s, int c) const { return at.acc[s][c]; }
};

// `attention` in ATTN_CLUSTER splits (sm_90+) whose blocks are one cluster: each split writes its partial into
// the first block's shared memory (distributed shared memory) and leaves; the first merges them there in
// the splits' order, as `attention`'s last split does from global memory: the same arithmetic, so the same
// bits, without the fence, the count and two trips to memory on a decode step's path.
// LAUNCH: grid (n_tok, n_heads, ATTN_CLUSTER), block ATTN_WARPS * 32 (128); `attention`'s parameters
// (partials and counts unused), so that a call site passes one list to either.
extern "C" __global__ void ATTN_CLUSTER_DIMS __launch_bounds__(ATTN_WARPS * WARP, 5)
attention_cluster(const float* q, const __half* k_cache, const __half* v_cache, const int* slot_seg,
                  const int* seg, float* out, const int* start_at, int n_tok, int n_heads, int n_kv_heads, int dk,
                  int dv, float scale, float* partials, int* counts, uint8_t* xq, float2* xds) {
    const BlockClock clocked;
    // the pass's first slot, read once before the wait: the copy before the pass, which no kernel of it writes (read
    // after the wait, a trip to L2 on the path before the slots' loads, which need it)
    const int start = *start_at;
    // a decode step's clusters (n_heads x 8 blocks) fit the SMs at once and start beside the rope; a short batch's
    // may take waves, whose later blocks would ask on their own path
    if (n_tok == 1) ask_l2_for_earlier_slots(k_cache, v_cache, start, n_tok, n_heads, n_kv_heads, dk, dv);
    follow_previous_kernel_early();
    cluster_arrive(false);  // this block has started: its shared memory may be written once every block has
    __shared__ AttnMerge merge;
    __shared__ float2 own_pair;
    __shared__ float own_acc[ATTN_MAX_PER_LANE * WARP];
    __shared__ ClusterPartials gathered;
    attend_any(q, k_cache, v_cache, slot_seg, seg, out, [&] { return SplitPartial{&own_pair, own_acc}; }, start,
               n_tok, n_heads, n_kv_heads, dk, dv, scale, merge, xq, xds);
    __syncthreads();
    cluster_wait();
    const int split = blockIdx.z;
    const float2 pair = own_pair;
    if (threadIdx.x == 0) *in_block_of_rank(&gathered.pair[split], 0) = pair;
    if (pair.x != -INFINITY) {  // else the merge gives it weight 0 and never reads its acc
        float* acc = in_block_of_rank(gathered.acc[split], 0);
        for (int c = threadIdx.x; c < dv; c += blockDim.x) acc[c] = own_acc[c];
    }
    cluster_arrive(true);
    if (split != 0) return;
    cluster_wait();
    combine_splits(PartialsInShared{gathered}, out, blockIdx.x, blockIdx.y, n_heads, ATTN_CLUSTER, dv, xq, xds);
}

#define ATTN_GROUP_MAX 8  // ops.py's ATTENTION_GROUP_MAX: query heads a KV head, the columns of an mma's B
#define ATTN_GROUP_CHUNK 16  // slots a warp takes at once: the k of the P V mma

// Where attention_group's warps merge: each warp's (max, sum) of every head of the group and its weighted V.
template <int D>
struct GroupMerge {
    float max[ATTN_WARPS][ATTN_GROUP_MAX], sum[ATTN_WARPS][ATTN_GROUP_MAX];
    float acc[ATTN_WARPS][ATTN_GROUP_MAX][D];
};

// Two f32 as an f16x2 hi and the f16x2 of what hi leaves out, lo: hi + lo holds them to ~2^-22.
__device__ __forceinline__ void split_half2(float x, float y, uint32_t& hi, uint32_t& lo) {
    const __half2 h = __floats2half2_rn(x, y);
    const float2 back = __half22float2(h);
    hi = as_u32(h), lo = pack_half2(x - back.x, y - back.y);
}

// The f16x2 of half i of two rows' pieces as loaded (words): a's in the low half, b's in the high one.
template <int W>
__device__ __forceinline__ uint32_t pair_halves(const uint32_t (&a)[W], const uint32_t (&b)[W], int i) {
    return __byte_perm(a[i / 2], b[i / 2], i % 2 ? 0x7632 : 0x5410);
}

// One split of a decode step's slots for one KV head's group of query heads: see attention_group. Warp w takes
// chunks of 16 slots, every ATTN_WARPS-th from the split's first + 16w; lane (g, c) = (lane / 4, lane % 4).
//  - Scores S^T = Q K^T, an m16n8k16 per 16 dims and 8 slots: A is Q, its row g head g of the group (rows past
//    the group, and 8-15, zero); B is K^T, its column g slot 8nt + g of the chunk. The dims are permuted alike
//    in both so that a lane's B for two k-steps is one 16-byte load: k-step 2kk + hh's k = 2c, 2c + 1 are dims
//    32kk + 8c + 4hh + 0, 1 and k = 2c + 8, 2c + 9 dims .. + 2, 3. C: head g's scores of slots 8nt + 2c, + 1.
//  - O^T += V^T P^T, an m16n8k16 per 16 dims: B is P^T as the scores' C fragments lie (k = slots 2c, 2c + 1 of
//    nt 0 and 2c + 8, 2c + 9: nt 1; column g = head g); A is V^T, its rows the dims tau(mt, g) = (D/8) g + mt and
//    tau(mt, g + 8) = (D/8) g + D/16 + mt, so that a lane reads its 4 slots' dims (D/8) g .. as 16-byte loads.
//    C: dims tau(mt, g), tau(mt, g + 8) of heads 2c, 2c + 1.
// q and the probabilities go in as f16 hi + lo pairs (K and V are f16 already), so the products carry float32's
// error, not f16's (the prefill kernel rounds both to f16). The softmax runs in base 2 (q scaled by log2(e)).
template <int D>
__device__ __forceinline__ void attend_group(const float* q, const __half* k_cache, const __half* v_cache,
                                             const int* slot_seg, const int* seg, int start, int n_heads,
                                             int n_kv_heads, float scale, float* partials, GroupMerge<D>& merge) {
    constexpr int KS = D / 16, VW = D / 16;  // k-steps of the scores and m-tiles of O^T; words of a lane's V dims
    const int kv_head = blockIdx.y, split = blockIdx.z, n_splits = gridDim.z;
    const int group = n_heads / n_kv_heads, h0 = kv_head * group;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane / 4, c = lane % 4;
    const int split_len = split_length(start, 1);
    const int first = split * split_len, end = min(first + split_len - 1, start);
    const size_t width = (size_t)n_kv_heads * D;
    const __half* k_head = k_cache + (size_t)kv_head * D + 8 * c;
    const __half* v_head = v_cache + (size_t)kv_head * D + (D / 8) * g;

    uint32_t qhi[KS][2], qlo[KS][2];  // A's a[0] and a[2] of k-step ks (a[1], a[3]: rows 8-15, zero)
    const bool real_head = g < group;
    const float* q_row = q + (size_t)(h0 + min(g, group - 1)) * D;
    const float q_scale = scale * 1.44269504f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float2 x = real_head ? *reinterpret_cast<const float2*>(q_row + 32 * (ks / 2) + 8 * c + 4 * (ks % 2) + 2 * e)
                                       : make_float2(0.0f, 0.0f);
            split_half2(x.x * q_scale, x.y * q_scale, qhi[ks][e], qlo[ks][e]);
        }

    const int own_seg = seg[0];
    float o[KS][4] = {}, run_max = -INFINITY, run_sum = 0.0f;  // head g's max and this lane's share of its sum
    for (int j0 = first + ATTN_GROUP_CHUNK * warp; j0 <= end; j0 += ATTN_WARPS * ATTN_GROUP_CHUNK) {
        // Every load of the chunk first; slots past `end` re-read it. The lane's score slots u = 2nt + e are
        // j0 + 2c + e + 8nt, the V rows it reads.
        uint4 kx[2][D / 32];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int kk = 0; kk < D / 32; ++kk)
                kx[nt][kk] = *reinterpret_cast<const uint4*>(k_head + (size_t)min(j0 + 8 * nt + g, end) * width + 32 * kk);
        uint32_t vx[4][VW];
        int slot_s[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int j = min(j0 + 2 * c + u % 2 + 8 * (u / 2), end);
            slot_s[u] = slot_seg[j];
#pragma unroll
            for (int w = 0; w < VW; w += 4) {
                const uint4 piece = *reinterpret_cast<const uint4*>(v_head + (size_t)j * width + 2 * w);
                vx[u][w] = piece.x, vx[u][w + 1] = piece.y, vx[u][w + 2] = piece.z, vx[u][w + 3] = piece.w;
            }
        }

        float s[2][4] = {};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                const uint4& w = kx[nt][ks / 2];
                const uint32_t b[2] = {ks % 2 ? w.z : w.x, ks % 2 ? w.w : w.y};
                mma_16816(s[nt], {qhi[ks][0], 0u, qhi[ks][1], 0u}, b);
                mma_16816(s[nt], {qlo[ks][0], 0u, qlo[ks][1], 0u}, b);
            }

        // The online softmax of head g over the chunk: hidden slots (and heads past the group) at -inf; a head
        // that has seen only those keeps max -inf, its exponents taken against 0, so every weight is 0.
        float p[4], m = run_max;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const bool seen = real_head && j0 + 2 * c + u % 2 + 8 * (u / 2) <= end && (slot_s[u] == 0 || slot_s[u] == own_seg);
            p[u] = seen ? s[u / 2][u % 2] : -INFINITY;
            m = fmaxf(m, p[u]);
        }
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));  // head g's 4 lanes
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        const float base = m == -INFINITY ? 0.0f : m, rescale = fast_exp2(run_max - base);
        run_max = m;
        run_sum *= rescale;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            p[u] = fast_exp2(p[u] - base);
            run_sum += p[u];
        }
        // O^T's columns are heads 2c and 2c + 1, whose rows lanes 8c and 8c + 4 hold
        const float r0 = __shfl_sync(0xffffffffu, rescale, 8 * c), r1 = __shfl_sync(0xffffffffu, rescale, 8 * c + 4);
        uint32_t bhi[2], blo[2];
        split_half2(p[0], p[1], bhi[0], blo[0]);
        split_half2(p[2], p[3], bhi[1], blo[1]);
#pragma unroll
        for (int mt = 0; mt < KS; ++mt) {
            o[mt][0] *= r0, o[mt][1] *= r1, o[mt][2] *= r0, o[mt][3] *= r1;
            const uint32_t a[4] = {pair_halves(vx[0], vx[1], mt), pair_halves(vx[0], vx[1], KS + mt),
                                   pair_halves(vx[2], vx[3], mt), pair_halves(vx[2], vx[3], KS + mt)};
            mma_16816(o[mt], a, bhi);
            mma_16816(o[mt], a, blo);
        }
    }

    // The warps merged, each head's (max, sum) and weighted V as `attend` merges its warps; the partial's max in
    // natural units, as combine_group_head weighs it (expf).
    run_sum += __shfl_xor_sync(0xffffffffu, run_sum, 1);
    run_sum += __shfl_xor_sync(0xffffffffu, run_sum, 2);
    if (c == 0) merge.max[warp][g] = run_max, merge.sum[warp][g] = run_sum;
#pragma unroll
    for (int mt = 0; mt < KS; ++mt) {
        const int d0 = (D / 8) * g + mt, d1 = d0 + KS;
        merge.acc[warp][2 * c][d0] = o[mt][0], merge.acc[warp][2 * c + 1][d0] = o[mt][1];
        merge.acc[warp][2 * c][d1] = o[mt][2], merge.acc[warp][2 * c + 1][d1] = o[mt][3];
    }
    __syncthreads();
    const AttnPartials part(partials, 1, n_heads, n_splits);
    for (int item = threadIdx.x; item < group * D; item += blockDim.x) {
        const int h = item / D, d = item % D;
        float m = merge.max[0][h];
#pragma unroll
        for (int w = 1; w < ATTN_WARPS; ++w) m = fmaxf(m, merge.max[w][h]);
        float total = 0.0f, v = 0.0f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) {
            const float wt = merge.max[w][h] == -INFINITY ? 0.0f : fast_exp2(merge.max[w][h] - m);
            total += wt * merge.sum[w][h];
            v += wt * merge.acc[w][h][d];
        }
        const SplitPartial at = part.at((size_t)(h0 + h) * n_splits + split, D);
        at.acc[d] = v;
        if (d == 0) *at.pair = make_float2(m == -INFINITY ? -INFINITY : m * 0.69314718f, total);
    }
}

// out for head h of a decode step from the n_splits partials attention_group's splits left (AttnPartials), by one
// warp: a lane a split's pair (two for more than 32), then 4 dims a lane, COMBINE_STEP splits' loads in flight;
// with xq, out's int16 blocks too. Each split's sum and weighted V rescaled to the largest max; splits of weight
// 0 are skipped, their acc never read. Warps merge the group's heads side by side, with no block barrier.
__device__ __forceinline__ void combine_group_head(const AttnPartials& part, float* out, int h, int n_splits, int dv,
                                                   uint8_t* xq, float2* xds) {
    static_assert(ATTN_MAX_SPLITS == 2 * WARP, "a lane holds two splits' pairs: wt[0] and wt[1] below");
    const int lane = threadIdx.x % WARP;
    const float2* pairs = part.pairs + (size_t)h * n_splits;
    const float* acc = part.acc + (size_t)h * n_splits * dv;
    float2 pr[ATTN_MAX_SPLITS / WARP];
    float m = -INFINITY;
#pragma unroll
    for (int k = 0; k < ATTN_MAX_SPLITS / WARP; ++k) {
        const int s = lane + WARP * k;
        pr[k] = s < n_splits ? __ldcg(pairs + s) : make_float2(-INFINITY, 0.0f);
        m = fmaxf(m, pr[k].x);
    }
    m = warp_max(m);
    float total = 0.0f, wt[ATTN_MAX_SPLITS / WARP];
#pragma unroll
    for (int k = 0; k < ATTN_MAX_SPLITS / WARP; ++k) {
        wt[k] = weight_of(pr[k].x, m);
        total += wt[k] * pr[k].y;
    }
    const float inv_total = 1.0f / warp_sum(total);  // > 0: the split holding the query's own slot sees it
    const int c = 4 * lane;
    const bool in = c < dv;
    float o[4] = {};
    for (int s0 = 0; s0 < n_splits; s0 += COMBINE_STEP) {
        float w[COMBINE_STEP];
        float4 a[COMBINE_STEP];
#pragma unroll
        for (int u = 0; u < COMBINE_STEP; ++u) {
            const int s = s0 + u;  // its weight from the lane holding its pair
            w[u] = __shfl_sync(0xffffffffu, s < WARP ? wt[0] : wt[ATTN_MAX_SPLITS / WARP - 1], s % WARP);
            w[u] = s < n_splits ? w[u] : 0.0f;
            a[u] = in && w[u] != 0.0f ? __ldcg(reinterpret_cast<const float4*>(acc + (size_t)s * dv + c)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < COMBINE_STEP; ++u)
            o[0] += w[u] * a[u].x, o[1] += w[u] * a[u].y, o[2] += w[u] * a[u].z, o[3] += w[u] * a[u].w;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) o[k] *= inv_total;
    const size_t at = (size_t)h * dv + c;  // query 0
    if (in) *reinterpret_cast<float4*>(out + at) = make_float4(o[0], o[1], o[2], o[3]);
    if (xq) store_x16<4>(o, in, (int)(at / 4), xq, xds);
}

// `attention` for a decode step (one query token) at a long context, for head widths 64 and 128 and up to
// ATTN_GROUP_MAX query heads a KV head (ops.py takes it from 4: at 2 the one-head kernel's many more blocks were
// faster, docs/perf-notes.md run 26), on tensor cores (attend_group): a block takes one KV head's group of
// query heads over one split of the slots, so a K or V row is read once for the group, not once a query head
// as the other kernels read it. The last split of a group to finish (counted in counts[h0], h0 its first head,
// set back to 0 for the next launch) merges the group's partials into out, each head's splits in their order.
// LAUNCH: grid (1, n_kv_heads, n_splits), block ATTN_WARPS * 32 (128), n_splits <= ATTN_MAX_SPLITS;
// `attention`'s parameters, n_tok 1; partials and counts as there.
extern "C" __global__ void __launch_bounds__(ATTN_WARPS * WARP)
attention_group(const float* q, const __half* k_cache, const __half* v_cache, const int* slot_seg, const int* seg,
                float* out, const int* start_at, int n_tok, int n_heads, int n_kv_heads, int dk, int dv, float scale,
                float* partials, int* counts, uint8_t* xq, float2* xds) {
    follow_previous_kernel();
    __shared__ __align__(16) unsigned char merge[sizeof(GroupMerge<128>)];  // one buffer for both widths
    __shared__ bool last;
    const int start = *start_at;
    if (dk == 64 && dv == 64)
        attend_group<64>(q, k_cache, v_cache, slot_seg, seg, start, n_heads, n_kv_heads, scale, partials,
                         *reinterpret_cast<GroupMerge<64>*>(merge));
    else if (dk == 128 && dv == 128)
        attend_group<128>(q, k_cache, v_cache, slot_seg, seg, start, n_heads, n_kv_heads, scale, partials,
                          *reinterpret_cast<GroupMerge<128>*>(merge));
    const int group = n_heads / n_kv_heads, h0 = blockIdx.y * group;
    __threadfence();  // this split's partials, visible to every block before it is counted
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(counts + h0, 1) == (int)gridDim.z - 1;
        if (last) counts[h0] = 0;  // every split has counted: none reads it again in this launch
    }
    __syncthreads();
    if (last) {
        __threadfence();
        for (int h = threadIdx.x / WARP; h < group; h += ATTN_WARPS)
            combine_group_head(AttnPartials(partials, 1, n_heads, gridDim.z), out, h0 + h, gridDim.z, dv, xq, xds);
    }
}
