"""Weights from the GGUF's file mapping to the device: pinned where they lie, copied by DMA, while
the first pass already runs.

A copy from pageable memory goes through the driver's staging buffers at a fraction of the
link's rate (H200, 2026-12-01: 5 GB in ~750 ms against ~160 ms pinned). Pinning the file's own
pages (`cuMemHostRegister`, read-only) lets the copy engine read them directly; pinning is the
slow part (page-table work in the kernel), so chunks are faulted in (`MADV_POPULATE_READ`) and
pinned by a few threads at once (design brief: 0.42 GB in 26.6 ms with 2-4 threads, against
37.6 ms with one), each copying its chunks on its own stream and recording a CUDA event after
each (one stream for all the copies was slower: 8B, 5 GB in ~230 ms against ~160 ms).

A weight's first reader waits on the host for the events of the chunks holding it, then
enqueues its kernels, so a prompt's pass can run on the first layers while later ones are in
flight; chunks go in the order the weights were loaded (a pass's order), not the file's.
The pages stay pinned as long as the Upload object lives (CudaOps keeps it, as it keeps the
weights' device memory), and so do the buffers they belong to: a mapping unmapped while pinned
would leave the driver copying the old pages for whatever is mapped there next. Unpinning costs
tens of milliseconds for 0.42 GB on the H200 (tools/probe_overlap.py, docs/perf-notes.md), so it
is never done on the way out of the process: the driver releases the pages at exit.

Only a file mapping's pages are pinned: they hold nothing else, while pinning a heap buffer's
pages would pin its neighbours' too, and the driver refuses a copy from memory that is partly
pinned. Small copies go through one fresh buffer for the same reason: they share pages with the
large copies beside them, which another thread may be pinning.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
import weakref
from ctypes import byref, c_int, c_size_t, c_void_p
from typing import NamedTuple, Sequence

from . import driver as cu

CHUNK = 32 << 20
THREADS = 4
SMALL = 64 << 10  # norm vectors and the like: every layer reads some, so they travel first, through a buffer
PAGE = os.sysconf("SC_PAGE_SIZE")
MADV_POPULATE_READ = 22  # Linux 5.14+; older kernels refuse it and registering faults the pages in
# The GIL's switch interval while the copies run: a thread back from a driver call waits up to
# one interval (5 ms by default) for the busy main thread to yield; so does starting a thread
SWITCH_INTERVAL_S = 1e-4


class Copy(NamedTuple):
    dst: int  # device address
    src: int  # host address
    nbytes: int


class Chunk(NamedTuple):
    start: int  # page-aligned host range to pin; start == end: nothing is pinned
    end: int
    copies: list[Copy]  # pieces lying inside [start, end)
    owners: list[int]  # for each piece, the index of the copy it is part of


def plan_chunks(copies: Sequence[Copy], chunk: int = CHUNK, page: int = PAGE, small: int = SMALL) -> list[Chunk]:
    """Cut the copies at page-aligned boundaries every `chunk` bytes of host address space, so
    chunks never share a page (a page can be registered once) and each piece lies in one chunk.
    Copies under `small` bytes come first, in one chunk that pins nothing (see the module's
    docstring); the others' chunks follow in the order of the first copy each holds."""
    live = [(i, c) for i, c in enumerate(copies) if c.nbytes]
    smalls = [(i, c) for i, c in live if c.nbytes < small]
    large = [(i, c) for i, c in live if c.nbytes >= small]
    chunks = [Chunk(0, 0, [c for _, c in smalls], [i for i, _ in smalls])] if smalls else []
    if not large:
        return chunks
    base = min(c.src for _, c in large) // page * page
    pieces: dict[int, list[tuple[int, Copy]]] = {}
    for owner, c in large:
        end = c.src + c.nbytes
        for k in range((c.src - base) // chunk, (end - 1 - base) // chunk + 1):
            lo, hi = max(c.src, base + k * chunk), min(end, base + (k + 1) * chunk)
            pieces.setdefault(k, []).append((owner, Copy(c.dst + lo - c.src, lo, hi - lo)))
    cut = []
    for part in pieces.values():
        start = min(p.src for _, p in part) // page * page
        end = -(-max(p.src + p.nbytes for _, p in part) // page) * page
        cut.append(Chunk(start, end, [p for _, p in part], [o for o, _ in part]))
    return chunks + sorted(cut, key=lambda c: (min(c.owners), c.start))


_libc = None


def _madvise(start: int, length: int, advice: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes, _libc.madvise.restype = (c_void_p, c_size_t, c_int), c_int
    _libc.madvise(start, length, advice)  # advice only: a refusal leaves the faulting to the driver


def _unpin(drv, pinned: list[int], buffers: list) -> None:
    for start in pinned:
        try:
            drv.cuMemHostUnregister(start)
        except cu.CudaError:
            pass  # the context is gone: so is the pinning
    buffers.clear()  # only now may the mappings go


class Upload:
    """The copies, started at once on `threads` threads, each pinning a chunk, copying it on its
    own stream and recording the chunk's event, then taking the next. `wait(i)` returns once
    copy i has landed, `finish()` once all have. A chunk the driver will not pin (e.g. no
    read-only registration) is copied from pageable memory. A failure is raised by the next
    `wait` or `finish`, never left for a waiter to hang on."""

    def __init__(self, device, copies: Sequence[Copy], buffers: Sequence = (), threads: int = THREADS):
        """buffers: the objects the copies read from, kept alive while their pages are pinned."""
        self.device, self.nbytes = device, sum(c.nbytes for c in copies)
        self.chunks = plan_chunks(copies)
        self._chunks_of: list[list[int]] = [[] for _ in copies]
        for j, chunk in enumerate(self.chunks):
            for owner in chunk.owners:
                if not self._chunks_of[owner] or self._chunks_of[owner][-1] != j:
                    self._chunks_of[owner].append(j)
        self._queued = [threading.Event() for _ in self.chunks]  # chunk j's copies and event are enqueued
        self._events = []
        for _ in self.chunks:
            self._events.append(c_void_p())
            device.drv.cuEventCreate(byref(self._events[-1]), cu.EVENT_DISABLE_TIMING)
        self.pinned: list[int] = []  # starts of the pinned ranges (see the module's docstring)
        self.close = weakref.finalize(self, _unpin, device.drv, self.pinned, list(buffers))  # close(): unpin now
        self.close.atexit = False
        self._landed: set[int] = set()  # chunks wait() has seen land
        self._errors: list[BaseException] = []
        self._started, self._copy_ends = time.perf_counter(), []  # when each thread saw its copies end
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, SWITCH_INTERVAL_S))
        queue = iter(list(enumerate(self.chunks)))  # shared: each chunk goes to whichever thread is free
        self._threads = [threading.Thread(target=self._work, args=(queue,), name=f"reflex-upload-{i}")
                         for i in range(min(threads, len(self.chunks)))]
        for t in self._threads:
            t.start()

    def _work(self, queue) -> None:
        drv, stream = self.device.drv, c_void_p()
        try:
            self.device.make_current()
            drv.cuStreamCreate(byref(stream), cu.STREAM_NON_BLOCKING)
            for j, chunk in queue:
                length = chunk.end - chunk.start
                if length:
                    _madvise(chunk.start, length, MADV_POPULATE_READ)
                    try:
                        drv.cuMemHostRegister_v2(chunk.start, length, cu.HOST_REGISTER_READ_ONLY)
                        self.pinned.append(chunk.start)
                    except cu.CudaError:
                        pass
                    for piece in chunk.copies:
                        drv.cuMemcpyHtoDAsync_v2(piece.dst, piece.src, piece.nbytes, stream)
                else:  # pageable: the driver stages each copy before the call returns
                    staged = ctypes.create_string_buffer(sum(piece.nbytes for piece in chunk.copies))
                    at = ctypes.addressof(staged)
                    for piece in chunk.copies:
                        ctypes.memmove(at, piece.src, piece.nbytes)
                        drv.cuMemcpyHtoDAsync_v2(piece.dst, at, piece.nbytes, stream)
                        at += piece.nbytes
                drv.cuEventRecord(self._events[j], stream)
                self._queued[j].set()
        except BaseException as e:
            self._errors.append(e)
            for queued in self._queued:  # wake every waiter: it raises the error
                queued.set()
        finally:  # even after an error: finish() returns only once every copy has ended
            if stream:
                self._call(drv.cuStreamSynchronize, stream)
                self._copy_ends.append(time.perf_counter())
                self._call(drv.cuStreamDestroy_v2, stream)

    def _call(self, call, arg) -> None:
        try:
            call(arg)
        except cu.CudaError as e:
            self._errors.append(e)

    def _raise(self) -> None:
        if self._errors:
            raise self._errors[0]

    def wait(self, i: int) -> None:
        """Return once copy i has landed on the device."""
        for j in self._chunks_of[i]:
            if j in self._landed:
                continue
            self._queued[j].wait()
            self._raise()
            self.device.drv.cuEventSynchronize(self._events[j])
            self._landed.add(j)

    def finish(self) -> float:
        """Wait for every copy; the ms from the start to the last copy's end."""
        for t in self._threads:
            t.join()
        sys.setswitchinterval(self._switch_interval)
        for event in self._events:
            self._call(self.device.drv.cuEventDestroy_v2, event)
        self._events = []
        self._raise()
        return (max(self._copy_ends, default=self._started) - self._started) * 1e3
