"""Hyperparameters read once from GGUF metadata, by meaning; arch code reads only these."""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from ..errors import ReflexError
from ..gguf import LazyArray
from ..ops import Rope, RopeMode


class ArchConfig(NamedTuple):
    arch: str
    n_layers: int
    n_embd: int
    n_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # key/query head width
    v_head_dim: int
    n_ctx_train: int
    rms_eps: float
    rope: Rope
    n_vocab: int
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (qwen3)

    @property
    def attn_scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def rope_pairs(self) -> int:
        return self.rope.n_rot // 2

    @property
    def activation_width(self) -> int:
        """float32 values per token that a decoder layer may hold at once, generously: the
        residual stream and its norms, q/k/v before and after norm and RoPE, the FFN, logits."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * (self.head_dim + self.v_head_dim)
        return 6 * self.n_embd + 4 * q + 3 * kv + 2 * self.n_heads * self.v_head_dim + 3 * self.n_ff + self.n_vocab


class Meta:
    """Typed access to `<arch>.*` keys with errors that name the key."""

    def __init__(self, metadata: Mapping[str, Any], arch: str):
        self.metadata = metadata
        self.arch = arch

    def get(self, key: str, default=None, kind=int):
        full = f"{self.arch}.{key}"
        value = self.metadata.get(full, default)
        if value is None:
            raise ReflexError(f"GGUF metadata key {full!r} is missing")
        if isinstance(value, LazyArray):
            raise ReflexError(f"GGUF metadata key {full!r}: per-layer arrays are not supported yet")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ReflexError(f"GGUF metadata key {full!r} must be a positive integer, found {value!r}")
        if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float)) or value != value):
            raise ReflexError(f"GGUF metadata key {full!r} must be a number, found {value!r}")
        return kind(value)


def read_config(metadata: Mapping[str, Any], arch: str, rope_mode: RopeMode, qk_norm: bool) -> ArchConfig:
    meta = Meta(metadata, arch)
    n_embd = meta.get("embedding_length")
    n_heads = meta.get("attention.head_count")
    n_kv_heads = meta.get("attention.head_count_kv", n_heads)
    head_dim = meta.get("attention.key_length", n_embd // n_heads)
    if n_heads % n_kv_heads:
        raise ReflexError(f"{arch}: head_count {n_heads} is not a multiple of head_count_kv {n_kv_heads}")
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    freq_scale = 1.0
    if scaling == "linear":
        freq_scale = 1.0 / meta.get("rope.scaling.factor", kind=float)
    elif scaling not in ("none", None):
        raise ReflexError(f"{arch}: rope scaling {scaling!r} is not supported yet")
    n_rot = meta.get("rope.dimension_count", head_dim)
    if n_rot > head_dim or n_rot % 2:
        raise ReflexError(f"{arch}: rope.dimension_count {n_rot} must be even and at most the head width {head_dim}")
    tokens = metadata.get("tokenizer.ggml.tokens")
    return ArchConfig(
        arch=arch,
        n_layers=meta.get("block_count"),
        n_embd=n_embd,
        n_ff=meta.get("feed_forward_length"),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        v_head_dim=meta.get("attention.value_length", head_dim),
        n_ctx_train=meta.get("context_length"),
        rms_eps=meta.get("attention.layer_norm_rms_epsilon", kind=float),
        rope=Rope(rope_mode, n_rot, meta.get("rope.freq_base", 10000.0, kind=float), freq_scale),
        n_vocab=meta.get("vocab_size", len(tokens) if tokens is not None else None),
        qk_norm=qk_norm,
    )
