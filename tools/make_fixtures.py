"""Small GGUF files for tests: well-formed ones written with gguf-py, and a malformed corpus.

    python tools/make_fixtures.py OUT_DIR     # writes every fixture and malformed case

The well-formed files come from gguf-py's GGUFWriter (llama.cpp's own writer), so the reader
is checked against files it did not write. The malformed cases need byte-level control, so
they come from `raw_gguf`, a deliberately plain packer of the GGUF layout, whose output for the
unmodified spec gguf-py reads back (tests assert that) before each case breaks one field.
"""
from __future__ import annotations

import argparse
import os
import struct
import sys
from dataclasses import dataclass, field

# ggml / gguf ids, spelled out here so this tool stays independent of the reader under test.
F32, F16, Q8_0 = 0, 1, 8
T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY, T_UINT64 = 4, 5, 6, 7, 8, 9, 10


def _string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def _value(vtype: int, value) -> bytes:
    if vtype == T_STRING:
        return _string(value)
    if vtype == T_ARRAY:
        etype, items = value
        return struct.pack("<iQ", etype, len(items)) + b"".join(_value(etype, v) for v in items)
    fmt = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}[vtype]
    return struct.pack("<" + fmt, value)


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]  # ggml order, innermost first
    ggml_type: int
    data: bytes
    offset: int | None = None  # relative to the data section; None = packed in order


@dataclass
class Spec:
    kvs: list[tuple[str, int, object]] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    version: int = 3
    alignment: int = 32
    n_kv: int | None = None  # override the header counts
    n_tensors: int | None = None


