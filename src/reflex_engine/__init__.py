"""Reflex: a GGUF-native inference engine built for the cold start."""

__version__ = "0.1.0"
