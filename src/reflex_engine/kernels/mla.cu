// Multi-head latent attention (deepseek2): the head-wise split and concat around it, its YaRN RoPE,
// and the absorbed attention over the latent cache. The cache is f16 (capacity, k_width) per layer,
// one row a token (kv_lora_rank latent values, then the RoPE part), written by attention.cu's
// kv_store with no value rows; slot_seg as there. Value rows are the first v_width features of each
// cached row, so a row is read once for its score and its value.
#include <float.h>
#include "common.cuh"

#define MLA_WARPS 8  // a decode step has only n_heads blocks: more warps split the slots further
#define MLA_MAX_PER_LANE 18  // latent rows up to 576 = 18 * 32 features (DeepSeek's 512 + 64)
#define MLA_STEP 2           // slots a warp has in flight at once

// Per row r of (n_rows, *) rows: dst[r * dst_width + dst_offset + c] = src[r * src_width + src_offset + c]
// for c < width. Ops.split and Ops.concat with r = token * n_heads + head.
// LAUNCH: block = 128, grid.x = n_rows.
extern "C" __global__ void copy_heads_f32(const float* src, float* dst, int src_width, int src_offset, int dst_width,
                                          int dst_offset, int width) {
    follow_previous_kernel();
    const float* s = src + (size_t)blockIdx.x * src_width + src_offset;
    float* d = dst + (size_t)blockIdx.x * dst_width + dst_offset;
    for (int c = threadIdx.x; c < width; c += blockDim.x) d[c] = s[c];
}

// elementwise.cu's rope_f32 with YaRN, as the numpy backend computes it in double: pair i's angle
// blends the interpolated pos·freq_scale·θ_i and the original pos·θ_i by mix = ramp_i·ext_factor,
// ramp_i = 1 - clamp((i - low) / max(0.001, high - low), 0, 1) (ggml's rope_yarn_ramp, low and high its
// corr dims); cos and sin are multiplied by magnitude.
// LAUNCH: block = (n_rot / 2 rounded up to 32, capped at 256), grid = (n_tok, n_heads).
extern "C" __global__ void rope_yarn_f32(const float* x, float* y, const int* pos, const float* freq_factors,
                                         int head_dim, int n_rot, int neox, double base, double freq_scale,
                                         double ext_factor, double low, double high, double magnitude) {
    follow_previous_kernel();
    const int64_t head = ((int64_t)blockIdx.x * gridDim.y + blockIdx.y) * head_dim;
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
        const float a = x[head + ia], b = x[head + ib];
        y[head + ia] = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
        y[head + ib] = __fadd_rn(__fmul_rn(a, sn), __fmul_rn(b, cs));
    }
    for (int i = n_rot + threadIdx.x; i < head_dim; i += blockDim.x) y[head + i] = x[head + i];
}

// softmax(scale · q·row) · row[:v_width] for query token i (cache slot start + i) and query head h over
// the cached rows j <= start + i of segment 0 or seg[i] (see ops.Batch): multi-query attention with
// one latent row per slot. q (n_tok, n_heads * k_width), out (n_tok, n_heads * v_width). Block z of
// gridDim.z takes the z-th of that many equal runs of the query's slots (lengths from *start_at, so a
// captured graph replays at any position); its warps run online softmaxes over every MLA_WARPS-th run
// of MLA_STEP slots and merge. With one split the block writes out; with more it writes its
// (max, sum, unnormalised values) to partials, ((i * n_heads + h) * splits + z) * (v_width + 2) floats
// on, for latent_attention_combine. Lane l holds features l, l+32, ... of q and of the values. The
// running maximum starts at -FLT_MAX, not -inf, so that exp(score - max) is 0, never NaN, for hidden
// slots (-inf) and for a split that sees none.
// LAUNCH: block = MLA_WARPS * 32, grid = (n_tok, n_heads, splits); v_width <= k_width <= 32 * MLA_MAX_PER_LANE.
extern "C" __global__ void __launch_bounds__(MLA_WARPS * WARP)
latent_attention(const float* q, const __half* cache, const int* slot_seg, const int* seg, float* out,
                 const int* start_at, int n_heads, int k_width, int v_width, float scale, float* partials) {
    follow_previous_kernel();
    __shared__ float merge_max[MLA_WARPS], merge_sum[MLA_WARPS];
    __shared__ float merge_acc[MLA_WARPS][MLA_MAX_PER_LANE * WARP];
    const int i = blockIdx.x, h = blockIdx.y, lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int n_slots = *start_at + i + 1, own_seg = seg[i];
    const int per_split = (n_slots + gridDim.z - 1) / gridDim.z;
    const int begin = blockIdx.z * per_split, end = min(n_slots, begin + per_split);
    const float* q_row = q + ((size_t)i * n_heads + h) * k_width;
    float qv[MLA_MAX_PER_LANE], acc[MLA_MAX_PER_LANE];
#pragma unroll
    for (int e = 0; e < MLA_MAX_PER_LANE; ++e) {
        const int d = e * WARP + lane;
        qv[e] = d < k_width ? q_row[d] : 0.0f;
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
        for (int z = 0; z < splits; ++z) o += wt[z] * part[z * (v_width + 2) + 2 + c];
        out[pair * v_width + c] = o * inv_total;
    }
}
