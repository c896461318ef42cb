#!/usr/bin/env bash
# An sm_90 kernel image of other kernel sources, for tools/gpu_check.sh's VARIANTS=1 (which runs
# tools/probe_launch_shapes.py with each image under .variants/ in turn, beside the carried one):
#
#   bash tools/build_variant.sh NAME [--rev REV] [--patch FILE] [--python | --clocks] [-- PROBE ARGS...]
#
# builds the kernels of REV (default HEAD) with FILE applied (a `git diff` of the kernels) into
# .variants/NAME, and writes the probe's arguments for that image (default: none) to its probe_args.
# --python: the variant is the whole package (REV's Python with FILE applied, its image inside, ~3.5 MB):
# for changes to the host code too, or to run HEAD's tree beside a working tree that changed both.
# tools/ab_bench.sh runs `reflex bench` on such packages beside the working tree, a-b-a-b.
# --clocks: a timing build (REFLEX_CUDA_CLOCKS=1: its blocks record their marks, kernels/clocks.cuh), the package
# under .clocks/NAME, not .variants/: its kernels write records, so it is no variant to time (tools/probe_clocks.py
# reads it; gpu_check.sh's CLOCKS=1 takes .clocks/clocks).
# Carry .variants (.clocks) with the call (`carry`), and keep them in .git/info/exclude.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] && [[ $1 != -* ]] || { echo "usage: tools/build_variant.sh NAME [--rev REV] [--patch FILE] [--python | --clocks] [-- PROBE ARGS...]" >&2; exit 2; }
name=$1 rev=HEAD patch= python_too= home=.variants
shift
while [ $# -gt 0 ]; do
    case $1 in
        --rev) rev=$2; shift 2 ;;
        --patch) patch=$(realpath "$2"); shift 2 ;;
        --python) python_too=1; shift ;;
        --clocks) python_too=1 home=.clocks; export REFLEX_CUDA_CLOCKS=1; shift ;;
        --) shift; break ;;
        *) echo "build_variant: unknown option $1" >&2; exit 2 ;;
    esac
done
python=${PYTHON:-.venv/bin/python}  # with the package's build requirements
[[ $python = /* ]] || python=$PWD/$python
tree=$(mktemp -d)
trap 'git worktree remove --force "$tree" 2>/dev/null || rm -rf "$tree"' EXIT
git worktree add -q --detach "$tree" "$rev"
[ -z "$patch" ] || git -C "$tree" apply "$patch"
out=$PWD/$home/$name
rm -rf "$out"
image=$out
if [ -n "$python_too" ]; then
    mkdir -p "$out/src"
    cp -r "$tree/src/reflex_engine" "$out/src/"
    rm -rf "$out/src/reflex_engine/cuda_image"
    image=$out/src/reflex_engine/cuda_image
fi
(cd "$tree" && REFLEX_CUDA=1 REFLEX_CUDA_COMPILER=nvcc REFLEX_CUDA_ARCH=sm_90 "$python" build_kernels.py "$image") \
    >/dev/null 2>"$tree.log" || { cat "$tree.log" >&2; rm -f "$tree.log"; exit 1; }
rm -f "$tree.log"
printf '%s\n' "$*" > "$out/probe_args"
echo "$out: $(git rev-parse --short "$rev")${patch:+ + $(basename "$patch")}${python_too:+ (the package)}, probe args: ${*:-(none)}"
