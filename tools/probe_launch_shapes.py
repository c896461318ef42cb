"""How the matmuls' launch shapes set warm speed, each variant in one process: weights per launch
(ops.MAX_FUSED: q, k and v in one launch, or one each), the short-prompt GEMM's column splits
(ops.GEMM_BLOCKS_AN_SM: the blocks a weight's splits aim for, per SM; 0 splits nothing) and the decode
matvec of the types with a tensor-core one (ops.X16_MMA_TYPES: 1 that kernel, 0 the int16 dot
products of kernels/matvec_x16.cu), that kernel's warps a block (ops.X16_MMA_WARPS, at most 8), its sm_90
form streaming the rows through shared memory (ops.X16_BULK_TYPES: 1 matvec_x16_bulk, 0 registers), the slots
a split of the split attention aims for (ops.ATTENTION_SPLIT_TARGET; 32: 32 a split, the rule before run 16), and the
short-prompt GEMM of the types with a fragment one (ops.GEMM_FRAG_TYPES: 1 kernels/gemm_frag.cu, 0 gemm.cu)
with its warps a block (ops.GEMM_FRAG_WARPS, at most 8), whether q and k's rope writes k and v to the
cache for the attention after it (1) or kv_store does (0: the held rope released first), and a decode
step's attention grid (ops.DECODE_MIN_SLOTS: its bucket of slots, at least that many; 0: the whole cache's,
the model loaded with --n-ctx), whether a one-token pass's norms are the matvecs' around them (ops.py
_fuse_norm: 1) or launches of their own (0), and whether up to 8 attention splits run as one cluster
(ops.ATTENTION_CLUSTER_SPLITS: 1) or merge through memory (0), and from how many query heads a KV head a long
context's decode step takes a block a KV head's group (ops.ATTENTION_GROUP_MIN; 9: never) in splits of how many
slots (ops.ATTENTION_GROUP_SPLIT_SLOTS). Per variant:
decode tokens/s at each --contexts' context (128: the decode graph captured again) and the 16- and
64-token prompts' passes.

    PYTHONPATH=src python3 tools/probe_launch_shapes.py MODEL [--fused 3,1] [--gemm-blocks 4,2,0] [--decode-mma 1,0] [--mma-warps 8,4] [--decode-bulk 1,0] [--split-slots 32,256]
        [--fused-norms 1,0] [--gemm-frag 1,0] [--frag-warps 16,8] [--rope-store 1,0] [--decode-slots 256,0] [--attention-cluster 1,0]
        [--group-min 4,2,9] [--group-slots 128,64] [--n-ctx 512] [--contexts 128] [--runs 3]

A throwaway measurement tool: it patches the module constants the launches read. The GEMM's
scratch is sized at load for the module's own GEMM_BLOCKS_AN_SM, so a variant may only lower it.
"""
import argparse
import itertools
import statistics
import sys

import reflex_engine
from reflex_engine.backends.cuda import ops
from reflex_engine.bench import decode_weight_bytes, run_bench
from reflex_engine.errors import ReflexError

