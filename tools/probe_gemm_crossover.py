"""Prompt passes through each prompt GEMM, in one process: the GEMM from the blocks in tiles of 64 tokens
(kernels/gemm_tile.cu, its types) against the paths before it (kernels/gemm_frag.cu and gemm.cu up to
ops.F16_GEMM_MIN_TOKENS, the f16 copy of kernels/gemm_f16.cu from there), at each prompt length, with
ops.GEMM_TILE_MIN_TOKENS set to take the tile kernel at every length or at none.

    PYTHONPATH=src python3 tools/probe_gemm_crossover.py MODEL [--tokens 16,24,32,40,48,64,128,512] [--runs 3]

A throwaway measurement tool: it patches the module constant the dispatch reads, and drops the
launches planned and the passes captured under the other.
"""
import argparse
import random
import statistics
import sys

import reflex_engine
from reflex_engine.backends.cuda import ops
from reflex_engine.errors import ReflexError
from reflex_engine.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", default="16,24,32,40,48,64,128,512")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    try:
        lengths = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        sys.exit(f"probe_gemm_crossover: --tokens takes comma-separated integers of 1 or more, not {args.tokens!r}")
    if args.runs < 1:
        sys.exit("probe_gemm_crossover: --runs takes 1 or more")
    try:
        model = reflex_engine.load(args.model, device="cuda", n_ctx=max(lengths) + 64)
    except ReflexError as e:
        sys.exit(f"probe_gemm_crossover: {e}")
    rng, greedy = random.Random(0), SamplingParams(temperature=0)

    def pass_ms(n: int) -> float:
        ids = [rng.randrange(model.config.n_vocab) for _ in range(n)]
        gen = model.generate(ids, max_tokens=1, sampling=greedy, ignore_eos=True)
        for _ in gen:
            pass
        return gen.timings["prompt_eval_ms"]

    paths = {"frag, blocks or f16 (before)": 1 << 30, "tile (gemm_tile.cu)": ops.MATVEC_MAX_TOKENS + 1}
    print(f"## {args.model}: prompt pass ms, median of {args.runs}\n")
    print("| tokens | " + " | ".join(paths) + " |\n" + "|---" * (len(paths) + 1) + "|")
    for n in lengths:
        cells = []
        for threshold in paths.values():
            ops.GEMM_TILE_MIN_TOKENS = threshold
            model.ops._plans.clear()
            model._forward.close()
            pass_ms(n)
            cells.append(statistics.median(pass_ms(n) for _ in range(args.runs)))
        print(f"| {n} | " + " | ".join(f"{c:.2f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
