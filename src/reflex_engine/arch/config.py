"""Hyperparameters read once from GGUF metadata, by meaning; arch code reads only these."""
from __future__ import annotations

import math

from typing import Any, Mapping, NamedTuple

from ..errors import ReflexError
from ..gguf import LazyArray
from ..ops import CacheShape, Gating, RecurrentShape, Rope, RopeMode, Routing


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
    # mixture of experts (read_moe); n_expert 0: every layer is a dense SwiGLU FFN
    n_expert: int = 0
    n_ff_exp: int = 0  # one expert's FFN width
    routing: Routing | None = None
    n_dense_layers: int = 0  # leading layers with a dense FFN before the MoE ones
    n_shared_experts: int = 0  # always-on experts beside the routed ones (one SwiGLU of n_ff_exp * n)
    # multi-head latent attention (deepseek2): head_dim is kv_lora_rank + rope dims, v_head_dim
    # kv_lora_rank, one KV head: the absorbed view, whose cache is the latent
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: q is one projection (V2-Lite)
    qk_nope_dim: int = 0  # per query head, the dims without RoPE
    v_head_mla: int = 0  # per head, the value width after W_vb
    scale: float = 0.0  # the attention scale where it is not 1/sqrt(head_dim)
    n_ff_shared: int = 0  # the shared expert's width where the file gives it (expert_shared_feed_forward_length)
    # Gated DeltaNet (read_ssm): these layers hold a recurrent state instead of attention
    recurrent_layers: tuple[int, ...] = ()
    ssm_conv_kernel: int = 0  # K
    ssm_k_dim: int = 0  # a key head's width (ssm.state_size)
    ssm_k_heads: int = 0  # ssm.group_count
    ssm_v_heads: int = 0  # ssm.time_step_rank
    ssm_v_dim: int = 0  # a value head's width: ssm.inner_size / ssm_v_heads
    ssm_tiled: bool = False  # value head h reads key head h % ssm_k_heads (qwen35's converter order), else h // r

    def is_moe(self, layer: int) -> bool:
        return self.n_expert > 0 and layer >= self.n_dense_layers

    def is_recurrent(self, layer: int) -> bool:
        return layer in self.recurrent_layers

    def cache_shape(self, capacity: int) -> CacheShape:
        k, v = self.n_kv_heads * self.head_dim, self.n_kv_heads * self.v_head_dim
        recurrent = RecurrentShape(self.recurrent_layers, self.ssm_conv_kernel - 1, self.ssm_channels, self.ssm_v_heads,
                                   self.ssm_k_dim, self.ssm_v_dim) if self.recurrent_layers else None
        return CacheShape(self.n_layers, capacity, k, v, latent=self.kv_lora_rank > 0, recurrent=recurrent)

    @property
    def ssm_k_width(self) -> int:
        return self.ssm_k_heads * self.ssm_k_dim

    @property
    def ssm_v_width(self) -> int:
        return self.ssm_v_heads * self.ssm_v_dim

    @property
    def ssm_channels(self) -> int:  # the conv runs over q, k and v of every head
        return 2 * self.ssm_k_width + self.ssm_v_width

    @property
    def ssm_qkvz_width(self) -> int:  # a legacy fused ssm_in: q, k, v and z
        return self.ssm_channels + self.ssm_v_width

    @property
    def attn_scale(self) -> float:
        return self.scale or self.head_dim**-0.5

    @property
    def qk_head_dim(self) -> int:  # MLA's query/key head before absorption
        return self.qk_nope_dim + self.rope.n_rot

    @property
    def n_ff_shexp(self) -> int:
        return self.n_ff_shared or self.n_ff_exp * self.n_shared_experts

    @property
    def rope_pairs(self) -> int:
        return self.rope.n_rot // 2

    @property
    def activation_width(self) -> int:
        """float32 values per token that a decoder layer may hold at once, generously: the
        residual stream and its norms, q/k/v before and after norm and RoPE, the FFN, logits."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * (self.head_dim + self.v_head_dim)
        # a prompt's grouped experts hold every (token, slot) pair's input, gate, up, product and output
        moe = 2 * self.n_expert + self.routing.n_used * (3 * self.n_ff_exp + 2 * self.n_embd) + self.n_embd if self.n_expert else 0
        ssm = 3 * self.ssm_channels + 4 * self.ssm_v_width + 6 * self.ssm_v_heads if self.recurrent_layers else 0
        return 6 * self.n_embd + 4 * q + 3 * kv + 2 * self.n_heads * self.v_head_dim + 3 * self.n_ff + self.n_vocab + moe + ssm


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


def read_config(metadata: Mapping[str, Any], arch: str, rope_mode: RopeMode, qk_norm: bool, yarn: bool = False) -> ArchConfig:
    meta = Meta(metadata, arch)
    n_embd = meta.get("embedding_length")
    n_heads = meta.get("attention.head_count")
    n_kv_heads = meta.get("attention.head_count_kv", n_heads)
    head_dim = meta.get("attention.key_length", n_embd // n_heads)
    if n_heads % n_kv_heads:
        raise ReflexError(f"{arch}: head_count {n_heads} is not a multiple of head_count_kv {n_kv_heads}")
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    freq_scale, yarn_fields = 1.0, {}
    if scaling == "linear" or (scaling == "yarn" and yarn):
        factor = meta.get("rope.scaling.factor", kind=float)
        if not factor > 0:
            raise ReflexError(f"{arch}: rope.scaling.factor must be positive, found {factor!r}")
        freq_scale = 1.0 / factor
    elif scaling not in ("none", None):
        raise ReflexError(f"{arch}: rope scaling {scaling!r} is not supported yet")
    if scaling == "yarn":  # cos/sin magnitude as llama.cpp's default: 1 + 0.1 ln(factor), times attn_factor
        magnitude = (1 + 0.1 * math.log(factor) if factor > 1 else 1.0) * meta.get("rope.scaling.attn_factor", 1.0, kind=float)
        yarn_fields = dict(ext_factor=1.0, n_ctx_orig=meta.get("rope.scaling.original_context_length"), magnitude=magnitude,
                           beta_fast=meta.get("rope.scaling.yarn_beta_fast", 32.0, kind=float),
                           beta_slow=meta.get("rope.scaling.yarn_beta_slow", 1.0, kind=float))
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
        rope=Rope(rope_mode, n_rot, meta.get("rope.freq_base", 10000.0, kind=float), freq_scale, **yarn_fields),
        n_vocab=meta.get("vocab_size", len(tokens) if tokens is not None else None),
        qk_norm=qk_norm,
    )


def read_moe(metadata: Mapping[str, Any], cfg: ArchConfig, *, norm: bool, gating: Gating = Gating.SOFTMAX,
             scale: float = 1.0, n_dense_layers: int = 0) -> ArchConfig:
    """cfg with the expert keys (`expert_count`, `expert_used_count`, `expert_feed_forward_length`,
    `expert_group_count`, `expert_group_used_count`), checked against each other."""
    meta = Meta(metadata, cfg.arch)
    n_expert, n_used = meta.get("expert_count"), meta.get("expert_used_count")
    n_groups = metadata.get(f"{cfg.arch}.expert_group_count") or 1  # 0 or absent: one group
    n_groups_used = metadata.get(f"{cfg.arch}.expert_group_used_count") or n_groups
    if n_used > n_expert:
        raise ReflexError(f"{cfg.arch}: expert_used_count {n_used} exceeds expert_count {n_expert}")
    if not (isinstance(n_groups, int) and isinstance(n_groups_used, int) and 0 < n_groups_used <= n_groups
            and n_expert % n_groups == 0 and n_used <= n_groups_used * (n_expert // n_groups)):
        raise ReflexError(f"{cfg.arch}: {n_expert} experts cannot be split into {n_groups!r} groups of which "
                          f"{n_groups_used!r} hold the {n_used} chosen")
    if n_dense_layers > cfg.n_layers:
        raise ReflexError(f"{cfg.arch}: {n_dense_layers} leading dense layers of {cfg.n_layers}")
    n_ff_exp = meta.get("expert_feed_forward_length", cfg.n_ff // n_used or None)  # llama.cpp's fallback
    routing = Routing(n_used, gating, norm, scale, n_groups, n_groups_used)
    return cfg._replace(n_expert=n_expert, n_ff_exp=n_ff_exp, routing=routing, n_dense_layers=n_dense_layers)


def read_ssm(metadata: Mapping[str, Any], cfg: ArchConfig, *, tiled: bool) -> ArchConfig:
    """cfg with the Gated DeltaNet keys (`ssm.*`) and the layer schedule: `attention.recurrent_layers`
    where the file has it, else every `full_attention_interval`-th layer is attention. Layers
    past block_count - nextn_predict_layers are MTP layers, which the main pass does not run."""
    meta = Meta(metadata, cfg.arch)
    n_layers = cfg.n_layers - (metadata.get(f"{cfg.arch}.nextn_predict_layers") or 0)
    k_heads, v_heads, inner = meta.get("ssm.group_count"), meta.get("ssm.time_step_rank"), meta.get("ssm.inner_size")
    if v_heads % k_heads or inner % v_heads or n_layers < 1:
        raise ReflexError(f"{cfg.arch}: ssm.inner_size {inner} over ssm.time_step_rank {v_heads} value heads and "
                          f"ssm.group_count {k_heads} key heads do not describe Gated DeltaNet heads")
    flags = metadata.get(f"{cfg.arch}.attention.recurrent_layers")
    if flags is None:
        interval = meta.get("full_attention_interval", 4)
        recurrent = tuple(i for i in range(n_layers) if (i + 1) % interval)
    else:
        flags = list(flags) if isinstance(flags, LazyArray) else flags
        if not isinstance(flags, list) or len(flags) < n_layers or not all(isinstance(f, bool) for f in flags):
            raise ReflexError(f"{cfg.arch}: attention.recurrent_layers must be {n_layers} booleans, found {flags!r}")
        recurrent = tuple(i for i in range(n_layers) if flags[i])
    return cfg._replace(n_layers=n_layers, recurrent_layers=recurrent, ssm_conv_kernel=meta.get("ssm.conv_kernel"),
                        ssm_k_dim=meta.get("ssm.state_size"), ssm_k_heads=k_heads, ssm_v_heads=v_heads,
                        ssm_v_dim=inner // v_heads, ssm_tiled=tiled)
