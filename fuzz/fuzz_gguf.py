"""The GGUF reader: header, metadata, tensor directory and tensor data bounds.

Each input is opened twice, with the compiled string walk (_native.c) and with the Python one,
and the two must agree: the same GGUFError message, or the same metadata and tensors. On a read
every tensor lies inside the file, every array decodes, and every string array packs to the
same table through the compiled and the Python packer. Anything but GGUFError is a crash.
"""
from __future__ import annotations

import sys

import common

with common.instrumented():
    from reflex_engine import native
    from reflex_engine.gguf import GGUFError, GGUFFile, LazyArray, ValueType
    from reflex_engine.gguf.constants import tensor_nbytes
    from reflex_engine.tokenizer.strings import Strings

PATH = common.scratch_path("model.gguf")
REACHES_NATIVE = True  # tools/fuzz.sh replays its corpus through the sanitizer build of _native.c
MAX_LEN = 1 << 16


def one_input(data: bytes) -> None:
    common.write(PATH, data)
    compiled = _read(data)
    walk = native.skip_strings
    native.skip_strings = None
    try:
        python = _read(data)
    finally:
        native.skip_strings = walk
    # as text: a NaN read from the file is not equal to itself
    assert repr(compiled) == repr(python), f"the compiled and Python walks disagree:\n{compiled}\n{python}"


def _read(data: bytes):
    try:
        f = GGUFFile(PATH, use_sidecar=False)
    except GGUFError as e:
        assert "\n" not in str(e) and " at byte " in str(e), str(e)
        return ("error", str(e))
    with f:
        assert f.data_offset <= len(data)
        tensors = []
        for info in f.tensors.values():
            assert 0 <= info.offset and info.offset + info.nbytes <= len(data), info
            assert info.nbytes == tensor_nbytes(info.ggml_type, info.shape), info
            with f.tensor_data(info.name) as view:
                assert len(view) == info.nbytes
            tensors.append(tuple(info))
        metadata = {}
        for key, value in f.metadata.items():
            start, end = f.spans[key]
            assert 24 <= start < end <= len(data), (key, f.spans[key])
            if isinstance(value, LazyArray):
                items = value.tolist()
                assert len(items) == value.count and value.start <= value.end <= end
                if value.element_type == ValueType.STRING:
                    raw = value.raw_strings()
                    assert len(raw) == value.count
                    _pack_both(f, value)
                elif value.count:  # as text: NaN != NaN
                    assert repr((value[0], value[-1])) == repr((items[0], items[-1]))
                value = (value.element_type, items)
            metadata[key] = (f.value_types[key], value)
        return ("ok", f.version, f.alignment, f.data_offset, metadata, tensors)


def _pack_both(f: GGUFFile, array: LazyArray) -> None:
    """The compiled packer against the Python one, on an array the reader accepted."""
    compiled = Strings.from_gguf_array(f, array, check_pairs=True)
    pack = native.pack_strings
    native.pack_strings = None
    try:
        python = Strings.from_gguf_array(f, array, check_pairs=True)
    finally:
        native.pack_strings = pack
    assert compiled.table.to_tuple() == python.table.to_tuple() and compiled[1:] == python[1:]


def seeds() -> dict[str, bytes]:
    """The malformed corpus, the files it breaks, the gguf-py fixture and the goldens' headers."""
    import glob
    import os
    import tempfile

    import make_fixtures

    out = {f"malformed-{name}": data for name, data in make_fixtures.malformed_cases().items()}
    out["base"] = make_fixtures.raw_gguf(make_fixtures.base_spec())
    with tempfile.TemporaryDirectory() as d:
        make_fixtures.write_model_fixture(os.path.join(d, "tiny.gguf"))
        out["tiny-llama-mixed"] = open(os.path.join(d, "tiny.gguf"), "rb").read()
    for path in sorted(glob.glob(os.path.join(common.ROOT, "tests", "goldens", "*", "*-Q4_0.gguf"))):
        out[os.path.basename(path) + "-metadata"] = metadata_only(path)
    return out


def metadata_only(path: str) -> bytes:
    """A real file's header and metadata (its vocabulary, its chat template), without tensors."""
    import struct

    with GGUFFile(path, use_sidecar=False) as f:
        end = max(end for _, end in f.spans.values())
        return f.raw_bytes(0, 8) + struct.pack("<q", 0) + f.raw_bytes(16, end)


if __name__ == "__main__":
    common.fuzz(one_input, max_len=MAX_LEN, dictionary="gguf.dict")
