"""One-token Q4_K matvecs launched back to back, made one launch (kernels/matvec_x16_mma.cu matvec_chain_q4_K).

Each launch of the bulk matvec starts with its SMs waiting for its first weights and ends with them
waiting for its last group, and the kernel after it can begin only then: memory idles through both
ends of every matvec, five a layer. A chain runs the launches as steps of one persistent grid, a
barrier of the grid between steps, and each block keeps its stages in flight across the barrier:
the next step's weights (which nothing writes) stream in while the grid waits for the step before.
A SwiGLU of a step's two products (gate and up) becomes that step's too.

Only while the device overlaps launches (a captured decode step, device.py): the grid waits for every
one of its blocks, which must all be resident at once, and the captured graph is what repeats.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

BULK = "matvec_x16_bulk_q4_K"
CHAIN = "matvec_chain_q4_K"
CHAIN_MAX_STEPS = 8  # kernels/matvec_x16_mma.cu ChainSteps: its steps, and arrivals' CHAIN_MAX_STEPS + 1 counts
CHAIN_STEPS_BYTES = 1352  # sizeof(ChainSteps)
# ChainStep: w[3], xq, xds, y[3], add; rows[3], n_cols; x_sums; eps; norm (w, xq, xds, sums, tickets); swiglu_y, _xq, _xds
_STEP = struct.Struct("<9Q4iQf4x5Q3Q")
NO_SWIGLU = (0, 0, 0)


class Step(NamedTuple):
    grid: int
    args: tuple  # the bulk kernel's, in its order (params.py)
    swiglu: tuple[int, int, int] = NO_SWIGLU  # where SwiGLU of the two products goes: y, its int16 blocks, their scales


class MatvecChain:
    """The bulk matvecs launched since the last other launch, waiting to be made (flush)."""

    def __init__(self, device, arrivals: int, shared: int, blocks: int):
        self.device, self.arrivals, self.shared, self.blocks = device, arrivals, shared, blocks
        self.steps: list[Step] = []
        self._allowed = False  # the chain kernel's shared memory, asked for at its first launch

    def takes(self, name: str, grid: tuple[int, ...], args: tuple) -> bool:
        """Whether this launch joins the chain: a bulk matvec, or SwiGLU of the last step's two products."""
        if name == BULK:
            if len(self.steps) == CHAIN_MAX_STEPS:
                self.flush()
            self.steps.append(Step(grid[0], args))
            return True
        if name == "swiglu_f32" and self.steps:
            gate, up, y, n, xq, xds = args
            last = self.steps[-1]
            (_, _, _, x_q, _, y0, y1, _, add, rows0, rows1, rows2, _, _, _, norm_w, *_) = last.args
            if (last.swiglu == NO_SWIGLU and (gate, up) == (y0, y1) and rows0 == rows1 == n and rows2 == 0
                    and n % 32 == 0 and xq and xq != x_q and not add and not norm_w):
                self.steps[-1] = last._replace(swiglu=(y, xq, xds))
                return True
        return False

    def flush(self) -> None:
        """Launch what the chain holds: one step alone as the bulk matvec it was, more as one chain."""
        steps, self.steps = self.steps, []
        if not steps:
            return
        if len(steps) == 1 and steps[0].swiglu == NO_SWIGLU:
            self.device.enqueue(BULK, (steps[0].grid,), 256, steps[0].args, self.shared)
            return
        packed = b"".join(_STEP.pack(*s.args, *s.swiglu) for s in steps).ljust(_STEP.size * CHAIN_MAX_STEPS, b"\0")
        blob = packed + struct.pack("<i4x", len(steps))
        assert len(blob) == CHAIN_STEPS_BYTES
        if not self._allowed:
            self.device.allow_shared(CHAIN, self.shared)
            self._allowed = True
        self.device.enqueue(CHAIN, (self.blocks,), 256, (blob, self.arrivals), self.shared)
