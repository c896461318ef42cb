"""KV state files: a generation exported and imported in another run goes on exactly as one
uninterrupted run (greedy and seeded sampling, penalties, logprobs); system1 states; a file from
another model, truncated, of another version or damaged is one line of error; writing is atomic.
Prompts and split points are drawn fresh on every run."""
import json
import os
import random
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

import reflex_engine
from reflex_engine import kvstate
from reflex_engine.errors import ContextExceeded, ReflexError
from reflex_engine.sampling import SamplingParams

from model_files import run_cli
from test_cli import assert_one_line_error

GOLDENS = os.path.join(os.path.dirname(__file__), "goldens")
QWEN3 = os.path.join(GOLDENS, "qwen3", "qwen3-Q8_0.gguf")
LLAMA = os.path.join(GOLDENS, "llama", "llama-F32.gguf")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SAMPLINGS = {
    "greedy": SamplingParams(temperature=0, repeat_penalty=1.3),
    "seeded": SamplingParams(temperature=0.9, top_k=30, top_p=0.95, min_p=0.0, repeat_penalty=1.2, presence_penalty=0.1,
                             seed=random.randrange(1 << 30)),
}
rng = random.Random()


@pytest.fixture(scope="module", params=DEVICES)
def model(request):
    return reflex_engine.load(QWEN3, device=request.param, n_ctx=256)


def random_prompt(model, n: int) -> list[int]:
    return [rng.randrange(model.config.n_vocab) for _ in range(n)]


def clear_prompt(model, n: int, steps: int, margin: float = 0.05) -> list[int]:
    """A random prompt whose greedy continuation of `steps` tokens never nearly ties (top two
    logprobs at least `margin` apart), so a rounding that moves logprobs by less cannot change a token."""
    for _ in range(50):
        prompt = random_prompt(model, n)
        gen = model.generate(prompt, max_tokens=steps, sampling=SamplingParams(temperature=0), ignore_eos=True, top_logprobs=2)
        if all(e.top_logprobs[0].logprob - e.top_logprobs[1].logprob > margin for e in gen if e.id is not None):
            return prompt
    raise AssertionError("no random prompt without a near-tie in 50 draws")


def run(model, prompt, n, sampling, **kw):
    gen = model.generate(prompt, max_tokens=n, sampling=sampling, ignore_eos=True, logprobs=True, **kw)
    events = [e for e in gen if e.id is not None]
    return gen, [e.logprob for e in events]


@pytest.mark.parametrize("kind", list(SAMPLINGS))
def test_export_then_import_goes_on_as_one_uninterrupted_run(model, kind, tmp_path):
    sampling, prompt = SAMPLINGS[kind], random_prompt(model, rng.randrange(1, 40))
    total, first = 24, rng.randrange(1, 16)
    whole, whole_lp = run(model, prompt, total, sampling)
    a, a_lp = run(model, prompt, first, sampling, export_kv=str(tmp_path / "a.kv"))
    # a second interruption: a state imported and exported again
    second = rng.randrange(1, total - first)
    b, b_lp = run(model, [], second, sampling, import_kv=str(tmp_path / "a.kv"), export_kv=str(tmp_path / "b.kv"))
    c, c_lp = run(model, [], total - first - second, sampling, import_kv=str(tmp_path / "b.kv"))
    assert a.tokens + b.tokens + c.tokens == whole.tokens
    assert (b.prompt_tokens, b.cached_tokens) == (len(prompt) + first, len(prompt) + first - 1)
    assert c.cached_tokens == len(prompt) + first + second - 1 and "kv_import_ms" in c.timings
    if model.device == "cpu":  # the same ops on the same numbers: bit for bit
        assert a_lp + b_lp + c_lp == whole_lp
    else:
        np.testing.assert_allclose(a_lp + b_lp + c_lp, whole_lp, atol=1e-3)


