"""Constrained decoding: a JSON schema, any JSON object, a regex or a grammar turned into a
token mask per step by llguidance (docs/perf-notes.md, issue 15, says why that engine).

Standard library at import: llguidance (the `structured` extra) is imported only when a
constraint is compiled, so a request without one never loads it.
"""
from __future__ import annotations

import ctypes
import json
import weakref
from typing import NamedTuple

from .errors import ReflexError

KINDS = ("json_schema", "json_object", "regex", "grammar")
# Fixed separators: a flexible-whitespace JSON grammar lets a small model pad forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_vocabularies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> llguidance's tokenizer


class ConstraintError(ReflexError):
    """A schema, regex or grammar the engine cannot compile."""


class Constraint(NamedTuple):
    """What the output must match: kind (one of KINDS) and its source text (a JSON schema as
    JSON text, a regex, a Lark or GBNF grammar; empty for json_object)."""

    kind: str
    source: str = ""


def json_schema(schema) -> Constraint:
    """A JSON schema, as a dict or as JSON text."""
    return Constraint("json_schema", schema if isinstance(schema, str) else json.dumps(schema))


def json_object() -> Constraint:
    return Constraint("json_object")


def regex(pattern: str) -> Constraint:
    return Constraint("regex", pattern)


def grammar(text: str) -> Constraint:
    """A grammar in llguidance's Lark dialect or llama.cpp's GBNF."""
    return Constraint("grammar", text)


class Guide:
    """One generation's grammar state: the mask of tokens allowed next, packed as llguidance
    writes it (bit i of 32-bit word j allows token 32j + i: the form a device can upload)."""

    def __init__(self, matcher, n_vocab: int):
        self._matcher = matcher
        self._mask = (ctypes.c_uint32 * ((n_vocab + 31) // 32))()

    def mask(self):
        """The packed mask for the next token (one buffer, rewritten every step)."""
        self._matcher.unsafe_compute_mask_ptr(ctypes.addressof(self._mask), ctypes.sizeof(self._mask))
        return self._mask

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise ReflexError(f"internal error: the grammar refused token {token} its own mask allowed: {self._matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The output is complete: the grammar allows nothing more but the end."""
        return self._matcher.is_stopped()


def start(constraint: Constraint, tokenizer) -> Guide:
    """The compiled constraint, ready for its first token; ConstraintError for a bad one."""
    llg = _llguidance()
    if constraint.kind not in KINDS:
        raise ConstraintError(f"unknown constraint kind {constraint.kind!r} (one of {', '.join(KINDS)})")
    source = _grammar_source(llg, constraint)
    matcher = llg.LLMatcher(_vocabulary(llg, tokenizer), source, log_level=0)
    if matcher.is_error():
        raise ConstraintError(f"invalid {constraint.kind.replace('_', ' ')}: {_one_line(matcher.get_error())}")
    return Guide(matcher, tokenizer.n_vocab)


def _grammar_source(llg, c: Constraint) -> str:
    try:
        if c.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if c.kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(c.source, defaults=JSON_OPTIONS)
        if c.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(c.source)
        return llg.grammar_from("grammar", c.source)  # Lark as is, GBNF converted to Lark
    except (ValueError, TypeError) as e:  # not JSON, or a GBNF the converter cannot read
        raise ConstraintError(f"invalid {c.kind.replace('_', ' ')}: {_one_line(str(e))}") from None


def _vocabulary(llg, tokenizer):
    """llguidance's view of the vocabulary, built once per tokenizer (151k tokens: ~0.9 s, docs/perf-notes.md)."""
    vocab = _vocabularies.get(tokenizer)
    if vocab is None:
        vocab = _vocabularies[tokenizer] = llg.LLTokenizer(llg.TokenizerWrapper(_Encoder(tokenizer)),
                                                           eos_token=sorted(tokenizer.eog_ids) or None)
    return vocab


class _Encoder:
    """The attributes and call llguidance's TokenizerWrapper reads off a tokenizer."""

    def __init__(self, tokenizer):
        from .tokenizer.vocab import CONTROL, USER_DEFINED

        types = tokenizer.vocab.types
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eog_ids, default=0)
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
        self.tokens = token_bytes(tokenizer)
        for i in self.special_token_ids:
            # llguidance's mark of a special token (as its llama.cpp binding): never text in a grammar
            if types[i] == CONTROL or self.tokens[i][:1] == b"<" and self.tokens[i][-1:] == b">":
                self.tokens[i] = b"\xff" + self.tokens[i]
        self._tokenizer = tokenizer

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tokenizer.encode(text, add_bos=False, parse_special=False)


def token_bytes(tokenizer) -> list[bytes]:
    """Every token's Tokenizer.token_bytes, a byte-level BPE's normal tokens through the C charmap
    codec (one GPT-2 character, one byte) rather than a Python step per character: for 151k
    tokens ~0.05 s, not ~0.8."""
    import codecs
    from itertools import accumulate

    from .tokenizer.bpe import BYTE_TO_UNICODE
    from .tokenizer.vocab import NORMAL

    vocab = tokenizer.vocab
    if tokenizer.kind != "bpe":
        return [tokenizer.token_bytes(i) for i in range(tokenizer.n_vocab)]
    table = codecs.charmap_build("".join(BYTE_TO_UNICODE))
    normal = [i for i, kind in enumerate(vocab.types) if kind == NORMAL]
    texts = [vocab.tokens[i] for i in normal]
    out: list = [None] * tokenizer.n_vocab
    try:
        data = codecs.charmap_encode("".join(texts), "strict", table)[0]
        for i, a, b in zip(normal, accumulate(map(len, texts), initial=0), accumulate(map(len, texts))):
            out[i] = data[a:b]
    except UnicodeEncodeError:  # a character outside the byte table (it stands for its UTF-8): token_bytes has it
        pass
    return [piece if piece is not None else tokenizer.token_bytes(i) for i, piece in enumerate(out)]


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ReflexError("constraints need llguidance: pip install 'reflex-engine[structured]'") from None
    return llguidance


def _one_line(message: str) -> str:
    return " ".join(message.split())[:500]
