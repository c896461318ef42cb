"""Ternary types (values -d, 0, +d), TQ1_0 and TQ2_0. Both store d last."""
import numpy as np

from ..gguf.constants import GGMLType
from .base import QuantType, f16, fields, unpack

_POW3 = np.array([1, 3, 9, 27, 81], np.uint8)


def _trits(qs: np.ndarray, count: int) -> np.ndarray:
    """Base-3 digits 0..count-1 of bytes that hold 5 digits as a fixed-point fraction of 256:
    digit k is ((byte·3^k mod 256)·3) >> 8. (..., L) -> (..., count, L)."""
    shifted = qs[..., None, :] * _POW3[:count, None]  # uint8: wraps mod 256 as in ggml
    return (shifted.astype(np.uint16) * 3) >> 8


class TQ1_0(QuantType, ggml_type=GGMLType.TQ1_0):
    """qs[48], qh[4], d: f16. Bytes 0-31 give 5 x 32 values, bytes 32-47 give 5 x 16, qh 4 x 4."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        qs, qh, d = fields(blocks, 48, 4, 2)
        n = len(blocks)
        digits = [_trits(qs[:, :32], 5), _trits(qs[:, 32:], 5), _trits(qh, 4)]
        q = np.concatenate([t.reshape(n, -1) for t in digits], axis=-1)
        return (q.astype(np.float32) - 1) * f16(d)


class TQ2_0(QuantType, ggml_type=GGMLType.TQ2_0):
    """qs[64], d: f16. Per 32-byte half, bits (0,1) of all bytes, then (2,3), ...; x = (q - 1)·d."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        qs, d = fields(blocks, 64, 2)
        q = unpack(qs.reshape(len(qs), 2, 32), 2, axis=-2).reshape(len(qs), -1)
        return (q.astype(np.float32) - 1) * f16(d)
