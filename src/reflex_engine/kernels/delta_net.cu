// Gated DeltaNet (qwen35, qwen3next): the short causal conv, the gates, and the gated delta rule, token by
// token for decode and in chunks for prompts, as backends/cpu/delta_rule.py defines them.
//
// The delta rule's state S (H, dk, dv) is float32, a value head's dk x dv block contiguous. Per value head h
// and token t: S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q. Each column of S (a value feature)
// evolves on its own, so kernels split the columns over blocks. Value head h reads key head
// tiled ? h % k_heads : h / (n_heads / k_heads).
#include "common.cuh"

#define CONV_MAX_TAPS 8
#define DELTA_MAX_DK 128  // the key head width the kernels hold per column (Qwen3.5 and Qwen3-Next: 128)
#define CHUNK_MAX 64      // tokens a chunk of the chunked form
// value columns a block of delta_rule_chunk_scan carries through the chunks: with 8, Qwen3.5-0.8B's 16 value heads
// are 256 blocks, two an SM, each half 16's math (512-token prompts +4%; 4, four an SM, -9%: docs/perf-notes.md run 31)
#define SCAN_COLUMNS 8

__device__ __forceinline__ float sigmoid_rn(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))); }

__device__ __forceinline__ int key_head(int h, int n_heads, int k_heads, int tiled) {
    return tiled ? h % k_heads : h / (n_heads / k_heads);
}

// y = x * sigmoid(gate), x's element i gated by gate[(i / run) · stride + (i % run) · step]: a tensor as x (run =
// stride = its cols, step 1), one gate a token (run = cols, stride 1, step 0), or a split's part in place (run its
// heads' width, stride theirs in the tensor cut, step 1).
// LAUNCH: block 256, grid.x = ceil(n / 256), n = T * cols.
extern "C" __global__ void sigmoid_gate_f32(const float* x, const float* gate, float* y, int64_t n, int run, int stride,
                                            int step) {
    follow_previous_kernel();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __fmul_rn(x[i], sigmoid_rn(gate[i / run * stride + i % run * step]));
}

// g = ssm_a * softplus(alpha + dt_bias) (softplus as numpy's logaddexp(0, z)), b = sigmoid(beta); (T, H) each.
// LAUNCH: block 256, grid.x = ceil(T * H / 256).
extern "C" __global__ void gdn_gates_f32(const float* alpha, const float* beta, const float* dt_bias, const float* ssm_a,
                                         float* g, float* b, int n, int n_heads) {
    follow_previous_kernel();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int h = i % n_heads;
    const float z = __fadd_rn(alpha[i], dt_bias[h]);
    const float softplus = z == 0.0f ? 0.69314718f : z > 0.0f ? __fadd_rn(z, log1pf(expf(-z))) : log1pf(expf(z));
    g[i] = __fmul_rn(ssm_a[h], softplus);
    b[i] = sigmoid_rn(beta[i]);
}

// silu(y), y_c(t) = sum_j w[c, j] in_c(t - K + 1 + j), where the inputs before the batch are the K-1 rows of the
// layer's state (zeros when fresh), which then holds the batch's last K-1 inputs. No output depends on another, so
// a warp takes one token of a block's 32 channels (its lanes: coalesced rows), the block's warps consecutive tokens
// (a thread a channel walking every token took 200 us for a 512-token Qwen3.5 prompt: 24 blocks; 8 warps walking
// a token in 8, 59 us: too few loads in flight). Only grid y's first block holds tokens that read the state's rows
// (t < K - 1 <= 7), so it alone rewrites them, after its barrier.
// w: (C, K) float32 or float16 (w_f16). LAUNCH: block 32 · min(8, n_tok), grid = (ceil(C / 32), ceil(n_tok /
// warps)); K <= CONV_MAX_TAPS.
extern "C" __global__ void __launch_bounds__(256) causal_conv1d_f32(const float* x, const void* w, float* state, float* y,
                                                                    int n_tok, int channels, int taps, int w_f16, int fresh) {
    follow_previous_kernel();
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, c = blockIdx.x * WARP + lane;
    const int t = blockIdx.y * (blockDim.x / WARP) + warp;
    const bool live = c < channels;
    // the channel's input s: the batch's x from s = 0, the state's rows before it (s = 1 - K .. -1)
    auto input = [&](int s) {
        return s >= 0 ? x[(int64_t)s * channels + c] : fresh ? 0.0f : state[(int64_t)(taps - 1 + s) * channels + c];
    };
    if (live && t < n_tok) {
        float acc = 0.0f;  // in the reference's order: the taps summed oldest first
#pragma unroll
        for (int j = 0; j < CONV_MAX_TAPS; j++)
            if (j < taps) {
                const int64_t wj = (int64_t)c * taps + j;
                const float wc = w_f16 ? __half2float(((const __half*)w)[wj]) : ((const float*)w)[wj];
                acc = __fadd_rn(acc, __fmul_rn(input(t - taps + 1 + j), wc));
            }
        y[(int64_t)t * channels + c] = __fmul_rn(acc, sigmoid_rn(acc));
    }
    if (blockIdx.y != 0) return;
    __syncthreads();  // every read of the state's rows is done
    if (live && warp == 0) {
        float next[CONV_MAX_TAPS - 1];
#pragma unroll
        for (int j = 0; j < CONV_MAX_TAPS - 1; j++)
            if (j < taps - 1) next[j] = input(n_tok - (taps - 1) + j);
#pragma unroll
        for (int j = 0; j < CONV_MAX_TAPS - 1; j++)
            if (j < taps - 1) state[(int64_t)j * channels + c] = next[j];
    }
}

