// Multi-head latent attention (deepseek2): the head-wise split around it, its YaRN RoPE, and the
// absorbed attention over the latent cache. The cache is f16 (capacity, k_width) per layer, one row
// a token (kv_lora_rank latent values, then the RoPE part), written by attention.cu's kv_store, the
// latent as its k and the RoPE part as its v; slot_seg as there. Value rows are the first v_width
// features of each cached row, so a row is read once for its score and its value.
#include <float.h>
#include "common.cuh"
#include "flash.cuh"

#define MLA_WARPS 8  // a decode step has only n_heads blocks: more warps split the slots further
#define MLA_MAX_PER_LANE 18  // latent rows up to 576 = 18 * 32 features (DeepSeek's 512 + 64)
#define MLA_STEP 2           // slots a warp has in flight at once

// A query row r = token · n_heads + head of k_width features in its two parts, as the model makes them (no
// concatenation between): the first v_width from lat (rows of v_width), the rest from rope (rows of k_width - v_width).
struct LatentQuery {
    const float *lat, *rope;
    int k_width, v_width;
    __device__ const float* at(size_t r, int d) const {
        return d < v_width ? lat + r * v_width + d : rope + r * (k_width - v_width) + (d - v_width);
    }
};

// Two copies of columns a row r of (n_rows, *) rows, each dst[r * dst_width + dst_offset + c] =
// src[r * src_width + src_offset + c] for c < width (a second of width 0: none). Ops.split (its parts made when
// something asks for one's address) and Ops.concat with r = token * n_heads + head, their parts two a launch.
// LAUNCH: block = 128, grid.x = n_rows.
__device__ __forceinline__ void copy_head(const float* src, float* dst, int src_width, int src_offset, int dst_width,
                                          int dst_offset, int width) {
    const float* s = src + (size_t)blockIdx.x * src_width + src_offset;
    float* d = dst + (size_t)blockIdx.x * dst_width + dst_offset;
    for (int c = threadIdx.x; c < width; c += blockDim.x) d[c] = s[c];
}
extern "C" __global__ void copy_heads_f32(const float* src0, float* dst0, int src_width0, int src_offset0, int dst_width0,
                                          int dst_offset0, int width0, const float* src1, float* dst1, int src_width1,
                                          int src_offset1, int dst_width1, int dst_offset1, int width1) {
    follow_previous_kernel();
    copy_head(src0, dst0, src_width0, src_offset0, dst_width0, dst_offset0, width0);
    copy_head(src1, dst1, src_width1, src_offset1, dst_width1, dst_offset1, width1);
}

// elementwise.cu's rope_f32 with YaRN, as the numpy backend computes it in double: pair i's angle
// blends the interpolated pos·freq_scale·θ_i and the original pos·θ_i by mix = ramp_i·ext_factor,
// ramp_i = 1 - clamp((i - low) / max(0.001, high - low), 0, 1) (ggml's rope_yarn_ramp, low and high its
// corr dims); cos and sin are multiplied by magnitude. Two tensors of the same tokens a launch (MLA's q and k
// rope parts): heads0 of x0's, then x1's (its heads the rest of grid y; x1 0 for none). x0's heads lie stride0
// floats apart (as rope_f32's), x1's stride1; y's are dense.
// LAUNCH: block = (n_rot / 2 rounded up to 32, capped at 256), grid = (n_tok, heads0 + x1's heads).
extern "C" __global__ void rope_yarn_f32(const float* x0, float* y0, int heads0, const float* x1, float* y1, const int* pos,
                                         const float* freq_factors, int head_dim, int n_rot, int neox, double base,
                                         double freq_scale, double ext_factor, double low, double high, double magnitude,
                                         int stride0, int stride1) {
    follow_previous_kernel();
    const bool second = blockIdx.y >= heads0;
    const int heads = second ? gridDim.y - heads0 : heads0;
    const int64_t n = (int64_t)blockIdx.x * heads + blockIdx.y - (second ? heads0 : 0);  // the block's head of its tensor
    const float* x = (second ? x1 : x0) + n * (second ? stride1 : stride0);
    float* y = (second ? y1 : y0) + n * head_dim;
    const int half = n_rot / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        double inv_freq = pow(base, -2.0 * i / n_rot);
        if (freq_factors) inv_freq /= (double)freq_factors[i];
        const double interp = (double)pos[blockIdx.x] * freq_scale * inv_freq, extrap = interp / freq_scale;
        const double ramp = 1.0 - fmin(fmax((i - low) / fmax(0.001, high - low), 0.0), 1.0);
        const double mix = __dmul_rn(ramp, ext_factor);
        double s, c;  // products and sums rounded apart, as numpy does (no FMA)
        sincos(__dadd_rn(__dmul_rn(interp, 1.0 - mix), __dmul_rn(extrap, mix)), &s, &c);
        const float cs = (float)(c * magnitude), sn = (float)(s * magnitude);
        const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
        const float a = x[ia], b = x[ib];
        y[ia] = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
        y[ib] = __fadd_rn(__fmul_rn(a, sn), __fmul_rn(b, cs));
    }
    for (int i = n_rot + threadIdx.x; i < head_dim; i += blockDim.x) y[i] = x[i];
}

