"""CudaOps's mixture-of-experts and latent-attention ops (kernels/moe.cu, kernels/mla.cu).

The router's choice stays on the device: Routes hold two activation buffers, the expert ids (int32
bits) and their weights, and the expert kernels read the ids there. No op here synchronises or
decides anything on the host from device data, so a decode step is captured as a CUDA graph.
A stacked weight (3-D: ggml {n_cols, n_rows, n}) is n matrices, each one's blocks contiguous.
"""
from __future__ import annotations

import itertools
import math
from typing import Sequence

from ...errors import ReflexError
from ...gguf import tensor_nbytes
from ...ops import Batch, Gating, Rope, Routes, Routing
from .memory import LazyTensor, RowRun, head_runs

MOE_WARPS = 4  # kernels/moe.cu: output rows per block
# past a decode pass's 8 tokens, experts take their tokens grouped (kernels/moe.cu moe_group), each
# expert's rows read once per 8 of them: H200, Qwen3-30B-A3B-shaped Q4_K_M, a 512-token prompt ran at
# 722 tok/s reading the chosen experts once per token, against llama.cpp's 12,116
GROUPED_MIN_TOKENS = 8
ROUTE_THREADS, ROUTE_MAX_EXPERTS, ROUTE_MAX_USED, ROUTE_MAX_GROUPS = 256, 1024, 64, 64  # kernels/moe.cu
MLA_MAX_WIDTH, MLA_THREADS = 576, 256  # kernels/mla.cu: 18 features a lane, MLA_WARPS * 32
# a decode step's slots split over up to 64 blocks a head, at least 128 slots each, their partial
# softmaxes in the scratch CudaOps keeps for attention's (which bounds the splits of a long batch)
MLA_MAX_SPLITS, MLA_SPLIT_SLOTS = 64, 128
# kernels/mla.cu's latent attention on tensor cores (sm_90+), for rows of whole 32-feature pieces and values of
# whole 256-dim blocks: (token, head) rows in blocks with their Q and two stages of 32 slots in shared memory; a
# prompt of MLA_PREFILL_MIN_TOKENS or more 128 rows a block, a warp each 16 (225 KB at DeepSeek's 576), its slots
# unsplit; a decode step (and a shorter prompt) 16 rows a block, MLA_DECODE_WARPS warps each a part of its value dims,
# its slots split in runs of about MLA_DECODE_SPLIT_SLOTS (up to MLA_MAX_SPLITS) as the split kernel's are; the split
# kernel elsewhere
MLA_MMA_SLOTS, MLA_MMA_DV = 32, 256
MLA_PREFILL_MIN_TOKENS, MLA_PREFILL_WARPS, MLA_DECODE_WARPS, MLA_DECODE_SPLIT_SLOTS = 64, 8, 4, 64


def matrix_bytes(weight) -> int:
    """Bytes between consecutive matrices of a stacked weight, as stored on the device."""
    return tensor_nbytes(weight.ggml_type, weight.shape[:2])


def yarn_args(rope: Rope) -> tuple:
    """kernels/mla.cu rope_yarn_f32's arguments after rope_f32's: ggml's rope_yarn_corr_dims."""
    def corr_dim(beta: float) -> float:
        return rope.n_rot * math.log(rope.n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(rope.base))

    low = max(0.0, math.floor(corr_dim(rope.beta_fast))) if rope.ext_factor else 0.0
    high = min(rope.n_rot - 1.0, math.ceil(corr_dim(rope.beta_slow))) if rope.ext_factor else 0.0
    return rope.ext_factor, low, high, rope.magnitude


