#!/usr/bin/env bash
# One call on the GPU machine: environment facts, the offline test suite, host-path benchmarks.
# Usage there (the device tool runs it in the repo root, results under $OUT):
#   bash tools/gpu_check.sh        with .whl (carried wheels: gguf) and .bench (a vocab GGUF)
set -uo pipefail
OUT=${OUT:-/tmp/reflex-gpu-check}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || echo "C helper not built (see build.log)"

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 --version; nproc
  python3 -c 'import numpy; print("numpy", numpy.__version__)'; } 2>&1 | tee "$OUT/env.txt"

# Tests that need no network and no demo model (the tokenizer's references come from PyPI).
python3 -m pytest -q -p no:cacheprovider tests/test_gguf_reader.py tests/test_quants.py tests/test_cpu_ops.py \
    tests/test_cpu_sampler.py tests/test_goldens.py tests/test_chat.py -k "not real_vocabulary" 2>&1 \
    | tee "$OUT/tests.log" | tail -3

for vocab in .bench/*.gguf; do
    [ -e "$vocab" ] && python3 tools/bench_host_path.py "$vocab" --runs 9 2>&1 | tee -a "$OUT/bench.txt"
done