// One token (decode): 32 columns of a value head a block, the dk rows split over its 8 warps, each thread
// holding its rows of one column in registers. q, k (Hk*dk), v (H*dv), g, beta (H) of the one token.
// LAUNCH: block 256, grid = (H, ceil(dv / 32)); dk <= DELTA_MAX_DK.
extern "C" __global__ void delta_rule_step(const float* q, const float* k, const float* v, const float* g, const float* beta,
                                           float* state, float* out, int n_heads, int k_heads, int dk, int dv, int tiled,
                                           float scale, int fresh) {
    follow_previous_kernel();
    constexpr int ROWS = DELTA_MAX_DK / 8;
    __shared__ float partial[8][WARP];
    const int h = blockIdx.x, lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int col = blockIdx.y * WARP + lane;
    const bool live = col < dv;
    const int kh = key_head(h, n_heads, k_heads, tiled);
    const float* qh = q + (int64_t)kh * dk;
    const float* kk = k + (int64_t)kh * dk;
    float* s = state + (int64_t)h * dk * dv + col;
    const float decay = expf(g[h]);
    float rows[ROWS];
    float mem = 0.0f;
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int i = warp + 8 * r;
        rows[r] = 0.0f;
        if (live && i < dk) {
            rows[r] = __fmul_rn(fresh ? 0.0f : s[(int64_t)i * dv], decay);
            mem = fmaf(rows[r], kk[i], mem);
        }
    }
    partial[warp][lane] = mem;
    __syncthreads();
    mem = 0.0f;
#pragma unroll
    for (int w = 0; w < 8; w++) mem += partial[w][lane];
    const float delta = live ? __fmul_rn(beta[h], __fsub_rn(v[(int64_t)h * dv + col], mem)) : 0.0f;
    float o = 0.0f;
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int i = warp + 8 * r;
        if (live && i < dk) {
            rows[r] = __fadd_rn(rows[r], __fmul_rn(kk[i], delta));
            s[(int64_t)i * dv] = rows[r];
            o = fmaf(rows[r], __fmul_rn(qh[i], scale), o);
        }
    }
    __syncthreads();  // every warp has read partial
    partial[warp][lane] = o;
    __syncthreads();
    if (warp == 0 && live) {
        o = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; w++) o += partial[w][lane];
        out[(int64_t)h * dv + col] = o;
    }
}

