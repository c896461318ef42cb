"""The original block types: one f16 scale (and maybe an offset) per block of 32 or so."""
import numpy as np

from ..gguf.constants import GGMLType
from .base import QuantType, f16, fields, nibbles, unpack


def _with_high_bit(qs: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """5-bit values: nibbles in ggml order, plus bit j of the little-endian u32 qh as bit 4."""
    return nibbles(qs) | unpack(qh, 1).reshape(len(qh), -1) << 4


class Q4_0(QuantType, ggml_type=GGMLType.Q4_0):
    """d: f16, qs[16]; x = (nibble - 8)·d."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        d, qs = fields(blocks, 2, 16)
        return f16(d) * (nibbles(qs).astype(np.float32) - 8)


class Q4_1(QuantType, ggml_type=GGMLType.Q4_1):
    """d: f16, m: f16, qs[16]; x = nibble·d + m."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        d, m, qs = fields(blocks, 2, 2, 16)
        return f16(d) * nibbles(qs).astype(np.float32) + f16(m)


class Q5_0(QuantType, ggml_type=GGMLType.Q5_0):
    """d: f16, qh: u32, qs[16]; x = (q5 - 16)·d."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        d, qh, qs = fields(blocks, 2, 4, 16)
        return f16(d) * (_with_high_bit(qs, qh).astype(np.float32) - 16)


class Q5_1(QuantType, ggml_type=GGMLType.Q5_1):
    """d: f16, m: f16, qh: u32, qs[16]; x = q5·d + m."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        d, m, qh, qs = fields(blocks, 2, 2, 4, 16)
        return f16(d) * _with_high_bit(qs, qh).astype(np.float32) + f16(m)


class Q8_0(QuantType, ggml_type=GGMLType.Q8_0):
    """d: f16, qs[32] int8; x = q·d."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        d, qs = fields(blocks, 2, 32)
        return f16(d) * qs.view(np.int8).astype(np.float32)


class Q8_1(QuantType, ggml_type=GGMLType.Q8_1):
    """d: f16, s: f16, qs[32] int8; x = q·d. s (= d·Σq) only serves dot products."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        d, _s, qs = fields(blocks, 2, 2, 32)
        return f16(d) * qs.view(np.int8).astype(np.float32)


class Q1_0(QuantType, ggml_type=GGMLType.Q1_0):
    """d: f16, qs[16]; bit j (LSB first) set gives +d, clear gives -d."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        d, qs = fields(blocks, 2, 16)
        d = f16(d)
        return np.where(unpack(qs, 1).reshape(len(qs), -1), d, -d)


class Q2_0(QuantType, ggml_type=GGMLType.Q2_0):
    """d: f16, qs[16]; 2-bit field j at bit 2·(j mod 4) of byte j/4; x = (q - 1)·d."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        d, qs = fields(blocks, 2, 16)
        return (unpack(qs, 2).reshape(len(qs), -1).astype(np.float32) - 1) * f16(d)
