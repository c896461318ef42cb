"""Mixture of experts: the router and the experts on the numpy backend, each against a per-token
formulation written out here, and qwen3moe against transformers (tests/goldens/qwen3moe, made by
tools/make_goldens.py from a tiny random Qwen3MoeForCausalLM converted by llama.cpp)."""
import os

import numpy as np
import pytest

import reflex_engine
from reflex_engine.backends.cpu import CpuOps
from reflex_engine.check import TOLERANCE, check_against_reference
from reflex_engine.errors import ReflexError
from reflex_engine.ops import Gating, Routing
from model_files import rewrite, run_cli
from test_goldens import DEVICES, paths

ops = CpuOps()
rng = np.random.default_rng(11)
MOE_TYPES = ["F32", "F16", "Q8_0", "Q4_0"]


def _route_reference(logits, routing, bias=None):
    """One token at a time: probabilities, group filter, top-k by sort on (-score, id), weights."""
    experts, weights = [], []
    n = logits.shape[1]
    for row in logits.astype(np.float64):
        p = np.exp(row - row.max()) / np.exp(row - row.max()).sum() if routing.gating is Gating.SOFTMAX else 1 / (1 + np.exp(-row))
        s = p + (0 if bias is None else bias)
        allowed = set(range(n))
        if routing.n_groups > 1:
            size = n // routing.n_groups
            score = [sum(sorted(s[g * size : (g + 1) * size])[-2:]) for g in range(routing.n_groups)]
            kept = sorted(range(routing.n_groups), key=lambda g: (-score[g], g))[: routing.n_groups_used]
            allowed = {e for e in range(n) if e // size in kept}
        chosen = sorted(allowed, key=lambda e: (-s[e], e))[: routing.n_used]
        w = p[chosen]
        if routing.norm:
            w = w / max(w.sum(), 6.103515625e-5)
        if routing.scale not in (0, 1):
            w = w * routing.scale
        experts.append(chosen)
        weights.append(w)
    return np.array(experts), np.array(weights)


@pytest.mark.parametrize("routing,biased", [
    (Routing(2), False),
    (Routing(2, norm=True), False),
    (Routing(3, Gating.SIGMOID, norm=True, scale=2.5), True),
    (Routing(2, Gating.SIGMOID, norm=True, scale=2.5, n_groups=4, n_groups_used=2), True),
    (Routing(1, Gating.SOFTMAX, n_groups=2, n_groups_used=1), False),
])
def test_routing_matches_a_per_token_reference(routing, biased):
    logits = rng.standard_normal((9, 8), dtype=np.float32) * 2
    bias = rng.standard_normal(8, dtype=np.float32) if biased else None
    routes = ops.route(logits, routing, bias)
    experts, weights = _route_reference(logits, routing, bias)
    np.testing.assert_array_equal(routes.experts, experts)
    np.testing.assert_allclose(routes.weights, weights, rtol=1e-5)
    if routing.norm:
        np.testing.assert_allclose(routes.weights.sum(-1), routing.scale if routing.scale else 1.0, rtol=1e-5)


def test_the_selection_bias_picks_but_does_not_weigh():
    logits = np.zeros((1, 4), np.float32)
    bias = np.array([0, 0, 5, 0], np.float32)
    routes = ops.route(logits, Routing(1, Gating.SIGMOID), bias)
    assert routes.experts.tolist() == [[2]] and routes.weights.tolist() == [[0.5]]  # sigmoid(0), no bias


def test_ties_go_to_the_lower_expert_id():
    logits = np.array([[1, 3, 3, 3, 0, 3]], np.float32)
    routes = ops.route(logits, Routing(2, norm=True))
    assert routes.experts.tolist() == [[1, 2]]
    np.testing.assert_allclose(routes.weights, [[0.5, 0.5]])
    flat = ops.route(np.zeros((3, 8), np.float32), Routing(3, norm=True))  # all equal
    assert flat.experts.tolist() == [[0, 1, 2]] * 3


def _experts(n_expert=6, e=16, f=8):
    gate = rng.standard_normal((n_expert, f, e), dtype=np.float32) * 0.3
    up = rng.standard_normal((n_expert, f, e), dtype=np.float32) * 0.3
    down = rng.standard_normal((n_expert, e, f), dtype=np.float32) * 0.3
    return gate, up, down


def _moe_reference(x, experts, weights, gate, up, down):
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for e, w in zip(experts[t], weights[t]):
            g, u = gate[e] @ x[t], up[e] @ x[t]
            out[t] += w * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return out


def test_experts_mix_the_chosen_ffns_by_their_weights():
    gate, up, down = _experts()
    x = rng.standard_normal((7, 16), dtype=np.float32)
    routes = ops.route(rng.standard_normal((7, 6), dtype=np.float32), Routing(2, norm=True))
    got = ops.moe_ffn(x, routes, gate=gate, up=up, down=down)
    np.testing.assert_allclose(got, _moe_reference(x, routes.experts, routes.weights, gate, up, down), rtol=1e-4, atol=1e-5)
    residual = rng.standard_normal((7, 16), dtype=np.float32)  # the residual stream, summed as ops.add sums it
    np.testing.assert_array_equal(ops.moe_ffn(x, routes, gate=gate, up=up, down=down, add=residual), ops.add(residual, got))


def test_every_token_to_one_expert_and_experts_nobody_picks():
    gate, up, down = _experts()
    x = rng.standard_normal((5, 16), dtype=np.float32)
    logits = np.zeros((5, 6), np.float32)
    logits[:, 3] = 20  # every token's first choice
    logits[:, 1] = 10  # and second
    routes = ops.route(logits, Routing(2))
    assert (routes.experts == [3, 1]).all()
    expected = _moe_reference(x, routes.experts, routes.weights, gate, up, down)
    for e in (0, 2, 4, 5):  # nobody picks these: poisoning them must change nothing
        gate[e], up[e], down[e] = np.nan, np.nan, np.nan
    got = ops.moe_ffn(x, routes, gate=gate, up=up, down=down)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    one = ops.route(logits, Routing(1, norm=True))  # top-1, renormalised: expert 3's own output
    g, u = x @ gate[3].T, x @ up[3].T
    np.testing.assert_allclose(ops.moe_ffn(x, one, gate=gate, up=up, down=down),
                               (g / (1 + np.exp(-g)) * u) @ down[3].T, rtol=1e-4, atol=1e-5)


def test_no_tokens():
    gate, up, down = _experts()
    routes = ops.route(np.zeros((0, 6), np.float32), Routing(2, norm=True))
    assert ops.moe_ffn(np.zeros((0, 16), np.float32), routes, gate=gate, up=up, down=down).shape == (0, 16)


# -- qwen3moe against transformers ---------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", MOE_TYPES)
def test_qwen3moe_logits_and_greedy_match_transformers(qtype, device):
    model_path, golden_path = paths("qwen3moe", qtype)
    model = reflex_engine.load(model_path, device=device)
    report = check_against_reference(model, golden_path)
    assert report.tolerance == TOLERANCE[device]
    assert report.ok, "\n".join(report.lines)
    assert report.n_prompts == 5
    assert sum("greedy" in line and "identical" in line for line in report.lines) == 2


def test_qwen3moe_renormalises_the_top_k_weights_and_that_matters():
    model = reflex_engine.load(paths("qwen3moe", "F32")[0], device="cpu")
    cfg = model.config
    assert cfg.n_expert == 8 and cfg.n_ff_exp == 32 and cfg.routing == Routing(2, Gating.SOFTMAX, norm=True)
    with np.load(paths("qwen3moe", "F32")[1]) as z:
        ids, expected = z["prompt_4"].tolist(), z["logits_4"]
    assert np.abs(model.logits(ids) - expected).max() <= TOLERANCE["cpu"] * np.ptp(expected)
    model.file.config = cfg._replace(routing=cfg.routing._replace(norm=False))  # HF's norm_topk_prob=False
    assert np.abs(model.logits(ids) - expected).max() > 1e-2


def test_qwen3moe_generate_system1_and_kv_state_round_trip(tmp_path):
    model_path = paths("qwen3moe", "Q8_0")[0]
    kv = str(tmp_path / "state.kv")
    first = run_cli("generate", model_path, "Hello there", "--temp", "0", "-n", "4", "--export-kv", kv)
    assert first.returncode == 0, first.stderr
    more = run_cli("generate", model_path, "--import-kv", kv, "--temp", "0", "-n", "3")
    assert more.returncode == 0, more.stderr
    s1 = run_cli("system1", model_path, "Hello", "--candidate", "a", "--candidate", "bc")
    assert s1.returncode == 0 and s1.stdout.rstrip().split("\n")[-1].startswith("REFLEX_SYSTEM1_OK"), s1.stderr
    model = reflex_engine.load(model_path, device="cpu")
    from reflex_engine.sampling import SamplingParams

    whole = model.generate("Hello there", max_tokens=7, sampling=SamplingParams(temperature=0), ignore_eos=True)
    list(whole)
    gen = model.generate("Hello there", max_tokens=4, sampling=SamplingParams(temperature=0), ignore_eos=True,
                         export_kv=str(tmp_path / "api.kv"))
    list(gen)
    rest = model.generate("", max_tokens=3, sampling=SamplingParams(temperature=0), ignore_eos=True,
                          import_kv=str(tmp_path / "api.kv"))
    list(rest)
    assert gen.tokens + rest.tokens == whole.tokens


# -- malformed MoE files ---------------------------------------------------------------------------

@pytest.mark.parametrize("change,message", [
    (dict(values={"qwen3moe.expert_count": 16}), "tensor 'blk.0.ffn_gate_inp.weight' has shape [64, 8], qwen3moe expects [64, 16]"),
    (dict(values={"qwen3moe.expert_used_count": 9}), "qwen3moe: expert_used_count 9 exceeds expert_count 8"),
    (dict(values={"qwen3moe.expert_feed_forward_length": 64}), "tensor 'blk.0.ffn_gate_exps.weight' has shape [64, 32, 8], qwen3moe expects [64, 64, 8]"),
    (dict(reshape="blk.1.ffn_down_exps.weight"), "tensor 'blk.1.ffn_down_exps.weight' has shape"),
    (dict(drop_key="qwen3moe.expert_count"), "GGUF metadata key 'qwen3moe.expert_count' is missing"),
    (dict(values={"qwen3moe.expert_group_count": 3}), "qwen3moe: 8 experts cannot be split into 3 groups"),
])
def test_inconsistent_expert_counts_or_shapes_are_refused_at_load(tmp_path, change, message):
    bad = rewrite(paths("qwen3moe", "F32")[0], str(tmp_path / "bad.gguf"), **change)
    with pytest.raises(ReflexError, match=None) as info:
        reflex_engine.load(bad, device="cpu")
    assert message in str(info.value) and "\n" not in str(info.value)
    out = run_cli("generate", bad, "hi", "-n", "1")
    err = out.stderr.strip().splitlines()
    assert out.returncode != 0 and len(err) == 1 and message in err[0], out.stderr


def test_the_moe_architecture_code_imports_no_numpy():
    import subprocess
    import sys

    code = "import sys, reflex_engine.arch.qwen3moe, reflex_engine.arch.deepseek2, reflex_engine.engine; sys.exit('numpy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_qwen3moe_tokenizer_matches_hf_on_the_toy_vocab():
    import json

    from reflex_engine.gguf import GGUFFile
    from reflex_engine.tokenizer import Tokenizer

    with GGUFFile(paths("qwen3moe", "F32")[0]) as f:
        tok = Tokenizer.from_gguf(f)
    with open(os.path.join(os.path.dirname(paths("qwen3moe", "F32")[0]), "tokenizer-check.json")) as fh:
        cases = json.load(fh)["cases"]
    assert all(tok.encode(c["text"], add_bos=False) == c["ids"] for c in cases)
