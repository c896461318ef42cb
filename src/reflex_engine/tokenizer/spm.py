"""SentencePiece BPE (`tokenizer.ggml.model == "llama"`), as llama.cpp's llm_tokenizer_spm_session.

The text (spaces already escaped to U+2581) starts as one symbol per character; the adjacent
pair whose concatenation is a vocabulary token with the highest score is merged (leftmost on
ties) until no pair forms a token. A final symbol that is not a token is emitted as its
UTF-8 bytes through the `<0xXX>` byte tokens.
"""
from __future__ import annotations

from array import array
from heapq import heapify, heappop, heappush

from .strings import Strings


class SPM:
    def __init__(self, tokens: Strings, scores: array, unk_id: int | None):
        self.tokens = tokens
        self.scores = scores
        self.unk_id = unk_id
        self._byte_ids = [self._byte_token(b) for b in range(256)]

    def _byte_token(self, b: int) -> int | None:
        tid = self.tokens.get(f"<0x{b:02X}>")
        if tid is None and b < 128:
            tid = self.tokens.get(chr(b))
        return tid if tid is not None else self.unk_id

    def encode(self, text: str, out: list[int]) -> None:
        lookup, scores = self.tokens.get, self.scores
        syms: list = list(text)
        n = len(syms)
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))

        def candidate(i: int, j: int):
            tid = lookup(syms[i] + syms[j])
            # max-heap on score, then leftmost; the size detects pairs gone stale
            return None if tid is None else (-scores[tid], i, j, len(syms[i]) + len(syms[j]))

        heap = [c for c in (candidate(i, i + 1) for i in range(n - 1)) if c is not None]
        heapify(heap)
        while heap:
            _, i, j, size = heappop(heap)
            left, right = syms[i], syms[j]
            if left is None or right is None or len(left) + len(right) != size:
                continue
            syms[i], syms[j] = left + right, None
            k = nxt[i] = nxt[j]
            if k < n:
                prv[k] = i
                c = candidate(i, k)
                if c is not None:
                    heappush(heap, c)
            p = prv[i]
            if p >= 0:
                c = candidate(p, i)
                if c is not None:
                    heappush(heap, c)
        for sym in syms:
            if sym is None:
                continue
            tid = lookup(sym)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(tid for tid in map(self._byte_ids.__getitem__, sym.encode("utf-8")) if tid is not None)
