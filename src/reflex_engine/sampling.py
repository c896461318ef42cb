"""Sampling parameters, validated; each backend implements the sampler itself
(backends/cpu/sampler.py: llama.cpp's order, penalties -> top-k -> top-p -> min-p ->
temperature -> draw). No numpy here: the CLI builds these before any backend exists."""
from __future__ import annotations

from typing import NamedTuple

from .errors import ReflexError


class _Fields(NamedTuple):
    temperature: float = 0.8
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1 = off
    min_p: float = 0.05  # 0 = off
    repeat_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    repeat_last_n: int = 64  # how many recent tokens the penalties look at
    seed: int | None = None  # None: fresh entropy


class SamplingParams(_Fields):
    """The fields above, checked when built."""

    __slots__ = ()

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls, *args, **kwargs)
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top-k must be >= 0"),
            (0 < self.top_p <= 1, "top-p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min-p must be in [0, 1]"),
            (self.repeat_penalty > 0, "repeat penalty must be > 0"),
            (self.repeat_last_n >= 0, "repeat-last-n must be >= 0"),
            (self.seed is None or self.seed >= 0, "seed must be >= 0 (None: random)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ReflexError(message)
        return self
