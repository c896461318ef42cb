"""`reflex prepare MODEL --system-prompt FILE`: the prompt's KV beside the model, taken by every
request whose prompt ids start with it (generate, system1, stdio), which then skips that prefill
(cached_tokens, kv_import_ms); a stale or damaged baked file is ignored, never trusted."""
import json
import os
import random
import shutil
import subprocess

import numpy as np
import pytest

import reflex_engine
from reflex_engine.kvstate import baked_state_path
from reflex_engine.sampling import SamplingParams

from model_files import run_cli
from test_cli import assert_one_line_error

GOLDENS = os.path.join(os.path.dirname(__file__), "goldens")
QWEN3 = os.path.join(GOLDENS, "qwen3", "qwen3-Q8_0.gguf")
LLAMA = os.path.join(GOLDENS, "llama", "llama-F32.gguf")
WORDS = "the a cat dog sat ran on under table house river quickly slowly said answer question why".split()
rng = random.Random()


def random_text(n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words)) + ".\n\n"


@pytest.fixture
def prepared(tmp_path):
    """A model copy with a random system prompt baked beside it: (model path, system prompt text)."""
    model = tmp_path / "m.gguf"
    shutil.copy(QWEN3, model)
    system = random_text(rng.randrange(20, 60))
    (tmp_path / "system.txt").write_text(system)
    out = run_cli("prepare", str(model), "--system-prompt", str(tmp_path / "system.txt"), "--device", "cpu")
    assert out.returncode == 0, out.stderr
    assert "wrote " + baked_state_path(str(model)) in out.stdout
    return str(model), system


def greedy_run(model, prompt, n=6):
    gen = model.generate(prompt, max_tokens=n, sampling=SamplingParams(temperature=0), ignore_eos=True, logprobs=True)
    return gen, [e.logprob for e in gen if e.id is not None]


def test_a_prompt_that_starts_with_the_baked_one_skips_its_prefill(prepared):
    path, system = prepared
    model = reflex_engine.load(path, device="cpu", n_ctx=256)
    n_system = len(model.tokenize(system))
    prompt = system + "Question: " + random_text(5)
    baked, baked_lp = greedy_run(model, prompt)
    assert baked.cached_tokens == n_system and "kv_import_ms" in baked.timings
    os.rename(baked_state_path(path), baked_state_path(path) + ".away")
    plain, plain_lp = greedy_run(model, prompt)
    assert plain.cached_tokens == 0 and "kv_import_ms" not in plain.timings
    assert baked.tokens == plain.tokens and baked.prompt_tokens == plain.prompt_tokens
    np.testing.assert_allclose(baked_lp, plain_lp, atol=1e-3)  # one pass or two: equal within rounding
    os.rename(baked_state_path(path) + ".away", baked_state_path(path))
    assert greedy_run(model, "Question: " + system)[0].cached_tokens == 0  # not a prefix
    exact, _ = greedy_run(model, system)  # the whole prompt is the baked one: its last token is evaluated again
    assert exact.cached_tokens == n_system - 1
    s1 = model.system1(prompt, [" a", " b"])
    assert s1.cached_tokens == n_system
    ref = reflex_engine.load(QWEN3, device="cpu", n_ctx=256).system1(prompt, [" a", " b"])
    np.testing.assert_allclose([c.score for c in s1.candidates], [c.score for c in ref.candidates], atol=1e-3)


