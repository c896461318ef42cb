"""tools/probe_clocks.py's reading of a timing build's block records (kernels/clocks.cuh), on records made here from
known times: each block's SM clock starts anywhere (wrapping past 2^32 included), so every mark must be placed from
its own block's wait."""
import itertools

import numpy as np
import pytest

import probe_clocks as pc

RATE = 1.98  # SM cycles a ns
BLOCKS = itertools.count()  # every block its own index


def block(grid: int, marks_ns: dict[int, float], rng) -> np.ndarray:
    """One block's record: its marks at those global-timer ns, its clock offset random."""
    r = np.zeros(1, pc.RECORD)
    r["grid"], r["block"] = grid, next(BLOCKS)
    r["wait_ns"], r["followed_ns"] = marks_ns[pc.MARK_WAIT], marks_ns[pc.MARK_FOLLOWED]
    offset = int(rng.integers(0, 2**32))
    for mark, ns in marks_ns.items():
        r["marks"][0, mark] = (offset + round(ns * RATE)) % 2**32 | 1
    return r


def steps(*pairs) -> dict[int, float]:
    """Step marks: (bytes in, products done) ns of steps 0, 1, ..."""
    out = {}
    for k, (bytes_in, done) in enumerate(pairs):
        out[pc.MARK_STEP + 2 * k], out[pc.MARK_STEP + 2 * k + 1] = bytes_in, done
    return out


def test_mark_times_place_every_mark_from_its_own_blocks_wait_across_clock_wraps():
    rng = np.random.default_rng(1)
    marks = {pc.MARK_START: 9_000.0, pc.MARK_WAIT: 10_000.0, pc.MARK_FOLLOWED: 13_500.0, pc.MARK_END: 20_250.0}
    records = np.concatenate([block(1, marks, rng) for _ in range(64)])
    records["wait_ns"] += 1_764_900_000_000_000_000  # the timer's ns since 1970: past float64's integers
    times = pc.mark_times(records, RATE, origin=1_764_900_000_000_000_000)
    for mark, ns in marks.items():
        assert np.allclose(times[:, mark], ns, atol=1.0)
    assert np.isnan(times[:, pc.MARK_STEP]).all()  # never marked


def test_the_sm_clock_is_read_against_the_global_timer_from_the_long_waits():
    rng = np.random.default_rng(2)
    records = np.concatenate([block(1, {pc.MARK_WAIT: 1e6, pc.MARK_FOLLOWED: 1e6 + 3_000 + 100 * i}, rng)
                              for i in range(12)])
    assert pc.cycles_per_ns(records) == pytest.approx(RATE, rel=1e-3)
    with pytest.raises(SystemExit, match="too few blocks"):
        pc.cycles_per_ns(records[:5])


def test_launches_come_in_the_order_they_started_and_each_blocks_figures_are_read():
    rng = np.random.default_rng(3)
    first = [block(9, {pc.MARK_WAIT: 1_000.0, pc.MARK_FOLLOWED: 1_500.0 + 10 * i, pc.MARK_END: 8_000.0 + i}, rng)
             for i in range(3)]
    # the second launch (a smaller grid id: order comes from the starts) is released at 8,400 ns; two of its four
    # blocks waited from 5,000 ns (early), two started at 8,900 and 9,300 (late)
    early = [block(4, {pc.MARK_START: 4_000.0, pc.MARK_WAIT: 5_000.0, pc.MARK_FOLLOWED: 8_400.0 + 50 * i,
                       pc.MARK_END: 15_000.0 + 1_000 * i, **steps((9_000.0, 11_000.0), (12_000.0, 13_500.0))}, rng)
             for i in range(2)]
    late = [block(4, {pc.MARK_START: s, pc.MARK_WAIT: s + 100, pc.MARK_FOLLOWED: s + 150, pc.MARK_END: s + 5_000,
                      **steps((s + 1_150, s + 3_150))}, rng) for s in (8_900.0, 9_300.0)]
    found = pc.launches(np.concatenate(late + first + early), RATE)
    assert [int(r["grid"][0]) for r, _ in found] == [9, 4]
    f = pc.launch_figures(found[1][1], found[0][1])
    assert f["early"] == 0.5
    assert f["release gap"] == pytest.approx((8_400 - 8_002) / 1e3, abs=1e-3)  # after the first launch's last end
    assert f["late start"] == pytest.approx((500 + 900) / 2 / 1e3, abs=1e-3)
    assert f["release->end"] == pytest.approx((16_000 - 8_400) / 1e3, abs=1e-3)
    # step 0's bytes after each block's own release: 600, 550 (early), 1,000, 1,000 (late)
    assert f["step 0 wait"] == pytest.approx(np.median([600, 550, 1_000, 1_000]) / 1e3, abs=1e-3)
    assert f["step wait"] == pytest.approx(1.0, abs=1e-3)  # 12,000 after 11,000; the late blocks took one step
    assert f["step work"] == pytest.approx(2.0, abs=1e-3)  # 2,000, 1,500 (early) and 2,000, 2,000
    assert np.isnan(f["iteration"])


