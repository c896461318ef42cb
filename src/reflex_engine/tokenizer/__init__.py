"""Tokenizer built from the GGUF's own tokenizer.ggml.* metadata (standard library only)."""
from .cache import prepare_tokenizer
from .tokenizer import StreamDecoder, Tokenizer

__all__ = ["Tokenizer", "StreamDecoder", "prepare_tokenizer"]
