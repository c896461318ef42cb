"""Sampling parameters, validated; each backend implements the sampler itself
(backends/cpu/sampler.py: llama.cpp's order, penalties -> top-k -> top-p -> min-p ->
temperature -> draw). No numpy here: the CLI builds these before any backend exists."""
from __future__ import annotations

import math
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


def candidate_distribution(p: SamplingParams, ids: list[int], logits: list[float], normalizer: float,
                           complete: bool) -> tuple[list[int], list[float]] | None:
    """The CPU sampler's top-k -> top-p -> min-p -> temperature steps, in plain Python, on the
    highest logits of a row sorted descending (ties: lower id first). Backends that find those
    on the device call this, so no numpy is needed to sample.

    `normalizer` is the sum over the whole row of exp(logit - logits[0]); `complete` says the
    candidates are the whole row. Returns (ids, probabilities) to draw from, or None when the
    candidates cannot settle it (the caller then passes the whole row).
    """
    covered = complete
    if p.top_k:
        if len(ids) < p.top_k and not complete:
            return None
        ids, logits = ids[: p.top_k], logits[: p.top_k]
        normalizer, covered = sum(math.exp(v - logits[0]) for v in logits), True
    probs = [math.exp(v - logits[0]) / normalizer for v in logits]
    if p.top_p < 1:
        total, cut = 0.0, None
        for i, q in enumerate(probs):
            total += q
            if total >= p.top_p:
                cut = i + 1
                break
        if cut is None and not covered:
            return None
        if cut is not None:
            ids, logits, probs, covered = ids[:cut], logits[:cut], probs[:cut], True
    if p.min_p > 0:
        n = sum(1 for q in probs if q >= p.min_p * probs[0])  # probs descend: the kept set is a prefix
        if n == len(probs) and not covered:
            return None
        ids, logits, covered = ids[:n], logits[:n], True
    if not covered:
        return None
    scaled = [v / p.temperature for v in logits]
    weights = [math.exp(v - scaled[0]) for v in scaled]
    total = sum(weights)
    return ids, [w / total for w in weights]
