"""Qwen3 dense, after transformers' modeling_qwen3.

Diff with llama: per-head RMSNorm of q and k before RoPE, NEOX RoPE (no weight permutation),
and a head width (`attention.key_length`) that need not be n_embd / n_heads.
"""
from ..ops import RopeMode
from .blocks import ATTENTION_TENSORS, FFN_TENSORS, MODEL_TENSORS, QK_NORM_TENSORS, decoder_forward
from .config import read_config

ARCH = "qwen3"
BACKENDS = ("cpu", "cuda")
TENSORS = MODEL_TENSORS
LAYER_TENSORS = ATTENTION_TENSORS + QK_NORM_TENSORS + FFN_TENSORS
forward = decoder_forward


def config(metadata):
    return read_config(metadata, ARCH, RopeMode.NEOX, qk_norm=True)
