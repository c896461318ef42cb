"""Every CUDA op against the numpy backend (the reference proven against transformers), on fresh
random inputs at several sizes, ragged ones included, with every activation buffer poisoned
(NaN) before each op so an unwritten element fails the comparison."""
import contextlib

import numpy as np
import pytest

from reflex_engine.backends.cpu import CpuOps
from reflex_engine.backends.cuda.ops import (ATTENTION_SPLIT_SLOTS, GEMM_TILE_MIN_TOKENS, GEMM_TILE_TYPES, MATVEC_MAX_ROWS,
                                             MATVEC_MAX_TOKENS, MATVEC_PASSES_MAX_TOKENS, PREFILL_ATTENTION_MIN_TOKENS,
                                             PREFILL_ATTENTION_WIDTHS,
                                             X16_MATVEC_TYPES, kernel_suffix)
from reflex_engine.gguf import GGML_BLOCK, GGMLType
from reflex_engine.ops import Batch, CacheShape, Rope, RopeMode
from reflex_engine.sampling import SamplingParams

pytestmark = pytest.mark.gpu

cpu = CpuOps()
rng = np.random.default_rng()
KERNEL_TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# byte offsets of each type's f16 scales inside a block: set to finite values so random blocks
# dequantize to numbers, not NaN/inf
SCALES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
          "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


@pytest.fixture(scope="module")
def gpu():
    from reflex_engine.backends.cuda import CudaOps

    ops = CudaOps()
    # the (512, 50) matrix sizes the long-prompt GEMM's f16 scratch: 50 rows of 512, so larger
    # weights below are dequantized and multiplied in turns
    # the cache region: every test's caches are carved from it and never given back (~70 MB in all)
    ops.reserve([(GGMLType.F32, (64 << 20,)), (GGMLType.F16, (512, 50))], CacheShape(8, 4096, 1024, 1024),
                activation_width=1 << 18)
    return ops


