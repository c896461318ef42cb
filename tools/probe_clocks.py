"""Where a replayed decode step's blocks spend their time, from a timing build's marks (kernels/clocks.cuh): for
every kernel node, when its blocks started against the end of the kernel before (a programmatic launch lets them
start early, if the SMs have room), how long after that end it took, and, for the matvecs that mark their steps,
each step's wait for its bytes and its products. probe_timeline gives a node's span; this gives its blocks'.

    bash tools/build_variant.sh clocks --clocks            (here: .clocks/clocks, a package with a timing image)
    PYTHONPATH=.clocks/clocks/src python3 tools/probe_clocks.py MODEL [--replays 20] [--contexts 128]

(gpu_check.sh's CLOCKS=1 runs it on the GPU machine, with the helper built there.)

A node's release is the first moment one of its blocks got past its wait (the kernel before it had ended). Per
place (probe_timeline's rows), means over its nodes of each replay's medians over blocks, then the median replay:

  early         blocks already waiting at the release (the rest started after it)
  release gap   the release after the last block end of the launch before (where that kernel marks its ends):
                what the launch boundary itself costs
  late start    a late block's start after the release (median over the late ones)
  release->end  the node's last block end (a block's last warp's) after its release
  step 0 wait   a step-marking block's first bytes in after its release (or, started late, its start)
  step wait     later steps' bytes in after the step before was done
  step work     a step's products, from its bytes in to its block's barrier after it
  iteration     (kernels marking only their steps' ends: the int16 matvecs' units) one round of a thread's loads
                and products

Timing builds only: needs a package whose image was built with REFLEX_CUDA_CLOCKS=1 (its blocks write records
the production image has no room for). Throwaway measurement, never the engine's path.
"""
import argparse
import ctypes
import os
import statistics
import sys
from collections import defaultdict
from ctypes import byref, c_size_t, c_void_p

import numpy as np

from probe_graph_nodes import captured_step, load_for_steps, places

MARK_START, MARK_WAIT, MARK_FOLLOWED, MARK_END, MARK_STEP = range(5)
CLOCK_STEPS = 10
# kernels/clocks.cuh BlockClocks
RECORD = np.dtype([("grid", "<u8"), ("block", "<u4"), ("sm", "<u4"), ("wait_ns", "<u8"), ("followed_ns", "<u8"),
                   ("marks", "<u4", (MARK_STEP + 2 * CLOCK_STEPS,))])
assert RECORD.itemsize == 128  # clocks.cuh static_asserts the same
COLUMNS = ("early", "release gap", "late start", "release->end", "step 0 wait", "step wait", "step work", "iteration")


def cycles_per_ns(records: np.ndarray) -> float:
    """The SM clock, from the blocks whose wait took long enough for the global timer's steps not to matter."""
    ns = records["followed_ns"].astype(np.int64) - records["wait_ns"].astype(np.int64)
    cycles = (records["marks"][:, MARK_FOLLOWED] - records["marks"][:, MARK_WAIT]).astype(np.uint32).astype(np.int64)
    long = ns > 2000
    if long.sum() < 10:
        sys.exit("probe_clocks: too few blocks waited 2 us or more to read the SM clock against the global timer")
    return float(np.median(cycles[long] / ns[long]))


def mark_times(records: np.ndarray, rate: float, origin: int = 0) -> np.ndarray:
    """(blocks, marks) ns on the global timer's line from origin, NaN where unmarked: each mark placed from its block's
    wait. (The timer counts ns since 1970: past 2^53, so a float64 of it would round to 256 ns.)"""
    marks = records["marks"]
    since_wait = (marks - marks[:, [MARK_WAIT]]).astype(np.uint32).view(np.int32).astype(np.float64) / rate
    out = (records["wait_ns"].astype(np.int64) - origin).astype(np.float64)[:, None] + since_wait
    out[marks == 0] = np.nan
    return out


def block_starts(times: np.ndarray) -> np.ndarray:
    """Each block's start: its kernel's start mark, or (a kernel holding no BlockClock) its wait's."""
    return np.where(np.isnan(times[:, MARK_START]), times[:, MARK_WAIT], times[:, MARK_START])


def joined(records: np.ndarray) -> np.ndarray:
    """One record a block: a block holding a BlockClock wrote its own marks and its wait's apart, each with the
    other's zero."""
    r = records[np.lexsort((records["block"], records["grid"]))]
    if not len(r):
        return r
    first = np.flatnonzero(np.r_[True, (np.diff(r["grid"]) != 0) | (np.diff(r["block"].astype(np.int64)) != 0)])
    out = r[first].copy()
    for field in ("wait_ns", "followed_ns", "marks"):
        out[field] = np.maximum.reduceat(r[field], first, axis=0)
    return out


