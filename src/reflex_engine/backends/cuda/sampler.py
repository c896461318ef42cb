"""Choosing the next token with the logits on the device: a few numbers come back, not the row.

Penalties, then a constraint's mask (its disallowed logits to -inf), are applied on the device;
greedy is an argmax there. Otherwise the device finds the
highest logits and the row's softmax normalizer, and `candidate_distribution` applies the CPU
sampler's filters to them in plain Python. Only when those candidates cannot settle the
distribution (top-k off and a flat row) does the whole row come back. The draw uses Python's
`random`, so a seed gives the same tokens on every run, but not the CPU sampler's tokens.
"""
from __future__ import annotations

import ctypes
import math
import random
from typing import Callable

from ...errors import ReflexError
from ...kvstate import restorable, sampler_state
from ...sampling import SamplingParams, candidate_distribution
from .memory import PinnedTurns, Tensor
from .ops import TOP_K_MAX, CudaOps


class CudaSampler:
    def __init__(self, ops: CudaOps, params: SamplingParams):
        self.ops, self.params = ops, params
        self.rng = random.Random(params.seed)

    def __call__(self, logits: Tensor, history, mask=None) -> int:
        row = logits.row(logits.rows - 1)
        self._penalize(row, history)
        ids, probs = self.distribution(row, logits.cols, mask)
        if len(ids) == 1:
            return ids[0]
        r, acc = self.rng.random(), 0.0
        for token, q in zip(ids, probs):
            acc += q
            if r < acc:
                return token
        return ids[-1]  # r landed in the rounding gap at the top

    def ahead(self, logits: Tensor) -> Callable[[], int] | None:
        """Greedy without penalties: the last row's argmax goes where a pass of ops.SAMPLED reads
        it, and comes back to the host without a wait, so the next pass can be queued first."""
        p = self.params
        if p.temperature != 0 or self._penalizes():
            return None
        ops = self.ops
        ops.device.launch("argmax_rows", (1,), 1024, (logits.row(logits.rows - 1), logits.cols, ops._top))
        # made at the first choice, while the host waits for the pass anyway: on the driver's init thread, which
        # the first token waits for, it took ~1.2 ms (H200, docs/perf-notes.md run 25)
        if ops._readback is None:
            ops._readback = Readback(ops.device)
        return ops._readback.copy(ops._top)

    def distribution(self, row: int, n_vocab: int, mask=None) -> tuple[list[int], list[float]]:
        """(ids, probabilities) after every filter; greedy gives ([argmax], [1.0]). mask: the tokens
        allowed (constraints.Guide's packed bits, bit i of uint32 word j = token 32j + i), applied
        to the row in place before the filters, as the CPU sampler applies it."""
        p, dev = self.params, self.ops.device
        n_allowed = n_vocab if mask is None else self._mask(row, n_vocab, mask)
        out = self.ops._top
        if p.temperature == 0:
            dev.launch("argmax_rows", (1,), 1024, (row, n_vocab, out))
            best = ctypes.c_int32()
            dev.download(ctypes.addressof(best), out, 4)
            return [best.value], [1.0]
        # the masked tokens sort last (-inf, as the CPU sampler's): only the allowed ones are candidates
        k = min(n_allowed, p.top_k if 0 < p.top_k <= TOP_K_MAX else TOP_K_MAX)
        ids_at, vals_at, stats_at = out, out + 4 * TOP_K_MAX, out + 8 * TOP_K_MAX
        dev.launch("top_k", (1,), 1024, (row, n_vocab, k, ids_at, vals_at, stats_at))
        host = (ctypes.c_int32 * (2 * TOP_K_MAX + 4))()
        dev.download(ctypes.addressof(host), out, ctypes.sizeof(host))
        ids = list(host[:k])
        vals = list((ctypes.c_float * TOP_K_MAX).from_buffer(host, 4 * TOP_K_MAX)[:k])
        normalizer = (ctypes.c_float * 2).from_buffer(host, 8 * TOP_K_MAX)[1]
        found = candidate_distribution(p, ids, vals, normalizer, complete=k == n_allowed)
        return found if found is not None else self._whole_row(row, n_vocab, n_allowed)

    def _whole_row(self, row: int, n_vocab: int, n_allowed: int) -> tuple[list[int], list[float]]:
        values = (ctypes.c_float * n_vocab)()
        self.ops.device.download(ctypes.addressof(values), row, 4 * n_vocab)
        order = sorted(range(n_vocab), key=values.__getitem__, reverse=True)  # stable: ties keep lower ids first
        ids = order[:n_allowed]  # a mask's -inf ones last: dropped, as the CPU sampler drops them
        vals = [values[i] for i in ids]
        normalizer = math.fsum(math.exp(v - vals[0]) for v in vals)
        return candidate_distribution(self.params, ids, vals, normalizer, complete=True)

    def _mask(self, row: int, n_vocab: int, mask) -> int:
        """Upload the mask to its scratch slot (CudaOps.reserve), set the logits it leaves out to
        -inf, and return how many tokens it allows."""
        host = (ctypes.c_uint32 * (-(-n_vocab // 32))).from_buffer_copy(mask)  # the driver stages it before returning
        n_allowed = (int.from_bytes(host, "little") & ((1 << n_vocab) - 1)).bit_count()
        if not n_allowed:
            raise ReflexError("internal error: the constraint allows no token")
        dev, slot = self.ops.device, self.ops._ints["mask"]
        dev.upload(slot, ctypes.addressof(host), ctypes.sizeof(host))
        dev.launch("mask_logits", (-(-n_vocab // 256),), 256, (row, slot, n_vocab))
        return n_allowed

    def _penalizes(self) -> bool:
        p = self.params
        return p.repeat_last_n != 0 and (p.repeat_penalty != 1 or p.presence_penalty != 0)

    def _penalize(self, row: int, history) -> None:
        p = self.params
        if not self._penalizes() or not history:
            return
        recent = sorted(set(history[-p.repeat_last_n:]))
        ids = self.ops._upload_ints("history", recent)
        self.ops.device.launch("apply_penalties", (-(-len(recent) // 256),), 256,
                               (row, ids, len(recent), p.repeat_penalty, p.presence_penalty))

    # -- KV state files (kvstate.py): a resumed seeded run draws what this one would have --------

    RNG = "python.MT19937"

    def state(self) -> dict | None:
        version, internal, gauss = self.rng.getstate()
        return sampler_state(self.RNG, self.params.seed, [version, list(internal), gauss])

    def restore(self, saved: dict | None) -> bool:
        """Continue the saved stream if it is this sampler's (same seed); False if not."""
        state = restorable(saved, self.RNG, self.params.seed)
        if state is None:
            return False
        try:
            version, internal, gauss = state
            self.rng.setstate((version, tuple(internal), gauss))
        except (TypeError, ValueError):
            raise ReflexError("the KV state's sampler state is damaged") from None
        return True


class Readback(PinnedTurns):
    """Token ids copied back from the device while the stream goes on, through two pinned slots in
    turn (one may still be unread when the next copy is queued)."""

    def __init__(self, device):
        super().__init__(device, 4)
        self.stream = device.stream

    def copy(self, src: int) -> Callable[[], int]:
        """Queue a copy of the int32 at src; the function returned waits for it and returns it."""
        drv, (slot, event) = self.drv, self.take()
        drv.cuMemcpyDtoHAsync_v2(slot, src, 4, self.stream)
        drv.cuEventRecord(event, self.stream)

        def wait() -> int:
            drv.cuEventSynchronize(event)
            return ctypes.c_int32.from_address(slot).value

        return wait
