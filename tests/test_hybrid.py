"""The hybrid architectures (qwen35, qwen35moe, qwen3next): the Gated DeltaNet ops on the numpy
backend against formulations written out here (the delta rule token by token in float64, the
chunked form against it up to 4,096 tokens), the models against transformers (tests/goldens,
made by tools/make_goldens.py from tiny random checkpoints converted by llama.cpp), and the
engine's recurrent state: generate, system1, KV state files."""
import numpy as np
import pytest

from reflex_engine.backends.cpu import CpuOps
from reflex_engine.backends.cpu import delta_rule
from reflex_engine.ops import Batch, CacheShape, RecurrentShape

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
