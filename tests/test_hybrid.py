"""The hybrid architectures (qwen35, qwen35moe, qwen3next): the Gated DeltaNet ops on the numpy
backend against formulations written out here (the delta rule token by token in float64, the
chunked form against it up to 4,096 tokens), the models against transformers (tests/goldens,
made by tools/make_goldens.py from tiny random checkpoints converted by llama.cpp), and the
engine's recurrent state: generate, system1, KV state files."""
import numpy as np
import pytest

import reflex_engine
from reflex_engine import kvstate
from reflex_engine.backends.cpu import CpuOps
from reflex_engine.backends.cpu import delta_rule
from reflex_engine.check import TOLERANCE, check_against_reference
from reflex_engine.errors import ReflexError
from reflex_engine.ops import Batch, CacheShape, RecurrentShape
from reflex_engine.sampling import SamplingParams
from model_files import rewrite, run_cli
from test_goldens import DEVICES, paths

ops = CpuOps()
rng = np.random.default_rng(35)


def _unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _inputs(h, t, dk, dv):
    """Head-major q, k (unit rows, as after the L2 norm), v, g <= 0, beta in (0, 1), a state."""
    q = _unit(rng.standard_normal((h, t, dk))).astype(np.float32) * dk**-0.5
    k = _unit(rng.standard_normal((h, t, dk))).astype(np.float32)
    v = rng.standard_normal((h, t, dv)).astype(np.float32)
    g = -rng.uniform(0, 0.3, (h, t)).astype(np.float32)
    beta = rng.uniform(0, 1, (h, t)).astype(np.float32)
    state = rng.standard_normal((h, dk, dv)).astype(np.float32) * 0.3
    return q, k, v, g, beta, state


def _delta_rule_reference(q, k, v, g, beta, state):
    """The definition in float64, one head and one token at a time."""
    s, out = state.astype(np.float64), np.zeros(v.shape)
    for h in range(q.shape[0]):
        for t in range(q.shape[1]):
            s[h] = np.exp(g[h, t]) * s[h]
            delta = beta[h, t] * (v[h, t] - s[h].T @ k[h, t])
            s[h] = s[h] + np.outer(k[h, t], delta)
            out[h, t] = s[h].T @ q[h, t]
    return out, s


@pytest.mark.parametrize("t", [1, 5, 64, 130])
def test_both_forms_of_the_delta_rule_are_its_definition(t):
    args = _inputs(3, t, 8, 6)
    want_o, want_s = _delta_rule_reference(*args)
    for form in (delta_rule.recurrent, delta_rule.chunked):
        o, s = form(*args)
        np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(s, want_s, rtol=1e-4, atol=1e-5)


