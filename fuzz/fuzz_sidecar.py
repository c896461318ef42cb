"""The `reflex prepare` cache file (`MODEL.reflex`, src/reflex_engine/sidecar.py) beside a valid GGUF:
its prefix, header and sections, the reader's layout index and the tokenizer's tables.

The first byte picks what the rest is:
- 0: the whole MODEL.reflex, as found on disk;
- 1, 2: edits to the true "layout" or "tokenizer" section (4 bytes each: which field, how, and a
  value), written back with valid crcs, the layout's crcs recomputed over the file's bytes from
  each entry's start to its end and the tokenizer's fingerprint kept, so that the section's
  content is what is tried, as a crafted file would have it. (Edits rather than marshal bytes
  from the fuzzer: marshal is not safe on crafted data, which sidecar.py never gives it.)
read_section never raises; opening the GGUF and loading its tokenizer raise ReflexError or
nothing; a tokenizer that loads encodes to ids in range and decodes. For mode 0, a sidecar that
reads as missing or as the true one gives exactly what the GGUF alone gives.
"""
from __future__ import annotations

import functools
import marshal
import os
import zlib

import common

with common.instrumented():
    from reflex_engine import sidecar
    from reflex_engine.errors import ReflexError
    from reflex_engine.gguf import GGUFFile, LazyArray, layout_section
    from reflex_engine.tokenizer import Tokenizer, prepare_tokenizer
    from reflex_engine.tokenizer.cache import SECTION as TOKENIZER

REACHES_NATIVE = True  # tools/fuzz.sh replays its corpus through the sanitizer build of _native.c
MAX_LEN = 1 << 16
GGUF = common.scratch_path("prepared.gguf")
GOLDEN = os.path.join(common.ROOT, "tests", "goldens", "qwen3", "qwen3-Q8_0.gguf")
TEXTS = ["Hello world! 123", "<|im_start|>user\nhi<|im_end|>", "\u00e9\u4e2d\U0001f680 x"]


@functools.lru_cache(maxsize=None)
def reference() -> tuple:
    """The GGUF (the golden's metadata), its true sections, and what it gives without a sidecar."""
    from fuzz_gguf import metadata_only

    data = metadata_only(GOLDEN)
    common.write(GGUF, data)
    f = GGUFFile(GGUF, use_sidecar=False)
    sections = {"layout": layout_section(f), TOKENIZER: prepare_tokenizer(f)}
    return data, sections, _outcome(use_sidecar=False)


def _outcome(use_sidecar: bool):
    try:
        with GGUFFile(GGUF, use_sidecar=use_sidecar) as f:
            arrays = {k: (v.start, v.end, v.count) for k, v in f.metadata.items() if isinstance(v, LazyArray)}
            tok = Tokenizer.from_gguf(f, use_cache=use_sidecar)
    except ReflexError as e:
        assert "\n" not in str(e), str(e)
        return ("error", str(e))
    encoded = []
    for text in TEXTS:
        try:
            ids = tok.encode(text)
        except ReflexError:
            encoded.append(None)
            continue
        assert all(type(i) is int and 0 <= i < tok.n_vocab for i in ids), ids
        try:
            encoded.append((ids, tok.decode(ids, special=True)))
        except ReflexError:
            encoded.append((ids, None))
    return ("ok", arrays, encoded)


def _values(n: int) -> list:
    return [None, 0, 1, -1, n - 1, n, n + 1, 1 << 31, 1 << 63, True, "", "spm", "bpe", "qwen2", "llama-bpe",
            b"", b"\x00" * 4, b"\xff" * 8, (), [], [n], [0, n], {}, 0.5]


def _edited(value, edits: bytes, n: int):
    """`value` (a section: dicts, tuples, lists, bytes, ints) with the edits applied."""
    for at in range(0, len(edits) - 3, 4):
        value = _edit(value, edits[at : at + 4], n)
    return value


def _edit(value, edit: bytes, n: int):
    pick, how, arg = edit[0], edit[1], int.from_bytes(edit[2:4], "little")
    if isinstance(value, dict) and value:
        key = sorted(value, key=str)[pick % len(value)]
        return {**value, key: _edit(value[key], bytes([pick // len(value), how]) + edit[2:], n)}
    if isinstance(value, (tuple, list)) and value and how % 4:
        i = pick % len(value)
        items = list(value)
        items[i] = _edit(items[i], bytes([pick // len(value), how >> 2]) + edit[2:], n)
        return type(value)(items)
    if isinstance(value, bytes) and how % 4 == 1:
        return value[: arg % (len(value) + 1)]
    if isinstance(value, bytes) and how % 4 == 2 and value:
        at = arg % len(value)
        return value[:at] + bytes([value[at] ^ (1 << (pick % 8))]) + value[at + 1 :]
    if isinstance(value, int) and not isinstance(value, bool) and how % 4 == 3:
        return value + (arg - 32768)
    choices = _values(n)
    return choices[arg % len(choices)]


def _layout_with_true_crcs(layout, data: bytes):
    if not isinstance(layout, dict):
        return layout
    fixed = {}
    for key, entry in layout.items():
        if (isinstance(entry, tuple) and len(entry) == 4 and all(type(v) is int for v in entry)
                and 0 <= entry[0] <= entry[2] <= len(data)):
            entry = (*entry[:3], zlib.crc32(data[entry[0] : entry[2]]))
        fixed[key] = entry
    return fixed


def one_input(blob: bytes) -> None:
    data, sections, alone = reference()
    mode, rest = (blob[0] % 3, blob[1:]) if blob else (0, b"")
    if mode == 0:
        common.write(sidecar.sidecar_path(GGUF), rest)
    else:
        name = "layout" if mode == 1 else TOKENIZER
        section = _edited(sections[name], rest, len(sections[TOKENIZER]["vocab"]["types"]))
        if mode == 1:
            section = _layout_with_true_crcs(section, data)
        else:
            section = {**section, "fingerprint": sections[TOKENIZER]["fingerprint"]} if isinstance(section, dict) else section
        sidecar.write_sections(GGUF, {name: section})
    read = {name: sidecar.read_section(GGUF, name) for name in sections}
    got = _outcome(use_sidecar=True)
    if mode == 0 and all(read[name] in (None, sections[name]) for name in sections):
        assert got == alone, (got, alone)


def seeds() -> dict[str, bytes]:
    _, sections, _ = reference()
    sidecar.write_sections(GGUF, sections)
    with open(sidecar.sidecar_path(GGUF), "rb") as f:
        true_file = f.read()
    out = {
        "file": b"\x00" + true_file,
        "file-truncated": b"\x00" + true_file[: len(true_file) // 2],
        "file-header-only": b"\x00" + true_file[:64],
        "file-old-format": b"\x00" + marshal.dumps({"format": 2, "sections": []}),
        "marshal-bomb": b"\x00(\xff\xff\xff\x7f",
        "layout": b"\x01",
    }
    for i, field in enumerate(sorted(sections[TOKENIZER]["vocab"])):
        out[f"tables-{field}"] = b"\x02" + bytes([1 + 2 * i, 0]) + bytes(2)
    for i in range(4):
        out[f"layout-end-{i}"] = b"\x01" + bytes([i, 0b1101, 8, 0x80])
    return out


if __name__ == "__main__":
    common.fuzz(one_input, max_len=MAX_LEN)
