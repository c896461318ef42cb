"""kernels/quant_blocks.cuh's chunk dequantization, compiled for the host by nvcc, against
reflex_engine.quants.dequantize, bit for bit, for every type with CUDA kernels; its Q4_K/Q5_K
scale picker (K4Scales, which the tensor-core matvecs and GEMMs read) against gguf-py's; and the
int16 matvecs' weight units (x16.cuh x16_type, x16_unit::dot) against gguf-py's dequantization
times x's int16 blocks.

matvec, gemm and get_rows all dequantize through these chunk functions; on the device the same
code runs with rounded intrinsics in place of * + -, so this checks their dequantization half.
"""
import os
import shutil
import subprocess

import numpy as np
import pytest

from reflex_engine.gguf.constants import GGML_BLOCK, GGMLType as T
from reflex_engine.quants import dequantize

KERNELS = os.path.join(os.path.dirname(__file__), "..", "src", "reflex_engine", "kernels")
SCALARS = (T.F32, T.F16, T.BF16)
QUANTIZED = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
N_ROWS = 6
# Row lengths: scalar rows need not fill a chunk; 40 f16 elements make 16-byte aligned rows
WIDTHS = {T.F32: (5, 32, 33, 100, 264), T.F16: (1, 31, 40, 100, 264), T.BF16: (7, 32, 40, 264)}
BLOCK_COUNTS = (1, 3, 8)

# Byte offsets of each block's f16 scale fields, set to finite values for the finite cases.
F16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
}  # fmt: skip

# usage: dequant TYPE N_COLS IN OUT; IN holds whole rows of N_COLS elements, OUT gets each row's
# chunks as float32, tail included (32 per chunk)
PROGRAM = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include "quant_blocks.cuh"

template <class B>
static void dequant_rows(const std::vector<uint8_t>& in, int n, FILE* out) {
    const size_t stride = row_bytes<B>(n);
    std::vector<float> v(32 * ((n + 31) / 32));
    for (size_t start = 0; start < in.size(); start += stride) {
        for (int c = 0; 32 * c < n; ++c) B::chunk(in.data() + start, c, n, &v[32 * c]);
        fwrite(v.data(), sizeof(float), v.size(), out);
    }
}

int main(int argc, char** argv) {
    if (argc != 5) return 2;
    FILE* in = fopen(argv[3], "rb");
    std::vector<uint8_t> data;
    for (int b; (b = fgetc(in)) != EOF;) data.push_back((uint8_t)b);
    fclose(in);
    FILE* out = fopen(argv[4], "wb");
#define DEQUANT(name, B) if (!strcmp(argv[1], #name)) dequant_rows<B>(data, atoi(argv[2]), out); else
    KERNEL_TYPES(DEQUANT) return 3;
    return fclose(out);
}
"""


# usage: k4scales IN OUT; IN holds 16-byte block heads (d, dmin, the 12 scale bytes), OUT gets for each and each
# j = 0..3 the 4 bytes K4Scales(j) gives: scale 2j, scale 2j + 1, min 2j, min 2j + 1
K4_PROGRAM = r"""
#include <cstdio>
#include "quant_blocks.cuh"

int main(int argc, char** argv) {
    if (argc != 3) return 2;
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    uint8_t head[16];
    while (fread(head, 1, 16, in) == 16) {
        uint32_t hd[4];
        load_words<16>(head, hd);
        for (int j = 0; j < 4; ++j) {
            const uint32_t b = K4Scales(j).bytes(hd);
            fwrite(&b, 4, 1, out);
        }
    }
    fclose(in);
    return fclose(out);
}
"""


# usage: x16units TYPE N_COLS ROWS XQ XDS OUT; ROWS holds whole rows of N_COLS elements, XQ one row of x as int16
# quants, XDS its blocks' (d, d·Σq); OUT gets for each row and unit u (x16_type's): its runs k0, k1 (int32) and the
# unit's dot product (float32)
X16_PROGRAM = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include "x16.cuh"

static std::vector<uint8_t> slurp(const char* path) {
    std::vector<uint8_t> data;
    FILE* f = fopen(path, "rb");
    for (int b; (b = fgetc(f)) != EOF;) data.push_back((uint8_t)b);
    fclose(f);
    return data;
}

template <class B>
static void unit_dots(const std::vector<uint8_t>& rows, int n, const std::vector<uint8_t>& xq,
                      const std::vector<uint8_t>& xds, FILE* out) {
    using T = x16_type<B>;
    const float2* ds = reinterpret_cast<const float2*>(xds.data());
    for (size_t start = 0; start < rows.size(); start += row_bytes<B>(n))
        for (int u = 0; u < n / 32; ++u) {
            x16_unit w;
            T::load(rows.data() + start, u, w);
            int k[2];
            T::runs(u, k[0], k[1]);
            uint32_t xa[8], xb[8];
            x_words(xq.data() + 2 * k[0], xa);
            x_words(xq.data() + 2 * k[1], xb);
            const float dot = w.template dot<T::has_min>(xa, xb, ds[k[0] / 32], ds[k[1] / 32]);
            fwrite(k, sizeof(int), 2, out);
            fwrite(&dot, sizeof(float), 1, out);
        }
}

int main(int argc, char** argv) {
    if (argc != 7) return 2;
    const std::vector<uint8_t> rows = slurp(argv[3]), xq = slurp(argv[4]), xds = slurp(argv[5]);
    FILE* out = fopen(argv[6], "wb");
    const int n = atoi(argv[2]);
#define UNITS(name, B) if (!strcmp(argv[1], #name)) unit_dots<B>(rows, n, xq, xds, out); else
    UNITS(q8_0, block_q8_0) UNITS(q4_0, block_q4_0) UNITS(q5_0, block_q5_0) UNITS(q4_K, block_q4_K)
    UNITS(q5_K, block_q5_K) UNITS(q6_K, block_q6_K) return 3;
    return fclose(out);
}
"""


