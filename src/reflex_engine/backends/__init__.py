"""Backends implementing the Ops protocol (reflex_engine.ops)."""
from ..errors import ReflexError

DEVICES = ("cpu", "cuda", "auto")


def create_backend(device: str):
    if device not in DEVICES:
        raise ReflexError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})")
    if device == "cuda":
        raise ReflexError("the CUDA backend is not built yet; use --device cpu (or auto)")
    from .cpu import CpuOps  # imports numpy: only once a backend is actually wanted

    return CpuOps()