def test_a_seeded_import_continues_the_files_stream_and_another_seed_its_own(model, tmp_path):
    sampling = SamplingParams(temperature=1.5, top_k=0, top_p=1, min_p=0, seed=rng.randrange(1 << 30))
    prompt = random_prompt(model, 8)
    whole, _ = run(model, prompt, 20, sampling)
    run(model, prompt, 4, sampling, export_kv=str(tmp_path / "s.kv"))
    other, _ = run(model, [], 16, sampling._replace(seed=sampling.seed + 1), import_kv=str(tmp_path / "s.kv"))
    same, _ = run(model, [], 16, sampling, import_kv=str(tmp_path / "s.kv"))
    assert same.tokens == whole.tokens[4:]
    assert other.tokens != whole.tokens[4:]  # the stream came from the file, not from re-seeding


def test_a_prompt_given_with_an_import_is_appended(model, tmp_path):
    prompt, more = random_prompt(model, 12), random_prompt(model, 5)
    greedy = SamplingParams(temperature=0)
    a, _ = run(model, prompt, 3, greedy, export_kv=str(tmp_path / "a.kv"))
    b, b_lp = run(model, more, 6, greedy, import_kv=str(tmp_path / "a.kv"))
    # the reference: the whole context in one fresh pass (other batching: equal within rounding)
    ref, ref_lp = run(model, prompt + a.tokens + more, 6, greedy)
    assert b.prompt_tokens == ref.prompt_tokens == len(prompt) + 3 + 5 and b.cached_tokens == len(prompt) + 2
    assert b.tokens == ref.tokens
    # on CUDA the two batchings take different kernels: the GEMM rounds activations to f16, matvec
    # keeps float32 (the H200 once gave 1.2e-3 on one of six)
    np.testing.assert_allclose(b_lp, ref_lp, atol=1e-3 if model.device == "cpu" else 5e-3)


def test_system1_exports_its_prompt_and_imports_a_state(model, tmp_path):
    prompt, more = random_prompt(model, 20), random_prompt(model, 4)
    candidates = [" a", " b c", " the end"]
    s1 = model.system1(prompt, candidates, export_kv=str(tmp_path / "p.kv"))
    again = model.system1([], candidates, import_kv=str(tmp_path / "p.kv"))  # the last prompt token evaluated again
    assert (again.prompt_tokens, again.cached_tokens) == (20, 19)
    np.testing.assert_allclose([c.score for c in again.candidates], [c.score for c in s1.candidates], atol=1e-3)
    longer = model.system1(more, candidates, import_kv=str(tmp_path / "p.kv"))
    ref = model.system1(prompt + more, candidates)
    assert longer.cached_tokens == 20
    np.testing.assert_allclose([c.score for c in longer.candidates], [c.score for c in ref.candidates], atol=1e-3)
    gen, _ = run(model, more, 5, SamplingParams(temperature=0), import_kv=str(tmp_path / "p.kv"))
    assert gen.tokens == run(model, prompt + more, 5, SamplingParams(temperature=0))[0].tokens


# -- what is refused ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_model():
    return reflex_engine.load(QWEN3, device="cpu", n_ctx=256)


@pytest.fixture
def state_file(cpu_model, tmp_path):
    path = str(tmp_path / "state.kv")
    list(cpu_model.generate(random_prompt(cpu_model, 10), max_tokens=4, export_kv=path))
    return path


def read_back(model, path):
    return model.generate([], max_tokens=1, import_kv=path)


def test_damaged_files_are_refused(cpu_model, state_file, tmp_path):
    data = open(state_file, "rb").read()
    header_at = struct.unpack_from("<Q", data, 16)[0]
    cases = {
        "truncated": data[: rng.randrange(len(data))],
        "longer": data + b"\0" * rng.randrange(1, 100),
        "version": data[:8] + struct.pack("<I", 2) + data[12:],
        "header": data[:header_at] + bytes([data[header_at] ^ 1 << rng.randrange(8)]) + data[header_at + 1 :],
        "magic": b"GGUF" + data[4:],
        "empty": b"",
    }
    messages = {"truncated": "truncated", "longer": "truncated", "version": "format 2; this Reflex reads format 1",
                "header": "fails its checksum", "magic": "not a Reflex KV state file", "empty": "not a Reflex KV state file"}
    if len(cases["truncated"]) < 32:
        messages["truncated"] = "not a Reflex KV state file"
    for name, damaged in cases.items():
        path = tmp_path / f"{name}.kv"
        path.write_bytes(damaged)
        with pytest.raises(ReflexError, match=messages[name]):
            read_back(cpu_model, str(path))


