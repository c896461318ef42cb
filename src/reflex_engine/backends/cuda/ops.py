"""Ops on device buffers: every call enqueues kernels on the device's one stream and returns.

Weights stay as the GGUF stores them (quantized blocks), dequantized inside the kernels; types
without kernels of their own are dequantized to F16 once at load. Knows devices, not models.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import os
from typing import NamedTuple, Sequence

from ...errors import ReflexError
from ...gguf import GGML_BLOCK, GGMLType, tensor_nbytes
from ...ops import SAMPLED, Batch, CacheShape, Rope, RopeMode, StateArray
from .delta_net import DeltaNetOps, RecurrentState, carve_states, check_shape, chunk_scratch_bytes
from .device import Device
from .experts import ExpertOps, yarn_args
from .memory import LazyTensor, Plan, Pool, Region, Tensor, aligned, head_runs
from .upload import Copy, Upload

# types with their own kernels (kernels/quant_blocks.cuh); the rest become F16 at load
KERNEL_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0,
                GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K,
                GGMLType.Q6_K)
MATVEC_MAX_TOKENS = 8  # kernels/matvec.cu: up to 8 tokens share one pass over the weights
# kernels/matvec_x16.cu: the decode matvec of these types dots int16 x blocks with the integer quants
X16_MATVEC_TYPES = (GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)
X16_DECODE_ROWS = 4  # rows a block of one token's int16 matvec computes at a time (matvec_x16_1_<type>)
# its blocks an SM (its launch bounds); it writes a norm's share (_fuse_norm) only where its blocks fit on the SMs
# at once: each block's ticket for its group (a fence) then held the next wave back (H200, run 17: Qwen3-8B Q8_0,
# 4,096 rows in 1,024 blocks, decode 298.2 tok/s with, 303.9 without; Qwen3-0.6B Q4_K_M, 1,024 rows, 1,238.0 with,
# 1,205.0 without). Q8_0's kernel holds 8 an SM (kernels/matvec_x16.cu), and so does Q6_K's twin matvec_x16_1w_q6_K,
# taken by the Q6_K launches that fit the SMs at 8 and not at 6 (every Q6_K launch at 8 cost 0.6B Q4_K_M 4%): with
# their norms and the store's reads asked before the wait, 8B Q4_K_M decode +1.5%, 8B Q8_0 +0.7% (run 32)
X16_DECODE_BLOCKS_AN_SM = 6
X16_DECODE_BLOCKS_AN_SM_64R, X16_WAVE_TWIN_TYPES = 8, (GGMLType.Q6_K,)
X16_NORM_READER_MAX_WAVES = 2  # waves of int16 blocks a launch reading a norm's output may take (_reads_norm_cheaply)
X16_THREADS = 128  # kernels/matvec_x16.cu: the most threads its blocks have, the ones its launch bounds count
# the blocks an SM holds at once at most, on every GPU the kernels are built for (sm_75's and sm_86's 16; sm_90's 32)
RESIDENT_BLOCKS_CAP = 16
# kernels/matvec_x16_mma.cu: one token's matvec of these types on tensor cores instead, from the same
# int16 blocks to the same integer sums: 32 rows a block, a warp per 256 columns of its rows, at most 8
X16_MMA_TYPES = (GGMLType.Q4_K,)
X16_MMA_ROWS, X16_MMA_WARPS = 32, 8
# its sm_90 form (matvec_x16_bulk_<type>): the weights streamed into shared memory by bulk copies, stages of
# 32 rows x 256 · X16_MMA_WARPS columns, X16_BULK_STAGES of them a block in flight, X16_BULK_BLOCKS_AN_SM
# blocks an SM walking their groups of rows in turn; for rows of whole stages at 16-byte addresses
X16_BULK_TYPES = (GGMLType.Q4_K,)
X16_BULK_STAGES, X16_BULK_BLOCKS_AN_SM = 2, 2
X16_BULK_STAGE_COLS = 256 * X16_MMA_WARPS
X16_BULK_SHARED = X16_BULK_STAGES * (X16_MMA_ROWS * X16_MMA_WARPS * GGML_BLOCK[GGMLType.Q4_K][1] + 64)
# and its wide form (matvec_x16_bulk16_<type>): X16_BULK_WIDE_WARPS warps a block, two a superblock of its stages, a
# ring of X16_BULK_WIDE_STAGES, one block an SM, for launches of at most one group of 32 rows an SM whose rows are
# X16_BULK_WIDE_MIN_COLS wide or more. H200, Qwen3-8B Q4_K_M, its Q4_K downs (128 groups of 12,288 columns): 13.2 us
# on a decode step's path against 15.5 with 8 warps, and room beside it for the next launch's early start
# (docs/perf-notes.md runs 34 and 35)
X16_BULK_WIDE_WARPS, X16_BULK_WIDE_STAGES, X16_BULK_WIDE_MIN_COLS = 16, 3, 8192
X16_BULK_WIDE_SHARED = X16_BULK_SHARED // X16_BULK_STAGES * X16_BULK_WIDE_STAGES
# the tensor-core matvec and short-prompt GEMM (kernels/gemm_frag.cu) take rows of at least this many columns:
# narrower, their blocks (32 rows, a warp per 256 columns) are too few and short (H200, Qwen3-0.6B, mostly
# 1,024 columns: decode 978-1,012 tok/s against 1,061, prefill 16 6.5 ms against 5.1; Qwen3-8B, 4,096 and
# 12,288: decode 360 against 335, prefill 16 8.2 ms against 14.0)
MMA_MIN_COLS = 4096
# the int16 matvecs and the short-prompt GEMMs take three weights of one type in one launch (q, k, v; the
# absent ones 0), and runs of up to MAX_FUSED weights are given to them together
TILE_PATHS = ("tile", "tile_split")  # kernels/gemm_tile.cu, one block a group of rows or a cluster of GEMM_TILE_SPLITS
FUSED_WEIGHTS, FUSED_PATHS = 3, ("x16", "blocks", "frag", *TILE_PATHS)
MAX_FUSED = FUSED_WEIGHTS
# the short-prompt GEMM splits a weight's columns over blocks (each the same share) until its blocks number
# this many an SM, its residency: 32 rows x 32 tokens a block leave most SMs idle on a 16-token prompt
# otherwise (H200, Qwen3-8B Q4_K_M, 16 tokens: 14.42 ms a pass unsplit, 13.70 with 2, 14.02 with 4)
GEMM_BLOCKS_AN_SM, GEMM_MAX_SPLITS = 2, 8
# kernels/gemm_frag.cu: the short-prompt GEMM of these types without shared tiles, x as f16: 32 rows by 16
# tokens a block, a warp per 256 columns of its rows, at most GEMM_FRAG_WARPS
GEMM_FRAG_TYPES = (GGMLType.Q4_K, GGMLType.Q8_0)
GEMM_FRAG_ROWS, GEMM_FRAG_TOKENS, GEMM_FRAG_WARPS = 32, 16, 8
# kernels/gemm_tile.cu: prompts of GEMM_TILE_MIN_TOKENS or more on tensor cores straight from these types' blocks, 32
# rows a warp by 64 tokens a block, x as f16 staged in GEMM_TILE_STAGES stages of 256 columns, for rows of at least
# MMA_MIN_COLS columns (tile_fits; narrower ones up to GEMM_TILE_NARROW_MAX_TOKENS); other types, and narrower rows
# past that, keep the short-prompt GEMMs and the f16 copy (F16_GEMM_MIN_TOKENS). On sm_90+ a weight whose blocks
# number under GEMM_TILE_SPLIT_BLOCKS_AN_SM an SM takes clusters of GEMM_TILE_SPLITS blocks, each a share of the
# columns (gemm_tile_split_*)
GEMM_TILE_TYPES = (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q5_0)
GEMM_TILE_WARPS, GEMM_TILE_TOKENS, GEMM_TILE_STAGES, GEMM_TILE_SPLITS = 4, 64, 2, 4
GEMM_TILE_ROWS, GEMM_TILE_SHARED = 32 * GEMM_TILE_WARPS, GEMM_TILE_STAGES * GEMM_TILE_TOKENS * 256 * 2
GEMM_TILE_SPLIT_BLOCKS_AN_SM = 1
# past the int16 passes' tokens (MATVEC_PASSES_MAX_TOKENS): H200, Qwen3-8B Q4_K_M prompt passes, ms, against gemm_frag /
# gemm_f16.cu: 32 tokens 10.23 / 9.01, 40 11.98 / 13.59, 64 11.09 / 15.35, 128 16.10 / 35.63 (docs/perf-notes.md run 27)
GEMM_TILE_MIN_TOKENS = 33
# and up to here for these types: Q8_0's rows, twice Q4_K's bytes a weight, are read again by each tile of 64 tokens,
# and past ~330 tokens the f16 copy costs less (8B Q8_0 prefill, ms, tile / f16 copy: 128 tokens 20.0 / 35.7, 512
# 60.1 / 46.2; docs/perf-notes.md run 27)
GEMM_TILE_MAX_TOKENS = {GGMLType.Q8_0: 256}
# and rows narrower than MMA_MIN_COLS (of 256 · GEMM_TILE_SPLITS columns or more: a split's superblock each) up to
# here, past which the f16 copy, dequantized once a pass, costs less. H200, Q4_K_M prompts, tok/s, the tile against
# gemm.cu (up to 127 tokens) or the f16 copy: Qwen3-0.6B 64 tokens 21,627 / 18,718, 128 35,390 / 27,301, 192 45,193
# / 37,946, 256 51,003 / 47,857, 512 ~72,300 / ~77,700; Qwen3.5-0.8B 128 18,814 / 17,172, 192 23,722 / 22,863, 256
# 27,035 / 27,977 (docs/perf-notes.md run 30)
GEMM_TILE_NARROW_MAX_TOKENS = 192
# up to here a matrix of at most MATVEC_MAX_ROWS rows takes int16 passes of 8 tokens (wider ones
# take the GEMMs past one pass): the int16 scratch holds this many tokens
MATVEC_PASSES_MAX_TOKENS = 32
# a weight of at most this many rows takes matvec passes at any token count: the GEMMs' 64-row tiles
# would be mostly empty, and passes keep it in float32, which Gated DeltaNet's gate projections (a
# row a value head, feeding exp of a running sum) need: with f16 operands, the hybrid fixtures' logits
# were 0.7-0.9% off transformers', against 0.01-0.05% (H200, 2026-12-01)
MATVEC_MAX_ROWS = 128
MAX_BATCH = 512  # tokens per forward pass; the engine splits longer batches
TOP_K_MAX = 256  # kernels/sampling.cu top_k
PREFILL_ATTENTION_MIN_TOKENS = 64  # kernels/attention_prefill.cu, 64 queries a block: below this, the split kernel
PREFILL_ATTENTION_WIDTHS = (64, 128, 256)  # its head widths (dk = dv; 256 a kernel of its own)
# kernels/attention.cu below that: the cache's slots split over up to 64 blocks a (query, head), at
# least 32 slots each, their partial softmaxes in a scratch that bounds the splits of a long batch
ATTENTION_MAX_SPLITS, ATTENTION_SPLIT_SLOTS, ATTENTION_PARTIALS_BYTES = 64, 32, 4 << 20
# splits of ATTENTION_SPLIT_TARGET slots, but ATTENTION_MIN_SPLITS where the slots allow: H200, Qwen3 0.6B and 8B
# Q4_K_M, decode tok/s at a 128-token context (256 slots) 1,243 / 388 with 8 splits, 1,088 / 367 with 1; at 4,096
# (4,352 slots) 829 / 291 with 64, 890 / 309 with 34 (docs/perf-notes.md run 16; a decode step past 8 splits now
# fills a wave instead, below)
ATTENTION_SPLIT_TARGET, ATTENTION_MIN_SPLITS = 128, 8
# a decode step whose slots take more than ATTENTION_MIN_SPLITS splits takes as many as fill one wave of the SMs at
# the kernel's blocks an SM (its launch bounds), whatever the slots: a second wave's blocks waited for the first's.
# H200, Q4_K_M decode tok/s at 2,048 / 4,096 / 8,192 tokens of context in an 8,704-slot cache, 8B (20 splits) 397.5 /
# 374.8 / 337.5 against 385.7 / 338.2 / 305.0 with 128 slots a split, 0.6B (41) 1,138 / 1,047 / 906 against 1,133 /
# 931 / 813 (docs/perf-notes.md run 25)
ATTENTION_BLOCKS_AN_SM = 5
# such a step (more splits than a cluster takes) of 64- or 128-wide heads, ATTENTION_GROUP_MIN to ATTENTION_GROUP_MAX
# query heads a KV head, runs on tensor cores a KV head's group of query heads a block (kernels/attention.cu
# attention_group), each reading the group's K and V rows once, in splits of ATTENTION_GROUP_SPLIT_SLOTS slots.
# H200, Q4_K_M decode tok/s at 4,096 tokens of context (4,608 slots), against a block a query head: Qwen3-8B (4 query
# heads a KV head) 389.8 / 389.7 against 375.1 / 374.9, Qwen3-0.6B (2) 993.5 / 993.2 against 1,043.1 / 1,042.0
# (docs/perf-notes.md run 26)
ATTENTION_GROUP_MIN, ATTENTION_GROUP_MAX, ATTENTION_GROUP_SPLIT_SLOTS = 4, 8, 128
# on sm_90+, up to this many splits run as one cluster of as many blocks (kernels/attention.cu attention_cluster),
# merged through distributed shared memory instead of by the last split to finish through global memory
ATTENTION_CLUSTER_SPLITS = 8
# a one-token pass splits the slots up to a power of two past its own, at least this many (decode_slots)
DECODE_MIN_SLOTS = 256
ROPE_MAX_DIMS = 256  # rotated dims a head, kernels/elementwise.cu ROPE_MAX_PAIRS
# (query, head) pairs or GEMM tiles whose splits the last one merges (kernels/attention.cu, gemm.cu): more
# (query, head) pairs take one split
SPLIT_COUNTS = MAX_BATCH * 128
# from here on weights are dequantized once per pass (kernels/gemm_f16.cu) instead of once per 32 tokens
# (kernels/gemm.cu): H200, Q4_K_M prompt passes, the two paths even at ~80 tokens on Qwen3-8B and at
# ~300 on 0.6B (whose passes the f16 path's extra launches slow), docs/perf-notes.md run 7
F16_GEMM_MIN_TOKENS = 128
W16_MAX_BYTES = 64 << 20  # the f16 copy of weight rows that long-prompt GEMMs work from
# captured passes kept (graph.py): decode steps' (one a bucket of slots, decode_slots) and the last
# prompts'. Each holds its logits (at most MATVEC_MAX_TOKENS rows) in the graph pool
KEPT_GRAPHS = 4
# the per-pass ints a forward pass reads from scratch, in their order there (graph.py stages them)
STEP_INTS = ("tokens", "positions", "segments", "start", "rows")


_SUFFIXES = {t: t.name.lower().replace("_k", "_K") for t in GGMLType}


def kernel_suffix(t: GGMLType) -> str:
    return _SUFFIXES[t]


def x16_decode_blocks_an_sm(kernel: str) -> int:
    """A one-token int16 matvec's blocks an SM (its launch bounds): matvec_x16_1_<type> or its twin matvec_x16_1w_<type>."""
    eight = kernel.startswith("matvec_x16_1w_") or kernel == "matvec_x16_1_" + kernel_suffix(GGMLType.Q8_0)
    return X16_DECODE_BLOCKS_AN_SM_64R if eight else X16_DECODE_BLOCKS_AN_SM


