"""A GGUF's vocabulary (tokenizer.* keys) to a Tokenizer: load_vocab's checks, then encode and
decode on whatever vocabulary got through. Opening the file or loading the vocabulary may raise
ReflexError, nothing else; a tokenizer that loads encodes to ids in range and decodes every id.
"""
from __future__ import annotations

import common

with common.instrumented():
    from reflex_engine.errors import ReflexError
    from reflex_engine.gguf import GGUFFile
    from reflex_engine.tokenizer import Tokenizer

PATH = common.scratch_path("vocab.gguf")
REACHES_NATIVE = True  # tools/fuzz.sh replays its corpus through the sanitizer build of _native.c
MAX_LEN = 1 << 15
TEXTS = ["Hello world! 123", " <|im_end|>x<s></s>\n\n  \t", "\u00e9\u4e2d\U0001f680 \u2581a\u2581b", ""]


def one_input(data: bytes) -> None:
    common.write(PATH, data)
    try:
        with GGUFFile(PATH, use_sidecar=False) as f:
            tok = Tokenizer.from_gguf(f, use_cache=False)
    except ReflexError as e:
        assert "\n" not in str(e), str(e)
        return
    n = tok.n_vocab
    assert all(0 <= i < n for i in tok.eog_ids) and all(
        i is None or 0 <= i < n for i in (tok.bos_id, tok.eos_id, tok.vocab.unk_id))
    for text in TEXTS:
        for parse_special in (False, True):
            try:
                ids = tok.encode(text, add_bos=None, parse_special=parse_special)
            except ReflexError as e:  # a vocabulary that cannot spell the text
                assert "\n" not in str(e), str(e)
                continue
            assert all(type(i) is int and 0 <= i < n for i in ids), ids
            stream = tok.stream(continuation=False)
            assert "".join(map(stream.feed, ids)) + stream.flush() == tok.decode(ids)
    ids = range(min(n, 4096))
    assert isinstance(tok.decode(ids, special=True), str) and isinstance(tok.decode(ids), str)


def seeds() -> dict[str, bytes]:
    import glob
    import os
    import tempfile

    import make_fixtures as m
    from fuzz_gguf import metadata_only

    def vocab(**kv) -> bytes:
        return m.raw_gguf(m.Spec(kvs=[("general.architecture", m.T_STRING, "llama")] + [
            (f"tokenizer.ggml.{k}", t, v) for k, (t, v) in kv.items()]))

    def strings(items):
        return (m.T_ARRAY, (m.T_STRING, items))

    spm_tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581", "\u2581a", "b", "\u2581ab"]
    out = {
        "toy-bpe": vocab(model=(m.T_STRING, "gpt2"), pre=(m.T_STRING, "qwen2"), tokens=strings(["a", "b", "ab", "<|end|>"]),
                         token_type=(m.T_ARRAY, (m.T_INT32, [1, 1, 1, 3])), merges=strings(["a b"]),
                         eos_token_id=(m.T_UINT32, 3)),
        "toy-spm": vocab(model=(m.T_STRING, "llama"), tokens=strings(spm_tokens),
                         scores=(m.T_ARRAY, (m.T_FLOAT32, [0.0] * (len(spm_tokens) - 3) + [-1.0, -2.0, -3.0])),
                         token_type=(m.T_ARRAY, (m.T_INT32, [2, 3, 3] + [6] * 256 + [1] * 4)),
                         add_space_prefix=(m.T_BOOL, True)),
    }
    with tempfile.TemporaryDirectory() as d:
        m.write_model_fixture(os.path.join(d, "tiny.gguf"))
        out["tiny-llama-mixed"] = metadata_only(os.path.join(d, "tiny.gguf"))
    for path in sorted(glob.glob(os.path.join(common.ROOT, "tests", "goldens", "*", "*-Q8_0.gguf"))):
        out[os.path.basename(path)] = metadata_only(path)
    return out


if __name__ == "__main__":
    common.fuzz(one_input, max_len=MAX_LEN, dictionary="gguf.dict")
