"""The fuzz harnesses (fuzz/) in CI: each replays its seeds and a few hundred seeded mutations
without atheris, then runs under atheris for a few seconds of coverage-guided fuzzing (skipped
where atheris is not installed); the corpus replays through an AddressSanitizer build of
_native.c where gcc has libasan. Long runs: tools/fuzz.sh NAME SECONDS (fuzz/README.md)."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ = os.path.join(ROOT, "fuzz")
sys.path.insert(0, FUZZ)

import common  # noqa: E402  (fuzz/common.py)

# harness -> seeded mutations for the replay (sized to ~1-3 s each on a busy 2-core machine)
MUTANTS = {"gguf": 1500, "native": 3000, "vocab": 1000, "sidecar": 300, "tokenizer": 300, "chat": 150, "ipc": 150,
           "lora": 150, "openai": 2000, "kvstate": 150}
ATHERIS_SECONDS = 2


def harness(name: str):
    return importlib.import_module(f"fuzz_{name}")


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_harness_replays_its_seeds_and_mutations(name):
    h = harness(name)
    seeds = list(h.seeds().values())
    assert common.replay(h.one_input, seeds) == len(seeds)
    assert common.replay(h.one_input, common.mutants(seeds, MUTANTS[name], seed=14)) == MUTANTS[name]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    subprocess.run([sys.executable, "make_corpus.py", str(folder)], cwd=FUZZ, check=True, capture_output=True)
    return folder


def env(**extra) -> dict:
    return {**os.environ, "OPENBLAS_NUM_THREADS": "1", **extra}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_harness_runs_under_atheris(name, corpus, tmp_path, tmp_path_factory):
    pytest.importorskip("atheris", reason="atheris is not installed (pip install atheris; Linux x86_64 wheels)")
    proc = subprocess.run([sys.executable, f"fuzz_{name}.py", f"-max_total_time={ATHERIS_SECONDS}", "-seed=14",
                           f"-artifact_prefix={tmp_path}/", "-print_final_stats=1", str(corpus / name)],
                          cwd=FUZZ, capture_output=True, text=True, timeout=120,
                          env=env(REFLEX_FUZZ_SCRATCH=str(tmp_path_factory.mktemp("scratch"))))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "stat::number_of_executed_units" in proc.stderr and not os.listdir(tmp_path), proc.stderr[-4000:]


def _libasan() -> str | None:
    try:
        path = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return None
    return path if os.path.isfile(path) else None


@pytest.mark.parametrize("name", ["gguf", "native"])
def test_harness_corpus_is_clean_under_address_sanitizer(name, corpus, tmp_path):
    asan = _libasan()
    if asan is None:
        pytest.skip("no gcc with libasan")
    lib = tmp_path / "_native_asan.so"
    subprocess.run(["gcc", "-O1", "-g", "-fPIC", "-shared", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                    "-fno-sanitize-recover=all", os.path.join(ROOT, "src", "reflex_engine", "_native.c"), "-o", str(lib)],
                   check=True)
    proc = subprocess.run([sys.executable, "replay.py", name, str(corpus / name), "--mutants", "1000"], cwd=FUZZ,
                          capture_output=True, text=True, timeout=300,
                          env=env(PYTHONMALLOC="malloc", LD_PRELOAD=asan, ASAN_OPTIONS="detect_leaks=0",
                                  REFLEX_FUZZ_NATIVE=str(lib)))
    assert proc.returncode == 0 and "no failure" in proc.stdout, proc.stderr[-4000:]
    assert "_native_asan.so" in proc.stderr  # the sanitizer build was the one called


# -- the harnesses can fail: their checks are not vacuous ------------------------------------------


def test_the_gguf_harness_catches_walks_that_disagree(monkeypatch):
    from reflex_engine import native

    h = harness("gguf")
    base = h.seeds()["base"]
    monkeypatch.setattr(native, "skip_strings", lambda fd, offset, count, size: size)  # a walk that lies
    with pytest.raises(AssertionError, match="disagree"):
        h.one_input(base)


def test_the_chat_harness_catches_a_template_that_opens_a_file(monkeypatch):
    from reflex_engine import chat

    h = harness("chat")
    monkeypatch.setitem(chat._environment().globals, "leak", open)  # a hole in the sandbox
    with pytest.raises(AssertionError, match="reached outside the sandbox.*open"):
        h.one_input(b"{{ leak('/dev/null').read() }}")


def test_the_ipc_harness_catches_an_internal_error(monkeypatch):
    from reflex_engine import ipc

    h = harness("ipc")
    monkeypatch.setattr(ipc.Session, "_ping", lambda self, request_id, args: 1 / 0)
    with pytest.raises(AssertionError, match="internal"):
        h.one_input(b'{"op": "ping"}\n')


def test_the_gguf_harness_takes_a_nan_in_a_float_array(tmp_path):
    """A NaN is a legal float32 value: tools/fuzz.sh gguf stopped on one (NaN != NaN in the harness)."""
    from gguf import GGUFWriter

    path = tmp_path / "nan.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.scores", [float("nan"), -1.0, float("nan")])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    harness("gguf").one_input(path.read_bytes())


def test_nan_logits_from_a_damaged_kv_state_are_a_clean_error(tmp_path):
    """Found by fuzz/fuzz_kvstate.py: NaN logits used to reach numpy's sampling as a ValueError."""
    import reflex_engine
    from reflex_engine import kvstate
    from reflex_engine.errors import ReflexError

    model = reflex_engine.load(os.path.join(ROOT, "tests", "goldens", "qwen3", "qwen3-Q8_0.gguf"), device="cpu", n_ctx=64)
    path = str(tmp_path / "state.kv")
    list(model.generate("The cat sat", max_tokens=2, export_kv=path))
    data = bytearray(open(path, "rb").read())
    header_at = kvstate._PREFIX.unpack_from(data)[3]
    data[kvstate._PREFIX.size : header_at] = b"\xff" * (header_at - kvstate._PREFIX.size)  # every value a NaN
    open(path, "wb").write(bytes(data))
    with pytest.raises(ReflexError, match="not finite"):
        list(model.generate([], max_tokens=1, import_kv=path))
