"""Where a replayed decode step's time goes on its critical path: the step's CUDA graph (as probe_graph_nodes
captures it) replayed under torch's profiler, whose CUPTI records give every kernel node its GPU start and end.
Programmatic launches let a kernel start before the one before it ends, so a node's share of the step is how far
it moves the step's end: its end minus the latest end before it ("adds"). Beside it the node's span (first block
start to last block end) and its start's lead over the end before it (a negative gap: it started that early).
Rows are kernel places as probe_graph_nodes --places names them (a matvec by its grid and the kernel before it);
figures are medians over the replays, summed over a place's nodes.

    PYTHONPATH=src python3 tools/probe_timeline.py MODEL [--replays 30] [--contexts 128]

Before the table, one replay's first 40 nodes in order. Needs torch (the GPU machine's python3 has it): a
throwaway measurement tool, never the engine's path.
"""
import argparse
import json
import statistics
import sys
import tempfile
from collections import Counter, defaultdict

from probe_graph_nodes import captured_step, load_for_steps, places


def kernel_events(trace_path: str) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of each GPU kernel in a chrome trace, by start."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    out = [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]))
           for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    return sorted(out, key=lambda e: e[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--contexts", default="128")
    args = ap.parse_args()
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        sys.exit("probe_timeline: needs torch (its profiler reads CUPTI)")
    model, contexts = load_for_steps("probe_timeline", args, min_replays=3)
    torch.cuda.init()  # the primary context Reflex holds
    for context in contexts:
        dev = model.ops.device
        drv = dev.drv
        exec_, graph, nodes = captured_step(model, context)
        named = [name for _, name in places(nodes)]
        for _ in range(10):
            drv.cuGraphLaunch(exec_, dev.stream)
        drv.cuStreamSynchronize(dev.stream)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.replays):
                drv.cuGraphLaunch(exec_, dev.stream)
            drv.cuStreamSynchronize(dev.stream)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            events = kernel_events(f.name)
        drv.cuGraphDestroy(graph)
        report(args, context, named, events)


def report(args, context: int, named: list[str], events) -> None:
    n = len(named)
    if len(events) < n * args.replays:
        sys.exit(f"probe_timeline: {len(events)} kernel records for {args.replays} replays of {n} nodes: "
                 "the profiler missed some (CUPTI off?)")
    events = events[-n * args.replays:]
    adds, spans, gaps, steps = defaultdict(list), defaultdict(list), defaultdict(list), []
    for r in range(args.replays):
        replay = events[r * n:(r + 1) * n]
        for (name, _, _), want in zip(replay, named):
            if not want.startswith(name):
                sys.exit(f"probe_timeline: replay {r}'s kernels are not the graph's in order ({name} for {want})")
        last_end = replay[0][1]
        per_place = defaultdict(lambda: [0.0, 0.0, 0.0])
        for (_, start, end), place in zip(replay, named):
            acc = per_place[place]
            acc[0] += max(0.0, end - last_end)
            acc[1] += end - start
            acc[2] += start - last_end
            last_end = max(last_end, end)
        for place, (a, s, g) in per_place.items():
            adds[place].append(a)
            spans[place].append(s)
            gaps[place].append(g)
        steps.append(last_end - replay[0][1])
        if r == args.replays // 2:
            print(f"### one replay's first 40 nodes (us from its start)\n\n| node | start | end | span |\n|---|---|---|---|")
            for (_, start, end), place in list(zip(replay, named))[:40]:
                print(f"| {place} | {start - replay[0][1]:.2f} | {end - replay[0][1]:.2f} | {end - start:.2f} |")
            print()
    counts, med = Counter(named), statistics.median
    step = med(steps)
    print(f"## {args.model}: a decode step at a {context}-token context, {n} kernel nodes, {step:.1f} us first start to "
          f"last end (median of {args.replays} replays under the profiler)\n")
    print("| place | nodes | adds us | adds a node | span a node | start's gap a node |\n|---|---|---|---|---|---|")
    for place in sorted(adds, key=lambda p: -med(adds[p])):
        c = counts[place]
        print(f"| {place} | {c} | {med(adds[place]):.1f} | {med(adds[place]) / c:.2f} | {med(spans[place]) / c:.2f} | "
              f"{med(gaps[place]) / c:.2f} |")
    print()


if __name__ == "__main__":
    sys.exit(main())
