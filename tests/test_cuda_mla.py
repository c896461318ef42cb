"""Multi-head latent attention on CUDA (kernels/mla.cu, the per-head matrices of kernels/moe.cu)
against the numpy backend: split, concat, head_matmul, YaRN RoPE, the latent cache and attention
over it, its KV state arrays; then deepseek2 (V2-Lite-style, YaRN) and deepseek3 (V3-style) decode
replayed as a CUDA graph against eager launches (test_mla.py checks both against transformers on
both backends)."""
import numpy as np
import pytest

from reflex_engine.backends.cuda.experts import GROUPED_MIN_TOKENS
from reflex_engine.backends.cuda.ops import GEMM_TILE_TYPES, kernel_suffix
from reflex_engine.gguf import GGML_BLOCK, GGMLType
from reflex_engine.ops import Batch, CacheShape, Rope, RopeMode, StateArray
from test_cuda_moe import decode_with_and_without_graphs
from test_cuda_ops import (KERNEL_TYPES, cpu, f16_rounded, gpu, host, loaded, random_weight, recorded_launches,  # noqa: F401 (gpu: a fixture)
                           rel_err)
from test_goldens import paths

pytestmark = pytest.mark.gpu

rng = np.random.default_rng()


@pytest.mark.parametrize("n_heads,widths", [(1, (32, 16)), (2, (5, 2)), (16, (128, 64)), (128, (512, 64)), (4, (8, 3, 5)),
                                            (1, (512, 64)), (1, (64, 32, 96))])
@pytest.mark.parametrize("n_tok", [1, 9, 77])
def test_split_and_concat_match_the_cpu(gpu, n_heads, widths, n_tok):
    """Two parts a launch (kernels/mla.cu copy_heads_f32): MLA's two, and three (a launch with one copy); one token's
    one head cut at multiples of 32 features (MLA's latent and rope parts): runs of its row, no copy."""
    x = rng.standard_normal((n_tok, n_heads * sum(widths))).astype(np.float32)
    parts = gpu.split(host(gpu, x), n_heads, widths)
    for got, want in zip(parts, cpu.split(x, n_heads, widths)):
        np.testing.assert_array_equal(gpu.to_host(got), want)
    np.testing.assert_array_equal(gpu.to_host(gpu.concat(parts, n_heads)), x)


@pytest.mark.parametrize("n_tok", [1, 5])
def test_a_splits_parts_are_read_where_they_lie(gpu, n_tok):
    """The ropes (rope_f32 with its heads' norms, and rope_yarn_f32), head_matmul's matvec and sigmoid_gate read a
    split's parts in the tensor cut (memory.head_runs: DeepSeek's q, Qwen3.5's gated query): the same bits as from
    the parts copied, no copy launched; asked for its address, a part is made (copy_heads_f32)."""
    n_heads, widths = 4, (64, 32)
    norm = loaded(gpu, "norm", GGMLType.F32, (64,), rng.standard_normal(64).astype("<f4").tobytes())
    w = loaded(gpu, "w", GGMLType.F32, (64, 16, n_heads), random_weight("F32", n_heads * 16, 64))
    x = rng.standard_normal((n_tok, n_heads * sum(widths))).astype(np.float32)
    y, k = (rng.standard_normal((n_tok, n_heads * n)).astype(np.float32) for n in (32, 64))
    gpu.poison()
    dy, dk = gpu.from_host(y), gpu.from_host(k)
    copied = [gpu.from_host(np.ascontiguousarray(p)) for p in cpu.split(x, n_heads, widths)]
    parts = gpu.split(gpu.from_host(x), n_heads, widths)
    positions = list(range(7, 7 + n_tok))
    neox, yarn = Rope(RopeMode.NEOX, 64, 10000.0), Rope(RopeMode.NORM, 32, 10000.0, 0.125, ext_factor=1.0, n_ctx_orig=64)

    def products(a, b):
        q, _ = gpu.ropes((a, dk), positions, 64, neox, norms=((norm, 1e-6), (norm, 1e-6)))
        return [gpu.to_host(t) for t in (q, gpu.rope(b, positions, 32, yarn), gpu.head_matmul(a, w), gpu.sigmoid_gate(dy, b))]

    want = products(*copied)
    with recorded_launches(gpu) as launched:
        got = products(*parts)
    assert "copy_heads_f32" not in launched
    for g, e in zip(got, want):
        np.testing.assert_array_equal(g, e)
    for part, expected in zip(parts, cpu.split(x, n_heads, widths)):
        np.testing.assert_array_equal(gpu.to_host(part), expected)


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
@pytest.mark.parametrize("n_tok", [1, 8, 9, 77])
def test_head_matmul_matches_the_cpu(gpu, qtype, n_tok):
    """A decode pass's heads by the stacked matvec, to float32 rounding. Past 8 tokens the types of kernels/gemm_tile.cu
    take its tiles of 64 tokens, a head a block's z: x and the weights rounded to f16 (the reference on x rounded
    so; the weights' rounding left, as test_cuda_ops allows the dense tiles), each head's slice of x and of the
    product in its place, no other kernel launched."""
    n_heads, t = 3, GGMLType[qtype]
    # (out, in) per head: MLA's attn_k_b (kv_lora, nope) and attn_v_b (v_head, kv_lora) shapes, ragged for floats;
    # 32-element blocks: DeepSeek-V2-Lite's attn_k_b too, 512 rows of 128 columns (half a superblock)
    block = GGML_BLOCK[t][0]
    shapes = [(72, 40), (40, 200)] if block == 1 else [(64, 256), (256, 512)] + [(512, 128)] * (block == 32)
    tiled = n_tok > GROUPED_MIN_TOKENS and t in GEMM_TILE_TYPES
    for n_out, n_in in shapes:
        data, shape = random_weight(qtype, n_heads * n_out, n_in), (n_in, n_out, n_heads)
        w_cpu, w_gpu = cpu.load_weight("w", t, shape, data), loaded(gpu, "w", t, shape, data)
        x = rng.standard_normal((n_tok, n_heads * n_in)).astype(np.float32)
        gpu.poison()
        with recorded_launches(gpu) as launched:
            got = gpu.to_host(gpu.head_matmul(host(gpu, x), w_gpu))
        want = cpu.head_matmul(f16_rounded(x) if tiled else x, w_cpu)
        assert [n for n in launched if "matvec" in n or "gemm" in n] == [f"{'gemm_tile_heads' if tiled else 'stacked_matvec'}_{kernel_suffix(t)}"]
        assert rel_err(got, want) < (1e-3 if tiled else 1e-5), (n_out, n_in)


