"""The tokenizer on arbitrary text and arbitrary ids, with real vocabularies: Qwen2's byte-level BPE
(151,936 tokens), Llama's SentencePiece (32,000, byte fallback) and the Llama 3 golden's BPE.

Properties: encode gives ids in range and raises nothing; decode(encode(text)) == text for plain
text (SPM: without U+2581, its space; for BPE also with special tokens parsed, then decoded with special=True); streaming decode
adds up to decode; decoding any ids gives text, or ReflexError for an id out of range.
Input: the first byte picks how the rest becomes text (UTF-8, Latin-1, or UTF-16 with lone
surrogates, which encode replaces by U+FFFD as documented).
"""
from __future__ import annotations

import functools
import os

import common

with common.instrumented():
    from reflex_engine.errors import ReflexError
    from reflex_engine.gguf import GGUFFile
    from reflex_engine.tokenizer import Tokenizer

MAX_LEN = 4096
GOLDEN_LLAMA3 = os.path.join(common.ROOT, "tests", "goldens", "llama3", "llama3-Q8_0.gguf")


@functools.lru_cache(maxsize=None)
def tokenizers() -> tuple[Tokenizer, ...]:
    from reference_files import vocab_path  # llama.cpp's vocab files, fetched once (tests/reference_files.py)

    paths = [str(vocab_path("qwen2")), str(vocab_path("llama-spm")), GOLDEN_LLAMA3]
    return tuple(Tokenizer.from_gguf(GGUFFile(p, use_sidecar=False), use_cache=False) for p in paths)


def text_of(data: bytes) -> str:
    mode, rest = (data[0] % 3, data[1:]) if data else (0, b"")
    if mode == 0:
        return rest.decode("utf-8", "replace")
    if mode == 1:
        return rest.decode("latin-1")
    return rest[: len(rest) & ~1].decode("utf-16-le", "surrogatepass")


def one_input(data: bytes) -> None:
    text = text_of(data)
    clean = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")  # what encode reads
    for tok in tokenizers():
        plain = tok.encode(text, add_bos=False, parse_special=False)
        _check_ids(tok, plain)
        if tok.kind == "bpe" or "\u2581" not in clean:  # SPM reads U+2581 as its space, and so decodes it
            assert tok.decode(plain) == clean, (tok.pre, text)
        special = tok.encode(text, add_bos=True, parse_special=True)
        _check_ids(tok, special)
        if tok.kind == "bpe":  # SPM prefixes a space after each special token, as llama.cpp does
            assert tok.decode(special[1:], special=True) == clean, (tok.pre, text)
        stream = tok.stream(continuation=False)
        assert "".join(map(stream.feed, special)) + stream.flush() == tok.decode(special)
        _decode_ids(tok, data)


def _check_ids(tok: Tokenizer, ids: list[int]) -> None:
    assert all(type(i) is int and 0 <= i < tok.n_vocab for i in ids), ids


def _decode_ids(tok: Tokenizer, data: bytes) -> None:
    """The input's bytes as ids, a few of them out of range."""
    ids = [v % (tok.n_vocab + 2) for v in common.u32s(data[1:])]
    try:
        text = tok.decode(ids, special=bool(data[:1] and data[0] & 8))
    except ReflexError as e:
        assert any(i >= tok.n_vocab for i in ids) and "out of range" in str(e), str(e)
        return
    assert isinstance(text, str) and all(i < tok.n_vocab for i in ids)


def seeds() -> dict[str, bytes]:
    from tokenizer_corpus import FIXED, random_texts

    out = {}
    for i, text in enumerate(FIXED + random_texts(20)):
        out[f"utf8-{i}"] = b"\x00" + text.encode("utf-8", "surrogatepass")
    out["latin1"] = b"\x01" + bytes(range(256))
    out["utf16-surrogates"] = b"\x02" + "a\ud800b\udfffc".encode("utf-16-le", "surrogatepass")
    out["ids"] = b"\x03" + bytes(range(64))
    return out


if __name__ == "__main__":
    common.fuzz(one_input, max_len=MAX_LEN)
