"""The numpy backend: the executable reference the CUDA backend is checked against."""
from .ops import CpuOps

__all__ = ["CpuOps"]
