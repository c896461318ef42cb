"""The numpy Ops, each against an independent formulation of the same maths."""
import numpy as np
import pytest

from reflex_engine.backends.cpu import CpuOps
from reflex_engine.ops import Batch, CacheShape, Rope, RopeMode

ops = CpuOps()
rng = np.random.default_rng(7)


def test_rms_norm_whole_row_and_per_head():
    x = rng.standard_normal((3, 12), dtype=np.float32)
    w = rng.standard_normal(12, dtype=np.float32)
    expected = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(ops.rms_norm(x, w, 1e-6), expected, rtol=1e-5)
    wh = rng.standard_normal(4, dtype=np.float32)
    per_head = np.concatenate([ops.rms_norm(x[:, h * 4 : (h + 1) * 4], wh, 1e-6) for h in range(3)], axis=1)
    np.testing.assert_allclose(ops.rms_norm(x, wh, 1e-6), per_head, rtol=1e-6)


def _rope_reference(x, positions, head_dim, n_rot, base, neox, factors=None):
    """Rotation written as complex multiplication, one head and pair at a time."""
    out = x.astype(np.float64).copy()
    for t, pos in enumerate(positions):
        for h in range(x.shape[1] // head_dim):
            for i in range(n_rot // 2):
                theta = pos * base ** (-2 * i / n_rot) / (1 if factors is None else factors[i])
                a, b = (h * head_dim + i, h * head_dim + i + n_rot // 2) if neox else (h * head_dim + 2 * i, h * head_dim + 2 * i + 1)
                z = complex(x[t, a], x[t, b]) * complex(np.cos(theta), np.sin(theta))
                out[t, a], out[t, b] = z.real, z.imag
    return out


@pytest.mark.parametrize("mode", [RopeMode.NORM, RopeMode.NEOX])
@pytest.mark.parametrize("n_rot", [8, 4])
def test_rope_matches_complex_rotation(mode, n_rot):
    x = rng.standard_normal((5, 16), dtype=np.float32)  # 2 heads of 8
    positions = [0, 1, 7, 100, 3]
    got = ops.rope(x, positions, 8, Rope(mode, n_rot, 10000.0))
    np.testing.assert_allclose(got, _rope_reference(x, positions, 8, n_rot, 10000.0, mode is RopeMode.NEOX), atol=2e-6)
    if n_rot < 8:  # dims past n_rot pass through
        np.testing.assert_array_equal(got.reshape(5, 2, 8)[..., n_rot:], x.reshape(5, 2, 8)[..., n_rot:])


def test_rope_frequency_factors_divide_each_pairs_angle():
    x = rng.standard_normal((4, 16), dtype=np.float32)
    positions = [0, 5, 300, 4000]
    factors = np.array([1.0, 1.5, 4.0, 8.0], np.float32)
    got = ops.rope(x, positions, 8, Rope(RopeMode.NORM, 8, 500000.0), freq_factors=factors)
    np.testing.assert_allclose(got, _rope_reference(x, positions, 8, 8, 500000.0, False, factors), atol=2e-5)
    assert not np.allclose(got, ops.rope(x, positions, 8, Rope(RopeMode.NORM, 8, 500000.0)), atol=1e-3)


def _attention_reference(q, k, v, segments, n_heads, n_kv):
    """One query at a time, one head at a time, visibility spelled out."""
    t, dk = q.shape[0], q.shape[1] // n_heads
    dv = v.shape[1] // n_kv
    out = np.zeros((t, n_heads * dv))
    for i in range(t):
        seen = [j for j in range(i + 1) if segments[j] == 0 or segments[j] == segments[i]]
        for h in range(n_heads):
            kv = h // (n_heads // n_kv)
            qh = q[i, h * dk : (h + 1) * dk].astype(np.float64)
            s = np.array([qh @ k[j, kv * dk : (kv + 1) * dk] for j in seen]) / np.sqrt(dk)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, h * dv : (h + 1) * dv] = sum(pj * v[j, kv * dv : (kv + 1) * dv] for pj, j in zip(p, seen))
    return out


@pytest.mark.parametrize("segments", [[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 2, 2], [0, 1, 2, 2, 1, 3]])
def test_attention_with_gqa_and_segments(segments):
    n_heads, n_kv, d = 4, 2, 8
    q = rng.standard_normal((6, n_heads * d), dtype=np.float32)
    k = rng.standard_normal((6, n_kv * d), dtype=np.float32)
    v = rng.standard_normal((6, n_kv * d), dtype=np.float32)
    cache = ops.new_kv_cache(CacheShape(1, 8, n_kv * d, n_kv * d))
    got = ops.attention(q, k, v, cache=cache, layer=0, batch=Batch([0] * 6, range(6), segments, 0),
                        n_heads=n_heads, n_kv_heads=n_kv, scale=d**-0.5)
    np.testing.assert_allclose(got, _attention_reference(q, k, v, segments, n_heads, n_kv), rtol=1e-5, atol=1e-6)


def test_attention_in_steps_equals_attention_at_once():
    n_heads, n_kv, d = 2, 1, 8
    q, k, v = (rng.standard_normal((5, w), dtype=np.float32) for w in (n_heads * d, n_kv * d, n_kv * d))
    kwargs = dict(layer=0, n_heads=n_heads, n_kv_heads=n_kv, scale=0.3)
    whole = ops.attention(q, k, v, cache=ops.new_kv_cache(CacheShape(1, 5, d, d)), batch=Batch.causal([0] * 5, 0), **kwargs)
    cache = ops.new_kv_cache(CacheShape(1, 5, d, d))
    steps = [ops.attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], cache=cache, batch=Batch.causal([0], i), **kwargs) for i in range(5)]
    np.testing.assert_allclose(np.concatenate(steps), whole, rtol=1e-5, atol=1e-6)


def test_swiglu_and_silu_saturation():
    g = np.array([[-1000.0, -1.0, 0.0, 2.0, 1000.0]], np.float32)
    u = np.full_like(g, 3.0)
    expected = g * (0.5 + 0.5 * np.tanh(g.astype(np.float64) / 2)) * 3.0  # silu via tanh: no overflow
    np.testing.assert_allclose(ops.swiglu(g, u), expected, rtol=1e-6)
