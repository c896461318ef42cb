"""The Ops protocol: the primitives architecture code may call, and the batch it runs on.

Architecture modules (`arch/`) express a forward pass only through these calls; each backend
(`backends/cpu` now, `backends/cuda` next) implements them on tensors it owns. Activations
are 2-D, (T, features), with heads laid out contiguously inside the feature axis, so no op
needs a reshape and a device backend can keep every buffer it allocates up front.

Shapes below: T tokens in the batch, E embedding width, H query heads, Hkv key/value heads,
dk / dv key / value head widths, V vocabulary.
"""
from __future__ import annotations

from enum import Enum
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Protocol, Sequence

Tensor = Any  # a backend's activation: numpy array on the CPU, device buffer on CUDA
Weight = Any  # a backend's prepared weight (see Ops.load_weight)


class RopeMode(Enum):
    NORM = "norm"  # rotate adjacent pairs (2i, 2i+1): llama, deepseek2
    NEOX = "neox"  # rotate (i, i + n_rot/2): qwen3, qwen3moe


class Rope(NamedTuple):
    mode: RopeMode
    n_rot: int  # leading dims of each head that rotate
    base: float
    freq_scale: float = 1.0  # linear scaling: positions are multiplied by it
    # YaRN (ggml's rope_yarn): with ext_factor 1, pair i's angle blends the interpolated
    # (freq_scale) and the original one by a ramp between the pairs whose wavelengths fit
    # beta_fast and beta_slow times into n_ctx_orig; 0 is plain linear scaling.
    ext_factor: float = 0.0
    n_ctx_orig: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    magnitude: float = 1.0  # cos and sin are multiplied by it (YaRN's attention factor)


class Gating(Enum):
    """How router logits become expert probabilities (GGUF `expert_gating_func`: 1, 2)."""

    SOFTMAX = 1  # over all experts: qwen3moe, DeepSeek-V2
    SIGMOID = 2  # each expert on its own: DeepSeek-V3


class Routing(NamedTuple):
    """How a token's experts are chosen and weighted, as llama.cpp's build_moe_ffn does it:
    p = gating(logits); s = p + bias; keep the n_groups_used groups whose top-2 s sum highest;
    take the top n_used of s; weights are the unbiased p of those, optionally renormalised
    (w / max(sum w, 2^-14)) and scaled."""

    n_used: int  # experts per token (top-k)
    gating: Gating = Gating.SOFTMAX
    norm: bool = False
    scale: float = 1.0  # routed scaling factor; 0 and 1 mean none
    n_groups: int = 1  # experts split into this many equal groups (DeepSeek-V3's n_group)
    n_groups_used: int = 1


class Routes(NamedTuple):
    """Each token's chosen experts, best first (ties: the lower expert id), and their weights."""

    experts: Any  # (T, n_used) expert ids
    weights: Any  # (T, n_used) float32


class Batch(NamedTuple):
    """Tokens evaluated together, and where they land in the cache.

    Token i is written to cache slot `start + i` and attends to the slots before it whose
    segment is 0 (the shared prefix) or equal to its own. With every segment 0 this is
    plain causal attention; system1 gives each candidate its own segment so candidates see
    the prompt and themselves, never each other.
    """

    tokens: Sequence[int]
    positions: Sequence[int]  # RoPE positions; candidates restart after the prompt
    segments: Sequence[int]
    start: int  # first cache slot

    @classmethod
    def causal(cls, tokens: Sequence[int], start: int) -> Batch:
        n = len(tokens)
        return cls(tokens, range(start, start + n), (0,) * n, start)


class Sampled(tuple):
    """A batch's tokens that a device chose itself and the host has not read yet (the sampler's
    `ahead`): a pass reads them where the choice left them."""


SAMPLED = Sampled((0,))  # one token: the last one the sampler's `ahead` chose


