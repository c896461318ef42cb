// The KV cache write and the attention over it (see ops.Batch for which slots a token reads).
// Cache rows are f16, (capacity, n_kv_heads * head width) per layer; slot_seg (capacity,) is
// the segment of each written slot, shared by every layer.
#include "common.cuh"
#include "rope.cuh"
#include "x16.cuh"

#define ATTN_WARPS 4
#define ATTN_MAX_PER_LANE 8  // head widths up to 256, 32 lanes
#define ATTN_MAX_SPLITS 64  // ops.py's ATTENTION_MAX_SPLITS
#define ATTN_SPLIT_MIN_SLOTS 32  // one STEP of 8 slots a warp: shorter splits only add partials

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

// Where the warps of a block merge their partial softmaxes.
struct AttnMerge {
    float max[ATTN_WARPS], sum[ATTN_WARPS];
    float acc[ATTN_WARPS][ATTN_MAX_PER_LANE * WARP];
};

// Where split s of (query i, head h) leaves its partial softmax for combine_splits: its
// (max, sum) pair at pairs[row], its unnormalized weighted V at acc[row * dv], row = (i * n_heads
// + h) * n_splits + s. acc follows all the pairs.
struct AttnPartials {
    float2* pairs;
    float* acc;
    __device__ AttnPartials(float* base, int n_tok, int n_heads, int n_splits)
        : pairs(reinterpret_cast<float2*>(base)), acc(base + 2 * (size_t)n_tok * n_heads * n_splits) {}
};

// The slots of each of n_splits splits: those of the batch's last query (slot start + n_tok - 1) cut evenly,
// ATTN_SPLIT_MIN_SLOTS at least.
__device__ __forceinline__ int split_length(int start, int n_tok, int n_splits) {
    return max(ATTN_SPLIT_MIN_SLOTS, (start + n_tok + n_splits - 1) / n_splits);
}

// The step attend<STEP> takes for these head widths: see attention_block.
__device__ __forceinline__ int attend_step(int dk, int dv) {
    return dk == dv && (dk == 64 || dk == 128) ? 8 : 2;
}