// The chunked form's state-free part, one (chunk, value head) a block: with c the cumulative log-decay from the
// chunk's start, A[t, j] = beta_t exp(c_t - c_j) k_t.k_j (j < t) and T = (I + A)^-1 (forward substitution),
//   W = T (beta exp(c) K),  U = T (beta V),  QK[t, j] = exp(c_t - c_j) q_t.k_j (j <= t, else 0),
// so that the chunk's corrections are D = U - W S0 (delta_rule_chunk_scan). Scratch per value head h and token:
// w (H, T, dk), u (H, T, dv), qk (H, T, CHUNK_MAX), cum (H, T). A grid of (chunks, heads) blocks leaves most of the
// GPU's warp slots empty (a 512-token Qwen3.5 prompt: 128 blocks), so each phase is written for latency, its chains
// side by side: the chunk's keys staged in shared memory (rows of dk + 1 floats: 16 consecutive j at one i in 16
// banks); a thread's four j of one t share each load of q_t and k_t; T's row t a sum over 8 threads an entry; and
// W and U a thread's 16 rows of one column at once, sharing each row j of the right-hand side. Each sum runs in the
// order it did a thread an entry (but T's, now in 8 slices): 149 us a launch before (run 30, 512 tokens).
// LAUNCH: block PREP_THREADS, grid = (ceil(T / chunk), H); chunk <= CHUNK_MAX; dynamic shared memory chunk · (dk + 1)
// floats.
#define PREP_THREADS 512
#define PREP_COLUMNS 128  // W's and U's columns a pass, PREP_THREADS / PREP_COLUMNS row groups
extern "C" __global__ void __launch_bounds__(PREP_THREADS)
delta_rule_chunk_prep(const float* q, const float* k, const float* v, const float* g, const float* beta, float* w, float* u,
                      float* qk, float* cum, int n_tok, int n_heads, int k_heads, int dk, int dv, int tiled, float scale,
                      int chunk) {
    follow_previous_kernel();
    constexpr int GROUPS = PREP_THREADS / PREP_COLUMNS, ROWS = CHUNK_MAX / GROUPS, T_SLICES = PREP_THREADS / CHUNK_MAX;
    __shared__ float m[CHUNK_MAX][CHUNK_MAX + 1];  // A's strictly lower part, then T's
    __shared__ float c[CHUNK_MAX], bt[CHUNK_MAX], f[CHUNK_MAX];
    extern __shared__ float ks[];  // (n, dk + 1): the chunk's keys
    const int a = blockIdx.x * chunk, h = blockIdx.y, n = min(chunk, n_tok - a), tid = threadIdx.x, ld = dk + 1;
    const int kh = key_head(h, n_heads, k_heads, tiled);
    const int64_t k_stride = (int64_t)k_heads * dk, v_stride = (int64_t)n_heads * dv;
    const float* kc = k + a * k_stride + (int64_t)kh * dk;
    const float* qc = q + a * k_stride + (int64_t)kh * dk;
    const float* vc = v + a * v_stride + (int64_t)h * dv;
    for (int t = tid; t < n; t += PREP_THREADS)
        c[t] = g[(int64_t)(a + t) * n_heads + h], bt[t] = beta[(int64_t)(a + t) * n_heads + h];
    for (int e = tid; e < n * dk; e += PREP_THREADS) ks[e / dk * ld + e % dk] = kc[e / dk * k_stride + e % dk];
    __syncthreads();
    if (tid == 0)  // the reference's cumsum: one running float32 sum
        for (int t = 1; t < n; t++) c[t] = __fadd_rn(c[t - 1], c[t]);
    __syncthreads();
    for (int t = tid; t < n; t += PREP_THREADS) f[t] = __fmul_rn(bt[t], expf(c[t]));  // W's beta exp(c), once a row

    // A and QK: thread (t, jg) takes j = jg, jg + 16, jg + 32, jg + 48 (j <= t)
    float* qk_rows = qk + ((int64_t)h * n_tok + a) * CHUNK_MAX;
    for (int e = tid; e < n * 16; e += PREP_THREADS) {
        const int t = e / 16, jg = e % 16;
        float kk[4] = {}, qq[4] = {};
        for (int i = 0; i < dk; i++) {
            const float kt = ks[t * ld + i], qt = __fmul_rn(qc[t * k_stride + i], scale);
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const int j = jg + 16 * r;
                if (j <= t) {
                    const float kj = ks[j * ld + i];
                    kk[r] = fmaf(kt, kj, kk[r]);
                    qq[r] = fmaf(qt, kj, qq[r]);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int j = jg + 16 * r;
            if (j >= n) continue;
            const float decay = j <= t ? expf(__fsub_rn(c[t], c[j])) : 0.0f;
            m[t][j] = j < t ? __fmul_rn(__fmul_rn(kk[r], decay), bt[t]) : 0.0f;
            qk_rows[(int64_t)t * CHUNK_MAX + j] = __fmul_rn(qq[r], decay);
        }
    }
    __syncthreads();
    // T's strictly lower part replaces A's row by row: T[t, j'] = -(A[t, j'] + sum_{j'<j<t} A[t, j] T[j, j']), the sum
    // in T_SLICES slices (thread (j', slice)), added up across their lanes
    const int col = tid / T_SLICES, slice = tid % T_SLICES;
    for (int t = 1; t < n; t++) {
        float tm = 0.0f;
        if (col < t)
            for (int j = col + 1 + slice; j < t; j += T_SLICES) tm = fmaf(m[t][j], m[j][col], tm);
#pragma unroll
        for (int o = T_SLICES / 2; o > 0; o /= 2) tm += __shfl_xor_sync(0xffffffffu, tm, o);
        __syncthreads();  // every slice has read row t's A
        if (col < t && slice == 0) m[t][col] = -__fadd_rn(m[t][col], tm);
        __syncthreads();
    }

    // out[t, :] = sum_{j <= t} T[t, j] scale_of[j] x[j, :] (T[t, t] = 1), for W (the keys) and U (the values): thread
    // (group, column) takes rows group + GROUPS·r, the sum over j in order
    const int group = tid / PREP_COLUMNS;
    auto t_times = [&](const float* x, int64_t x_stride, const float* scale_of, int width, float* out) {
        for (int cl = tid % PREP_COLUMNS; cl < width; cl += PREP_COLUMNS) {
            float acc[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                const int t = group + GROUPS * r;
                acc[r] = t < n ? __fmul_rn(scale_of[t], x[t * x_stride + cl]) : 0.0f;
            }
            for (int j = 0; j < n - 1; j++) {
                const float xj = __fmul_rn(scale_of[j], x[j * x_stride + cl]);
#pragma unroll
                for (int r = 0; r < ROWS; r++) {
                    const int t = group + GROUPS * r;
                    if (j < t && t < n) acc[r] = fmaf(m[t][j], xj, acc[r]);
                }
            }
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                const int t = group + GROUPS * r;
                if (t < n) out[(int64_t)t * width + cl] = acc[r];
            }
        }
    };
    t_times(ks, ld, f, dk, w + ((int64_t)h * n_tok + a) * dk);
    t_times(vc, v_stride, bt, dv, u + ((int64_t)h * n_tok + a) * dv);
    for (int t = tid; t < n; t += PREP_THREADS) cum[(int64_t)h * n_tok + a + t] = c[t];
}

