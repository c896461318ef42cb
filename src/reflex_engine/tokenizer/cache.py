"""The tokenizer's sidecar section: the loaded vocabulary tables, keyed by a fingerprint.

Reading 150k tokens and 150k merges out of the GGUF, checking and indexing them costs 200+ ms;
`reflex prepare` stores the result (byte blobs and arrays, see strings.py) in `<model>.reflex`.
The section is used only when its fingerprint equals that of the raw bytes of every
`tokenizer.*` entry of the open file and its tables have the expected sizes; anything else
(stale, corrupt, another version or byte order) is ignored and the vocabulary is read from
the GGUF.
"""
from __future__ import annotations

import sys
import zlib

from .. import sidecar
from .vocab import Vocab, load_vocab

SECTION = "tokenizer"
_VERSION = 2
_CHUNK = 1 << 16


def tokenizer_fingerprint(gguf_file) -> tuple:
    """(version, byte order, length, crc32) of the concatenated tokenizer.* entries."""
    spans = sorted(span for key, span in gguf_file.spans.items() if key.startswith("tokenizer."))
    length = crc = 0
    # In small slices: copying 3.6 MB (qwen2) at once into fresh memory costs more in page
    # faults (~5 ms on a cold start) than the crc itself; 64 KiB blocks are reused by malloc.
    for start, end in spans:
        for at in range(start, end, _CHUNK):
            block = gguf_file.raw_bytes(at, min(at + _CHUNK, end))
            length, crc = length + len(block), zlib.crc32(block, crc)
    return (_VERSION, sys.byteorder, length, crc)


def prepare_tokenizer(gguf_file) -> dict:
    """The sidecar section for this file (for sidecar.write_sections)."""
    return {"fingerprint": tokenizer_fingerprint(gguf_file), "vocab": load_vocab(gguf_file).to_tables()}


def load_vocab_cached(gguf_file, use_cache: bool = True) -> Vocab:
    if use_cache:
        vocab = _from_section(sidecar.read_section(gguf_file.path, SECTION), gguf_file)
        if vocab is not None:
            return vocab
    return load_vocab(gguf_file)


def _from_section(section, gguf_file) -> Vocab | None:
    if not isinstance(section, dict) or section.get("fingerprint") != tokenizer_fingerprint(gguf_file):
        return None
    try:
        vocab = Vocab.from_tables(section["vocab"])
    except (KeyError, TypeError, ValueError):
        return None
    n = len(vocab.tokens)
    shape_ok = (
        n > 0
        and isinstance(vocab.types, bytes) and len(vocab.types) == n
        and len(vocab.scores) == (n if vocab.kind == "spm" else 0)
        and vocab.kind in ("bpe", "spm")
        and (vocab.pre is None or isinstance(vocab.pre, str))
        and isinstance(vocab.eog_ids, list)
        and all(i is None or (type(i) is int and 0 <= i < n)
                for i in (vocab.bos_id, vocab.eos_id, vocab.eot_id, vocab.eom_id, vocab.unk_id, vocab.pad_id,
                          vocab.sep_id, *vocab.eog_ids))
    )
    return vocab if shape_ok else None