def tile_fits(t: GGMLType, n_cols: int) -> bool:
    """Whether kernels/gemm_tile.cu multiplies rows of this type and width: whole superblocks, or for the types of
    32-element blocks a half superblock last (llama.cpp's rows that are not whole superblocks: DeepSeek-V2-Lite's
    1,408-column experts' downs, its 128-column attn_k_b)."""
    return t in GEMM_TILE_TYPES and n_cols % (128 if GGML_BLOCK[t][0] == 32 else 256) == 0


class Weight(NamedTuple):
    ptr: int
    ggml_type: GGMLType
    shape: tuple[int, ...]  # ggml order: (n_cols, n_rows) for a matrix

    @property
    def n_cols(self) -> int:
        return self.shape[0]

    @property
    def n_rows(self) -> int:
        return self.shape[1] if len(self.shape) > 1 else 1


def decode_slots(start: int) -> int:
    """The slots a one-token pass into cache slot `start` splits its attention over (kernels/attention.cu),
    the cache's capacity permitting: a power of two past start, DECODE_MIN_SLOTS at least. The kernel
    cuts whatever slots a pass reaches evenly over its grid, so one grid serves every position of a
    bucket and graph.py captures a decode step's graph once a bucket; the grid of the whole cache left
    most of its blocks without slots at a short context (2,048 blocks a layer on Qwen3-8B at 4,352)."""
    return max(DECODE_MIN_SLOTS, 1 << start.bit_length())


def token_class(n_tok: int) -> int:
    """Token counts that CudaOps._path tells apart alike: 1, up to a pass of the matvecs, up to their
    int16 scratch, then by the side of each prompt GEMM's bounds they lie on (GEMM_TILE_MIN_TOKENS,
    F16_GEMM_MIN_TOKENS, GEMM_TILE_MAX_TOKENS, GEMM_TILE_NARROW_MAX_TOKENS)."""
    if n_tok == 1:
        return 1
    if n_tok <= MATVEC_PASSES_MAX_TOKENS:
        return 2 if n_tok <= MATVEC_MAX_TOKENS else 3
    return 4 + (n_tok >= GEMM_TILE_MIN_TOKENS) + 2 * (n_tok >= F16_GEMM_MIN_TOKENS) \
        + 4 * sum(n_tok > most for most in (*GEMM_TILE_MAX_TOKENS.values(), GEMM_TILE_NARROW_MAX_TOKENS))


class Group(NamedTuple):
    """A run of weights that one launch multiplies with the same x (ops.py _plan): its kernel and
    every argument that does not change between calls, made once."""
    path: str  # one of FUSED_PATHS
    kernel: str
    units: int  # blocks over all the rows (the bulk matvec's: at most its blocks an SM, each walking several)
    threads: int
    weights: tuple  # the arguments before x ("x16": its int16 blocks) and the products: W0, W1, W2 (absent: 0)
    rows: tuple  # after them: rows0, rows1, rows2 (absent: 0), n_cols
    absent: list[int]  # 0 for each absent weight's product
    n_rows: list[int]
    splits: dict[int, tuple]  # "blocks": token tiles of 32 -> (grid z, each weight's splits), gemm_splits on first use
    shared: int = 0  # dynamic shared memory a block


