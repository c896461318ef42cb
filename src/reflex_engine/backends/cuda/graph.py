"""One decode step as a CUDA graph: captured on its first call, then replayed for every token.

A decode step is a few hundred kernel launches, each 10-20 µs of Python and ctypes; a replay is
one launch. A captured step replays correctly at any position because nothing it reads is baked
into the graph except addresses: its activations come from a pool only the graph uses, and the
per-pass ints (token ids, positions, segments, the first cache slot, the logits rows) sit in the
scratch region, which the graph's first node fills from a pinned host buffer. Before each launch
the host writes the next batch's ints there; the step after it reads them on the device.
"""
from __future__ import annotations

import ctypes
from ctypes import byref, c_void_p
from typing import Callable

from ...errors import ReflexError
from ...ops import Batch
from . import driver as cu

# how each staged kind follows from the batch; the others ("rows") must be the same every step
FROM_BATCH = {"tokens": lambda b: list(b.tokens), "positions": lambda b: list(b.positions),
              "segments": lambda b: list(b.segments), "start": lambda b: [b.start]}


class DecodeGraph:
    """forward(batch) -> logits for batches of one shape (one token, one segment), replayed."""

    def __init__(self, ops, forward: Callable[[Batch], object], step_ints: tuple[str, ...]):
        self.ops, self.forward = ops, forward
        base = ops._ints[step_ints[0]]
        self._offsets = {kind: ops._ints[kind] - base for kind in step_ints}
        last = step_ints[-1]
        self._base, self._span = base, ops._ints[last] - base + 4 * ops.max_batch
        self._pinned = c_void_p()  # allocated at the capture, after the first token
        self._exec = None
        self._out = None  # the logits tensor the graph writes: kept for the graph's lifetime
        self._constants: dict[str, list[int]] = {}

    def close(self) -> None:
        """Destroy the captured step and free its pinned buffer (Model.close)."""
        drv = self.ops.device.drv
        if self._exec is not None:
            drv.cuGraphExecDestroy(self._exec)
            self._exec = None
        if self._pinned:
            drv.cuMemFreeHost(self._pinned)
            self._pinned = c_void_p()

    def __call__(self, batch: Batch):
        if self._exec is None:
            self._capture(batch)
        self._stage(batch)
        self.ops.device.drv.cuGraphLaunch(self._exec, self.ops.device.stream)
        self.ops._positions = None  # the device's positions are now this batch's
        return self._out

    def _stage(self, batch: Batch) -> None:
        values = {kind: derive(batch) for kind, derive in FROM_BATCH.items()} | self._constants
        for kind, vals in values.items():
            if vals:
                host = (ctypes.c_int32 * len(vals))(*vals)
                ctypes.memmove(self._pinned.value + self._offsets[kind], host, 4 * len(vals))

    def _capture(self, batch: Batch) -> None:
        ops, dev = self.ops, self.ops.device
        drv, stream = dev.drv, dev.stream
        ops.weights_arrived()  # a capture may neither wait on the upload's events nor copy from pageable memory
        drv.cuMemHostAlloc(byref(self._pinned), self._span, 0)
        recorded: dict[str, list[int]] = {}
        ops._captured_ints, ops._positions = recorded, None
        graph = c_void_p()
        drv.cuStreamBeginCapture_v2(stream, cu.STREAM_CAPTURE_MODE_THREAD_LOCAL)
        dev.overlap_launches = True
        try:
            drv.cuMemcpyHtoDAsync_v2(self._base, self._pinned, self._span, stream)  # the staged ints
            out = self.forward(batch)
        finally:
            ops._captured_ints, dev.overlap_launches = None, False
            drv.cuStreamEndCapture(stream, byref(graph))
        try:
            for kind, vals in recorded.items():
                if kind not in self._offsets:
                    raise ReflexError(f"internal error: a captured decode step reads {kind!r}, which is not staged")
                if kind in FROM_BATCH and vals != FROM_BATCH[kind](batch):
                    raise ReflexError(f"internal error: a captured decode step's {kind} do not follow from its batch")
            self._constants = {kind: vals for kind, vals in recorded.items() if kind not in FROM_BATCH}
            exec_ = c_void_p()
            drv.cuGraphInstantiateWithFlags(byref(exec_), graph, 0)
        finally:
            drv.cuGraphDestroy(graph)
        self._exec, self._out = exec_, out