// softmax(scale · q·row) · row[:v_width] for query token i (cache slot start + i) and query head h over
// the cached rows j <= start + i of segment 0 or seg[i] (see ops.Batch): multi-query attention with
// one latent row per slot. q: (q_lat, q_rope), out (n_tok, n_heads * v_width). Block z of
// gridDim.z takes the z-th of that many equal runs of the query's slots (lengths from *start_at, so a
// captured graph replays at any position); its warps run online softmaxes over every MLA_WARPS-th run
// of MLA_STEP slots and merge. With one split the block writes out; with more it writes its
// (max, sum, unnormalised values) to partials, ((i * n_heads + h) * splits + z) * (v_width + 2) floats
// on, for latent_attention_combine. Lane l holds features l, l+32, ... of q and of the values. The
// running maximum starts at -FLT_MAX, not -inf, so that exp(score - max) is 0, never NaN, for hidden
// slots (-inf) and for a split that sees none.
// LAUNCH: block = MLA_WARPS * 32, grid = (n_tok, n_heads, splits); v_width <= k_width <= 32 * MLA_MAX_PER_LANE.
extern "C" __global__ void __launch_bounds__(MLA_WARPS * WARP)
latent_attention(const float* q_lat, const float* q_rope, const __half* cache, const int* slot_seg, const int* seg,
                 float* out, const int* start_at, int n_heads, int k_width, int v_width, float scale, float* partials) {
    follow_previous_kernel();
    __shared__ float merge_max[MLA_WARPS], merge_sum[MLA_WARPS];
    __shared__ float merge_acc[MLA_WARPS][MLA_MAX_PER_LANE * WARP];
    const int i = blockIdx.x, h = blockIdx.y, lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int n_slots = *start_at + i + 1, own_seg = seg[i];
    const int per_split = (n_slots + gridDim.z - 1) / gridDim.z;
    const int begin = blockIdx.z * per_split, end = min(n_slots, begin + per_split);
    const LatentQuery q{q_lat, q_rope, k_width, v_width};
    float qv[MLA_MAX_PER_LANE], acc[MLA_MAX_PER_LANE];
#pragma unroll
    for (int e = 0; e < MLA_MAX_PER_LANE; ++e) {
        const int d = e * WARP + lane;
        qv[e] = d < k_width ? *q.at((size_t)i * n_heads + h, d) : 0.0f;
        acc[e] = 0.0f;
    }
    float run_max = -FLT_MAX, run_sum = 0.0f;
    for (int j0 = begin + warp * MLA_STEP; j0 < end; j0 += MLA_WARPS * MLA_STEP) {
        // the step's loads first, so they are in flight together; slots past the run re-read its last
        float row[MLA_STEP][MLA_MAX_PER_LANE];
        int slot_s[MLA_STEP];
#pragma unroll
        for (int u = 0; u < MLA_STEP; ++u) {
            const int j = min(j0 + u, end - 1);
            const __half* r = cache + (size_t)j * k_width;
            slot_s[u] = slot_seg[j];
#pragma unroll
            for (int e = 0; e < MLA_MAX_PER_LANE; ++e) {
                const int d = e * WARP + lane;
                row[u][e] = d < k_width ? __half2float(r[d]) : 0.0f;
            }
        }
        float score[MLA_STEP], step_max = run_max;
#pragma unroll
        for (int u = 0; u < MLA_STEP; ++u) {
            float dot = 0.0f;
#pragma unroll
            for (int e = 0; e < MLA_MAX_PER_LANE; ++e) dot += qv[e] * row[u][e];
            dot = warp_sum(dot) * scale;
            const bool seen = j0 + u < end && (slot_s[u] == 0 || slot_s[u] == own_seg);
            score[u] = seen ? dot : -INFINITY;
            step_max = fmaxf(step_max, score[u]);
        }
        const float rescale = expf(run_max - step_max);
        run_sum *= rescale;
#pragma unroll
        for (int e = 0; e < MLA_MAX_PER_LANE; ++e) acc[e] *= rescale;
#pragma unroll
        for (int u = 0; u < MLA_STEP; ++u) {
            const float p = expf(score[u] - step_max);
            run_sum += p;
#pragma unroll
            for (int e = 0; e < MLA_MAX_PER_LANE; ++e) acc[e] += p * row[u][e];
        }
        run_max = step_max;
    }

    if (lane == 0) merge_max[warp] = run_max, merge_sum[warp] = run_sum;
#pragma unroll
    for (int e = 0; e < MLA_MAX_PER_LANE; ++e)
        if (e * WARP + lane < v_width) merge_acc[warp][e * WARP + lane] = acc[e];
    __syncthreads();
    // a warp that saw no slot weighs exp(-FLT_MAX - m) = 0
    float m = merge_max[0];
#pragma unroll
    for (int w = 1; w < MLA_WARPS; ++w) m = fmaxf(m, merge_max[w]);
    float wt[MLA_WARPS], total = 0.0f;
#pragma unroll
    for (int w = 0; w < MLA_WARPS; ++w) {
        wt[w] = expf(merge_max[w] - m);
        total += wt[w] * merge_sum[w];
    }
    const size_t pair = (size_t)i * n_heads + h;
    float* dst = gridDim.z == 1 ? out + pair * v_width : partials + (pair * gridDim.z + blockIdx.z) * (v_width + 2) + 2;
    const float norm = gridDim.z == 1 ? 1.0f / total : 1.0f;  // one split saw the query's own slot: total > 0
    for (int c = threadIdx.x; c < v_width; c += blockDim.x) {
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < MLA_WARPS; ++w) o += wt[w] * merge_acc[w][c];
        dst[c] = o * norm;
    }
    if (gridDim.z > 1 && threadIdx.x == 0) dst[-2] = m, dst[-1] = total;
}

