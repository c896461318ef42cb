// Prefill attention on tensor cores, flash-attention 2 style: attention.cu's `attention` for
// prompts of 64 tokens and more (13-19x the scalar tiled kernel it replaced, H200, 2026-12-01).
#include "flash.cuh"

#define PREFILL_WARPS 4
#define PREFILL_QT (16 * PREFILL_WARPS)  // queries a block: 16 a warp, the rows of one mma

// One stage is 8 KB of K and 8 KB of V for any width (KT slots of D halves), so two stages
// fit the 48 KB of static shared memory with room to spare.
template <int D>
struct PrefillSmem {
    static constexpr int KT = 4096 / D;  // slots a tile: 64, 32, 16 for D = 64, 128, 256
    static constexpr int LD = D + 8;  // halves a row: the 16-byte shift puts ldmatrix's 8 rows in distinct banks
    __half k[2][KT][LD];  // [stage][slot][dim]
    __half v[2][KT][LD];
    int seg[2][KT];
};

// The block's queries q0..q0+63 of one head sweep the cache slots 0..last_slot in tiles of KT,
// each tile copied (cp.async) into one stage of shared memory while the warps work on the other.
// Warp w owns queries q0 + 16w .. q0 + 16w + 15 and keeps everything about them in registers:
// its Q fragments (scaled by scale * log2(e), in f16), its scores S = Q K^T for the tile (mma
// accumulators, flash.cuh's layout), the online softmax over S's rows, and O += P V.
template <int D>
__device__ __forceinline__ void attend_prefill(const float* q, const __half* k_cache, const __half* v_cache,
                                               const int* slot_seg, const int* seg, float* out, int start,
                                               int n_tok, int n_heads, int n_kv_heads, float scale,
                                               PrefillSmem<D>& sm) {
    constexpr int KT = PrefillSmem<D>::KT, CHUNKS = D / 8;  // 16-byte pieces a row
    constexpr int COPIES = KT * CHUNKS / (PREFILL_WARPS * WARP);  // of K and of V, a thread a tile
    // the last query tile first: its rows are the longest, so the grid's tail is short ones
    const int q0 = (gridDim.x - 1 - blockIdx.x) * PREFILL_QT, head = blockIdx.y;
    const int kv_head = head / (n_heads / n_kv_heads);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane / 4, c = lane % 4;
    const int n_q = min(PREFILL_QT, n_tok - q0), last_slot = start + q0 + n_q - 1;
    const int width = n_kv_heads * D;  // a cache row, K's and V's alike

    // Slots past last_slot are zeros, never read: an unwritten V row could hold NaN, which a
    // weight of 0 would not cancel. The segments travel asynchronously too: a plain load would
    // hold its warp here for the whole latency, and the block at the next barrier.
    auto load = [&](int stage, int j0) {
#pragma unroll
        for (int p = 0; p < COPIES; ++p) {
            const int i = threadIdx.x + PREFILL_WARPS * WARP * p, r = i / CHUNKS, col = 8 * (i % CHUNKS);
            const size_t offset = (size_t)min(j0 + r, last_slot) * width + kv_head * D + col;
            cp_async16(&sm.k[stage][r][col], k_cache + offset, j0 + r <= last_slot);
            cp_async16(&sm.v[stage][r][col], v_cache + offset, j0 + r <= last_slot);
        }
        if (threadIdx.x < KT)
            cp_async4(&sm.seg[stage][threadIdx.x], slot_seg + min(j0 + (int)threadIdx.x, last_slot),
                      j0 + (int)threadIdx.x <= last_slot);
        cp_async_commit();
    };

    // This lane's rows r[u] (block-relative): g and g + 8 of the warp's 16. A slot is visible to
    // row r[u] up to limit[u]; rows past n_q (zeros, never stored) stop at last_slot.
    int r[2], limit[2], own_seg[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        r[u] = 16 * warp + g + 8 * u;
        limit[u] = min(start + q0 + r[u], last_slot);
        own_seg[u] = r[u] < n_q ? seg[q0 + r[u]] : 0;
    }
    // the warp's last visible slot; -1 for a warp with no query, which then does no work
    const int warp_last = 16 * warp < n_q ? min(start + q0 + 16 * warp + 15, last_slot) : -1;

    // A fragments of Q, 16 dims each: a[e] holds row r[e % 2], dims 2c, 2c + 1 (+ 8 for e >= 2)
    uint32_t qa[D / 16][4];
    const float q_scale = scale * 1.44269504f;  // log2(e): the softmax runs in base 2
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = r[e % 2], dim = 16 * kk + 2 * c + 8 * (e / 2);
            const float* src = q + ((size_t)(q0 + row) * n_heads + head) * D + dim;
            const float2 x = row < n_q ? *reinterpret_cast<const float2*>(src) : make_float2(0.0f, 0.0f);
            qa[kk][e] = pack_half2(x.x * q_scale, x.y * q_scale);
        }

    float o[D / 8][4] = {}, run_max[2] = {-INFINITY, -INFINITY}, run_sum[2] = {0.0f, 0.0f};
    const int n_tiles = last_slot / KT + 1;
    load(0, 0);
    for (int t = 0; t < n_tiles; ++t) {
        const int cur = t % 2, j0 = t * KT;
        cp_async_wait<0>();
        // Tile t is in shared memory (every thread's copies), and every warp is done with tile
        // t - 1, whose stage the next copies overwrite.
        __syncthreads();
        if (t + 1 < n_tiles) load(cur ^ 1, j0 + KT);
        if (j0 > warp_last) continue;  // every query of the warp is before the tile

        // S = Q K^T. K rows are dims in a row, the k x n = dim x slot operand as ldmatrix reads
        // it: matrix m of the x4 is slots 8nt.. by dims 16kk + 8m.., i.e. b of pieces kk, kk + 1.
        float s[KT / 8][4] = {};
#pragma unroll
        for (int nt = 0; nt < KT / 8; ++nt)
#pragma unroll
            for (int kk = 0; kk < D / 16; kk += 2) {
                uint32_t b[4];
                ldmatrix_x4(b, &sm.k[cur][8 * nt + lane % 8][16 * kk + 8 * (lane / 8)]);
                mma_16816(s[nt], qa[kk], {b[0], b[1]});
                mma_16816(s[nt], qa[kk + 1], {b[2], b[3]});
            }

        mask_hidden(s, j0, sm.seg[cur], limit, own_seg, c);
        online_softmax(s, run_max, run_sum, o);
        add_pv(s, &sm.v[cur][0][0], PrefillSmem<D>::LD, o, lane);
    }

