"""Blocks shared by the dense decoder architectures, written against the Ops protocol.

Pre-norm residual layout: h = x + attn(norm(x)); out = h + ffn(norm(h)); final norm, LM head.
"""
from __future__ import annotations

from typing import Sequence

from ..lora import LoraWeight
from ..ops import Batch
from .config import ArchConfig
from .weights import TensorDecl

MODEL_TENSORS = [  # loaded after the layers, in this order (weights.load_weights): the head before the embedding
    TensorDecl("output_norm", ("n_embd",)),
    TensorDecl("output", ("n_embd", "n_vocab"), optional=True),  # absent: tied to token_embd
    TensorDecl("rope_freqs", ("rope_pairs",), optional=True),  # Llama 3.1 long-context factors
    TensorDecl("token_embd", ("n_embd", "n_vocab")),
]
ATTENTION_TENSORS = [
    TensorDecl("attn_norm", ("n_embd",)),
    TensorDecl("attn_q", ("n_embd", "n_heads*head_dim")),
    TensorDecl("attn_k", ("n_embd", "n_kv_heads*head_dim")),
    TensorDecl("attn_v", ("n_embd", "n_kv_heads*v_head_dim")),
    TensorDecl("attn_output", ("n_heads*v_head_dim", "n_embd")),
]
QK_NORM_TENSORS = [
    TensorDecl("attn_q_norm", ("head_dim",)),
    TensorDecl("attn_k_norm", ("head_dim",)),
]
FFN_TENSORS = [
    TensorDecl("ffn_norm", ("n_embd",)),
    TensorDecl("ffn_gate", ("n_embd", "n_ff")),
    TensorDecl("ffn_up", ("n_embd", "n_ff")),
    TensorDecl("ffn_down", ("n_ff", "n_embd")),
]


def linear(ops, x, w, add=None):
    """x (T, in) times a stored (out, in) weight, plus add (T, out) where given (the residual
    stream); one a LoRA adapter changes (lora.py) adds its low-rank terms ((x·Aᵀ)·S)·Bᵀ, passing
    through (T, r), before add."""
    if not isinstance(w, LoraWeight):
        return ops.matmul(x, w, add=add)
    y = ops.matmul(x, w.base)
    for a, scale, b in w.terms:
        y = ops.add(y, ops.matmul(ops.matmul(ops.matmul(x, a), scale), b))
    return y if add is None else ops.add(add, y)


def linears(ops, x, ws):
    """[linear(ops, x, w) for w in ws], in one backend call (which may share launches) where no
    adapter changes them."""
    if any(isinstance(w, LoraWeight) for w in ws):
        return [linear(ops, x, w) for w in ws]
    return ops.matmuls(x, ws)


def attention(ops, w, lw, cfg: ArchConfig, cache, layer: int, batch: Batch, x, residual):
    """residual + attention(x)."""
    q, k, v = linears(ops, x, (lw.attn_q, lw.attn_k, lw.attn_v))  # (T, H*dk), (T, Hkv*dk), (T, Hkv*dv)
    q_norm, k_norm = ((lw.attn_q_norm, cfg.rms_eps), (lw.attn_k_norm, cfg.rms_eps)) if cfg.qk_norm else (None, None)
    q, k = ops.ropes((q, k), batch.positions, cfg.head_dim, cfg.rope, freq_factors=w.rope_freqs, norms=(q_norm, k_norm))  # rope(norm(.))
    o = ops.attention(q, k, v, cache=cache, layer=layer, batch=batch,
                      n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, scale=cfg.attn_scale)  # (T, H*dv)
    return linear(ops, o, lw.attn_output, add=residual)


def swiglu_mlp(ops, x, gate, up, down, residual=None):
    """(residual +) W_down (silu(W_gate x) * W_up x)."""
    return linear(ops, ops.swiglu(*linears(ops, x, (gate, up))), down, add=residual)


def swiglu_ffn(ops, lw, x, residual=None):
    return swiglu_mlp(ops, x, lw.ffn_gate, lw.ffn_up, lw.ffn_down, residual)


MOE_TENSORS = [
    TensorDecl("ffn_norm", ("n_embd",)),
    TensorDecl("ffn_gate_inp", ("n_embd", "n_expert")),  # the router
    TensorDecl("ffn_gate_exps", ("n_embd", "n_ff_exp", "n_expert")),  # experts stacked on the outer axis
    TensorDecl("ffn_up_exps", ("n_embd", "n_ff_exp", "n_expert")),
    TensorDecl("ffn_down_exps", ("n_ff_exp", "n_embd", "n_expert")),
]


def moe_ffn(ops, lw, cfg: ArchConfig, x, bias=None, residual=None):
    """Sparse SwiGLU experts: each token is routed on W_g x to cfg.routing.n_used experts, whose
    outputs are mixed by the routing weights (bias: for the choice only, see Ops.route); + residual."""
    routes = ops.route(linear(ops, x, lw.ffn_gate_inp), cfg.routing, bias)  # (T, k) ids and weights
    return ops.moe_ffn(x, routes, gate=lw.ffn_gate_exps, up=lw.ffn_up_exps, down=lw.ffn_down_exps, add=residual)


def feed_forward(ops, lw, cfg: ArchConfig, layer: int, x, residual):
    """residual + the layer's feed-forward of x."""
    return moe_ffn(ops, lw, cfg, x, residual=residual) if cfg.is_moe(layer) else swiglu_ffn(ops, lw, x, residual)


def decoder_forward(ops, w, cfg: ArchConfig, cache, batch: Batch, out_rows: Sequence[int], *,
                    attention=attention, feed_forward=feed_forward):
    """Logits (len(out_rows), V) for the batch positions in out_rows."""
    x = ops.embed(w.token_embd, batch.tokens)  # (T, E)
    for i, lw in enumerate(w.blk):
        h = attention(ops, w, lw, cfg, cache, i, batch, ops.rms_norm(x, lw.attn_norm, cfg.rms_eps), x)  # x + attn(norm(x))
        x = feed_forward(ops, lw, cfg, i, ops.rms_norm(h, lw.ffn_norm, cfg.rms_eps), h)  # h + ffn(norm(h))
    x = ops.take_rows(x, out_rows)
    lm_head = w.output if w.output is not None else w.token_embd  # tied embeddings
    return linear(ops, ops.rms_norm(x, w.output_norm, cfg.rms_eps), lm_head)
