"""I-quants: groups of 8 (or 4) values looked up in lattice grids, with sign bits and 4-bit scales.

The grids are format data generated from ggml-common.h into iq_grids.py.
"""
import base64
from functools import cache

import numpy as np

from ..gguf.constants import GGMLType
from .base import QuantType, f16, fields, nibbles, unpack
from .iq_grids import GRIDS, KSIGNS_IQ2XS

KVALUES_IQ4NL = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32
)
IQ1_DELTA = np.float32(0.125)


@cache
def grid(name: str) -> np.ndarray:
    """A grid from iq_grids as float32 (entries, values per entry). The bytes are read as int8:
    iq1s_grid holds -1/0/1, and every other grid's bytes are below 128."""
    entries, width, alphabet, bits, codes = GRIDS[name]
    stream = np.unpackbits(np.frombuffer(base64.b64decode(codes), np.uint8), bitorder="little")
    code = stream[: entries * width * bits].reshape(-1, bits) @ (1 << np.arange(bits))
    return np.array(alphabet, np.uint8)[code].view(np.int8).astype(np.float32).reshape(entries, width)


def signs(bits: np.ndarray) -> np.ndarray:
    """Sign bits -> float32 factors: a set bit negates."""
    return np.where(bits, np.float32(-1), np.float32(1))


@cache
def ksigns() -> np.ndarray:
    """ksigns_iq2xs as (128, 8) factors: a 7-bit index plus an implied parity bit 7."""
    return signs(unpack(np.frombuffer(KSIGNS_IQ2XS, np.uint8), 1))