// The splits of latent_attention merged: out (n_tok, n_heads * v_width) = sum_z exp(max_z - M) acc_z /
// sum_z exp(max_z - M) sum_z, M the largest max_z (some split saw the query's own slot).
// LAUNCH: block = 256, grid = (n_tok, n_heads); splits <= 256.
extern "C" __global__ void __launch_bounds__(256)
latent_attention_combine(const float* partials, float* out, int splits, int v_width) {
    follow_previous_kernel();
    __shared__ float wt[256];
    __shared__ float inv_total;
    const size_t pair = (size_t)blockIdx.x * gridDim.y + blockIdx.y;
    const float* part = partials + pair * splits * (v_width + 2);
    if (threadIdx.x == 0) {
        float m = -FLT_MAX, total = 0.0f;
        for (int z = 0; z < splits; ++z) m = fmaxf(m, part[z * (v_width + 2)]);
        for (int z = 0; z < splits; ++z) {
            wt[z] = expf(part[z * (v_width + 2)] - m);
            total += wt[z] * part[z * (v_width + 2) + 1];
        }
        inv_total = 1.0f / total;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < v_width; c += blockDim.x) {
        float o = 0.0f;
        for (int z = 0; z < splits; ++z)
            if (wt[z] != 0.0f) o += wt[z] * part[z * (v_width + 2) + 2 + c];  // 0: a split that saw none, its values unwritten
        out[pair * v_width + c] = o * inv_total;
    }
}