def find_nvcc() -> str | None:
    homes = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")]
    found = [shutil.which("nvcc")] + [os.path.join(h, "bin", "nvcc") for h in homes if h]
    return next((p for p in found if p and os.path.isfile(p)), None)


def host_program(tmp_path_factory, name: str, source: str) -> str:
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found on PATH, CUDA_HOME/bin or CUDA_PATH/bin")
    tmp = tmp_path_factory.mktemp(name)
    (tmp / f"{name}.cu").write_text(source)
    exe = str(tmp / name)
    # no FMA contraction on the host either: numpy rounds every product and sum
    cmd = [nvcc, "-std=c++17", "-O2", "-Xcompiler", "-ffp-contract=off", "-I", KERNELS, str(tmp / f"{name}.cu"),
           "-o", exe]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return exe


@pytest.fixture(scope="session")
def dequant_program(tmp_path_factory) -> str:
    return host_program(tmp_path_factory, "dequant", PROGRAM)


def kernel_suffix(ggml_type: T) -> str:
    return ggml_type.name.lower().replace("_k", "_K")


def log_uniform(rng, n, lo, hi, dtype):
    """n values of both signs with magnitudes spread over 10^lo .. 10^hi, as `dtype`."""
    return (rng.standard_normal(n) * 10.0 ** rng.uniform(lo, hi, n)).astype(dtype)


def random_rows(rng, ggml_type: T, n_cols: int, finite: bool) -> np.ndarray:
    """N_ROWS rows of random blocks; `finite`: scales (or scalar values) finite, else any bytes."""
    block, size = GGML_BLOCK[ggml_type]
    n_blocks = N_ROWS * n_cols // block
    if finite and ggml_type == T.F32:  # down into the denormals
        return log_uniform(rng, n_blocks, -44, 30, "<f4").view(np.uint8)
    if finite and ggml_type == T.F16:
        return log_uniform(rng, n_blocks, -7, 4, "<f2").view(np.uint8)
    if finite and ggml_type == T.BF16:
        return (log_uniform(rng, n_blocks, -40, 30, "<f4").view("<u4") >> 16).astype("<u2").view(np.uint8)
    blocks = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    if finite:  # f16 scales from f16 denormals (~1e-7) to ~10
        for offset in F16_FIELDS[ggml_type]:
            blocks[:, offset : offset + 2] = log_uniform(rng, n_blocks, -7, 1, "<f2").view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def dequant_on_host(program: str, ggml_type: T, n_cols: int, data: np.ndarray, tmp_path) -> np.ndarray:
    src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
    data.tofile(src)
    subprocess.run([program, kernel_suffix(ggml_type), str(n_cols), str(src), str(dst)], check=True)
    return np.fromfile(dst, np.float32).reshape(N_ROWS, -1)


def assert_same_bits(got: np.ndarray, want: np.ndarray):
    """Identical float32 bit patterns, except that NaN matches NaN of any payload."""
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


@pytest.mark.parametrize("finite", [True, False], ids=["finite_scales", "random_bytes"])
@pytest.mark.parametrize("ggml_type", SCALARS + QUANTIZED, ids=lambda t: t.name)
def test_chunks_match_numpy(dequant_program, ggml_type, finite, tmp_path):
    rng = np.random.default_rng(2000 + 2 * ggml_type + finite)  # fixed seed per case
    block = GGML_BLOCK[ggml_type][0]
    widths = WIDTHS.get(ggml_type) or tuple(block * n for n in BLOCK_COUNTS)
    for n_cols in widths:
        data = random_rows(rng, ggml_type, n_cols, finite)
        want = dequantize(data, ggml_type, (N_ROWS, n_cols))
        if finite:
            assert np.isfinite(want).all()
        got = dequant_on_host(dequant_program, ggml_type, n_cols, data, tmp_path)
        assert_same_bits(got[:, :n_cols], want)
        assert not got[:, n_cols:].view(np.uint32).any()  # a scalar row's last chunk ends in +0.0


