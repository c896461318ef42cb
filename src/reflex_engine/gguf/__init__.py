"""GGUF container: constants, the type table and the reader. Standard library only."""
from ..errors import GGUFError
from .constants import GGML_BLOCK, GGMLType, ValueType, tensor_nbytes
from .reader import GGUFFile, LazyArray, TensorInfo, layout_section

__all__ = ["GGUFError", "GGML_BLOCK", "GGMLType", "ValueType", "tensor_nbytes", "GGUFFile", "LazyArray", "TensorInfo", "layout_section"]
