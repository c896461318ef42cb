"""The forward pass against transformers, on tiny random llama/qwen3 models converted by
llama.cpp's convert_hf_to_gguf.py at every listed quant type (tests/goldens, made by
tools/make_goldens.py). Logits within each device's tolerance of the logit range (check.py:
1e-4 on the CPU); greedy identical for 32 tokens."""
import json
import os

import numpy as np
import pytest

import reflex_engine
from reflex_engine.check import TOLERANCE, check_against_reference
from reflex_engine.gguf import GGUFFile
from reflex_engine.sampling import SamplingParams
from reflex_engine.tokenizer import Tokenizer
from model_files import run_cli

GOLDENS = os.path.join(os.path.dirname(__file__), "goldens")
ARCHS = ["llama", "qwen3", "llama3"]
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]
# llama3: Llama 3.1 RoPE scaling (a rope_freqs tensor), original context 64, prompts to 300
# tokens; only F32 and Q8_0, referenced against transformers on the checkpoint itself.
VARIANTS = [(arch, t) for arch in ARCHS[:2] for t in TYPES] + [("llama3", "F32"), ("llama3", "Q8_0")]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def paths(arch, qtype):
    return os.path.join(GOLDENS, arch, f"{arch}-{qtype}.gguf"), os.path.join(GOLDENS, arch, f"goldens-{qtype}.npz")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch,qtype", VARIANTS)
def test_logits_and_greedy_match_transformers(arch, qtype, device):
    model_path, golden_path = paths(arch, qtype)
    model = reflex_engine.load(model_path, device=device)
    report = check_against_reference(model, golden_path)
    assert report.tolerance == TOLERANCE[device]
    assert report.ok, "\n".join(report.lines)
    assert report.n_prompts == (6 if arch == "llama3" else 5)
    assert sum("greedy" in line and "identical" in line for line in report.lines) == 2


def test_llama3_file_carries_rope_freqs_and_they_matter():
    model = reflex_engine.load(paths("llama3", "F32")[0], device="cpu")
    assert model.weights.rope_freqs is not None
    with np.load(paths("llama3", "F32")[1]) as z:
        ids, expected = z["prompt_5"].tolist(), z["logits_5"]
    model.weights.rope_freqs = None  # as if the tensor were ignored
    assert np.abs(model.logits(ids) - expected).max() > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_matches_hf_on_the_toy_vocab(arch):
    with GGUFFile(paths(arch, "F32")[0]) as f:
        tok = Tokenizer.from_gguf(f)
    with open(os.path.join(GOLDENS, arch, "tokenizer-check.json")) as fh:
        cases = json.load(fh)["cases"]
    for case in cases:
        assert tok.encode(case["text"], add_bos=False) == case["ids"], case["text"]
        assert tok.encode(case["text"]) == case["ids_with_special"], case["text"]


def test_check_command_passes_on_goldens_and_fails_on_a_poisoned_reference(tmp_path):
    model_path, golden_path = paths("qwen3", "Q4_K")
    ok = run_cli("check", model_path, "--reference", golden_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.rstrip().split("\n")[-1].startswith("REFLEX_CHECK_OK")

    with np.load(golden_path) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["logits_3"] = arrays["logits_3"].copy()
    arrays["logits_3"][5, 17] += 0.05  # one logit off by ~1% of the range
    poisoned = str(tmp_path / "poisoned.npz")
    np.savez(poisoned, **arrays)
    bad = run_cli("check", model_path, "--reference", poisoned)
    assert bad.returncode == 1
    assert "prompt 3: 16 tokens" in bad.stdout and "at position 5" in bad.stdout and "MISMATCH" in bad.stdout
    assert bad.stdout.rstrip().split("\n")[-1].startswith("REFLEX_CHECK_FAIL")


def test_generate_and_system1_run_on_a_tiny_model_with_chat_template():
    model_path, _ = paths("qwen3", "Q8_0")
    gen = run_cli("generate", model_path, "Hello", "--chat", "--temp", "0", "-n", "5")
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.rstrip().split("\n")[-1].startswith("REFLEX_GENERATE_OK ")
    s1 = run_cli("system1", model_path, "Hello", "--candidate", "a", "--candidate", "bc")
    assert s1.returncode == 0, s1.stderr
    lines = s1.stdout.rstrip().split("\n")
    assert [line.split()[0] for line in lines] == ["REFLEX_SYSTEM1_CANDIDATE_OK"] * 2 + ["REFLEX_SYSTEM1_OK"]


@pytest.mark.parametrize("device", DEVICES)
def test_batches_longer_than_a_pass_run_as_several_passes_over_one_cache(device):
    """Passes of 5 tokens (the engine splits what exceeds ops.max_batch) give the logits, the
    system1 scores and the greedy tokens of one pass, within the device's tolerance."""
    model_path, golden_path = paths("llama3", "F32")
    model = reflex_engine.load(model_path, device=device)
    with np.load(golden_path) as z:
        ids = z["prompt_5"].tolist()  # 160 tokens
    whole = model.logits(ids)
    candidates = [" a b c d e f g", " hello there", " x"]
    s1_whole = model.system1(ids[:40], candidates)
    gen_whole = model.generate(ids[:30], max_tokens=12, sampling=SamplingParams(temperature=0), ignore_eos=True)
    list(gen_whole)
    model.ops.max_batch = 5
    split = model.logits(ids)
    assert np.abs(split - whole).max() <= TOLERANCE[device] * np.ptp(whole)
    s1_split = model.system1(ids[:40], candidates)
    np.testing.assert_allclose([c.score for c in s1_split.candidates], [c.score for c in s1_whole.candidates],
                               rtol=TOLERANCE[device], atol=TOLERANCE[device])
    gen_split = model.generate(ids[:30], max_tokens=12, sampling=SamplingParams(temperature=0), ignore_eos=True)
    list(gen_split)
    assert gen_split.tokens == gen_whole.tokens
