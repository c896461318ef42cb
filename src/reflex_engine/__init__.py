"""Reflex: a GGUF-native inference engine built for the cold start."""
import time

PROCESS_T0 = time.perf_counter()  # first_token_ms and total_ms count from here

__version__ = "0.1.0"


def load(path, device="auto", n_ctx: int | None = None, lora=()):
    """Open a GGUF model and load it on `device` ("cpu", "cuda" or "auto", or a
    backends.BackendStart begun earlier). lora: LoRA adapter files (llama.cpp's GGUF adapters)
    to apply, each a path or a (path, scale) pair."""
    from .backends import started

    start = started(device)  # the driver initialises on a thread while the file opens
    from .engine import ModelFile

    file = ModelFile(path)
    for adapter in lora:
        path_, scale = (adapter, 1.0) if isinstance(adapter, str) else adapter
        file.add_lora(path_, scale)
    return file.load(start, n_ctx=n_ctx)
