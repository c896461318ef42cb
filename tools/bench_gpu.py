"""Warm decode and prefill timings of one model on the CUDA backend (the figures llama-bench gives).

    python tools/bench_gpu.py MODEL.gguf [--runs 5]

Prefill: `prompt_eval_ms` (forward over the prompt plus the first token's choice, which waits
for the device) for 16 and 1,024 random tokens; decode: tokens/s over 64 greedy tokens. Each the
median of --runs, after one warm-up. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import random
import statistics

import reflex_engine
from reflex_engine.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    model = reflex_engine.load(args.model, device="cuda", n_ctx=2048)
    rng = random.Random(0)
    greedy = SamplingParams(temperature=0)

    def run(n_prompt: int, n_gen: int):
        gen = model.generate([rng.randrange(model.config.n_vocab) for _ in range(n_prompt)], max_tokens=n_gen,
                             sampling=greedy, ignore_eos=True)
        for _ in gen:
            pass
        return gen

    print(f"| {model.ops.description} | median of {args.runs} |")
    print("|---|---|")
    for n in (16, 1024):
        run(n, 1)
        ms = statistics.median(run(n, 1).timings["prompt_eval_ms"] for _ in range(args.runs))
        print(f"| prefill {n} tokens | {ms:.2f} ms ({n / ms * 1e3:.0f} tok/s) |")
    run(16, 8)
    rate = statistics.median(run(16, 64).tokens_per_s for _ in range(args.runs))
    print(f"| decode, 64 tokens after a 16-token prompt | {rate:.1f} tok/s |")


if __name__ == "__main__":
    main()