// The chunked form's scan: SCAN_COLUMNS columns of a value head's state a block, through the batch's chunks in
// turn. Per chunk, with S0 the state at its start and c_L its last cumulative log-decay:
//   D = U - W S0;  o = exp(c) (Q S0) + QK D;  S = exp(c_L) S0 + (exp(c_L - c) K)^T D.
// A thread takes one column and TOK_ROWS rows (tokens; for S, DK_ROWS of the state's rows) at once, each row's
// sum over the inner index in order: its chains run side by side and share each load of the other operand (a row
// at a time, the loops' latency and two shared loads an FMA bounded the kernel: 388 us a launch on a 512-token
// Qwen3.5 prompt). The chunk's (n, dk) operand rows are dk + 1 floats apart: a warp's two rows in distinct banks.
// Each operand is staged as stored (plain copies): Q's scale multiplies Q S0's sums, K's decays D's rows (a decay
// an element took 8,192 expf a chunk), and QK is staged too, its sums' loads from global memory in the chain
// (241 us a launch before, run 30).
// LAUNCH: block SCAN_THREADS, grid = (H, ceil(dv / SCAN_COLUMNS)); dk <= DELTA_MAX_DK, chunk <= CHUNK_MAX.
#define SCAN_THREADS 256
#define SCAN_ROW_STEP (SCAN_THREADS / SCAN_COLUMNS)  // 32 rows side by side, a thread every 32nd
extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
delta_rule_chunk_scan(const float* q, const float* k, const float* w, const float* u, const float* qk, const float* cum,
                      float* state, float* out, int n_tok, int n_heads, int k_heads, int dk, int dv, int tiled,
                      float scale, int chunk, int fresh) {
    follow_previous_kernel();
    constexpr int TOK_ROWS = CHUNK_MAX / SCAN_ROW_STEP, DK_ROWS = DELTA_MAX_DK / SCAN_ROW_STEP;  // a thread's rows
    __shared__ float x[CHUNK_MAX * (DELTA_MAX_DK + 1)];  // W, Q, QK ((n, n), rows CHUNK_MAX + 1 apart), K: (n, dk), rows ld apart
    __shared__ float s[DELTA_MAX_DK][SCAN_COLUMNS];
    __shared__ float d[CHUNK_MAX][SCAN_COLUMNS];
    __shared__ float c[CHUNK_MAX];
    const int h = blockIdx.x, c0 = blockIdx.y * SCAN_COLUMNS, tid = threadIdx.x, ld = dk + 1;
    const int col = tid % SCAN_COLUMNS, lane_row = tid / SCAN_COLUMNS;
    const bool live = c0 + col < dv;
    const int kh = key_head(h, n_heads, k_heads, tiled);
    const int64_t k_stride = (int64_t)k_heads * dk;
    float* sh = state + (int64_t)h * dk * dv + c0;
    for (int i = lane_row; i < dk; i += SCAN_ROW_STEP) s[i][col] = fresh || !live ? 0.0f : sh[(int64_t)i * dv + col];
    // each of this thread's token rows t = lane_row + SCAN_ROW_STEP·r (r < TOK_ROWS, t < n) dotted with S's column
    auto rows_times_s = [&](int n, float (&acc)[TOK_ROWS]) {
#pragma unroll
        for (int r = 0; r < TOK_ROWS; r++) acc[r] = 0.0f;
        for (int i = 0; i < dk; i++) {
            const float si = s[i][col];
#pragma unroll
            for (int r = 0; r < TOK_ROWS; r++)
                if (lane_row + SCAN_ROW_STEP * r < n) acc[r] = fmaf(x[(lane_row + SCAN_ROW_STEP * r) * ld + i], si, acc[r]);
        }
    };
    for (int a = 0; a < n_tok; a += chunk) {
        const int n = min(chunk, n_tok - a);
        const float* wc = w + ((int64_t)h * n_tok + a) * dk;
        const float* uc = u + ((int64_t)h * n_tok + a) * dv;
        const float* qkc = qk + ((int64_t)h * n_tok + a) * CHUNK_MAX;
        __syncthreads();  // the last chunk's readers of x, d and c are done
        for (int e = tid; e < n * dk; e += SCAN_THREADS) x[e / dk * ld + e % dk] = wc[e];
        for (int t = tid; t < n; t += SCAN_THREADS) c[t] = cum[(int64_t)h * n_tok + a + t];
        __syncthreads();
        float acc[TOK_ROWS];
        rows_times_s(n, acc);  // W S0
#pragma unroll
        for (int r = 0; r < TOK_ROWS; r++) {
            const int t = lane_row + SCAN_ROW_STEP * r;
            if (t < n) d[t][col] = live ? __fsub_rn(uc[(int64_t)t * dv + c0 + col], acc[r]) : 0.0f;
        }
        __syncthreads();
        for (int e = tid; e < n * dk; e += SCAN_THREADS) x[e / dk * ld + e % dk] = q[(a + e / dk) * k_stride + (int64_t)kh * dk + e % dk];
        __syncthreads();
        rows_times_s(n, acc);  // Q S0, unscaled
        __syncthreads();
        constexpr int QK_LD = CHUNK_MAX + 1;
        for (int e = tid; e < n * n; e += SCAN_THREADS) x[e / n * QK_LD + e % n] = qkc[(int64_t)(e / n) * CHUNK_MAX + e % n];
        __syncthreads();
#pragma unroll
        for (int r = 0; r < TOK_ROWS; r++) {
            const int t = lane_row + SCAN_ROW_STEP * r;
            if (t >= n) continue;
            float qd = 0.0f;
            for (int j = 0; j <= t; j++) qd = fmaf(x[t * QK_LD + j], d[j][col], qd);
            if (live)
                out[(int64_t)(a + t) * n_heads * dv + (int64_t)h * dv + c0 + col] =
                    __fadd_rn(__fmul_rn(expf(c[t]), __fmul_rn(acc[r], scale)), qd);
        }
        __syncthreads();
        const float last = c[n - 1];
#pragma unroll
        for (int r = 0; r < TOK_ROWS; r++) {  // D's rows decayed to the chunk's end, each by the thread that wrote it
            const int t = lane_row + SCAN_ROW_STEP * r;
            if (t < n) d[t][col] = __fmul_rn(d[t][col], expf(__fsub_rn(last, c[t])));
        }
        for (int e = tid; e < n * dk; e += SCAN_THREADS) x[e / dk * ld + e % dk] = k[(a + e / dk) * k_stride + (int64_t)kh * dk + e % dk];
        __syncthreads();
        const float grow = expf(last);
        float kd[DK_ROWS] = {};  // S's rows i = lane_row + SCAN_ROW_STEP·r (i < dk): K^T (decayed D)
        for (int t = 0; t < n; t++) {
            const float dt = d[t][col];
#pragma unroll
            for (int r = 0; r < DK_ROWS; r++)
                if (lane_row + SCAN_ROW_STEP * r < dk) kd[r] = fmaf(x[t * ld + lane_row + SCAN_ROW_STEP * r], dt, kd[r]);
        }
#pragma unroll
        for (int r = 0; r < DK_ROWS; r++) {
            const int i = lane_row + SCAN_ROW_STEP * r;
            if (i < dk) s[i][col] = __fadd_rn(__fmul_rn(grow, s[i][col]), kd[r]);
        }
    }
    __syncthreads();
    if (live)
        for (int i = lane_row; i < dk; i += SCAN_ROW_STEP) sh[(int64_t)i * dv + col] = s[i][col];
}
