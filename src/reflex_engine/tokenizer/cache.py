"""The tokenizer's sidecar section: the loaded vocabulary tables, keyed by a fingerprint.

Reading 150k tokens and 150k merges out of the GGUF and checking them costs tens of ms;
`reflex prepare` stores the result (plain lists/dicts, marshal-friendly) in `<model>.reflex`.
The section is used only when its fingerprint equals that of the raw bytes of every
`tokenizer.*` entry of the open file and its tables have the expected shape; anything else
(stale, corrupt, another version) is ignored and the vocabulary is read from the GGUF.
"""
from __future__ import annotations

from .. import sidecar
from .vocab import Vocab, load_vocab

SECTION = "tokenizer"
_VERSION = 1


def tokenizer_fingerprint(gguf_file) -> tuple:
    spans = sorted(span for key, span in gguf_file.spans.items() if key.startswith("tokenizer."))
    data = b"".join(gguf_file.raw_bytes(start, end) for start, end in spans)
    return (_VERSION, *sidecar.fingerprint(data))


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
    n = len(vocab.tokens) if isinstance(vocab.tokens, list) else -1
    shape_ok = (
        n > 0
        and isinstance(vocab.types, bytes) and len(vocab.types) == n
        and isinstance(vocab.scores, list) and len(vocab.scores) in (0, n)
        and isinstance(vocab.merges, list)
        and vocab.kind in ("bpe", "spm")
        and all(i is None or (isinstance(i, int) and 0 <= i < n) for i in (vocab.bos_id, vocab.eos_id, vocab.unk_id, *vocab.eog_ids))
    )
    return vocab if shape_ok else None
