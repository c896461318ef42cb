"""Choosing the next token from a row of logits, in llama.cpp's default order:
penalties -> top-k -> top-p -> min-p -> temperature -> draw. Temperature 0 is greedy."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ...errors import ReflexError
from ...kvstate import restorable, sampler_state
from ...sampling import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: Sequence[int], mask=None) -> int:
        ids, probs = self.distribution(logits, history, mask)
        return int(ids[0]) if self.params.temperature == 0 else int(ids[self.rng.choice(len(ids), p=probs)])

    def distribution(self, logits: np.ndarray, history: Sequence[int], mask=None) -> tuple[np.ndarray, np.ndarray]:
        """The ids left after every filter and the probabilities to draw them with. mask: the
        tokens allowed (constraints.Guide's packed bits, bit i of uint32 word j = token 32j + i)."""
        p = self.params
        logits = self._penalized(np.array(logits, dtype=np.float32), history)
        if np.isnan(logits).any() or np.isposinf(logits).any():  # no distribution to sample from
            raise ReflexError("the model's logits are not finite (NaN or +inf): its weights or its KV state are damaged")
        if mask is not None:
            # before every filter, as llama.cpp's grammar sampler: top-k and the rest see allowed tokens only
            allowed = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[: logits.size].astype(bool)
            if not allowed.any():
                raise ReflexError("internal error: the constraint allows no token")
            logits[~allowed] = -np.inf
        if p.temperature == 0:
            return np.array([np.argmax(logits)]), np.ones(1)
        ids = np.argsort(-logits, kind="stable")
        if mask is not None:
            ids = ids[: int(allowed.sum())]  # the masked ones sort last: drop them
        if p.top_k:
            ids = ids[: p.top_k]
        kept = logits[ids]
        probs = _softmax(kept)
        if p.top_p < 1:
            # smallest prefix whose mass reaches top_p (always at least one token)
            cut = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            ids, kept, probs = ids[:cut], kept[:cut], probs[:cut]
        if p.min_p > 0:
            keep = probs >= p.min_p * probs[0]
            ids, kept = ids[keep], kept[keep]
        return ids, _softmax(kept / np.float32(p.temperature))

    def _penalized(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        p = self.params
        if p.repeat_last_n == 0 or (p.repeat_penalty == 1 and p.presence_penalty == 0) or not history:
            return logits
        recent = np.unique(np.asarray(history[-p.repeat_last_n :], dtype=np.int64))
        seen = logits[recent]
        # as llama.cpp: shrink positive logits, grow negative ones
        seen = np.where(seen > 0, seen / p.repeat_penalty, seen * p.repeat_penalty)
        logits[recent] = seen - p.presence_penalty
        return logits


class LastRowSampler(Sampler):
    """The Ops sampler: the next token from the last row of (N, V) logits. Its random state
    goes into KV state files, so a resumed seeded run draws what this one would have."""

    RNG = "numpy.PCG64"

    def __call__(self, logits: np.ndarray, history: Sequence[int], mask=None) -> int:
        return super().__call__(logits[-1], history, mask)

    def ahead(self, logits: np.ndarray) -> None:
        return None  # the logits are on the host already: nothing to overlap

    def state(self) -> dict | None:
        return sampler_state(self.RNG, self.params.seed, self.rng.bit_generator.state)

    def restore(self, saved: dict | None) -> bool:
        """Continue the saved stream if it is this sampler's (same seed); False if not."""
        state = restorable(saved, self.RNG, self.params.seed)
        if state is None:
            return False
        try:
            self.rng.bit_generator.state = state
        except (TypeError, ValueError, KeyError):
            raise ReflexError("the KV state's sampler state is damaged") from None
        return True


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - np.max(x))
    return e / e.sum()


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities, computed in float64 for the scores system1 reports."""
    rows = rows.astype(np.float64)
    shifted = rows - rows.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