def raw_gguf(spec: Spec) -> bytes:
    """Pack a GGUF exactly as the spec says, including any wrong field it is given."""
    out = bytearray(b"GGUF")
    out += struct.pack("<I", spec.version)
    out += struct.pack("<q", len(spec.tensors) if spec.n_tensors is None else spec.n_tensors)
    out += struct.pack("<q", len(spec.kvs) if spec.n_kv is None else spec.n_kv)
    for key, vtype, value in spec.kvs:
        out += _string(key) + struct.pack("<i", vtype) + _value(vtype, value)
    offsets, cursor = [], 0
    for t in spec.tensors:
        offsets.append(cursor if t.offset is None else t.offset)
        cursor += -(-len(t.data) // spec.alignment) * spec.alignment
    for t, offset in zip(spec.tensors, offsets):
        out += _string(t.name) + struct.pack("<I", len(t.shape))
        out += struct.pack(f"<{len(t.shape)}q", *t.shape) + struct.pack("<iQ", t.ggml_type, offset)
    if spec.tensors:
        out += bytes(-len(out) % spec.alignment)
        data_start = len(out)
        out += bytes(cursor)
        for t, offset in zip(spec.tensors, offsets):
            if offset + len(t.data) <= cursor:  # a wrong offset pointing elsewhere writes nothing
                out[data_start + offset : data_start + offset + len(t.data)] = t.data
    return bytes(out)


def base_spec() -> Spec:
    """A small valid file touching every section: scalars, a string, arrays, three tensors."""
    f32 = struct.pack("<8f", *[0.5 * i for i in range(8)])
    f16 = struct.pack("<16e", *[0.25 * i for i in range(16)])
    q8 = struct.pack("<e32b", 0.125, *range(-16, 16))  # one Q8_0 block
    return Spec(
        kvs=[
            ("general.architecture", T_STRING, "llama"),
            ("general.name", T_STRING, "malformed-base"),
            ("llama.block_count", T_UINT32, 1),
            ("llama.rope.freq_base", T_FLOAT32, 10000.0),
            ("tokenizer.ggml.tokens", T_ARRAY, (T_STRING, ["<s>", "a", "b", "ab"])),
            ("tokenizer.ggml.scores", T_ARRAY, (T_FLOAT32, [0.0, -1.0, -2.0, -3.0])),
            ("tokenizer.ggml.add_bos_token", T_BOOL, True),
            ("general.alignment", T_UINT32, 32),
        ],
        tensors=[
            Tensor("a.weight", (8,), F32, f32),
            Tensor("b.weight", (16,), F16, f16),
            Tensor("c.weight", (32,), Q8_0, q8),
        ],
    )


def _kv_offset(spec: Spec, index: int) -> int:
    """Byte offset where kv `index` starts in raw_gguf(spec)."""
    return 24 + sum(len(_string(k)) + 4 + len(_value(t, v)) for k, t, v in spec.kvs[:index])


def _tensor_info_offset(spec: Spec, index: int) -> int:
    offset = _kv_offset(spec, len(spec.kvs))
    for t in spec.tensors[:index]:
        offset += len(_string(t.name)) + 4 + 8 * len(t.shape) + 12
    return offset


def _patched(spec: Spec, **changes) -> bytes:
    spec = Spec(**{**spec.__dict__, **changes})
    return raw_gguf(spec)


def _with_kv(spec: Spec, index: int, kv) -> bytes:
    kvs = list(spec.kvs)
    kvs[index] = kv
    return _patched(spec, kvs=kvs)


def _with_tensor(spec: Spec, index: int, **changes) -> bytes:
    tensors = list(spec.tensors)
    tensors[index] = Tensor(**{**tensors[index].__dict__, **changes})
    return _patched(spec, tensors=tensors)


def _overwrite(data: bytes, offset: int, raw: bytes) -> bytes:
    return data[:offset] + raw + data[offset + len(raw) :]


def malformed_cases() -> dict[str, bytes]:
    """Each case breaks exactly one thing in an otherwise valid file."""
    spec = base_spec()
    good = raw_gguf(spec)
    tokens_kv = _kv_offset(spec, 4)
    first_info = _tensor_info_offset(spec, 0)
    data_start = -(-_tensor_info_offset(spec, len(spec.tensors)) // 32) * 32
    cases = {
        "empty": b"",
        "bad_magic": b"GGML" + good[4:],
        "version_1": _patched(spec, version=1),
        "version_4": _patched(spec, version=4),
        "big_endian_version": _overwrite(good, 4, struct.pack(">I", 3)),
        "huge_kv_count": _patched(spec, n_kv=1 << 62),
        "negative_kv_count": _patched(spec, n_kv=-1),
        "kv_count_too_large": _patched(spec, n_kv=len(spec.kvs) + 1),
        "huge_tensor_count": _patched(spec, n_tensors=1 << 40),
        "negative_tensor_count": _patched(spec, n_tensors=-5),
        "key_length_past_eof": _overwrite(good, 24, struct.pack("<Q", 1 << 40)),
        "empty_key": _with_kv(spec, 1, ("", T_STRING, "x")),
        "duplicate_key": _with_kv(spec, 1, ("general.architecture", T_STRING, "x")),
        "key_not_utf8": _with_kv(spec, 1, (b"general.\xff\xfe", T_STRING, "x")),
        "unknown_value_type": _overwrite(good, _kv_offset(spec, 2) + len(_string("llama.block_count")), struct.pack("<i", 13)),
        "string_value_past_eof": _overwrite(good, _kv_offset(spec, 1) + len(_string("general.name")) + 4, struct.pack("<Q", 1 << 33)),
        "array_of_arrays": _overwrite(good, tokens_kv + len(_string("tokenizer.ggml.tokens")) + 4, struct.pack("<i", T_ARRAY)),
        "array_element_type_unknown": _overwrite(good, tokens_kv + len(_string("tokenizer.ggml.tokens")) + 4, struct.pack("<i", 77)),
        "array_count_huge": _overwrite(good, tokens_kv + len(_string("tokenizer.ggml.tokens")) + 8, struct.pack("<Q", 1 << 29)),
        "array_count_past_limit": _overwrite(good, tokens_kv + len(_string("tokenizer.ggml.tokens")) + 8, struct.pack("<Q", 1 << 40)),
        "array_string_past_eof": _overwrite(good, tokens_kv + len(_string("tokenizer.ggml.tokens")) + 16, struct.pack("<Q", 1 << 50)),
        "float_array_past_eof": _with_kv(spec, 5, ("tokenizer.ggml.scores", T_ARRAY, (T_FLOAT32, [0.0] * 4)))[: _kv_offset(spec, 6) - 2],
        "bool_not_0_or_1": _overwrite(good, _kv_offset(spec, 6) + len(_string("tokenizer.ggml.add_bos_token")) + 4, b"\x02"),
        "alignment_zero": _with_kv(spec, 7, ("general.alignment", T_UINT32, 0)),
        "alignment_not_power_of_two": _with_kv(spec, 7, ("general.alignment", T_UINT32, 48)),
        "alignment_wrong_type": _with_kv(spec, 7, ("general.alignment", T_STRING, "32")),
        "tensor_name_empty": _with_tensor(spec, 0, name=""),
        "tensor_name_too_long": _with_tensor(spec, 0, name="x" * 64),
        "tensor_name_duplicate": _with_tensor(spec, 1, name="a.weight"),
        "tensor_n_dims_zero": _with_tensor(spec, 0, shape=()),
        "tensor_n_dims_five": _with_tensor(spec, 0, shape=(8, 1, 1, 1, 1)),
        "tensor_negative_dim": _with_tensor(spec, 0, shape=(8, -1)),
        "tensor_huge_dim": _with_tensor(spec, 0, shape=(8, 1 << 40)),
        "tensor_removed_type_id": _with_tensor(spec, 0, ggml_type=4),
        "tensor_unknown_type_id": _with_tensor(spec, 0, ggml_type=99),
        "tensor_ne0_not_block_multiple": _with_tensor(spec, 2, shape=(33,)),
        "tensor_offset_unaligned": _with_tensor(spec, 1, offset=40),
        "tensor_offset_huge": _with_tensor(spec, 2, offset=1 << 60),
        "tensor_offset_negative": _with_tensor(spec, 2, offset=(1 << 64) - 64),
        "tensors_overlap": _with_tensor(spec, 1, offset=0),
        "tensor_data_past_eof": good[: data_start + 64 + 16],
        "truncated_in_magic": good[:2],
        "truncated_in_header": good[:20],
        "truncated_in_key": good[: _kv_offset(spec, 7) + 12],
        "truncated_in_value": good[: _kv_offset(spec, 7) + len(_string("general.alignment")) + 4 + 2],
        # inside the header of the 4th token string ("<s>", "a", "b" take 11 + 9 + 9 bytes)
        "truncated_in_string_array": good[: tokens_kv + len(_string("tokenizer.ggml.tokens")) + 16 + 29 + 5],
        "truncated_in_tensor_info": good[: first_info + 10],
        "truncated_before_data": good[:data_start],
    }
    return cases


def write_model_fixture(path: str) -> None:
    """A tiny llama-shaped file written by gguf-py, with tensors of several ggml types."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    w = GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(61)])
    w.add_token_scores([0.0] * 64)
    w.add_token_types([2, 3, 3] + [1] * 61)
    w.add_array("test.nested_ints", [1, 2, 3])
    w.add_string("tokenizer.chat_template", "{{ messages }}")
    w.add_tensor("token_embd.weight", rng.standard_normal((64, 64), dtype=np.float32))
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64, dtype=np.float32).astype(np.float16))
    q = quantize(rng.standard_normal((128, 64), dtype=np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_up.weight", q, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    args = parser.parse_args(argv)
    malformed_dir = os.path.join(args.out_dir, "malformed")
    os.makedirs(malformed_dir, exist_ok=True)
    write_model_fixture(os.path.join(args.out_dir, "tiny-llama-mixed.gguf"))
    with open(os.path.join(args.out_dir, "base.gguf"), "wb") as f:
        f.write(raw_gguf(base_spec()))
    for name, data in malformed_cases().items():
        with open(os.path.join(malformed_dir, f"{name}.gguf"), "wb") as f:
            f.write(data)
    print(f"wrote fixtures to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
