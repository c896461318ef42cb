"""K-quants: 256-value super-blocks of 16 or 8 sub-blocks, each with its own small scale."""
import numpy as np

from ..gguf.constants import GGMLType
from .base import QuantType, f16, fields, nibbles, unpack


def scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 for all 8 sub-blocks: (n, 12) bytes -> 6-bit sc, m, each (n, 8).

    Pairs 0-3 sit in the low 6 bits of bytes 0-3 (sc) and 4-7 (m); pairs 4-7 take their low
    4 bits from bytes 8-11 (sc lo nibble, m hi nibble) and their top 2 bits from bits 6-7 of
    bytes 0-3 (sc) and 4-7 (m).
    """
    sc_lo, m_lo, packed = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([sc_lo & 63, (packed & 15) | (sc_lo >> 6) << 4], axis=-1)
    m = np.concatenate([m_lo & 63, (packed >> 4) | (m_lo >> 6) << 4], axis=-1)
    return sc, m


def _scaled(d: np.ndarray, sc: np.ndarray, q: np.ndarray) -> np.ndarray:
    """(d·sc)·q for q of shape (n, sub-blocks, values); ggml rounds d·sc first."""
    return (d * sc.astype(np.float32))[..., None] * q.astype(np.float32)


def _scaled_minus_min(d, dmin, sc, m, q) -> np.ndarray:
    """(d·sc)·q - dmin·m per sub-block, flattened to (n, 256)."""
    return (_scaled(d, sc, q) - (dmin * m.astype(np.float32))[..., None]).reshape(len(q), -1)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K 2-bit order: per 32-byte half, bits (0,1) of all 32 bytes, then (2,3), ...;
    (n, 64) -> (n, 16 sub-blocks, 16)."""
    return unpack(qs.reshape(len(qs), 2, 32), 2, axis=-2).reshape(len(qs), 16, 16)


class Q2_K(QuantType, ggml_type=GGMLType.Q2_K):
    """scales[16] (lo nibble: scale, hi nibble: min), qs[64], d: f16, dmin: f16."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        scales, qs, d, dmin = fields(blocks, 16, 64, 2, 2)
        return _scaled_minus_min(f16(d), f16(dmin), scales & 15, scales >> 4, _crumbs(qs))


class Q3_K(QuantType, ggml_type=GGMLType.Q3_K):
    """hmask[32], qs[64], scales[12] (sixteen 6-bit scales, offset 32), d: f16."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        hmask, qs, scales, d = fields(blocks, 32, 64, 12, 2)
        n = len(blocks)
        # scale i: low 4 bits from nibble i//8 of byte i%8, top 2 from byte 8 + i%4 at bit 2·(i//4)
        low, high = unpack(scales[:, :8], 4, axis=-2), unpack(scales[:, 8:], 2, axis=-2)
        sc = low.reshape(n, 16) | high.reshape(n, 16) << 4
        # the hmask bit (advancing one bit per 2-bit plane, across both halves) is bit 2 of an
        # unsigned 3-bit q offset by 4, so a set bit means "no -4"
        q = _crumbs(qs) | unpack(hmask, 1, axis=-2).reshape(n, 16, 16) << 2
        return _scaled(f16(d), sc.astype(np.float32) - 32, q.astype(np.float32) - 4).reshape(n, -1)


class Q4_K(QuantType, ggml_type=GGMLType.Q4_K):
    """d: f16, dmin: f16, scales[12] (8 x 6-bit sc/m), qs[128]; 32-byte chunks, lo then hi nibbles."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        d, dmin, scales, qs = fields(blocks, 2, 2, 12, 128)
        q = nibbles(qs.reshape(len(qs), 4, 32)).reshape(len(qs), 8, 32)
        return _scaled_minus_min(f16(d), f16(dmin), *scale_min_k4(scales), q)


class Q5_K(QuantType, ggml_type=GGMLType.Q5_K):
    """Q4_K plus qh[32]: bit k of qh[l] is bit 4 of value l of sub-block k."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        d, dmin, scales, qh, qs = fields(blocks, 2, 2, 12, 32, 128)
        q = nibbles(qs.reshape(len(qs), 4, 32)).reshape(len(qs), 8, 32)
        q = q | unpack(qh, 1, axis=-2) << 4
        return _scaled_minus_min(f16(d), f16(dmin), *scale_min_k4(scales), q)


class Q6_K(QuantType, ggml_type=GGMLType.Q6_K):
    """ql[128], qh[64], scales[16] int8, d: f16; two halves of 128 values, x = d·sc·(q6 - 32)."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        ql, qh, scales, d = fields(blocks, 128, 64, 16, 2)
        n = len(blocks)
        # per half: lo nibbles of ql[0:64] then hi nibbles; qh[l] has bits 4-5 of l, l+32, l+64, l+96
        high = unpack(qh.reshape(n, 2, 32), 2, axis=-2).reshape(n, 2, 128)
        q = nibbles(ql.reshape(n, 2, 64)) | high << 4
        q = q.reshape(n, 16, 16).astype(np.float32) - 32
        return _scaled(f16(d), scales.view(np.int8), q).reshape(n, -1)


class Q8_K(QuantType, ggml_type=GGMLType.Q8_K):
    """d: f32, qs[256] int8, bsums[16] i16 (sums for dot products; not needed here)."""

    @classmethod
    def dequantize_blocks(cls, blocks):
        d, qs, _bsums = fields(blocks, 4, 256, 32)
        return d.view("<f4") * qs.view(np.int8).astype(np.float32)