PROMPTS = (16, 64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--fused", default="3,1")
    ap.add_argument("--gemm-blocks", default=f"{ops.GEMM_BLOCKS_AN_SM},2,0")
    ap.add_argument("--decode-mma", default="1")
    ap.add_argument("--mma-warps", default=str(ops.X16_MMA_WARPS))
    ap.add_argument("--decode-bulk", default="1")
    ap.add_argument("--split-slots", default=str(ops.ATTENTION_SPLIT_TARGET))
    ap.add_argument("--fused-norms", default="1")
    ap.add_argument("--attention-cluster", default="1")
    ap.add_argument("--gemm-frag", default="1")
    ap.add_argument("--frag-warps", default=str(ops.GEMM_FRAG_WARPS))
    ap.add_argument("--rope-store", default="1")
    ap.add_argument("--decode-slots", default=str(ops.DECODE_MIN_SLOTS))
    ap.add_argument("--group-min", default=str(ops.ATTENTION_GROUP_MIN))
    ap.add_argument("--group-slots", default=str(ops.ATTENTION_GROUP_SPLIT_SLOTS))
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--contexts", default="128")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    try:
        contexts = tuple(int(c) for c in args.contexts.split(","))
        grid = [[int(v) for v in a.split(",")] for a in (args.fused, args.gemm_blocks, args.decode_mma, args.mma_warps,
                                                             args.gemm_frag, args.frag_warps, args.rope_store, args.decode_slots,
                                                             args.decode_bulk, args.split_slots, args.fused_norms,
                                                             args.attention_cluster, args.group_min, args.group_slots)]
    except ValueError:
        sys.exit("probe_launch_shapes: every option but --runs and --n-ctx takes comma-separated integers")
    if any(c < 1 or c + 64 > args.n_ctx for c in contexts):
        sys.exit("probe_launch_shapes: a --contexts context is 1 or more, and it and its 64 decoded tokens must fit in --n-ctx")
    if not all(1 <= f <= ops.FUSED_WEIGHTS for f in grid[0]) or not all(0 <= b <= ops.GEMM_BLOCKS_AN_SM for b in grid[1]) \
            or not all(m in (0, 1) for m in grid[2]) or not all(1 <= w <= ops.X16_MMA_WARPS for w in grid[3]) \
            or not all(f in (0, 1) for f in grid[4]) or not all(1 <= w <= ops.GEMM_FRAG_WARPS for w in grid[5]) \
            or not all(r in (0, 1) for r in grid[6]) or not all(s >= 0 for s in grid[7]) \
            or not all(b in (0, 1) for b in grid[8]) or not all(s >= ops.ATTENTION_SPLIT_SLOTS for s in grid[9]) \
            or not all(f in (0, 1) for f in grid[10]) or not all(c in (0, 1) for c in grid[11]) \
            or not all(g >= 1 for g in grid[12]) or not all(s >= ops.ATTENTION_SPLIT_SLOTS for s in grid[13]) \
            or args.runs < 1 or args.n_ctx < 256:
        sys.exit(f"probe_launch_shapes: --fused takes 1 to {ops.FUSED_WEIGHTS}, --gemm-blocks 0 to {ops.GEMM_BLOCKS_AN_SM}, "
                 f"--decode-mma 0 or 1, --mma-warps 1 to {ops.X16_MMA_WARPS}, --gemm-frag 0 or 1, "
                 f"--frag-warps 1 to {ops.GEMM_FRAG_WARPS}, --rope-store 0 or 1, --decode-slots 0 or more, "
                 f"--decode-bulk 0 or 1, --split-slots {ops.ATTENTION_SPLIT_SLOTS} or more, --fused-norms 0 or 1, "
                 f"--attention-cluster 0 or 1, --group-min 1 or more, --group-slots {ops.ATTENTION_SPLIT_SLOTS} or more, "
                 "--n-ctx 256 or more, --runs 1 or more")
    try:
        model = reflex_engine.load(args.model, device="cuda", n_ctx=args.n_ctx)
    except ReflexError as e:
        sys.exit(f"probe_launch_shapes: {e}")
    # the copy timed once the GPU is busy: right after the load it read 3.2-4.2 TB/s between processes (run 17)
    run_bench(model, runs=1, decode_tokens=16, prefill_tokens=(16,), contexts=(128,))
    copy, weight_bytes = model.ops.device.copy_bandwidth(), decode_weight_bytes(model)
    print(f"## {args.model}: median of {args.runs}; the decode bound: {weight_bytes / 1e9:.2f} GB a token "
          f"over the copy's {copy / 1e12:.2f} TB/s\n")
    mma_types, frag_types, bulk_types, cuda_ops = ops.X16_MMA_TYPES, ops.GEMM_FRAG_TYPES, ops.X16_BULK_TYPES, model.ops
    cluster_splits = ops.ATTENTION_CLUSTER_SPLITS

    def rope_alone_then_attention(*args, **kwargs):  # the attention then launches kv_store
        cuda_ops.device.release()
        return type(cuda_ops).attention(cuda_ops, *args, **kwargs)

    print("| weights a launch | GEMM blocks an SM | decode mma | its warps | GEMM frag | its warps | rope stores | decode slots | bulk | split slots | fused norms | cluster | group from | group slots | "
          + " | ".join(f"decode at {c} tok/s" for c in contexts) + " | of the bound | "
          + " | ".join(f"prefill {n} ms" for n in PROMPTS) + " |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
          + "---|" * (len(contexts) + len(PROMPTS)))
    for fused, blocks, mma, warps, frag, frag_warps, rope_store, slots, bulk, split_slots, norms, cluster, group_min, group_slots \
            in itertools.product(*grid):
        ops.DECODE_MIN_SLOTS = slots or 1 << 30  # 0: past any cache's capacity
        if rope_store:
            cuda_ops.__dict__.pop("attention", None)
        else:
            cuda_ops.attention = rope_alone_then_attention
        ops.MAX_FUSED, ops.GEMM_BLOCKS_AN_SM, ops.X16_MMA_TYPES = fused, blocks, mma_types if mma else ()
        ops.X16_MMA_WARPS, ops.GEMM_FRAG_TYPES, ops.GEMM_FRAG_WARPS = warps, frag_types if frag else (), frag_warps
        ops.X16_BULK_TYPES, ops.ATTENTION_SPLIT_TARGET = bulk_types if bulk else (), split_slots
        cuda_ops.fuse_norms = bool(norms)
        ops.ATTENTION_CLUSTER_SPLITS = cluster_splits if cluster else 1
        ops.ATTENTION_GROUP_MIN, ops.ATTENTION_GROUP_SPLIT_SLOTS = group_min, group_slots
        model.ops._plans.clear()  # the matmuls' launches, made again with these constants
        model._forward.close()  # captured again at the next steps, with these launches
        reports = [run_bench(model, runs=2, decode_tokens=64, prefill_tokens=PROMPTS, contexts=contexts)
                   for _ in range(args.runs)]
        rates = [statistics.median(r.decode[c]["tokens_per_s"] for r in reports) for c in contexts]
        rate = rates[0]
        prefill = " | ".join(f"{statistics.median(r.prefill[n] for r in reports):.2f}" for n in PROMPTS)
        print(f"| {fused} | {blocks} | {mma} | {warps} | {frag} | {frag_warps} | {rope_store} | {slots or 'cache'} | {bulk} | {split_slots} | {norms} | {cluster} | {group_min} | {group_slots} | "
              + " | ".join(f"{r:.1f}" for r in rates) + f" | {rate * weight_bytes / copy:.1%} | {prefill} |", flush=True)


if __name__ == "__main__":
    main()
