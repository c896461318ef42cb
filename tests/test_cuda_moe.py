"""Mixture of experts on CUDA against the numpy backend: the router (kernels/moe.cu: ties, groups, the selection
bias, scaling) and the experts on each of their paths (a decode pass's on int16 x, kernels/matvec_x16.cu; a
prompt's in tiles on tensor cores, kernels/gemm_tile.cu; the float kernels of moe.cu for the other types), every
weight type, tokens sharing experts, experts nobody picks, with and without the residual stream; then qwen3moe's
decode replayed as a CUDA graph against eager launches (test_moe.py checks it against transformers on both
backends)."""
from functools import cache

import numpy as np
import pytest

import reflex_engine
from reflex_engine.backends.cuda.experts import GROUPED_MIN_TOKENS
from reflex_engine.backends.cuda.ops import GEMM_TILE_TYPES, X16_MATVEC_TYPES
from reflex_engine.gguf import GGML_BLOCK, GGMLType
from reflex_engine.ops import Gating, Routes, Routing
from reflex_engine.sampling import SamplingParams
from test_cuda_ops import KERNEL_TYPES, cpu, gpu, host, loaded, random_weight, recorded_launches, rel_err, x16_rounded  # noqa: F401 (gpu: a fixture)
from test_goldens import paths

pytestmark = pytest.mark.gpu

rng = np.random.default_rng()
ROUTINGS = {
    "softmax-norm": Routing(8, norm=True),  # qwen3moe
    "softmax-scaled": Routing(6, scale=2.0),  # DeepSeek-V2
    "sigmoid-groups": Routing(8, Gating.SIGMOID, norm=True, scale=2.5, n_groups=8, n_groups_used=4),  # DeepSeek-V3
    "sigmoid-2-of-8-groups": Routing(2, Gating.SIGMOID, n_groups=8, n_groups_used=2),  # of one expert each at 8
}


def gpu_routes(gpu, logits, routing, bias=None):
    """The device's Routes, as host arrays: ids (int32 bits in their buffer) and weights."""
    bias_gpu = None if bias is None else loaded(gpu, "b", GGMLType.F32, (len(bias),), bias.tobytes())
    routes = gpu.route(host(gpu, logits), routing, bias_gpu)
    return gpu.to_host(routes.experts).view(np.int32), gpu.to_host(routes.weights)


def check_route(gpu, logits, routing, bias=None):
    experts, weights = gpu_routes(gpu, logits, routing, bias)
    want = cpu.route(logits, routing, bias)
    np.testing.assert_array_equal(experts, want.experts)
    np.testing.assert_allclose(weights, want.weights, rtol=1e-5, atol=1e-7)
    return experts


@pytest.mark.parametrize("name", ROUTINGS)
@pytest.mark.parametrize("n_expert", [8, 64, 256, 1024])
@pytest.mark.parametrize("n_tok", [1, 5, 77])
def test_route_matches_the_cpu(gpu, name, n_expert, n_tok):
    routing = ROUTINGS[name]
    if routing.n_used > n_expert // routing.n_groups * routing.n_groups_used:
        pytest.skip("more experts used than the kept groups hold")
    logits = rng.standard_normal((n_tok, n_expert)).astype(np.float32) * 3
    bias = rng.standard_normal(n_expert).astype(np.float32) * 0.1 if routing.gating is Gating.SIGMOID else None
    check_route(gpu, logits, routing, bias)


@pytest.mark.parametrize("name", ROUTINGS)
def test_ties_in_router_scores_pick_the_lower_expert_id_as_the_cpu_does(gpu, name):
    routing = ROUTINGS[name]
    n_expert = 64
    equal = np.zeros((3, n_expert), np.float32)  # every expert ties: the first n_used
    assert (check_route(gpu, equal, routing) == np.arange(routing.n_used)).all()
    few_values = rng.integers(0, 3, (40, n_expert)).astype(np.float32)  # many ties at every rank
    check_route(gpu, few_values, routing)
    if routing.gating is Gating.SIGMOID:  # ties made by the bias, on scores the probabilities do not share
        bias = np.where(np.arange(n_expert) % 2, 0.5, 0.0).astype(np.float32)
        check_route(gpu, np.zeros((3, n_expert), np.float32), routing, bias)


def test_route_of_no_tokens(gpu):
    experts, weights = gpu_routes(gpu, np.zeros((0, 8), np.float32), Routing(2, norm=True))
    assert experts.shape == weights.shape == (0, 2)


