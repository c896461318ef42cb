"""Backends implementing the Ops protocol (reflex_engine.ops)."""
from ..errors import ReflexError

DEVICES = ("cpu", "cuda", "auto")


def create_backend(device: str):
    """`auto` is CUDA when a GPU, its driver and this install's kernels are there, else the CPU."""
    if device not in DEVICES:
        raise ReflexError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})")
    if device != "cpu":
        from .cuda import CudaOps, CudaUnavailable

        try:
            return CudaOps()
        except CudaUnavailable:
            if device == "cuda":
                raise
    from .cpu import CpuOps  # imports numpy: only once a backend is actually wanted

    return CpuOps()
