"""Architectures, keyed by `general.architecture`. Backend-agnostic: no numpy here."""
from importlib import import_module
from types import ModuleType

from ..errors import ReflexError

# each is the module of that name, imported when a file of its architecture is opened: the cold
# path pays only for its own
ARCHS = ("llama", "qwen3", "qwen3moe", "deepseek2", "qwen35", "qwen35moe", "qwen3next")


def get_arch(name) -> ModuleType:
    if name not in ARCHS:
        raise ReflexError(f"unsupported architecture {name!r} (supported: {', '.join(sorted(ARCHS))})")
    return import_module(f"{__name__}.{name}")