def stacked(gpu, qtype, n_expert, n_rows, n_cols):
    """(n_expert, n_rows, n_cols) experts on both backends: ggml shape {n_cols, n_rows, n_expert}."""
    data = random_weight(qtype, n_expert * n_rows, n_cols)
    t, shape = GGMLType[qtype], (n_cols, n_rows, n_expert)
    return cpu.load_weight("w", t, shape, data), loaded(gpu, "w", t, shape, data)


@cache  # one set per type: the test's weight region does not hold one per parametrization
def experts_for(gpu, qtype, n_expert):
    # K-quant rows are whole 256-blocks; the float types get ragged widths
    e, f = (200, 72) if GGML_BLOCK[GGMLType[qtype]][0] == 1 else (512, 256)
    return e, [stacked(gpu, qtype, n_expert, *shape) for shape in ((f, e), (f, e), (e, f))]


def device_routes(gpu, experts, weights):
    return Routes(gpu.from_host(np.ascontiguousarray(experts, np.int32).view(np.float32)),
                  gpu.from_host(np.ascontiguousarray(weights, np.float32)))


def f16(a):
    return a.astype(np.float16).astype(np.float32)


def rounded_reference(x, experts, weights, gate, up, down, x_rounded, h_rounded):
    """cpu.moe_ffn with x and each expert's SwiGLU output rounded as the device's kernels take them."""
    out = np.zeros((len(x), down.shape[1]), np.float64)
    for e in np.unique(experts):
        rows, slot = np.nonzero(experts == e)
        h = h_rounded(cpu.swiglu(x_rounded(x[rows]) @ gate[e].T, x_rounded(x[rows]) @ up[e].T))
        np.add.at(out, rows, (h @ down[e].T) * weights[rows, slot][:, None])
    return out


def experts_path(qtype, n_tok):
    """Which kernels take a pass's experts of this type (the experts here: rows of whole superblocks): "tile"
    (a prompt, kernels/gemm_tile.cu), "x16" (a decode pass on int16 x, kernels/matvec_x16.cu) or "float"."""
    t = GGMLType[qtype]
    if n_tok > GROUPED_MIN_TOKENS:
        return "tile" if t in GEMM_TILE_TYPES else "float"
    return "x16" if t in X16_MATVEC_TYPES else "float"


def same(a):
    return a


# what each path rounds x and h to, how many launches of which kernels multiply gate, up and down (gate and up
# in one on int16 x), and the tolerance left: the tile's for the weights' f16 rounding inside gemm_tile.cu (as its
# dense GEMM's test allows); the int16 path's for float rounding and for h's int16 steps, where the device's SwiGLU
# (its gate and up summed in another order) lands on the other side of a rounding boundary from the reference's
# (one step is 1/32767 of its block's largest |h|: run 29 saw 1.18e-5 once, on Q5_K)
PATHS = {"tile": (f16, f16, {"gemm_tile_experts_": 3}, 1e-3),
         "tile, then float": (f16, same, {"gemm_tile_experts_": 2, "grouped_matvec_": 1}, 1e-3),
         "x16": (x16_rounded, x16_rounded, {"stacked_matvec_x16_": 1, "experts_down_x16_": 1}, 5e-5),
         "float": (same, same, {}, 1e-5)}


def within_f16(x, experts, mats, most=1024.0):
    """x scaled so that no chosen expert's SwiGLU output passes `most`, as a model's do, in f16's reach (65,504):
    random K-quant experts take N(0, 1) inputs into the hundreds, and their SwiGLU into the hundred thousands."""
    (gate, _), (up, _), _ = mats
    h = max(float(np.abs(cpu.swiglu(x @ gate[e].T, x @ up[e].T)).max()) for e in np.unique(experts))
    return x * np.float32(min(1.0, np.sqrt(most / h)))  # SwiGLU grows as x squared


