"""QuantType, the registry it fills, and the bit-unpacking helpers every block layout shares.

Block layouts follow ggml-common.h; the arithmetic follows ggml's dequantize_row_* in float32,
operation for operation, so results are bit-identical to ggml and gguf-py.
"""
from typing import ClassVar

import numpy as np

from ..gguf.constants import GGML_BLOCK, GGMLType

QUANTS: dict[GGMLType, type["QuantType"]] = {}


class QuantType:
    """One ggml type. Subclass with `ggml_type=` to register it in QUANTS; leave it out for a
    base shared by several types."""

    ggml_type: ClassVar[GGMLType]
    block_size: ClassVar[int]  # elements per block
    type_size: ClassVar[int]  # bytes per block

    def __init_subclass__(cls, ggml_type: GGMLType | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if ggml_type is None:
            return
        if ggml_type in QUANTS:
            raise TypeError(f"{ggml_type.name} registered twice: {QUANTS[ggml_type].__name__}")
        cls.ggml_type = ggml_type
        cls.block_size, cls.type_size = GGML_BLOCK[ggml_type]
        QUANTS[ggml_type] = cls

    @classmethod
    def dequantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        """uint8 (n, type_size) -> float32 (n, block_size)."""
        raise NotImplementedError


def fields(blocks: np.ndarray, *widths: int) -> list[np.ndarray]:
    """Split uint8 (n, type_size) blocks into the struct's fields (byte widths, in order); views."""
    assert sum(widths) == blocks.shape[-1], (widths, blocks.shape)
    return np.split(blocks, np.cumsum(widths)[:-1], axis=-1)


def f16(field: np.ndarray) -> np.ndarray:
    """Little-endian halves (bytes or uint16) -> float32, exactly."""
    return field.view("<f2").astype(np.float32)


def unpack(x: np.ndarray, width: int, count: int | None = None, axis: int = -1) -> np.ndarray:
    """Bit fields of `width` bits of each element of x, lowest first, along a new axis at `axis`
    (negative). Keeps x's unsigned dtype."""
    count = count or 8 * x.itemsize // width
    shifts = (np.arange(count, dtype=x.dtype) * width).reshape((count,) + (1,) * (-1 - axis))
    return (np.expand_dims(x, axis) >> shifts) & x.dtype.type((1 << width) - 1)


def nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit order: the lo nibbles of all bytes (last axis), then all the hi nibbles."""
    return unpack(qs, 4, axis=-2).reshape(*qs.shape[:-1], 2 * qs.shape[-1])