def launches(records: np.ndarray, rate: float) -> list[tuple[np.ndarray, np.ndarray]]:
    """(records, mark times) of each launch in one replay, in the order they started."""
    records = joined(records)
    recorded = records[records["marks"][:, MARK_WAIT] != 0]  # every block marks its wait
    times = mark_times(recorded, rate, int(recorded["wait_ns"].min()) if len(recorded) else 0)
    starts = block_starts(times)
    out = []
    for grid in np.unique(recorded["grid"]):
        mine = recorded["grid"] == grid
        out.append((starts[mine].min(), recorded[mine], times[mine]))
    out.sort(key=lambda launch: launch[0])
    return [(r, t) for _, r, t in out]


def last_end(times: np.ndarray) -> float:
    """The launch's last block end (a block's last warp's), NaN if its kernel holds no BlockClock."""
    ends = times[:, MARK_END]
    return float(np.nanmax(ends)) if np.any(~np.isnan(ends)) else float("nan")


def launch_figures(times: np.ndarray, before: np.ndarray | None = None) -> dict[str, float]:
    """COLUMNS of one launch (us; `early` a fraction), from its blocks' mark times and the launch before's."""
    med = lambda a: float(np.nanmedian(a)) / 1e3 if np.any(~np.isnan(a)) else float("nan")
    start = block_starts(times)
    followed = times[:, MARK_FOLLOWED]
    release = np.nanmin(followed)
    early = times[:, MARK_WAIT] <= release
    out = {"early": float(early.mean()),
           "release gap": (release - last_end(before)) / 1e3 if before is not None else float("nan"),
           "late start": med(start[~early] - release), "release->end": (last_end(times) - release) / 1e3}
    bytes_in = times[:, MARK_STEP::2][:, :CLOCK_STEPS]
    done = times[:, MARK_STEP + 1::2][:, :CLOCK_STEPS]
    after = np.concatenate([followed[:, None], done[:, :-1]], axis=1)  # what each step waited for
    if np.any(~np.isnan(bytes_in)):
        out["step 0 wait"] = med(bytes_in[:, 0] - followed)
        out["step wait"] = med((bytes_in - after)[:, 1:])
        out["step work"] = med(done - bytes_in)
        out["iteration"] = float("nan")
    else:
        out["step 0 wait"] = out["step wait"] = out["step work"] = float("nan")
        out["iteration"] = med(done - after)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--contexts", default="128")
    ap.add_argument("--save", metavar="PREFIX", help="also write one replay's first --save-nodes launches' block marks "
                    "to PREFIX-CONTEXT.npz (us from the step's first start; NaN unmarked), for reading them here")
    ap.add_argument("--save-nodes", type=int, default=60)
    args = ap.parse_args()
    if args.save_nodes < 1 or (args.save and not os.access(os.path.dirname(os.path.abspath(args.save)), os.W_OK)):
        sys.exit("probe_clocks: --save-nodes takes 1 or more, --save a prefix in a folder this process may write")
    model, contexts = load_for_steps("probe_clocks", args, min_replays=1)
    dev = model.ops.device
    drv, lib = dev.drv, dev.drv._lib
    records_at, records_size, used_at, used_size = c_void_p(), c_size_t(), c_void_p(), c_size_t()
    if (lib.cuModuleGetGlobal_v2(byref(records_at), byref(records_size), dev.module, b"reflex_clocks")
            or lib.cuModuleGetGlobal_v2(byref(used_at), byref(used_size), dev.module, b"reflex_clocks_used")):
        sys.exit("probe_clocks: this package's kernels are not a timing build (REFLEX_CUDA_CLOCKS=1 build_kernels.py)")
    capacity = records_size.value // RECORD.itemsize
    for context in contexts:
        exec_, graph, nodes = captured_step(model, context)
        named = [name for _, name in places(nodes)]
        for _ in range(10):
            drv.cuGraphLaunch(exec_, dev.stream)
        replays = []
        for _ in range(args.replays):
            drv.cuMemsetD8Async(records_at.value, 0, records_size.value, dev.stream)
            drv.cuMemsetD32Async(used_at.value, 0, 1, dev.stream)
            drv.cuGraphLaunch(exec_, dev.stream)
            used = ctypes.c_uint32()
            drv.cuMemcpyDtoHAsync_v2(byref(used), used_at.value, 4, dev.stream)
            drv.cuStreamSynchronize(dev.stream)
            if used.value > capacity:
                sys.exit(f"probe_clocks: a step's {used.value} blocks overflow the build's {capacity} records")
            raw = np.empty(used.value, RECORD)
            drv.cuMemcpyDtoHAsync_v2(raw.ctypes.data, records_at.value, raw.nbytes, dev.stream)
            drv.cuStreamSynchronize(dev.stream)
            replays.append(raw)
        drv.cuGraphDestroy(graph)
        report(args, context, named, replays)


