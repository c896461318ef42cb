"""Weights from the GGUF's file mapping to the device: pinned where they lie, copied by DMA.

A copy from pageable memory goes through the driver's staging buffers at a fraction of the
link's rate. Pinning the file's own pages (`cuMemHostRegister`, read-only) lets the copy engine
read them directly; pinning is the slow part (page-table work in the kernel), so chunks are
faulted in (`MADV_POPULATE_READ`) and pinned by a few threads at once, each copying its chunks
on its own stream. Measured on an H200 (design brief): 0.42 GB in 26.6 ms with 2-4 threads,
against 37.6 ms with one.
"""
from __future__ import annotations

import ctypes
import os
import threading
from ctypes import c_int, c_size_t, c_void_p
from typing import NamedTuple, Sequence

from . import driver as cu

CHUNK = 32 << 20
THREADS = 4
PAGE = os.sysconf("SC_PAGE_SIZE")
MADV_POPULATE_READ = 22  # Linux 5.14+; older kernels refuse it and registering faults the pages in


class Copy(NamedTuple):
    dst: int  # device address
    src: int  # host address
    nbytes: int


class Chunk(NamedTuple):
    start: int  # page-aligned host range to pin
    end: int
    copies: list[Copy]  # pieces lying inside [start, end)


def plan_chunks(copies: Sequence[Copy], chunk: int = CHUNK, page: int = PAGE) -> list[Chunk]:
    """Cut the copies at page-aligned boundaries every `chunk` bytes of host address space, so
    chunks never share a page (a page can be registered once) and each piece lies in one chunk.
    Chunks come in host-address order: the file's first tensors first."""
    copies = [c for c in copies if c.nbytes]
    if not copies:
        return []
    base = min(c.src for c in copies) // page * page
    pieces: dict[int, list[Copy]] = {}
    for c in copies:
        end = c.src + c.nbytes
        for i in range((c.src - base) // chunk, (end - 1 - base) // chunk + 1):
            lo, hi = max(c.src, base + i * chunk), min(end, base + (i + 1) * chunk)
            pieces.setdefault(i, []).append(Copy(c.dst + lo - c.src, lo, hi - lo))
    chunks = []
    for i in sorted(pieces):
        part = pieces[i]
        start = min(p.src for p in part) // page * page
        end = -(-max(p.src + p.nbytes for p in part) // page) * page
        chunks.append(Chunk(start, end, part))
    return chunks


_libc = None


def _madvise(start: int, length: int, advice: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes, _libc.madvise.restype = (c_void_p, c_size_t, c_int), c_int
    _libc.madvise(start, length, advice)  # advice only: a refusal leaves the faulting to the driver


def upload(device, copies: Sequence[Copy], threads: int = THREADS) -> int:
    """Copy every piece to the device; returns the bytes copied once all are there. A chunk the
    driver will not pin (e.g. no read-only registration) is copied from pageable memory."""
    chunks = plan_chunks(copies)
    if not chunks:
        return 0
    queue, errors = iter(chunks), []

    def work() -> None:
        drv, stream, pinned = device.drv, c_void_p(), []
        try:
            device.make_current()
            drv.cuStreamCreate(ctypes.byref(stream), cu.STREAM_NON_BLOCKING)
            for chunk in queue:  # a shared iterator: each chunk goes to whichever thread is free
                length = chunk.end - chunk.start
                _madvise(chunk.start, length, MADV_POPULATE_READ)
                try:
                    drv.cuMemHostRegister_v2(chunk.start, length, cu.HOST_REGISTER_READ_ONLY)
                    pinned.append(chunk.start)
                except cu.CudaError:
                    pass
                for piece in chunk.copies:
                    drv.cuMemcpyHtoDAsync_v2(piece.dst, piece.src, piece.nbytes, stream)
        except BaseException as e:
            errors.append(e)
        finally:  # even after an error: the copies must end before their pages are unpinned
            for call, arg in [(drv.cuStreamSynchronize, stream)] * bool(stream) + [
                    (drv.cuMemHostUnregister, start) for start in pinned] + [(drv.cuStreamDestroy_v2, stream)] * bool(stream):
                try:
                    call(arg)
                except cu.CudaError as e:
                    errors.append(e)

    workers = [threading.Thread(target=work, name=f"reflex-upload-{i}") for i in range(min(threads, len(chunks)) - 1)]
    for w in workers:
        w.start()
    work()  # the calling thread is one of the workers
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return sum(c.nbytes for c in copies)