def test_a_header_that_lies_about_its_arrays_is_refused(cpu_model, state_file, tmp_path):
    data = open(state_file, "rb").read()
    header_at, length = struct.unpack_from("<QQ", data, 16)
    header = json.loads(data[header_at:])
    for change, message in [(lambda h: h["arrays"][3].update(offset=header_at), "lies outside the file"),
                            (lambda h: h["arrays"][0].update(dtype="bf16"), "dtypes"),
                            (lambda h: h["arrays"].pop(), "does not fit this model"),
                            (lambda h: h["tokens"].append(1), "does not fit this model"),
                            (lambda h: h.update(tokens="abc"), "not a KV state header"),
                            (lambda h: h["pending"].append(10**6), "outside the vocabulary"),
                            # found by fuzz/fuzz_kvstate.py: a RecursionError from json
                            (lambda h: h.update(sampler="NESTED"), "not JSON"),
                            # found by fuzz/fuzz_kvstate.py: a newline in the architecture made the error two lines
                            (lambda h: h["model"].update(architecture="qw\n3"), r"another model \(qw\\n3, fingerprint")]:
        h = json.loads(json.dumps(header))
        change(h)
        raw = json.dumps(h).encode().replace(b'"NESTED"', b"[" * 100_000 + b"]" * 100_000)
        import zlib

        forged = data[:12] + struct.pack("<IQQ", zlib.crc32(raw), header_at, len(raw)) + data[32:header_at] + raw
        path = tmp_path / "forged.kv"
        path.write_bytes(forged)
        with pytest.raises(ReflexError, match=message) as e:
            read_back(cpu_model, str(path))
        assert "\n" not in str(e.value)


def test_another_models_file_is_refused(state_file):
    llama = reflex_engine.load(LLAMA, device="cpu")
    with pytest.raises(ReflexError, match="written for another model"):
        read_back(llama, state_file)
    # another file of the same shapes: the fingerprint samples every tensor's bytes
    other = reflex_engine.load(QWEN3.replace("Q8_0", "Q4_0"), device="cpu")
    assert other.state_fingerprint != reflex_engine.load(QWEN3, device="cpu").state_fingerprint