def report(args, context: int, named: list[str], replays: list[np.ndarray]) -> None:
    rate = cycles_per_ns(np.concatenate(replays))
    per_place = defaultdict(lambda: defaultdict(list))  # place -> column -> [a replay's mean over its nodes]
    for r, raw in enumerate(replays):
        found = launches(raw, rate)
        if len(found) != len(named):
            sys.exit(f"probe_clocks: replay {r} recorded {len(found)} launches, the graph has {len(named)} kernel nodes")
        rows = defaultdict(lambda: defaultdict(list))
        for i, ((_, times), place) in enumerate(zip(found, named)):
            for column, v in launch_figures(times, found[i - 1][1] if i else None).items():
                rows[place][column].append(v)
        for place, columns in rows.items():
            for column, vs in columns.items():
                per_place[place][column].append(float(np.nanmean(vs)) if np.any(~np.isnan(vs)) else float("nan"))
        if r == len(replays) // 2:
            step0 = min(np.nanmin(block_starts(t)) for _, t in found)
            print(f"### one replay's first 40 nodes (us from its first block's start; SM clock {rate:.3f} GHz)\n")
            print("| node | blocks | SMs | first start | release | " + " | ".join(COLUMNS) + " |")
            print("|---|---|---|---|---|" + "---|" * len(COLUMNS))
            for i, ((recs, times), place) in enumerate(list(zip(found, named))[:40]):
                start = np.nanmin(block_starts(times))
                figures = launch_figures(times, found[i - 1][1] if i else None)
                print(f"| {place} | {len(recs)} | {len(np.unique(recs['sm']))} | {(start - step0) / 1e3:.2f} | "
                      f"{(np.nanmin(times[:, MARK_FOLLOWED]) - step0) / 1e3:.2f} | " + " | ".join(fmt(c, figures[c]) for c in COLUMNS) + " |")
            print()
            if args.save:
                save(f"{args.save}-{context}.npz", found[:args.save_nodes], named, step0)
    counts = {p: named.count(p) for p in per_place}
    print(f"## {args.model}: a decode step at a {context}-token context, {len(named)} kernel nodes (a node's figures "
          f"over its blocks, the place's mean over its nodes, median of {len(replays)} replays)\n")
    print("| place | nodes | " + " | ".join(COLUMNS) + " |\n|---|---|" + "---|" * len(COLUMNS))
    med = lambda vs: statistics.median(vs) if not any(v != v for v in vs) else float("nan")
    for place in sorted(per_place, key=lambda p: -counts[p] * nan_zero(med(per_place[p]["release->end"]))):
        print(f"| {place} | {counts[place]} | " + " | ".join(fmt(c, med(per_place[place][c])) for c in COLUMNS) + " |")
    print()


def save(path: str, found: list[tuple[np.ndarray, np.ndarray]], named: list[str], step0: float) -> None:
    """The launches' blocks: node (its place in the step), block, SM and every mark, us from step0 (float32)."""
    node = np.concatenate([np.full(len(r), i, np.int32) for i, (r, _) in enumerate(found)])
    try:
        np.savez_compressed(path, node=node, names=np.array(named[:len(found)]),
                            block=np.concatenate([r["block"] for r, _ in found]),
                            sm=np.concatenate([r["sm"] for r, _ in found]),
                            marks=np.concatenate([(t - step0) / 1e3 for _, t in found]).astype(np.float32))
    except OSError as e:
        sys.exit(f"probe_clocks: cannot write {path}: {e.strerror}")
    print(f"{path}: {len(node)} blocks of {len(found)} launches")


def nan_zero(v: float) -> float:
    return 0.0 if v != v else v


def fmt(column: str, v: float) -> str:
    if v != v:
        return ""
    return f"{100 * v:.0f}%" if column == "early" else f"{v:.2f}"


if __name__ == "__main__":
    sys.exit(main())
