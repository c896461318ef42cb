"""DeepSeek-V2, V2-Lite and V3-style models, after transformers' modeling_deepseek_v2/_v3 and
llama.cpp's src/models/deepseek2.cpp (the GGUFs its converter writes, with attn_k_b / attn_v_b).

Multi-head latent attention (MLA) in its absorbed form: a token's keys and values are one latent
c = RMSNorm(W_kv_a x) of kv_lora_rank values plus a RoPE part k_pe shared by every head; the
cache holds [c ; k_pe] only. Head h's query [W_kb,h^T q_nope,h ; q_pe,h] scores it directly, its
output o'_h = softmax(.) c is lifted by W_vb,h; this equals the naive MHA form exactly.
RoPE is NORM on the rope part, with YaRN where the file says; the scale is
mscale^2 / sqrt(qk_nope + qk_rope). Leading dense layers, then MoE layers: routed experts
(softmax V2, sigmoid with a selection bias V3, group-limited top-k, optional renormalisation and
routed scaling, all per the metadata) plus always-on shared experts.
Legacy files with an unsplit attn_kv_b are not read yet.
"""
import math

from ..errors import ReflexError
from ..ops import Gating, RopeMode
from .blocks import MODEL_TENSORS, decoder_forward, linear, moe_ffn, swiglu_ffn, swiglu_mlp
from .config import Meta, read_config, read_moe
from .weights import TensorDecl

ARCH = "deepseek2"
BACKENDS = ("cpu", "cuda")
TENSORS = MODEL_TENSORS


def _q_lora(cfg, i):
    return cfg.q_lora_rank > 0


def _dense(cfg, i):
    return not cfg.is_moe(i)


def _moe(cfg, i):
    return cfg.is_moe(i)


def _shared(cfg, i):
    return cfg.is_moe(i) and cfg.n_shared_experts > 0


LAYER_TENSORS = [
    TensorDecl("attn_norm", ("n_embd",)),
    TensorDecl("attn_q_a", ("n_embd", "q_lora_rank"), when=_q_lora),
    TensorDecl("attn_q_a_norm", ("q_lora_rank",), when=_q_lora),
    TensorDecl("attn_q_b", ("q_lora_rank", "n_heads*qk_head_dim"), when=_q_lora),
    TensorDecl("attn_q", ("n_embd", "n_heads*qk_head_dim"), when=lambda cfg, i: not _q_lora(cfg, i)),
    TensorDecl("attn_kv_a_mqa", ("n_embd", "head_dim")),  # [c ; k_pe]: kv_lora_rank + rope dims
    TensorDecl("attn_kv_a_norm", ("kv_lora_rank",)),
    TensorDecl("attn_k_b", ("qk_nope_dim", "kv_lora_rank", "n_heads")),  # W_kb^T per head
    TensorDecl("attn_v_b", ("kv_lora_rank", "v_head_mla", "n_heads")),
    TensorDecl("attn_output", ("n_heads*v_head_mla", "n_embd")),
    TensorDecl("ffn_norm", ("n_embd",)),
    TensorDecl("ffn_gate", ("n_embd", "n_ff"), when=_dense),
    TensorDecl("ffn_up", ("n_embd", "n_ff"), when=_dense),
    TensorDecl("ffn_down", ("n_ff", "n_embd"), when=_dense),
    TensorDecl("ffn_gate_inp", ("n_embd", "n_expert"), when=_moe),
    TensorDecl("exp_probs_b", ("n_expert",), optional=True, suffix="bias", when=_moe),  # V3's selection bias
    TensorDecl("ffn_gate_exps", ("n_embd", "n_ff_exp", "n_expert"), when=_moe),
    TensorDecl("ffn_up_exps", ("n_embd", "n_ff_exp", "n_expert"), when=_moe),
    TensorDecl("ffn_down_exps", ("n_ff_exp", "n_embd", "n_expert"), when=_moe),
    TensorDecl("ffn_gate_shexp", ("n_embd", "n_ff_shexp"), when=_shared),
    TensorDecl("ffn_up_shexp", ("n_embd", "n_ff_shexp"), when=_shared),
    TensorDecl("ffn_down_shexp", ("n_ff_shexp", "n_embd"), when=_shared),
]


