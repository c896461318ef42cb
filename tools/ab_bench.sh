#!/usr/bin/env bash
# `reflex bench --json` on one model file, a-b-a-b: the working tree's package, then each variant package under
# .variants/ (tools/build_variant.sh NAME --python; a .variants/NAME.tar.xz of one, `tar -cJf .variants/NAME.tar.xz -C
# .variants NAME`, is unpacked first: the tree and two or three packages fit the 64 MiB a device call carries only
# packed), ROUNDS rounds, a process a run; one line a run: NAME rROUND: {prompt tokens: tok/s} {context: decode tok/s}.
#
#   bash tools/ab_bench.sh MODEL [ROUNDS] [-- BENCH ARGS...]
#
# On the GPU machine after the C helper is built (tools/gpu_check.sh's first steps), gguf on PYTHONPATH. Each package
# goes first on PYTHONPATH, so it is the one imported whatever else is there.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: tools/ab_bench.sh MODEL [ROUNDS] [-- BENCH ARGS...]" >&2; exit 2; }
model=$1 rounds=${2:-2}
shift $(( $# >= 2 ? 2 : 1 )); [ "${1:-}" = -- ] && shift
unpacked=$(mktemp -d)
for t in .variants/*.tar.xz; do [ -e "$t" ] && tar -xJf "$t" -C "$unpacked"; done
packages=$(ls -d .variants/*/src "$unpacked"/*/src 2>/dev/null)
summary() {
    python3 -c 'import json, sys
d = json.load(sys.stdin)
print({k: round(v["tokens_per_s"]) for k, v in d["prefill"].items()}, {k: round(v["tokens_per_s"], 1) for k, v in d["decode"].items()})'
}
for round in $(seq "$rounds"); do
    echo "tree r$round: $(PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} python3 -m reflex_engine bench "$model" --json "$@" 2>/dev/null | summary)"
    for src in $packages; do
        cp src/reflex_engine/_native*.so "$src/reflex_engine/" 2>/dev/null  # the helper built here, for this interpreter
        echo "$(basename "$(dirname "$src")") r$round: $(PYTHONPATH=$src${PYTHONPATH:+:$PYTHONPATH} python3 -m reflex_engine bench "$model" --json "$@" 2>/dev/null | summary)"
    done
done
rm -rf "$unpacked"
