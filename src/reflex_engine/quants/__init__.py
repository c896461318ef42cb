"""numpy dequantization of every ggml tensor type to float32, bit-identical to ggml and gguf-py.

One QuantType subclass per type (floats, legacy, kquants, iquants, ternary, fp4), registered
in QUANTS by subclassing. numpy is imported here; the GGUF reader and the CLI path never need it.
"""
import math

import numpy as np

from ..errors import ReflexError
from ..gguf.constants import GGMLType
from . import floats, fp4, iquants, kquants, legacy, ternary  # noqa: F401  (registers the types)
from .base import QUANTS, QuantType

__all__ = ["QUANTS", "QuantType", "dequantize"]

# elements per dequantize_blocks call: keeps temporaries at a few MB for any tensor size
CHUNK_ELEMENTS = 1 << 20


def dequantize(data, ggml_type: GGMLType | int, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Whole blocks of `ggml_type` in file order (bytes, memoryview or uint8 array) -> float32.

    `shape` is in numpy order (outermost first, i.e. ggml's ne reversed); flat when None.
    """
    try:
        quant = QUANTS[GGMLType(ggml_type)]
    except (ValueError, KeyError):
        raise ReflexError(f"cannot dequantize ggml type {ggml_type!r}: unsupported") from None
    if isinstance(data, np.ndarray):
        raw = data.reshape(-1).view(np.uint8)
    else:
        raw = np.frombuffer(data, np.uint8)
    n_blocks, rest = divmod(raw.size, quant.type_size)
    if rest:
        raise ReflexError(
            f"{quant.ggml_type.name} data of {raw.size} bytes is not a whole number of "
            f"{quant.type_size}-byte blocks"
        )
    n = n_blocks * quant.block_size
    if shape is not None and math.prod(shape) != n:
        raise ReflexError(f"{quant.ggml_type.name}: {n} values do not fill shape {tuple(shape)}")
    blocks = raw.reshape(n_blocks, quant.type_size)
    out = np.empty((n_blocks, quant.block_size), np.float32)
    step = max(1, CHUNK_ELEMENTS // quant.block_size)
    # inf/NaN scales in a file propagate as they do in ggml, without numpy warnings
    with np.errstate(all="ignore"):
        for start in range(0, n_blocks, step):
            out[start : start + step] = quant.dequantize_blocks(blocks[start : start + step])
    return out.reshape(n if shape is None else shape)