def check_moe(gpu, x, experts, weights, mats, path="float", residual=None):
    """The device's moe_ffn (+ residual, scaled to the products' size) against the reference, on the path's
    kernels: the residual summed in the int16 down's own launch, by add_f32 after the others."""
    (g_cpu, g_gpu), (u_cpu, u_gpu), (d_cpu, d_gpu) = mats
    x_rounded, h_rounded, kernels, tolerance = PATHS[path]
    want = rounded_reference(x, experts, weights, g_cpu, u_cpu, d_cpu, x_rounded, h_rounded)
    if residual is not None:
        residual = residual * np.float32(np.abs(want).mean())
        want += residual
    gpu.poison()
    dx, add = gpu.from_host(x), None if residual is None else gpu.from_host(residual)
    with recorded_launches(gpu) as launched:
        got = gpu.to_host(gpu.moe_ffn(dx, device_routes(gpu, experts, weights), gate=g_gpu, up=u_gpu, down=d_gpu, add=add))
    assert launched.count("add_f32") == (residual is not None and path != "x16")
    assert {part: sum(part in name for name in launched) for part in kernels} == kernels
    assert sum("_x16_" in name or "gemm_tile" in name for name in launched) == sum(kernels.values()) - kernels.get("grouped_matvec_", 0)
    assert rel_err(got, want) < tolerance
    return got


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
@pytest.mark.parametrize("n_tok", [1, 3, 8, 9, 77])
@pytest.mark.parametrize("with_residual", [False, True])
def test_moe_ffn_matches_the_cpu(gpu, qtype, n_tok, with_residual):
    n_expert, k = 8, 3
    e, mats = experts_for(gpu, qtype, n_expert)
    experts = np.stack([rng.permutation(n_expert)[:k] for _ in range(n_tok)])
    x = within_f16(rng.standard_normal((n_tok, e)).astype(np.float32), experts, mats)
    weights = rng.uniform(0, 1, (n_tok, k)).astype(np.float32)
    residual = rng.standard_normal((n_tok, e)).astype(np.float32) if with_residual else None
    check_moe(gpu, x, experts, weights, mats, experts_path(qtype, n_tok), residual)


@pytest.mark.parametrize("qtype", [t.name for t in GEMM_TILE_TYPES])
def test_a_prompts_experts_on_tensor_cores_take_tiles_of_64_pairs_and_never_read_unpicked_experts(gpu, qtype):
    """Expert 2 takes every token's first slot: 150 pairs, three tiles (64, 64, 22); experts 0 and 5 share the
    second slot (a partial tile each); no token picks the others, whose blocks' scales are NaN: a read of them
    would reach the output. Rows of 2 and 3 superblocks; 6 and 4 blocks of 128 rows."""
    n_expert, e, f, n_tok = 6, 512, 768, 150
    t, d_at = GGMLType[qtype], {"Q4_K": 0, "Q6_K": 208, "Q8_0": 0, "Q5_0": 0}[qtype]
    block, size = GGML_BLOCK[t]
    mats = []
    for n_rows, n_cols in ((f, e), (f, e), (e, f)):
        blocks = np.frombuffer(random_weight(qtype, n_expert * n_rows, n_cols), np.uint8).reshape(n_expert, -1, size).copy()
        blocks[[1, 3, 4], :, d_at : d_at + 2] = np.array([0x7E00], "<u2").view(np.uint8)  # f16 NaN
        shape, data = (n_cols, n_rows, n_expert), blocks.tobytes()
        mats.append((cpu.load_weight("w", t, shape, data), loaded(gpu, "w", t, shape, data)))
    experts = np.stack([np.full(n_tok, 2), np.where(np.arange(n_tok) % 3, 0, 5)], axis=1)
    x = within_f16(rng.standard_normal((n_tok, e)).astype(np.float32), experts, mats)
    weights = rng.uniform(0, 1, (n_tok, 2)).astype(np.float32)
    got = check_moe(gpu, x, experts, weights, mats, "tile")
    assert np.isfinite(got).all()


@pytest.mark.parametrize("down_type,path", [("Q5_0", "tile"), ("Q8_0", "tile"), ("Q4_0", "tile, then float")])
def test_a_prompts_experts_take_tiles_where_the_kernels_have_their_type_and_float_passes_elsewhere(gpu, down_type, path):
    """As DeepSeek-V2-Lite's Q4_K_M file: Q4_K gate and up of 1,408 rows (ten blocks of 128 rows and a partial
    one), a down of 1,408 columns, five superblocks and a half, in Q5_0 or (its layers of more bits) Q8_0: tiles,
    the last step's half alone. A down of a type gemm_tile.cu has no kernels for (Q4_0) takes grouped_matvec, on h
    as it is."""
    n_expert, e, f, n_tok, k = 4, 512, 1408, 40, 2
    mats = [stacked(gpu, qtype, n_expert, *shape) for qtype, shape in (("Q4_K", (f, e)), ("Q4_K", (f, e)), (down_type, (e, f)))]
    experts = np.stack([rng.permutation(n_expert)[:k] for _ in range(n_tok)])
    x = within_f16(rng.standard_normal((n_tok, e)).astype(np.float32), experts, mats)
    check_moe(gpu, x, experts, rng.uniform(0, 1, (n_tok, k)).astype(np.float32), mats, path)


