"""The weight upload's plan: the copies cut into chunks that can each be pinned on their own.
A page can be registered with the driver once, so chunks must never share one; every byte of
every copy must land once, at its own device offset."""
import random

import pytest

from reflex_engine.backends.cuda.upload import Copy, plan_chunks

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
        assert c.start % PAGE == 0 and c.end % PAGE == 0 and c.end - c.start <= chunk
        for p in c.copies:
            assert c.start <= p.src and p.src + p.nbytes <= c.end  # each piece inside its chunk's pinned range
        pinned.append((c.start, c.end))
    pinned.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(pinned, pinned[1:]))
    # the pieces, put back together, are exactly the copies: same source bytes to the same device bytes
    pieces = sorted((p for c in chunks for p in c.copies), key=lambda p: p.src)
    for copy in copies:
        mine = [p for p in pieces if copy.src <= p.src < copy.src + copy.nbytes]
        assert sum(p.nbytes for p in mine) == copy.nbytes
        at = copy.src
        for p in mine:
            assert p.src == at and p.dst - copy.dst == p.src - copy.src
            at += p.nbytes


def test_chunks_come_in_file_order_and_empty_copies_are_dropped():
    copies = [Copy(1 << 40, 10 * PAGE, 3 * PAGE), Copy(2 << 40, 2 * PAGE, 5), Copy(3 << 40, 99 * PAGE, 0)]
    chunks = plan_chunks(copies, chunk=4 * PAGE, page=PAGE)
    assert [c.start for c in chunks] == sorted(c.start for c in chunks)
    assert all(p.nbytes for c in chunks for p in c.copies)
    assert plan_chunks([Copy(1, 2, 0)]) == []
