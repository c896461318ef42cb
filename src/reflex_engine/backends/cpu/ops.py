"""Ops on numpy float32 arrays. Weights are dequantized once, at load, by the quants module."""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np

from ...ops import Batch, CacheShape, Gating, Rope, RopeMode, Routes, Routing, StateArray
from ...quants import dequantize
from . import delta_rule
from .sampler import LastRowSampler, log_softmax


class KVCache(NamedTuple):
    k: list[np.ndarray | None]  # per layer (capacity, Hkv*dk); latent: (capacity, k_width); recurrent: None
    v: list[np.ndarray | None]  # per layer (capacity, Hkv*dv); latent: none, the values are k[:, :v_width]
    segments: np.ndarray  # (capacity,) segment of each written slot
    latent: bool = False
    # recurrent layers (Gated DeltaNet): by layer, the conv state (K-1, C) and S (H, dk, dv)
    conv: dict[int, np.ndarray] | None = None
    ssm: dict[int, np.ndarray] | None = None
    checkpoint: dict[str, np.ndarray] | None = None  # checkpoint_state's copies


def _yarn_ramp(rope: Rope) -> np.ndarray:
    """ggml's rope_yarn_corr_dims and rope_yarn_ramp: per pair, 1 for the high frequencies
    (kept), 0 for the low ones (interpolated), linear between."""
    def corr_dim(beta: float) -> float:
        return rope.n_rot * math.log(rope.n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(rope.base))

    low = max(0.0, math.floor(corr_dim(rope.beta_fast)))
    high = min(rope.n_rot - 1.0, math.ceil(corr_dim(rope.beta_slow)))
    y = (np.arange(rope.n_rot // 2, dtype=np.float64) - low) / max(0.001, high - low)
    return 1 - np.clip(y, 0, 1)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) -> inf gives 0, as it should
        return np.float32(1) / (np.float32(1) + np.exp(-x))


def _top(scores: np.ndarray, k: int) -> np.ndarray:
    """Column indices of each row's k largest scores, largest first; ties: the lower index."""
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


class CpuOps:
    name = "cpu"
    description = "numpy"
    max_batch = 1 << 30  # no limit: numpy allocates per op

    def reserve(self, tensors, cache: CacheShape, activation_width: int) -> None:
        pass  # host memory: the weights are dequantized lazily by numpy, no up-front budget

    def load_weight(self, name, ggml_type, shape, data) -> np.ndarray:
        return dequantize(data, ggml_type, tuple(reversed(shape)))  # numpy order: (out, in)

    def commit_weights(self) -> int:
        return 0  # load_weight already holds every weight

    def weights_arrived(self) -> None:
        return None

    def replayable(self, forward):
        return forward  # numpy has no launches to save

    def new_kv_cache(self, shape: CacheShape) -> KVCache:
        # np.zeros maps untouched pages lazily: a long context costs memory only where written
        kv, r = shape.kv_layers, shape.recurrent
        return KVCache(
            k=[np.zeros((shape.capacity, shape.k_width), np.float32) if i in kv else None for i in range(shape.n_layers)],
            v=[] if shape.latent else [np.zeros((shape.capacity, shape.v_width), np.float32) if i in kv else None
                                       for i in range(shape.n_layers)],
            segments=np.zeros(shape.capacity, np.int32),
            latent=shape.latent,
            conv={i: np.zeros((r.conv_rows, r.channels), np.float32) for i in r.layers} if r else {},
            ssm={i: np.zeros((r.n_v_heads, r.k_dim, r.v_dim), np.float32) for i in r.layers} if r else {},
            checkpoint={},
        )

    def embed(self, table: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
        return table[np.asarray(tokens, dtype=np.int64)]

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        groups = x.reshape(x.shape[0], x.shape[1] // weight.shape[0], weight.shape[0])  # also for 0 rows
        mean_sq = np.mean(groups * groups, axis=-1, keepdims=True)
        return (groups / np.sqrt(mean_sq + np.float32(eps)) * weight).reshape(x.shape)

    def matmul(self, x: np.ndarray, weight: np.ndarray, add: np.ndarray | None = None) -> np.ndarray:
        y = x @ weight.T
        return y if add is None else add + y

    def matmuls(self, x: np.ndarray, weights) -> list[np.ndarray]:
        return [self.matmul(x, w) for w in weights]

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):  # exp(-gate) -> inf gives silu -> -0, as it should
            return gate / (np.float32(1) + np.exp(-gate)) * up

    def ropes(self, xs, positions: Sequence[int], head_dim: int, rope: Rope, freq_factors=None, norms=None) -> list[np.ndarray]:
        return [self.rope(x, positions, head_dim, rope, freq_factors, n) for x, n in zip(xs, norms or (None,) * len(xs))]

    def rope(self, x: np.ndarray, positions: Sequence[int], head_dim: int, rope: Rope,
             freq_factors: np.ndarray | None = None, norm: tuple[np.ndarray, float] | None = None) -> np.ndarray:
        if norm is not None:
            x = self.rms_norm(x, *norm)
        heads = x.reshape(x.shape[0], -1, head_dim).copy()
        half = rope.n_rot // 2
        inv_freq = rope.base ** (-np.arange(half, dtype=np.float64) * 2.0 / rope.n_rot)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors
        angle = np.asarray(positions, dtype=np.float64)[:, None] * rope.freq_scale * inv_freq  # (T, n_rot/2)
        if rope.ext_factor:
            extrap = angle / rope.freq_scale
            mix = _yarn_ramp(rope)[None, :] * rope.ext_factor  # (1, n_rot/2): 1 keeps the original angle
            angle = angle * (1 - mix) + extrap * mix
        cos = (np.cos(angle) * rope.magnitude).astype(np.float32)[:, None, :]
        sin = (np.sin(angle) * rope.magnitude).astype(np.float32)[:, None, :]
        if rope.mode is RopeMode.NORM:
            a, b = heads[..., 0 : rope.n_rot : 2], heads[..., 1 : rope.n_rot : 2]
            heads[..., 0 : rope.n_rot : 2], heads[..., 1 : rope.n_rot : 2] = a * cos - b * sin, a * sin + b * cos
        else:
            a, b = heads[..., :half], heads[..., half : rope.n_rot]
            heads[..., :half], heads[..., half : rope.n_rot] = a * cos - b * sin, a * sin + b * cos
        return heads.reshape(x.shape)

    def attention(self, q, k, v, *, cache: KVCache, layer: int, batch: Batch, n_heads: int, n_kv_heads: int, scale: float):
        t, start = q.shape[0], batch.start
        end = start + t
        cache.k[layer][start:end] = k
        cache.v[layer][start:end] = v
        cache.segments[start:end] = batch.segments
        dk, dv = k.shape[1] // n_kv_heads, v.shape[1] // n_kv_heads
        group = n_heads // n_kv_heads
        keys = cache.k[layer][:end].reshape(end, n_kv_heads, dk).transpose(1, 2, 0)  # (Hkv, dk, S)
        values = cache.v[layer][:end].reshape(end, n_kv_heads, dv).transpose(1, 0, 2)  # (Hkv, S, dv)
        queries = q.reshape(t, n_kv_heads, group, dk).transpose(1, 2, 0, 3)  # (Hkv, g, T, dk)
        scores = (queries @ keys[:, None]) * np.float32(scale)  # (Hkv, g, T, S)
        scores += self._mask(cache.segments[:end], np.asarray(batch.segments), start)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out = probs @ values[:, None]  # (Hkv, g, T, dv)
        return out.transpose(2, 0, 1, 3).reshape(t, n_heads * dv)

    def split(self, x: np.ndarray, n_heads: int, widths) -> tuple[np.ndarray, ...]:
        heads = x.reshape(x.shape[0], n_heads, -1)
        ends = np.cumsum(widths)
        return tuple(np.ascontiguousarray(heads[..., e - w : e]).reshape(x.shape[0], n_heads * w) for w, e in zip(widths, ends))

    def concat(self, parts, n_heads: int) -> np.ndarray:
        t = parts[0].shape[0]
        return np.concatenate([p.reshape(t, n_heads, -1) for p in parts], axis=-1).reshape(t, -1)

    def head_matmul(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        h, out, inner = weight.shape
        heads = x.reshape(x.shape[0], h, inner).transpose(1, 0, 2)  # (H, T, in)
        return (heads @ weight.transpose(0, 2, 1)).transpose(1, 0, 2).reshape(x.shape[0], h * out)

    def latent_attention(self, q, kv, *, cache: KVCache, layer: int, batch: Batch, n_heads: int, scale: float):
        q, v_width = self.concat(q, n_heads), kv[0].shape[1]
        t, start = q.shape[0], batch.start
        end = start + t
        cache.k[layer][start:end] = self.concat(kv, 1)
        cache.segments[start:end] = batch.segments
        rows = cache.k[layer][:end]  # (S, k_width): every head's keys; values are their first v_width
        scores = (q.reshape(t, n_heads, -1).transpose(1, 0, 2) @ rows.T) * np.float32(scale)  # (H, T, S)
        scores += self._mask(cache.segments[:end], np.asarray(batch.segments), start)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        return (probs @ rows[:, :v_width]).transpose(1, 0, 2).reshape(t, n_heads * v_width)

    @staticmethod
    def _mask(slot_segments: np.ndarray, query_segments: np.ndarray, start: int) -> np.ndarray:
        """(T, S) additive mask: 0 where query i may read slot j, -inf elsewhere (see Batch)."""
        slots = np.arange(slot_segments.shape[0])
        query_slots = start + np.arange(query_segments.shape[0])
        visible = (slots[None, :] <= query_slots[:, None]) & (
            (slot_segments[None, :] == 0) | (slot_segments[None, :] == query_segments[:, None])
        )
        return np.where(visible, np.float32(0), np.float32(-np.inf))

    def route(self, logits: np.ndarray, routing: Routing, bias: np.ndarray | None = None) -> Routes:
        t, n_expert = logits.shape
        if routing.gating is Gating.SOFTMAX:
            e = np.exp(logits - logits.max(axis=-1, keepdims=True))
            probs = e / e.sum(axis=-1, keepdims=True)
        else:
            with np.errstate(over="ignore"):
                probs = np.float32(1) / (np.float32(1) + np.exp(-logits))
        scores = probs if bias is None else probs + bias
        if routing.n_groups > 1:
            groups = scores.reshape(t, routing.n_groups, n_expert // routing.n_groups)
            group_score = -np.sort(-groups, axis=-1)[..., :2].sum(-1)  # (T, n_groups): top-2 sum
            kept = _top(group_score, routing.n_groups_used)
            mask = np.full(group_score.shape, True)
            np.put_along_axis(mask, kept, False, axis=-1)
            scores = np.where(mask[..., None], np.float32(-np.inf), groups).reshape(t, n_expert)
        experts = _top(scores, routing.n_used)  # (T, k)
        weights = np.take_along_axis(probs, experts, axis=-1)
        if routing.norm:
            weights = weights / np.maximum(weights.sum(-1, keepdims=True), np.float32(6.103515625e-5))
        if routing.scale not in (0.0, 1.0):
            weights = weights * np.float32(routing.scale)
        return Routes(experts, weights.astype(np.float32))

    def moe_ffn(self, x: np.ndarray, routes: Routes, *, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                add: np.ndarray | None = None) -> np.ndarray:
        out = np.zeros_like(x)
        for e in np.unique(routes.experts):  # each chosen expert once, over the tokens that chose it
            rows, slot = np.nonzero(routes.experts == e)
            h = self.swiglu(x[rows] @ gate[e].T, x[rows] @ up[e].T) @ down[e].T  # (n, E)
            np.add.at(out, rows, h * routes.weights[rows, slot][:, None])
        return out if add is None else add + out

    # -- Gated DeltaNet ---------------------------------------------------------------------------

    def sigmoid_gate(self, x: np.ndarray, gate: np.ndarray) -> np.ndarray:
        return x * _sigmoid(gate)

    def l2_norm(self, x: np.ndarray, head_dim: int, eps: float) -> np.ndarray:
        heads = x.reshape(x.shape[0], -1, head_dim)
        return (heads / np.sqrt(np.sum(heads * heads, axis=-1, keepdims=True) + np.float32(eps))).reshape(x.shape)

    def causal_conv1d(self, x: np.ndarray, weight: np.ndarray, *, cache: KVCache, layer: int, batch: Batch) -> np.ndarray:
        state = cache.conv[layer]
        if batch.start == 0:
            state[:] = 0
        inputs = np.concatenate([state, x])  # (K-1+T, C): row j + K-1 is token j
        t, taps = x.shape[0], weight.shape[1]
        y = sum(inputs[j : j + t] * weight[:, j] for j in range(taps))
        state[:] = inputs[t:]
        return y * _sigmoid(y)  # SiLU

    def gdn_gates(self, alpha: np.ndarray, beta: np.ndarray, *, dt_bias: np.ndarray, ssm_a: np.ndarray):
        g = ssm_a * np.logaddexp(np.float32(0), alpha + dt_bias)  # softplus without overflow
        return g.astype(np.float32), _sigmoid(beta)

    def delta_rule(self, q, k, v, g, beta, *, cache: KVCache, layer: int, batch: Batch, tiled: bool, scale: float):
        state = cache.ssm[layer]
        if batch.start == 0:
            state[:] = 0
        t, (h, dk, dv) = q.shape[0], state.shape
        k_heads = q.shape[1] // dk
        of = np.arange(h) % k_heads if tiled else np.arange(h) // (h // k_heads)  # each value head's key head

        def heads(x, d, index=None):  # (T, n*d) -> (H, T, d)
            x = x.reshape(t, -1, d)
            return np.ascontiguousarray((x if index is None else x[:, index]).transpose(1, 0, 2))

        args = (heads(q * np.float32(scale), dk, of), heads(k, dk, of), heads(v, dv), np.ascontiguousarray(g.T),
                np.ascontiguousarray(beta.T), state)
        out, state[:] = delta_rule.recurrent(*args) if t == 1 else delta_rule.chunked(*args)
        return out.transpose(1, 0, 2).reshape(t, h * dv)

    def checkpoint_state(self, cache: KVCache) -> None:
        cache.checkpoint.update({f"conv{i}": c.copy() for i, c in cache.conv.items()})
        cache.checkpoint.update({f"ssm{i}": s.copy() for i, s in cache.ssm.items()})

    def rewind_state(self, cache: KVCache) -> None:
        for i in cache.conv:
            cache.conv[i][:] = cache.checkpoint[f"conv{i}"]
            cache.ssm[i][:] = cache.checkpoint[f"ssm{i}"]

    def take_rows(self, x: np.ndarray, rows: Sequence[int]) -> np.ndarray:
        return x[np.asarray(rows, dtype=np.int64)]

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x, dtype=np.float32)

    def new_sampler(self, params):
        return LastRowSampler(params)

    def token_logprobs(self, logits: np.ndarray, pairs) -> list[float]:
        rows = sorted({r for r, _ in pairs})
        table = dict(zip(rows, log_softmax(logits[rows])))
        return [float(table[r][t]) for r, t in pairs]

    def top_logprobs(self, logits: np.ndarray, row: int, k: int) -> list[tuple[int, float]]:
        ids = np.argsort(-logits[row], kind="stable")[:k]
        logprobs = log_softmax(logits[row])
        return [(int(t), float(logprobs[t])) for t in ids]

    # -- KV state files (kvstate.py) -------------------------------------------------------------

    @staticmethod
    def _layer_arrays(cache: KVCache, n_tokens: int):
        """(name, the cache's array for it) in kvstate.cache_layout's order: per-token ones cut to n_tokens."""
        for i in range(len(cache.k)):
            if i in cache.ssm:
                yield f"blk.{i}.conv", cache.conv[i]
                yield f"blk.{i}.ssm", cache.ssm[i]
            elif cache.latent:
                yield f"blk.{i}.kv", cache.k[i][:n_tokens]
            else:
                yield f"blk.{i}.k", cache.k[i][:n_tokens]
                yield f"blk.{i}.v", cache.v[i][:n_tokens]

    def export_cache(self, cache: KVCache, n_tokens: int):
        for name, a in self._layer_arrays(cache, n_tokens):
            yield StateArray(name, "f32", a.shape, a)

    def import_cache(self, cache: KVCache, arrays, n_tokens: int) -> None:
        for name, dest in self._layer_arrays(cache, n_tokens):
            a = arrays[name]
            dest[...] = np.frombuffer(a.data, "<f4" if a.dtype == "f32" else "<f2").reshape(a.shape)
        cache.segments[:n_tokens] = 0
