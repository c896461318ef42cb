"""The Qwen3-Next / Qwen3.5 hybrid decoder, after transformers' modeling_qwen3_next and
modeling_qwen3_5 and llama.cpp's src/models/{qwen3next,qwen35,delta-net-base}.cpp; qwen35.py,
qwen35moe.py and qwen3next.py pick its parts.

Most layers are Gated DeltaNet: a linear-attention recurrence behind a short causal conv, whose
state has a fixed size whatever the context; the others (attention.recurrent_layers, or every
full_attention_interval-th) are gated full attention. Diff with qwen3's attention: attn_q holds
per head d query rows then d gate rows, the output is multiplied by sigmoid(gate) before
attn_output, RoPE turns only n_rot of the d dims. The pre-FFN norm is `post_attention_norm`. The
converter added HF's 1 to every norm weight but ssm_norm's, so each norm is x / rms(x) * w.
"""
from ..errors import ReflexError
from ..ops import Batch
from .blocks import linear, linears, moe_ffn, swiglu_ffn, swiglu_mlp
from .config import ArchConfig
from .weights import TensorDecl


def _attention(cfg, i):
    return not cfg.is_recurrent(i)


def _recurrent(cfg, i):
    return cfg.is_recurrent(i)


ATTENTION_TENSORS = [
    TensorDecl("attn_norm", ("n_embd",)),
    TensorDecl("attn_q", ("n_embd", "2*n_heads*head_dim"), when=_attention),  # per head: d query rows, d gate rows
    TensorDecl("attn_k", ("n_embd", "n_kv_heads*head_dim"), when=_attention),
    TensorDecl("attn_v", ("n_embd", "n_kv_heads*v_head_dim"), when=_attention),
    TensorDecl("attn_q_norm", ("head_dim",), when=_attention),
    TensorDecl("attn_k_norm", ("head_dim",), when=_attention),
    TensorDecl("attn_output", ("n_heads*v_head_dim", "n_embd"), when=_attention),
]
DELTA_NET_TENSORS = [  # after the input projections and the gates' (below)
    TensorDecl("ssm_conv1d", ("ssm_conv_kernel", "ssm_channels"), when=_recurrent),
    TensorDecl("ssm_dt", ("ssm_v_heads",), suffix="bias", when=_recurrent),
    TensorDecl("ssm_a", ("ssm_v_heads",), suffix="", when=_recurrent),  # -exp(A_log)
    TensorDecl("ssm_norm", ("ssm_v_dim",), when=_recurrent),
    TensorDecl("ssm_out", ("ssm_v_width", "n_embd"), when=_recurrent),
]
SPLIT_INPUT_TENSORS = [  # qwen35, qwen35moe
    TensorDecl("attn_qkv", ("n_embd", "ssm_channels"), when=_recurrent),  # [q; k; v], every head's
    TensorDecl("attn_gate", ("n_embd", "ssm_v_width"), when=_recurrent),  # z
]
FUSED_OR_SPLIT_INPUT_TENSORS = [  # qwen3next: either the split form, or a legacy file's ssm_in
    TensorDecl("attn_qkv", ("n_embd", "ssm_channels"), when=_recurrent, unless="ssm_in"),
    TensorDecl("attn_gate", ("n_embd", "ssm_v_width"), when=_recurrent, unless="ssm_in"),
    TensorDecl("ssm_in", ("n_embd", "ssm_qkvz_width"), optional=True, when=_recurrent),  # per key head [q, k, v, z]
]
SPLIT_GATE_TENSORS = [  # qwen35, qwen35moe: beta and alpha from projections of their own
    TensorDecl("ssm_beta", ("n_embd", "ssm_v_heads"), when=_recurrent),
    TensorDecl("ssm_alpha", ("n_embd", "ssm_v_heads"), when=_recurrent),
]
GROUPED_GATE_TENSORS = [  # qwen3next: one projection, per key head [beta (r); alpha (r)]
    TensorDecl("ssm_ba", ("n_embd", "2*ssm_v_heads"), when=_recurrent),
]
DENSE_FFN_TENSORS = [
    TensorDecl("ffn_gate", ("n_embd", "n_ff")),
    TensorDecl("ffn_up", ("n_embd", "n_ff")),
    TensorDecl("ffn_down", ("n_ff", "n_embd")),
]
MOE_FFN_TENSORS = [
    TensorDecl("ffn_gate_inp", ("n_embd", "n_expert")),
    TensorDecl("ffn_gate_exps", ("n_embd", "n_ff_exp", "n_expert")),
    TensorDecl("ffn_up_exps", ("n_embd", "n_ff_exp", "n_expert")),
    TensorDecl("ffn_down_exps", ("n_ff_exp", "n_embd", "n_expert")),
    TensorDecl("ffn_gate_inp_shexp", ("n_embd", "1")),  # the shared expert's sigmoid gate
    TensorDecl("ffn_gate_shexp", ("n_embd", "n_ff_shexp")),
    TensorDecl("ffn_up_shexp", ("n_embd", "n_ff_shexp")),
    TensorDecl("ffn_down_shexp", ("n_ff_shexp", "n_embd")),
]


