"""Gated DeltaNet on CUDA (kernels/delta_net.cu) against the numpy backend: the gates, norms and conv,
the delta rule one token at a time and in chunks, across batches that continue the state, over
4,096 tokens against the recurrence; then the hybrids (test_hybrid.py checks them against
transformers on both backends): a 4,096-token prompt, decode replayed as a CUDA graph, system1's
checkpoint and KV state files between the backends."""
import functools

import numpy as np
import pytest

import reflex_engine
from reflex_engine import kvstate
from reflex_engine.backends.cpu import delta_rule
from reflex_engine.backends.cuda import CudaOps
from reflex_engine.check import TOLERANCE
from reflex_engine.gguf import GGMLType
from reflex_engine.ops import Batch, CacheShape, RecurrentShape
from reflex_engine.sampling import SamplingParams
from test_cuda_moe import decode_with_and_without_graphs
from test_cuda_ops import cpu, loaded, rel_err
from test_goldens import paths
from test_hybrid import GREEDY

pytestmark = pytest.mark.gpu

rng = np.random.default_rng()


@functools.cache
def backends(h_v: int, dk: int, dv: int, channels: int = 64, taps: int = 4):
    """A device backend and a cache whose layer 0 is recurrent with these widths, and the CPU's twin."""
    shape = CacheShape(2, 16, 8, 8, recurrent=RecurrentShape((0,), taps - 1, channels, h_v, dk, dv))
    gpu = CudaOps()
    gpu.reserve([(GGMLType.F32, (1 << 20,))], shape, activation_width=max(1 << 16, h_v * dv * 4))
    return gpu, gpu.new_kv_cache(shape), cpu.new_kv_cache(shape)


def up(gpu, x):
    return gpu.from_host(np.ascontiguousarray(x, np.float32))


def down(gpu, ptr, shape):
    out = np.empty(shape, np.float32)
    gpu.device.download(out.ctypes.data, ptr, out.nbytes)
    return out


def unit_rows(t, heads, d):
    x = rng.standard_normal((t, heads, d))
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).reshape(t, -1).astype(np.float32)


