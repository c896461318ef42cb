"""Device memory, taken once at load: weights, the KV cache and a pool of activation buffers.

An activation buffer holds `rows` x width float32, whatever the batch's length, and goes back to
its width's free list when the Python object dies. The same op sequence therefore gets the same
buffers every step, which keeps a decode step capturable as a CUDA graph, and a forward pass
never calls the allocator.

Beside them, small pinned host buffers that copies queued on the stream go through (PinnedTurns).
"""
from __future__ import annotations

from ctypes import byref, c_void_p
from typing import NamedTuple

from ...errors import ReflexError
from . import driver as cu

ALIGN = 256


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


class PinnedTurns:
    """Two pinned host buffers of nbytes, taken in turn by copies queued on the device's stream
    (one may still be queued when the next is), each with an event to record behind its copy:
    the host waits on it before reading the buffer (a copy back) or writing it again (a copy up).
    The events start recorded, as if a copy had run."""

    def __init__(self, device, nbytes: int):
        self.drv, self.nbytes, self.turn = device.drv, nbytes, 0
        self.buffers, self.events = c_void_p(), [c_void_p(), c_void_p()]
        self.drv.cuMemHostAlloc(byref(self.buffers), 2 * nbytes, 0)
        for event in self.events:
            self.drv.cuEventCreate(byref(event), cu.EVENT_DISABLE_TIMING)
            self.drv.cuEventRecord(event, device.stream)

    def take(self) -> tuple[int, c_void_p]:
        """The next buffer's address and its event."""
        at, event = self.buffers.value + self.turn * self.nbytes, self.events[self.turn]
        self.turn ^= 1
        return at, event

    def close(self) -> None:
        for event in self.events:
            self.drv.cuEventDestroy_v2(event)
        self.drv.cuMemFreeHost(self.buffers)


class Region:
    """A bump allocator over one device allocation."""

    def __init__(self, base: int, size: int, what: str):
        self.base, self.size, self.top, self.what = base, size, 0, what

    def carve(self, nbytes: int) -> int:
        n = aligned(nbytes)
        if self.top + n > self.size:
            raise ReflexError(f"internal error: the {self.what} region ({self.size} bytes) is full")
        ptr = self.base + self.top
        self.top += n
        return ptr


class Pool:
    """Activation buffers of `rows` x width float32, recycled per width."""

    def __init__(self, region: Region, rows: int):
        self.region, self.rows = region, rows
        self._free: dict[int, list[int]] = {}

    def take(self, width: int) -> int:
        free = self._free.get(width)
        return free.pop() if free else self.region.carve(self.rows * width * 4)

    def give(self, width: int, ptr: int) -> None:
        self._free.setdefault(width, []).append(ptr)


class Tensor:
    """A (rows, cols) float32 activation on the device, row-major."""

    __slots__ = ("ptr", "rows", "cols", "_pool")

    def __init__(self, pool: Pool, rows: int, cols: int):
        if rows > pool.rows:
            raise ReflexError(f"internal error: {rows} rows exceed the activation buffers' {pool.rows}")
        ptr = pool.take(cols)
        self.ptr, self.rows, self.cols, self._pool = ptr, rows, cols, pool

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    def row(self, i: int) -> int:
        return self.ptr + i * self.cols * 4

    def __del__(self):
        if hasattr(self, "_pool"):  # not when __init__ failed
            self._pool.give(self.cols, self.ptr)


_ADDRESS = Tensor.__dict__["ptr"]  # Tensor's own slot, under LazyTensor's property


class LazyTensor(Tensor):
    """A tensor whose float values are made only when something first asks for their address (`make`): rms_norm's
    output while the matvecs around it may take the norm over (CudaOps._fuse_norm), and a split's parts, which
    kernels that read heads at a stride take where they lie (`heads`: the tensor cut, the part's byte offset in a
    head, its width and the heads' stride in floats; head_runs)."""

    __slots__ = ("make", "heads")

    def __init__(self, pool: Pool, rows: int, cols: int):
        self.make, self.heads = None, None
        super().__init__(pool, rows, cols)

    @property
    def ptr(self) -> int:
        if self.make is not None:
            make, self.make = self.make, None
            make()
        return _ADDRESS.__get__(self)

    @ptr.setter
    def ptr(self, value: int) -> None:
        _ADDRESS.__set__(self, value)

    @property
    def address(self) -> int:
        """Where its values are or will be, nothing made."""
        return _ADDRESS.__get__(self)

    def __del__(self):
        if hasattr(self, "_pool"):
            self._pool.give(self.cols, _ADDRESS.__get__(self))


class HeadRuns(NamedTuple):
    """Where a kernel finds a tensor's heads: the first one's address, their width, and floats from one to the next."""

    address: int
    width: int
    stride: int


def head_runs(x: Tensor, head: int | None = None) -> HeadRuns:
    """x's heads of `head` floats (None: a row a head, or a split part's heads) for a kernel that reads them at a
    stride: a split's part where it lies in the tensor it was cut from, nothing copied; any other tensor as it is."""
    heads = getattr(x, "heads", None)
    if heads is None:
        return HeadRuns(x.ptr, head or x.cols, head or x.cols)
    of, offset, width, stride = heads
    if head not in (None, width):
        raise ReflexError(f"internal error: heads of {head} read from a split's parts of {width}")
    return HeadRuns(of.ptr + offset, width, stride)


class RowRun(Tensor):
    """cols consecutive floats of a one-row tensor, from its feature `offset` on: no buffer of its own, and the
    tensor it lies in kept alive while it is."""

    __slots__ = ("_of",)

    def __init__(self, of: Tensor, offset: int, cols: int):
        if of.rows != 1 or not 0 <= offset <= offset + cols <= of.cols:
            raise ReflexError(f"internal error: a run of {cols} at {offset} in a ({of.rows}, {of.cols}) tensor")
        self.ptr, self.rows, self.cols, self._of = of.ptr + 4 * offset, 1, cols, of


class Plan(NamedTuple):
    """Bytes the model needs on the device, checked against free memory before any allocation."""

    weights: int
    cache: int
    activations: int
    scratch: int

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.activations + self.scratch

    def check(self, free: int, device: str, n_ctx: int) -> None:
        if self.weights + self.activations + self.scratch > free:
            raise ReflexError(f"the model needs {gb(self.weights)} of weights plus {gb(self.activations + self.scratch)} of "
                              f"buffers on {device}, which has {gb(free)} free")
        if self.total > free:
            raise ReflexError(f"a {n_ctx}-token context needs a {gb(self.cache)} KV cache; with the model ({gb(self.weights)}) "
                              f"and buffers that exceeds the {gb(free)} free on {device}: pass a smaller --ctx-size")
