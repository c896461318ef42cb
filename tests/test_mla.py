"""deepseek2: multi-head latent attention with its latent cache, YaRN, and DeepSeek's routing,
against transformers (tests/goldens/deepseek3: a tiny DeepseekV3ForCausalLM; deepseek2: a tiny
V2-Lite-style DeepseekV2ForCausalLM with YaRN; both converted by llama.cpp, made by
tools/make_goldens.py), and the new ops against formulations written out here."""
import math

import numpy as np
import pytest

import reflex_engine
from reflex_engine import kvstate
from reflex_engine.backends.cpu import CpuOps
from reflex_engine.check import TOLERANCE, check_against_reference
from reflex_engine.errors import ReflexError
from reflex_engine.ops import Batch, CacheShape, Rope, RopeMode
from reflex_engine.sampling import SamplingParams
from model_files import rewrite, run_cli
from test_cpu_ops import _attention_reference
from test_goldens import DEVICES, paths

ops = CpuOps()
rng = np.random.default_rng(5)
VARIANTS = [("deepseek3", "F32"), ("deepseek3", "Q8_0"), ("deepseek2", "F32"), ("deepseek2", "Q8_0")]


def test_split_concat_and_per_head_matmul():
    x = rng.standard_normal((3, 2 * 7), dtype=np.float32)
    a, b = ops.split(x, 2, (5, 2))
    np.testing.assert_array_equal(a, np.concatenate([x[:, 0:5], x[:, 7:12]], axis=1))
    np.testing.assert_array_equal(b, np.concatenate([x[:, 5:7], x[:, 12:14]], axis=1))
    np.testing.assert_array_equal(ops.concat([a, b], 2), x)
    w = rng.standard_normal((2, 4, 5), dtype=np.float32)  # (H, out, in)
    expected = np.concatenate([a[:, h * 5 : (h + 1) * 5] @ w[h].T for h in range(2)], axis=1)
    np.testing.assert_allclose(ops.head_matmul(a, w), expected, rtol=1e-5)


@pytest.mark.parametrize("segments", [[0, 0, 0, 0, 0], [0, 0, 1, 1, 2]])
def test_latent_attention_is_multi_query_attention_whose_values_are_the_keys_first_features(segments):
    """Its query and latent row come in two parts each (latent, rope), each head's query the concat of its two."""
    n_heads, width, v_width = 3, 12, 8
    q = rng.standard_normal((5, n_heads * width), dtype=np.float32)
    kv = rng.standard_normal((5, width), dtype=np.float32)
    cache = ops.new_kv_cache(CacheShape(1, 8, width, v_width, latent=True))
    got = ops.latent_attention(ops.split(q, n_heads, (v_width, width - v_width)), (kv[:, :v_width], kv[:, v_width:]),
                               cache=cache, layer=0, batch=Batch([0] * 5, range(5), segments, 0), n_heads=n_heads,
                               scale=width**-0.5)
    np.testing.assert_allclose(got, _attention_reference(q, kv, kv[:, :v_width], segments, n_heads, 1), rtol=1e-4, atol=1e-6)
    assert cache.v == [] and cache.k[0].shape == (8, width)  # one latent row per slot, nothing else
    np.testing.assert_array_equal(cache.k[0][:5], kv)


