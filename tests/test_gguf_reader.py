"""The GGUF reader against gguf-py (llama.cpp's own reader/writer) and a malformed corpus."""
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

import make_fixtures
from reflex_engine import native, sidecar
from reflex_engine.gguf import GGMLType, GGUFError, GGUFFile, LazyArray, ValueType, layout_section


@pytest.fixture(params=["compiled", "python"])
def walk(request, monkeypatch):
    """Run a test with the compiled string walk (_native.c) and with the Python loop."""
    if request.param == "python":
        monkeypatch.setattr(native, "skip_strings", None)
    return request.param


def test_the_compiled_walk_is_built():
    # pip builds _native.c with the package; it is optional only so that installs
    # without a C compiler still work, and CI must exercise it.
    assert native.skip_strings is not None


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    make_fixtures.write_model_fixture(path)
    return path


def test_tensor_directory_matches_gguf_py(model_path):
    ref = GGUFReader(model_path)
    with GGUFFile(model_path) as f:
        assert list(f.tensors) == [t.name for t in ref.tensors]
        for t in ref.tensors:
            ours = f.tensors[t.name]
            assert ours.shape == tuple(int(x) for x in t.shape)
            assert int(ours.ggml_type) == int(t.tensor_type)
            assert ours.offset == t.data_offset
            assert ours.nbytes == t.n_bytes
            assert bytes(f.tensor_data(t.name)) == t.data.tobytes()


def test_metadata_matches_gguf_py(model_path):
    ref = GGUFReader(model_path)
    fields = {k: v for k, v in ref.fields.items() if not k.startswith("GGUF.")}  # gguf-py's header pseudo-fields
    with GGUFFile(model_path) as f:
        assert list(f.metadata) == list(fields)
        for key, field in fields.items():
            value = f.metadata[key]
            expected = field.contents()
            if isinstance(value, LazyArray):
                value = value.tolist()
            if isinstance(expected, float):
                assert value == pytest.approx(expected, rel=1e-7)
            else:
                assert value == expected, key