def layer_tensors(inputs: list[TensorDecl], gates: list[TensorDecl], ffn: list[TensorDecl]) -> list[TensorDecl]:
    """A layer's declarations, in the order a pass reads them."""
    return ATTENTION_TENSORS + inputs + gates + DELTA_NET_TENSORS + [TensorDecl("post_attention_norm", ("n_embd",))] + ffn


def split_inputs(ops, lw, cfg: ArchConfig, x):
    """qwen35's projections of x, each its own weight: [q; k; v] of every head (T, C), z (T, H_v*d_v), alpha and
    beta (T, H_v); one matmuls call, so that those of one type share a launch."""
    return linears(ops, x, (lw.attn_qkv, lw.attn_gate, lw.ssm_alpha, lw.ssm_beta))


def grouped_inputs(ops, lw, cfg: ArchConfig, x):
    """qwen3next's: [q; k; v] and z from attn_qkv and attn_gate, or from a legacy file's ssm_in, which holds q, k, v
    and z of each key head in turn; beta and alpha from one projection, per key head [beta (r); alpha (r)]."""
    if lw.attn_qkv is not None:
        mixed, z = linears(ops, x, (lw.attn_qkv, lw.attn_gate))
    else:
        width = cfg.ssm_v_width // cfg.ssm_k_heads  # the value heads of one key head
        q, k, v, z = ops.split(linear(ops, x, lw.ssm_in), cfg.ssm_k_heads, (cfg.ssm_k_dim, cfg.ssm_k_dim, width, width))
        mixed = ops.concat([q, k, v], 1)
    r = cfg.ssm_v_heads // cfg.ssm_k_heads
    beta, alpha = ops.split(linear(ops, x, lw.ssm_ba), cfg.ssm_k_heads, (r, r))  # value head g*r + j
    return mixed, z, alpha, beta


def gated_delta_net(ops, lw, cfg: ArchConfig, cache, layer: int, batch: Batch, x, inputs, residual):
    mixed, z, alpha, beta = inputs(ops, lw, cfg, x)
    qkv = ops.causal_conv1d(mixed, lw.ssm_conv1d, cache=cache, layer=layer, batch=batch)  # (T, C)
    qk, v = ops.split(qkv, 1, (2 * cfg.ssm_k_width, cfg.ssm_v_width))
    g, beta = ops.gdn_gates(alpha, beta, dt_bias=lw.ssm_dt, ssm_a=lw.ssm_a)  # log-decay <= 0, write strength
    # every head of q and of k L2-normalized: one op over both
    q, k = ops.split(ops.l2_norm(qk, cfg.ssm_k_dim, cfg.rms_eps), 1, (cfg.ssm_k_width, cfg.ssm_k_width))
    o = ops.delta_rule(q, k, v, g, beta, cache=cache, layer=layer, batch=batch, tiled=cfg.ssm_tiled,
                       scale=cfg.ssm_k_dim**-0.5)  # (T, H_v*d_v)
    return linear(ops, ops.swiglu(z, ops.rms_norm(o, lw.ssm_norm, cfg.rms_eps)), lw.ssm_out, add=residual)  # norm(o) * silu(z)


