"""Qwen3.5 dense (GGUF qwen35, 0.8B-27B), after transformers' modeling_qwen3_5 and llama.cpp's
src/models/qwen35.cpp: the hybrid of hybrid.py with dense SwiGLU FFNs.

Diff with qwen3next: beta and alpha come from projections of their own (ssm_beta, ssm_alpha);
the converter reorders value heads from grouped to tiled order, so value head h reads key head
h mod H_k; RoPE is IMROPE, which for text is NEOX on n_rot dims (hybrid.check_text_imrope).
"""
from ..ops import RopeMode
from . import hybrid
from .blocks import MODEL_TENSORS
from .config import read_config, read_ssm

ARCH = "qwen35"
BACKENDS = ("cpu", "cuda")
TENSORS = MODEL_TENSORS
LAYER_TENSORS = hybrid.layer_tensors(hybrid.SPLIT_INPUT_TENSORS, hybrid.SPLIT_GATE_TENSORS, hybrid.DENSE_FFN_TENSORS)


def forward(ops, w, cfg, cache, batch, out_rows):
    return hybrid.forward(ops, w, cfg, cache, batch, out_rows, inputs=hybrid.split_inputs,
                          feed_forward=hybrid.dense_ffn)


def config(metadata):
    cfg = read_ssm(metadata, read_config(metadata, ARCH, RopeMode.NEOX, qk_norm=True), tiled=True)
    hybrid.check_text_imrope(metadata, cfg)
    return cfg