def test_every_value_type_round_trips(tmp_path):
    path = str(tmp_path / "types.gguf")
    w = GGUFWriter(path, "llama")
    values = {
        "t.u8": (w.add_uint8, 250), "t.i8": (w.add_int8, -120), "t.u16": (w.add_uint16, 65000),
        "t.i16": (w.add_int16, -32000), "t.u32": (w.add_uint32, 4_000_000_000), "t.i32": (w.add_int32, -2_000_000_000),
        "t.f32": (w.add_float32, 1.5), "t.u64": (w.add_uint64, 1 << 63), "t.i64": (w.add_int64, -(1 << 62)),
        "t.f64": (w.add_float64, 1e300), "t.bool": (w.add_bool, True), "t.str": (w.add_string, "héllo ☃"),
    }
    for key, (add, value) in values.items():
        add(key, value)
    w.add_array("t.arr_f32", [0.5, -2.0, 3.25])
    w.add_array("t.arr_str", ["a", "", "ünï"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with GGUFFile(path) as f:
        for key, (_, value) in values.items():
            assert f.metadata[key] == value, key
        assert f.value_types["t.u64"] == ValueType.UINT64
        assert f.metadata["t.arr_f32"].tolist() == [0.5, -2.0, 3.25]
        assert f.metadata["t.arr_f32"][-1] == 3.25
        assert f.metadata["t.arr_str"].tolist() == ["a", "", "ünï"]
        assert f.tensors == {}


def test_version_2_header_is_read():
    data = make_fixtures.raw_gguf(make_fixtures.Spec(**{**make_fixtures.base_spec().__dict__, "version": 2}))
    path = _write_tmp(data, "v2.gguf")
    with GGUFFile(path) as f:
        assert f.version == 2 and len(f.tensors) == 3


def test_raw_base_file_is_valid_for_gguf_py_and_us(tmp_path):
    path = str(tmp_path / "base.gguf")
    with open(path, "wb") as fh:
        fh.write(make_fixtures.raw_gguf(make_fixtures.base_spec()))
    ref = GGUFReader(path)
    with GGUFFile(path) as f:
        assert [t.name for t in ref.tensors] == list(f.tensors)
        assert f.tensors["c.weight"].ggml_type == GGMLType.Q8_0
        np.testing.assert_array_equal(np.frombuffer(f.tensor_data("a.weight"), np.float32), 0.5 * np.arange(8))


def test_arrays_are_not_materialised_at_open(model_path):
    with GGUFFile(model_path) as f:
        tokens = f.metadata["tokenizer.ggml.tokens"]
        assert isinstance(tokens, LazyArray) and tokens._items is None
        assert len(tokens) == 64
        assert tokens[1] == "<s>"


def test_prepared_layout_is_used_and_a_stale_one_ignored(tmp_path):
    path = str(tmp_path / "m.gguf")
    with open(path, "wb") as fh:
        fh.write(make_fixtures.raw_gguf(make_fixtures.base_spec()))
    with GGUFFile(path) as f:
        expected = {k: (v.tolist() if isinstance(v, LazyArray) else v) for k, v in f.metadata.items()}
        sidecar.write_sections(path, {"layout": layout_section(f)})
    calls = []
    original = GGUFFile._skip_strings
    GGUFFile._skip_strings = lambda self, *a: calls.append(a) or original(self, *a)
    try:
        with GGUFFile(path) as f:
            assert {k: (v.tolist() if isinstance(v, LazyArray) else v) for k, v in f.metadata.items()} == expected
        assert calls == []  # the token array was skipped through the layout
        # Same length, different bytes: the crc no longer matches, so the array is walked.
        data = open(path, "rb").read().replace(b"ab", b"ba")
        open(path, "wb").write(data)
        with GGUFFile(path) as f:
            assert f.metadata["tokenizer.ggml.tokens"].tolist() == ["<s>", "a", "b", "ba"]
        assert len(calls) == 1
        open(sidecar.sidecar_path(path), "wb").write(b"\x00garbage")
        with GGUFFile(path) as f:
            assert len(f.metadata["tokenizer.ggml.tokens"]) == 4
    finally:
        GGUFFile._skip_strings = original


@pytest.mark.parametrize("layout", [1j, [("tokenizer.ggml.tokens", 1)], "layout", {"tokenizer.ggml.tokens": None}])
def test_a_prepared_layout_of_the_wrong_shape_is_ignored(tmp_path, layout):
    # found by fuzzing (fuzz/fuzz_sidecar.py): a section that read back as a non-dict was AttributeError
    path = str(tmp_path / "m.gguf")
    with open(path, "wb") as fh:
        fh.write(make_fixtures.raw_gguf(make_fixtures.base_spec()))
    sidecar.write_sections(path, {"layout": layout})
    with GGUFFile(path) as f:
        assert f.metadata["tokenizer.ggml.tokens"].tolist() == ["<s>", "a", "b", "ab"]


_TMP = {}


def _write_tmp(data: bytes, name: str) -> str:
    import tempfile

    d = _TMP.setdefault("dir", tempfile.mkdtemp(prefix="reflex-gguf-"))
    path = os.path.join(d, name)
    with open(path, "wb") as fh:
        fh.write(data)
    return path


CASES = make_fixtures.malformed_cases()


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_file_raises_gguf_error(case, walk):
    path = _write_tmp(CASES[case], f"{case}.gguf")
    with pytest.raises(GGUFError) as err:
        GGUFFile(path, use_sidecar=False)
    message = str(err.value)
    assert "\n" not in message and path in message
    assert " at byte " in message  # every message names the field and where it is


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_file_gives_one_line_and_exit_2_from_info(case):
    path = _write_tmp(CASES[case], f"{case}.gguf")
    proc = subprocess.run([sys.executable, "-m", "reflex_engine", "info", path], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("reflex: error: ")
    assert "Traceback" not in proc.stderr


def test_missing_file_is_a_clean_error():
    proc = subprocess.run([sys.executable, "-m", "reflex_engine", "info", "/nonexistent/model.gguf"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("reflex: error: ") and "Traceback" not in proc.stderr


def test_reader_imports_no_numpy():
    code = "import sys, reflex_engine.gguf, reflex_engine.cli; print('numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_random_damage_is_always_a_clean_error_or_a_valid_read(tmp_path, walk):
    """Seeded mutation fuzzing: flipped bytes, overwritten lengths and truncations of a valid
    file either still parse (then every tensor lies inside the file) or raise GGUFError."""
    import random

    base = make_fixtures.raw_gguf(make_fixtures.base_spec())
    rng = random.Random(1234)
    path = str(tmp_path / "fuzz.gguf")
    outcomes = {"ok": 0, "error": 0}
    for _ in range(3000):
        data = bytearray(base)
        kind = rng.randrange(3)
        if kind == 0:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind == 1:
            at = rng.randrange(len(data) - 8)
            data[at : at + 8] = struct.pack("<Q", rng.choice([0, 1, 2**31, 2**40, 2**63, 2**64 - 1, rng.randrange(2**16)]))
        else:
            data = data[: rng.randrange(len(data))]
        with open(path, "wb") as fh:
            fh.write(data)
        try:
            with GGUFFile(path, use_sidecar=False) as f:
                for info in f.tensors.values():
                    assert 0 <= info.offset and info.offset + info.nbytes <= len(data)
                for value in f.metadata.values():
                    if isinstance(value, LazyArray):
                        value.tolist()
            outcomes["ok"] += 1
        except GGUFError:
            outcomes["error"] += 1
    assert outcomes["ok"] > 100 and outcomes["error"] > 1000, outcomes


def test_compiled_and_python_walks_agree_on_a_real_vocabulary(monkeypatch):
    from reference_files import vocab_path

    path = str(vocab_path("qwen2"))
    with GGUFFile(path, use_sidecar=False) as f:
        compiled = {k: (v.start, v.end) for k, v in f.metadata.items() if isinstance(v, LazyArray)}
    monkeypatch.setattr(native, "skip_strings", None)
    with GGUFFile(path, use_sidecar=False) as f:
        assert {k: (v.start, v.end) for k, v in f.metadata.items() if isinstance(v, LazyArray)} == compiled
        assert len(f.metadata["tokenizer.ggml.merges"]) == 151387
