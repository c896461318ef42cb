"""The weight upload: the copies cut into chunks that can each be pinned on their own (a page
can be registered with the driver once, so chunks must never share one; every byte of every
copy must land once, at its own device offset), sent in the order a pass reads them, and a pass
that starts while they are in flight waits for each weight it reads and for nothing else."""
import ctypes
import gc
import random
import threading
import time

import pytest

from reflex_engine.backends.cuda import driver, upload
from reflex_engine.backends.cuda.upload import SMALL, Copy, Upload, plan_chunks

PAGE = 4096


def random_copies(rng: random.Random, n: int) -> list[Copy]:
    """Tensors laid out one after another in a file mapping (with alignment gaps), as in a GGUF."""
    src, dst, copies = rng.randrange(1, 64) * PAGE + rng.randrange(0, PAGE, 32), 1 << 40, []
    for _ in range(n):
        size = rng.choice([rng.randrange(1, 4096), rng.randrange(1, 1 << 20), rng.randrange(1 << 20, 40 << 20)])
        copies.append(Copy(dst, src, size))
        src += -(-size // 32) * 32 + rng.choice([0, 0, 32, 4096 * 3])
        dst += -(-size // 256) * 256
    rng.shuffle(copies)
    return copies


@pytest.mark.parametrize("seed", range(20))
def test_chunks_cover_every_byte_once_and_share_no_page(seed):
    rng = random.Random(seed)
    copies = random_copies(rng, rng.randrange(1, 60))
    chunk = rng.choice([PAGE, 16 * PAGE, 1 << 20, 32 << 20])
    chunks = plan_chunks(copies, chunk=chunk, page=PAGE)
    pinned = []
    for c in chunks:
        assert len(c.owners) == len(c.copies)
        if c.start == c.end:  # the unpinned chunk: whole small copies
            assert all(copies[o] == p and p.nbytes < SMALL for o, p in zip(c.owners, c.copies))
            continue
        assert c.start % PAGE == 0 and c.end % PAGE == 0 and c.end - c.start <= chunk
        for p in c.copies:
            assert c.start <= p.src and p.src + p.nbytes <= c.end  # each piece inside its chunk's pinned range
        pinned.append((c.start, c.end))
    pinned.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(pinned, pinned[1:]))
    # the pieces, put back together, are exactly the copies: same source bytes to the same device bytes
    pieces = sorted(((o, p) for c in chunks for o, p in zip(c.owners, c.copies)), key=lambda op: op[1].src)
    for i, copy in enumerate(copies):
        mine = [p for o, p in pieces if o == i]
        assert all(copy.src <= p.src < copy.src + copy.nbytes for p in mine)
        assert sum(p.nbytes for p in mine) == copy.nbytes
        at = copy.src
        for p in mine:
            assert p.src == at and p.dst - copy.dst == p.src - copy.src
            at += p.nbytes


def test_small_copies_go_first_then_chunks_in_the_copies_order_and_empty_ones_are_dropped():
    # load order (a pass's) against the file's: the first copy lies last in the file
    copies = [Copy(1 << 40, 40 * PAGE, 3 * PAGE), Copy(2 << 40, 2 * PAGE, 5 * PAGE), Copy(3 << 40, 99 * PAGE, 0),
              Copy(4 << 40, 20 * PAGE, 100)]
    chunks = plan_chunks(copies, chunk=4 * PAGE, page=PAGE, small=PAGE)
    assert chunks[0].start == chunks[0].end and chunks[0].owners == [3]
    assert [min(c.owners) for c in chunks[1:]] == [0, 0, 1, 1]  # each spans two chunks
    assert all(p.nbytes for c in chunks for p in c.copies)
    assert plan_chunks([Copy(1, 2, 0)]) == []


class FakeDriver:
    """Copies at once (so an enqueued copy has landed) into host memory standing for the device;
    checks that an event waited for has been recorded."""

    def __init__(self, rng: random.Random, fail_copy_at: int | None = None):
        self.rng, self.fail_copy_at, self.copies = rng, fail_copy_at, 0
        self.lock = threading.Lock()
        self.recorded, self.waited, self.registered, self.unregistered = set(), [], [], []

    def __getattr__(self, name):
        return lambda *args: None

    def cuEventCreate(self, out, flags):
        out._obj.value = id(out._obj)  # any distinct non-zero handle

    def cuMemHostRegister_v2(self, start, length, flags):
        time.sleep(self.rng.random() * 2e-3)  # pinning takes a while, differently per chunk
        if self.rng.random() < 0.2:
            raise driver.CudaError("cuMemHostRegister_v2", 1, "CUDA_ERROR_INVALID_VALUE")  # refused: pageable copy
        with self.lock:
            self.registered.append(start)

    def cuMemHostUnregister(self, start):
        with self.lock:
            self.unregistered.append(start)

    def cuMemcpyHtoDAsync_v2(self, dst, src, nbytes, stream):
        with self.lock:
            self.copies += 1
            if self.copies == self.fail_copy_at:
                raise driver.CudaError("cuMemcpyHtoDAsync_v2", 700, "CUDA_ERROR_ILLEGAL_ADDRESS")
        ctypes.memmove(dst, src, nbytes)

    def cuEventRecord(self, event, stream):
        with self.lock:
            self.recorded.add(event.value)

    def cuEventSynchronize(self, event):
        with self.lock:
            assert event.value in self.recorded, "a wait for an event not yet recorded (it would return at once)"
            self.waited.append(event.value)


class FakeDevice:
    def __init__(self, drv):
        self.drv = drv

    def make_current(self):
        pass


def file_and_device(rng: random.Random, n: int):
    """A file mapping's worth of random tensors and device memory for them (host buffers both)."""
    sizes = [rng.choice([rng.randrange(1, 3000), rng.randrange(SMALL, 300_000)]) for _ in range(n)]
    src = bytes(rng.randrange(256) for _ in range(sum(sizes)))
    dev = ctypes.create_string_buffer(sum(sizes))
    host = ctypes.create_string_buffer(src, len(src))
    copies, at = [], 0
    for size in sizes:
        copies.append(Copy(ctypes.addressof(dev) + at, ctypes.addressof(host) + at, size))
        at += size
    rng.shuffle(copies)  # load order is not file order
    return copies, src, dev, host


@pytest.mark.parametrize("seed", range(6))
def test_a_copy_waited_for_has_landed_and_every_byte_arrives(seed, monkeypatch):
    rng = random.Random(seed)
    monkeypatch.setattr(upload, "CHUNK", 64 << 10)
    copies, src, dev, host = file_and_device(rng, 40)
    drv = FakeDriver(rng)
    up = Upload(FakeDevice(drv), copies, threads=rng.choice([1, 2, 4]))
    base = ctypes.addressof(dev)
    for i in rng.sample(range(len(copies)), len(copies)):
        up.wait(i)
        c = copies[i]
        assert dev.raw[c.dst - base : c.dst - base + c.nbytes] == src[c.src - ctypes.addressof(host):][:c.nbytes]
    assert up.finish() >= 0
    assert dev.raw == src
    assert sorted(up.pinned) == sorted(drv.registered) and not drv.unregistered  # pinned while the upload lives
    del up
    gc.collect()
    assert sorted(drv.unregistered) == sorted(drv.registered)  # and unpinned when it goes, before its buffers
    assert len(drv.waited) == len(set(drv.waited))  # one wait per chunk, however many weights share it


def test_a_failed_copy_is_raised_to_the_waiter_instead_of_hanging_it(monkeypatch):
    rng = random.Random(7)
    monkeypatch.setattr(upload, "CHUNK", 64 << 10)
    copies, src, dev, host = file_and_device(rng, 30)
    drv = FakeDriver(rng, fail_copy_at=len(copies) // 2)
    up = Upload(FakeDevice(drv), copies, threads=2)
    with pytest.raises(driver.CudaError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        for i in range(len(copies)):
            up.wait(i)
    with pytest.raises(driver.CudaError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        up.finish()
    assert all(not t.is_alive() for t in up._threads)  # finish() returned only after every thread ended


@pytest.mark.gpu
def test_a_pass_started_during_a_slow_upload_reads_only_arrived_weights(monkeypatch):
    """Chunks of 64 KiB, each held back 3 ms before its copy, into weight memory poisoned with
    NaN: the first pass runs far ahead of the copies, so any op that read a weight before its
    copy landed would put NaN in the logits. They must match the reference like any other load's."""
    import reflex_engine
    from reflex_engine.backends.cuda import ops as cuda_ops
    from reflex_engine.check import check_against_reference
    from test_goldens import paths

    monkeypatch.setattr(upload, "CHUNK", 64 << 10)
    monkeypatch.setattr(upload, "_madvise", lambda *args: time.sleep(3e-3))
    reserve = cuda_ops.CudaOps.reserve

    def poisoned(self, *args):
        reserve(self, *args)
        w = self._weights
        self.device.drv.cuMemsetD32Async(w.base, 0x7FC00000, w.size // 4, self.device.stream)
        self.device.synchronize()  # before the copies start on their own streams

    monkeypatch.setattr(cuda_ops.CudaOps, "reserve", poisoned)
    for arch in ("qwen3", "llama3"):  # tied embeddings (the table is the head) and rope factors
        model_path, golden_path = paths(arch, "Q8_0")
        model = reflex_engine.load(model_path, device="cuda")
        assert model.ops._upload is not None  # the copies are still running as the check begins
        report = check_against_reference(model, golden_path)
        assert report.ok, "\n".join(report.lines)
