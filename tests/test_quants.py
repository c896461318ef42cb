"""Every QUANTS entry against gguf-py's dequantize, bit for bit.

gguf-py 0.19.0 is byte-exact with ggml's C for the types it implements. For the few it lacks
(Q8_K, Q8_1, Q1_0, Q2_0, F64 and the integer types) an independent per-block reference below,
written from the block layout with struct, stands in.
"""
import struct

import gguf
import numpy as np
import pytest

from reflex_engine.errors import ReflexError
from reflex_engine.gguf.constants import GGML_BLOCK, GGMLType as T
from reflex_engine.quants import QUANTS, dequantize

N_BLOCKS = 256

# The types the quants module must cover (the brief's list); everything in QUANTS is tested.
REQUIRED = {
    T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_K,
    T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS,
    T.TQ1_0, T.TQ2_0, T.MXFP4, T.NVFP4,
}  # fmt: skip

# Byte offsets of each block's f16 scale fields, overwritten with finite values so that
# results are finite and comparisons exercise real arithmetic, not NaN propagation.
F16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q8_1: (0, 2),
    T.Q1_0: (0,), T.Q2_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,),
    T.IQ1_S: (0,), T.IQ4_NL: (0,), T.IQ4_XS: (0,),
    T.TQ1_0: (52,), T.TQ2_0: (64,),
}  # fmt: skip


def log_uniform(rng, n, lo, hi, dtype):
    """n values of both signs with magnitudes spread over 10^lo .. 10^hi, as `dtype`."""
    return (rng.standard_normal(n) * 10.0 ** rng.uniform(lo, hi, n)).astype(dtype)


def as_bytes(values: np.ndarray) -> np.ndarray:
    return values.view(np.uint8).reshape(len(values), -1)


def random_blocks(ggml_type: T) -> np.ndarray:
    rng = np.random.default_rng(1000 + ggml_type)  # fixed seed per type
    blocks = rng.integers(0, 256, (N_BLOCKS, GGML_BLOCK[ggml_type][1]), dtype=np.uint8)
    # f16 scales span f16 denormals (~1e-7) to ~10
    for offset in F16_FIELDS.get(ggml_type, ()):
        blocks[:, offset : offset + 2] = as_bytes(log_uniform(rng, N_BLOCKS, -7, 1, "<f2"))
    if ggml_type == T.IQ1_M:  # the f16 super-scale is the top nibbles of the 4 scale words
        words = blocks[:, 48:56].view("<u2")
        d = log_uniform(rng, N_BLOCKS, -7, 1, "<f2").view(np.uint16)[:, None]
        words[:] = (words & 0x0FFF) | ((d >> np.array([0, 4, 8, 12], np.uint16)) & 15) << 12
    elif ggml_type == T.Q8_K:  # d: f32
        blocks[:, :4] = as_bytes(log_uniform(rng, N_BLOCKS, -40, 3, "<f4"))
    elif ggml_type == T.MXFP4:  # E8M0 up to 250 keeps 12·2^(e-128) finite; 0 and 1 give denormals
        blocks[:, 0] = rng.integers(0, 251, N_BLOCKS)
    elif ggml_type == T.F64:  # into float32's denormals, short of its overflow
        blocks[:] = as_bytes(log_uniform(rng, N_BLOCKS, -45, 30, "<f8"))
    elif ggml_type == T.I64:  # within 2^53 the reference's int -> float -> float32 rounds once
        blocks[:] = as_bytes(rng.integers(-(2**53), 2**53, N_BLOCKS, dtype=np.int64).astype("<i8"))
    return blocks


# ---- independent references for the types gguf-py 0.19.0 does not dequantize -----------------
# Each works block by block from the layout with struct, in float32 as ggml's C does.


def _per_block(fmt: str, values):
    """A reference that unpacks each block with struct `fmt`, maps it through `values`, flattens."""

    def reference(blocks: np.ndarray) -> np.ndarray:
        out = [values(*struct.unpack(fmt, bytes(b))) for b in blocks]
        return np.array([v for block in out for v in block], dtype=np.float32)

    return reference


def _q8(d, *qs):  # Q8_K (d: f32) and Q8_1 (d: f16): x = d·q in float32
    return [np.float32(d) * np.float32(q) for q in qs]


