"""Plain scalar types: one element per block, little-endian, converted to float32."""
from typing import ClassVar

import numpy as np

from ..gguf.constants import GGMLType
from .base import QuantType


class _Scalar(QuantType):
    dtype: ClassVar[str]  # numpy dtype of one element

    @classmethod
    def dequantize_blocks(cls, blocks):
        return blocks.view(cls.dtype).astype(np.float32)


class F32(_Scalar, ggml_type=GGMLType.F32):
    dtype = "<f4"


class F16(_Scalar, ggml_type=GGMLType.F16):
    dtype = "<f2"


class F64(_Scalar, ggml_type=GGMLType.F64):
    dtype = "<f8"


class I8(_Scalar, ggml_type=GGMLType.I8):
    dtype = "i1"


class I16(_Scalar, ggml_type=GGMLType.I16):
    dtype = "<i2"


class I32(_Scalar, ggml_type=GGMLType.I32):
    dtype = "<i4"


class I64(_Scalar, ggml_type=GGMLType.I64):
    dtype = "<i8"


class BF16(QuantType, ggml_type=GGMLType.BF16):
    @classmethod
    def dequantize_blocks(cls, blocks):
        # bf16 is the top half of a float32: shifting keeps NaN payloads and denormals as they are
        return (blocks.view("<u2").astype(np.uint32) << 16).view(np.float32)