// The latent attention on tensor cores, a flash attention 2 over MLA's one latent row a slot (flash.cuh's tile steps,
// attention_prefill.cu's too): every head reads the same rows, so a block's 16 · ROW_WARPS query rows are (token, head)
// pairs, row r = token · n_heads + head of q (LatentQuery) and out (n_tok · n_heads, v_width), and each staged tile of
// slots serves all of them. The block's Q (scaled by scale · log2(e), f16) stays in shared memory for the whole sweep,
// beside two stages of MLA_MMA_SLOTS cache rows (cp.async). Of the values (a row's first v_width features, the rows
// already staged) a block takes dims dv0.. dv0 + MLA_MMA_DV - 1 (grid y); its warps are ROW_WARPS groups of 16 rows
// times DV_WARPS parts of those dims, warp w rows 16 (w / DV_WARPS).. and dims MLA_MMA_DV / DV_WARPS · (w % DV_WARPS)..
// of them: its O accumulators in registers, S = Q K^T recomputed by each warp of the same rows. Masks as
// latent_attention's (slot <= start + token, segment 0 or the token's). Grid z splits the slots the block's rows see
// into that many runs of whole tiles, as equal as tiles allow (lengths from *start_at, so a captured graph replays at
// any position: the grid is the cache's, a short context leaves its last splits none); with more than one, each writes
// (max in natural units, sum, unnormalised values) to partials as latent_attention does, for latent_attention_combine
// (a split without slots only its max, -inf).
#define MLA_MMA_SLOTS 32
#define MLA_MMA_DV 256
#define MLA_PREFILL_WARPS 8
template <int ROW_WARPS, int DV_WARPS>
__device__ __forceinline__ void latent_attend_mma(const LatentQuery& q, const __half* cache, const int* slot_seg, const int* seg,
                                                  float* out, float* partials, int start, int n_tok, int n_heads,
                                                  int k_width, int v_width, float scale) {
    constexpr int ROWS = 16 * ROW_WARPS, KT = MLA_MMA_SLOTS, DV = MLA_MMA_DV / DV_WARPS, THREADS = ROW_WARPS * DV_WARPS * WARP;
    const int ld = k_width + 8;  // halves a staged row: an odd number of 16-byte pieces, so ldmatrix's 8 rows miss each other's banks
    extern __shared__ uint4 mla_smem[];
    __half* qs = reinterpret_cast<__half*>(mla_smem);  // [ROWS][ld]
    __half* ks = qs + ROWS * ld;                         // [2][KT][ld]
    int* segs = reinterpret_cast<int*>(ks + 2 * KT * ld);  // [2][KT]

    const int n_rows = n_tok * n_heads;
    // the last rows first: theirs are the longest sweeps, so the grid's tail is short ones
    const int r0 = (gridDim.x - 1 - blockIdx.x) * ROWS, n_r = min(ROWS, n_rows - r0);
    // this split's slots, whole tiles of them: a short context leaves the grid's last splits none
    const int n_slots = start + (r0 + n_r - 1) / n_heads + 1;
    const int per_split = KT * ((n_slots + KT * gridDim.z - 1) / (KT * gridDim.z));
    const int begin = blockIdx.z * per_split, last_slot = min(n_slots, begin + per_split) - 1;
    if (begin >= n_slots) {  // no slots: weight 0 in latent_attention_combine, which reads no values of it
        for (int row = threadIdx.x; row < n_r && blockIdx.y == 0; row += THREADS) {
            float* split = partials + ((size_t)(r0 + row) * gridDim.z + blockIdx.z) * (v_width + 2);
            split[0] = -INFINITY, split[1] = 0.0f;
        }
        return;
    }
    const int lane = threadIdx.x % WARP, g = lane / 4, c = lane % 4;
    const int warp = threadIdx.x / WARP / DV_WARPS, part = threadIdx.x / WARP % DV_WARPS;  // its rows' 16s, its dims
    const int dv0 = blockIdx.y * MLA_MMA_DV + part * DV;
    const int chunks = k_width / 8;  // 16-byte pieces a row

    // slots past last_slot are zeros, never read (masked below)
    auto load = [&](int stage, int j0) {
        for (int i = threadIdx.x; i < KT * chunks; i += THREADS) {
            const int r = i / chunks, col = 8 * (i % chunks);
            cp_async16(ks + (stage * KT + r) * ld + col, cache + (size_t)min(j0 + r, last_slot) * k_width + col, j0 + r <= last_slot);
        }
        if (threadIdx.x < KT)
            cp_async4(segs + stage * KT + threadIdx.x, slot_seg + min(j0 + (int)threadIdx.x, last_slot), j0 + (int)threadIdx.x <= last_slot);
        cp_async_commit();
    };
    const int n_tiles = (last_slot - begin) / KT + 1;
    load(0, begin);  // in flight while Q is converted

    // Q once, f16 and scaled (rows past n_r: zeros), QB pieces a thread loaded before any is stored: their loads'
    // latencies overlap (a one-warp block's 36 pieces a lane, one at a time, took longer than its tiles)
    constexpr int QB = 8;
    const float q_scale = scale * 1.44269504f;
    for (int i0 = threadIdx.x; i0 < ROWS * chunks; i0 += QB * THREADS) {
        float4 a[QB], b[QB];
#pragma unroll
        for (int p = 0; p < QB; ++p) {
            const int i = i0 + p * THREADS, row = i / chunks, col = 8 * (i % chunks);
            a[p] = b[p] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (i < ROWS * chunks && row < n_r) {
                const float4* src = reinterpret_cast<const float4*>(q.at(r0 + row, col));  // 8 of one part
                a[p] = src[0], b[p] = src[1];
            }
        }
#pragma unroll
        for (int p = 0; p < QB; ++p) {
            const int i = i0 + p * THREADS, row = i / chunks, col = 8 * (i % chunks);
            const float w[8] = {a[p].x, a[p].y, a[p].z, a[p].w, b[p].x, b[p].y, b[p].z, b[p].w};
            float v[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = w[e] * q_scale;
            if (i < ROWS * chunks) *reinterpret_cast<uint4*>(qs + row * ld + col) = pack_half8(v);
        }
    }
    // This lane's rows (block-relative) g and g + 8 of the warp's 16, each visible to slots up to limit[u]
    int r[2], limit[2], own_seg[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        r[u] = 16 * warp + g + 8 * u;
        const int tok = (r0 + min(r[u], n_r - 1)) / n_heads;
        limit[u] = min(start + tok, last_slot);
        own_seg[u] = r[u] < n_r ? seg[tok] : 0;
    }
    const int warp_last = 16 * warp < n_r ? min(start + (r0 + min(16 * warp + 15, n_r - 1)) / n_heads, last_slot) : -1;

    float o[DV / 8][4] = {}, run_max[2] = {-INFINITY, -INFINITY}, run_sum[2] = {0.0f, 0.0f};
    for (int t = 0; t < n_tiles; ++t) {
        const int cur = t % 2, j0 = begin + t * KT;
        cp_async_wait<0>();
        __syncthreads();  // tile t (and, the first time, Q) is in; every warp is done with tile t - 1's stage
        if (t + 1 < n_tiles) load(cur ^ 1, j0 + KT);
        if (j0 > warp_last) continue;
        const __half* kt = ks + cur * KT * ld;

        // S = Q K^T, 32 dims at a time: Q's A fragments by ldmatrix (matrix m: rows 8(m % 2).., dims 8(m / 2)..),
        // K's B fragments as attention_prefill takes them
        float s[KT / 8][4] = {};
        for (int kk = 0; kk < k_width / 16; kk += 2) {
            uint32_t a0[4], a1[4];
            const __half* qrow = qs + (16 * warp + lane % 16) * ld + 16 * kk + 8 * (lane / 16);
            ldmatrix_x4(a0, qrow);
            ldmatrix_x4(a1, qrow + 16);
#pragma unroll
            for (int nt = 0; nt < KT / 8; ++nt) {
                uint32_t b[4];
                ldmatrix_x4(b, kt + (8 * nt + lane % 8) * ld + 16 * kk + 8 * (lane / 8));
                mma_16816(s[nt], a0, {b[0], b[1]});
                mma_16816(s[nt], a1, {b[2], b[3]});
            }
        }
        mask_hidden(s, j0, segs + cur * KT, limit, own_seg, c);
        online_softmax(s, run_max, run_sum, o);
        add_pv(s, kt + dv0, ld, o, lane);  // V: the staged rows' dims dv0..
    }

#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const float sum = row_sum(run_sum[u]);
        if (r[u] >= n_r) continue;
        if (gridDim.z == 1) {  // sum > 0: a query always sees its own slot
            store_row(o, u, out + (size_t)(r0 + r[u]) * v_width + dv0, 1.0f / sum, c);
            continue;
        }
        float* split = partials + ((size_t)(r0 + r[u]) * gridDim.z + blockIdx.z) * (v_width + 2);
        if (dv0 == 0 && c == 0) split[0] = run_max[u] * 0.69314718f, split[1] = sum;  // -inf: the row saw none
        store_row(o, u, split + 2 + dv0, 1.0f, c);
    }
}

