"""CudaOps's Gated DeltaNet ops (kernels/delta_net.cu): the recurrent layers of qwen35 and qwen3next.

A recurrent layer's state lives in the KV cache's region: the conv's last K-1 inputs (K-1, C) and the
delta rule's S (H, dk, dv), float32, every layer's one after the other and a checkpoint copy of them
all behind (system1). One token goes through the recurrence (delta_rule_step, what a decode graph
replays); longer batches through the chunked form, whose state-free part runs for every chunk at
once (delta_rule_chunk_prep) before one scan carries the state through the chunks.
"""
from __future__ import annotations

from typing import NamedTuple

from ...errors import ReflexError
from ...gguf import GGMLType
from ...ops import Batch, RecurrentShape
from .memory import head_runs

CONV_MAX_TAPS, DELTA_MAX_DK, CHUNK, SCAN_COLUMNS, PREP_THREADS = 8, 128, 64, 8, 512  # kernels/delta_net.cu


class RecurrentState(NamedTuple):
    """Device addresses of the recurrent layers' states: layer -> conv (K-1, C), layer -> S (H, dk, dv)."""

    conv: dict[int, int]
    ssm: dict[int, int]
    base: int  # every state, contiguous from here
    nbytes: int
    checkpoint: int  # a copy of those bytes (checkpoint_state, rewind_state)


def chunk_scratch_bytes(r: RecurrentShape, max_batch: int) -> int:
    """delta_rule_chunk_prep's W, U, QK and cumulative decays for a batch of max_batch tokens."""
    return 4 * r.n_v_heads * max_batch * (r.k_dim + r.v_dim + CHUNK + 1)


def check_shape(r: RecurrentShape) -> None:
    if r.k_dim > DELTA_MAX_DK or r.conv_rows + 1 > CONV_MAX_TAPS:
        raise ReflexError(f"Gated DeltaNet with key heads of {r.k_dim} and a conv of {r.conv_rows + 1} taps: the CUDA "
                          f"kernels take at most {DELTA_MAX_DK} and {CONV_MAX_TAPS}")


def carve_states(region, r: RecurrentShape) -> RecurrentState:
    base = region.carve(2 * r.nbytes)
    conv, ssm, at = {}, {}, base
    for i in r.layers:
        conv[i], at = at, at + 4 * r.conv_rows * r.channels
        ssm[i], at = at, at + 4 * r.n_v_heads * r.k_dim * r.v_dim
    return RecurrentState(conv, ssm, base, r.nbytes, base + r.nbytes)


class DeltaNetOps:
    """Mixed into CudaOps: uses its device, activation pools (_new), weight readiness (_ready) and
    the chunked form's scratch (_chunk_scratch, carved by reserve)."""

    def sigmoid_gate(self, x, gate):
        out, n = self._new(x.rows, x.cols), x.rows * x.cols
        if gate.cols == 1:  # one gate a token
            address, run, stride, step = gate.ptr, x.cols, 1, 0
        else:  # a split's part where it lies, or a tensor as it is
            (address, run, stride), step = head_runs(gate), 1
        self.device.launch("sigmoid_gate_f32", (-(-n // 256),), 256, (x.ptr, address, out.ptr, n, run, stride, step))
        return out

    def l2_norm(self, x, head_dim: int, eps: float):
        out = self._new(x.rows, x.cols)
        self.device.launch("norm_f32", (x.rows * x.cols // head_dim,), 32 * -(-min(head_dim, 1024) // 32),
                           (x.ptr, 0, out.ptr, head_dim, eps, 0, 0))
        return out

    def causal_conv1d(self, x, weight, *, cache, layer: int, batch: Batch):
        taps, channels = weight.shape
        if weight.ggml_type not in (GGMLType.F32, GGMLType.F16):
            raise ReflexError(f"a Gated DeltaNet conv weight of type {weight.ggml_type.name}: the CUDA kernel reads F32 or F16")
        out = self._new(x.rows, x.cols)
        warps = min(8, x.rows)  # a warp a token: a decode step's block is its one warp
        self.device.launch("causal_conv1d_f32", (-(-channels // 32), -(-x.rows // warps)), 32 * warps,
                           (x.ptr, self._ready(weight), cache.recurrent.conv[layer], out.ptr, x.rows, channels, taps,
                            weight.ggml_type == GGMLType.F16, batch.start == 0))
        return out

    def gdn_gates(self, alpha, beta, *, dt_bias, ssm_a):
        g, b, n = self._new(alpha.rows, alpha.cols), self._new(beta.rows, beta.cols), alpha.rows * alpha.cols
        self.device.launch("gdn_gates_f32", (-(-n // 256),), 256,
                           (alpha.ptr, beta.ptr, self._ready(dt_bias), self._ready(ssm_a), g.ptr, b.ptr, n, alpha.cols))
        return g, b

    def delta_rule(self, q, k, v, g, beta, *, cache, layer: int, batch: Batch, tiled: bool, scale: float):
        r = cache.shape.recurrent
        t, h, dk, dv = q.rows, r.n_v_heads, r.k_dim, r.v_dim
        out, dev = self._new(t, h * dv), self.device
        heads = (h, q.cols // dk, dk, dv, tiled, scale)
        state, fresh = cache.recurrent.ssm[layer], batch.start == 0
        if t == 1:
            dev.launch("delta_rule_step", (h, -(-dv // 32)), 256,
                       (q.ptr, k.ptr, v.ptr, g.ptr, beta.ptr, state, out.ptr) + heads + (fresh,))
            return out
        w = self._chunk_scratch
        u, qk, cum = w + 4 * h * t * dk, w + 4 * h * t * (dk + dv), w + 4 * h * t * (dk + dv + CHUNK)
        keys = 4 * CHUNK * (dk + 1)  # the chunk's keys in shared memory
        dev.allow_shared("delta_rule_chunk_prep", keys)
        dev.launch("delta_rule_chunk_prep", (-(-t // CHUNK), h), PREP_THREADS,
                   (q.ptr, k.ptr, v.ptr, g.ptr, beta.ptr, w, u, qk, cum, t) + heads + (CHUNK,), keys)
        dev.launch("delta_rule_chunk_scan", (h, -(-dv // SCAN_COLUMNS)), 256,
                   (q.ptr, k.ptr, w, u, qk, cum, state, out.ptr, t) + heads + (CHUNK, fresh))
        return out

    def checkpoint_state(self, cache) -> None:
        s = cache.recurrent
        self.device.drv.cuMemcpyDtoDAsync_v2(s.checkpoint, s.base, s.nbytes, self.device.stream)

    def rewind_state(self, cache) -> None:
        s = cache.recurrent
        self.device.drv.cuMemcpyDtoDAsync_v2(s.base, s.checkpoint, s.nbytes, self.device.stream)
