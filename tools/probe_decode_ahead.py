"""Greedy decode with each pass queued before the host reads the token it follows (the sampler's
`ahead`, as the engine runs it) against the host reading every token first (`ahead` off), on one
model, interleaved.

    PYTHONPATH=src python3 tools/probe_decode_ahead.py MODEL [--context 128] [--tokens 64] [--runs 7]

Prints the median decode tok/s of each (graphs on in both: each shape captured before its runs)."""
import argparse
import statistics
import sys

import reflex_engine
from reflex_engine.backends.cuda.sampler import CudaSampler
from reflex_engine.errors import ReflexError
from reflex_engine.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    if args.runs < 1 or args.context < 1 or args.tokens < 2:
        sys.exit("probe_decode_ahead: --runs and --context take 1 or more, --tokens 2 or more")
    try:
        model = reflex_engine.load(args.model, device="cuda", n_ctx=args.context + args.tokens + 8)
    except ReflexError as e:
        sys.exit(f"probe_decode_ahead: {e}")
    ids, greedy, ahead = list(range(1000, 1000 + args.context)), SamplingParams(temperature=0), CudaSampler.ahead
    modes = {"queued ahead": ahead, "host reads each token first": lambda self, logits: None}
    rates = {m: [] for m in modes}
    for i in range(args.runs + 2):
        for m, fn in modes.items():
            CudaSampler.ahead = fn
            gen = model.generate(ids, max_tokens=args.tokens, sampling=greedy, ignore_eos=True)
            for _ in gen:
                pass
            if i >= 2:  # shapes seen, then captured
                rates[m].append(gen.tokens_per_s)
    CudaSampler.ahead = ahead
    print(f"## {args.model}: greedy decode after {args.context} tokens, {args.tokens} tokens, median of {args.runs}\n")
    print("| " + " | ".join(modes) + " |\n|---|---|\n| " + " | ".join(f"{statistics.median(r):.1f} tok/s" for r in rates.values()) + " |")


if __name__ == "__main__":
    main()
