"""Reflex: a GGUF-native inference engine built for the cold start."""
import time

PROCESS_T0 = time.perf_counter()  # first_token_ms and total_ms count from here

__version__ = "0.1.0"


def load(path, device: str = "auto", n_ctx: int | None = None):
    """Open a GGUF model and load it on `device` ("cpu", "cuda" or "auto")."""
    from .engine import ModelFile

    return ModelFile(path).load(device=device, n_ctx=n_ctx)
