"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B), after transformers' modeling_qwen3_moe and
llama.cpp's src/models/qwen3moe.cpp.

Diff with qwen3: every FFN is a softmax-routed mixture of experts (no shared expert, no
scaling). The top-k weights are always renormalised to sum to 1, as llama.cpp does whatever the
checkpoint's `norm_topk_prob` was (the converter writes no key for it; transformers' own GGUF
loader forces it on too), so a checkpoint trained with norm_topk_prob=False differs from HF here.
"""
from ..ops import RopeMode
from .blocks import ATTENTION_TENSORS, MODEL_TENSORS, MOE_TENSORS, QK_NORM_TENSORS, decoder_forward
from .config import read_config, read_moe

ARCH = "qwen3moe"
BACKENDS = ("cpu", "cuda")
TENSORS = MODEL_TENSORS
LAYER_TENSORS = ATTENTION_TENSORS + QK_NORM_TENSORS + MOE_TENSORS
forward = decoder_forward


def config(metadata):
    return read_moe(metadata, read_config(metadata, ARCH, RopeMode.NEOX, qk_norm=True), norm=True)