// One (query token, query head, split) for a block: see `attention`. q_head is the query's head (dk
// floats), in global or shared memory. nk, nv (head widths / 32) are literals at the common call sites,
// so the per-lane loops below shrink to them there. STEP slots at a time, so that their loads are in
// flight together. FRESH (attention_rope): slot start of the one query token is this launch's to write,
// so its k and v come from k_new and v_new (shared memory, f16 as the cache would hold them) and its
// segment is the query's.
template <int STEP, bool FRESH>
__device__ __forceinline__ void attend(const float* q_head, const __half* k_new, const __half* v_new, const __half* k_cache,
                                       const __half* v_cache, const int* slot_seg, const int* seg,
                                       float* out, float* partials, int start, int n_tok, int n_heads,
                                       int n_kv_heads, int nk, int nv, float scale, AttnMerge& merge,
                                       uint8_t* xq, float2* xds) {
    const int i = blockIdx.x, h = blockIdx.y, split = blockIdx.z, n_splits = gridDim.z;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int split_len = split_length(start, n_tok, n_splits);
    const int last = start + i, first = split * split_len, end = min(first + split_len - 1, last);
    const size_t row = ((size_t)i * n_heads + h) * n_splits + split;
    const AttnPartials part(partials, n_tok, n_heads, n_splits);
    if (first > end) {  // a split past the query's slot: weight 0 in the combine, which skips its acc
        if (threadIdx.x == 0) part.pairs[row] = make_float2(-INFINITY, 0.0f);
        return;
    }
    const int dk = nk * WARP, dv = nv * WARP, kv_head = h / (n_heads / n_kv_heads);
    const size_t k_width = (size_t)n_kv_heads * dk, v_width = (size_t)n_kv_heads * dv;

    // Lane l holds dims l, l+32, ... of q and of the output. Loops run over all
    // ATTN_MAX_PER_LANE entries without branches: past nk, q is 0 (and K, re-read from a real
    // dim, finite); past nv, acc is never stored.
    float qv[ATTN_MAX_PER_LANE], acc[ATTN_MAX_PER_LANE];
#pragma unroll
    for (int e = 0; e < ATTN_MAX_PER_LANE; ++e) {
        qv[e] = e < nk ? q_head[lane + e * WARP] : 0.0f;
        acc[e] = 0.0f;
    }

    const int own_seg = seg[i];
    const __half* k_head = k_cache + (size_t)kv_head * dk + lane;
    const __half* v_head = v_cache + (size_t)kv_head * dv + lane;
    float run_max = -INFINITY, run_sum = 0.0f;
    for (int j0 = first + warp * STEP; j0 <= end; j0 += ATTN_WARPS * STEP) {
        // Every load of the step first and unconditionally, so they are in flight together:
        // slots past `end` re-read it, unused dims re-read the last one. Then the scores,
        // with hidden slots at -inf.
        __half kx[STEP][ATTN_MAX_PER_LANE], vx[STEP][ATTN_MAX_PER_LANE];
        int slot_s[STEP];
#pragma unroll
        for (int u = 0; u < STEP; ++u) {
            const int j = min(j0 + u, end);
            const bool fresh = FRESH && j == last;  // the same across the warp
            slot_s[u] = fresh ? own_seg : slot_seg[j];
#pragma unroll
            for (int e = 0; e < ATTN_MAX_PER_LANE; ++e) {
                kx[u][e] = fresh ? k_new[lane + min(e, nk - 1) * WARP] : k_head[j * k_width + min(e, nk - 1) * WARP];
                vx[u][e] = fresh ? v_new[lane + min(e, nv - 1) * WARP] : v_head[j * v_width + min(e, nv - 1) * WARP];
            }
        }
        float score[STEP], step_max = run_max;
#pragma unroll
        for (int u = 0; u < STEP; ++u) {
            float dot = 0.0f;
#pragma unroll
            for (int e = 0; e < ATTN_MAX_PER_LANE; ++e) dot += qv[e] * __half2float(kx[u][e]);
            dot = warp_sum(dot) * scale;
            const bool seen = j0 + u <= end && (slot_s[u] == 0 || slot_s[u] == own_seg);
            score[u] = seen ? dot : -INFINITY;
            step_max = fmaxf(step_max, score[u]);
        }
        const float rescale = weight_of(run_max, step_max);
        run_sum *= rescale;
#pragma unroll
        for (int e = 0; e < ATTN_MAX_PER_LANE; ++e) acc[e] *= rescale;
#pragma unroll
        for (int u = 0; u < STEP; ++u) {
            const float p = weight_of(score[u], step_max);
            run_sum += p;
#pragma unroll
            for (int e = 0; e < ATTN_MAX_PER_LANE; ++e) acc[e] += p * __half2float(vx[u][e]);
        }
        run_max = step_max;
    }

    if (lane == 0) merge.max[warp] = run_max, merge.sum[warp] = run_sum;
#pragma unroll
    for (int e = 0; e < ATTN_MAX_PER_LANE; ++e)
        if (e < nv) merge.acc[warp][e * WARP + lane] = acc[e];
    __syncthreads();

    // A warp that saw no slot has max -inf and weighs 0. With one split, some warp saw the
    // query's own slot; with more, a split whose slots are all hidden has max -inf and sum 0.
    float m = merge.max[0];
#pragma unroll
    for (int w = 1; w < ATTN_WARPS; ++w) m = fmaxf(m, merge.max[w]);
    float wt[ATTN_WARPS], total = 0.0f;
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; ++w) {
        wt[w] = weight_of(merge.max[w], m);
        total += wt[w] * merge.sum[w];
    }
    const float norm = n_splits == 1 ? 1.0f / total : 1.0f;
    float* out_row = n_splits == 1 ? out + ((size_t)i * n_heads + h) * dv : part.acc + row * dv;
    for (int c = threadIdx.x; c < dv; c += blockDim.x) {
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) o += wt[w] * merge.acc[w][c];
        out_row[c] = o *= norm;
        if (n_splits == 1 && xq) store_x16<1>({o}, true, (int)(((size_t)i * n_heads + h) * dv + c), xq, xds);  // a warp: 32 consecutive c
    }
    if (n_splits > 1 && threadIdx.x == 0) part.pairs[row] = make_float2(m, total);
}

