"""The vocabulary as the GGUF's `tokenizer.*` keys describe it, checked against the file.

Follows llama.cpp's llama_vocab::impl::load (src/llama-vocab.cpp): per-model defaults for the
special ids and flags, overridden by the file; out-of-range special ids are ignored (the
default is kept) as llama.cpp does; end-of-generation ids include tokens found by their
text. The result is packed (`Strings`, bytes, arrays) so that the sidecar can store it as a
few byte blobs (`to_tables` / `from_tables`) that load without building per-token objects.
"""
from __future__ import annotations

import re
from array import array
from typing import NamedTuple

from ..errors import ReflexError
from ..gguf.constants import ValueType
from .strings import Strings

# tokenizer.ggml.token_type values
UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 0, 1, 2, 3, 4, 5, 6

KIND_BY_MODEL = {"gpt2": "bpe", "llama": "spm"}
# (bos, eos, unk) defaults before the file overrides them, as llama.cpp.
_DEFAULT_IDS = {"bpe": (11, 11, None), "spm": (1, 2, 0)}
_SPECIAL_KEYS = ("bos", "eos", "eot", "eom", "unknown", "seperator", "padding")
_LLAMA3_PRES = frozenset({"llama3", "llama-v3", "llama-bpe"})
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>")
_EOG_TEXTS = frozenset(_EOT_TEXTS + ("<|eom_id|>", "<|return|>", "<|call|>", "<eos>", "</s>"))
BYTE_TEXT = re.compile(r"<0x[0-9A-Fa-f]{2}>\Z")  # a BYTE token's text, as decode reads it


class Vocab(NamedTuple):
    kind: str  # "bpe" | "spm"
    pre: str | None  # tokenizer.ggml.pre as written (None when absent)
    tokens: Strings  # text per id, and text -> id
    types: bytes  # token_type per id (NORMAL when the key is absent)
    scores: array  # 'd': SPM merge priorities; empty for BPE
    merges: Strings  # BPE "left right" entries, position = rank; empty for SPM
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    unk_id: int | None
    pad_id: int | None
    sep_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    ignore_merges: bool
    eog_ids: list[int] = []  # filled by _mark_end_of_generation; never mutated

    def to_tables(self) -> dict:
        """marshal-friendly form: the big tables as bytes."""
        tables = self._asdict()
        tables["tokens"], tables["merges"] = self.tokens.to_tuple(), self.merges.to_tuple()
        tables["scores"] = self.scores.tobytes()
        return tables

    @classmethod
    def from_tables(cls, tables: dict) -> Vocab:
        """Raises KeyError/TypeError/ValueError on tables of the wrong shape."""
        tables = dict(tables)
        tables["tokens"], tables["merges"] = Strings.from_tuple(tables["tokens"]), Strings.from_tuple(tables["merges"])
        tables["scores"] = array("d", tables["scores"])
        return cls(**tables)


def _array(meta: dict, value_types: dict, key: str, element: tuple, required: bool = False):
    if key not in meta:
        if required:
            raise ReflexError(f"tokenizer: {key} is missing")
        return None
    value = meta[key]
    if value_types.get(key) != ValueType.ARRAY or value.element_type not in element:
        raise ReflexError(f"tokenizer: {key} must be an array of {'/'.join(t.name for t in element)}")
    return value


