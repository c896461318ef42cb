"""Where the f16 GEMM (kernels/gemm_f16.cu: weights dequantized once a pass) overtakes the
short-prompt GEMM straight from the blocks (kernels/gemm.cu): warm prompt passes of each length
with ops.F16_GEMM_MIN_TOKENS set to each candidate, so both paths are timed in one process.

    PYTHONPATH=src python3 tools/probe_gemm_crossover.py MODEL [--tokens 64,128,256,512] [--runs 3]

A throwaway measurement tool: it patches the module constant the dispatch reads.
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
    ap.add_argument("--tokens", default="48,64,96,128,192,256,384,512")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    try:
        lengths = [int(t) for t in args.tokens.split(",")]
        model = reflex_engine.load(args.model, device="cuda", n_ctx=max(lengths) + 64)
    except ValueError:
        sys.exit(f"probe_gemm_crossover: --tokens takes comma-separated integers, not {args.tokens!r}")
    except ReflexError as e:
        sys.exit(f"probe_gemm_crossover: {e}")
    rng, greedy = random.Random(0), SamplingParams(temperature=0)

    def pass_ms(n: int) -> float:
        ids = [rng.randrange(model.config.n_vocab) for _ in range(n)]
        gen = model.generate(ids, max_tokens=1, sampling=greedy, ignore_eos=True)
        for _ in gen:
            pass
        return gen.timings["prompt_eval_ms"]

    paths = {"blocks (gemm.cu)": 1 << 30, "f16 (gemm_f16.cu)": 1}
    print(f"## {args.model}: prompt pass ms, median of {args.runs}\n")
    print("| tokens | " + " | ".join(paths) + " |\n|---" * (len(paths) + 1) + "|")
    for n in lengths:
        cells = []
        for threshold in paths.values():
            ops.F16_GEMM_MIN_TOKENS = threshold
            pass_ms(n)
            cells.append(statistics.median(pass_ms(n) for _ in range(args.runs)))
        print(f"| {n} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