@pytest.mark.parametrize("rope", [
    Rope(RopeMode.NORM, 16, 10000.0, 0.125, ext_factor=1.0, n_ctx_orig=64),  # the deepseek2 fixture's
    Rope(RopeMode.NORM, 64, 10000.0, 1 / 40, ext_factor=1.0, n_ctx_orig=4096, magnitude=1.37),  # DeepSeek-V3's
    Rope(RopeMode.NEOX, 32, 500000.0, 1.0, magnitude=1.2),  # a magnitude alone
])
def test_yarn_rope_matches_the_cpu(gpu, rope):
    """One tensor, and two of the same tokens in one launch (MLA's q of 3 heads and k of 1)."""
    head_dim = rope.n_rot + 16  # the dims past n_rot pass through
    x, x1 = (rng.standard_normal((6, n * head_dim)).astype(np.float32) for n in (3, 1))
    positions = [0, 1, 2, 37, 300, 4095]
    got = gpu.to_host(gpu.rope(host(gpu, x), positions, head_dim, rope))
    np.testing.assert_allclose(got, cpu.rope(x, positions, head_dim, rope), rtol=1e-6, atol=1e-6)
    gpu.poison()  # once: host() poisons, which would wipe the first tensor's upload
    inputs = (gpu.from_host(x), gpu.from_host(x1))
    with recorded_launches(gpu) as launched:
        both = [gpu.to_host(y) for y in gpu.ropes(inputs, positions, head_dim, rope)]
    assert launched.count("rope_yarn_f32" if rope.ext_factor or rope.magnitude != 1.0 else "rope_f32") == 1
    for got, want in zip(both, cpu.ropes((x, x1), positions, head_dim, rope)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def latent_parts(q, kv, n_heads, v_width):
    """The query's and the latent row's (latent, rope) parts, as deepseek2.py passes them."""
    return cpu.split(q, n_heads, (v_width, kv.shape[1] - v_width)), (kv[:, :v_width], kv[:, v_width:])


@pytest.mark.parametrize("n_heads,width,v_width", [(2, 48, 32), (16, 576, 512), (3, 100, 60)])
@pytest.mark.parametrize("segments", ["causal", "system1"])
@pytest.mark.parametrize("t", [1, 5, 70])
def test_latent_attention_prefill_then_decode(gpu, n_heads, width, v_width, segments, t):
    """A prompt, then decode steps into the same latent cache. Its rows are f16 on the device, so the
    reference gets the same rounded values; what remains is float32 summation order, but for a prompt the
    tensor-core kernel takes (test_latent_attention_of_long_prompts_on_tensor_cores), which rounds q and the
    probabilities to f16. On sm_90 DeepSeek's widths decode on tensor cores, split as the 160-slot cache allows:
    the splits past a short context's slots see none, and the merge must leave them out."""
    n_prompt = 2 * t // 3
    seg = [0] * t if segments == "causal" else [0] * n_prompt + [1 + (i // 7) for i in range(t - n_prompt)]
    shape = CacheShape(1, 160, width, v_width, latent=True)
    c_cpu, c_gpu = cpu.new_kv_cache(shape), gpu.new_kv_cache(shape)
    q = rng.standard_normal((t + 3, n_heads * width)).astype(np.float32)
    kv = f16_rounded(rng.standard_normal((t + 3, width)).astype(np.float32))
    kw = dict(layer=0, n_heads=n_heads, scale=width**-0.5)
    steps = [(0, t, Batch(range(t), range(t), seg, 0))] + [(i, i + 1, Batch.causal([0], i)) for i in range(t, t + 3)]
    for a, b, batch in steps:
        q_parts, kv_parts = latent_parts(q[a:b], kv[a:b], n_heads, v_width)
        ref = cpu.latent_attention(q_parts, kv_parts, cache=c_cpu, batch=batch, **kw)
        gpu.poison()
        dq, dkv = ([gpu.from_host(np.ascontiguousarray(p)) for p in parts] for parts in (q_parts, kv_parts))
        with recorded_launches(gpu) as launched:
            got = gpu.to_host(gpu.latent_attention(dq, dkv, cache=c_gpu, batch=batch, **kw))
        f16_products = bool({"latent_attention_prefill", "latent_attention_decode"} & set(launched))
        np.testing.assert_allclose(got, ref, rtol=2e-3 if f16_products else 1e-4, atol=2e-3 if f16_products else 2e-5)


@pytest.mark.parametrize("n_heads,width,v_width", [(16, 576, 512), (3, 288, 256)])
def test_latent_attention_of_long_prompts_on_tensor_cores(gpu, n_heads, width, v_width):
    """On sm_90+, kernels/mla.cu's latent attention on tensor cores: from MLA_PREFILL_MIN_TOKENS tokens on
    latent_attention_prefill (128 rows a block), 100 tokens, then 77 after them (rows of 16 or 3 heads: partial
    blocks), the second chunk's last 40 in system1's segments; then two decode steps and a 9-token batch by
    latent_attention_decode (16 rows a block, its slots split, the splits merged by latent_attention_combine: at
    16 heads its rows are one token's). Q and the probabilities are rounded to f16 on the tensor cores, as
    attention_prefill.cu rounds them (test_cuda_ops attention_tolerance)."""
    if not gpu._sm90:
        pytest.skip("the prompt kernel's shared memory needs sm_90 or later")
    shape = CacheShape(1, 192, width, v_width, latent=True)
    c_cpu, c_gpu = cpu.new_kv_cache(shape), gpu.new_kv_cache(shape)
    q = rng.standard_normal((188, n_heads * width)).astype(np.float32)
    kv = f16_rounded(rng.standard_normal((188, width)).astype(np.float32))
    kw = dict(layer=0, n_heads=n_heads, scale=width**-0.5)
    second = [0] * 37 + [1 + i // 9 for i in range(40)]
    steps = [(0, 100, Batch(range(100), range(100), [0] * 100, 0), "latent_attention_prefill", 2e-3),
             (100, 177, Batch(range(77), range(100, 177), second, 100), "latent_attention_prefill", 2e-3),
             (177, 178, Batch.causal([0], 177), "latent_attention_decode", 2e-3),
             (178, 179, Batch.causal([0], 178), "latent_attention_decode", 2e-3),
             (179, 188, Batch(range(9), range(179, 188), [0] * 4 + [1] * 5, 179), "latent_attention_decode", 2e-3)]
    for a, b, batch, kernel, tolerance in steps:
        q_parts, kv_parts = latent_parts(q[a:b], kv[a:b], n_heads, v_width)
        ref = cpu.latent_attention(q_parts, kv_parts, cache=c_cpu, batch=batch, **kw)
        gpu.poison()
        dq, dkv = ([gpu.from_host(np.ascontiguousarray(p)) for p in parts] for parts in (q_parts, kv_parts))
        with recorded_launches(gpu) as launched:
            got = gpu.to_host(gpu.latent_attention(dq, dkv, cache=c_gpu, batch=batch, **kw))
        assert [n for n in launched if n.startswith("latent_attention")][0] == kernel, launched
        np.testing.assert_allclose(got, ref, rtol=tolerance, atol=tolerance)


def test_latent_cache_state_arrays_round_trip(gpu):
    """One `blk.{i}.kv` array a layer, nothing for values: imported from the CPU's f32 (rounded to
    f16 as a pass stores it) or from f16, exported as f16."""
    n, width = 37, 48
    shape = CacheShape(2, 64, width, 32, latent=True)
    rows = [rng.standard_normal((n, width)).astype(np.float32) for _ in range(2)]
    for dtype in ("f32", "f16"):
        cache = gpu.new_kv_cache(shape)
        arrays = {f"blk.{i}.kv": StateArray(f"blk.{i}.kv", dtype, (n, width), r.astype("<f4" if dtype == "f32" else "<f2"))
                  for i, r in enumerate(rows)}
        gpu.import_cache(cache, arrays, n)
        out = list(gpu.export_cache(cache, n))
        assert [(a.name, a.dtype, a.shape) for a in out] == [("blk.0.kv", "f16", (n, width)), ("blk.1.kv", "f16", (n, width))]
        for a, r in zip(out, rows):
            np.testing.assert_array_equal(np.frombuffer(bytes(a.data), "<f2").reshape(n, width), r.astype("<f2"))


@pytest.mark.parametrize("variant", ["deepseek2", "deepseek3"])
def test_deepseek_decode_replayed_as_a_cuda_graph_equals_eager_decode(monkeypatch, variant):
    graphed, eager = decode_with_and_without_graphs(monkeypatch, paths(variant, "Q8_0")[0])
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(graphed, eager):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-6)
