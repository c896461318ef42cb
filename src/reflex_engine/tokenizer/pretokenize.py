"""Pre-tokenizer regexes (HF `Split`, behaviour "isolated") on the standard library's `re`.

`re` has no \\p{L}/\\p{N}/\\p{M}/\\p{P}/\\p{S}, so, as llama.cpp's unicode.cpp does, we run each
regex on a *shadow* of the text: ASCII stays itself and every other character becomes a
placeholder code point (Supplementary Private Use Area-A) that encodes all the regexes can
tell about it: its general-category major class (L M N P S Z C), whether it is Unicode
White_Space, and its membership in each explicit non-ASCII set the regexes name (deepseek's
CJK/Latin ranges, the non-ASCII case partners of letters under (?i:...)). Over that finite
alphabet every class, negated ones included, is an explicit positive set, so each regex is
translated once into a plain `re` pattern. Cuts found on the shadow are cuts of the original
text (translation is one code point for one). Semantics follow Oniguruma as HF tokenizers
runs it: `\\s` is White_Space (not Python's str.isspace, which adds \\x1c-\\x1f) and `$` is the
end of the fragment.
"""
from __future__ import annotations

import re
import unicodedata
from bisect import bisect_right

from ..errors import ReflexError

# Unicode White_Space, as Oniguruma's and Rust regex's \s.
WHITE_SPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000])
_MAJORS = "LMNPSZC"
_PLACEHOLDER_BASE = 0xF0000
_MAX_SETS = 10  # 7 * 2 * 2**10 placeholders stay inside plane 15

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Written with \u escapes: several of these code points are NFC singletons (U+2126 OHM SIGN,
# U+212A KELVIN SIGN, ...) that an editor may silently normalise to other characters.
_CJK_DEEPSEEK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# The deepseek-llm letter class, from its tokenizer.json (Latin, Greek, Cyrillic, Armenian, ...).
_DEEPSEEK_LLM_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_DEEPSEEK_LLM_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"

# tokenizer.ggml.pre -> the regexes applied in turn, each splitting the pieces of the last
# (as llm_tokenizer_bpe in llama.cpp's llama-vocab.cpp; HF originals where they differ).
PRE_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt-2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "qwen35": (_QWEN35,),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "deepseek-llm": (r"[\r\n]", _DEEPSEEK_LLM_LETTERS, _DEEPSEEK_LLM_PUNCT, r"\s+$", _CJK_DEEPSEEK, r"\p{N}+"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_DEEPSEEK, r"\p{N}"),
    "deepseek-v3": (
        r"\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
}
PRE_ALIASES = {
    "llama-bpe": "llama3", "llama-v3": "llama3", "gpt2": "gpt-2", "mpt": "gpt-2", "olmo": "gpt-2", "phi-2": "gpt-2",
    "starcoder": "smollm", "refact": "smollm", "command-r": "smollm", "deepseek-r1-qwen": "qwen2",
}


# -- character classes as predicates over a feature (major, white_space, set bits, ASCII cp) --

class _Cat:
    def __init__(self, major: str):
        self.major = major

    def __call__(self, feat) -> bool:
        return feat[0] == self.major


class _Space:
    def __call__(self, feat) -> bool:
        return feat[1]


class _InSet:
    """Membership in explicit ranges: tested directly on ASCII, by feature bit on placeholders."""

    def __init__(self, ranges: "_Ranges", bit: int | None):
        self.ranges, self.bit = ranges, bit

    def __call__(self, feat) -> bool:
        if feat[3] is not None:
            return feat[3] in self.ranges
        return self.bit is not None and bool(feat[2] >> self.bit & 1)


class _Union:
    def __init__(self, items: list, negate: bool = False):
        self.items, self.negate = items, negate

    def __call__(self, feat) -> bool:
        return any(p(feat) for p in self.items) != self.negate


class _Ranges:
    """An explicit set of code points, as sorted disjoint [lo, hi] ranges."""

    def __init__(self, ranges: list[tuple[int, int]]):
        merged: list[list[int]] = []
        for lo, hi in sorted(ranges):
            if merged and lo <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.los = [lo for lo, _ in merged]
        self.his = [hi for _, hi in merged]

    def __contains__(self, cp: int) -> bool:
        i = bisect_right(self.los, cp) - 1
        return i >= 0 and cp <= self.his[i]

    def has_non_ascii(self) -> bool:
        return bool(self.his) and self.his[-1] >= 0x80


class _Translator:
    """Parses the supported regex subset once and renders it over the shadow alphabet."""

    def __init__(self):
        self.sets: list[_Ranges] = []  # the explicit sets with non-ASCII members, one bit each

    def feature(self, cp: int) -> tuple:
        major, ws = unicodedata.category(chr(cp))[0], cp in WHITE_SPACE
        if cp < 128:
            return major, ws, 0, cp
        bits = 0
        for k, s in enumerate(self.sets):
            if cp in s:
                bits |= 1 << k
        return major, ws, bits, None

    def add_set(self, ranges: list[tuple[int, int]]) -> _InSet:
        s = _Ranges(ranges)
        if not s.has_non_ascii():
            return _InSet(s, None)
        self.sets.append(s)
        return _InSet(s, len(self.sets) - 1)

    # parse: regex text -> list of ("lit", str) | ("cls", predicate) tokens
    def parse(self, src: str) -> list:
        out, i, fold = [], 0, []  # fold: stack of "inside (?i:" flags per open group
        while i < len(src):
            c = src[i]
            if c == "\\":
                atom, i = self._escape(src, i)
                out.append(("cls", atom) if not isinstance(atom, str) else self._literal(atom, fold))
                continue
            if c == "[":
                pred, i = self._class(src, i)
                out.append(("cls", pred))
                continue
            if c == "(":
                for opener, emit, folding in (("(?i:", "(?:", True), ("(?:", "(?:", False), ("(?!", "(?!", False), ("(?=", "(?=", False)):
                    if src.startswith(opener, i):
                        break
                else:
                    if src.startswith("(?", i):
                        raise ValueError(f"unsupported group at {i} in {src!r}")
                    opener, emit, folding = "(", "(?:", False
                out.append(("raw", emit))
                fold.append(folding or bool(fold and fold[-1]))
                i += len(opener)
                continue
            if c == ")":
                fold.pop()
                out.append(("raw", ")"))
            elif c == "$":
                out.append(("raw", r"\Z"))  # Python's $ also matches before a final newline
            elif c in "|?*+":
                out.append(("raw", c))
            elif c == "{":
                j = src.index("}", i)
                out.append(("raw", src[i : j + 1]))
                i = j
            elif c in ".^":
                raise ValueError(f"unsupported {c!r} in {src!r}")
            else:
                out.append(self._literal(c, fold))
            i += 1
        return out

    def _literal(self, ch: str, fold: list) -> tuple:
        if fold and fold[-1] and ch.isascii() and ch.isalpha():
            # Oniguruma's (?i:) uses simple case folding: 's' also matches U+017F LONG S
            partners = [ord(ch.lower()), ord(ch.upper())]
            partners += [cp for cp in _FOLD_PARTNERS.get(ch.lower(), ())]
            return ("cls", self.add_set([(cp, cp) for cp in partners]))
        if not ch.isascii():
            return ("cls", self.add_set([(ord(ch), ord(ch))]))
        return ("lit", ch)

    def _escape(self, src: str, i: int):
        c = src[i + 1]
        if c == "p":
            j = src.index("}", i)
            name = src[i + 3 : j]
            if len(name) != 1 or name not in _MAJORS:
                raise ValueError(f"unsupported \\p{{{name}}} in {src!r}")
            return _Cat(name), j + 1
        if c == "s":
            return _Space(), i + 2
        if c == "S":
            return _Union([_Space()], negate=True), i + 2
        if c in "rnt":
            return {"r": "\r", "n": "\n", "t": "\t"}[c], i + 2
        if c.isalnum():
            raise ValueError(f"unsupported escape \\{c} in {src!r}")
        return c, i + 2

    def _class(self, src: str, i: int):
        i += 1
        negate = src[i] == "^"
        if negate:
            i += 1
        items, ranges = [], []
        first = True
        while first or src[i] != "]":
            first = False
            if src[i] == "\\":
                atom, i = self._escape(src, i)
                if not isinstance(atom, str):
                    items.append(atom)
                    continue
                lo = atom
            else:
                lo, i = src[i], i + 1
            if src[i] == "-" and src[i + 1] != "]":
                if src[i + 1] == "\\":
                    hi, i = self._escape(src, i + 1)
                else:
                    hi, i = src[i + 1], i + 2
                ranges.append((ord(lo), ord(hi)))
            else:
                ranges.append((ord(lo), ord(lo)))
        if ranges:
            items.append(self.add_set(ranges))
        return _Union(items, negate), i + 1


_FOLD_PARTNERS = {"s": (0x17F,), "k": (0x212A,)}  # the only non-ASCII chars whose casefold is one ASCII letter


def _char_class(members: list[int]) -> str:
    """Render code points as a `re` class, compressing runs into ranges."""
    if not members:
        return "(?!)"
    parts, start, prev = [], members[0], members[0]
    for cp in members[1:] + [None]:
        if cp is not None and cp == prev + 1:
            prev = cp
            continue
        parts.append(f"\\U{start:08x}" if start == prev else f"\\U{start:08x}-\\U{prev:08x}")
        if cp is not None:
            start = prev = cp
    return "[" + "".join(parts) + "]"


class PreTokenizer:
    """Splits text into pre-tokens by a `tokenizer.ggml.pre` regex list."""

    def __init__(self, name: str):
        canonical = PRE_ALIASES.get(name, name)
        if canonical not in PRE_REGEXES:
            known = ", ".join(sorted({*PRE_REGEXES, *PRE_ALIASES}))
            raise ReflexError(f"unsupported pre-tokenizer {name!r} (tokenizer.ggml.pre); supported: {known}")
        self.name = name
        tr = _Translator()
        parsed = [tr.parse(src) for src in PRE_REGEXES[canonical]]
        if len(tr.sets) > _MAX_SETS:
            raise ValueError(f"pre-tokenizer {name!r} needs {len(tr.sets)} explicit sets, over {_MAX_SETS}")
        self._translator = tr
        n_sets = len(tr.sets)
        # Every placeholder's feature, indexed by placeholder - _PLACEHOLDER_BASE.
        feats = [(m, ws, bits, None) for m in _MAJORS for ws in (False, True) for bits in range(1 << n_sets)]
        alphabet = [(cp, tr.feature(cp)) for cp in range(128)]
        alphabet += [(_PLACEHOLDER_BASE + k, f) for k, f in enumerate(feats)]
        self._index = {f: _PLACEHOLDER_BASE + k for k, f in enumerate(feats)}
        self._patterns = [re.compile("".join(self._render(tok, alphabet) for tok in toks)) for toks in parsed]
        self._shadow = _ShadowMap(self)

    @staticmethod
    def _render(tok: tuple, alphabet: list) -> str:
        kind, value = tok
        if kind == "raw":
            return value
        if kind == "lit":
            return re.escape(value)
        return _char_class([cp for cp, feat in alphabet if value(feat)])

    def placeholder(self, cp: int) -> int:
        return self._index[self._translator.feature(cp)]

    def split(self, text: str) -> list[str]:
        """The pre-tokens of `text`, in order; they concatenate back to `text`."""
        shadow = text if text.isascii() else text.translate(self._shadow)
        bounds = [(0, len(text))]
        for pattern in self._patterns:
            cut = []
            for start, end in bounds:
                pos = start
                for m in pattern.finditer(shadow, start, end):
                    s, e = m.span()
                    if s > pos:
                        cut.append((pos, s))  # text no alternative matched stays a piece of its own
                    cut.append((s, e))
                    pos = e
                if pos < end:
                    cut.append((pos, end))
            bounds = cut
        return [text[s:e] for s, e in bounds]


class _ShadowMap(dict):
    """str.translate table: ASCII to itself, anything else to its placeholder; filled lazily."""

    def __init__(self, pre: PreTokenizer):
        super().__init__()
        self._pre = pre

    def __missing__(self, cp: int) -> int:
        value = cp if cp < 128 else self._pre.placeholder(cp)
        self[cp] = value
        return value
