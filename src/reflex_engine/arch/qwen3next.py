"""Qwen3-Next (GGUF qwen3next: Qwen3-Next-80B-A3B), after transformers' modeling_qwen3_next and
llama.cpp's src/models/qwen3next.cpp: the hybrid of hybrid.py with qwen35moe's FFNs.

Diff with qwen35moe: beta and alpha come from one projection, ssm_ba, grouped per key head as
[beta (r), alpha (r)] (value head g*r + j); value heads stay in HF's grouped order, so value
head h reads key head h // r; RoPE is plain NEOX on n_rot dims. Legacy files hold q, k, v and z
in one projection, ssm_in, grouped per key head, instead of attn_qkv and attn_gate: both forms
are read (hybrid.grouped_inputs).
"""
from ..ops import RopeMode
from . import hybrid
from .blocks import MODEL_TENSORS
from .config import Meta, read_config, read_moe, read_ssm

ARCH = "qwen3next"
BACKENDS = ("cpu", "cuda")
TENSORS = MODEL_TENSORS
LAYER_TENSORS = hybrid.layer_tensors(hybrid.FUSED_OR_SPLIT_INPUT_TENSORS, hybrid.GROUPED_GATE_TENSORS, hybrid.MOE_FFN_TENSORS)


def forward(ops, w, cfg, cache, batch, out_rows):
    return hybrid.forward(ops, w, cfg, cache, batch, out_rows, inputs=hybrid.grouped_inputs,
                          feed_forward=hybrid.moe_with_shared_expert)


def config(metadata):
    cfg = read_moe(metadata, read_ssm(metadata, read_config(metadata, ARCH, RopeMode.NEOX, qk_norm=True), tiled=False),
                   norm=True)
    return cfg._replace(n_shared_experts=1, n_ff_shared=Meta(metadata, ARCH).get("expert_shared_feed_forward_length"))