def test_k4_scales_are_gguf_pys_scales_and_mins(tmp_path_factory, tmp_path):
    """Every sub-block pair's 6-bit scales and mins, as the tensor-core Q4_K matvecs and the Q4_K/Q5_K GEMMs pick them
    from a block's first 16 bytes, are gguf-py's (Q4_K.get_scale_min), over random scale bytes and the extremes."""
    from gguf.quants import Q4_K

    program = host_program(tmp_path_factory, "k4scales", K4_PROGRAM)
    rng = np.random.default_rng(44)
    heads = rng.integers(0, 256, (4096, 16), dtype=np.uint8)
    heads[:256, 4:] = 0xFF
    heads[256:512, 4:] = 0x00
    heads[512:768, 4:] = rng.choice(np.array([0x00, 0x3F, 0x40, 0xC0, 0xF0, 0x0F, 0xFF], np.uint8), (256, 12))
    src, dst = tmp_path / "heads.bin", tmp_path / "scales.bin"
    heads.tofile(src)
    subprocess.run([program, str(src), str(dst)], check=True)
    got = np.fromfile(dst, np.uint8).reshape(len(heads), 4, 4)  # block, j, (sc 2j, sc 2j+1, m 2j, m 2j+1)
    sc, mn = Q4_K.get_scale_min(heads[:, 4:].copy())
    np.testing.assert_array_equal(got[:, :, 0:2].reshape(len(heads), 8), sc)
    np.testing.assert_array_equal(got[:, :, 2:4].reshape(len(heads), 8), mn)
    assert sc.max() == 63 and mn.max() == 63 and len(np.unique(sc)) == 64  # every bit of both reached


X16_TYPES = (T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_K, T.Q5_K, T.Q6_K)


def x16_unit_dots(program: str, ggml_type: T, rows, xq, xds, n_cols: int, tmp_path):
    paths = [tmp_path / name for name in ("rows.bin", "xq.bin", "xds.bin", "out.bin")]
    for array, path in zip((rows, xq, xds), paths):
        array.tofile(path)
    subprocess.run([program, kernel_suffix(ggml_type), str(n_cols)] + [str(p) for p in paths], check=True)
    return np.fromfile(paths[3], np.dtype([("k", "<i4", 2), ("dot", "<f4")])).reshape(N_ROWS, n_cols // 32)


@pytest.fixture(scope="module")
def x16_program(tmp_path_factory) -> str:
    return host_program(tmp_path_factory, "x16units", X16_PROGRAM)


def random_x16(rng, n_cols: int):
    """x as int16 blocks: random quants with the extremes, random positive scales, (d, d·Σq) as store_x16 writes them."""
    xq = rng.integers(-32767, 32768, n_cols, dtype=np.int16)
    xq[:64] = rng.choice(np.array([-32767, 32767, 0, -1, 1], np.int16), 64)
    d = np.abs(log_uniform(rng, n_cols // 32, -6, 1, "<f4"))
    xds = np.stack([d, d * xq.reshape(-1, 32).sum(1).astype(np.float32)], 1).astype("<f4")
    return xq, xds


@pytest.mark.parametrize("ggml_type", X16_TYPES, ids=lambda t: t.name)
def test_x16_units_are_gguf_pys_weights_times_x(x16_program, tmp_path, ggml_type):
    """Each 32-weight unit a thread of the int16 matvecs loads (matvec_x16.cu), times x's int16 blocks as
    x16_unit::dot sums it, is gguf-py's dequantized weights times x_deq over the unit's two runs, and the runs of a
    row's units cover each of its columns once. Random weight bytes with finite scales, random int16 x with the
    extremes; a quant unpacked wrong moves a pair of units by about a term (1/64 of its magnitude), where float32's
    roundings moved it by at most 9e-8 of it."""
    from gguf.quants import dequantize as gguf_dequantize

    rng = np.random.default_rng(1600 + ggml_type)
    n_cols = 1024
    rows = random_rows(rng, ggml_type, n_cols, finite=True)
    xq, xds = random_x16(rng, n_cols)
    out = x16_unit_dots(x16_program, ggml_type, rows, xq, xds, n_cols, tmp_path)

    w = gguf_dequantize(rows.reshape(N_ROWS, -1), ggml_type).astype(np.float64)  # (N_ROWS, n_cols)
    x = xq.astype(np.float64) * np.repeat(xds[:, 0].astype(np.float64), 32)
    runs = out["k"][..., None] + np.arange(16)  # (row, unit, run, 16): the unit's columns
    columns = runs.reshape(N_ROWS, n_cols // 32, 32)
    np.testing.assert_array_equal(np.sort(columns.reshape(N_ROWS, -1), axis=1), np.tile(np.arange(n_cols), (N_ROWS, 1)))
    terms = np.take_along_axis(w, columns.reshape(N_ROWS, -1), 1).reshape(columns.shape) * x[columns]
    # units 2i and 2i + 1 cover the same x blocks: a K type's unit subtracts half its min times x's block sum, not
    # its own half's, so only the pair's sum is the weights' dot product
    pairs = terms.reshape(N_ROWS, n_cols // 64, 64)
    want, size = pairs.sum(-1), np.abs(pairs).sum(-1)
    got = out["dot"].astype(np.float64).reshape(N_ROWS, -1, 2).sum(-1)
    assert (np.abs(got - want) <= 1e-6 * size).all()