class ExpertOps:
    """Mixed into CudaOps: uses its device, activation pools (_new), weight readiness (_ready) and
    per-pass ints (_upload_ints)."""

    def route(self, logits, routing: Routing, bias=None) -> Routes:
        t, n_expert = logits.rows, logits.cols
        if n_expert > ROUTE_MAX_EXPERTS or routing.n_used > ROUTE_MAX_USED or routing.n_groups > ROUTE_MAX_GROUPS:
            raise ReflexError(f"{n_expert} experts, {routing.n_used} used, in {routing.n_groups} groups: the CUDA router "
                              f"takes at most {ROUTE_MAX_EXPERTS}, {ROUTE_MAX_USED} and {ROUTE_MAX_GROUPS}")
        experts, weights = self._new(t, routing.n_used), self._new(t, routing.n_used)  # experts: int32 bits
        scale = 1.0 if routing.scale in (0.0, 1.0) else routing.scale
        self.device.launch("moe_route", (t,), ROUTE_THREADS,
                           (logits.ptr, self._ready(bias) if bias is not None else 0, experts.ptr, weights.ptr, n_expert,
                            routing.n_used, routing.gating is Gating.SIGMOID, routing.norm, scale, routing.n_groups,
                            routing.n_groups_used))
        return Routes(experts, weights)

    def moe_ffn(self, x, routes: Routes, *, gate, up, down, add=None):
        experts, weights = routes
        t, k, c = experts.rows, experts.cols, _cuda_ops()
        if t <= GROUPED_MIN_TOKENS and all(w.ggml_type in c.X16_MATVEC_TYPES for w in (gate, up, down)) \
                and max(x.cols, k * gate.n_rows) <= self._x16_width:
            return self._x16_moe_ffn(x, routes, gate=gate, up=up, down=down, add=add)  # add summed in its down's launch
        if t > GROUPED_MIN_TOKENS:
            out = self._grouped_moe_ffn(x, routes, gate=gate, up=up, down=down)
        else:
            h = self.swiglu(self._stacked_matvec(x, gate, k, experts), self._stacked_matvec(x, up, k, experts))  # (T, k*F)
            out = self._new(t, down.n_rows)
            self.device.launch(_kernel("experts_down", down), (t, -(-down.n_rows // MOE_WARPS)), 32 * MOE_WARPS,
                               (self._ready(down), matrix_bytes(down), experts.ptr, weights.ptr,
                                h.ptr, out.ptr, down.n_rows, down.n_cols, k))
        return out if add is None else self.add(add, out)

    def _x16_moe_ffn(self, x, routes: Routes, *, gate, up, down, add):
        """A decode pass's experts on int16 x, as the dense matvecs (kernels/matvec_x16.cu stacked_matvec_x16_*,
        experts_down_x16_*): x's blocks made once (or taken from the norm before), gate and up in one launch where
        they are of one type and shape, SwiGLU's blocks written beside h for the down, which sums add in."""
        experts, weights = routes
        t, k, c = experts.rows, experts.cols, _cuda_ops()
        src = self._x16_source(x)
        runs = [(gate, up)] if (gate.ggml_type, gate.shape) == (up.ggml_type, up.shape) else [(gate,), (up,)]
        h = self.swiglu(*(y for run in runs for y in self._stacked_x16(src, run, experts, k)))  # (T, k*F)
        hs, out = self._x16_source(h), self._new(t, down.n_rows)
        self.device.launch(_kernel("experts_down_x16", down), (-(-down.n_rows // c.X16_DECODE_ROWS), t),
                           32 * min(4, -(-down.n_cols // 1024)),
                           (self._ready(down), matrix_bytes(down), experts.ptr, weights.ptr, hs.xq, hs.xds,
                            add.ptr if add is not None else 0, out.ptr, down.n_rows, down.n_cols, k))
        return out

    def _stacked_x16(self, src, run, experts, k: int):
        """(T, k * n_rows) for each of the run's one or two stacked weights (one type, one shape): matrix
        experts[t, j] of it times x's row t, from its int16 blocks."""
        c, first = _cuda_ops(), run[0]
        outs = [self._new(experts.rows, k * first.n_rows) for _ in run]
        self.device.launch(_kernel("stacked_matvec_x16", first), (-(-first.n_rows // c.X16_DECODE_ROWS), len(run) * experts.rows * k),
                           32 * min(4, -(-first.n_cols // 1024)),
                           (*(self._ready(w) for w in run), *(0,) * (2 - len(run)), matrix_bytes(first), experts.ptr,
                            src.xq, src.xds, *(y.ptr for y in outs), *(0,) * (2 - len(run)), first.n_rows, first.n_cols, k,
                            src.sums, src.eps))
        return outs

    def _grouped_moe_ffn(self, x, routes: Routes, *, gate, up, down):
        """A prompt's experts, each over the (token, slot) pairs routed to it (kernels/moe.cu's moe_group): a
        matrix kernels/gemm_tile.cu takes (ops.tile_fits) on tensor cores in tiles of 64 pairs
        (gemm_tile_experts_*, its input as f16), any other with its weights read once per 8 of an expert's pairs
        (matvec.cu's grouped_matvec). The pairs' rows live in (T, k * width) buffers: place p is row p // k, slot p % k."""
        experts, weights = routes
        t, k, n_expert, dev, c = experts.rows, experts.cols, gate.shape[2], self.device, _cuda_ops()
        offsets, order, place_of = self._new(1, n_expert + 1), self._new(t, k), self._new(t, k)  # int32 bits
        tile_gate, tile_up, tile_down = (c.tile_fits(w.ggml_type, w.n_cols) for w in (gate, up, down))
        n_tiles = -(-t * k // c.GEMM_TILE_TOKENS) + n_expert  # the most there may be: each expert's last partial
        tiles = self._new(1, 2 * n_tiles) if tile_gate or tile_up or tile_down else None  # (expert, first place) int32 pairs
        dev.launch("moe_group", (1,), 1024, (experts.ptr, t * k, n_expert, offsets.ptr, order.ptr, place_of.ptr,
                                             tiles.ptr if tiles else 0, c.GEMM_TILE_TOKENS, n_tiles if tiles else 0))
        xs = self._new(t, k * x.cols)
        dev.launch("moe_gather", (t * k,), 256, (x.ptr, order.ptr, xs.ptr, k, x.cols))

        def product(x_, x_f16, weight, tiled):  # x_f16: x_ as f16 (gemm_tile.cu's order), made once for every tile reading it
            return self._tiled_experts(x_f16, weight, offsets, tiles, k) if tiled else self._grouped_matvec(x_, weight, offsets, k)

        xs_f16 = self._f16_interleaved(xs) if tile_gate or tile_up else None
        h = self.swiglu(product(xs, xs_f16, gate, tile_gate), product(xs, xs_f16, up, tile_up))
        ys = product(h, self._f16_interleaved(h) if tile_down else None, down, tile_down)
        out = self._new(t, down.n_rows)
        dev.launch("moe_combine", (t,), 256, (ys.ptr, place_of.ptr, weights.ptr, out.ptr, k, down.n_rows))
        return out

    def _grouped_matvec(self, xs, weight, offsets, k: int):
        out = self._new(xs.rows, k * weight.n_rows)
        self.device.launch(_kernel("grouped_matvec", weight), (-(-weight.n_rows // 2), weight.shape[2]),
                           32 * min(4, -(-weight.n_cols // 512)),
                           (self._ready(weight), matrix_bytes(weight), offsets.ptr, xs.ptr, out.ptr,
                            weight.n_rows, weight.n_cols))
        return out

    def _tiled_experts(self, xh, weight, offsets, tiles, k: int):
        """(T, k * n_rows): each place's row of xh (f16 interleaved, two a float) times its expert's matrix."""
        c, out, kernel = _cuda_ops(), self._new(xh.rows, k * weight.n_rows), _kernel("gemm_tile_experts", weight)
        self.device.allow_shared(kernel, c.GEMM_TILE_SHARED)
        self.device.launch(kernel, (tiles.cols // 2, -(-weight.n_rows // c.GEMM_TILE_ROWS)), 32 * c.GEMM_TILE_WARPS,
                           (self._ready(weight), matrix_bytes(weight), tiles.ptr, offsets.ptr, xh.ptr, out.ptr,
                            weight.n_rows, weight.n_cols), c.GEMM_TILE_SHARED)
        return out

    def _f16_interleaved(self, x):
        """x as f16 in gemm_tile.cu's order, in a buffer of half x's floats (the f16 scratch holds one pass of
        tokens, not its (token, expert) pairs)."""
        out = self._new(x.rows, x.cols // 2)
        self._launch_f16(x, out.ptr, interleaved=True)
        return out

    def head_matmul(self, x, weight):
        """A decode pass's heads by the stacked matvec; a prompt's, where kernels/gemm_tile.cu takes the type, on
        tensor cores in tiles of 64 tokens, each head's matrix read once a tile (the matvec read it once a token:
        DeepSeek-V2-Lite's 512-token prompt spent 89 of its 212 ms there)."""
        n_heads, c = weight.shape[2], _cuda_ops()
        if x.cols != n_heads * weight.n_cols:
            raise ReflexError(f"internal error: head_matmul of width {x.cols} with {n_heads} heads of {weight.n_cols} columns")
        if x.rows <= GROUPED_MIN_TOKENS or not c.tile_fits(weight.ggml_type, weight.n_cols):
            return self._stacked_matvec(x, weight, n_heads, heads=head_runs(x, weight.n_cols))
        out, kernel = self._new(x.rows, n_heads * weight.n_rows), _kernel("gemm_tile_heads", weight)
        self.device.allow_shared(kernel, c.GEMM_TILE_SHARED)
        self.device.launch(kernel, (-(-x.rows // c.GEMM_TILE_TOKENS), -(-weight.n_rows // c.GEMM_TILE_ROWS), n_heads),
                           32 * c.GEMM_TILE_WARPS, (self._ready(weight), matrix_bytes(weight), self._f16_interleaved(x).ptr,
                                                    out.ptr, weight.n_rows, weight.n_cols, x.rows), c.GEMM_TILE_SHARED)
        return out

    def _stacked_matvec(self, x, weight, n_slots: int, ids=None, heads=None):
        """(T, n_slots * n_rows): per token t and slot j, matrix ids[t, j] of the stacked weight times
        x's row t (experts), or without ids matrix j times x's head j (heads: memory.head_runs(x))."""
        out = self._new(x.rows, n_slots * weight.n_rows)
        address, x_stride, slot_stride = (x.ptr, x.cols, 0) if heads is None else (heads.address, n_slots * heads.stride, heads.stride)
        self.device.launch(_kernel("stacked_matvec", weight), (x.rows * n_slots, -(-weight.n_rows // MOE_WARPS)),
                           32 * MOE_WARPS,
                           (self._ready(weight), matrix_bytes(weight), ids.ptr if ids is not None else 0, address, out.ptr,
                            weight.n_rows, weight.n_cols, n_slots, x_stride, slot_stride))
        return out

    def split(self, x, n_heads: int, widths: Sequence[int]):
        total, offsets = sum(widths), itertools.accumulate(widths, initial=0)
        if x.rows == 1 and n_heads == 1 and all(w % 32 == 0 for w in widths):
            # a decode step's one head: each part is a run of the row at a 128-byte step, where the kernels' 16-byte loads
            # and int16 blocks of 32 find it as in a buffer of its own; no copy
            return tuple(RowRun(x, offset, w) for w, offset in zip(widths, offsets))
        # parts made (copied, two a launch) only when something asks for one's address: the rope, head_matmul's
        # matvec and sigmoid_gate read them where they lie (memory.head_runs)
        parts, copies, made = [], [], []
        for w, offset in zip(widths, offsets):
            part = LazyTensor(self._pool(x.rows), x.rows, n_heads * w)
            part.heads = (x, 4 * offset, w, total)
            parts.append(part)
            copies.append((part.address, offset, w))

        def make():
            if not made:
                made.append(True)
                self._copy_heads([(x.ptr, dst, total, offset, w, 0, w) for dst, offset, w in copies], x.rows * n_heads)

        for part in parts:
            part.make = make
        return tuple(parts)

    def concat(self, parts, n_heads: int):
        widths = [p.cols // n_heads for p in parts]
        total, offsets = sum(widths), itertools.accumulate(widths, initial=0)
        out = self._new(parts[0].rows, n_heads * total)
        self._copy_heads([(p.ptr, out.ptr, w, 0, total, offset, w) for p, w, offset in zip(parts, widths, offsets)],
                         parts[0].rows * n_heads)
        return out

    def _copy_heads(self, copies, n_rows: int) -> None:
        """copies: (src, dst, src_width, src_offset, dst_width, dst_offset, width) each, two a launch."""
        for i in range(0, len(copies), 2):
            pair = copies[i:i + 2]
            second = pair[1] if len(pair) == 2 else (0, 0, 0, 0, 0, 0, 0)
            self.device.launch("copy_heads_f32", (n_rows,), 128, (*pair[0], *second))

    def latent_attention(self, q, kv, *, cache, layer: int, batch: Batch, n_heads: int, scale: float):
        (q_lat, q_rope), (c, k_rope) = q, kv
        dev, t, v_width = self.device, q_lat.rows, c.cols
        width = v_width + k_rope.cols
        if (q_lat.cols, q_rope.cols) != (n_heads * v_width, n_heads * k_rope.cols):
            raise ReflexError(f"internal error: latent attention's query parts of {q_lat.cols} and {q_rope.cols} are not "
                              f"{n_heads} heads of its row's {v_width} and {k_rope.cols}")
        if width > MLA_MAX_WIDTH:
            raise ReflexError(f"latent attention over rows of {width} (values {v_width}): the CUDA kernel takes rows of at "
                              f"most {MLA_MAX_WIDTH}")
        if layer == cache.shape.kv_layers[0]:  # every layer's pass has the same slots
            self._segments = self._upload_ints("segments", batch.segments)
            self._start = self._upload_ints("start", [batch.start])
        # attention.cu's kv_store writes the row [c ; k_rope], its two parts as k and v: the values are its first v_width
        dev.launch("kv_store", (t,), 256, (c.ptr, k_rope.ptr, cache.k[layer], cache.k[layer] + 2 * v_width, cache.segments,
                                           self._segments, self._start, t, v_width, k_rope.cols, width, width))
        out = self._new(t, n_heads * v_width)
        most_splits = _cuda_ops().ATTENTION_PARTIALS_BYTES // (4 * t * n_heads * (v_width + 2))
        if self._sm90 and width % 32 == 0 and v_width % MLA_MMA_DV == 0:
            prompt = t >= MLA_PREFILL_MIN_TOKENS
            rows, warps = (16 * MLA_PREFILL_WARPS, MLA_PREFILL_WARPS) if prompt else (16, MLA_DECODE_WARPS)
            splits = 1 if prompt else max(1, min(MLA_MAX_SPLITS, -(-cache.shape.capacity // MLA_DECODE_SPLIT_SLOTS), most_splits))
            kernel, shared = f"latent_attention_{'prefill' if prompt else 'decode'}", mla_mma_shared(rows, width)
            dev.allow_shared(kernel, shared)
            dev.launch(kernel, (-(-t * n_heads // rows), v_width // MLA_MMA_DV, splits), 32 * warps,
                       (q_lat.ptr, q_rope.ptr, cache.k[layer], cache.segments, self._segments, out.ptr, self._start, t,
                        n_heads, width, v_width, scale, self._partials), shared)
        else:
            splits = max(1, min(MLA_MAX_SPLITS, -(-cache.shape.capacity // MLA_SPLIT_SLOTS), most_splits))
            dev.launch("latent_attention", (t, n_heads, splits), MLA_THREADS,
                       (q_lat.ptr, q_rope.ptr, cache.k[layer], cache.segments, self._segments, out.ptr, self._start,
                        n_heads, width, v_width, scale, self._partials))
        if splits > 1:
            dev.launch("latent_attention_combine", (t, n_heads), 256, (self._partials, out.ptr, splits, v_width))
        return out


def mla_mma_shared(rows: int, width: int) -> int:
    """kernels/mla.cu latent_attend_mma's shared memory: its rows' Q and two stages of slots, rows of width + 8
    halves, and the stages' segments."""
    return (rows + 2 * MLA_MMA_SLOTS) * (width + 8) * 2 + 2 * MLA_MMA_SLOTS * 4


def _cuda_ops():
    from . import ops  # here, not at the top: ops.py imports this module

    return ops


def _kernel(name: str, weight) -> str:
    return f"{name}_{_cuda_ops().kernel_suffix(weight.ggml_type)}"