def test_a_blocks_two_records_its_waits_and_its_block_clocks_are_joined():
    rng = np.random.default_rng(5)
    marks = {pc.MARK_START: 500.0, pc.MARK_WAIT: 1_000.0, pc.MARK_FOLLOWED: 4_000.0, pc.MARK_END: 9_000.0,
             **steps((4_500.0, 6_000.0))}
    whole = block(3, marks, rng)
    waits, own = whole.copy(), whole.copy()
    for mark in range(len(whole["marks"][0])):
        (own if mark in (pc.MARK_WAIT, pc.MARK_FOLLOWED) else waits)["marks"][0, mark] = 0
    own["wait_ns"] = own["followed_ns"] = 0
    other = block(3, {pc.MARK_WAIT: 1_200.0, pc.MARK_FOLLOWED: 4_000.0}, rng)
    out = pc.joined(np.concatenate([other, own, waits]))
    assert len(out) == 2 and out["block"].tolist() == [whole["block"][0], other["block"][0]]
    assert (out[0]["marks"] == whole[0]["marks"]).all() and out[0]["wait_ns"] == whole[0]["wait_ns"]
    assert (out[1]["marks"] == other[0]["marks"]).all()


def test_a_kernel_marking_only_its_steps_ends_gets_iterations():
    rng = np.random.default_rng(4)
    marks = {pc.MARK_WAIT: 0.0, pc.MARK_FOLLOWED: 1_000.0, pc.MARK_STEP + 1: 1_700.0, pc.MARK_STEP + 3: 2_900.0}
    (_, times), = pc.launches(block(5, marks, rng), RATE)
    f = pc.launch_figures(times)
    assert f["iteration"] == pytest.approx(np.median([700, 1_200]) / 1e3, abs=1e-3)
    assert np.isnan(f["step work"]) and np.isnan(f["release->end"]) and np.isnan(f["release gap"])


def test_a_saved_replay_keeps_each_launchs_blocks_and_their_marks(tmp_path):
    rng = np.random.default_rng(6)
    marks = {pc.MARK_WAIT: 1_000.0, pc.MARK_FOLLOWED: 3_000.0, pc.MARK_END: 7_500.0}
    found = pc.launches(np.concatenate([block(8, marks, rng), block(8, marks, rng), block(2, {pc.MARK_WAIT: 9_000.0,
                                        pc.MARK_FOLLOWED: 9_400.0}, rng)]), RATE)
    pc.save(str(tmp_path / "s.npz"), found, ["a", "b", "c"], step0=0.0)  # launches() counts from the first wait
    saved = np.load(tmp_path / "s.npz")
    assert saved["node"].tolist() == [0, 0, 1] and saved["names"].tolist() == ["a", "b"]
    assert np.allclose(saved["marks"][:2, pc.MARK_END], 6.5, atol=1e-3)  # us from step0
    assert np.isnan(saved["marks"][2, pc.MARK_END])
