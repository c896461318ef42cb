"""How the one-token matvec's grid and its early weight requests (kernels/matvec_x16.cu
matvec_x16_decode) set decode speed: warm decode tokens/s at a 128-token context with
ops.DECODE_BLOCKS_PER_SM and ops.DECODE_PREFETCH_BYTES set to each candidate, the decode graph
captured again for each, in one process.

    PYTHONPATH=src python3 tools/probe_decode_prefetch.py MODEL [--blocks 2,4,0] [--prefetch-mb 0,16] [--runs 3]

--blocks 0 is a block for every group of rows (the grid before the strided one). A throwaway
measurement tool: it patches the module constants the launch reads.
"""
import argparse
import statistics
import sys

import reflex_engine
from reflex_engine.backends.cuda import ops
from reflex_engine.bench import decode_weight_bytes, run_bench
from reflex_engine.errors import ReflexError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--blocks", default="2,3,4,0")
    ap.add_argument("--prefetch-mb", default="0,8,16,32")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    try:
        blocks = [int(b) for b in args.blocks.split(",")]
        prefetch = [int(m) for m in args.prefetch_mb.split(",")]
        model = reflex_engine.load(args.model, device="cuda", n_ctx=512)
    except ValueError:
        sys.exit("probe_decode_prefetch: --blocks and --prefetch-mb take comma-separated integers")
    except ReflexError as e:
        sys.exit(f"probe_decode_prefetch: {e}")
    copy = model.ops.device.copy_bandwidth()
    weight_bytes = decode_weight_bytes(model)
    print(f"## {args.model}: decode tok/s at context 128 (median of {args.runs}), "
          f"fraction of the bandwidth bound ({weight_bytes / 1e9:.2f} GB a token, copy {copy / 1e12:.2f} TB/s)\n")
    print("| blocks an SM | prefetch MB | tok/s | bound |\n|---|---|---|---|")
    for b in blocks:
        for mb in prefetch:
            ops.DECODE_BLOCKS_PER_SM = b if b else 1 << 20
            ops.DECODE_PREFETCH_BYTES = mb << 20
            model._decode_step._exec = None  # capture the step again with these launches (the old one leaks)
            rates = [run_bench(model, runs=2, decode_tokens=64, prefill_tokens=(), contexts=(128,))
                     .decode[128]["tokens_per_s"] for _ in range(args.runs)]
            rate = statistics.median(rates)
            print(f"| {b or 'all'} | {mb} | {rate:.1f} | {rate * weight_bytes / copy:.1%} |", flush=True)


if __name__ == "__main__":
    main()
