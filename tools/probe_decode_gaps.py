"""Where a greedy decode's time goes between tokens, as `reflex bench` times it: runs of generate(CONTEXT,
TOKENS), each token's arrival stamped; per run the rate bench reports and every gap past 2x the run's median
(its index: 0 is the gap after the first token), with Python's garbage collector on and off in turn.

    PYTHONPATH=src python3 tools/probe_decode_gaps.py MODEL [--context 128] [--tokens 64] [--runs 6]

A throwaway measurement tool.
"""
import argparse
import gc
import random
import statistics
import sys
import time

import reflex_engine
from reflex_engine.errors import ReflexError
from reflex_engine.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=6)
    args = ap.parse_args()
    if args.runs < 1 or args.context < 1 or args.tokens < 3:
        sys.exit("probe_decode_gaps: --runs and --context take 1 or more, --tokens 3 or more")
    try:
        model = reflex_engine.load(args.model, device="cuda", n_ctx=512)
    except ReflexError as e:
        sys.exit(f"probe_decode_gaps: {e}")
    rng, greedy = random.Random(0), SamplingParams(temperature=0)

    def run(n_gen: int):
        ids = [rng.randrange(model.config.n_vocab) for _ in range(args.context)]
        gen = model.generate(ids, max_tokens=n_gen, sampling=greedy, ignore_eos=True)
        stamps = [time.perf_counter() for event in gen if event.id is not None]
        return gen, [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]

    run(8)
    run(4)
    print(f"## {args.model}: generate({args.context}, {args.tokens}), gaps in ms\n")
    print("| gc | tok/s | median gap | gaps past 2x the median (index: ms) |\n|---|---|---|---|")
    for i in range(args.runs):
        collect = i % 2 == 0
        (gc.enable if collect else gc.disable)()
        gen, gaps = run(args.tokens)
        gc.enable()
        median = statistics.median(gaps)
        slow = ", ".join(f"{k}: {g:.2f}" for k, g in enumerate(gaps) if g > 2 * median)
        print(f"| {'on' if collect else 'off'} | {gen.tokens_per_s:.1f} | {median:.3f} | {slow or '-'} |", flush=True)


if __name__ == "__main__":
    main()