def load_vocab(gguf_file) -> Vocab:
    meta, vtypes = gguf_file.metadata, gguf_file.value_types
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise ReflexError("tokenizer: tokenizer.ggml.model is missing (the file has no vocabulary)")
    kind = KIND_BY_MODEL.get(model) if isinstance(model, str) else None
    if kind is None:
        raise ReflexError(f"tokenizer: unsupported tokenizer.ggml.model {model!r} (supported: gpt2, llama)")
    pre = meta.get("tokenizer.ggml.pre")
    if pre is not None and not isinstance(pre, str):
        raise ReflexError("tokenizer: tokenizer.ggml.pre must be a string")

    token_array = _array(meta, vtypes, "tokenizer.ggml.tokens", (ValueType.STRING,), required=True)
    n = len(token_array)
    if n == 0:
        raise ReflexError("tokenizer: tokenizer.ggml.tokens is empty")
    token_table, duplicates, first_empty, _ = Strings.from_gguf_array(gguf_file, token_array)
    if first_empty is not None:  # llama.cpp renames empty tokens so that every text maps to one id
        tokens = [t or f"[EMPTY_{i}]".encode() for i, t in enumerate(token_array.raw_strings())]
        token_table, duplicates = Strings.build(tokens)
    if duplicates:
        # llama.cpp keeps the last id of a duplicated text; text->id must be one-to-one
        raise ReflexError(f"tokenizer: {duplicates} duplicate token texts in tokenizer.ggml.tokens")
    types = _array(meta, vtypes, "tokenizer.ggml.token_type", (ValueType.INT32,))
    types = types.tolist() if types is not None else [NORMAL] * n
    if len(types) != n:
        raise ReflexError(f"tokenizer: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
    if min(types) < 0 or max(types) > BYTE:  # llama.cpp reads unknown values as UNDEFINED
        types = [t if 0 <= t <= BYTE else UNDEFINED for t in types]
    types = bytes(types)
    _check_byte_tokens(kind, token_table, types)
    scores = array("d")
    merges = Strings.build([])[0]
    if kind == "spm":
        arr = _array(meta, vtypes, "tokenizer.ggml.scores", (ValueType.FLOAT32, ValueType.INT32))
        scores = array("d", arr.tolist() if arr is not None else [0.0] * n)
        if len(scores) != n:
            raise ReflexError(f"tokenizer: tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
    else:
        merge_array = _array(meta, vtypes, "tokenizer.ggml.merges", (ValueType.STRING,), required=True)
        # a repeated entry keeps its first rank
        merges, _, _, bad = Strings.from_gguf_array(gguf_file, merge_array, check_pairs=True)
        if bad is not None:
            # llama.cpp would silently read such an entry as the pair ("", "")
            raise ReflexError(f"tokenizer: tokenizer.ggml.merges[{bad}] = {merges[bad]!r} is not 'left right'")

    bos, eos, unk = _DEFAULT_IDS[kind]
    ids = {"bos": bos, "eos": eos, "unknown": unk}
    for name in _SPECIAL_KEYS:
        key = f"tokenizer.ggml.{name}_token_id"
        if ids.get(name) is not None and ids[name] >= n:
            ids[name] = None
        value = meta.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise ReflexError(f"tokenizer: {key} must be an integer, found {value!r}")
        if 0 <= value < n:  # out of range: ignored, the default stays (llama.cpp warns)
            ids[name] = value

    llama3 = kind == "bpe" and pre in _LLAMA3_PRES
    add_bos = _flag(meta, "tokenizer.ggml.add_bos_token", kind == "spm" or llama3)
    add_eos = _flag(meta, "tokenizer.ggml.add_eos_token", False)
    if add_bos and ids["bos"] is None:
        raise ReflexError("tokenizer: add_bos_token is set but the vocabulary has no BOS token")
    vocab = Vocab(
        kind=kind, pre=pre, tokens=token_table, types=types, scores=scores,
        merges=merges,
        bos_id=ids["bos"], eos_id=ids["eos"], eot_id=ids.get("eot"), eom_id=ids.get("eom"),
        unk_id=ids["unknown"], pad_id=ids.get("padding"), sep_id=ids.get("seperator"),
        add_bos=add_bos, add_eos=add_eos,
        add_space_prefix=_flag(meta, "tokenizer.ggml.add_space_prefix", kind == "spm"),
        ignore_merges=llama3,
    )
    return _mark_end_of_generation(vocab)


def _check_byte_tokens(kind: str, tokens: Strings, types: bytes) -> None:
    """decode reads a BYTE token as <0xHH> (SPM: every one; BPE: those that start so)."""
    for i in (m.start() for m in re.finditer(bytes([BYTE]), types)):  # a C-level scan: SPM has 256
        text = tokens[i]
        if (kind == "spm" or text.startswith("<0x")) and not BYTE_TEXT.match(text):
            raise ReflexError(f"tokenizer: byte token {i} is {text[:40]!r}, not '<0xHH>'")


def _flag(meta: dict, key: str, default: bool) -> bool:
    value = meta.get(key, default)
    if not isinstance(value, bool):
        raise ReflexError(f"tokenizer: {key} must be a bool, found {value!r}")
    return value


def _mark_end_of_generation(v: Vocab) -> Vocab:
    """eot by text when the file names none, the EOG set, and CONTROL for tokens found by text.

    Unlike llama.cpp, only tokens that are not NORMAL are found by text: Qwen's vocabulary
    has an ordinary "</s>" token (HTML strike-through), which llama.cpp turns into a control
    token that stops generation and is matched as special in prompts; HF does neither.
    """
    found = sorted(i for i in map(v.tokens.get, _EOG_TEXTS) if i is not None and v.types[i] != NORMAL)
    eot_id = v.eot_id if v.eot_id is not None else next((i for i in found if v.tokens[i] in _EOT_TEXTS), None)
    types = bytearray(v.types)
    for i in found:
        types[i] = CONTROL  # llama.cpp: "control-looking token ... will be overridden"
    eog_ids = sorted({*found, *(i for i in (v.eos_id, eot_id, v.eom_id) if i is not None)})
    return v._replace(eot_id=eot_id, types=bytes(types), eog_ids=eog_ids)