def test_every_token_to_one_expert_and_experts_nobody_picks(gpu):
    """Unpicked experts are never read: NaN in them changes nothing."""
    n_expert, e, f, n_tok = 6, 64, 32, 9
    mats = []
    for n_rows, n_cols in ((f, e), (f, e), (e, f)):
        w = rng.standard_normal((n_expert, n_rows, n_cols)).astype(np.float32)
        w[[0, 2, 4, 5]] = np.nan
        data, shape = w.tobytes(), (n_cols, n_rows, n_expert)
        mats.append((cpu.load_weight("w", GGMLType.F32, shape, data), loaded(gpu, "w", GGMLType.F32, shape, data)))
    x = rng.standard_normal((n_tok, e)).astype(np.float32)
    logits = np.zeros((n_tok, n_expert), np.float32)
    logits[:, 3], logits[:, 1] = 20, 10  # every token's first and second choice
    for routing in (Routing(2), Routing(1, norm=True)):
        experts, weights = gpu_routes(gpu, logits, routing)
        assert (experts == [3, 1][: routing.n_used]).all()
        got = check_moe(gpu, x, experts, weights, mats)
        assert np.isfinite(got).all()


def test_stacked_experts_of_a_type_without_kernels_become_f16_at_load(gpu):
    """A 3-D IQ4_NL tensor is dequantized once at load to n_expert F16 matrices, each one's values
    contiguous; the only difference from the reference is the f16 rounding of each weight."""
    n_expert, e, f, n_tok, k = 4, 256, 64, 5, 2
    block, size = GGML_BLOCK[GGMLType.IQ4_NL]
    mats = []
    for n_rows, n_cols in ((f, e), (f, e), (e, f)):
        blocks = rng.integers(0, 256, (n_expert * n_rows * n_cols // block, size), dtype=np.uint8)
        blocks[:, 0:2] = rng.uniform(0.001, 0.01, len(blocks)).astype("<f2").view(np.uint8).reshape(-1, 2)  # finite scales
        shape, data = (n_cols, n_rows, n_expert), blocks.tobytes()
        w_gpu = loaded(gpu, "w", GGMLType.IQ4_NL, shape, data)
        assert w_gpu.ggml_type == GGMLType.F16
        mats.append((cpu.load_weight("w", GGMLType.IQ4_NL, shape, data).astype(np.float16).astype(np.float32), w_gpu))
    x = rng.standard_normal((n_tok, e)).astype(np.float32)
    experts = np.stack([rng.permutation(n_expert)[:k] for _ in range(n_tok)])
    check_moe(gpu, x, experts, rng.uniform(0, 1, (n_tok, k)).astype(np.float32), mats)


def decode_with_and_without_graphs(monkeypatch, path):
    """Greedy tokens and their log-probabilities from a model whose decode steps replay a CUDA
    graph, and from one that launches every kernel (REFLEX_CUDA_GRAPHS=0)."""
    runs = []
    for graphs in ("1", "0"):
        monkeypatch.setenv("REFLEX_CUDA_GRAPHS", graphs)
        model = reflex_engine.load(path, device="cuda", n_ctx=256)
        out = []
        for prompt in ("The capital of France is", "Once upon a time"):  # the second replays the first's graph
            gen = model.generate(prompt, max_tokens=40, sampling=SamplingParams(temperature=0), ignore_eos=True, logprobs=True)
            events = [e for e in gen if e.id is not None]
            out.append(([e.id for e in events], [e.logprob for e in events]))
        assert (type(model._forward).__name__ == "ReplayedPasses") == (graphs == "1")
        if graphs == "1":
            assert [shape[0] for shape in model._forward.graphs] == [1]  # the decode step's
        runs.append(out)
    return runs


def test_qwen3moe_decode_replayed_as_a_cuda_graph_equals_eager_decode(monkeypatch):
    graphed, eager = decode_with_and_without_graphs(monkeypatch, paths("qwen3moe", "Q8_0")[0])
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(graphed, eager):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-6)
