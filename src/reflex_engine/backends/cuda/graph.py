"""Forward passes as CUDA graphs: a pass whose shape was seen before is captured, then replayed
whenever that shape comes again.

A pass is a few hundred kernel launches, each 10-20 µs of Python and ctypes; a replay is one launch.
Every decode step into one bucket of slots (ops.decode_slots) has one shape, and so has a prompt of
the same length at the same slot (a client sending one template, a benchmark's repeats). A captured
pass replays correctly for any tokens and positions because nothing it reads is baked into the graph
except addresses and its shape: its activations come from a pool only graphs use, and the per-pass
ints (token ids, positions, segments, the first cache slot, the logits rows) sit in the scratch
region, which a copy queued before each launch fills from a pinned host buffer. Two such buffers in
turn, each written again only once its last copy has run: a pass may be queued while the one before
it still waits on the stream (a greedy decode's, engine.py _step), and a buffer the graph itself
read would by then hold the later pass's ints (run 13: a greedy decode of an MoE fixture on the H200
now and then ran a step at the next one's position and cache slot).

A capture costs an eager pass plus the graph's instantiation, so a shape is captured when it
comes the second time, never the first: a one-shot process's prompt stays eager. Nor is it
captured where that would destroy a graph used since the shape last came: the passes in between
then cycle through more shapes than are kept (a long prompt's several passes, prompts of a few
lengths in turn), and each capture would only destroy the next graph needed (run 13: a 2,048-token
prompt's four passes, two graphs free beside the decode steps', captured on every repeat, 2x slower).
"""
from __future__ import annotations

import ctypes
from ctypes import byref, c_void_p
from typing import Callable, Sequence

from ...errors import ReflexError
from ...ops import SAMPLED, Batch
from . import driver as cu
from .memory import PinnedTurns
from .ops import decode_slots

# how each staged kind follows from the batch; the others ("rows") must be the same every replay
FROM_BATCH = {"tokens": lambda b: list(b.tokens), "positions": lambda b: list(b.positions),
              "segments": lambda b: list(b.segments), "start": lambda b: [b.start]}
SEEN_SHAPES = 16  # the shapes remembered: one of them that comes again is captured
# passes of at most this many tokens are captured with overlapped launches (device.py): a decode
# step's kernels each fill under a wave, and overlapping hides their launches' latency; a prompt's
# kernels are captured as eager passes launch them (docs/perf-notes.md, run 12)
OVERLAP_MAX_TOKENS = 1


def pass_shape(batch: Batch, rows: Sequence[int]) -> tuple:
    """What fixes a pass's launches: the tokens' count, segments and logits rows, where the batch
    starts in the cache, and whether its token is the device's own choice (ops.SAMPLED: read where
    the sampler left it). A one-token pass's grids cover its bucket of slots (ops.decode_slots), so
    any start of the bucket but the first slot (a fresh recurrent state) replays the same graph; a
    prompt's grids reach its last slot."""
    n = len(batch.tokens)
    start = (batch.start == 0, decode_slots(batch.start)) if n == 1 else batch.start
    return n, start, tuple(batch.segments), tuple(rows), batch.tokens is SAMPLED


class ReplayedPasses:
    """forward(batch, rows) -> logits, with each shape seen before captured once and replayed
    after; `kept` graphs are kept, a capture beyond them destroying the prompt's graph used
    longest ago (a one-token pass's only where there is none), unless that graph was used since
    the shape last came (see the module's docstring). Passes asking for more logits rows than
    max_rows stay eager: a graph's logits live in the graph pool, whose buffers hold max_rows rows."""

    def __init__(self, ops, forward: Callable[[Batch, Sequence[int]], object], step_ints: tuple[str, ...],
                 max_rows: int, kept: int):
        self.ops, self.forward, self.step_ints, self.max_rows, self.kept = ops, forward, step_ints, max_rows, kept
        self.graphs: dict[tuple, CapturedPass] = {}  # in the order of their last use
        self._seen: dict[tuple, int] = {}  # likewise, each shape's last pass (its number)
        self._passes = 0

    def __call__(self, batch: Batch, rows: Sequence[int]):
        shape = pass_shape(batch, rows)
        self._passes += 1
        last = self._seen.pop(shape, None)
        self._seen[shape] = self._passes  # the last seen last
        while len(self._seen) > SEEN_SHAPES:
            del self._seen[next(iter(self._seen))]
        graph = self.graphs.pop(shape, None)
        if graph is None:
            if last is None or len(rows) > self.max_rows or not self._room_since(last):
                return self.forward(batch, rows)
            graph = CapturedPass(self.ops, lambda b: self.forward(b, rows), self.step_ints)
        try:
            out = graph(batch)
        except BaseException:
            graph.close()
            raise
        self.graphs[shape] = graph
        return out

    def _room_since(self, last: int) -> bool:
        """Make room for one more graph, destroying none used after pass `last`: whether it could."""
        while len(self.graphs) >= self.kept:  # a prompt's graph goes first: every request decodes
            victim = next((s for s in self.graphs if s[0] > 1), next(iter(self.graphs)))
            if self._seen.get(victim, 0) > last:
                return False
            self.graphs.pop(victim).close()
        return True

    def close(self) -> None:
        """Destroy every captured pass (Model.close; tools that change the launches), once the
        stream is done with them: a greedy decode may have left a pass queued (engine.py _step)."""
        if self.graphs:
            self.ops.device.synchronize()
        while self.graphs:
            self.graphs.popitem()[1].close()
        self._seen.clear()


