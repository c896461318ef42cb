"""Llama 2/3 and SmolLM/SmolLM2, after transformers' modeling_llama.

The converter permutes Q/K rows so that NORM (adjacent-pair) RoPE on the GGUF weights equals
HF's rotate-half on the originals; so RoPE here is NORM.
"""
from ..ops import RopeMode
from .blocks import ATTENTION_TENSORS, FFN_TENSORS, MODEL_TENSORS, decoder_forward
from .config import read_config

ARCH = "llama"
BACKENDS = ("cpu", "cuda")
TENSORS = MODEL_TENSORS
LAYER_TENSORS = ATTENTION_TENSORS + FFN_TENSORS
forward = decoder_forward


def config(metadata):
    return read_config(metadata, ARCH, RopeMode.NORM, qk_norm=False)