def random_weight(qtype: str, n_rows: int, n_cols: int) -> bytes:
    t = GGMLType[qtype]
    if qtype in ("F32", "F16"):
        return rng.standard_normal((n_rows, n_cols)).astype("<f4" if qtype == "F32" else "<f2").tobytes()
    if qtype == "BF16":
        return (rng.standard_normal((n_rows, n_cols)).astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
    block, size = GGML_BLOCK[t]
    blocks = rng.integers(0, 256, (n_rows * n_cols // block, size), dtype=np.uint8)
    for at in SCALES[qtype]:
        blocks[:, at : at + 2] = (rng.uniform(0.001, 0.05, len(blocks)).astype("<f2")).view(np.uint8).reshape(-1, 2)
    return blocks.tobytes()


def both(gpu, qtype, n_rows, n_cols):
    data = random_weight(qtype, n_rows, n_cols)
    t, shape = GGMLType[qtype], (n_cols, n_rows)
    return cpu.load_weight("w", t, shape, data), loaded(gpu, "w", t, shape, data)


def loaded(gpu, name, t, shape, data):
    """A weight on the device: load_weight defers copies of stored blocks to commit_weights."""
    weight = gpu.load_weight(name, t, shape, data)
    gpu.commit_weights()
    return weight


def host(gpu, x):
    gpu.poison()
    return gpu.from_host(np.ascontiguousarray(x, np.float32))


@contextlib.contextmanager
def recorded_launches(gpu):
    """The names of the kernels gpu launches inside the block, in order."""
    names, launch = [], gpu.device.launch
    gpu.device.launch = lambda name, *args: (names.append(name), launch(name, *args))[1]
    try:
        yield names
    finally:
        del gpu.device.launch  # the class's method again


def rel_err(got, ref):
    assert not np.isnan(got).any(), "unwritten (NaN) elements"
    return float(np.linalg.norm(got.astype(np.float64) - ref) / np.linalg.norm(ref))


def x16_rounded(x):
    """x as kernels/matvec_x16.cu's quantize_x16 gives it back: per 32 elements of a row, d = max |x| / 32767
    and x = rint(x / d)·d clamped to ±32767·d, all float32 (0 where d is 0)."""
    blocks = x.reshape(-1, 32)
    d = (np.abs(blocks).max(axis=1) / np.float32(32767)).astype(np.float32)[:, None]
    q = np.clip(np.rint(blocks / np.where(d > 0, d, np.float32(1))), -32767, 32767)
    return (np.where(d > 0, q, 0).astype(np.float32) * d).reshape(x.shape)


def matvec_input(qtype, x):
    """What the decode matvec of qtype multiplies: the int16 path's rounded x, or x itself."""
    return x16_rounded(x) if GGMLType[qtype] in X16_MATVEC_TYPES else x


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
@pytest.mark.parametrize("n_tok", [1, 3, 8, 9, 40, 77, 130, 300])  # matvec, the short-prompt GEMM, the f16 GEMM
def test_matmul_matches_dequantized_reference(gpu, qtype, n_tok):
    block = GGML_BLOCK[GGMLType[qtype]][0]
    # ragged rows for the float types (which then keep the matvec passes); an odd number of 32-column
    # chunks a row (736, 800: the short-prompt GEMM's warps take them in pairs) where the blocks allow
    for n_cols in ([200, 512, 736] if block == 1 else [512, 800] if block == 32 else [512, 768]):
        # a lone row's one token is often a sum that cancels to near 0, of which float rounding is then a
        # large share: it is judged together with the 70 rows, which take the same path
        for shapes in ((1, 70), (129,), (200,)):
            # past one pass of 8 tokens, wide enough matrices take the GEMMs, which round operands to f16
            gemm = n_tok > MATVEC_MAX_TOKENS and shapes[-1] > MATVEC_MAX_ROWS and n_cols % 32 == 0
            got, ref = [], []
            for n_rows in shapes:
                w_cpu, w_gpu = both(gpu, qtype, n_rows, n_cols)
                x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
                got.append(gpu.to_host(gpu.matmul(host(gpu, x), w_gpu)).ravel())
                # matvec passes: float32 throughout, of x as they round it; small matrices' too at any length, of x unrounded
                x_ref = x if gemm or n_tok > MATVEC_PASSES_MAX_TOKENS else matvec_input(qtype, x)
                ref.append(cpu.matmul(x_ref, w_cpu).astype(np.float64).ravel())
            assert rel_err(np.concatenate(got), np.concatenate(ref)) < (3e-3 if gemm else 1e-5), (qtype, shapes, n_cols)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "F16"])
def test_short_prompt_gemm_split_over_the_columns(gpu, qtype):
    """A short prompt's few blocks split a weight's columns (kernels/gemm.cu: up to 8 splits of the 512-column
    steps, the last split's sums merged by the tile's last block): the product of the whole row, over one
    token tile and several, the same bits from one call to the next whichever block merges."""
    n_cols = 4352  # 9 steps, the last a half: splits of unequal length
    w_cpu, w_gpu = both(gpu, qtype, 100, n_cols)
    for n_tok in (16, 77, 127):
        x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
        got = [gpu.to_host(gpu.matmul(host(gpu, x), w_gpu)) for _ in range(3)]
        assert rel_err(got[0], cpu.matmul(x, w_cpu).astype(np.float64)) < 3e-3, n_tok
        np.testing.assert_array_equal(got[1], got[0])
        np.testing.assert_array_equal(got[2], got[0])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
def test_fragment_gemm_rounds_only_x_to_f16(gpu, qtype):
    """Q4_K and Q8_0 rows of 4,096 columns or more take kernels/gemm_frag.cu on short prompts, which keeps the
    weights exact (the quants, Q4_K's sc·q and m, as f16 integers; d and dmin applied in float32): against the
    reference on x rounded to f16 it agrees to float32 summation, where weights rounded to f16 (gemm.cu) cost
    ~1e-3. 132 rows: a block's 32 and a partial one; 17 steps of 256 columns: 8 warps, one with a third. Past
    32 tokens the tile GEMM takes them (test_long_prompts_multiply_the_blocks_themselves)."""
    w_cpu, w_gpu = both(gpu, qtype, 132, 4352)
    for n_tok in (9, 16, 17, GEMM_TILE_MIN_TOKENS - 1):
        x = rng.standard_normal((n_tok, 4352)).astype(np.float32)
        got = gpu.to_host(gpu.matmul(host(gpu, x), w_gpu))
        ref = cpu.matmul(x.astype(np.float16).astype(np.float32), w_cpu).astype(np.float64)
        assert rel_err(got, ref) < 1e-5, n_tok


@pytest.mark.parametrize("qtype,n_cols", [(t, 4352) for t in GEMM_TILE_TYPES]
                         + [(t, 4224) for t in GEMM_TILE_TYPES if GGML_BLOCK[t][0] == 32]
                         + [(GGMLType.Q4_K, 1024), (GGMLType.Q6_K, 1280)])
def test_long_prompts_multiply_the_blocks_themselves(monkeypatch, qtype, n_cols):
    """From GEMM_TILE_MIN_TOKENS tokens on, Q4_K, Q6_K, Q8_0 and Q5_0 rows take kernels/gemm_tile.cu, no f16 copy of
    the weights: each lane makes its rows' weights f16 itself (the quants exact, d·sc and dmin·m rounded to f16), x
    rounded to f16. Against the reference on x rounded so, what is left is the weights' rounding, as gemm_f16.cu's
    copy has it. 300 rows: two blocks of 128 and a partial one; 65 and 130 tokens: a partial token tile; 17
    superblocks a row: an odd one last, in the second of the two stages, or (4,224 columns, Q8_0 and Q5_0) 16 and
    a half, its half's other X columns zeros; rows narrower than MMA_MIN_COLS (4 and 5 superblocks: a split's one or
    two) take them up to GEMM_TILE_NARROW_MAX_TOKENS. A launch of few blocks takes clusters of GEMM_TILE_SPLITS, each a
    share of the 17 (4, 4, 4, 5; the half in the last), the first adding the others' sums: the same product to
    float32 rounding, the same bits on every call. In either form a weight's product is its own launch's bits when
    another weight (200 rows) shares the launch."""
    from reflex_engine.backends.cuda import CudaOps, ops as cuda_ops

    gpu = CudaOps()  # its own scratch: the module's f16 x holds 512 columns of a long prompt
    if not gpu._sm90:
        pytest.skip("the split form's clusters need sm_90 or later")
    n_rows = 300
    gpu.reserve([(qtype, (n_cols, n_rows)), (qtype, (n_cols, 200))], CacheShape(1, 16, 64, 64),
                activation_width=4 * (n_rows + 200 + n_cols))
    w_cpu, w_gpu = both(gpu, qtype.name, n_rows, n_cols)
    other = both(gpu, qtype.name, 200, n_cols)[1]
    with recorded_launches(gpu) as launched:
        for n_tok in (GEMM_TILE_MIN_TOKENS, 65, 130):
            x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
            ref = cpu.matmul(x.astype(np.float16).astype(np.float32), w_cpu).astype(np.float64)
            products = {}
            for form, blocks_an_sm in (("tile", 0), ("tile_split", 1 << 20)):
                monkeypatch.setattr(cuda_ops, "GEMM_TILE_SPLIT_BLOCKS_AN_SM", blocks_an_sm)
                gpu._plans.clear()
                launched.clear()
                products[form] = [gpu.to_host(gpu.matmul(host(gpu, x), w_gpu)) for _ in range(2)]
                assert launched.count(f"gemm_{form}_{kernel_suffix(qtype)}") == 2 and not any(n.startswith("dequant_f16") for n in launched)
                assert rel_err(products[form][0], ref) < 1e-3, (form, n_tok)
                np.testing.assert_array_equal(products[form][1], products[form][0])
                together = [gpu.to_host(y) for y in gpu.matmuls(host(gpu, x), [w_gpu, other])]
                np.testing.assert_array_equal(together[0], products[form][0])
                np.testing.assert_array_equal(together[1], gpu.to_host(gpu.matmul(host(gpu, x), other)))
            assert rel_err(products["tile_split"][0], products["tile"][0].astype(np.float64)) < 2e-5, n_tok


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_matvec_edge_shapes(gpu, qtype):
    """The decode matvec (kernels/matvec.cu: 2 rows a block, 128 threads striding over 16-element
    pieces) at its edges: the smallest legal width, widths whose last pass is partial, ragged and
    unaligned rows for the float types, one row, an odd row count, every token count."""
    block = GGML_BLOCK[GGMLType[qtype]][0]
    widths = [1, 13, 64, 2056] if block == 1 else [block, 3 * block, 12288]
    for n_cols in widths:
        for n_rows in (1, 3, 130):
            w_cpu, w_gpu = both(gpu, qtype, n_rows, n_cols)
            for n_tok in range(1, 9):
                x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
                got = gpu.to_host(gpu.matmul(host(gpu, x), w_gpu))
                xin = matvec_input(qtype, x)
                ref = cpu.matmul(xin, w_cpu).astype(np.float64)
                # relative to the terms' magnitudes: one output row's sum can cancel to near zero
                terms = np.linalg.norm(np.abs(xin).astype(np.float64) @ np.abs(w_cpu).T.astype(np.float64))
                assert np.linalg.norm(got - ref) / terms < 1e-5, (n_cols, n_rows, n_tok)
                assert not np.isnan(got).any()


@pytest.mark.parametrize("qtype", [t.name for t in X16_MATVEC_TYPES])
def test_x16_matvec_is_within_int16_rounding_of_float_x(gpu, qtype):
    """The int16 path (kernels/matvec_x16.cu) against x unrounded: int16 x costs ~2e-5 of the result
    on random weights (int8 x, llama.cpp's q8_1, ~5e-3). Every row has blocks of x that are all zero
    or all tiny and one whose spike takes q = 32767 while its other elements keep ~11 bits. 160 units
    of 32 columns a row: 128 threads make a full pass and a partial one."""
    n_rows, n_cols = 257, 5120  # past 8 tokens such a matrix takes the GEMM instead
    w_cpu, w_gpu = both(gpu, qtype, n_rows, n_cols)
    for n_tok in (1, 2, 8):
        x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
        x[:, :32], x[:, 32:64], x[:, 64:96] = 0.0, 1e-43, 1e-40  # d: 0, 0 by underflow, subnormal (clamped q)
        x[:, 100] = 20.0
        got = gpu.to_host(gpu.matmul(host(gpu, x), w_gpu))
        assert rel_err(got, cpu.matmul(x16_rounded(x), w_cpu).astype(np.float64)) < 1e-5, n_tok
        assert rel_err(got, cpu.matmul(x, w_cpu).astype(np.float64)) < 3e-4, n_tok


def test_x16_matvec_reuses_an_inputs_int16_blocks_and_never_stale_ones(gpu):
    """q, k, v share one quantize_x16 of their x (ops.py _matvec), yet every new x is quantized afresh:
    one of other tokens, passes of 8 tokens, and (third round) one in the buffer the first round's had."""
    n_cols = 1024
    weights = [both(gpu, qtype, n_rows, n_cols) for qtype, n_rows in (("Q4_K", 64), ("Q8_0", 32), ("Q6_K", 96))]
    for n_tok in (1, 5, 1, 20):
        x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
        xt = host(gpu, x)
        for w_cpu, w_gpu in weights:
            got = gpu.to_host(gpu.matmul(xt, w_gpu))
            assert rel_err(got, cpu.matmul(x16_rounded(x), w_cpu).astype(np.float64)) < 1e-5, n_tok
        del xt  # its buffer returns to the pool once the next round's x is quantized


def test_ops_that_feed_a_matvec_leave_it_their_int16_blocks_bit_for_bit(gpu):
    """A whole-row rms_norm, swiglu and the split attention's combine write their output's int16
    blocks beside it (kernels/x16.cuh), and the matvec after them reads those instead of quantizing
    again: it must give, bit for bit, what it gives on a copy of the output quantized afresh."""
    n_cols, heads, d, wide = 1024, 8, 128, 4096
    w_gpu, w_wide = both(gpu, "Q4_K", 96, n_cols)[1], both(gpu, "Q4_K", 40, wide)[1]
    norm_w, norm_wide = (loaded(gpu, "n", GGMLType.F32, (n,), rng.standard_normal(n).astype(np.float32).tobytes()) for n in (n_cols, wide))
    cache = gpu.new_kv_cache(CacheShape(1, 4096, n_cols, n_cols))  # 64 splits a (query, head): combined
    for n_tok in (1, 5, 8):  # one pass: past it the GEMMs read the float output itself
        a, b, c = (gpu.from_host(rng.standard_normal((n_tok, n_cols)).astype(np.float32) * 3) for _ in range(3))
        a_wide = gpu.from_host(rng.standard_normal((n_tok, wide)).astype(np.float32) * 3)
        made = {"rms_norm": (lambda: gpu.rms_norm(a, norm_w, 1e-6), w_gpu),
                "rms_norm, 4 blocks a row": (lambda: gpu.rms_norm(a_wide, norm_wide, 1e-6), w_wide),
                "swiglu": (lambda: gpu.swiglu(a, b), w_gpu),
                "attention": (lambda: gpu.attention(a, b, c, cache=cache, layer=0, batch=Batch.causal(range(n_tok), 0),
                                                    n_heads=heads, n_kv_heads=heads, scale=d**-0.5), w_gpu)}
        for op, (make, w) in made.items():
            y = make()
            assert gpu._x16_of[0] is y, op  # the matvec below takes the blocks the op wrote
            got = gpu.to_host(gpu.matmul(y, w))
            want = gpu.to_host(gpu.matmul(gpu.from_host(gpu.to_host(y)), w))
            np.testing.assert_array_equal(got, want, err_msg=f"{op}, {n_tok} tokens")


@pytest.mark.parametrize("qtype,width,n_ff", [("Q4_K", 1024, 512), ("Q6_K", 1024, 768), ("Q8_0", 512, 1024), ("Q4_K", 4096, 4096),
                                             ("Q6_K", 4096, 512), ("Q4_K", 4096, 12288)],
                         ids=["q4_K", "q6_K", "q8_0", "tensor-cores", "q6_K-eight-an-sm", "tensor-cores-16-warps"])
def test_a_norm_between_one_tokens_matvecs_is_theirs_within_int16_rounding(gpu, qtype, width, n_ff):
    """down (n_ff -> width, the residual summed in), the norm of its product, then gate and up (two types:
    two launches) in a one-token pass: down writes the int16 blocks of y∘w and each group's sum of squares
    (kernels/x16.cuh NormOut), gate and up scale their sums by the norm's. Their products are the
    reference's norm then matvec to int16 rounding, as the norm's launch gives them; y is the same bits,
    and the norm's float values, when they are read, are norm_f32's own. A Q6_K down of 4,096 rows (1,024
    blocks) fits an H200's SMs only at 8 blocks an SM: its twin kernel (matvec_x16_1w_q6_K) makes it; a Q4_K down of
    4,096 rows of 12,288 (128 groups of 32) takes the bulk matvec's blocks of 16 warps (matvec_x16_bulk16_q4_K)."""
    down, gate, up = both(gpu, qtype, width, n_ff), both(gpu, qtype, n_ff, width), both(gpu, "Q4_K", n_ff, width)
    norm = rng.standard_normal(width).astype(np.float32)
    norm_gpu = loaded(gpu, "n", GGMLType.F32, (width,), norm.tobytes())
    h, r = rng.standard_normal((1, n_ff)).astype(np.float32), rng.standard_normal((1, width)).astype(np.float32) * 3
    with recorded_launches(gpu) as launched:
        runs = {}
        try:
            for fused in (True, False):
                gpu.fuse_norms = fused
                launched.clear()
                y = gpu.matmul(host(gpu, h), down[1], add=gpu.from_host(r))
                normed = gpu.rms_norm(y, norm_gpu, 1e-6)
                products = [gpu.to_host(p) for p in gpu.matmuls(normed, [gate[1], up[1]])]
                assert ("norm_f32" in launched) != fused, fused
                twin = 6 * gpu.device.info.multiprocessors < width // 4 <= 8 * gpu.device.info.multiprocessors
                assert ("matvec_x16_1w_q6_K" in launched) == (qtype == "Q6_K" and twin)
                assert ("matvec_x16_bulk16_q4_K" in launched) == (n_ff == 12288)
                runs[fused] = products, gpu.to_host(normed), gpu.to_host(y)
        finally:
            gpu.fuse_norms = True
    (fused_products, fused_normed, fused_y), (products, normed, y) = runs[True], runs[False]
    np.testing.assert_array_equal(fused_y, y)
    np.testing.assert_array_equal(fused_normed, normed)
    y_ref = r + cpu.matmul(x16_rounded(h), down[0])
    normed_ref = cpu.rms_norm(y_ref, norm, 1e-6)
    for (w_cpu, _), got, unfused in zip((gate, up), fused_products, products):
        assert rel_err(unfused, cpu.matmul(x16_rounded(normed_ref), w_cpu).astype(np.float64)) < 2e-5
        assert rel_err(got, cpu.matmul(normed_ref, w_cpu).astype(np.float64)) < 1e-4
        assert rel_err(got, unfused.astype(np.float64)) < 1e-4


@pytest.mark.parametrize("qtype,n_rows,n_cols", [("Q4_K", 96, 512), ("Q8_0", 300, 512), ("Q4_1", 96, 512), ("F16", 300, 512),
                                                 ("Q4_K", 70, 4096)])  # int16 and float passes (one token: tensor cores); GEMMs
def test_matmul_sums_the_residual_it_is_given_into_the_product(gpu, qtype, n_rows, n_cols):
    """matmul(x, w, add=r) is r + matmul(x, w) to the bit, whether the matvec sums r in its own
    stores (the int16 kernels, the short-prompt GEMM) or an add follows the product (every other path)."""
    w_gpu = both(gpu, qtype, n_rows, n_cols)[1]
    for n_tok in (1, 5, 40, 200):
        x, r = (rng.standard_normal((n_tok, s)).astype(np.float32) for s in (n_cols, n_rows))
        xt = host(gpu, x)
        product = gpu.to_host(gpu.matmul(xt, w_gpu))
        got = gpu.to_host(gpu.matmul(xt, w_gpu, add=gpu.from_host(r)))
        np.testing.assert_array_equal(got, r + product, err_msg=f"{n_tok} tokens")


@pytest.mark.parametrize("kinds,n_cols", [([("Q4_K", 300), ("Q4_K", 129), ("Q4_K", 200), ("Q4_K", 64)], 512),  # past three: a second launch
                                          ([("Q8_0", 256), ("Q8_0", 70), ("Q8_0", 96)], 512),
                                          ([("Q4_K", 256), ("Q4_K", 130), ("Q6_K", 160), ("Q4_1", 140), ("Q4_1", 100)], 512),
                                          # the short-prompt GEMM splits each weight's 5 column steps its own way
                                          ([("Q4_K", 96), ("Q4_K", 1000), ("Q4_K", 6000)], 2304),
                                          # one token on tensor cores (kernels/matvec_x16_mma.cu), 32 rows a block
                                          ([("Q4_K", 300), ("Q4_K", 40), ("Q4_K", 64)], 4096)],
                         ids=["q4_K", "q8_0", "mixed", "split", "mma"])
def test_matmuls_equal_the_matmuls_one_by_one(gpu, kinds, n_cols):
    """Weights reading one x (q, k, v; gate, up) that share a launch (a grid over all their rows) give
    each product to the bit as its own launch does: at every path's token counts, with weights of one
    type and of several (then in runs), and small ones (passes at any length) beside GEMM-sized ones."""
    weights = [both(gpu, qtype, n_rows, n_cols)[1] for qtype, n_rows in kinds]
    for n_tok in (1, 5, 8, 20, 40, 200):
        x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
        together = [gpu.to_host(y) for y in gpu.matmuls(host(gpu, x), weights)]  # host(): every buffer poisoned first
        alone = [gpu.to_host(gpu.matmul(host(gpu, x), w)) for w in weights]
        for i, (a, b) in enumerate(zip(alone, together)):
            assert not np.isnan(a).any()
            np.testing.assert_array_equal(b, a, err_msg=f"weight {i} of {kinds}, {n_tok} tokens")


@pytest.mark.parametrize("rows,n_cols", [([300, 40, 64], 4096), ([9000], 4096), ([4300, 70], 12288), ([4096], 12288)],
                         ids=["fused", "groups-a-block", "wide", "sixteen-warps"])
def test_bulk_matvec_is_the_register_matvec_to_the_bit(rows, n_cols):
    """From sm_90 on, one token's Q4_K matvec streams its rows through shared memory (matvec_x16_bulk_q4_K):
    a grid of 2 blocks an SM, each walking its groups of 32 rows (9,000 rows: some blocks two groups) and
    each group's stages of 8 superblocks through a ring of 2 (12,288 columns: 6 a group). Every lane sums
    the same superblocks in the same order as the register kernel's, so the products are its bits, the
    residual summed in too, and the reference's on the int16-rounded x to float32 summation. A launch of at
    most a group an SM whose rows are 8,192 columns or more (4,096 rows of 12,288: 8B's downs) takes
    blocks of 16 warps, two a superblock (matvec_x16_bulk16_q4_K): their sums meet in another order, so there the
    products are the register kernel's to float32 rounding."""
    from reflex_engine.backends.cuda import CudaOps

    gpu = CudaOps()  # its own weights region: these are large
    if not gpu._sm90:
        pytest.skip("bulk copies need sm_90 or later")
    gpu.reserve([(GGMLType.Q4_K, (n_cols, n)) for n in rows], CacheShape(1, 16, 64, 64), activation_width=2 * max(rows + [n_cols]))
    weights = [both(gpu, "Q4_K", n, n_cols) for n in rows]
    x = rng.standard_normal((1, n_cols)).astype(np.float32)
    r = rng.standard_normal((1, rows[0])).astype(np.float32)
    wide = sum(-(-n // 32) for n in rows) <= gpu.device.info.multiprocessors and n_cols >= 8192
    bulk_kernel = "matvec_x16_bulk16_q4_K" if wide else "matvec_x16_bulk_q4_K"

    def products():
        xt = host(gpu, x)
        together = [gpu.to_host(y) for y in gpu.matmuls(xt, [w for _, w in weights])]
        return together, gpu.to_host(gpu.matmul(xt, weights[0][1], add=gpu.from_host(r)))

    with recorded_launches(gpu) as launched:
        bulk, bulk_added = products()
        assert bulk_kernel in launched and "matvec_x16_mma_q4_K" not in launched
        gpu._sm90 = False
        gpu._plans.clear()
        launched.clear()
        register, register_added = products()
        assert "matvec_x16_mma_q4_K" in launched and bulk_kernel not in launched
    for (w_cpu, _), got, want in zip(weights, bulk, register):
        if wide:
            assert rel_err(got, want.astype(np.float64)) < 1e-6
        else:
            np.testing.assert_array_equal(got, want)
        assert rel_err(got, cpu.matmul(x16_rounded(x), w_cpu).astype(np.float64)) < 1e-5
    if not wide:
        np.testing.assert_array_equal(bulk_added, register_added)
    np.testing.assert_array_equal(bulk_added, r + bulk[0])


def test_long_prompt_matmul_on_the_large_tiles():
    """A grid big enough for gemm_f16's 128 x 128 tiles (the tests above take its 64 x 64 ones)."""
    from reflex_engine.backends.cuda import CudaOps

    ops = CudaOps()
    n_rows, n_cols, n_tok = 12288, 256, 500
    ops.reserve([(GGMLType.Q4_K, (n_cols, n_rows))], CacheShape(1, 16, 64, 64), activation_width=n_rows + n_cols)
    w_cpu, w_gpu = both(ops, "Q4_K", n_rows, n_cols)
    assert -(-n_rows // 128) * -(-n_tok // 128) >= 2 * ops.device.info.multiprocessors
    x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
    got = ops.to_host(ops.matmul(host(ops, x), w_gpu))
    assert rel_err(got, cpu.matmul(x, w_cpu).astype(np.float64)) < 3e-3


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_embed_rows_are_the_exact_dequantized_rows(gpu, qtype):
    n_cols = 96 if GGML_BLOCK[GGMLType[qtype]][0] == 1 else 256
    w_cpu, w_gpu = both(gpu, qtype, 50, n_cols)
    ids = [int(i) for i in rng.integers(0, 50, 9)]
    gpu.poison()
    np.testing.assert_array_equal(gpu.to_host(gpu.embed(w_gpu, ids)), cpu.embed(w_cpu, ids))


@pytest.mark.parametrize("width,d", [(1024, 1024), (576, 576), (12, 4), (2048, 128), (3000, 3000), (4096, 4096)])
def test_rms_norm(gpu, width, d):
    x = rng.standard_normal((5, width)).astype(np.float32) * 3
    w = rng.standard_normal(d).astype(np.float32)
    w_gpu = loaded(gpu, "n", GGMLType.F32, (d,), w.tobytes())
    got = gpu.to_host(gpu.rms_norm(host(gpu, x), w_gpu, 1e-6))
    np.testing.assert_allclose(got, cpu.rms_norm(x, w, 1e-6), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("mode", [RopeMode.NORM, RopeMode.NEOX])
@pytest.mark.parametrize("head_dim,n_rot,factors", [(64, 64, False), (128, 128, False), (64, 32, False), (64, 64, True),
                                                    (256, 64, False)])
@pytest.mark.parametrize("normed", [False, True], ids=["rope", "rope-of-rms-norm"])
def test_rope(gpu, mode, head_dim, n_rot, factors, normed):
    x = rng.standard_normal((6, 3 * head_dim)).astype(np.float32) * 4
    positions = [0, 1, 2, 37, 300, 4095]
    rope = Rope(mode, n_rot, 500000.0 if factors else 10000.0, 0.5 if n_rot < head_dim else 1.0)
    ff = rng.uniform(1, 8, n_rot // 2).astype(np.float32) if factors else None
    ff_gpu = loaded(gpu, "f", GGMLType.F32, (n_rot // 2,), ff.tobytes()) if factors else None
    w = rng.standard_normal(head_dim).astype(np.float32)
    norm_cpu, norm_gpu = ((w, 1e-6), (loaded(gpu, "n", GGMLType.F32, (head_dim,), w.tobytes()), 1e-6)) if normed else (None, None)
    got = gpu.to_host(gpu.rope(host(gpu, x), positions, head_dim, rope, freq_factors=ff_gpu, norm=norm_gpu))
    want = cpu.rope(x, positions, head_dim, rope, freq_factors=ff, norm=norm_cpu)
    np.testing.assert_allclose(got, want, rtol=1e-5 if normed else 1e-6, atol=1e-5 if normed else 1e-6)


def test_a_passs_later_ropes_read_the_angles_its_first_worked_out(gpu):
    """The first rope of a pass's positions works out their angles (in double) into a table the later ones
    read; a rope of other parameters, or of other positions, works them out again. Each against numpy."""
    positions, other = [3, 0, 1000, 77], [5, 9, 4000, 2]
    x = rng.standard_normal((4, 2 * 128)).astype(np.float32) * 4
    a, b = Rope(RopeMode.NEOX, 128, 1000000.0), Rope(RopeMode.NEOX, 128, 10000.0)
    for rope, pos in ((a, positions), (a, positions), (b, positions), (a, positions), (a, other), (a, other)):
        got = gpu.to_host(gpu.rope(host(gpu, x), pos, 128, rope))
        np.testing.assert_allclose(got, cpu.rope(x, pos, 128, rope), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("normed", [False, True], ids=["ropes", "ropes-of-rms-norms"])
def test_ropes_of_q_and_k_in_one_launch_equal_each_alone(gpu, normed):
    """q (4 heads) and k (2 heads, another norm weight) rotated by one launch give each to the bit
    as its own launch does, and both match the numpy reference."""
    head_dim, positions, rope = 128, [0, 5, 77, 4000], Rope(RopeMode.NEOX, 128, 1000000.0)
    xs = [rng.standard_normal((4, n * head_dim)).astype(np.float32) * 4 for n in (4, 2)]
    ws = [rng.standard_normal(head_dim).astype(np.float32) for _ in xs]
    norms_gpu = [(loaded(gpu, "n", GGMLType.F32, (head_dim,), w.tobytes()), 1e-6) if normed else None for w in ws]
    gpu.poison()
    tensors = [gpu.from_host(x) for x in xs]
    together = [gpu.to_host(y) for y in gpu.ropes(tensors, positions, head_dim, rope, norms=norms_gpu)]
    alone = [gpu.to_host(gpu.rope(host(gpu, x), positions, head_dim, rope, norm=n)) for x, n in zip(xs, norms_gpu)]
    for x, w, a, b in zip(xs, ws, alone, together):
        np.testing.assert_array_equal(b, a)
        want = cpu.rope(x, positions, head_dim, rope, norm=(w, 1e-6) if normed else None)
        np.testing.assert_allclose(b, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", [RopeMode.NEOX, RopeMode.NORM])
def test_a_rope_that_writes_the_cache_stores_what_kv_store_does(gpu, mode):
    """q and k's rope, when the attention follows it, writes k (rotated, f16) and v to the cache in its
    own launch; with anything run between them it runs alone and kv_store writes them: the same cache
    and the same attention, bit for bit, over a prompt in two chunks and decode steps (k's 2 heads of
    128, its first 64 dims rotated; v's heads 96 wide)."""
    n_heads, n_kv, d, dv, n = 8, 2, 128, 96, 24
    shape = CacheShape(1, 64, n_kv * d, n_kv * dv)
    w = rng.standard_normal(d).astype(np.float32)
    norm = (loaded(gpu, "n", GGMLType.F32, (d,), w.tobytes()), 1e-6)
    rope = Rope(mode, 64, 1000000.0)
    q, k, v = (rng.standard_normal((n, width)).astype(np.float32) for width in (n_heads * d, n_kv * d, n_kv * dv))
    results = []
    for fused in (True, False):
        cache, outs = gpu.new_kv_cache(shape), []
        for a, b in ((0, 13), (13, 22), (22, 23), (23, 24)):
            batch = Batch.causal(range(b - a), a)
            gpu.poison()
            dq, dk, dv_ = (gpu.from_host(np.ascontiguousarray(m[a:b])) for m in (q, k, v))
            qr, kr = gpu.ropes((dq, dk), batch.positions, d, rope, norms=(norm, norm))
            if not fused:
                gpu.to_host(kr)  # a download between them makes the held rope alone
            outs.append(gpu.to_host(gpu.attention(qr, kr, dv_, cache=cache, layer=0, batch=batch, n_heads=n_heads,
                                                  n_kv_heads=n_kv, scale=d**-0.5)))
        results.append((outs, [np.frombuffer(bytes(a.data), np.float16).copy() for a in gpu.export_cache(cache, n)]))
    (fused_outs, fused_cache), (alone_outs, alone_cache) = results
    for a, b in zip(fused_cache + fused_outs, alone_cache + alone_outs):
        assert not np.isnan(a).any()
        np.testing.assert_array_equal(a, b)
    want_k = cpu.rope(k, range(n), d, rope, norm=(w, 1e-6)).astype(np.float16)
    np.testing.assert_array_equal(fused_cache[1].reshape(n, -1), v.astype(np.float16))
    np.testing.assert_allclose(fused_cache[0].reshape(n, -1).astype(np.float32), want_k.astype(np.float32), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("qk_type,v_type,width", [("Q4_K", "Q4_K", 1024), ("Q4_K", "Q6_K", 1024), ("Q8_0", "Q8_0", 512),
                                                  ("Q4_K", "Q4_K", 4096), ("Q4_K", "Q6_K", 4096)],
                         ids=["shared", "v-apart", "q8_0", "bulk", "bulk-v-apart"])
def test_a_rope_made_by_the_launch_making_v_is_rope_f32s_to_the_bit(gpu, qk_type, v_type, width):
    """Decode steps of two layers (8 query heads and 2 KV heads of 128): past the pass's first rope, the matvec launch
    making v ropes q and k and writes the cache (kernels/rope.cuh RopeOut), in each form (q, k and v one launch, each
    head roped by its last block; v a launch of its own after q and k, which its blocks rope; the int16 and the bulk
    tensor-core matvecs). Its roped q and k, the cache and the attention are rope_f32's and kv_store's bit for bit."""
    n_heads, n_kv, d = 8, 2, 128
    shape = CacheShape(2, 64, n_kv * d, n_kv * d)
    weights = [both(gpu, t, rows, width)[1] for t, rows in ((qk_type, n_heads * d), (qk_type, n_kv * d), (v_type, n_kv * d))]
    norms = [(loaded(gpu, "n", GGMLType.F32, (d,), rng.standard_normal(d).astype(np.float32).tobytes()), 1e-6) for _ in range(2)]
    rope = Rope(RopeMode.NEOX, d, 1000000.0)
    xs = rng.standard_normal((4, 2, width)).astype(np.float32)
    results = {}
    with recorded_launches(gpu) as launched:
        try:
            for fused in (True, False):
                gpu.fuse_ropes = fused
                cache, outs = gpu.new_kv_cache(shape), []
                for step, x in enumerate(xs):
                    batch = Batch.causal(range(1), step)
                    launched.clear()
                    for layer in range(2):
                        q, k, v = gpu.matmuls(host(gpu, x[layer : layer + 1]), weights)
                        qr, kr = gpu.ropes((q, k), batch.positions, d, rope, norms=norms)
                        o = gpu.attention(qr, kr, v, cache=cache, layer=layer, batch=batch, n_heads=n_heads, n_kv_heads=n_kv,
                                          scale=d**-0.5)
                        outs += [gpu.to_host(t) for t in (qr, kr, o)]
                    assert ("rope_f32" in launched) and any("_rope_" in name for name in launched) == fused, launched
                results[fused] = outs + [np.frombuffer(bytes(a.data), np.float16).copy() for a in gpu.export_cache(cache, len(xs))]
        finally:
            gpu.fuse_ropes = True
    for a, b in zip(results[True], results[False]):
        assert not np.isnan(a).any()
        np.testing.assert_array_equal(a, b)


def test_add_swiglu_take_rows(gpu):
    a, b = (rng.standard_normal((7, 333)).astype(np.float32) * 20 for _ in range(2))
    gpu.poison()
    da, db = gpu.from_host(a), gpu.from_host(b)
    np.testing.assert_array_equal(gpu.to_host(gpu.add(da, db)), cpu.add(a, b))
    np.testing.assert_allclose(gpu.to_host(gpu.swiglu(da, db)), cpu.swiglu(a, b), rtol=1e-6, atol=1e-6)
    rows = [6, 0, 3, 3]
    np.testing.assert_array_equal(gpu.to_host(gpu.take_rows(da, rows)), cpu.take_rows(a, rows))


def f16_rounded(x):
    return x.astype(np.float16).astype(np.float32)


def attention_tolerance(n_tok, d):
    """K and V are f16 in the CUDA cache, so the reference gets the same rounded values. The
    tensor-core prefill kernel (PREFILL_ATTENTION_MIN_TOKENS tokens or more, PREFILL_ATTENTION_WIDTHS) also
    rounds the scaled q and the probabilities to f16: ~5e-4 off at most on these inputs. Elsewhere
    what remains is float32 summation order."""
    if n_tok >= PREFILL_ATTENTION_MIN_TOKENS and d in PREFILL_ATTENTION_WIDTHS:
        return dict(rtol=2e-3, atol=2e-3)
    return dict(rtol=1e-4, atol=2e-5)


def random_qkv(n, n_heads, n_kv, d):
    """n tokens' q, k and v rows (k and v f16-exact, as the CUDA cache holds them)."""
    q, k, v = (rng.standard_normal((n, w)).astype(np.float32) for w in (n_heads * d, n_kv * d, n_kv * d))
    return q, f16_rounded(k), f16_rounded(v)


def attention_matches_the_cpus(gpu, n_heads, n_kv, d, capacity, steps, qkv=None):
    """Each (a, b, batch) of steps, in order into one cache of each backend: q, k and v rows a..b-1 (qkv,
    else random_qkv's), GPU attention against the CPU's. The GPU's outputs, in order."""
    shape = CacheShape(1, capacity, n_kv * d, n_kv * d)
    c_cpu, c_gpu = cpu.new_kv_cache(shape), gpu.new_kv_cache(shape)
    q, k, v = qkv or random_qkv(steps[-1][1], n_heads, n_kv, d)
    kw = dict(layer=0, n_heads=n_heads, n_kv_heads=n_kv, scale=d**-0.5)
    outs = []
    for a, b, batch in steps:
        ref = cpu.attention(q[a:b], k[a:b], v[a:b], cache=c_cpu, batch=batch, **kw)
        gpu.poison()
        dq, dk, dv = (gpu.from_host(np.ascontiguousarray(m[a:b])) for m in (q, k, v))
        outs.append(gpu.to_host(gpu.attention(dq, dk, dv, cache=c_gpu, batch=batch, **kw)))
        np.testing.assert_allclose(outs[-1], ref, **attention_tolerance(b - a, d), err_msg=f"slots {a}..{b - 1}")
    return outs


@pytest.mark.parametrize("n_heads,n_kv,d", [(4, 2, 64), (2, 1, 128), (16, 8, 128), (9, 3, 64), (4, 4, 96), (8, 2, 256)])
@pytest.mark.parametrize("segments", ["causal", "system1"])
# below the prefill kernel's threshold; ragged tiles of 64 queries; 200 tokens after 100 cached; the
# longest batch the activation buffers take
@pytest.mark.parametrize("chunks", [(37,), (65,), (150,), (100, 200), (512,)], ids=lambda c: "+".join(map(str, c)))
def test_attention_prefill_then_decode(gpu, n_heads, n_kv, d, segments, chunks):
    """A prompt in chunks, each into the slots after the last, then decode steps into the same
    cache. system1: the last third of the prompt is candidates, 7 tokens to a segment."""
    t = sum(chunks)
    n_prompt = 2 * t // 3
    seg = [0] * t if segments == "causal" else [0] * n_prompt + [1 + (i // 7) for i in range(t - n_prompt)]
    ends = np.cumsum((0,) + chunks).tolist()
    steps = [(a, b, Batch(range(b - a), range(a, b), seg[a:b], a)) for a, b in zip(ends, ends[1:])]
    steps += [(i, i + 1, Batch.causal([0], i)) for i in range(t, t + 3)]
    attention_matches_the_cpus(gpu, n_heads, n_kv, d, t + 3, steps)


@pytest.mark.parametrize("n_heads,n_kv,d", [(4, 2, 128), (6, 2, 64), (2, 1, 96), (4, 2, 256)])
def test_attention_at_a_long_context_over_many_splits(gpu, n_heads, n_kv, d):
    """Decode and short batches where the cache's slots are split over 64 blocks a (query, head)
    (kernels/attention.cu; a decode step's grid that of its bucket of slots) and the last split to finish
    merges their partials: a 4,000-token prompt, then two candidates in their own segments (each sees the
    prompt and itself), then decode steps of 1 and 8 tokens at start > 0."""
    steps = [(a, a + 500, Batch.causal(range(500), a)) for a in range(0, 4000, 500)]
    steps += [(4000, 4020, Batch(range(20), range(4000, 4020), [1] * 10 + [2] * 10, 4000))]
    steps += [(4020, 4021, Batch.causal([0], 4020)), (4021, 4029, Batch.causal(range(8), 4021)),
              (4029, 4030, Batch.causal([0], 4029))]
    attention_matches_the_cpus(gpu, n_heads, n_kv, d, 4096, steps)


@pytest.mark.parametrize("n_heads,n_kv,d", [(8, 8, 128), (32, 8, 128), (16, 2, 64), (14, 2, 128), (6, 2, 64)])
def test_a_decode_step_at_a_long_context_takes_a_kv_heads_group_of_query_heads_a_block(gpu, monkeypatch, n_heads, n_kv, d):
    """Past 8 splits a decode step of 64- or 128-wide heads runs a block a KV head's group of query heads (4 to 8
    of them, here 1 to 8; kernels/attention.cu attention_group, on tensor cores) over a split of 128 slots, and the
    last split of a group merges the group's heads: against the CPU at float32's tolerance, where the splits'
    chunks of 16 slots end mid-chunk, and where the decode token is in segment 0 and the slots before it hold
    candidates of segment 1 (hidden from it), then a candidate's decode step that sees them."""
    monkeypatch.setattr("reflex_engine.backends.cuda.ops.ATTENTION_GROUP_MIN", 1)
    steps = [(a, a + 500, Batch.causal(range(500), a)) for a in range(0, 1500, 500)]
    steps += [(1500, 1537, Batch(range(37), range(1500, 1537), [1] * 37, 1500))]
    steps += [(s, s + 1, Batch.causal([0], s)) for s in range(1537, 1540)]
    steps += [(1540, 1541, Batch([0], [1537], [1], 1540)), (1541, 1542, Batch.causal([0], 1541))]
    launched = []
    launch = gpu.device.launch

    def counted(name, grid, *a):
        if name.startswith("attention"):
            launched.append((name, grid))
        return launch(name, grid, *a)

    monkeypatch.setattr(gpu.device, "launch", counted)
    attention_matches_the_cpus(gpu, n_heads, n_kv, d, 2048, steps)
    assert launched[-5:] == [("attention_group", (1, n_kv, 16))] * 5  # the bucket's 2,048 slots, 128 a split


def test_decode_attention_at_the_first_slots_of_a_large_cache(gpu):
    """A decode step's grid splits its bucket of slots (8 blocks a (query, head) for the first 256, of a
    4,096-slot cache) wherever it stands in it: past a short prompt all but the first splits are empty,
    and their merge skips them, until a second split of 32 slots fills."""
    steps = [(0, 20, Batch.causal(range(20), 0))] + [(s, s + 1, Batch.causal([0], s)) for s in range(20, 40)]
    attention_matches_the_cpus(gpu, 8, 2, 128, 4096, steps)


@pytest.mark.parametrize("n_heads,n_kv,d", [(16, 8, 128), (4, 2, 64), (2, 1, 96), (4, 2, 256)])
def test_splits_merged_in_a_cluster_give_the_bits_of_the_merge_through_memory(gpu, monkeypatch, n_heads, n_kv, d):
    """On sm_90, up to 8 splits of a (query, head) run as one cluster (kernels/attention.cu attention_cluster)
    whose first block merges the partials gathered in its shared memory, in the splits' order, as the last
    split of `attention` does from global memory: the same bits. Decode steps past a short prompt (splits past
    the query's slot empty), a short batch in two segments, and decode steps of 512- and 1,024-slot buckets
    (the long batches between them split too where the prefill kernel does not take their width)."""
    if not gpu._sm90:
        pytest.skip("clusters need sm_90 or later")
    steps = [(0, 20, Batch.causal(range(20), 0))] + [(s, s + 1, Batch.causal([0], s)) for s in range(20, 23)]
    steps += [(23, 40, Batch(range(17), range(23, 40), [0] * 9 + [1] * 8, 23)), (40, 300, Batch.causal(range(260), 40))]
    steps += [(300, 301, Batch.causal([0], 300)), (301, 600, Batch.causal(range(299), 301)), (600, 601, Batch.causal([0], 600))]
    qkv = random_qkv(601, n_heads, n_kv, d)
    launched = []  # each step's attention launch: (kernel, its splits)
    launch = gpu.device.launch

    def counted(name, grid, *a):
        if name.startswith("attention"):
            launched.append((name, grid[2] if len(grid) == 3 else 1))
        return launch(name, grid, *a)

    monkeypatch.setattr(gpu.device, "launch", counted)
    in_clusters = attention_matches_the_cpus(gpu, n_heads, n_kv, d, 1024, steps, qkv)
    cluster_splits = [n for _, n in launched]
    assert [k for k, _ in launched].count("attention_cluster") == (6 if d in PREFILL_ATTENTION_WIDTHS else 8)
    monkeypatch.setattr("reflex_engine.backends.cuda.ops.ATTENTION_CLUSTER_SPLITS", 1)
    launched.clear()
    through_memory = attention_matches_the_cpus(gpu, n_heads, n_kv, d, 1024, steps, qkv)
    assert "attention_cluster" not in [k for k, _ in launched]

    def cut(step, n_splits):
        a, b, batch = step
        return max(ATTENTION_SPLIT_SLOTS, -(-(batch.start + b - a) // n_splits))

    same_cut = [cut(st, a) == cut(st, b) for st, a, b in zip(steps, cluster_splits, [n for _, n in launched])]
    assert all(same_cut)
    for a, b in zip(in_clusters, through_memory):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("vocab", [1000, 151936])
def test_greedy_with_penalties_and_token_logprobs(gpu, vocab):
    logits = rng.standard_normal((3, vocab)).astype(np.float32) * 4
    logits[2, 17] = logits[2, 900] = logits[2].max() + 1  # a tie: the lower id wins
    history = [int(i) for i in rng.integers(0, vocab, 40)] + [17]
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=0, repeat_penalty=1.3, presence_penalty=0.5)):
        want = cpu.new_sampler(params)(logits, history)
        assert gpu.new_sampler(params)(host(gpu, logits), history) == want
    pairs = [(0, 5), (2, 17), (1, vocab - 1), (0, 5)]
    got = gpu.token_logprobs(host(gpu, logits), pairs)
    np.testing.assert_allclose(got, cpu.token_logprobs(logits, pairs), rtol=1e-9, atol=1e-6)


@pytest.mark.parametrize("params", [dict(top_k=40, top_p=0.95, min_p=0.05), dict(top_k=1), dict(top_k=256, top_p=1.0, min_p=0.0),
                                    dict(top_k=0, top_p=0.9, min_p=0.0), dict(top_k=0, top_p=1.0, min_p=0.0),
                                    dict(top_k=7, top_p=0.5, min_p=0.2, temperature=0.3)])
def test_sampling_distribution_matches_the_cpu_sampler(gpu, params):
    from reflex_engine.backends.cpu.sampler import Sampler

    p = SamplingParams(**{"temperature": 0.8, **params})
    logits = (rng.standard_normal((1, 5000)) * 3).astype(np.float32)
    logits[0, 10:20] = logits[0].max()  # ties at the top
    ids, probs = gpu.new_sampler(p).distribution(host(gpu, logits).row(0), 5000)
    want_ids, want_probs = Sampler(p).distribution(logits[0], [])
    assert ids == want_ids.tolist()
    np.testing.assert_allclose(probs, want_probs, rtol=1e-5, atol=1e-9)


def test_top_k_kernel_against_stable_argsort(gpu):
    from reflex_engine.backends.cuda.sampler import CudaSampler

    for n, k in ((256, 256), (1000, 1), (151936, 256), (70000, 40)):
        x = rng.standard_normal((1, n)).astype(np.float32)
        x[0, rng.integers(0, n, 50)] = x.max()  # many ties at the top
        ids, probs = CudaSampler(gpu, SamplingParams(temperature=1.0, top_k=k, top_p=1.0, min_p=0.0)).distribution(host(gpu, x).row(0), n)
        assert ids == np.argsort(-x[0], kind="stable")[:k].tolist()


@pytest.mark.parametrize("qtype,scale_at", [("IQ4_NL", 0), ("TQ2_0", 64), ("IQ4_XS", 0)])
def test_types_without_kernels_become_f16_at_load(gpu, qtype, scale_at):
    """No kernel reads these blocks: the weight is dequantized once at load and stored as F16."""
    block, size = GGML_BLOCK[GGMLType[qtype]]
    blocks = rng.integers(0, 256, (70 * 512 // block, size), dtype=np.uint8)
    blocks[:, scale_at : scale_at + 2] = rng.uniform(0.001, 0.01, len(blocks)).astype("<f2").view(np.uint8).reshape(-1, 2)
    t, shape = GGMLType[qtype], (512, 70)
    w_cpu, w_gpu = cpu.load_weight("w", t, shape, blocks.tobytes()), loaded(gpu, "w", t, shape, blocks.tobytes())
    assert w_gpu.ggml_type == GGMLType.F16
    x = rng.standard_normal((2, 512)).astype(np.float32)
    # the only difference from the reference is the f16 rounding of each weight
    ref = x.astype(np.float64) @ w_cpu.astype(np.float16).astype(np.float64).T
    assert rel_err(gpu.to_host(gpu.matmul(host(gpu, x), w_gpu)), ref) < 1e-5


def test_norm_weights_stored_as_f16_are_widened_to_f32(gpu):
    x = rng.standard_normal((3, 256)).astype(np.float32)
    w = rng.standard_normal(256).astype(np.float16)
    w_gpu = loaded(gpu, "n", GGMLType.F16, (256,), w.tobytes())
    np.testing.assert_allclose(gpu.to_host(gpu.rms_norm(host(gpu, x), w_gpu, 1e-5)), cpu.rms_norm(x, w.astype(np.float32), 1e-5),
                               rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("vocab", [384, 151936])
def test_top_logprobs_match_the_cpu(gpu, vocab):
    """top_k's ids and logits with row_logsumexp's normalizer: the likeliest tokens in the numpy
    backend's order (ties by lower id) and their float64 log-probabilities."""
    logits = rng.standard_normal((2, vocab)).astype(np.float32) * 4
    logits[1, [3, 200, 301]] = logits[1].max() + 2  # a three-way tie at the top
    for row, k in ((0, 1), (1, 2), (1, 20), (0, 256)):
        got = gpu.top_logprobs(host(gpu, logits), row, k)
        want = cpu.top_logprobs(logits, row, k)
        assert [t for t, _ in got] == [t for t, _ in want]
        np.testing.assert_allclose([lp for _, lp in got], [lp for _, lp in want], rtol=1e-9, atol=1e-6)