def test_the_chunked_delta_rule_follows_the_recurrence_over_4096_tokens():
    args = _inputs(2, 4096, 8, 8)
    o_steps, s_steps = delta_rule.recurrent(*args)
    o_chunks, s_chunks = delta_rule.chunked(*args)
    assert np.abs(o_steps).max() > 0.1  # the state carries signal all the way
    np.testing.assert_allclose(o_chunks, o_steps, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(s_chunks, s_steps, rtol=1e-3, atol=1e-4)
    other = delta_rule.chunked(*args, chunk=48)[0]  # chunk edges elsewhere: the same outputs
    np.testing.assert_allclose(other, o_steps, rtol=1e-3, atol=1e-4)


def _cache(h_v=4, dk=8, dv=6, channels=20, k=4):
    return ops.new_kv_cache(CacheShape(2, 16, 8, 8, recurrent=RecurrentShape((0,), k - 1, channels, h_v, dk, dv)))


@pytest.mark.parametrize("tiled", [True, False])
def test_value_heads_read_their_key_heads_tiled_or_grouped(tiled):
    t, h_k, h_v, dk, dv = 6, 2, 4, 8, 6
    cache = _cache(h_v, dk, dv)
    q, k = rng.standard_normal((t, h_k * dk), dtype=np.float32), _unit(rng.standard_normal((t, h_k, dk))).reshape(t, -1)
    v = rng.standard_normal((t, h_v * dv), dtype=np.float32)
    g, beta = -rng.uniform(0, 0.5, (t, h_v)).astype(np.float32), rng.uniform(0, 1, (t, h_v)).astype(np.float32)
    got = ops.delta_rule(q, k.astype(np.float32), v, g, beta, cache=cache, layer=0, batch=Batch.causal([0] * t, 0),
                         tiled=tiled, scale=0.5)
    for h in range(h_v):
        kh = h % h_k if tiled else h // (h_v // h_k)
        heads = [x.reshape(t, -1, d)[None, :, i] for x, d, i in ((q * 0.5, dk, kh), (k, dk, kh), (v, dv, h))]
        want, _ = _delta_rule_reference(*heads, g[:, h][None], beta[:, h][None], np.zeros((1, dk, dv)))
        np.testing.assert_allclose(got[:, h * dv : (h + 1) * dv], want[0], rtol=1e-4, atol=1e-5)


def test_a_batch_continues_the_state_the_last_one_left_and_start_0_begins_anew():
    t, dk, dv = 9, 8, 6
    q, k = rng.standard_normal((t, 2 * dk), dtype=np.float32), _unit(rng.standard_normal((t, 2, dk))).reshape(t, -1)
    v, g = rng.standard_normal((t, 4 * dv), dtype=np.float32), -rng.uniform(0, 0.5, (t, 4)).astype(np.float32)
    beta, w = rng.uniform(0, 1, (t, 4)).astype(np.float32), rng.standard_normal((20, 4), dtype=np.float32)
    x = rng.standard_normal((t, 20), dtype=np.float32)
    cache = _cache()

    def run(a, b):
        batch = Batch.causal([0] * (b - a), a)
        conv = ops.causal_conv1d(x[a:b], w, cache=cache, layer=0, batch=batch)
        out = ops.delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], cache=cache, layer=0, batch=batch, tiled=True, scale=1.0)
        return conv, out

    whole = run(0, t)
    parts = [run(0, 4), run(4, 5), run(5, t)]  # a prompt, a decode step, more
    for i in range(2):
        np.testing.assert_allclose(np.concatenate([p[i] for p in parts]), whole[i], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(run(0, t)[1], whole[1], rtol=1e-6)  # start 0 forgets the old state


def test_the_causal_conv_sees_the_last_k_inputs_then_silu():
    t, c, taps = 7, 5, 4
    x, w = rng.standard_normal((t, c), dtype=np.float32), rng.standard_normal((c, taps), dtype=np.float32)
    cache = _cache(channels=c, k=taps)
    got = ops.causal_conv1d(x, w, cache=cache, layer=0, batch=Batch.causal([0] * t, 0))
    padded = np.concatenate([np.zeros((taps - 1, c)), x])
    y = np.array([[sum(w[ch, j] * padded[i + j, ch] for j in range(taps)) for ch in range(c)] for i in range(t)])
    np.testing.assert_allclose(got, y / (1 + np.exp(-y)), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(cache.conv[0], x[-(taps - 1):])


def test_gates_norms_and_sigmoid_gate():
    alpha, beta = rng.standard_normal((3, 4), dtype=np.float32) * 5, rng.standard_normal((3, 4), dtype=np.float32) * 5
    dt_bias, ssm_a = rng.standard_normal(4, dtype=np.float32), -np.exp(rng.standard_normal(4, dtype=np.float32))
    g, b = ops.gdn_gates(alpha, beta, dt_bias=dt_bias, ssm_a=ssm_a)
    np.testing.assert_allclose(g, ssm_a * np.log1p(np.exp(alpha.astype(np.float64) + dt_bias)), rtol=1e-5)
    np.testing.assert_allclose(b, 1 / (1 + np.exp(-beta.astype(np.float64))), rtol=1e-6)
    big = ops.gdn_gates(np.array([[1e4]], np.float32), np.array([[-1e4]], np.float32), dt_bias=np.zeros(1, np.float32),
                        ssm_a=-np.ones(1, np.float32))
    assert big[0][0, 0] == -1e4 and big[1][0, 0] == 0  # softplus and sigmoid do not overflow
    x = rng.standard_normal((2, 12), dtype=np.float32)
    norms = np.linalg.norm(ops.l2_norm(x, 4, 0.0).reshape(2, 3, 4), axis=-1)
    np.testing.assert_allclose(norms, 1, rtol=1e-6)
    gate = rng.standard_normal((2, 1), dtype=np.float32)
    np.testing.assert_allclose(ops.sigmoid_gate(x, gate), x / (1 + np.exp(-gate)), rtol=1e-6)


def test_checkpoint_and_rewind_restore_the_recurrent_state_only():
    cache = _cache()
    cache.conv[0][:], cache.ssm[0][:] = 1, 2
    ops.checkpoint_state(cache)
    cache.conv[0][:], cache.ssm[0][:] = 3, 4
    ops.rewind_state(cache)
    assert (cache.conv[0] == 1).all() and (cache.ssm[0] == 2).all()
    assert cache.k[0] is None and cache.k[1].shape == (16, 8)  # layer 0 is recurrent: no K and V


# -- the models against transformers -----------------------------------------------------------

VARIANTS = [("qwen35", "F32"), ("qwen35", "Q8_0"), ("qwen35", "Q4_0"), ("qwen35moe", "F32"), ("qwen35moe", "Q8_0"),
            ("qwen3next", "F32"), ("qwen3next", "Q8_0")]
GREEDY = SamplingParams(temperature=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch,qtype", VARIANTS)
def test_logits_and_greedy_match_transformers(arch, qtype, device):
    model = reflex_engine.load(paths(arch, qtype)[0], device=device)
    report = check_against_reference(model, paths(arch, qtype)[1])
    assert report.tolerance == TOLERANCE[device]
    assert report.ok, "\n".join(report.lines)
    assert report.n_prompts == (6 if arch == "qwen35" else 5)
    assert sum("greedy" in line and "identical" in line for line in report.lines) == 2


def _golden(arch, i=4):
    with np.load(paths(arch, "F32")[1]) as z:
        return z[f"prompt_{i}"].tolist(), z[f"logits_{i}"]


@pytest.mark.parametrize("arch", ["qwen35", "qwen3next"])
def test_the_value_to_key_head_mapping_matters(arch):
    model = reflex_engine.load(paths(arch, "F32")[0], device="cpu")
    ids, expected = _golden(arch)
    assert np.abs(model.logits(ids) - expected).max() <= TOLERANCE["cpu"] * np.ptp(expected)
    model.file.config = model.config._replace(ssm_tiled=not model.config.ssm_tiled)  # what its passes read
    assert np.abs(model.logits(ids) - expected).max() > 1e-3


@pytest.mark.parametrize("arch,what", [("qwen35moe", "renormalisation"), ("qwen35moe", "shared expert"),
                                       ("qwen3next", "shared expert gate"), ("qwen3next", "beta and alpha swapped")])
def test_each_part_of_the_moe_hybrids_matters(arch, what):
    model = reflex_engine.load(paths(arch, "F32")[0], device="cpu")
    cfg = model.config
    assert cfg.n_expert == 4 and cfg.routing.n_used == 2 and cfg.n_ff_shexp == 48 and cfg.recurrent_layers == (0, 1)
    ids, expected = _golden(arch)
    assert np.abs(model.logits(ids) - expected).max() <= TOLERANCE["cpu"] * np.ptp(expected)
    for lw in model.weights.blk:
        if what == "shared expert":
            lw.ffn_down_shexp = np.zeros_like(lw.ffn_down_shexp)
        elif what == "shared expert gate":
            lw.ffn_gate_inp_shexp = np.zeros_like(lw.ffn_gate_inp_shexp)  # sigmoid(0): half, not the gate's
        elif what == "beta and alpha swapped" and lw.ssm_ba is not None:
            r = cfg.ssm_v_heads // cfg.ssm_k_heads
            lw.ssm_ba = lw.ssm_ba.reshape(cfg.ssm_k_heads, 2, r, -1)[:, ::-1].reshape(lw.ssm_ba.shape)
    if what == "renormalisation":
        model.file.config = cfg._replace(routing=cfg.routing._replace(norm=False))
    assert np.abs(model.logits(ids) - expected).max() > 1e-3


def test_the_layer_schedule_comes_from_the_metadata(tmp_path):
    cfg = reflex_engine.load(paths("qwen35", "F32")[0], device="cpu").config
    assert cfg.recurrent_layers == (0, 1, 2) and cfg.rope.n_rot == 8 and cfg.head_dim == 32
    assert (cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_k_dim, cfg.ssm_v_dim, cfg.ssm_conv_kernel) == (2, 4, 16, 16, 4)
    by_interval = rewrite(paths("qwen35", "F32")[0], str(tmp_path / "a.gguf"), drop_key="qwen35.attention.recurrent_layers")
    assert reflex_engine.load(by_interval, device="cpu").config.recurrent_layers == (0, 1, 2)
    every_2nd = rewrite(by_interval, str(tmp_path / "b.gguf"), values={"qwen35.full_attention_interval": 2})
    with pytest.raises(ReflexError, match=r"lacks tensor 'blk.1.attn_q.weight'"):
        reflex_engine.load(every_2nd, device="cpu")


@pytest.mark.parametrize("arch,change,message", [
    ("qwen35", dict(values={"qwen35.ssm.time_step_rank": 8, "qwen35.ssm.inner_size": 128}),
     "tensor 'blk.0.attn_qkv.weight' has shape [64, 128], qwen35 expects [64, 192]"),
    ("qwen35", dict(values={"qwen35.ssm.state_size": 8}), "tensor 'blk.0.attn_qkv.weight' has shape [64, 128], qwen35 expects [64, 96]"),
    ("qwen35", dict(values={"qwen35.ssm.conv_kernel": 3}), "tensor 'blk.0.ssm_conv1d.weight' has shape [4, 128], qwen35 expects [3, 128]"),
    ("qwen35", dict(values={"qwen35.ssm.time_step_rank": 3}), "do not describe Gated DeltaNet heads"),
    ("qwen35", dict(reshape="blk.2.ssm_a"), "tensor 'blk.2.ssm_a' has shape [2], qwen35 expects [4]"),
    ("qwen35", dict(drop="blk.1.ssm_dt.bias"), "lacks tensor 'blk.1.ssm_dt.bias'"),
    ("qwen35", dict(drop_key="qwen35.ssm.group_count"), "GGUF metadata key 'qwen35.ssm.group_count' is missing"),
    ("qwen35", dict(drop_key="qwen35.rope.dimension_sections"), "rope.dimension_sections' must be 4 section sizes"),
    ("qwen35moe", dict(values={"qwen35moe.expert_count": 8}),
     "tensor 'blk.0.ffn_gate_inp.weight' has shape [64, 4], qwen35moe expects [64, 8]"),
    ("qwen35moe", dict(values={"qwen35moe.expert_shared_feed_forward_length": 32}),
     "tensor 'blk.0.ffn_gate_shexp.weight' has shape [64, 48], qwen35moe expects [64, 32]"),
    ("qwen35moe", dict(reshape="blk.2.ffn_gate_inp_shexp.weight"), "tensor 'blk.2.ffn_gate_inp_shexp.weight' has shape"),
    ("qwen35moe", dict(reshape="blk.1.ffn_up_exps.weight"), "tensor 'blk.1.ffn_up_exps.weight' has shape"),
    ("qwen3next", dict(drop_key="qwen3next.expert_shared_feed_forward_length"),
     "GGUF metadata key 'qwen3next.expert_shared_feed_forward_length' is missing"),
    ("qwen3next", dict(values={"qwen3next.ssm.group_count": 4}),
     "tensor 'blk.0.attn_qkv.weight' has shape [64, 128], qwen3next expects [64, 192]"),
    ("qwen3next", dict(reshape="blk.0.ssm_ba.weight"), "tensor 'blk.0.ssm_ba.weight' has shape"),
])
def test_inconsistent_hybrid_files_are_refused_at_load(tmp_path, arch, change, message):
    bad = rewrite(paths(arch, "F32")[0], str(tmp_path / "bad.gguf"), **change)
    with pytest.raises(ReflexError) as info:
        reflex_engine.load(bad, device="cpu")
    assert message in str(info.value) and "\n" not in str(info.value)


# -- the recurrent state in the engine ----------------------------------------------------------

def _scores_one_by_one(model, prompt, candidates):
    """log P(candidate | prompt) from plain causal passes over prompt + candidate."""
    p = model.tokenize(prompt)
    scores = []
    for c in candidates:
        ids = model.tokenize(c, add_bos=False)
        logits = model.logits(p + ids).astype(np.float64)
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        scores.append(sum(logp[len(p) - 1 + j, t] for j, t in enumerate(ids)))
    return scores


def test_system1_scores_each_candidate_from_the_prompts_state(tmp_path):
    model = reflex_engine.load(paths("qwen35", "Q8_0")[0], device="cpu")
    prompt, candidates = "The engine reads the file", [" and then", " x", " it runs the forward pass"]
    result = model.system1(prompt, candidates, export_kv=str(tmp_path / "p.kv"))
    np.testing.assert_allclose([c.score for c in result.candidates], _scores_one_by_one(model, prompt, candidates),
                               rtol=1e-4, atol=1e-4)
    # the exported state is the prompt's, not the last candidate's
    more = model.generate(" and", max_tokens=5, sampling=GREEDY, ignore_eos=True, import_kv=str(tmp_path / "p.kv"))
    list(more)
    whole = model.generate(model.tokenize(prompt) + model.tokenize(" and", add_bos=False), max_tokens=5,
                           sampling=GREEDY, ignore_eos=True)
    list(whole)
    assert more.cached_tokens == len(model.tokenize(prompt)) and more.tokens == whole.tokens


def test_passes_of_a_few_tokens_continue_the_state():
    model = reflex_engine.load(paths("qwen35", "F32")[0], device="cpu")
    ids, _ = _golden("qwen35", 5)  # 100 tokens
    whole = model.logits(ids)
    s1_whole = model.system1(ids[:40], [" a b c d e f g", " hello there", " x"])
    gen_whole = model.generate(ids[:30], max_tokens=12, sampling=GREEDY, ignore_eos=True)
    list(gen_whole)
    model.ops.max_batch = 5
    assert np.abs(model.logits(ids) - whole).max() <= TOLERANCE["cpu"] * np.ptp(whole)
    s1_split = model.system1(ids[:40], [" a b c d e f g", " hello there", " x"])
    np.testing.assert_allclose([c.score for c in s1_split.candidates], [c.score for c in s1_whole.candidates], rtol=1e-4, atol=1e-4)
    gen_split = model.generate(ids[:30], max_tokens=12, sampling=GREEDY, ignore_eos=True)
    list(gen_split)
    assert gen_split.tokens == gen_whole.tokens


def test_kv_state_files_carry_the_recurrent_state(tmp_path):
    model = reflex_engine.load(paths("qwen35", "Q8_0")[0], device="cpu", n_ctx=64)
    cfg, path = model.config, str(tmp_path / "s.kv")
    whole = model.generate("Hello there", max_tokens=7, sampling=GREEDY, ignore_eos=True)
    list(whole)
    first = model.generate("Hello there", max_tokens=4, sampling=GREEDY, ignore_eos=True, export_kv=path)
    list(first)
    state = kvstate.read_header(path, fingerprint=model.state_fingerprint, architecture="qwen35", config=cfg)
    n = len(state.tokens)
    assert [(name, shape) for name, _, shape, _ in state.arrays] == \
        [(f"blk.{i}.{kind}", shape) for i in (0, 1, 2) for kind, shape in (("conv", (3, 128)), ("ssm", (4, 16, 16)))] \
        + [("blk.3.k", (n, 64)), ("blk.3.v", (n, 64))]
    rest = model.generate("", max_tokens=3, sampling=GREEDY, ignore_eos=True, import_kv=path)
    list(rest)
    assert rest.cached_tokens == n and first.tokens + rest.tokens == whole.tokens


def test_f16_keys_and_values_beside_f32_states_import_on_the_cpu(tmp_path):
    """As the CUDA backend writes a hybrid's state: its cache's f16 K and V, the states' f32."""
    model = reflex_engine.load(paths("qwen35", "Q8_0")[0], device="cpu", n_ctx=64)
    whole = model.generate("Hello there", max_tokens=7, sampling=GREEDY, ignore_eos=True)
    list(whole)
    first = model.generate("Hello there", max_tokens=4, sampling=GREEDY, ignore_eos=True, export_kv=str(tmp_path / "a.kv"))
    list(first)
    state = model._read_state(str(tmp_path / "a.kv"))
    with kvstate.mapped_arrays(state, len(state.tokens)) as arrays:
        mixed = [a._replace(dtype="f16", data=np.frombuffer(a.data, "<f4").astype("<f2")) if a.name.endswith((".k", ".v"))
                 else a for a in arrays.values()]
        kvstate.write_state(str(tmp_path / "b.kv"), fingerprint=model.state_fingerprint, architecture="qwen35",
                            tokens=state.tokens, pending=state.pending, sampler=None, arrays=mixed)
    assert {d for _, d, _, _ in model._read_state(str(tmp_path / "b.kv")).arrays} == {"f16", "f32"}
    rest = model.generate("", max_tokens=3, sampling=GREEDY, ignore_eos=True, import_kv=str(tmp_path / "b.kv"))
    list(rest)
    assert first.tokens + rest.tokens == whole.tokens


def test_a_baked_prompt_serves_only_prompts_that_continue_past_it(tmp_path):
    model = reflex_engine.load(paths("qwen35", "F32")[0], device="cpu")
    baked = model.bake_prompt("The engine reads the file", str(tmp_path / "b.kv"))
    state = model._read_state(str(tmp_path / "b.kv"))
    longer = baked + model.tokenize(" and then", add_bos=False)
    assert kvstate.prefix(state, longer, whole=True).cached == len(baked)
    assert kvstate.prefix(state, baked, whole=True).cached == 0  # nothing new: the last token cannot be taken back
    assert kvstate.prefix(state, baked[:-1] + [baked[-1] ^ 1] + longer[len(baked):], whole=True).cached == 0
    assert kvstate.prefix(state, baked, whole=False).cached == len(baked) - 1  # attention caches can


def test_the_recurrent_state_does_not_grow_with_the_context():
    small = reflex_engine.load(paths("qwen35", "Q4_0")[0], device="cpu", n_ctx=64).cache
    large = reflex_engine.load(paths("qwen35", "Q4_0")[0], device="cpu", n_ctx=4096).cache
    assert [a.shape for a in small.ssm.values()] == [a.shape for a in large.ssm.values()] == [(4, 16, 16)] * 3
    assert [a.shape for a in small.conv.values()] == [a.shape for a in large.conv.values()] == [(3, 128)] * 3
    assert [k is None for k in large.k] == [True, True, True, False] and large.k[3].shape == (4096, 64)


def test_the_cli_runs_generate_system1_and_check(tmp_path):
    model_path, golden_path = paths("qwen35", "Q4_0")
    gen = run_cli("generate", model_path, "Hello", "--chat", "--temp", "0", "-n", "5", "--export-kv", str(tmp_path / "a.kv"))
    assert gen.returncode == 0 and gen.stdout.rstrip().split("\n")[-1].startswith("REFLEX_GENERATE_OK "), gen.stderr
    more = run_cli("generate", model_path, "--import-kv", str(tmp_path / "a.kv"), "--temp", "0", "-n", "2")
    assert more.returncode == 0, more.stderr
    s1 = run_cli("system1", model_path, "Hello", "--candidate", "a", "--candidate", "bc")
    assert s1.returncode == 0 and s1.stdout.rstrip().split("\n")[-1].startswith("REFLEX_SYSTEM1_OK"), s1.stderr
    check = run_cli("check", model_path, "--reference", golden_path)
    assert check.returncode == 0 and check.stdout.rstrip().split("\n")[-1].startswith("REFLEX_CHECK_OK"), check.stdout


def test_the_hybrid_architecture_code_imports_no_numpy():
    import subprocess
    import sys

    modules = "reflex_engine.arch.qwen35, reflex_engine.arch.qwen35moe, reflex_engine.arch.qwen3next, reflex_engine.engine"
    code = f"import sys, {modules}; sys.exit('numpy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_bench_counts_kv_bytes_of_the_attention_layers_and_the_state_per_sequence():
    from reflex_engine.bench import format_report, kv_bytes_per_token, recurrent_state_bytes, run_bench

    model = reflex_engine.load(paths("qwen35", "Q4_0")[0], device="cpu", n_ctx=64)
    assert kv_bytes_per_token(model) == 2 * 64 * 4 == sum(a.nbytes for a in model.cache.k + model.cache.v if a is not None) // 64
    states = sum(a.nbytes for a in [*model.cache.conv.values(), *model.cache.ssm.values()])
    assert recurrent_state_bytes(model) == states == 3 * 4 * (3 * 128 + 4 * 16 * 16)
    longer = reflex_engine.load(paths("qwen35", "Q4_0")[0], device="cpu", n_ctx=4096)
    assert recurrent_state_bytes(longer) == states
    report = run_bench(model, runs=1, decode_tokens=2, prefill_tokens=(8,), contexts=(8,))
    assert report.state_bytes == states and f"| recurrent state per sequence (any context) | {states:,} bytes |" in \
        format_report(report, "qwen35")


def _legacy_qwen3next(src, dst):
    """The qwen3next file as older converters wrote it: per recurrent layer one ssm_in holding, for
    each key head, its q, k, v and z rows (llama.cpp's legacy path), instead of attn_qkv and attn_gate."""
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(src)
    writer = GGUFWriter(dst, "qwen3next")
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            if field.types[0] == 9:
                writer.add_array(key, field.contents())
            else:
                writer.add_key_value(key, field.contents(), field.types[0])
    tensors = {t.name: np.array(t.data) for t in reader.tensors}  # numpy (out, in)
    h_k, dk = 2, 16  # key heads and their width
    for name, data in tensors.items():
        if name.endswith("attn_gate.weight"):
            continue
        if name.endswith("attn_qkv.weight"):
            z = tensors[name.replace("attn_qkv", "attn_gate")]
            q, k, v = data[: h_k * dk], data[h_k * dk : 2 * h_k * dk], data[2 * h_k * dk :]
            parts = [x.reshape(h_k, -1, x.shape[1]) for x in (q, k, v, z)]
            name, data = name.replace("attn_qkv", "ssm_in"), np.concatenate(parts, axis=1).reshape(-1, data.shape[1])
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_a_legacy_qwen3next_file_with_a_fused_ssm_in_gives_the_same_logits(tmp_path):
    legacy = _legacy_qwen3next(paths("qwen3next", "F32")[0], str(tmp_path / "legacy.gguf"))
    model = reflex_engine.load(legacy, device="cpu")
    assert model.weights.blk[0].attn_qkv is None and model.weights.blk[0].ssm_in.shape == (192, 64)
    ids, expected = _golden("qwen3next")
    assert np.abs(model.logits(ids) - expected).max() <= TOLERANCE["cpu"] * np.ptp(expected)
    with pytest.raises(ReflexError, match="lacks tensor 'blk.0.attn_qkv.weight'"):
        reflex_engine.load(rewrite(legacy, str(tmp_path / "none.gguf"), drop="blk.0.ssm_in.weight"), device="cpu")