def test_yarn_rope_matches_transformers_formulation():
    """HF's _compute_yarn_parameters: inv_freq blended between interpolated and original by a
    linear ramp over the correction range, cos/sin times the attention factor."""
    n_rot, base, factor, n_orig, mag = 16, 10000.0, 8.0, 4096, 1.2
    rope = Rope(RopeMode.NORM, n_rot, base, 1 / factor, ext_factor=1.0, n_ctx_orig=n_orig, magnitude=mag)

    def corr(beta):
        return (n_rot * math.log(n_orig / (beta * 2 * math.pi))) / (2 * math.log(base))

    low, high = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), n_rot - 1)
    pos_freqs = base ** (np.arange(0, n_rot, 2) / n_rot)
    ramp = np.clip((np.arange(n_rot // 2) - low) / (high - low), 0, 1)
    extrap = 1 - ramp
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrap) + (1 / pos_freqs) * extrap
    assert 0 < low < high < n_rot // 2  # the ramp bends some pairs, keeps some, interpolates some
    x = rng.standard_normal((4, n_rot), dtype=np.float32)
    positions = [0, 3, 70, 5000]
    expected = x.astype(np.float64).copy()
    for t, p in enumerate(positions):
        z = (x[t, 0::2] + 1j * x[t, 1::2]) * np.exp(1j * p * inv_freq) * mag
        expected[t, 0::2], expected[t, 1::2] = z.real, z.imag
    np.testing.assert_allclose(ops.rope(x, positions, n_rot, rope), expected, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant,qtype", VARIANTS)
def test_deepseek_logits_and_greedy_match_transformers(variant, qtype, device):
    model_path, golden_path = paths(variant, qtype)
    model = reflex_engine.load(model_path, device=device)
    report = check_against_reference(model, golden_path)
    assert report.tolerance == TOLERANCE[device]
    assert report.ok, "\n".join(report.lines)
    assert report.n_prompts == (6 if variant == "deepseek2" else 5)
    assert sum("greedy" in line and "identical" in line for line in report.lines) == 2


def _without(model, what):
    cfg = model.config
    if what == "selection bias":
        for lw in model.weights.blk:
            lw.exp_probs_b = None
    elif what == "expert groups":
        model.file.config = cfg._replace(routing=cfg.routing._replace(n_groups=1, n_groups_used=1))
    elif what == "renormalisation":
        model.file.config = cfg._replace(routing=cfg.routing._replace(norm=False))
    elif what == "routed scaling":
        model.file.config = cfg._replace(routing=cfg.routing._replace(scale=1.0))
    elif what == "shared experts":
        model.file.config = cfg._replace(n_shared_experts=0)
    elif what == "yarn":
        model.file.config = cfg._replace(rope=cfg.rope._replace(ext_factor=0.0))
    elif what == "mscale":
        model.file.config = cfg._replace(scale=cfg.qk_head_dim**-0.5)


@pytest.mark.parametrize("variant,what", [
    ("deepseek3", "selection bias"), ("deepseek3", "expert groups"), ("deepseek3", "renormalisation"),
    ("deepseek3", "routed scaling"), ("deepseek3", "shared experts"),
    ("deepseek2", "routed scaling"), ("deepseek2", "shared experts"), ("deepseek2", "yarn"), ("deepseek2", "mscale"),
])
def test_each_part_of_the_file_matters(variant, what):
    model = reflex_engine.load(paths(variant, "F32")[0], device="cpu")
    with np.load(paths(variant, "F32")[1]) as z:
        ids, expected = z["prompt_4"].tolist(), z["logits_4"]
    assert np.abs(model.logits(ids) - expected).max() <= TOLERANCE["cpu"] * np.ptp(expected)
    _without(model, what)
    assert np.abs(model.logits(ids) - expected).max() > 1e-3


def test_the_config_reads_v3_and_v2_lite_as_the_metadata_says():
    v3 = reflex_engine.load(paths("deepseek3", "F32")[0], device="cpu").config
    assert (v3.q_lora_rank, v3.kv_lora_rank, v3.qk_nope_dim, v3.rope.n_rot, v3.v_head_mla) == (32, 32, 32, 16, 32)
    assert (v3.routing.gating.name, v3.routing.norm, v3.routing.scale, v3.routing.n_groups, v3.routing.n_groups_used) == ("SIGMOID", True, 2.5, 2, 1)
    assert v3.n_dense_layers == 1 and v3.n_shared_experts == 1 and v3.attn_scale == pytest.approx(48**-0.5)
    lite = reflex_engine.load(paths("deepseek2", "F32")[0], device="cpu").config
    assert lite.q_lora_rank == 0 and lite.routing.gating.name == "SOFTMAX" and not lite.routing.norm
    assert (lite.rope.ext_factor, lite.rope.freq_scale, lite.rope.n_ctx_orig, lite.rope.magnitude) == (1.0, 0.125, 64, 1.0)
    assert lite.attn_scale == pytest.approx((1 + 0.1 * 0.707 * math.log(8)) ** 2 / math.sqrt(48), rel=1e-5)


@pytest.mark.parametrize("variant", ["deepseek3", "deepseek2"])
def test_the_cache_holds_the_latent_only_and_kv_state_files_carry_it(variant, tmp_path):
    model = reflex_engine.load(paths(variant, "Q8_0")[0], device="cpu", n_ctx=64)
    cfg = model.config
    per_token = cfg.kv_lora_rank + cfg.rope.n_rot
    assert [k.shape for k in model.cache.k] == [(64, per_token)] * cfg.n_layers and model.cache.v == []
    greedy = SamplingParams(temperature=0)
    whole = model.generate("Hello there", max_tokens=7, sampling=greedy, ignore_eos=True)
    list(whole)
    first = model.generate("Hello there", max_tokens=4, sampling=greedy, ignore_eos=True, export_kv=str(tmp_path / "s.kv"))
    list(first)
    state = kvstate.read_header(str(tmp_path / "s.kv"), fingerprint=kvstate.model_fingerprint(model.file.gguf),
                                architecture="deepseek2", config=cfg)
    n = len(state.tokens)
    assert kvstate.cache_layout(cfg, n) == [(f"blk.{i}.kv", (n, per_token)) for i in range(cfg.n_layers)]
    rest = model.generate("", max_tokens=3, sampling=greedy, ignore_eos=True, import_kv=str(tmp_path / "s.kv"))
    list(rest)
    assert first.tokens + rest.tokens == whole.tokens


def test_generate_system1_and_the_cli_run_on_deepseek(tmp_path):
    model_path = paths("deepseek3", "Q8_0")[0]
    gen = run_cli("generate", model_path, "Hello", "--chat", "--temp", "0", "-n", "5", "--export-kv", str(tmp_path / "a.kv"))
    assert gen.returncode == 0 and gen.stdout.rstrip().split("\n")[-1].startswith("REFLEX_GENERATE_OK "), gen.stderr
    more = run_cli("generate", model_path, "--import-kv", str(tmp_path / "a.kv"), "--temp", "0", "-n", "2")
    assert more.returncode == 0, more.stderr
    s1 = run_cli("system1", model_path, "Hello", "--candidate", "a", "--candidate", "bc")
    assert s1.returncode == 0 and s1.stdout.rstrip().split("\n")[-1].startswith("REFLEX_SYSTEM1_OK"), s1.stderr


@pytest.mark.parametrize("change,message", [
    (dict(drop_key="deepseek2.attention.key_length_mla"), "without attention.key_length_mla (an unsplit attn_kv_b) is not supported yet"),
    (dict(values={"deepseek2.attention.key_length": 40}), "do not describe MLA over a latent of 32 + 16 RoPE dims"),
    (dict(values={"deepseek2.expert_gating_func": 3}), "expert_gating_func 3 is not supported"),
    (dict(values={"deepseek2.expert_count": 4}), "tensor 'blk.1.ffn_gate_inp.weight' has shape [64, 8], deepseek2 expects [64, 4]"),
    (dict(drop="blk.2.attn_k_b.weight"), "lacks tensor 'blk.2.attn_k_b.weight'"),
    (dict(values={"deepseek2.leading_dense_block_count": 2}), "lacks tensor 'blk.1.ffn_gate.weight'"),
])
def test_malformed_deepseek_files_are_one_line_errors(tmp_path, change, message):
    bad = rewrite(paths("deepseek3", "F32")[0], str(tmp_path / "bad.gguf"), **change)
    with pytest.raises(ReflexError) as info:
        reflex_engine.load(bad, device="cpu")
    assert message in str(info.value) and "\n" not in str(info.value)
