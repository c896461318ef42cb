"""Architectures, keyed by `general.architecture`. Backend-agnostic: no numpy here."""
from types import ModuleType

from ..errors import ReflexError
from . import deepseek2, llama, qwen3, qwen3moe, qwen3next, qwen35, qwen35moe

ARCHS: dict[str, ModuleType] = {m.ARCH: m for m in (llama, qwen3, qwen3moe, deepseek2, qwen35, qwen35moe, qwen3next)}


def get_arch(name) -> ModuleType:
    if name not in ARCHS:
        raise ReflexError(f"unsupported architecture {name!r} (supported: {', '.join(sorted(ARCHS))})")
    return ARCHS[name]