def test_a_prompt_that_merges_across_the_seam_still_takes_the_shared_tokens(tmp_path):
    model = reflex_engine.load(QWEN3, device="cpu", n_ctx=256)
    system = random_text(30).rstrip(".\n") + " the ca"  # the prompt goes on "t ...": the tokenizer merges "cat"
    baked_ids = model.tokenize(system)
    prompt = system + "t sat on the table"
    ids = model.tokenize(prompt)
    shared = next(i for i, (a, b) in enumerate(zip(baked_ids, ids)) if a != b)
    assert len(baked_ids) - 4 <= shared < len(baked_ids)  # a seam, within SEAM_TOKENS
    copy = tmp_path / "m.gguf"
    shutil.copy(QWEN3, copy)
    reflex_engine.load(str(copy), device="cpu").bake_prompt(system)
    seamed, seamed_lp = greedy_run(reflex_engine.load(str(copy), device="cpu", n_ctx=256), prompt)
    plain, plain_lp = greedy_run(model, prompt)
    assert seamed.cached_tokens == shared and seamed.tokens == plain.tokens
    np.testing.assert_allclose(seamed_lp, plain_lp, atol=1e-3)
    far = system[: len(system) // 2] + " dog"  # shares only half the baked prompt: not taken
    assert greedy_run(reflex_engine.load(str(copy), device="cpu", n_ctx=256), far)[0].cached_tokens == 0


def test_the_cli_result_line_shows_the_prefill_gone(prepared):
    path, system = prepared
    out = run_cli("generate", path, system + "Question: why", "-n", "2", "--temp", "0", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    fields = dict(kv.split("=", 1) for kv in out.stdout.strip().split("\n")[-1].split()[1:])
    model = reflex_engine.load(path, device="cpu")
    assert int(fields["cached_tokens"]) == len(model.tokenize(system)) and "kv_import_ms" in fields
    assert int(fields["prompt_tokens"]) == len(model.tokenize(system + "Question: why"))


def test_a_stale_or_damaged_baked_prompt_is_ignored(prepared, tmp_path):
    path, system = prepared
    prompt = system + "Question: " + random_text(3)
    model = reflex_engine.load(path, device="cpu", n_ctx=256)
    plain = greedy_run(model, prompt)[0].tokens
    baked = baked_state_path(path)
    data = open(baked, "rb").read()
    for damaged in (data[: rng.randrange(len(data))], data[:-1] + bytes([data[-1] ^ 1])):
        open(baked, "wb").write(damaged)
        gen, _ = greedy_run(model, prompt)
        assert gen.cached_tokens == 0 and gen.tokens == plain
    # another model's baked prompt with the same text: its fingerprint is not this model's
    other = tmp_path / "other.gguf"
    shutil.copy(QWEN3.replace("Q8_0", "Q4_0"), other)
    reflex_engine.load(str(other), device="cpu").bake_prompt(system)
    shutil.copy(baked_state_path(str(other)), baked)
    assert greedy_run(model, prompt)[0].cached_tokens == 0


def test_a_chat_system_turn_is_baked_and_stdio_takes_it(tmp_path):
    model_path = tmp_path / "m.gguf"
    shutil.copy(QWEN3, model_path)
    system = random_text(30).strip()
    (tmp_path / "system.txt").write_text(system)
    out = run_cli("prepare", str(model_path), "--system-prompt", str(tmp_path / "system.txt"), "--chat", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    messages = [{"role": "system", "content": system}, {"role": "user", "content": random_text(4)}]
    from test_ipc import ENGINE, checked

    requests = [{"op": "generate", "id": 1, "messages": messages, "max_tokens": 3, "temperature": 0},
                {"op": "system1", "id": 2, "messages": messages, "candidates": ["a"]},
                {"op": "generate", "id": 3, "prompt": "no system prompt", "max_tokens": 1}]
    proc = subprocess.run([*ENGINE, "stdio", str(model_path), "--device", "cpu", "-c", "256"], capture_output=True, timeout=120,
                          input=b"".join(json.dumps(r).encode() + b"\n" for r in requests))
    assert proc.returncode == 0, proc.stderr
    _, gen, s1, other = [checked(line) for line in proc.stdout.splitlines()]
    model = reflex_engine.load(str(model_path), device="cpu")
    n_turn = len(model.tokenize(model.file.render_chat(messages[:1], add_generation_prompt=False), add_bos=False))
    assert gen["usage"]["cached_tokens"] == s1["usage"]["cached_tokens"] == n_turn and other["usage"]["cached_tokens"] == 0
    assert "kv_import_ms" in gen["timings"]


def test_bad_system_prompt_files_are_one_line_errors(tmp_path):
    model = tmp_path / "m.gguf"
    shutil.copy(QWEN3, model)
    assert_one_line_error(run_cli("prepare", str(model), "--system-prompt", str(tmp_path / "absent.txt")), "cannot read")
    (tmp_path / "empty.txt").write_text("")
    assert_one_line_error(run_cli("prepare", str(model), "--system-prompt", str(tmp_path / "empty.txt"), "--device", "cpu"),
                          "tokenizes to no tokens")
    assert not os.path.exists(baked_state_path(str(model)))
    (tmp_path / "long.txt").write_text("word " * 3000)  # over the fixture's 512-token context
    assert_one_line_error(run_cli("prepare", str(model), "--system-prompt", str(tmp_path / "long.txt"), "--device", "cpu"),
                          "longer than the model's context")
    assert sorted(os.listdir(tmp_path)) == ["empty.txt", "long.txt", "m.gguf", "m.gguf.reflex"]


@pytest.mark.gpu
def test_a_baked_prompt_on_cuda_skips_its_prefill_and_loads_no_numpy(prepared):
    path, system = prepared  # baked on the CPU (f32): CUDA rounds it into its f16 cache
    code = ("import sys\nfrom reflex_engine import cli\n"
            f"code = cli.main(['generate', {path!r}, {system + 'Question: why'!r}, '--device', 'cuda', '-n', '3', '--temp', '0'])\n"
            "print('numpy' in sys.modules, code)")
    proc = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    fields = dict(kv.split("=", 1) for kv in proc.stdout.strip().split("\n")[-2].split()[1:])
    assert int(fields["cached_tokens"]) > 10 and proc.stdout.rstrip().split("\n")[-1] == "False 0"
    cuda = reflex_engine.load(path, device="cuda", n_ctx=256)
    prompt = system + "Question: " + random_text(4)
    baked, baked_lp = greedy_run(cuda, prompt)
    os.remove(baked_state_path(path))
    plain, plain_lp = greedy_run(cuda, prompt)
    assert baked.cached_tokens > 10 and baked.tokens == plain.tokens
    np.testing.assert_allclose(baked_lp, plain_lp, atol=5e-2)