// A prompt's: 128 rows a block (8 warps of 16 rows), its slots unsplit. A decode step's (and a short prompt's): 16
// rows a block (a token's 16 heads, DeepSeek-V2's count), MLA_DECODE_WARPS warps each a part of the block's value
// dims (a warp alone loaded Q and the tiles one piece a lane at a time), the slots split over grid z.
// LAUNCH: block = 32 · (MLA_PREFILL_WARPS or MLA_DECODE_WARPS), grid = (ceil(n_tok · n_heads / rows), v_width /
// MLA_MMA_DV, splits), rows = 128 or 16; dynamic shared memory (rows + 2 · MLA_MMA_SLOTS) · (k_width + 8) · 2 +
// 2 · MLA_MMA_SLOTS · 4 bytes (experts.py mla_mma_shared); k_width % 32 == 0, v_width % MLA_MMA_DV == 0,
// v_width <= k_width.
#define MLA_DECODE_WARPS 4
#define LATENT_ATTENTION_MMA(name, ROW_WARPS, DV_WARPS)                                                               \
    extern "C" __global__ void __launch_bounds__(ROW_WARPS * DV_WARPS * WARP)                                          \
        name(const float* q_lat, const float* q_rope, const __half* cache, const int* slot_seg, const int* seg,         \
             float* out, const int* start_at, int n_tok, int n_heads, int k_width, int v_width, float scale,            \
             float* partials) {                                                                                         \
        follow_previous_kernel();                                                                                      \
        latent_attend_mma<ROW_WARPS, DV_WARPS>({q_lat, q_rope, k_width, v_width}, cache, slot_seg, seg, out, partials, *start_at, n_tok, n_heads,      \
                                               k_width, v_width, scale);                                               \
    }
LATENT_ATTENTION_MMA(latent_attention_prefill, MLA_PREFILL_WARPS, 1)
LATENT_ATTENTION_MMA(latent_attention_decode, 1, MLA_DECODE_WARPS)
#undef LATENT_ATTENTION_MMA