class CapturedPass:
    """forward(batch) -> logits for batches of one shape, captured on the first call and replayed."""

    def __init__(self, ops, forward: Callable[[Batch], object], step_ints: tuple[str, ...]):
        self.ops, self.forward = ops, forward
        base = ops._ints[step_ints[0]]
        self._offsets = {kind: ops._ints[kind] - base for kind in step_ints}
        last = step_ints[-1]
        self._base, self._span = base, ops._ints[last] - base + 4 * ops.max_batch
        self._staging: PinnedTurns | None = None  # the staged ints' buffers, made at the capture
        self._exec = None
        self._out = None  # the logits tensor the graph writes: kept for the graph's lifetime
        self._constants: dict[str, list[int]] = {}

    def close(self) -> None:
        """Destroy the graph, free its staging buffers and give its logits buffer back to the pool."""
        if self._exec is not None:
            self.ops.device.drv.cuGraphExecDestroy(self._exec)
            self._exec = None
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        self._out = None

    def __call__(self, batch: Batch):
        if self._exec is None:
            self._capture(batch)
        drv, stream = self.ops.device.drv, self.ops.device.stream
        staged, copied = self._staging.take()
        drv.cuEventSynchronize(copied)  # its last copy has run (at once, but after a pass queued ahead)
        self._stage(batch, staged)
        drv.cuMemcpyHtoDAsync_v2(self._base, staged, self._span, stream)
        drv.cuEventRecord(copied, stream)
        drv.cuGraphLaunch(self._exec, stream)
        self.ops._positions = None  # the device's positions are now this batch's
        return self._out

    def _stage(self, batch: Batch, staged: int) -> None:
        values = {kind: derive(batch) for kind, derive in FROM_BATCH.items()} | self._constants
        for kind, vals in values.items():
            if vals:
                host = (ctypes.c_int32 * len(vals))(*vals)
                ctypes.memmove(staged + self._offsets[kind], host, 4 * len(vals))

    def _capture(self, batch: Batch) -> None:
        ops, dev = self.ops, self.ops.device
        drv, stream = dev.drv, dev.stream
        ops.weights_arrived()  # a capture may neither wait on the upload's events nor copy from pageable memory
        self._staging = PinnedTurns(dev, self._span)
        recorded: dict[str, list[int]] = {}
        ops._captured_ints, ops._positions = recorded, None
        graph = c_void_p()
        drv.cuStreamBeginCapture_v2(stream, cu.STREAM_CAPTURE_MODE_THREAD_LOCAL)
        dev.overlap_launches = len(batch.tokens) <= OVERLAP_MAX_TOKENS
        try:
            out = self.forward(batch)
        finally:
            # and what the scratch held for the capture's tensors, whose buffers then go back to the pool
            dev.release()  # into the graph (a pass always takes what it holds back, unless it failed)
            ops._captured_ints, ops._x16_of, ops._xh_of, dev.overlap_launches = None, None, None, False
            drv.cuStreamEndCapture(stream, byref(graph))
        try:
            for kind, vals in recorded.items():
                if kind not in self._offsets:
                    raise ReflexError(f"internal error: a captured pass reads {kind!r}, which is not staged")
                if kind in FROM_BATCH and vals != FROM_BATCH[kind](batch):
                    raise ReflexError(f"internal error: a captured pass's {kind} do not follow from its batch")
            self._constants = {kind: vals for kind, vals in recorded.items() if kind not in FROM_BATCH}
            exec_ = c_void_p()
            drv.cuGraphInstantiateWithFlags(byref(exec_), graph, 0)
        finally:
            drv.cuGraphDestroy(graph)
        self._exec, self._out = exec_, out
