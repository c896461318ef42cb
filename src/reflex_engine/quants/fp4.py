"""FP4 (E2M1) types with a shared power-of-two or FP8 scale: MXFP4 and NVFP4."""
import numpy as np

from ..gguf.constants import GGMLType
from .base import QuantType, fields, nibbles

# ggml's kvalues_fp4: E2M1 values doubled, so the scales below carry a factor 1/2
KVALUES_FP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


def _ue4m3_halves() -> np.ndarray:
    """float32 value/2 of every UE4M3 byte: 4 exponent bits (bias 7), 3 mantissa bits, bit 7
    ignored; 0x00 and 0x7F decode as 0 (ggml_ue4m3_to_fp32)."""
    x = np.arange(256)
    exp, man = (x >> 3) & 15, x & 7
    value = np.where(exp == 0, np.ldexp(man, -9), np.ldexp(8 + man, exp - 10))
    value[(x == 0) | (x == 0x7F)] = 0
    return (value * 0.5).astype(np.float32)  # exact: at most 4 significant bits


UE4M3_HALF = _ue4m3_halves()


class MXFP4(QuantType, ggml_type=GGMLType.MXFP4):
    """e: E8M0, qs[16]; x = kvalues_fp4[nibble]·2^(e-128), Q4_0 nibble order."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        e, qs = fields(blocks, 1, 16)
        # exact for every e: e = 0 and 1 give float32 denormals, as in ggml_e8m0_to_fp32_half
        return np.ldexp(KVALUES_FP4[nibbles(qs)], e.astype(np.int32) - 128)


class NVFP4(QuantType, ggml_type=GGMLType.NVFP4):
    """d[4]: UE4M3, one per 16 values; qs[32], 8 bytes per 16 values, lo nibbles then hi."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        d, qs = fields(blocks, 4, 32)
        n = len(blocks)
        return (KVALUES_FP4[nibbles(qs.reshape(n, 4, 8))] * UE4M3_HALF[d][..., None]).reshape(n, -1)