// out for (query i, head h) from the n_splits partials the splits left: each split's sum and
// weighted V rescaled to the largest max. Splits of weight 0 (past the query's slot, all hidden,
// or negligible) are skipped: their acc (stale, even NaN) is never used. The first COMBINE_STEP
// splits' acc of a thread's first column are asked for with the pairs, the rest once the weights
// are known (one trip to memory before the sums, not two, in a decode step). The partials were
// written by other blocks of this launch: read past L1 (__ldcg). With xq, out's int16 blocks too
// (x16.cuh; dv a multiple of 32). Every thread of the block (128) calls it.
#define COMBINE_STEP 16  // splits whose acc loads a thread has in flight together
__device__ __forceinline__ void combine_splits(const float* partials, float* out, int i, int h, int n_tok, int n_heads,
                                               int n_splits, int dv, uint8_t* xq, float2* xds) {
    __shared__ float2 pair[ATTN_MAX_SPLITS];
    __shared__ float wt[ATTN_MAX_SPLITS + COMBINE_STEP];  // 0 past n_splits
    const AttnPartials part(const_cast<float*>(partials), n_tok, n_heads, n_splits);
    const size_t row0 = ((size_t)i * n_heads + h) * n_splits;
    float ahead[COMBINE_STEP];
#pragma unroll
    for (int u = 0; u < COMBINE_STEP; ++u)
        ahead[u] = threadIdx.x < dv && u < n_splits ? __ldcg(part.acc + (row0 + u) * dv + threadIdx.x) : 0.0f;
    if (threadIdx.x < n_splits) pair[threadIdx.x] = __ldcg(part.pairs + row0 + threadIdx.x);
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
            for (int u = 0; u < COMBINE_STEP; ++u)
                a[u] = wt[s0 + u] == 0.0f                  ? 0.0f
                       : s0 == 0 && c == (int)threadIdx.x ? ahead[u]
                                                           : __ldcg(part.acc + (row0 + s0 + u) * dv + c);
#pragma unroll
            for (int u = 0; u < COMBINE_STEP; ++u) o += wt[s0 + u] * a[u];
        }
        out_row[c] = o *= inv_total;
        if (xq) store_x16<1>({o}, true, (int)(((size_t)i * n_heads + h) * dv + c), xq, xds);  // a warp: 32 consecutive c
    }
}

// A block's share of `attention` (attention_rope's after its rope): the split's online softmax, then,
// with more splits than one, the count whose last finisher merges them.
template <bool FRESH>
__device__ __forceinline__ void attention_block(const float* q_head, const __half* k_new, const __half* v_new,
                                                const __half* k_cache, const __half* v_cache, const int* slot_seg,
                                                const int* seg, float* out, int start, int n_tok, int n_heads,
                                                int n_kv_heads, int dk, int dv, float scale, float* partials,
                                                int* counts, uint8_t* xq, float2* xds) {
    __shared__ AttnMerge merge;
    __shared__ bool last;
    // The other widths keep all ATTN_MAX_PER_LANE dims a lane, so a shorter step keeps their
    // registers (which size the whole kernel's) in check.
    if (dk == 64 && dv == 64)
        attend<8, FRESH>(q_head, k_new, v_new, k_cache, v_cache, slot_seg, seg, out, partials, start, n_tok, n_heads,
                         n_kv_heads, 2, 2, scale, merge, xq, xds);
    else if (dk == 128 && dv == 128)
        attend<8, FRESH>(q_head, k_new, v_new, k_cache, v_cache, slot_seg, seg, out, partials, start, n_tok, n_heads,
                         n_kv_heads, 4, 4, scale, merge, xq, xds);
    else
        attend<2, FRESH>(q_head, k_new, v_new, k_cache, v_cache, slot_seg, seg, out, partials, start, n_tok, n_heads,
                         n_kv_heads, dk / WARP, dv / WARP, scale, merge, xq, xds);
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
        combine_splits(partials, out, blockIdx.x, blockIdx.y, n_tok, n_heads, gridDim.z, dv, xq, xds);
    }
}