def gemm_splits(n_rows: Sequence[int], n_cols: int, tiles: int, target: int) -> tuple[int, tuple[int, int, int]]:
    """Over how many blocks kernels/gemm.cu splits each weight's columns (absent ones: 1), and the grid's z:
    enough for `target` blocks a weight, at most one a 512-column step and GEMM_MAX_SPLITS. From the weight's
    own shape alone, so that a product is the same bits whichever weights share its launch."""
    steps = -(-n_cols // 512)
    splits = [max(1, min(steps, GEMM_MAX_SPLITS, -(-target // (-(-r // 32) * tiles)))) for r in n_rows]
    return max(splits), (*splits, *(1,) * (FUSED_WEIGHTS - len(splits)))


class HeldMatvec(NamedTuple):
    """A one-token pass's last launch of q, k and v's matmuls, held back for the rope after it (CudaOps.ropes), which
    its rope form (kernels/rope.cuh RopeOut) may make: the launch making v, and q and k too where they share it."""
    outs: tuple  # its products
    before: tuple  # the products of the call's launches before it
    group: Group
    head: tuple  # its arguments before the residual's: weights, x's int16 blocks, products
    tail: tuple  # and after it: rows, n_cols, x's norm sums and eps


class HeldRope(NamedTuple):
    """A rope_f32 launch of q and k held back for the attention after it (CudaOps.ropes)."""
    inputs: tuple  # q and k before the rope: held, so their buffers stay theirs until it runs
    outs: tuple
    grid: tuple[int, int]
    block: int
    args: tuple  # every argument before the cache's (NO_CACHE_WRITE where none)
    matvec: HeldMatvec | None = None  # the launch making v, still held: the attention may give it this rope
    rope_args: tuple = ()  # and then its rope form's arguments before the cache's


NO_CACHE_WRITE = (0, 0, 0, 0, 0, 0, 0)  # rope_f32's k_cache, v_cache, v, v_width, slot_seg, seg, start_at


class X16(NamedTuple):
    """Where a matvec finds its x as int16 blocks (kernels/x16.cuh), and for a norm's output whose norm the
    matvec before it took over, that norm's sums of squares and eps (NormOut; else 0 and 0.0)."""
    xq: int
    xds: int
    sums: int = 0
    eps: float = 0.0


class HeldProduct(NamedTuple):
    """A one-token matvec with the residual summed in, its launch held back for a norm of its product
    (CudaOps.rms_norm)."""
    out: Tensor
    kernel: str
    units: int
    threads: int
    args: tuple  # every argument before the norm's (NO_NORM where it writes none)
    shared: int


NO_NORM = (0, 0, 0, 0, 0)  # a decode matvec's norm_w, norm_xq, norm_xds, norm_sums, tickets


def _address_stride(x: Tensor, head: int) -> tuple[int, int]:
    """The rope kernels' x and its heads' stride (memory.head_runs)."""
    runs = head_runs(x, head)
    return runs.address, runs.stride


class PendingNorm(NamedTuple):
    """A norm of a held product (HeldProduct), itself held back for the matvecs reading its output."""
    product: HeldProduct
    out: LazyTensor  # rms_norm's output
    x: Tensor
    weight: Weight
    eps: float


class KVCache(NamedTuple):
    k: list[int]  # per layer: f16 (capacity, k_width); 0 for a recurrent layer
    v: list[int]  # per layer: f16 (capacity, v_width); 0 for a recurrent one, and for all when latent (MLA): the values are k's first v_width
    segments: int  # int32 (capacity,): the segment of each written slot
    shape: CacheShape
    recurrent: RecurrentState | None = None  # the Gated DeltaNet layers' states (delta_net.py)

    def arrays(self, layer: int) -> tuple[tuple[str, int, int], ...]:
        """An attention layer's arrays as KV state files name them: (kind, device address, width)."""
        s = self.shape
        if s.latent:
            return (("kv", self.k[layer], s.k_width),)
        return (("k", self.k[layer], s.k_width), ("v", self.v[layer], s.v_width))

    def states(self, layer: int) -> tuple[tuple[str, int, tuple[int, ...]], ...]:
        """A recurrent layer's arrays: (kind, device address, shape), float32."""
        r = self.shape.recurrent
        return (("conv", self.recurrent.conv[layer], (r.conv_rows, r.channels)),
                ("ssm", self.recurrent.ssm[layer], (r.n_v_heads, r.k_dim, r.v_dim)))


def device_nbytes(ggml_type: GGMLType, shape: tuple[int, ...]) -> int:
    if len(shape) == 1:  # vectors (norm weights, rope factors) are kept as float32
        return aligned(4 * shape[0])
    if ggml_type in KERNEL_TYPES:
        return aligned(tensor_nbytes(ggml_type, shape))
    return aligned(2 * math.prod(shape))


class _PyBuffer(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.py_object), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


def buffer_address(view: memoryview) -> int:
    """The address of any contiguous buffer, read-only ones too (ctypes' from_buffer refuses
    those): a tensor's bytes in the file mapping, a host array. It stays valid while the
    buffer's owner lives."""
    buf = _PyBuffer()
    ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(view), ctypes.byref(buf), 0)
    try:
        return buf.buf
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(buf))


class CudaOps(ExpertOps, DeltaNetOps):
    name = "cuda"
    max_batch = MAX_BATCH

    def __init__(self, device: Device | None = None):
        self.device = device or Device()
        self.device.make_current()
        self._weights = self._cache = self._scratch = self._small = self._large = None
        self._allocations: list[Region] = []  # reserve's device memory, in one allocation a region
        self._positions = None  # (sequence, device copy) of the last rope call: q and k share it
        self._angles_of: tuple | None = None  # the positions and rope whose angles the table holds (CudaOps.ropes)
        self._pending: list[tuple[Copy, memoryview]] = []  # weight copies waiting for commit_weights
        self._upload: Upload | None = None  # the committed copies while any are in flight
        self._upload_ms: float | None = None
        self._arriving: dict[int, tuple[int, memoryview]] = {}  # weight address -> (its copy, its bytes) until first read
        self._captured_ints: dict[str, list[int]] | None = None  # while graph.py captures a pass
        self._readback = None  # pinned slots the sampler reads its device-made choices back through (cuda/sampler.py), made at its first `ahead`
        self._held_rope: HeldRope | None = None  # q and k's rope while the device holds its launch back
        self._held_matvec: HeldMatvec | None = None  # q, k and v's last launch while the device holds it back
        # a one-token pass's rope of q and k made by the launch making v (HeldMatvec)
        self.fuse_ropes = True
        self._held_product: HeldProduct | None = None  # a residual's matvec while the device holds its launch back
        self._pending_norm: PendingNorm | None = None  # its norm, while the device holds both
        # a one-token pass's norms taken over by the matvecs around them (_fuse_norm)
        self.fuse_norms = True
        self.graphs = os.environ.get("REFLEX_CUDA_GRAPHS") != "0"  # replay repeated passes as CUDA graphs
        # sm_90+: cp.async.bulk (the bulk matvec) and clusters of blocks (the attention's splits)
        self._sm90 = self.device.info.compute_capability >= (9, 0)

    @property
    def description(self) -> str:
        info, image = self.device.info, self.device.image
        return f"{info.name} sm_{info.compute_capability[0]}{info.compute_capability[1]} {image.kind} {image.arch}"

    # -- memory ---------------------------------------------------------------------------------

    def reserve(self, tensors: Sequence[tuple[GGMLType, tuple[int, ...]]], cache: CacheShape, activation_width: int) -> None:
        """Check that the weights, a cache of `cache`'s shape and the activation buffers fit in free
        device memory, then take all three (activation_width: float32 values live per token). Once: a
        second model takes a backend of its own."""
        if self._allocations:
            raise ReflexError("internal error: this CUDA backend already holds a model's memory (reserve is called once)")
        row_width = cache.k_width + (0 if cache.latent else cache.v_width)  # a latent row holds its values
        kv_bytes = len(cache.kv_layers) * aligned(cache.capacity * row_width * 2) + aligned(4 * cache.capacity)
        r = cache.recurrent
        if r:
            check_shape(r)
            kv_bytes += aligned(2 * r.nbytes)  # and their checkpoint
        ints = {**{kind: 1 if kind == "start" else MAX_BATCH for kind in STEP_INTS}, "pairs": MAX_BATCH, "history": cache.capacity,
                "mask": -(-activation_width // 32)}  # a constraint's packed mask (cuda/sampler.py): n_vocab bits fit
        # dequantized weight rows for the long-prompt GEMM: the largest matrix, up to a cap (more rows run in turns)
        self._w16_bytes = aligned(min(W16_MAX_BYTES, max((2 * math.prod(shape) for _, shape in tensors if len(shape) == 2), default=0)))
        # and their x as f16: a whole pass of the widest input
        self._xh_bytes = xh_bytes = aligned(2 * MAX_BATCH * max((shape[0] for _, shape in tensors if len(shape) == 2), default=0))
        chunk_bytes = aligned(chunk_scratch_bytes(r, MAX_BATCH)) if r else 0
        scratch = (sum(aligned(4 * n) for n in ints.values()) + aligned(8 * 2 * MAX_BATCH) + aligned(8 * TOP_K_MAX + 16)
                   + self._w16_bytes + xh_bytes + ATTENTION_PARTIALS_BYTES + aligned(4 * SPLIT_COUNTS) + chunk_bytes
                   + aligned(8 * ROPE_MAX_DIMS // 2 * MAX_BATCH)
                   + self._gemm_partials_bytes())
        # a matvec pass's x as int16 blocks (2 bytes an element, then 8 bytes (d, d·Σq) a block of 32)
        self._x16_width = max([activation_width] + [shape[0] for _, shape in tensors if len(shape) == 2])
        x16_bytes = aligned(2 * MATVEC_PASSES_MAX_TOKENS * self._x16_width) + aligned(MATVEC_PASSES_MAX_TOKENS * self._x16_width // 4)
        # a fused norm's (_fuse_norm): one token's int16 blocks, then each group of 32's sum and ticket; beside the
        # tickets a fused rope's (HeldMatvec): one a head of q and k, heads of a multiple of 32 features
        groups = -(-self._x16_width // 32)
        norm_bytes = aligned(2 * self._x16_width) + aligned(8 * groups) + aligned(4 * groups) + aligned(4 * 3 * groups)
        scratch += x16_bytes + norm_bytes
        # three pools: decode-sized buffers (a step's addresses never move), the same for captured
        # passes alone (graph.py: one pass's buffers beside the other kept graphs' logits), and whole-pass ones
        small, large = aligned(2 * MATVEC_MAX_TOKENS * activation_width * 4), aligned(MAX_BATCH * activation_width * 4)
        graph = aligned(KEPT_GRAPHS * MATVEC_MAX_TOKENS * activation_width * 4)
        plan = Plan(sum(device_nbytes(t, s) for t, s in tensors) + len(tensors) * 256, kv_bytes, small + graph + large, scratch)
        plan.check(self.device.free_memory(), self.device.info.name, cache.capacity)
        self.reserved_bytes = plan.total
        self._allocations = self._regions(
            [(plan.weights, "weights"), (plan.cache, "KV cache"), (plan.scratch, "scratch"), (small, "small activation"),
             (graph, "graph activation"), (large, "activation")])
        weights, kv, scratch_, small_, graph_, large_ = self._allocations
        self._weights, self._cache, self._scratch = weights, kv, scratch_
        self._small, self._graph_pool = Pool(small_, MATVEC_MAX_TOKENS), Pool(graph_, MATVEC_MAX_TOKENS)
        self._large = Pool(large_, MAX_BATCH)
        s = self._scratch
        self._ints = {kind: s.carve(4 * n) for kind, n in ints.items()}  # STEP_INTS first: one contiguous span
        self._f64 = s.carve(8 * 2 * MAX_BATCH)
        self._top = s.carve(8 * TOP_K_MAX + 16)  # top_k's ids, values and (max, sum of exp)
        self._w16 = s.carve(self._w16_bytes) if self._w16_bytes else 0
        self._xh = s.carve(xh_bytes) if xh_bytes else 0
        self._xh_of: tuple[Tensor, bool] | None = None  # the tensor the f16 scratch holds, and whether interleaved
        self._partials = s.carve(ATTENTION_PARTIALS_BYTES)
        self._gemm_partials = s.carve(self._gemm_partials_bytes())
        self._angles = s.carve(8 * ROPE_MAX_DIMS // 2 * MAX_BATCH)  # (cos, sin) of a pass's tokens' rotated pairs
        self._counts = s.carve(4 * SPLIT_COUNTS)  # 0, and set back to 0 by each launch that counts
        self.device.drv.cuMemsetD32Async(self._counts, 0, SPLIT_COUNTS, self.device.stream)
        self._chunk_scratch = s.carve(chunk_bytes) if chunk_bytes else 0
        self._xq = s.carve(x16_bytes)
        self._xds = self._xq + aligned(2 * MATVEC_PASSES_MAX_TOKENS * self._x16_width)
        self._plain_x16 = X16(self._xq, self._xds)
        self._x16_of: tuple[Tensor, int, X16] | None = None  # (tensor, elements, where) of the int16 blocks made last
        self._norm_xq = s.carve(2 * self._x16_width)
        self._norm_xds, self._norm_sums, self._tickets = s.carve(8 * groups), s.carve(4 * groups), s.carve(4 * 3 * groups)
        self._head_tickets = self._tickets + 4 * groups
        self.device.drv.cuMemsetD32Async(self._tickets, 0, 3 * groups, self.device.stream)  # both kinds, one call
        # (token class, the weights' addresses: carved once, never shared) -> the matmul's launches (_plan)
        self._plans: dict[tuple[int, ...], list[Group | tuple[Weight, str]]] = {}

    def _gemm_partials_bytes(self) -> int:
        """The split GEMM tiles' sums (kernels/gemm.cu) at most: a weight splits only while its tiles number
        under the target, into at most ceil(target / tiles) splits, so under 2 x target tiles' worth each."""
        return aligned(FUSED_WEIGHTS * 2 * GEMM_BLOCKS_AN_SM * self.device.info.multiprocessors * 32 * 32 * 4)

    def close(self) -> None:
        """Give the device back what reserve and the upload took, once the stream's work is done:
        the regions, the pinned file pages, the Device's module, stream and context hold. Nothing
        may run on these ops after."""
        if self._upload is not None:
            self.weights_arrived()
            self._upload.close()
            self._upload = None
        self.device.synchronize()
        if self._readback is not None:
            self._readback.close()
            self._readback = None
        for region in self._allocations:
            self.device.free(region.base)
        self._allocations = []
        self.device.close()

    def _regions(self, sizes: list[tuple[int, str]]) -> list[Region]:
        """One device allocation each; if one fails (memory taken since the plan's check), the
        ones before it are given back, so a caller that catches the error keeps nothing."""
        regions: list[Region] = []
        try:
            for size, what in sizes:
                regions.append(Region(self.device.alloc(size), size, what))
        except BaseException:
            for region in regions:
                self.device.free(region.base)
            raise
        return regions

    def load_weight(self, name, ggml_type, shape, data) -> Weight:
        ggml_type, shape = GGMLType(ggml_type), tuple(shape)
        ptr = self._weights.carve(device_nbytes(ggml_type, shape))
        if len(shape) == 1 and ggml_type != GGMLType.F32:
            host, ggml_type = _dequantized(data, ggml_type, "<f4"), GGMLType.F32
        elif len(shape) > 1 and ggml_type not in KERNEL_TYPES:
            host, ggml_type = _dequantized(data, ggml_type, "<f2"), GGMLType.F16
        else:
            host = data
        view = memoryview(host).cast("B")
        if isinstance(view.obj, mmap.mmap):  # the stored blocks in a file mapping: commit_weights copies them
            self._pending.append((Copy(ptr, buffer_address(view), view.nbytes), view))  # the view keeps data alive
            return Weight(ptr, ggml_type, shape)
        self.device.upload(ptr, buffer_address(view), view.nbytes)  # pageable: staged before it returns
        return Weight(ptr, ggml_type, shape)

    def commit_weights(self) -> int:
        """Start the copies (upload.py) and return: each op waits for its own weights."""
        self.weights_arrived()  # an earlier commit's copies first
        if not self._pending:
            return 0
        self._upload_ms = None
        self._upload = Upload(self.device, [copy for copy, _ in self._pending], [view for _, view in self._pending])
        self._arriving = {copy.dst: (i, view) for i, (copy, view) in enumerate(self._pending)}
        self._pending = []
        return self._upload.nbytes

    def weights_arrived(self) -> float | None:
        if self._upload is not None and self._upload_ms is None:
            self._arriving = {}
            self._upload_ms = self._upload.finish()  # the Upload stays: its pages stay pinned (upload.py)
        return self._upload_ms

    def _ready(self, weight: Weight) -> int:
        """The weight's address, once the stream's next work will find it on the device."""
        if self._arriving:
            arriving = self._arriving.pop(weight.ptr, None)
            if arriving is not None:
                self._upload.wait(arriving[0])
        return weight.ptr

    def replayable(self, forward):
        if not self.graphs:
            return forward
        from .graph import ReplayedPasses

        return ReplayedPasses(self, forward, STEP_INTS, MATVEC_MAX_TOKENS, KEPT_GRAPHS)

    def new_kv_cache(self, shape: CacheShape) -> KVCache:
        c, kv = self._cache, shape.kv_layers
        k = [c.carve(shape.capacity * shape.k_width * 2) if i in kv else 0 for i in range(shape.n_layers)]
        v = [c.carve(shape.capacity * shape.v_width * 2) if i in kv and not shape.latent else 0 for i in range(shape.n_layers)]
        segments = c.carve(4 * shape.capacity)
        return KVCache(k, v, segments, shape, carve_states(c, shape.recurrent) if shape.recurrent else None)

    def from_host(self, x) -> Tensor:
        """A C-contiguous float32 (rows, cols) host buffer as a device activation (tests, tools)."""
        rows, cols = x.shape
        out = self._new(rows, cols)
        if rows * cols:  # memoryview cannot cast an empty array
            view = memoryview(x).cast("B")
            self.device.upload(out.ptr, buffer_address(view), view.nbytes)
        return out

    def poison(self) -> None:
        """Fill every activation buffer with NaN, so a test sees any element a kernel did not write."""
        self.device.release()  # a held launch reads its inputs before the fill
        for pool in (self._small, self._graph_pool, self._large):
            self.device.drv.cuMemsetD32Async(pool.region.base, 0x7FC00000, pool.region.size // 4, self.device.stream)

    def _new(self, rows: int, cols: int) -> Tensor:
        return Tensor(self._pool(rows), rows, cols)

    def _pool(self, rows: int) -> Pool:
        if rows > MATVEC_MAX_TOKENS:
            return self._large
        return self._small if self._captured_ints is None else self._graph_pool

    def _upload_ints(self, kind: str, values: Sequence[int]) -> int:
        """Copy ints into their scratch slot; pageable source: the driver stages it before returning.
        While a pass is captured, record them instead: graph.py stages them per replay."""
        ptr = self._ints[kind]
        if self._captured_ints is not None:
            self._captured_ints[kind] = list(values)
            return ptr
        n = len(values)
        if n:
            host = (ctypes.c_int32 * n)(*values)
            self.device.upload(ptr, ctypes.addressof(host), 4 * n)
        return ptr

    # -- the Ops protocol ------------------------------------------------------------------------

    def embed(self, table: Weight, tokens: Sequence[int]) -> Tensor:
        out = self._new(len(tokens), table.n_cols)
        if tokens is SAMPLED:  # the sampler's argmax left it there (cuda/sampler.py ahead)
            self.device.launch(f"get_rows_{kernel_suffix(table.ggml_type)}", (1,), 128,
                               (self._ready(table), self._top, out.ptr, table.n_cols, 1))
            return out
        arriving = self._arriving.get(table.ptr)
        if arriving is not None:
            # the table is still in flight (it goes last: a pass reads only the prompt's rows of it):
            # those rows go up from the file mapping, packed in an activation buffer, which holds
            # 4 bytes a column and so any stored row
            first = sorted(set(tokens))
            row_bytes = tensor_nbytes(table.ggml_type, (table.n_cols,))
            rows = b"".join(arriving[1][t * row_bytes : (t + 1) * row_bytes] for t in first)
            packed = self._new(len(first), table.n_cols)
            self.device.upload(packed.ptr, buffer_address(memoryview(rows)), len(rows))  # pageable: staged before it returns
            at = {t: i for i, t in enumerate(first)}
            table_ptr, tokens = packed.ptr, [at[t] for t in tokens]
        else:
            table_ptr = self._ready(table)
        ids = self._upload_ints("tokens", tokens)
        self.device.launch(f"get_rows_{kernel_suffix(table.ggml_type)}", (len(tokens),), 128,
                           (table_ptr, ids, out.ptr, table.n_cols, len(tokens)))
        return out

    def rms_norm(self, x: Tensor, weight: Weight, eps: float) -> Tensor:
        product = self._held_product
        if product is not None and product.out is x and weight.n_cols == x.cols:
            # x is a held one-token matvec's: it may write this norm's int16 blocks and the matvecs after
            # finish it (_fuse_norm); the next launch of anything else makes both as they are first
            self.device.take_held()
            self._held_product = None
            out = LazyTensor(self._pool(x.rows), x.rows, x.cols)
            pending = self._pending_norm = PendingNorm(product, out, x, weight, eps)
            self.device.hold(lambda: self._launch_unfused(pending))
            return out
        out = self._new(x.rows, x.cols)
        self._launch_norm(x, weight, eps, out.ptr, out if weight.n_cols == x.cols else None)
        return out

    def _launch_norm(self, x: Tensor, weight: Weight, eps: float, out: int, beside: Tensor | None) -> None:
        """norm_f32 of x into out, and its int16 blocks where beside is out's tensor (_x16_beside)."""
        d = weight.n_cols
        block = 32 * -(-min(d, 1024) // 32)
        # blocks a row (kernels/elementwise.cu, one feature a thread), each reading the whole row: for a few
        # rows only, whose one block each would leave most SMs idle
        splits = d // 1024 if d % 1024 == 0 and x.rows <= MATVEC_MAX_TOKENS else 1
        self.device.launch("norm_f32", (x.rows * x.cols // d, splits), block,
                           (x.ptr, self._ready(weight), out, d, eps) + (self._x16_beside(beside) if beside else (0, 0)))

    def _launch_product(self, product: HeldProduct, norm: tuple) -> None:
        if self._held_product is product:
            self._held_product = None
        self.device.launch(product.kernel, (product.units,), product.threads, product.args + norm, product.shared)

    def _launch_unfused(self, pending: PendingNorm) -> None:
        """A pending norm's matvec and the norm itself, as they are."""
        if self._pending_norm is pending:
            self._pending_norm = None
        self._launch_product(pending.product, NO_NORM)
        self._launch_norm(pending.x, pending.weight, pending.eps, pending.out.address, pending.out)

    def _fuse_norm(self, pending: PendingNorm) -> None:
        """The pending norm taken over by the matvecs around it (kernels/x16.cuh NormOut): its input's matvec
        writes the int16 blocks of x∘w and their groups' sums of squares, which the matvecs reading its
        output take with those sums; its float values are made only if something asks for them. One launch
        and one wait fewer a norm: H200, Qwen3-8B Q4_K_M decode 389.8 -> 417.0 tok/s (docs/perf-notes.md run 17)."""
        self.device.take_held()
        self._pending_norm = None
        self._launch_product(pending.product, (self._ready(pending.weight), self._norm_xq, self._norm_xds,
                                               self._norm_sums, self._tickets))
        out, x, weight, eps = pending.out, pending.x, pending.weight, pending.eps
        self._x16_of = (out, out.cols, X16(self._norm_xq, self._norm_xds, self._norm_sums, eps))
        address = out.address
        out.make = lambda: self._launch_norm(x, weight, eps, address, None)

    def _x16_beside(self, out: Tensor) -> tuple[int, int]:
        """Where the kernel making `out` also writes its int16 blocks (kernels/x16.cuh), which the
        matvec reading it next then takes instead of quantizing it again (one launch fewer); (0, 0),
        nothing, past one pass of tokens, where the GEMMs read x itself."""
        if out.rows <= MATVEC_MAX_TOKENS and out.cols % 32 == 0 and out.cols <= self._x16_width:
            self._x16_of = (out, out.rows * out.cols, self._plain_x16)
            return self._xq, self._xds
        return 0, 0

    def matmul(self, x: Tensor, weight: Weight, add: Tensor | None = None) -> Tensor:
        key = (token_class(x.rows), weight.ptr)
        return self._matmul(x, self._plans.get(key) or self._plan(x, (weight,), key), add)[0]

    def matmuls(self, x: Tensor, weights: Sequence[Weight]) -> list[Tensor]:
        """Runs of up to MAX_FUSED weights of one type that take the same kernel go as one launch
        (its grid over all their rows), the rest one by one."""
        key = (token_class(x.rows), *[w.ptr for w in weights])
        return self._matmul(x, self._plans.get(key) or self._plan(x, weights, key), qkv=len(weights) == 3)

    def _plan(self, x: Tensor, weights: Sequence[Weight], key: tuple[int, ...]) -> list[Group | tuple[Weight, str]]:
        """The launches of x times the weights, kept under key: a Group for each run that shares a
        kernel, (weight, path) where one goes alone."""
        t, plan, i = x.rows, [], 0
        while i < len(weights):
            first = weights[i]
            if x.cols != first.n_cols:
                raise ReflexError(f"internal error: matmul of width {x.cols} with a weight of {first.n_cols} columns")
            path, group = self._path(x, first), [first]
            for w in weights[i + 1:i + MAX_FUSED] if path in FUSED_PATHS else ():
                if w.ggml_type != first.ggml_type or w.n_cols != first.n_cols or self._path(x, w) != path:
                    break
                group.append(w)
            plan.append(self._group(group, path, t) if path in FUSED_PATHS else (first, path))
            i += len(group)
        self._plans[key] = plan
        return plan

    def _path(self, x: Tensor, weight: Weight) -> str:
        """Which kernels multiply x with the weight: "x16" (int16 matvec passes), "float" (float
        matvec passes), "blocks" or "frag" (the short-prompt GEMMs), "tile" or "tile_split" (the GEMM from the
        blocks for longer prompts) or "f16" (the long-prompt GEMM of an f16 copy)."""
        n_cols, n_rows = weight.n_cols, weight.n_rows
        if x.rows <= MATVEC_MAX_TOKENS or n_rows <= MATVEC_MAX_ROWS or n_cols % 32:
            # a weight wider than reserve planned the int16 scratch for keeps the float kernel, as do passes past 32 tokens
            x16 = weight.ggml_type in X16_MATVEC_TYPES and n_cols <= self._x16_width and x.rows <= MATVEC_PASSES_MAX_TOKENS
            return "x16" if x16 else "float"
        wide_enough = n_cols >= MMA_MIN_COLS or (n_cols >= 256 * GEMM_TILE_SPLITS and x.rows <= GEMM_TILE_NARROW_MAX_TOKENS)
        if GEMM_TILE_MIN_TOKENS <= x.rows <= GEMM_TILE_MAX_TOKENS.get(weight.ggml_type, MAX_BATCH) \
                and tile_fits(weight.ggml_type, n_cols) and wide_enough and 2 * x.rows * n_cols <= self._xh_bytes:
            blocks = -(-n_rows // GEMM_TILE_ROWS) * -(-x.rows // GEMM_TILE_TOKENS)  # the weight's own: split alike in any launch
            return "tile_split" if self._sm90 and blocks < GEMM_TILE_SPLIT_BLOCKS_AN_SM * self.device.info.multiprocessors else "tile"
        if x.rows >= F16_GEMM_MIN_TOKENS and 2 * n_cols <= self._w16_bytes and 2 * x.rows * n_cols <= self._xh_bytes:
            return "f16"
        frag = weight.ggml_type in GEMM_FRAG_TYPES and n_cols >= MMA_MIN_COLS and n_cols % 256 == 0
        return "frag" if frag else "blocks"

    def _group(self, group: list[Weight], path: str, n_tok: int) -> Group:
        """A run's launch: made when the run is first multiplied, once its weights have arrived."""
        absent, rows, n_cols = FUSED_WEIGHTS - len(group), [w.n_rows for w in group], group[0].n_cols
        weights, suffix = (*[self._ready(w) for w in group], *(0,) * absent), kernel_suffix(group[0].ggml_type)
        shared, most = 0, None  # dynamic shared memory a block; the most blocks a launch
        if path == "blocks":  # kernels/gemm.cu: 32 rows x 32 tokens a block, straight from the GGUF blocks
            kernel, per, threads = f"gemm_{suffix}", 32, 256
        elif path == "frag":
            kernel, per, threads = f"gemm_frag_{suffix}", GEMM_FRAG_ROWS, 32 * min(GEMM_FRAG_WARPS, n_cols // 256)
        elif path in TILE_PATHS:
            kernel, per, threads, shared = f"gemm_{path}_{suffix}", GEMM_TILE_ROWS, 32 * GEMM_TILE_WARPS, GEMM_TILE_SHARED
            self.device.allow_shared(kernel, shared)
        elif n_tok == 1 and group[0].ggml_type in X16_MMA_TYPES and n_cols >= MMA_MIN_COLS:
            kernel, per, threads = f"matvec_x16_mma_{suffix}", X16_MMA_ROWS, 32 * min(X16_MMA_WARPS, n_cols // 256)
            if self._sm90 and group[0].ggml_type in X16_BULK_TYPES and n_cols % X16_BULK_STAGE_COLS == 0 \
                    and all(w % 16 == 0 for w in weights[:len(group)]):
                kernel, threads, shared = f"matvec_x16_bulk_{suffix}", 32 * X16_MMA_WARPS, X16_BULK_SHARED
                most = X16_BULK_BLOCKS_AN_SM * self.device.info.multiprocessors
                if sum(-(-r // per) for r in rows) <= self.device.info.multiprocessors \
                        and n_cols >= X16_BULK_WIDE_MIN_COLS:
                    kernel, threads, shared = f"matvec_x16_bulk16_{suffix}", 32 * X16_BULK_WIDE_WARPS, X16_BULK_WIDE_SHARED
                    most = self.device.info.multiprocessors
                self.device.allow_shared(kernel, shared)
        else:  # kernels/matvec_x16.cu: 2 rows a block (one token: 4), a warp per 1,024 columns (32 units), at most 4
            kernel, per = (f"matvec_x16_1_{suffix}", X16_DECODE_ROWS) if n_tok == 1 else (f"matvec_x16_{suffix}", 2)
            threads = 32 * min(4, -(-n_cols // 1024))
        units, sms = sum(-(-r // per) for r in rows), self.device.info.multiprocessors
        if kernel == f"matvec_x16_1_{suffix}" and group[0].ggml_type in X16_WAVE_TWIN_TYPES \
                and X16_DECODE_BLOCKS_AN_SM * sms < units <= X16_DECODE_BLOCKS_AN_SM_64R * sms:
            kernel = f"matvec_x16_1w_{suffix}"  # one wave, so that it may write a norm's share (_may_write_norm)
        return Group(path, kernel, min(units, most or units), threads, weights, (*rows, *(0,) * absent, n_cols),
                     [0] * absent, rows, {}, shared)

    def _matmul(self, x: Tensor, plan: list[Group | tuple[Weight, str]], add: Tensor | None = None,
                qkv: bool = False) -> list[Tensor]:
        """The plan's launches; add summed into the one product there is where given. qkv: the weights may be q, k
        and v, whose last launch a rope may then take (HeldMatvec)."""
        outs: list[Tensor] = []
        dev = self.device
        pending = self._pending_norm
        if pending is not None and pending.out is x:
            if all(type(g) is Group and g.path == "x16" and self._reads_norm_cheaply(g) for g in plan):  # the decode matvecs
                self._fuse_norm(pending)
            else:
                dev.release()
        for g in plan:
            if type(g) is not Group:
                outs.append(self._matmul_one(x, *g, add))
                continue
            products = []
            for r in g.n_rows:
                y = self._new(x.rows, r)
                outs.append(y)
                products.append(y.ptr)
            products += g.absent
            products.append(add.ptr if add is not None else 0)
            if g.path == "blocks":
                tiles = -(-x.rows // 32)
                split = g.splits.get(tiles)
                if split is None:
                    split = g.splits[tiles] = gemm_splits(g.n_rows, g.rows[-1], tiles, GEMM_BLOCKS_AN_SM * dev.info.multiprocessors)
                z, splits = split
                dev.launch(g.kernel, (g.units, tiles, z), g.threads,
                           (*g.weights, x.ptr, *products, self._gemm_partials, self._counts, *g.rows, *splits, x.rows))
                continue
            if g.path == "frag":
                self._to_f16(x)
                dev.launch(g.kernel, (g.units, -(-x.rows // GEMM_FRAG_TOKENS)), g.threads, (*g.weights, self._xh, *products, *g.rows, x.rows))
                continue
            if g.path in TILE_PATHS:  # token tiles first: those sharing a weight's rows run together, its bytes read once
                self._to_f16(x, interleaved=True)
                dev.launch(g.kernel, (-(-x.rows // GEMM_TILE_TOKENS), g.units, GEMM_TILE_SPLITS if g.path == "tile_split" else 1),
                           g.threads, (*g.weights, self._xh, *products, *g.rows, x.rows), g.shared)
                continue
            src = self._x16_source(x)
            if x.rows != 1:  # passes of 8 tokens (none for a chunk of a prompt whose logits no one wants)
                dev.launch(g.kernel, (g.units, -(-x.rows // MATVEC_MAX_TOKENS)), g.threads,
                           (*g.weights, src.xq, src.xds, *products, *g.rows, x.rows))
                continue
            head, tail = (*g.weights, src.xq, src.xds, *products[:-1]), (*g.rows, src.sums, src.eps)
            args = (*head, products[-1], *tail)
            if qkv and g is plan[-1] and self._has_rope_form(g):
                mine = len(g.n_rows)
                held = self._held_matvec = HeldMatvec(tuple(outs[-mine:]), tuple(outs[:-mine]), g, head, tail)
                dev.hold(lambda: self._launch_matvec(held))
            elif add is not None and len(plan) == 1 and self._may_write_norm(g, src):
                # the residual stream: held for a norm of it, which this launch may take a share of (rms_norm)
                product = self._held_product = HeldProduct(outs[0], g.kernel, g.units, g.threads, args, g.shared)
                dev.hold(lambda: self._launch_product(product, NO_NORM))
            else:
                dev.launch(g.kernel, (g.units,), g.threads, args + NO_NORM, g.shared)
        return outs

    def _x16_source(self, x: Tensor) -> X16:
        """x's int16 blocks: made now, unless the op that made x wrote them or a matmul before took the same x
        (a tensor is final once the op making it returns, and holding it keeps its buffer's address)."""
        n = x.rows * x.cols
        made = self._x16_of
        if made is None or made[0] is not x or made[1] != n:
            self.device.launch("quantize_x16", (-(-n // 1024),), 256, (x.ptr, self._xq, self._xds, n))
            made = self._x16_of = (x, n, self._plain_x16)
        return made[2]

    def _may_write_norm(self, g: Group, src: X16) -> bool:
        """Whether a one-token launch may write a norm's share of its product (kernels/x16.cuh NormOut): one
        weight of whole groups of 32 rows, whose x is not a norm's blocks (it would overwrite them), and for
        matvec_x16_1 blocks that fit on the SMs at once."""
        rows = g.n_rows[0]
        return (self.fuse_norms and len(g.n_rows) == 1 and rows % 32 == 0 and rows <= self._x16_width and not src.sums
                and (not g.kernel.startswith("matvec_x16_1") or g.units <= x16_decode_blocks_an_sm(g.kernel) * self.device.info.multiprocessors))

    def _has_rope_form(self, g: Group) -> bool:
        """Whether a one-token launch's kernel has a form that ropes q and k (kernels/rope.cuh RopeOut): the int16
        matvec's where it makes v alone, or q, k and v in one wave of blocks (each block's ticket, a fence, held a
        second wave back: H200, Qwen3-8B Q8_0's 1,536 blocks, decode 333 -> 320 tok/s, docs/perf-notes.md run 34);
        the bulk matvec's where it makes q, k and v, each block at most one group of rows (it ropes a block's one due
        head)."""
        if not self.fuse_ropes:
            return False
        if g.kernel.startswith("matvec_x16_bulk_"):
            return len(g.n_rows) == 3 and g.units == sum(-(-r // X16_MMA_ROWS) for r in g.n_rows)
        return g.kernel.startswith("matvec_x16_1_") and (len(g.n_rows) == 1 or g.units <= self._x16_wave(g))

    def _launch_matvec(self, held: HeldMatvec) -> None:
        if self._held_matvec is held:
            self._held_matvec = None
        g = held.group
        self.device.launch(g.kernel, (g.units,), g.threads, held.head + (0,) + held.tail + NO_NORM, g.shared)

    def _reads_norm_cheaply(self, g: Group) -> bool:
        """Whether a one-token launch may read a norm's output as its blocks (kernels/x16.cuh norm_scale): each block
        sums the norm's group sums before its products, which on a launch of many waves of int16 blocks costs more than
        the norm's own launch (H200, run 32: 8B's output head, 37,984 blocks, 187 us a step reading them against 164
        after a norm of 5). A wave: the launch bounds' registers hold that many blocks of 4 warps an SM, or more
        narrower ones (Qwen3.5-0.8B's gate and up: 1,792 blocks of one warp, under one wave: _x16_wave)."""
        return not g.kernel.startswith("matvec_x16_1") or g.units <= X16_NORM_READER_MAX_WAVES * self._x16_wave(g)

    def _x16_wave(self, g: Group) -> int:
        """The blocks of a one-token int16 launch the SMs hold at once: its launch bounds' registers hold that many
        blocks of 4 warps an SM, or more narrower ones (Qwen3.5-0.8B's gate and up: 1,792 blocks of one warp)."""
        resident = min(RESIDENT_BLOCKS_CAP, x16_decode_blocks_an_sm(g.kernel) * X16_THREADS // g.threads)
        return resident * self.device.info.multiprocessors

    def _matmul_one(self, x: Tensor, weight: Weight, path: str, add: Tensor | None) -> Tensor:
        """The kernels that take one weight: the float matvec passes and the long-prompt GEMM."""
        out = self._new(x.rows, weight.n_rows)
        w, suffix = self._ready(weight), kernel_suffix(weight.ggml_type)
        if path == "f16":
            self._matmul_f16(x, weight, out, suffix, add)
            return out
        # kernels/matvec.cu: 2 rows a block, a warp per 512 columns (32 pieces), at most 4
        n_rows, n_cols = weight.n_rows, weight.n_cols
        self.device.launch(f"matvec_{suffix}", (-(-n_rows // 2), -(-x.rows // MATVEC_MAX_TOKENS)), 32 * min(4, -(-n_cols // 512)),
                           (w, x.ptr, out.ptr, n_rows, n_cols, x.rows))
        return out if add is None else self.add(add, out)

    def _matmul_f16(self, x: Tensor, weight: Weight, out: Tensor, suffix: str, add: Tensor | None) -> None:
        """Long prompts (kernels/gemm_f16.cu): x rounded to f16 once (q, k and v share it), as many
        weight rows as the scratch holds dequantized to f16, then the tensor-core GEMM writes their
        columns of out (add's summed in); repeated until every row is done."""
        dev, k, t = self.device, weight.n_cols, x.rows
        self._to_f16(x)
        step = max(2, self._w16_bytes // (2 * k) // 2 * 2)  # even: out's float2 stores stay 8-byte aligned
        for r0 in range(0, weight.n_rows, step):
            rows = min(step, weight.n_rows - r0)
            dev.launch(f"dequant_f16_{suffix}", (-(-rows * (k // 32) // 256),), 256, (weight.ptr, self._w16, r0, rows, k))
            big = -(-rows // 128) * -(-t // 128) >= dev.info.multiprocessors
            tile = 128 if big else 64
            dev.launch(f"gemm_f16_{tile}", (-(-rows // tile), -(-t // tile)), 256 if big else 128,
                       (self._w16, self._xh, out.ptr + 4 * r0, add.ptr + 4 * r0 if add is not None else 0,
                        rows, k, t, weight.n_rows))

    def _to_f16(self, x: Tensor, interleaved: bool = False) -> None:
        """x rounded to f16 in the scratch (kernels/gemm_f16.cu to_f16; interleaved: each 4 values' middle two
        swapped, kernels/gemm_tile.cu to_f16_interleaved), unless it holds this x so already."""
        held = self._xh_of
        if held is None or held[0] is not x or held[1] != interleaved:
            self._launch_f16(x, self._xh, interleaved)
            self._xh_of = (x, interleaved)

    def _launch_f16(self, x: Tensor, out: int, interleaved: bool) -> None:
        n = x.rows * x.cols
        self.device.launch("to_f16_interleaved" if interleaved else "to_f16", (-(-n // 1024),), 256, (x.ptr, out, n))

    def _elementwise(self, kernel: str, a: Tensor, b: Tensor) -> Tensor:
        out = self._new(a.rows, a.cols)
        n = a.rows * a.cols
        self.device.launch(kernel, (-(-n // 256),), 256, (a.ptr, b.ptr, out.ptr, n))
        return out

    def add(self, a: Tensor, b: Tensor) -> Tensor:
        return self._elementwise("add_f32", a, b)

    def swiglu(self, gate: Tensor, up: Tensor) -> Tensor:
        out = self._new(gate.rows, gate.cols)
        n = gate.rows * gate.cols
        self.device.launch("swiglu_f32", (-(-n // 256),), 256, (gate.ptr, up.ptr, out.ptr, n) + self._x16_beside(out))
        return out

    def rope(self, x: Tensor, positions: Sequence[int], head_dim: int, rope: Rope, freq_factors: Weight | None = None,
             norm: tuple[Weight, float] | None = None) -> Tensor:
        return self.ropes((x,), positions, head_dim, rope, freq_factors, (norm,))[0]

    def ropes(self, xs: Sequence[Tensor], positions: Sequence[int], head_dim: int, rope: Rope,
              freq_factors: Weight | None = None, norms: Sequence[tuple[Weight, float] | None] | None = None) -> list[Tensor]:
        """kernels/elementwise.cu rope_f32 and deepseek2's YaRN (kernels/mla.cu rope_yarn_f32, whose norms
        run before it) take two tensors (q and k) of the same tokens a launch."""
        norms = norms or (None,) * len(xs)
        if rope.n_rot > ROPE_MAX_DIMS:
            raise ReflexError(f"RoPE of {rope.n_rot} dims a head: the CUDA kernels rotate at most {ROPE_MAX_DIMS}")
        if self._positions is None or self._positions[0] is not positions:
            self._positions = (positions, self._upload_ints("positions", positions))
            self._angles_of = None
        block = min(256, 32 * -(-(rope.n_rot // 2) // 32))
        common = (self._positions[1], self._ready(freq_factors) if freq_factors else 0, head_dim, rope.n_rot,
                  rope.mode is RopeMode.NEOX, rope.base, rope.freq_scale)
        if rope.ext_factor != 0.0 or rope.magnitude != 1.0:
            xs = [x if norm is None else self.rms_norm(x, *norm) for x, norm in zip(xs, norms)]
            outs = [self._new(x.rows, x.cols) for x in xs]
            pairs = list(zip(xs, outs))
            for run in [pairs] if len(xs) == 2 and xs[0].rows == xs[1].rows else [[pair] for pair in pairs]:
                # (x, its heads' stride, y, heads) of each tensor, a second one absent (0, 0, 0, 0)
                (x0, s0, y0, h0), (x1, s1, y1, h1) = [(*_address_stride(x, head_dim), y.ptr, x.cols // head_dim) for x, y in run] \
                    + [(0, 0, 0, 0)] * (2 - len(run))
                self.device.launch("rope_yarn_f32", (run[0][0].rows, h0 + h1), block,
                                   (x0, y0, h0, x1, y1, *common) + yarn_args(rope) + (s0, s1))
            return outs
        if len(xs) > 2 or (len(xs) == 2 and (xs[0].rows != xs[1].rows or (norms[0] and norms[1] and norms[0][1] != norms[1][1]))):
            return [self.ropes((x,), positions, head_dim, rope, freq_factors, (n,))[0] for x, n in zip(xs, norms)]
        matvec = self._rope_rides_on(xs, head_dim)
        if matvec is not None:
            self.device.take_held()  # made below with this rope, or as it is before it
        outs = [self._new(x.rows, x.cols) for x in xs]
        # (x, y, norm weight) of each tensor, an absent second one (0, 0, 0); one eps serves both
        runs = [_address_stride(x, head_dim) for x in xs] + [(0, 0)]
        parts = [(address, y.ptr, self._ready(n[0]) if n else 0) for (address, _), y, n in zip(runs, outs, norms)] + [(0, 0, 0)]
        eps = next((n[1] for n in norms if n), 0.0)
        # the pass's first rope works out its tokens' angles into the table (in double: pow and sincos), the
        # rest of the pass reads them, which the stream's order makes safe: every later rope runs after it
        angles_of = (common[0], common[1], rope.n_rot, rope.base, rope.freq_scale)
        ready, self._angles_of = angles_of == self._angles_of, angles_of
        rope_args = ()
        if matvec is not None and ready:  # the angles made by the pass's first rope: the launch making v may make this one
            (q, _, q_norm), (k, _, k_norm) = parts[:2]
            rope_args = (q, k, outs[0].ptr, outs[1].ptr, q_norm, k_norm, xs[0].cols // head_dim, xs[1].cols // head_dim,
                         head_dim, rope.n_rot, rope.mode is RopeMode.NEOX, eps, self._angles)
        rope = HeldRope(tuple(xs), tuple(outs), (xs[0].rows, sum(x.cols for x in xs) // head_dim), block,
                        (*parts[0], xs[0].cols // head_dim, *parts[1], *common, eps, runs[0][1], runs[1][1], self._angles, ready),
                        matvec, rope_args)
        # held back: the attention after q and k's rope writes k and v to its cache in this launch (attention)
        self._held_rope = rope
        self.device.hold(lambda: self._launch_rope(rope, NO_CACHE_WRITE))
        return outs

    def _rope_rides_on(self, xs: Sequence[Tensor], head_dim: int) -> HeldMatvec | None:
        """The held launch of q, k and v's matmuls (HeldMatvec) if the rope of xs may be made by it: one token's q and k
        as they came, heads of a multiple of 32 features, both made by that launch (its weights 0 and 1, v its 2) or
        both before it (v its one weight)."""
        held = self._held_matvec
        if held is None or len(xs) != 2 or xs[0].rows != 1 or head_dim % 32 \
                or any(type(x) is not Tensor or x.cols % head_dim for x in xs) \
                or (xs[0].cols + xs[1].cols) // head_dim > 2 * -(-self._x16_width // 32):
            return None
        q, k = xs
        if held.outs[:2] == (q, k) and len(held.outs) == 3 or len(held.outs) == 1 and (q, k) == held.before[-2:]:
            return held
        return None

    def _launch_rope(self, rope: HeldRope, cache_write: tuple) -> None:
        if self._held_rope is rope:
            self._held_rope = None
        if rope.matvec is not None:
            self._launch_matvec(rope.matvec)
        self.device.launch("rope_f32", rope.grid, rope.block, rope.args + cache_write)

    def _launch_matvec_rope(self, rope: HeldRope, cache: KVCache, layer: int) -> None:
        """The held launch making v in its rope form (kernels/rope.cuh RopeOut): q and k's rope and the cache's writes
        in it, no rope_f32 or kv_store launch between it and the attention. One launch and its wait fewer a layer."""
        if self._held_rope is rope:
            self._held_rope = None
        held = rope.matvec
        if self._held_matvec is held:
            self._held_matvec = None
        g = held.group
        kernel = g.kernel.replace("_x16_1_", "_x16_1_rope_").replace("_x16_bulk_", "_x16_bulk_rope_")
        if g.shared:
            self.device.allow_shared(kernel, g.shared)
        # q and k the launch's own: a ticket a head; made before it: a block a head past v's
        shared = len(held.outs) == 3
        self.device.launch(kernel, (g.units + (0 if shared else rope.grid[1]),), g.threads, held.head + held.tail + rope.rope_args
                           + (cache.k[layer], cache.v[layer], cache.segments, self._segments, self._start,
                              self._head_tickets if shared else 0), g.shared)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, cache: KVCache, layer: int, batch: Batch,
                  n_heads: int, n_kv_heads: int, scale: float) -> Tensor:
        dev, t = self.device, q.rows
        rope = self._held_rope  # the device holds its launch back while it is set (_launch_rope clears it)
        if rope is not None and rope.outs == (q, k):
            dev.take_held()  # made below, writing k and v to the cache as kv_store would
            self._held_rope = None
        else:
            rope = None
        if layer == cache.shape.kv_layers[0]:  # every layer's pass has the same slots
            self._segments = self._upload_ints("segments", batch.segments)
            self._start = self._upload_ints("start", [batch.start])
        dk, dv = k.cols // n_kv_heads, v.cols // n_kv_heads
        if rope is not None and rope.rope_args and v is rope.matvec.outs[-1]:
            self._launch_matvec_rope(rope, cache, layer)
        elif rope is not None:
            self._launch_rope(rope, (cache.k[layer], cache.v[layer], v.ptr, v.cols, cache.segments, self._segments, self._start))
        else:
            dev.launch("kv_store", (t,), 256, (k.ptr, v.ptr, cache.k[layer], cache.v[layer], cache.segments, self._segments,
                                               self._start, t, k.cols, v.cols, k.cols, v.cols))
        out = self._new(t, n_heads * dv)
        args = (q.ptr, cache.k[layer], cache.v[layer], cache.segments, self._segments,
                out.ptr, self._start, t, n_heads, n_kv_heads, dk, dv, scale)
        if t >= PREFILL_ATTENTION_MIN_TOKENS and dk == dv and dk in PREFILL_ATTENTION_WIDTHS:
            dev.launch("attention_prefill_256" if dk == 256 else "attention_prefill", (-(-t // 64), n_heads), 128, args)
        else:  # decode and short batches: blocks per (query, head) split the slots
            # a decode step's grid is its bucket's (decode_slots), so that one captured graph replays at every
            # position of it and eager steps split alike; a short prompt splits the slots it reaches (16 tokens
            # into an empty cache: one split, which writes out itself, and no merge)
            slots = min(cache.shape.capacity, decode_slots(batch.start)) if t == 1 else batch.start + t
            splits = max(-(-slots // ATTENTION_SPLIT_TARGET), min(ATTENTION_MIN_SPLITS, -(-slots // ATTENTION_SPLIT_SLOTS)))
            if self._sm90 and 1 < splits <= ATTENTION_CLUSTER_SPLITS:
                # the same cut of the slots (fewer splits are of ATTN_SPLIT_MIN_SLOTS: the cluster's last blocks
                # get none), and no partials in memory to bound them
                kernel, splits = "attention_cluster", ATTENTION_CLUSTER_SPLITS
            elif t == 1 and splits > ATTENTION_MIN_SPLITS and dk == dv and dk in (64, 128) \
                    and ATTENTION_GROUP_MIN <= n_heads // n_kv_heads <= ATTENTION_GROUP_MAX:
                # as many as the partials' scratch holds, and an even count: the partials' weighted V (after a
                # float2 a head and split) then lie at 16-byte addresses, which the merge reads 16 bytes at a time
                splits = min(ATTENTION_MAX_SPLITS, -(-slots // ATTENTION_GROUP_SPLIT_SLOTS),
                             ATTENTION_PARTIALS_BYTES // (4 * n_heads * (dv + 2)))
                kernel, splits = "attention_group", splits - splits % 2
            else:
                kernel = "attention"
                if t == 1 and splits > ATTENTION_MIN_SPLITS:
                    splits = ATTENTION_BLOCKS_AN_SM * dev.info.multiprocessors // n_heads
                splits = max(1, min(ATTENTION_MAX_SPLITS, splits, ATTENTION_PARTIALS_BYTES // (4 * t * n_heads * (dv + 2))))
                if t * n_heads > SPLIT_COUNTS:
                    splits = 1
            # out's int16 blocks beside it, from the one split or the one that merges several
            beside = self._x16_beside(out) if dv % 32 == 0 else (0, 0)
            grid = (1, n_kv_heads, splits) if kernel == "attention_group" else (t, n_heads, splits)
            dev.launch(kernel, grid, 128, args + (self._partials, self._counts, *beside))
        return out

    def take_rows(self, x: Tensor, rows: Sequence[int]) -> Tensor:
        if len(rows) == x.rows and all(r == i for i, r in enumerate(rows)):
            return x  # every row, in order (a decode step's logits row): nothing to copy
        out = self._new(len(rows), x.cols)
        ptr = self._upload_ints("rows", rows)
        self.device.launch("take_rows_f32", (len(rows),), 256, (x.ptr, ptr, out.ptr, x.cols))
        return out

    def to_host(self, x: Tensor):
        import numpy as np  # only `logits()` and `check` come here, never the generate path

        out = np.empty((x.rows, x.cols), np.float32)
        self.device.download(out.ctypes.data, x.ptr, out.nbytes)
        return out

    def new_sampler(self, params):
        from .sampler import CudaSampler

        return CudaSampler(self, params)

    def token_logprobs(self, logits: Tensor, pairs: Sequence[tuple[int, int]]) -> list[float]:
        n = len(pairs)
        if n > MAX_BATCH or logits.rows > MAX_BATCH:
            raise ReflexError(f"internal error: {n} log-probabilities asked of one pass (at most {MAX_BATCH})")
        if not n:
            return []
        lse, out = self._f64, self._f64 + 8 * MAX_BATCH
        rows = self._upload_ints("rows", [r for r, _ in pairs])
        tokens = self._upload_ints("pairs", [t for _, t in pairs])
        dev = self.device
        dev.launch("row_logsumexp", (logits.rows,), 1024, (logits.ptr, logits.cols, lse))
        dev.launch("gather_logprobs", (-(-n // 256),), 256, (logits.ptr, logits.cols, rows, tokens, lse, n, out))
        host = (ctypes.c_double * n)()
        dev.download(ctypes.addressof(host), out, 8 * n)
        return list(host)

    def top_logprobs(self, logits: Tensor, row: int, k: int) -> list[tuple[int, float]]:
        if not 0 < k <= min(TOP_K_MAX, logits.cols):
            raise ReflexError(f"internal error: top {k} log-probabilities of a {logits.cols}-token row (1..{TOP_K_MAX})")
        x, dev, lse = logits.row(row), self.device, self._f64
        ids_at, values_at, stats_at = self._top, self._top + 4 * TOP_K_MAX, self._top + 8 * TOP_K_MAX
        dev.launch("row_logsumexp", (1,), 1024, (x, logits.cols, lse))
        dev.launch("top_k", (1,), 1024, (x, logits.cols, k, ids_at, values_at, stats_at))
        ids, values, total = (ctypes.c_int32 * k)(), (ctypes.c_float * k)(), ctypes.c_double()
        dev.download(ctypes.addressof(ids), ids_at, 4 * k)
        dev.download(ctypes.addressof(values), values_at, 4 * k)
        dev.download(ctypes.addressof(total), lse, 8)
        return [(token, value - total.value) for token, value in zip(ids, values)]

    # -- KV state files (kvstate.py) -------------------------------------------------------------

    def export_cache(self, cache: KVCache, n_tokens: int):
        """K and V in the cache's f16; a recurrent layer's states in their f32."""
        kv = cache.shape.kv_layers
        for i in range(cache.shape.n_layers):
            if i not in kv:
                for kind, ptr, shape in cache.states(i):
                    host = bytearray(4 * math.prod(shape))
                    self.device.download(buffer_address(memoryview(host)), ptr, len(host))
                    yield StateArray(f"blk.{i}.{kind}", "f32", shape, host)
                continue
            for kind, ptr, width in cache.arrays(i):
                host = bytearray(2 * n_tokens * width)  # slots 0..n-1 are the first rows: one copy
                if host:
                    self.device.download(buffer_address(memoryview(host)), ptr, len(host))
                yield StateArray(f"blk.{i}.{kind}", "f16", (n_tokens, width), host)

    def import_cache(self, cache: KVCache, arrays, n_tokens: int) -> None:
        """f16 arrays go from the file mapping straight to the cache; f32 ones (a file made on the
        CPU) pass through activation buffers and kv_store, which rounds them as a pass does."""
        dev, shape = self.device, cache.shape
        for i in range(shape.n_layers):
            if i not in shape.kv_layers:
                for kind, ptr, _ in cache.states(i):
                    a = arrays[f"blk.{i}.{kind}"]
                    if a.dtype != "f32":
                        raise ReflexError(f"the KV state's recurrent array blk.{i}.{kind} is {a.dtype}: the CUDA backend reads f32 ones")
                    view = memoryview(a.data).cast("B")
                    dev.upload(ptr, buffer_address(view), view.nbytes)  # pageable: staged before it returns
                continue
            parts = [(arrays[f"blk.{i}.{kind}"], ptr) for kind, ptr, _ in cache.arrays(i)]
            v_width = 0 if shape.latent else shape.v_width
            if parts[0][0].dtype == "f16":
                for a, ptr in parts:
                    view = memoryview(a.data).cast("B")
                    dev.upload(ptr, buffer_address(view), view.nbytes)  # pageable: staged before it returns
                continue
            for a in range(0, n_tokens, MAX_BATCH):
                rows = min(MAX_BATCH, n_tokens - a)
                kt = self._rows_from_host(parts[0][0], a, rows)
                vt = self._rows_from_host(parts[1][0], a, rows) if len(parts) > 1 else kt  # latent: no value rows
                segs, start = self._upload_ints("segments", [0] * rows), self._upload_ints("start", [a])
                dev.launch("kv_store", (rows,), 256, (kt.ptr, vt.ptr, cache.k[i], cache.v[i], cache.segments, segs, start,
                                                      rows, shape.k_width, v_width, shape.k_width, v_width))
                del kt, vt
        if n_tokens:
            dev.drv.cuMemsetD32Async(cache.segments, 0, n_tokens, dev.stream)

    def _rows_from_host(self, a: StateArray, first: int, rows: int) -> Tensor:
        """Rows first..first+rows-1 of an f32 state array, on the device."""
        width = a.shape[1]
        part = memoryview(a.data).cast("B")[4 * first * width : 4 * (first + rows) * width]
        out = self._new(rows, width)
        self.device.upload(out.ptr, buffer_address(part), part.nbytes)
        return out


def _dequantized(data, ggml_type: GGMLType, dtype: str) -> bytes:
    """Types without kernels: dequantized on the host (numpy, only for such files) once at load."""
    from ...quants import dequantize

    return dequantize(data, ggml_type).astype(dtype).tobytes()

