"""Qwen3.5-MoE (GGUF qwen35moe: 35B-A3B, 122B-A10B, 397B-A17B), after transformers'
modeling_qwen3_5_moe and llama.cpp's src/models/qwen35moe.cpp.

Diff with qwen35: every FFN is a softmax-routed mixture of experts, top-k always renormalised
(as qwen3moe), plus a shared expert scaled by sigmoid(ffn_gate_inp_shexp . x).
"""
from ..ops import RopeMode
from . import hybrid
from .blocks import MODEL_TENSORS
from .config import Meta, read_config, read_moe, read_ssm

ARCH = "qwen35moe"
BACKENDS = ("cpu", "cuda")
TENSORS = MODEL_TENSORS
LAYER_TENSORS = hybrid.layer_tensors(hybrid.SPLIT_INPUT_TENSORS, hybrid.SPLIT_GATE_TENSORS, hybrid.MOE_FFN_TENSORS)


def forward(ops, w, cfg, cache, batch, out_rows):
    return hybrid.forward(ops, w, cfg, cache, batch, out_rows, inputs=hybrid.split_inputs,
                          feed_forward=hybrid.moe_with_shared_expert)


def config(metadata):
    cfg = read_ssm(metadata, read_config(metadata, ARCH, RopeMode.NEOX, qk_norm=True), tiled=True)
    hybrid.check_text_imrope(metadata, cfg)
    cfg = read_moe(metadata, cfg, norm=True)
    return cfg._replace(n_shared_experts=1, n_ff_shared=Meta(metadata, ARCH).get("expert_shared_feed_forward_length"))
