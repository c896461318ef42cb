"""Prompt passes eager, replayed as graphs captured with serialized launches, and replayed as graphs
captured with overlapped launches (programmatic stream serialization), on one model, interleaved.

    PYTHONPATH=src python3 tools/probe_prompt_graphs.py MODEL [--tokens 16 128 512] [--runs 7]

Prints, per prompt length, the median prompt_eval ms of each mode (each mode's graph captured
before its runs)."""
import argparse
import os
import statistics
import sys

os.environ["REFLEX_CUDA_GRAPHS"] = "0"  # the plain forward; graphs are wrapped around it below
import reflex_engine  # noqa: E402
from reflex_engine.backends.cuda import graph  # noqa: E402
from reflex_engine.errors import ReflexError  # noqa: E402
from reflex_engine.sampling import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 512])
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    if args.runs < 1 or min(args.tokens) < 1 or max(args.tokens) > 1000:
        sys.exit("probe_prompt_graphs: --runs and --tokens take 1 or more (--tokens at most 1,000)")
    try:
        model = reflex_engine.load(args.model, device="cuda", n_ctx=1024)
    except ReflexError as e:
        sys.exit(f"probe_prompt_graphs: {e}")
    plain = model._forward
    model.ops.graphs = True
    greedy = SamplingParams(temperature=0)
    modes = {"eager": (plain, 1), "graph, serialized": (model.ops.replayable(plain), 1),
             "graph, overlapped": (model.ops.replayable(plain), 512)}
    print(f"## {args.model}: prompt_eval ms, median of {args.runs}\n")
    print("| tokens | " + " | ".join(modes) + " |\n|---|" + "---|" * len(modes))
    for n in args.tokens:
        ids = list(range(1000, 1000 + n))
        times = {m: [] for m in modes}
        for i in range(args.runs + 2):
            for m, (forward, overlap) in modes.items():
                model._forward, graph.OVERLAP_MAX_TOKENS = forward, overlap
                gen = model.generate(ids, max_tokens=1, sampling=greedy, ignore_eos=True)
                for _ in gen:
                    pass
                if i >= 2:  # seen, then captured
                    times[m].append(gen.timings["prompt_eval_ms"])
        print(f"| {n} | " + " | ".join(f"{statistics.median(t):.2f}" for t in times.values()) + " |", flush=True)
        for forward, _ in list(modes.values())[1:]:
            forward.close()  # the graph pool holds one set of graphs' logits


if __name__ == "__main__":
    main()