def _q1_0(d, *qs):  # bit j of the 16 bytes, LSB first: +d or -d
    return [np.float32(d) if (qs[j // 8] >> (j % 8)) & 1 else -np.float32(d) for j in range(128)]


def _q2_0(d, *qs):  # 2-bit field j at bits 2·(j%4) of byte j/4: (q - 1)·d
    return [np.float32(((qs[j // 4] >> 2 * (j % 4)) & 3) - 1) * np.float32(d) for j in range(64)]


def _scalar(x):
    return [np.float32(x)]


LOCAL_REFERENCES = {
    # Q8_K: d f32, qs int8[256], bsums i16[16] (bsums ignored: they only serve dot products)
    T.Q8_K: _per_block("<f256b32x", _q8),
    T.Q8_1: _per_block("<e2x32b", _q8),  # d f16, s f16 (ignored), qs int8[32]
    T.Q1_0: _per_block("<e16B", _q1_0),
    T.Q2_0: _per_block("<e16B", _q2_0),
    T.F64: _per_block("<d", _scalar),
    T.I8: _per_block("<b", _scalar),
    T.I16: _per_block("<h", _scalar),
    T.I32: _per_block("<i", _scalar),
    T.I64: _per_block("<q", _scalar),
}


def reference(ggml_type: T, blocks: np.ndarray) -> np.ndarray:
    if ggml_type in LOCAL_REFERENCES:
        return LOCAL_REFERENCES[ggml_type](blocks)
    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[ggml_type.name])


def assert_same_bits(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ref.dtype == np.float32, (ours.dtype, ref.dtype)
    a, b = ours.reshape(-1).view(np.uint32), ref.reshape(-1).view(np.uint32)
    assert a.shape == b.shape, (a.shape, b.shape)
    bad = np.flatnonzero(a != b)
    if bad.size:
        i = bad[0]
        raise AssertionError(f"{bad.size} of {a.size} differ; first at {i}: {a[i]:#010x} != {b[i]:#010x}")


def _name(ggml_type):
    return ggml_type.name


# ---- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type", sorted(QUANTS), ids=_name)
def test_bit_identical_to_reference(ggml_type):
    blocks = random_blocks(ggml_type)
    ours = dequantize(blocks, ggml_type)
    assert ours.shape == (N_BLOCKS * GGML_BLOCK[ggml_type][0],)
    assert_same_bits(ours, reference(ggml_type, blocks))


@pytest.mark.parametrize("ggml_type", sorted(set(QUANTS) - set(LOCAL_REFERENCES)), ids=_name)
def test_raw_random_bytes_match_gguf_py(ggml_type):
    """Unpatched scales too: inf/NaN scales and overflow propagate exactly as in gguf-py."""
    rng = np.random.default_rng(2000 + ggml_type)
    blocks = rng.integers(0, 256, (64, GGML_BLOCK[ggml_type][1]), dtype=np.uint8)
    with np.errstate(all="ignore"):
        expected = reference(ggml_type, blocks)
    assert_same_bits(dequantize(blocks, ggml_type), expected)


# rounding to float32 can absorb a change in a low byte of these
ROUNDED = {T.F64, T.I32, T.I64}


@pytest.mark.parametrize("ggml_type", sorted(set(QUANTS) - ROUNDED), ids=_name)
def test_every_byte_is_read(ggml_type):
    """Flipping any byte offset changes the output: no field skipped or misplaced. Flipped in
    16 blocks at once, since in one block a zero sub-scale can hide its values."""
    ignored = {T.Q8_K: range(260, 292), T.Q8_1: range(2, 4)}.get(ggml_type, ())  # bsums, s
    blocks = random_blocks(ggml_type)[:16]
    clean = dequantize(blocks, ggml_type).view(np.uint32)
    for offset in sorted(set(range(blocks.shape[1])) - set(ignored)):
        poisoned = blocks.copy()
        poisoned[:, offset] ^= 0xFF
        assert (dequantize(poisoned, ggml_type).view(np.uint32) != clean).any(), f"byte {offset} unused"


def test_poisoned_input_fails_the_comparison():
    blocks = random_blocks(T.Q4_K)
    poisoned = blocks.copy()
    poisoned[7, 100] ^= 0x01  # one bit of one nibble
    with pytest.raises(AssertionError, match="1 of 65536 differ"):
        assert_same_bits(dequantize(poisoned, T.Q4_K), reference(T.Q4_K, blocks))


def test_registry_covers_every_ggml_type():
    assert REQUIRED <= set(QUANTS)
    assert set(QUANTS) == set(T)
    for ggml_type, quant in QUANTS.items():
        assert quant.ggml_type == ggml_type
        assert (quant.block_size, quant.type_size) == GGML_BLOCK[ggml_type]


def test_local_references_only_where_gguf_py_lacks_the_type():
    for ggml_type in LOCAL_REFERENCES:
        qtype = getattr(gguf.GGMLQuantizationType, ggml_type.name, None)
        if qtype is not None:
            with pytest.raises(NotImplementedError):
                gguf.quants.dequantize(np.zeros(GGML_BLOCK[ggml_type][1], np.uint8), qtype)


def _f16_bits_reference(h: int) -> int:
    """IEEE half -> float32 bits: NaN and inf keep sign and payload; the rest converts exactly."""
    if h & 0x7C00 == 0x7C00:
        return (h & 0x8000) << 16 | 0x7F800000 | (h & 0x3FF) << 13
    return int(np.float32(struct.unpack("<e", h.to_bytes(2, "little"))[0]).view(np.uint32))


def test_f16_every_bit_pattern():
    halves = np.arange(1 << 16, dtype=np.uint16)
    ours = dequantize(halves.view(np.uint8), T.F16)
    assert_same_bits(ours, gguf.quants.dequantize(halves.view(np.uint8), gguf.GGMLQuantizationType.F16))
    expected = np.array([_f16_bits_reference(h) for h in range(1 << 16)], np.uint32)
    assert_same_bits(ours, expected.view(np.float32))
    assert ours[0x0001] == 2.0**-24 and ours[0x7C00] == np.inf and np.isnan(ours[0x7E00])


def test_bf16_every_bit_pattern():
    halves = np.arange(1 << 16, dtype=np.uint16)
    ours = dequantize(halves.tobytes(), T.BF16)
    assert_same_bits(ours, gguf.quants.dequantize(halves.view(np.uint8), gguf.GGMLQuantizationType.BF16))
    assert_same_bits(ours, (halves.astype(np.uint32) << 16).view(np.float32))


def test_f32_special_values_pass_through():
    specials = [0, 0x80000000, 1, 0x807FFFFF, 0x00800000, 0x7F7FFFFF]  # ±0, denormals, extremes
    specials += [0x7F800000, 0xFF800000, 0x7F800001, 0x7FC00000, 0xFFFFFFFF]  # ±inf, NaNs
    bits = np.array(specials, np.uint32)
    ours = dequantize(memoryview(bits.tobytes()), T.F32, shape=(11,))
    assert_same_bits(ours, bits.view(np.float32))
    assert_same_bits(ours, gguf.quants.dequantize(bits.view(np.uint8), gguf.GGMLQuantizationType.F32))


def test_shape_and_input_kinds():
    blocks = random_blocks(T.Q4_0)[:4]
    flat = dequantize(blocks, T.Q4_0)
    assert_same_bits(dequantize(blocks.tobytes(), T.Q4_0, shape=(2, 64)), flat.reshape(2, 64))
    assert_same_bits(dequantize(memoryview(blocks.tobytes()), int(T.Q4_0)), flat)
    assert dequantize(b"", T.Q4_K).shape == (0,)


def test_chunked_matches_single_call(monkeypatch):
    import reflex_engine.quants as quants

    blocks = random_blocks(T.Q6_K)
    whole = dequantize(blocks, T.Q6_K)
    monkeypatch.setattr(quants, "CHUNK_ELEMENTS", 3 * 256)  # uneven: 256 blocks in chunks of 3
    assert_same_bits(dequantize(blocks, T.Q6_K), whole)


def test_bad_length_raises():
    with pytest.raises(ReflexError, match="Q4_K data of 143 bytes is not a whole number of 144-byte blocks"):
        dequantize(bytes(143), T.Q4_K)
    with pytest.raises(ReflexError, match="not a whole number"):
        dequantize(bytes(7), T.F32)


def test_bad_shape_raises():
    with pytest.raises(ReflexError, match="do not fill shape"):
        dequantize(bytes(18), T.Q4_0, shape=(2, 32))


def test_unsupported_type_raises():
    with pytest.raises(ReflexError, match="unsupported"):
        dequantize(bytes(18), 4)  # Q4_2, removed from ggml
