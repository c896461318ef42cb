"""Leftmost-longest matching of special-token texts in a prompt, without a big regex.

A `re` alternation of Qwen's 293 special texts costs ~10 ms to compile, on the first encode of
every process. Instead one character class finds the next position where any special text
could start, and there the texts are tried longest first, one dict lookup per distinct
length. The result is the alternation's (longest first): leftmost match, longest there.
"""
from __future__ import annotations

import re
from collections.abc import Iterator


class SpecialMatcher:
    def __init__(self, ids: dict[str, int]):
        """ids: special text -> token id (non-empty texts)."""
        self._start = re.compile("[" + "".join(map(re.escape, sorted({t[0] for t in ids}))) + "]")
        by_length: dict[int, dict[str, int]] = {}
        for text, tid in ids.items():
            by_length.setdefault(len(text), {})[text] = tid
        self._by_length = sorted(by_length.items(), reverse=True)

    def partition(self, text: str) -> Iterator[tuple[str, int | None]]:
        """Yields (text, None) for plain fragments and ("", id) for special tokens."""
        pos = 0
        m = self._start.search(text)
        while m is not None:
            at = m.start()
            for length, table in self._by_length:
                tid = table.get(text[at : at + length])
                if tid is not None:
                    if at > pos:
                        yield text[pos:at], None
                    yield "", tid
                    pos = at + length
                    m = self._start.search(text, pos)
                    break
            else:
                m = self._start.search(text, at + 1)
        if pos < len(text):
            yield text[pos:], None
