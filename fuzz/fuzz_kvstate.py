"""The KV state loader (kvstate.py): a state file from the fuzzer imported into a generation on the
qwen3 golden (CPU, 64 positions), as `--import-kv FILE` does.

The first byte picks what the rest is:
- 0: the whole file, as found on disk (random damage to its header fails the header's crc32);
- 1: the header's JSON, written here into the true file with a valid prefix and crc, so that the
  header's fields are what is tried, as a crafted file would have them.
Importing raises ReflexError (or nothing), never anything else; what it continues is tokens in
the vocabulary, one at most since the generation asks for one.
"""
from __future__ import annotations

import functools
import os
import zlib

import common
import numpy

with common.instrumented():
    from reflex_engine import kvstate
    from reflex_engine.errors import ReflexError
    from reflex_engine.sampling import SamplingParams

# Greedy, the plainest sampler: damaged arrays' non-finite logits are a ReflexError before any sampler sees them
# (tests/test_fuzz.py test_nan_logits_from_a_damaged_kv_state_are_a_clean_error).
GREEDY = SamplingParams(temperature=0.0)

PATH = common.scratch_path("state.kv")
MAX_LEN = 1 << 16
MODEL = os.path.join(common.ROOT, "tests", "goldens", "qwen3", "qwen3-Q8_0.gguf")


@functools.lru_cache(maxsize=None)
def model():
    import reflex_engine

    return reflex_engine.load(MODEL, device="cpu", n_ctx=64)


@functools.lru_cache(maxsize=None)
def true_state() -> tuple[bytes, bytes, bytes]:
    """A state the engine wrote: (its bytes, the arrays before its header, its header)."""
    path = common.scratch_path("true.kv")
    list(model().generate("The cat sat", max_tokens=2, export_kv=path))
    with open(path, "rb") as f:
        data = f.read()
    _, _, _, offset, length = kvstate._PREFIX.unpack_from(data)
    return data, data[kvstate._PREFIX.size : offset], data[offset : offset + length]


def with_header(header: bytes) -> bytes:
    _, arrays, _ = true_state()
    offset = kvstate._PREFIX.size + len(arrays)
    prefix = kvstate._PREFIX.pack(kvstate.MAGIC, kvstate.FORMAT, zlib.crc32(header), offset, len(header))
    return prefix + arrays + header


def one_input(data: bytes) -> None:
    mode, rest = (data[0] & 1, data[1:]) if data else (0, b"")
    common.write(PATH, rest if mode == 0 else with_header(rest))
    m = model()
    try:
        # a damaged array's huge values overflow the CPU reference's sums on their way to the non-finite logits the
        # engine refuses (ReflexError): numpy's warning about it is that path, not a finding
        with numpy.errstate(over="ignore"):
            gen = m.generate([], max_tokens=1, import_kv=PATH, sampling=GREEDY)
            events = list(gen)
    except ReflexError as e:
        assert "\n" not in str(e), str(e)
        return
    assert len(gen.tokens) <= 1 and all(0 <= t < m.config.n_vocab for t in gen.tokens), gen.tokens
    assert len(events) >= len(gen.tokens)


def seeds() -> dict[str, bytes]:
    data, _, header = true_state()
    return {
        "file": b"\x00" + data,
        "file-truncated": b"\x00" + data[: len(data) // 2],
        "header": b"\x01" + header,
        "header-other-model": b"\x01" + header.replace(b'"fingerprint":"', b'"fingerprint":"0', 1),
        "header-nested": b"\x01" + b"[" * 50 + b"]" * 50,
    }


if __name__ == "__main__":
    common.fuzz(one_input, max_len=MAX_LEN)
