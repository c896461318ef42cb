"""How the matmuls' launch shapes set warm speed, each variant in one process: weights per launch
(ops.MAX_FUSED: q, k and v in one launch, or one each), the one-token matvec's grid
(ops.DECODE_BLOCKS_PER_SM) and its early weight requests (ops.DECODE_PREFETCH_BYTES,
kernels/matvec_x16.cu prefetch_decode_rows). Per variant: decode tokens/s at a 128-token context
(the decode graph captured again) and the 16-token prompt's pass.

    PYTHONPATH=src python3 tools/probe_launch_shapes.py MODEL [--fused 3,1] [--blocks 2,4,0] [--prefetch-mb 0,16] [--runs 3]

--blocks 0 is a block for every group of rows (the grid before the strided one). A throwaway
measurement tool: it patches the module constants the launches read.
"""
import argparse
import itertools
import statistics
import sys

import reflex_engine
from reflex_engine.backends.cuda import ops
from reflex_engine.bench import decode_weight_bytes, run_bench
from reflex_engine.errors import ReflexError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--fused", default="3,1")
    ap.add_argument("--blocks", default="2,4,0")
    ap.add_argument("--prefetch-mb", default="0,16")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    try:
        grid = [[int(v) for v in a.split(",")] for a in (args.fused, args.blocks, args.prefetch_mb)]
    except ValueError:
        sys.exit("probe_launch_shapes: --fused, --blocks and --prefetch-mb take comma-separated integers")
    if not all(1 <= f <= ops.FUSED_WEIGHTS for f in grid[0]) or min(grid[1] + grid[2]) < 0 or args.runs < 1:
        sys.exit(f"probe_launch_shapes: --fused takes 1 to {ops.FUSED_WEIGHTS}, --blocks and --prefetch-mb 0 or more, "
                 "--runs 1 or more")
    try:
        model = reflex_engine.load(args.model, device="cuda", n_ctx=512)
    except ReflexError as e:
        sys.exit(f"probe_launch_shapes: {e}")
    copy, weight_bytes = model.ops.device.copy_bandwidth(), decode_weight_bytes(model)
    print(f"## {args.model}: median of {args.runs}; the decode bound: {weight_bytes / 1e9:.2f} GB a token "
          f"over the copy's {copy / 1e12:.2f} TB/s\n")
    print("| weights a launch | blocks an SM | prefetch MB | decode tok/s | of the bound | prefill 16 ms |\n"
          "|---|---|---|---|---|---|")
    for fused, blocks, mb in itertools.product(*grid):
        ops.MAX_FUSED, ops.DECODE_BLOCKS_PER_SM, ops.DECODE_PREFETCH_BYTES = fused, blocks or 1 << 20, mb << 20
        model.ops._plans.clear()  # the matmuls' launches, made again with these constants
        model._decode_step.close()  # captured again at the next step, with these launches
        reports = [run_bench(model, runs=2, decode_tokens=64, prefill_tokens=(16,), contexts=(128,)) for _ in range(args.runs)]
        rate = statistics.median(r.decode[128]["tokens_per_s"] for r in reports)
        prefill = statistics.median(r.prefill[16] for r in reports)
        print(f"| {fused} | {blocks or 'all'} | {mb} | {rate:.1f} | {rate * weight_bytes / copy:.1%} | {prefill:.2f} |", flush=True)


if __name__ == "__main__":
    main()