def mla_attention(ops, w, lw, cfg, cache, layer, batch, x, residual):
    n_rot = cfg.rope.n_rot
    if cfg.q_lora_rank:
        q = linear(ops, ops.rms_norm(linear(ops, x, lw.attn_q_a), lw.attn_q_a_norm, cfg.rms_eps), lw.attn_q_b)
    else:
        q = linear(ops, x, lw.attn_q)  # (T, H*(nope+rope))
    q_nope, q_pe = ops.split(q, cfg.n_heads, (cfg.qk_nope_dim, n_rot))
    c, k_pe = ops.split(linear(ops, x, lw.attn_kv_a_mqa), 1, (cfg.kv_lora_rank, n_rot))  # (T, kv_lora), (T, rope)
    c = ops.rms_norm(c, lw.attn_kv_a_norm, cfg.rms_eps)
    q_pe, k_pe = ops.ropes((q_pe, k_pe), batch.positions, n_rot, cfg.rope, freq_factors=w.rope_freqs)
    q_latent = (ops.head_matmul(q_nope, lw.attn_k_b), q_pe)  # per head [W_kb,h^T q_nope,h ; q_pe,h]: (T, H*kv_lora), (T, H*rope)
    o_latent = ops.latent_attention(q_latent, (c, k_pe), cache=cache, layer=layer, batch=batch, n_heads=cfg.n_heads,
                                    scale=cfg.attn_scale)  # (T, H*kv_lora)
    return linear(ops, ops.head_matmul(o_latent, lw.attn_v_b), lw.attn_output, add=residual)  # via (T, H*v_head)


def feed_forward(ops, lw, cfg, layer, x, residual):
    if not cfg.is_moe(layer):
        return swiglu_ffn(ops, lw, x, residual)
    if not cfg.n_shared_experts:
        return moe_ffn(ops, lw, cfg, x, bias=lw.exp_probs_b, residual=residual)
    # residual + routed experts + shared experts, the sums in the experts' and the shared down's own launches
    routed = moe_ffn(ops, lw, cfg, x, bias=lw.exp_probs_b, residual=residual)
    return swiglu_mlp(ops, x, lw.ffn_gate_shexp, lw.ffn_up_shexp, lw.ffn_down_shexp, residual=routed)


def forward(ops, w, cfg, cache, batch, out_rows):
    return decoder_forward(ops, w, cfg, cache, batch, out_rows, attention=mla_attention, feed_forward=feed_forward)


def config(metadata):
    cfg = read_config(metadata, ARCH, RopeMode.NORM, qk_norm=False, yarn=True)
    meta = Meta(metadata, ARCH)
    kv_lora, n_rot = meta.get("attention.kv_lora_rank"), cfg.rope.n_rot
    q_lora = metadata.get(f"{ARCH}.attention.q_lora_rank") or 0  # absent: one q projection (V2-Lite)
    if f"{ARCH}.attention.key_length_mla" not in metadata:
        raise ReflexError(f"{ARCH}: a GGUF without attention.key_length_mla (an unsplit attn_kv_b) is not supported yet")
    k_mla, v_mla = meta.get("attention.key_length_mla"), meta.get("attention.value_length_mla")
    if (cfg.n_kv_heads, cfg.head_dim, cfg.v_head_dim) != (1, kv_lora + n_rot, kv_lora) or k_mla <= n_rot \
            or not isinstance(q_lora, int) or q_lora < 0:
        raise ReflexError(f"{ARCH}: head_count_kv {cfg.n_kv_heads}, key_length {cfg.head_dim}, value_length "
                          f"{cfg.v_head_dim}, key_length_mla {k_mla} and q_lora_rank {q_lora!r} do not describe "
                          f"MLA over a latent of {kv_lora} + {n_rot} RoPE dims")
    # llama.cpp: the cos/sin magnitude is attn_factor (its mscale = mscale_all_dim assumption), and
    # the scale takes mscale^2 with mscale = attn_factor * (1 + 0.1 * mscale_all_dim * ln factor)
    mscale, rope = 1.0, cfg.rope
    if rope.ext_factor:
        factor = 1 / rope.freq_scale
        log_mul = meta.get("rope.scaling.yarn_log_multiplier", 0.0, kind=float) / 0.1  # the converter wrote 0.1 x
        attn_factor = meta.get("rope.scaling.attn_factor", 1.0, kind=float)
        magnitude = attn_factor * (1.0 if log_mul or factor <= 1 else 1 + 0.1 * math.log(factor))
        mscale = magnitude * (1 + 0.1 * log_mul * math.log(factor) if factor > 1 else 1.0)
        rope = rope._replace(magnitude=magnitude)
    gating = metadata.get(f"{ARCH}.expert_gating_func") or Gating.SOFTMAX.value  # absent: softmax (V2)
    if gating not in [g.value for g in Gating]:
        raise ReflexError(f"{ARCH}: expert_gating_func {gating!r} is not supported (1 softmax, 2 sigmoid)")
    n_dense = metadata.get(f"{ARCH}.leading_dense_block_count") or 0
    cfg = read_moe(metadata, cfg, norm=bool(metadata.get(f"{ARCH}.expert_weights_norm", False)), gating=Gating(gating),
                   scale=meta.get("expert_weights_scale", 0.0, kind=float), n_dense_layers=n_dense)
    return cfg._replace(rope=rope, kv_lora_rank=kv_lora, q_lora_rank=q_lora, qk_nope_dim=k_mla - n_rot,
                        v_head_mla=v_mla, scale=mscale**2 / math.sqrt(k_mla),
                        n_shared_experts=metadata.get(f"{ARCH}.expert_shared_count") or 0)
