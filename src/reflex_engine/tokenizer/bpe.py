"""Byte-level BPE (`tokenizer.ggml.model == "gpt2"`), as llama.cpp's llm_tokenizer_bpe_session.

Each pre-token is UTF-8 encoded and its bytes mapped to printable characters by GPT-2's
byte-to-unicode table; the merge with the lowest rank (leftmost on ties) is applied until
none applies; the resulting symbols are looked up in the vocabulary.
"""
from __future__ import annotations

from heapq import heapify, heappop, heappush

from .strings import Strings


def _byte_to_unicode() -> list[str]:
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


BYTE_TO_UNICODE = _byte_to_unicode()
# latin-1 decoding turns bytes into code points 0-255; this maps those onto GPT-2's characters.
_ENCODE_TABLE = {b: c for b, c in enumerate(BYTE_TO_UNICODE)}
UNICODE_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_UNICODE)}
_WORD_CACHE_LIMIT = 1 << 16


def byte_encode(piece: str) -> str:
    return piece.encode("utf-8").decode("latin-1").translate(_ENCODE_TABLE)


class BPE:
    def __init__(self, tokens: Strings, merges: Strings, ignore_merges: bool):
        self.tokens = tokens
        self.merges = merges  # looked up by the entry text "left right"; position = rank
        self.ignore_merges = ignore_merges
        self._cache: dict[str, list[int]] = {}

    def encode_piece(self, piece: str, out: list[int]) -> None:
        word = byte_encode(piece)
        ids = self._cache.get(word)
        if ids is None:
            ids = self._encode_word(word)
            if len(self._cache) >= _WORD_CACHE_LIMIT:
                self._cache.clear()
            self._cache[word] = ids
        out.extend(ids)

    def _encode_word(self, word: str) -> list[int]:
        lookup = self.tokens.get
        if self.ignore_merges:
            tid = lookup(word)
            if tid is not None:
                return [tid]
        ids = []
        for sym in self._merge(word):
            tid = lookup(sym)
            if tid is not None:
                ids.append(tid)
            else:  # not in the vocabulary: one token per byte, dropped if even that is missing
                ids.extend(tid for tid in map(lookup, sym) if tid is not None)
        return ids

    def _merge(self, word: str) -> list[str]:
        syms: list = list(word)
        n = len(syms)
        if n < 2:
            return syms
        rank = self.merges.get
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            r = rank(syms[i] + " " + syms[i + 1])
            if r is not None:
                heap.append((r, i, syms[i], syms[i + 1]))
        heapify(heap)
        while heap:
            _, i, left, right = heappop(heap)
            j = nxt[i]
            if j >= n or syms[i] != left or syms[j] != right:
                continue  # stale: one side was merged since this pair was queued
            merged = left + right
            syms[i], syms[j] = merged, None
            k = nxt[i] = nxt[j]
            if k < n:
                prv[k] = i
                r = rank(merged + " " + syms[k])
                if r is not None:
                    heappush(heap, (r, i, merged, syms[k]))
            p = prv[i]
            if p >= 0:
                r = rank(syms[p] + " " + merged)
                if r is not None:
                    heappush(heap, (r, p, syms[p], merged))
        return [s for s in syms if s is not None]