class RecurrentShape(NamedTuple):
    """The fixed-size state of a Gated DeltaNet layer, whatever the context length: the conv's last
    K-1 inputs (K-1, channels) and the delta rule's S (n_v_heads, k_dim, v_dim)."""

    layers: tuple[int, ...]  # the layers that hold this state instead of K and V
    conv_rows: int  # K - 1
    channels: int  # the conv's width: q, k and v of every head
    n_v_heads: int
    k_dim: int
    v_dim: int

    @property
    def nbytes(self) -> int:
        """Every layer's conv and delta-rule states as float32, what both backends hold."""
        return 4 * len(self.layers) * (self.conv_rows * self.channels + self.n_v_heads * self.k_dim * self.v_dim)


class CacheShape(NamedTuple):
    """Per layer, K (capacity, k_width) and V (capacity, v_width). A latent cache (MLA) holds one
    row per token, (capacity, k_width), whose first v_width features are also the values. The
    `recurrent` layers hold no K and V but a RecurrentShape state."""

    n_layers: int
    capacity: int
    k_width: int
    v_width: int
    latent: bool = False
    recurrent: RecurrentShape | None = None

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers whose cache grows by a row of K and V a token."""
        skip = self.recurrent.layers if self.recurrent else ()
        return tuple(i for i in range(self.n_layers) if i not in skip)


class StateArray(NamedTuple):
    """A named array of a cache's contents, as KV state files (kvstate.py) hold them. An attention
    cache of n tokens is `blk.{i}.k` (n, k_width) and `blk.{i}.v` (n, v_width) per layer; a
    latent one `blk.{i}.kv` (n, k_width); a recurrent layer's state after the n tokens
    `blk.{i}.conv` (K-1, channels) and `blk.{i}.ssm` (n_v_heads, k_dim, v_dim)."""

    name: str
    dtype: str  # "f32" or "f16"
    shape: tuple[int, ...]
    data: Any  # C-order little-endian bytes: a buffer (memoryview, numpy array, bytearray)


class Ops(Protocol):
    max_batch: int  # tokens one forward pass may hold; the engine splits longer batches

    def reserve(self, tensors: Sequence[tuple[Any, tuple[int, ...]]], cache: CacheShape, activation_width: int) -> None:
        """Before loading: check that these (ggml_type, shape) weights, a cache of that shape and
        activations of `activation_width` float32 values per token fit; a one-line error if not."""

    def load_weight(self, name: str, ggml_type, shape: tuple[int, ...], data: memoryview) -> Weight:
        """Take a tensor's raw blocks as stored (ggml `shape`, innermost first)."""

    def commit_weights(self) -> int:
        """After the last load_weight: the weights may be used from now on (a device backend's
        copies may still be in flight: each op waits for its own). Returns the bytes being copied
        to a device (0 where nothing is). load_weight's data stays alive until weights_arrived."""

    def weights_arrived(self) -> float | None:
        """Wait until every committed weight is on the device: the ms from the commit to the last
        copy's end (None where nothing was copied)."""

    def replayable(self, forward: Callable[[Batch, Sequence[int]], Tensor]) -> Callable[[Batch, Sequence[int]], Tensor]:
        """forward(batch, out_rows) -> logits (len(out_rows), V), as a function the backend may
        record for a batch's shape and replay for later batches of that shape (CUDA graphs):
        forward must do nothing but call ops."""

    def new_kv_cache(self, shape: CacheShape) -> Any:
        """The cache, made once per model and reused by every request: K, V and slot segments."""

    def embed(self, table: Weight, tokens: Sequence[int]) -> Tensor:
        """Rows of the (V, E) table -> (T, E). tokens is SAMPLED only on a backend whose sampler's
        `ahead` chose it (new_sampler)."""

    def rms_norm(self, x: Tensor, weight: Weight, eps: float) -> Tensor:
        """x (T, n*d), weight (d,): normalize each group of d features (d = n*d: whole row)."""

    def matmul(self, x: Tensor, weight: Weight, add: Tensor | None = None) -> Tensor:
        """x (T, in) times a stored (out, in) weight -> (T, out); add + that where add (T, out) is
        given (the residual stream: a backend may sum it in the product's own kernel)."""

    def matmuls(self, x: Tensor, weights: Sequence[Weight]) -> list[Tensor]:
        """[matmul(x, w) for w in weights], the same values: several weights reading one x (q, k and
        v; gate and up) may share a launch."""

    def add(self, a: Tensor, b: Tensor) -> Tensor:
        """Elementwise a + b (the residual stream)."""

    def swiglu(self, gate: Tensor, up: Tensor) -> Tensor:
        """silu(gate) * up, both (T, F)."""

    def rope(self, x: Tensor, positions: Sequence[int], head_dim: int, rope: Rope,
             freq_factors: Weight | None = None, norm: tuple[Weight, float] | None = None) -> Tensor:
        """Rotate the first rope.n_rot dims of every head of x (T, n*head_dim); pair i's angle
        is divided by freq_factors[i] (n_rot/2,) when given (Llama 3.1's `rope_freqs`). norm:
        (weight (head_dim,), eps) to RMS-normalize each head first (Qwen3's q and k norms), as
        rms_norm(x, weight, eps) would, in the same op."""

    def ropes(self, xs: Sequence[Tensor], positions: Sequence[int], head_dim: int, rope: Rope,
              freq_factors: Weight | None = None, norms: Sequence[tuple[Weight, float] | None] | None = None) -> list[Tensor]:
        """[rope(x, ..., norm=n) for x, n in zip(xs, norms)], the same values: the q and k of one
        batch may share a launch."""

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, cache: Any, layer: int, batch: Batch,
                  n_heads: int, n_kv_heads: int, scale: float) -> Tensor:
        """Write k (T, Hkv*dk), v (T, Hkv*dv) to the cache at batch.start, then attend:
        q (T, H*dk) -> (T, H*dv). Query head h reads KV head h // (H / Hkv)."""

    def route(self, logits: Tensor, routing: Routing, bias: Weight | None = None) -> Routes:
        """Router logits (T, n_expert) -> Routes (see Routing); bias (n_expert,) is added to the
        probabilities for the choice only (DeepSeek-V3's `exp_probs_b`)."""

    def moe_ffn(self, x: Tensor, routes: Routes, *, gate: Weight, up: Weight, down: Weight, add: Tensor | None = None) -> Tensor:
        """x (T, E) -> (T, E): sum over j of weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t),
        e = experts[t, j]; gate and up are stored (n_expert, F, E), down (n_expert, E, F) (ggml
        shapes {E, F, n_expert} and {F, E, n_expert}). Only the chosen experts are read. add + that
        where add (T, E) is given (the residual stream, as matmul's)."""

    def split(self, x: Tensor, n_heads: int, widths: Sequence[int]) -> tuple[Tensor, ...]:
        """x (T, n_heads * sum(widths)), each head's features cut in that order -> one
        (T, n_heads * w) per width w."""

    def concat(self, parts: Sequence[Tensor], n_heads: int) -> Tensor:
        """The inverse of split: per head, the parts' features one after the other."""

    def head_matmul(self, x: Tensor, weight: Weight) -> Tensor:
        """x (T, H*in) times a per-head stored (H, out, in) weight, head h by its own matrix
        -> (T, H*out)."""

    def latent_attention(self, q: tuple[Tensor, Tensor], kv: tuple[Tensor, Tensor], *, cache: Any, layer: int,
                         batch: Batch, n_heads: int, scale: float) -> Tensor:
        """MLA's absorbed attention, multi-query over one latent row per token: kv = (c (T, v_width),
        k_rope (T, r)) written to the latent cache at batch.start as rows [c ; k_rope] of k_width =
        v_width + r; keys are the cached rows, values their first v_width features. q = (q_lat
        (T, H*v_width), q_rope (T, H*r)), each head's query the concat of its two parts -> (T, H*v_width).
        Parts, not concatenated rows: a backend reads them where the model made them."""

    # -- Gated DeltaNet (qwen35, qwen3next): a recurrent state per layer instead of K and V. A batch
    # with start 0 begins a sequence from the zero state; any other continues the state as the
    # last batch (or import_cache, or rewind_state) left it, whatever start says.

    def sigmoid_gate(self, x: Tensor, gate: Tensor) -> Tensor:
        """x * sigmoid(gate): gate (T, F) as x, or (T, 1) for one gate a token."""

    def l2_norm(self, x: Tensor, head_dim: int, eps: float) -> Tensor:
        """x (T, n*head_dim): each head divided by sqrt(sum of its squares + eps)."""

    def causal_conv1d(self, x: Tensor, weight: Weight, *, cache: Any, layer: int, batch: Batch) -> Tensor:
        """silu(y), y_c(t) = sum_j weight[c, j] * x_c(t - K + 1 + j): a depthwise causal conv over
        x (T, C) with a stored (C, K) weight (ggml {K, C}), whose inputs before the batch are the
        layer's conv state (the last K-1 rows; zeros at start 0), which it then holds."""

    def gdn_gates(self, alpha: Tensor, beta: Tensor, *, dt_bias: Weight, ssm_a: Weight) -> tuple[Tensor, Tensor]:
        """alpha, beta (T, H) -> (g, b): the log-decay g = ssm_a * softplus(alpha + dt_bias) and
        the write strength b = sigmoid(beta); ssm_a (H,) is -exp(A_log), dt_bias (H,)."""

    def delta_rule(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, cache: Any, layer: int,
                   batch: Batch, tiled: bool, scale: float) -> Tensor:
        """The gated delta rule over the batch, from the layer's state S (H, dk, dv), per value
        head h and token t: S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T (scale q).
        q, k (T, Hk*dk), v (T, H*dv), g and beta (T, H) -> o (T, H*dv); value head h reads key
        head h % Hk if tiled (qwen35's converter order), else h // (H / Hk) (qwen3next)."""

    def checkpoint_state(self, cache: Any) -> None:
        """Keep a copy of every recurrent layer's state (system1: the prompt's, before a candidate)."""

    def rewind_state(self, cache: Any) -> None:
        """Put the checkpointed recurrent states back (K and V need none: segments mask them)."""

    def take_rows(self, x: Tensor, rows: Sequence[int]) -> Tensor:
        """x[rows]: only the positions whose logits are wanted reach the LM head."""

    def to_host(self, x: Tensor):
        """A float32 numpy array of x (for `Model.logits` and `check`; generation never needs it)."""

    def new_sampler(self, params) -> Any:
        """A callable (logits (N, V), token history) -> the next token id after the last row; it
        may apply the penalties to that row in place. Its `ahead(logits)` starts the same choice
        without waiting for it where the device can make it alone (greedy, no penalties): it
        returns a function that waits and returns the token, and until the next choice a batch of
        SAMPLED reads that token on the device; None where the choice needs the host."""

    def token_logprobs(self, logits: Tensor, pairs: Sequence[tuple[int, int]]) -> list[float]:
        """log softmax(logits[row])[token] for each (row, token) pair, computed in float64."""

    def top_logprobs(self, logits: Tensor, row: int, k: int) -> list[tuple[int, float]]:
        """The k (1..256) likeliest tokens of logits[row], likeliest first (ties: lower id), as
        (token, log softmax in float64) pairs."""

    def export_cache(self, cache: Any, n_tokens: int) -> Iterator[StateArray]:
        """Slots 0..n_tokens-1 of every layer's K and V (and the recurrent layers' states, which
        must be those after those n tokens), one array at a time, in the cache's own dtype; each
        array's buffer stays valid until the next is asked for."""

    def import_cache(self, cache: Any, arrays: Mapping[str, StateArray], n_tokens: int) -> None:
        """Write such arrays (f32 or f16, converted to the cache's dtype) to slots 0..n_tokens-1,
        as segment 0 (the shared prefix), and the recurrent states."""
