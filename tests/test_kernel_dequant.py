"""kernels/quant_blocks.cuh's chunk dequantization, compiled for the host by nvcc, against
reflex_engine.quants.dequantize, bit for bit, for every type with CUDA kernels; and its Q4_K/Q5_K
scale picker (K4Scales, which the tensor-core matvecs and GEMMs read) against gguf-py's.

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