def test_a_changed_weight_changes_the_fingerprint(tmp_path):
    copy = tmp_path / "m.gguf"
    shutil.copy(QWEN3, copy)
    model = reflex_engine.load(str(copy), device="cpu")
    before = model.state_fingerprint
    info = rng.choice(list(model.file.gguf.tensors.values()))
    at = info.offset + rng.randrange(min(info.nbytes, kvstate.SAMPLE_BYTES))
    del model
    with open(copy, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    assert reflex_engine.load(str(copy), device="cpu").state_fingerprint != before


def test_an_import_that_does_not_fit_the_context_and_messages_are_refused(state_file):
    small = reflex_engine.load(QWEN3, device="cpu", n_ctx=16)
    with pytest.raises(ContextExceeded, match="imported state"):
        small.generate(list(range(10)), max_tokens=1, import_kv=state_file)
    with pytest.raises(ReflexError, match="not chat messages"):
        small.generate([{"role": "user", "content": "hi"}], import_kv=state_file)


def test_writing_is_atomic(cpu_model, state_file, monkeypatch, tmp_path):
    before = open(state_file, "rb").read()

    def fail(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)
    gen = cpu_model.generate([5, 6, 7], max_tokens=2, export_kv=state_file)
    with pytest.raises(ReflexError, match="cannot write the KV state .* No space left"):
        list(gen)
    monkeypatch.undo()
    assert open(state_file, "rb").read() == before
    assert os.listdir(tmp_path) == ["state.kv"]  # no temporary file left
    with pytest.raises(ReflexError, match="not a writable folder"):  # refused before the work
        cpu_model.generate([1], export_kv=str(tmp_path / "absent" / "x.kv"))
    with pytest.raises(ReflexError, match="is a folder"):
        cpu_model.system1([1], ["a"], export_kv=str(tmp_path))


def test_an_f16_file_imports_on_the_cpu(cpu_model, tmp_path):
    """As a CUDA backend writes them: the CPU widens f16 to its float32 cache. f16 rounding moves the
    logprobs (by up to 5e-3 here), so the prompt is one whose greedy tokens it cannot flip."""
    prompt = clear_prompt(cpu_model, 16, 6)
    greedy = SamplingParams(temperature=0)
    ref, ref_lp = run(cpu_model, prompt, 6, greedy)
    a, _ = run(cpu_model, prompt, 2, greedy, export_kv=str(tmp_path / "f32.kv"))
    state = cpu_model._read_state(str(tmp_path / "f32.kv"))
    with kvstate.mapped_arrays(state, len(state.tokens)) as arrays:
        halves = [a._replace(dtype="f16", data=np.frombuffer(a.data, "<f4").astype("<f2")) for a in arrays.values()]
        kvstate.write_state(str(tmp_path / "f16.kv"), fingerprint=cpu_model.state_fingerprint, architecture="qwen3",
                            tokens=state.tokens, pending=state.pending, sampler=None, arrays=halves)
    b, b_lp = run(cpu_model, [], 4, greedy, import_kv=str(tmp_path / "f16.kv"))
    assert a.tokens + b.tokens == ref.tokens
    np.testing.assert_allclose(b_lp, ref_lp[2:], atol=5e-3)
    assert b_lp != ref_lp[2:]  # f16 rounding reached the logits: the f16 arrays were used


# -- the command line and the IPC ---------------------------------------------------------------------


def test_cli_export_and_import(tmp_path):
    path = str(tmp_path / "s.kv")
    common = ["-n", "5", "--temp", "0.9", "--seed", "7", "--ignore-eos", "--device", "cpu", "--json"]
    whole = json.loads(run_cli("generate", QWEN3, "Once upon", *common[:1], "10", *common[2:]).stdout)
    a = json.loads(run_cli("generate", QWEN3, "Once upon", *common, "--export-kv", path).stdout)
    b = run_cli("generate", QWEN3, *common, "--import-kv", path)
    assert b.returncode == 0, b.stderr
    b = json.loads(b.stdout)
    assert a["token_ids"] + b["token_ids"] == whole["token_ids"]
    assert b["cached_tokens"] == b["prompt_tokens"] - 1 and "kv_import_ms" in b and "kv_export_ms" in a
    s1 = run_cli("system1", QWEN3, "Hello", "--candidate", "a", "--device", "cpu", "--import-kv", path)
    assert s1.returncode == 0 and "cached_tokens=" in s1.stdout.split("\n")[-2]


def test_cli_errors_are_one_line(tmp_path, state_file):
    bad = tmp_path / "bad.kv"
    bad.write_bytes(open(state_file, "rb").read()[:-3])
    assert_one_line_error(run_cli("generate", QWEN3, "x", "--device", "cpu", "--import-kv", str(bad)), "truncated")
    assert_one_line_error(run_cli("generate", LLAMA, "--device", "cpu", "--import-kv", state_file), "another model")
    assert_one_line_error(run_cli("generate", QWEN3, "x", "--chat", "--import-kv", state_file), "--chat")
    assert_one_line_error(run_cli("system1", QWEN3, "x", "--candidate", "a", "--export-kv", str(tmp_path / "no" / "f")),
                          "not a writable folder")
    assert sorted(os.listdir(tmp_path)) == ["bad.kv", "state.kv"]


def test_the_ipc_exports_and_imports(tmp_path, cpu_model):
    from test_ipc import ENGINE, checked

    path = str(tmp_path / "s.kv")
    sampling = {"temperature": 0.8, "seed": 3}
    requests = [{"op": "generate", "id": 1, "prompt": "Once", "max_tokens": 4, "ignore_eos": True, "export_kv": path, **sampling},
                {"op": "generate", "id": 2, "prompt": "", "max_tokens": 4, "ignore_eos": True, "import_kv": path, **sampling},
                {"op": "system1", "id": 3, "prompt": " x", "candidates": ["a"], "import_kv": path},
                {"op": "generate", "id": 4, "prompt": "x", "import_kv": str(tmp_path / "absent.kv")},
                {"op": "generate", "id": 5, "prompt": "x", "import_kv": 3}]
    proc = subprocess.run([*ENGINE, "stdio", QWEN3, "--device", "cpu", "-c", "256"], capture_output=True, timeout=120,
                          input=b"".join(json.dumps(r).encode() + b"\n" for r in requests))
    assert proc.returncode == 0, proc.stderr
    ready, first, second, s1, absent, wrong = [checked(line) for line in proc.stdout.splitlines()]
    whole = cpu_model.generate("Once", max_tokens=8, ignore_eos=True, sampling=SamplingParams(**sampling))
    list(whole)
    assert first["tokens"] + second["tokens"] == whole.tokens
    assert second["usage"] == {"prompt_tokens": len(cpu_model.tokenize("Once")) + 4, "cached_tokens": second["usage"]["prompt_tokens"] - 1,
                               "completion_tokens": 4}
    assert s1["usage"]["cached_tokens"] == second["usage"]["prompt_tokens"] - 1  # the file's 4 + 1 tokens, the last evaluated again
    assert (absent["code"], wrong["code"], wrong["field"]) == ("invalid_request", "wrong_type", "import_kv")


def test_the_state_module_imports_no_numpy():
    code = "import sys, reflex_engine.kvstate; print([m for m in sys.modules if m.split('.')[0] == 'numpy'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


# -- across devices, and the CUDA cold path (GPU only) ------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("writer,reader", [("cpu", "cuda"), ("cuda", "cpu")])
def test_a_state_moves_between_devices(writer, reader, tmp_path):
    """f32 from the CPU is rounded into CUDA's f16 cache by kv_store; f16 from CUDA widens exactly."""
    w, r = (reflex_engine.load(QWEN3, device=d, n_ctx=256) for d in (writer, reader))
    prompt, greedy = random_prompt(w, 24), SamplingParams(temperature=0)
    a, _ = run(w, prompt, 3, greedy, export_kv=str(tmp_path / "s.kv"))
    moved, moved_lp = run(r, [], 5, greedy, import_kv=str(tmp_path / "s.kv"))
    ref, ref_lp = run(r, prompt, 8, greedy)  # the reader's own uninterrupted run
    assert a.tokens + moved.tokens == ref.tokens
    np.testing.assert_allclose(moved_lp, ref_lp[3:], atol=5e-2)  # f16 rounding of the cache and the GEMMs


@pytest.mark.gpu
def test_generate_on_cuda_with_an_imported_state_loads_no_numpy(tmp_path):
    path = str(tmp_path / "s.kv")
    assert run_cli("generate", QWEN3, "Hello", "-n", "3", "--device", "cuda", "--export-kv", path).returncode == 0
    code = ("import sys\nfrom reflex_engine import cli\n"
            f"code = cli.main(['generate', {QWEN3!r}, ' more', '--device', 'cuda', '-n', '3', '--import-kv', {path!r}])\n"
            "print('numpy' in sys.modules, code)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "cached_tokens=" in proc.stdout and proc.stdout.rstrip().split("\n")[-1] == "False 0"