#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const float sum = row_sum(run_sum[u]);
        // > 0: a query always sees its own slot
        if (r[u] < n_q) store_row(o, u, out + ((size_t)(q0 + r[u]) * n_heads + head) * D, 1.0f / sum, c);
    }
}

// The same function as `attention` (attention.cu): softmax(scale * q.k) . v for query token i
// (cache slot start + i) and head h over the slots j <= start + i of segment 0 or seg[i], for
// head widths dk = dv = 64 or 128 (other widths do nothing: use `attention`).
// LAUNCH: grid (ceil(n_tok / PREFILL_QT), n_heads) = (ceil(n_tok / 64), n_heads), block
// PREFILL_WARPS * 32 (128).
extern "C" __global__ void __launch_bounds__(PREFILL_WARPS * WARP)
attention_prefill(const float* q, const __half* k_cache, const __half* v_cache, const int* slot_seg,
                  const int* seg, float* out, const int* start_at, int n_tok, int n_heads, int n_kv_heads, int dk,
                  int dv, float scale) {
    follow_previous_kernel();
    // one buffer for both widths: separate __shared__ variables would each take their room
    constexpr size_t BYTES = sizeof(PrefillSmem<64>) > sizeof(PrefillSmem<128>) ? sizeof(PrefillSmem<64>)
                                                                                 : sizeof(PrefillSmem<128>);
    __shared__ __align__(16) unsigned char smem[BYTES];
    const int start = *start_at;
    if (dk == 64 && dv == 64)
        attend_prefill<64>(q, k_cache, v_cache, slot_seg, seg, out, start, n_tok, n_heads, n_kv_heads, scale,
                           *reinterpret_cast<PrefillSmem<64>*>(smem));
    else if (dk == 128 && dv == 128)
        attend_prefill<128>(q, k_cache, v_cache, slot_seg, seg, out, start, n_tok, n_heads, n_kv_heads, scale,
                            *reinterpret_cast<PrefillSmem<128>*>(smem));
}

// The same for dk = dv = 256 (Qwen3.5's gated attention), a kernel of its own: its Q fragments and O accumulators
// take 254 registers, which in attention_prefill would hold the narrower widths to 2 blocks an SM (168 there: 3).
// LAUNCH: as attention_prefill's.
extern "C" __global__ void __launch_bounds__(PREFILL_WARPS * WARP)
attention_prefill_256(const float* q, const __half* k_cache, const __half* v_cache, const int* slot_seg,
                      const int* seg, float* out, const int* start_at, int n_tok, int n_heads, int n_kv_heads, int dk,
                      int dv, float scale) {
    follow_previous_kernel();
    __shared__ __align__(16) unsigned char smem[sizeof(PrefillSmem<256>)];
    attend_prefill<256>(q, k_cache, v_cache, slot_seg, seg, out, *start_at, n_tok, n_heads, n_kv_heads, scale,
                        *reinterpret_cast<PrefillSmem<256>*>(smem));
}