// softmax(scale * q.k) . v for query token i (cache slot start + i) and query head h, over
// the slots j <= start + i of segment 0 or seg[i]; query head h reads KV head
// h / (n_heads / n_kv_heads). The slots are cut into gridDim.z splits (flash-decoding), so that a
// decode step at a long context has blocks for every SM; their length comes from *start_at on
// the device, so the grid (the host's choice, from the cache's capacity) fits every position a
// captured step replays at. Each warp of a split runs an online softmax over its share of the
// split's slots (runs of STEP consecutive ones, every ATTN_WARPS-th run), then the warps' results
// are merged. One split writes out; more write partials (AttnPartials, in `partials`), a split
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
    attention_block<false>(q + ((size_t)blockIdx.x * n_heads + blockIdx.y) * dk, nullptr, nullptr, k_cache, v_cache,
                           slot_seg, seg, out, *start_at, n_tok, n_heads, n_kv_heads, dk, dv, scale, partials, counts,
                           xq, xds);
}

// `attention` of one query token whose q and k come as the matmuls made them: each block ropes (and with
// q_norm, k_norm first RMS-normalizes, rope.cuh) its query head and the new slot's key head itself, so
// that no rope_f32 launch runs before it. Slot *start_at's k and v, which the launch writes to the cache,
// come from shared memory inside it; the first block of each kv head's first split writes them (k rounded
// to f16, v too, and slot_seg from the first kv head), the first split's blocks their roped q heads to
// q_out, and those k writers the roped k heads to k_out: every output of rope_f32 with the cache's write.
// The same bits as that rope, then `attention`; angles and angles_ready as rope_f32's (its first block
// writes the table's row). LAUNCH: as attention's with n_tok 1 (grid (1, n_heads,
// n_splits)); pos the token's position; q, k, v its rows (n_heads * dk, n_kv_heads * dk, n_kv_heads * dv).
// 3 blocks an SM: at 5 (96 registers) the fresh slot's loads spilled, at 4 (128) with the prefetches too.
extern "C" __global__ void __launch_bounds__(ATTN_WARPS * WARP, 3)
attention_rope(const float* q, const float* k, const float* v, float* q_out, float* k_out, const float* q_norm,
               const float* k_norm, const int* pos, const float* freq_factors, int n_rot, int neox, double base,
               double freq_scale, float eps, float2* angles, int angles_ready, __half* k_cache, __half* v_cache,
               int* slot_seg, const int* seg, float* out, const int* start_at, int n_heads, int n_kv_heads, int dk, int dv, float scale,
               float* partials, int* counts, uint8_t* xq, float2* xds) {
    follow_previous_kernel();
    constexpr int WIDTH = ATTN_MAX_PER_LANE * WARP, PER_THREAD = WIDTH / (ATTN_WARPS * WARP);
    __shared__ float2 cs[ROPE_MAX_PAIRS];
    __shared__ float norm_scale[2];
    __shared__ float q_head[WIDTH], staged[4][WIDTH];  // q's and k's heads as they come, then their norms' weights
    __shared__ __half k_new[WIDTH], v_new[WIDTH];
    const int h = blockIdx.y, kv_head = h / (n_heads / n_kv_heads), start = *start_at;
    const size_t k_width = (size_t)n_kv_heads * dk, v_width = (size_t)n_kv_heads * dv, slot = start;
    const bool first_split = blockIdx.z == 0, writer = first_split && h % (n_heads / n_kv_heads) == 0;
    // Every input in flight at once, the angles too: one trip to memory, not one a step of the rope
    const float* ins[4] = {q + (size_t)h * dk, k + (size_t)kv_head * dk, q_norm, k_norm};
    const float* v_head = v + (size_t)kv_head * dv;
    float in[4][PER_THREAD], v_in[PER_THREAD];
#pragma unroll
    for (int e = 0; e < PER_THREAD; ++e) {
        const int c = threadIdx.x + e * ATTN_WARPS * WARP;
#pragma unroll
        for (int a = 0; a < 4; ++a) in[a][e] = c < dk && ins[a] ? ins[a][c] : 0.0f;
        v_in[e] = c < dv ? v_head[c] : 0.0f;
    }
    {  // the cache rows attend reads first (each warp's first step of slots) on their way to L1 while the rope runs
        const int step = attend_step(dk, dv), lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
        const int first = blockIdx.z * split_length(start, 1, gridDim.z) + warp * step;
        const int k_lines = dk * 2 / 128, lines = k_lines + dv * 2 / 128;  // 128-byte lines of a slot's f16 rows
        for (int c = lane; c < step * lines; c += WARP) {
            const int j = first + c / lines, line = c % lines;
            if (j >= start) break;  // past the cache's slots: the new one is in shared memory
            const __half* row = line < k_lines ? k_cache + j * k_width + (size_t)kv_head * dk + line * 64
                                               : v_cache + j * v_width + (size_t)kv_head * dv + (line - k_lines) * 64;
            asm volatile("prefetch.global.L1 [%0];" ::"l"(__cvta_generic_to_global(row)));
        }
    }
    const RopeParams r{freq_factors, dk, n_rot, neox != 0, base, freq_scale, eps};
    const bool first_block = h == 0 && first_split;
    rope_angles(r, *pos, angles, angles_ready, first_block, cs);
#pragma unroll
    for (int e = 0; e < PER_THREAD; ++e) {
        const int c = threadIdx.x + e * ATTN_WARPS * WARP;
#pragma unroll
        for (int a = 0; a < 4; ++a) staged[a][c] = in[a][e];
        if (c < dv) {
            v_new[c] = __float2half_rn(v_in[e]);
            if (writer) v_cache[slot * v_width + (size_t)kv_head * dv + c] = v_new[c];
        }
    }
    if (writer && kv_head == 0 && threadIdx.x == 0) slot_seg[slot] = seg[0];
    __syncthreads();
    const int warp = threadIdx.x / WARP;  // q's norm on warp 0, k's on warp 1, side by side
    if (warp < 2 && (warp == 0 ? q_norm : k_norm)) {
        const float s = head_norm_scale(staged[warp], r);
        if (threadIdx.x % WARP == 0) norm_scale[warp] = s;
    }
    __syncthreads();
    rope_rotate(staged[0], q_norm ? staged[2] : nullptr, norm_scale[0], r, cs, [&](int i, float value) {
        q_head[i] = value;
        if (first_split) q_out[(size_t)h * dk + i] = value;
    });
    rope_rotate(staged[1], k_norm ? staged[3] : nullptr, norm_scale[1], r, cs, [&](int i, float value) {
        k_new[i] = __float2half_rn(value);
        if (writer) k_out[(size_t)kv_head * dk + i] = value, k_cache[slot * k_width + (size_t)kv_head * dk + i] = k_new[i];
    });
    __syncthreads();
    attention_block<true>(q_head, k_new, v_new, k_cache, v_cache, slot_seg, seg, out, start, 1, n_heads, n_kv_heads,
                          dk, dv, scale, partials, counts, xq, xds);
}
