"""The CUDA backend: kernels compiled when the package was built, reached through libcuda.

Importing this package loads nothing: the driver is opened when a CudaOps is created. CudaOps
itself (ops.py, which brings the GGUF reader) is imported on first use, not with the package:
the driver's init thread imports device.py through this package while the main thread is still
importing the CLI, and the two would otherwise queue on the same modules' import locks.
"""
from ...errors import CudaUnavailable

__all__ = ["CudaOps", "CudaUnavailable"]


def __getattr__(name: str):
    if name == "CudaOps":
        from .ops import CudaOps

        return CudaOps
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