def _signs_and_scale(aux: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A u32 of IQ2_XXS/IQ3_XXS: four 7-bit ksigns indices, then a 4-bit scale in bits 28-31.
    Returns signs (..., 4, 8) and the scale as float32."""
    return ksigns()[unpack(aux, 7, 4)], (aux >> 28).astype(np.float32)


def _iq2_scales(d: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """IQ2_XS/IQ2_S: per 32 values, lo then hi nibble scale 16 values each, as d·(0.5+s)·0.25;
    (n, 8 blocks, 2 halves, 1, 1)."""
    return (d[..., None] * (unpack(scales, 4).astype(np.float32) + 0.5) * 0.25)[..., None, None]


def _iq1_values(dl: np.ndarray, index: np.ndarray, negative_delta: np.ndarray) -> np.ndarray:
    """dl·(grid + delta), delta = ∓1/8; dl and negative_delta broadcast against index."""
    delta = np.where(negative_delta, -IQ1_DELTA, IQ1_DELTA)[..., None]
    return dl * (grid("iq1s_grid")[index] + delta)


class IQ2_XXS(QuantType, ggml_type=GGMLType.IQ2_XXS):
    """d: f16, then per 32 values two u32: four iq2xxs_grid indices, and signs plus scale."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        d, qs = fields(blocks, 2, 64)
        n = len(blocks)
        sign, s = _signs_and_scale(qs.view("<u4").reshape(n, 8, 2)[..., 1])
        db = f16(d) * (s + 0.5) * 0.25
        index = qs.reshape(n, 8, 8)[..., :4]
        return (db[..., None, None] * grid("iq2xxs_grid")[index] * sign).reshape(n, -1)


class IQ2_XS(QuantType, ggml_type=GGMLType.IQ2_XS):
    """d: f16, qs[32] u16 (9-bit iq2xs_grid index, 7-bit ksigns index), scales[8]."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        d, qs, scales = fields(blocks, 2, 64, 8)
        n = len(blocks)
        qs = qs.view("<u2").reshape(n, 8, 2, 2)
        values = grid("iq2xs_grid")[qs & 511] * ksigns()[qs >> 9]
        return (_iq2_scales(f16(d), scales) * values).reshape(n, -1)


class IQ2_S(QuantType, ggml_type=GGMLType.IQ2_S):
    """d: f16, qs[32] (index bits 0-7), signs[32], qh[8] (index bits 8-9), scales[8]."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        d, qs, sign_bits, qh, scales = fields(blocks, 2, 32, 32, 8, 8)
        n = len(blocks)
        index = qs.reshape(n, 8, 4) | unpack(qh, 2).astype(np.uint16) << 8
        values = grid("iq2s_grid")[index] * signs(unpack(sign_bits, 1)).reshape(n, 8, 4, 8)
        return (_iq2_scales(f16(d), scales) * values.reshape(n, 8, 2, 2, 8)).reshape(n, -1)


class IQ3_XXS(QuantType, ggml_type=GGMLType.IQ3_XXS):
    """d: f16, qs[64] (iq3xxs_grid indices, 4 values each), then per 32 values a u32 of signs
    and scale."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        d, qs, aux = fields(blocks, 2, 64, 32)
        n = len(blocks)
        sign, s = _signs_and_scale(aux.view("<u4"))
        db = f16(d) * (s + 0.5) * 0.5
        values = grid("iq3xxs_grid")[qs].reshape(n, 8, 4, 8)
        return (db[..., None, None] * values * sign).reshape(n, -1)


class IQ3_S(QuantType, ggml_type=GGMLType.IQ3_S):
    """d: f16, qs[64] (index bits 0-7), qh[8] (bit 8: bit k of qh[ib]), signs[32], scales[4]."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        d, qs, qh, sign_bits, scales = fields(blocks, 2, 64, 8, 32, 4)
        n = len(blocks)
        index = qs.reshape(n, 8, 8) | unpack(qh, 1).astype(np.uint16) << 8
        db = f16(d) * (1 + 2 * unpack(scales, 4).reshape(n, 8)).astype(np.float32)
        values = grid("iq3s_grid")[index].reshape(n, 8, 32)
        return (db[..., None] * values * signs(unpack(sign_bits, 1)).reshape(n, 8, 32)).reshape(n, -1)


class IQ1_S(QuantType, ggml_type=GGMLType.IQ1_S):
    """d: f16, qs[32] (index bits 0-7), qh[8] u16: 4 x 3 index bits, 3-bit scale, delta sign."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        d, qs, qh = fields(blocks, 2, 32, 16)
        n = len(blocks)
        qh = qh.view("<u2")
        index = qs.reshape(n, 8, 4) | unpack(qh, 3, 4) << 8
        dl = f16(d) * (2 * ((qh >> 12) & 7) + 1).astype(np.float32)
        values = _iq1_values(dl[..., None, None], index, (qh >> 15)[..., None])
        return values.reshape(n, -1)


class IQ1_M(QuantType, ggml_type=GGMLType.IQ1_M):
    """qs[32], qh[16] (per group of 8: 3 index bits and a delta sign), scales[8] as 4 u16 words:
    3-bit scales for each 16 values, and the f16 super-scale in the words' top nibbles."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        qs, qh, scales = fields(blocks, 32, 16, 8)
        n = len(blocks)
        words = scales.view("<u2")
        d = f16(np.bitwise_or.reduce(words >> 12 << np.array([0, 4, 8, 12], np.uint16), axis=-1))
        dl = d[:, None, None] * (2 * unpack(words, 3, 4) + 1).reshape(n, 8, 2).astype(np.float32)
        high = unpack(qh, 4).reshape(n, 8, 2, 2)
        index = qs.reshape(n, 8, 2, 2) | (high & 7).astype(np.uint16) << 8
        return _iq1_values(dl[..., None, None], index, high & 8).reshape(n, -1)


class IQ4_NL(QuantType, ggml_type=GGMLType.IQ4_NL):
    """d: f16, qs[16]; x = d·kvalues_iq4nl[nibble], Q4_0 nibble order."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        d, qs = fields(blocks, 2, 16)
        return f16(d) * KVALUES_IQ4NL[nibbles(qs)]


class IQ4_XS(QuantType, ggml_type=GGMLType.IQ4_XS):
    """d: f16, scales_h: u16, scales_l[4], qs[128]; 6-bit scales (offset 32) per 32 values."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        d, scales_h, scales_l, qs = fields(blocks, 2, 2, 4, 128)
        n = len(blocks)
        ls = unpack(scales_l, 4).reshape(n, 8) | unpack(scales_h.view("<u2"), 2).reshape(n, 8) << 4
        dl = f16(d) * (ls.astype(np.float32) - 32)
        return (dl[..., None] * KVALUES_IQ4NL[nibbles(qs.reshape(n, 8, 16))]).reshape(n, -1)