def gated_attention(ops, lw, cfg: ArchConfig, cache, layer: int, batch: Batch, x, residual):
    q_gate, k, v = linears(ops, x, (lw.attn_q, lw.attn_k, lw.attn_v))  # (T, 2*H*d), (T, Hkv*d) each
    q, gate = ops.split(q_gate, cfg.n_heads, (cfg.head_dim, cfg.head_dim))  # (T, H*d) each
    q, k = ops.ropes((q, k), batch.positions, cfg.head_dim, cfg.rope,
                     norms=((lw.attn_q_norm, cfg.rms_eps), (lw.attn_k_norm, cfg.rms_eps)))  # rope(norm(.))
    o = ops.attention(q, k, v, cache=cache, layer=layer, batch=batch,
                      n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, scale=cfg.attn_scale)  # (T, H*dv)
    return linear(ops, ops.sigmoid_gate(o, gate), lw.attn_output, add=residual)


def dense_ffn(ops, lw, cfg: ArchConfig, layer: int, x, residual):
    return swiglu_ffn(ops, lw, x, residual)


def moe_with_shared_expert(ops, lw, cfg: ArchConfig, layer: int, x, residual):
    """residual + routed experts + one always-on expert scaled by sigmoid(w_sh . x)."""
    shared = swiglu_mlp(ops, x, lw.ffn_gate_shexp, lw.ffn_up_shexp, lw.ffn_down_shexp)
    routed = moe_ffn(ops, lw, cfg, x, residual=residual)  # the residual summed in the experts' launch
    return ops.add(routed, ops.sigmoid_gate(shared, linear(ops, x, lw.ffn_gate_inp_shexp)))


def forward(ops, w, cfg: ArchConfig, cache, batch: Batch, out_rows, *, inputs, feed_forward):
    """Logits (len(out_rows), V) for the batch positions in out_rows."""
    x = ops.embed(w.token_embd, batch.tokens)  # (T, E)
    for i, lw in enumerate(w.blk):
        xn = ops.rms_norm(x, lw.attn_norm, cfg.rms_eps)
        if cfg.is_recurrent(i):
            h = gated_delta_net(ops, lw, cfg, cache, i, batch, xn, inputs, x)  # x + mixer(norm(x))
        else:
            h = gated_attention(ops, lw, cfg, cache, i, batch, xn, x)
        x = feed_forward(ops, lw, cfg, i, ops.rms_norm(h, lw.post_attention_norm, cfg.rms_eps), h)  # h + ffn(norm(h))
    x = ops.take_rows(x, out_rows)
    lm_head = w.output if w.output is not None else w.token_embd  # tied embeddings
    return linear(ops, ops.rms_norm(x, w.output_norm, cfg.rms_eps), lm_head)


def check_text_imrope(metadata, cfg: ArchConfig) -> None:
    """qwen35's IMROPE gives rotary pair i the position component i mod 3 of its section (while
    i % sum(sections) < 3 * that section's size; beyond, the 4th, which is 0 for text). Text feeds
    (p, p, p, 0), so where every pair takes one of the first three it is NEOX on n_rot dims."""
    key = f"{cfg.arch}.rope.dimension_sections"
    sections = list(metadata.get(key) or [])
    total = sum(sections) if len(sections) == 4 and all(isinstance(s, int) and s >= 0 for s in sections) else 0
    if not total:
        raise ReflexError(f"{cfg.arch}: GGUF metadata key {key!r} must be 4 section sizes, found {sections!r}")
    if any(i % total >= 3 * sections[i % total % 3] for i in range(cfg.rope_pairs)):
        raise ReflexError(f"{cfg.arch}: rope sections {sections} leave rotary pairs to the 4th position component, "
                          f"which text models do not use: not supported")
