"""The CUDA backend: kernels compiled when the package was built, reached through libcuda.

Importing this package loads nothing: the driver is opened when a CudaOps is created.
"""
from ...errors import CudaUnavailable
from .ops import CudaOps

__all__ = ["CudaOps", "CudaUnavailable"]