def test_gates_norms_and_sigmoid_gate_match_the_cpu():
    gpu, _, _ = backends(4, 16, 16)
    t, h = 37, 6
    alpha, beta = (rng.standard_normal((t, h)) * 8).astype(np.float32), (rng.standard_normal((t, h)) * 8).astype(np.float32)
    alpha[0, :3] = [1e4, -1e4, 0]  # softplus's far ends, and z = 0 once dt_bias is added (below)
    dt_bias, ssm_a = rng.standard_normal(h).astype(np.float32), -np.exp(rng.standard_normal(h)).astype(np.float32)
    dt_bias[2] = 0
    w_dt, w_a = loaded(gpu, "dt", GGMLType.F32, (h,), dt_bias.tobytes()), loaded(gpu, "a", GGMLType.F32, (h,), ssm_a.tobytes())
    gpu.poison()
    got = gpu.gdn_gates(up(gpu, alpha), up(gpu, beta), dt_bias=w_dt, ssm_a=w_a)
    for g, want in zip(got, cpu.gdn_gates(alpha, beta, dt_bias=dt_bias, ssm_a=ssm_a)):
        np.testing.assert_allclose(gpu.to_host(g), want, rtol=2e-6, atol=1e-30)
    for head_dim, width in ((16, 64), (128, 2048), (7, 21)):
        x = rng.standard_normal((t, width)).astype(np.float32)
        gpu.poison()
        np.testing.assert_allclose(gpu.to_host(gpu.l2_norm(up(gpu, x), head_dim, 1e-6)), cpu.l2_norm(x, head_dim, 1e-6),
                                   rtol=2e-6, atol=1e-7)
    x = rng.standard_normal((t, 48)).astype(np.float32)
    for gate in (rng.standard_normal((t, 48)) * 6, rng.standard_normal((t, 1)) * 6):
        gate = gate.astype(np.float32)
        gpu.poison()
        np.testing.assert_allclose(gpu.to_host(gpu.sigmoid_gate(up(gpu, x), up(gpu, gate))), cpu.sigmoid_gate(x, gate),
                                   rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("taps", [4, 2, 8])
@pytest.mark.parametrize("weight_type", ["F32", "F16"])
def test_the_causal_conv_matches_the_cpu_across_batches(taps, weight_type):
    channels = 300
    gpu, g_cache, c_cache = backends(4, 16, 16, channels, taps)
    w = rng.standard_normal((channels, taps)).astype(np.float32)
    dtype = "<f4" if weight_type == "F32" else "<f2"
    w_gpu = loaded(gpu, "conv", GGMLType[weight_type], (taps, channels), w.astype(dtype).tobytes())
    w = w.astype(dtype).astype(np.float32)
    x = rng.standard_normal((60, channels)).astype(np.float32)
    for a, b in ((0, 5), (5, 6), (6, 7), (7, 60), (0, 2)):  # a prompt, decode steps, a long batch, a fresh start
        batch = Batch.causal([0] * (b - a), a)
        gpu.poison()
        got = gpu.to_host(gpu.causal_conv1d(up(gpu, x[a:b]), w_gpu, cache=g_cache, layer=0, batch=batch))
        want = cpu.causal_conv1d(x[a:b], w, cache=c_cache, layer=0, batch=batch)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(down(gpu, g_cache.recurrent.conv[0], (taps - 1, channels)), c_cache.conv[0])


def delta_inputs(t, h_k, h_v, dk, dv):
    q, k = rng.standard_normal((t, h_k * dk)).astype(np.float32), unit_rows(t, h_k, dk)
    v = rng.standard_normal((t, h_v * dv)).astype(np.float32)
    g = -rng.uniform(0, 0.4, (t, h_v)).astype(np.float32)
    g[:, 0] *= 40  # a head whose state all but vanishes within a chunk
    beta = rng.uniform(0, 1, (t, h_v)).astype(np.float32)
    return q, k, v, g, beta


@pytest.mark.parametrize("h_k,h_v,dk,dv", [(2, 4, 16, 16), (1, 3, 128, 128), (2, 6, 128, 40), (4, 4, 64, 128)])
@pytest.mark.parametrize("tiled", [True, False])
def test_the_delta_rule_matches_the_cpu_as_batches_continue_the_state(h_k, h_v, dk, dv, tiled):
    gpu, g_cache, c_cache = backends(h_v, dk, dv)
    inputs = delta_inputs(700, h_k, h_v, dk, dv)
    scale = dk**-0.5
    # one token (the recurrence), short and ragged batches, more than a chunk, a whole pass; then anew
    for a, b in ((0, 1), (1, 6), (6, 7), (7, 71), (71, 200), (200, 700), (0, 130)):
        batch = Batch.causal([0] * (b - a), a)
        part = [x[a:b] for x in inputs]
        gpu.poison()
        got = gpu.to_host(gpu.delta_rule(*[up(gpu, x) for x in part], cache=g_cache, layer=0, batch=batch, tiled=tiled,
                                         scale=scale))
        want = cpu.delta_rule(*part, cache=c_cache, layer=0, batch=batch, tiled=tiled, scale=scale)
        assert rel_err(got, want) < 1e-4, (a, b)
        state = down(gpu, g_cache.recurrent.ssm[0], (h_v, dk, dv))
        assert rel_err(state, c_cache.ssm[0]) < 1e-4, (a, b)


def test_the_chunked_kernels_follow_the_recurrence_over_4096_tokens():
    h, dk, dv = 2, 128, 128
    gpu, g_cache, _ = backends(h, dk, dv)
    q, k, v, g, beta = delta_inputs(4096, h, h, dk, dv)
    g[:, 0] /= 40  # both heads carry the state far
    outs = []
    for a in range(0, 4096, 512):  # the engine's passes of a 4,096-token prompt
        part = [up(gpu, x[a : a + 512]) for x in (q, k, v, g, beta)]
        outs.append(gpu.to_host(gpu.delta_rule(*part, cache=g_cache, layer=0, batch=Batch.causal([0] * 512, a), tiled=True,
                                               scale=dk**-0.5)))
    heads = [np.ascontiguousarray(x.reshape(4096, h, -1).transpose(1, 0, 2)) for x in (q * np.float32(dk**-0.5), k, v)]
    o_steps, s_steps = delta_rule.recurrent(*heads, np.ascontiguousarray(g.T), np.ascontiguousarray(beta.T),
                                            np.zeros((h, dk, dv), np.float32))
    want = o_steps.transpose(1, 0, 2).reshape(4096, h * dv)
    assert np.abs(want[-512:]).max() > 0.1  # signal reaches the end
    np.testing.assert_allclose(np.concatenate(outs), want, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(down(gpu, g_cache.recurrent.ssm[0], (h, dk, dv)), s_steps, rtol=1e-3, atol=1e-4)


def test_checkpoint_and_rewind_restore_every_recurrent_state():
    gpu, g_cache, _ = backends(4, 16, 16)
    r = g_cache.recurrent
    before = down(gpu, r.base, (r.nbytes // 4,))
    gpu.checkpoint_state(g_cache)
    gpu.device.drv.cuMemsetD32Async(r.base, 0x3F800000, r.nbytes // 4, gpu.device.stream)
    gpu.rewind_state(g_cache)
    np.testing.assert_array_equal(down(gpu, r.base, (r.nbytes // 4,)), before)


# -- the models ------------------------------------------------------------------------------------


def test_a_4096_token_prompt_through_the_chunked_kernels_matches_the_recurrence():
    path = paths("qwen35", "F32")[0]
    model = reflex_engine.load(path, device="cuda", n_ctx=4096)
    ids = rng.integers(0, model.tokenizer.n_vocab, 4096).tolist()
    chunked = model.logits(ids)  # passes of 512 tokens: the chunked kernels
    model.ops.max_batch = 1  # a pass a token: the recurrence
    steps = model.logits(ids)
    reference = reflex_engine.load(path, device="cpu", n_ctx=4096).logits(ids)
    for got in (chunked, steps):
        assert np.abs(got - reference).max() <= TOLERANCE["cuda"] * np.ptp(reference)
    assert np.abs(chunked - steps).max() <= TOLERANCE["cuda"] * np.ptp(reference)


@pytest.mark.parametrize("arch", ["qwen35", "qwen3next", "qwen35moe"])
def test_hybrid_decode_replayed_as_a_cuda_graph_equals_eager_decode(monkeypatch, arch):
    graphed, eager = decode_with_and_without_graphs(monkeypatch, paths(arch, "Q8_0")[0])
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(graphed, eager):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-6)


def test_system1_on_cuda_scores_as_the_cpu_does():
    candidates = [" a b c d e f g", " hello there", " x", " hello"]
    scores = []
    for device in ("cpu", "cuda"):
        model = reflex_engine.load(paths("qwen35", "Q8_0")[0], device=device)
        scores.append([c.score for c in model.system1("The answer is", candidates).candidates])
    np.testing.assert_allclose(scores[1], scores[0], rtol=0, atol=0.05)
    assert len(set(np.round(scores[0], 3))) == len(candidates)  # distinct scores: the order is tested


@pytest.mark.parametrize("first,second", [("cuda", "cpu"), ("cpu", "cuda"), ("cuda", "cuda")])
def test_kv_state_files_carry_the_recurrent_state_between_backends(tmp_path, first, second):
    path, prompt = str(tmp_path / "s.kv"), "Hello there, general"
    whole = reflex_engine.load(paths("qwen35", "Q8_0")[0], device=second, n_ctx=64)
    ref = whole.generate(prompt, max_tokens=8, sampling=GREEDY, ignore_eos=True)
    list(ref)
    writer = reflex_engine.load(paths("qwen35", "Q8_0")[0], device=first, n_ctx=64)
    head = writer.generate(prompt, max_tokens=3, sampling=GREEDY, ignore_eos=True, export_kv=path)
    list(head)
    state = kvstate.read_header(path, fingerprint=writer.state_fingerprint, architecture="qwen35", config=writer.config)
    dtypes = {name.rsplit(".", 1)[1]: dtype for name, dtype, _, _ in state.arrays}
    assert dtypes == ({"conv": "f32", "ssm": "f32", "k": "f16", "v": "f16"} if first == "cuda" else
                      {"conv": "f32", "ssm": "f32", "k": "f32", "v": "f32"})
    rest = whole.generate("", max_tokens=5, sampling=SamplingParams(temperature=0), ignore_eos=True, import_kv=path)
    list(rest)
    assert head.tokens + rest.tokens == ref.tokens
