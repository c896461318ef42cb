#!/usr/bin/env bash
# One call on the GPU machine: build (or take the carried kernel image), smoke, the GPU tests,
# `reflex check --device cuda` on every golden fixture, SmolLM2 on CUDA, and with BENCH=1 decode
# and prefill timings next to llama.cpp's llama-bench on the same file (BENCH=reflex: ours only,
# no llama.cpp build). Results under $OUT.
# Carried (ignored) paths it uses when present:
#   .whl/                         wheels missing there (gguf, for the fixtures)
#   src/reflex_engine/cuda_image  kernels compiled here (REFLEX_CUDA_ARCH=sm_90), else built there
#   .peers/llama.cpp-*.tar.xz     llama.cpp source (../shared/peers), BENCH=1 only
#   /tmp/smollm2/*.part*          SmolLM2 GGUF pieces left by earlier calls (the file exceeds one call)
set -uo pipefail
OUT=${OUT:-/tmp/reflex-gpu-check}
mkdir -p "$OUT"
ROOT=$PWD
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
reflex() { python3 -m reflex_engine "$@"; }

if [ "${BENCH:-0}" = 1 ] && ls .peers/llama.cpp-*.tar.xz >/dev/null 2>&1; then
    ( mkdir -p /tmp/peer && tar -xJf .peers/llama.cpp-*.tar.xz -C /tmp/peer \
      && cmake -S /tmp/peer/llama.cpp -B /tmp/peer/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
           -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
           -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
           -DGGML_CCACHE=OFF -DLLAMA_BUILD_COMMIT=0c1e57098 \
      && ninja -C /tmp/peer/build -j16 llama-bench ) > "$OUT/llama-build.log" 2>&1 &
    PEER=$!
fi

start=$(date +%s)
if [ -f src/reflex_engine/cuda_image/manifest.json ]; then  # keep the carried image: build only the C helper
    cp -r src/reflex_engine/cuda_image /tmp/carried_image
    REFLEX_CUDA=0 python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || echo "C helper not built (see build.log)"
    rm -rf src/reflex_engine/cuda_image && cp -r /tmp/carried_image src/reflex_engine/cuda_image
else
    REFLEX_CUDA=1 REFLEX_CUDA_COMPILER=nvcc REFLEX_CUDA_ARCH=sm_90 python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 \
        || { echo "BUILD FAILED"; tail -30 "$OUT/build.log"; exit 1; }
fi
echo "build: $(( $(date +%s) - start )) s"

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader; python3 --version; nproc
  python3 -c 'import numpy; print("numpy", numpy.__version__)'; } 2>&1 | tee "$OUT/env.txt"

CUDA_DISABLE_PTX_JIT=1 reflex smoke 2>&1 | tee "$OUT/smoke.txt"

python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_ops.py tests/test_goldens.py tests/test_cuda_cold_path.py --timeout 300 \
    > "$OUT/gpu-tests.log" 2>&1
tail -3 "$OUT/gpu-tests.log"
grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/gpu-tests.log" | head -40

echo "| fixture | worst relative logit error | tolerance | greedy |" | tee "$OUT/check-table.md"
echo "|---|---|---|---|" | tee -a "$OUT/check-table.md"
for model in tests/goldens/*/*.gguf; do
    arch=$(basename "$(dirname "$model")"); qtype=$(basename "$model" .gguf); qtype=${qtype#"$arch"-}
    log=$(reflex check "$model" --reference "tests/goldens/$arch/goldens-$qtype.npz" --device cuda 2>&1)
    worst=$(grep -oE "worst=[^ ]+" <<< "$log" | cut -d= -f2); tol=$(grep -oE "tolerance=[^ ]+" <<< "$log" | cut -d= -f2)
    greedy=$(grep -c "identical" <<< "$log")
    echo "| $arch $qtype | ${worst:-ERROR} | $tol | $greedy/2 identical |" | tee -a "$OUT/check-table.md"
    grep -E "MISMATCH|error" <<< "$log" | head -3
done

if ls /tmp/smollm2/*.part* >/dev/null 2>&1 || ls .smollm2/*.part* >/dev/null 2>&1; then
    mkdir -p /tmp/smollm2 && cp .smollm2/*.part* /tmp/smollm2/ 2>/dev/null
    if [ "$(ls /tmp/smollm2/*.part* | wc -l)" = "${SMOLLM2_PARTS:-4}" ]; then
        cat /tmp/smollm2/*.part* > /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
        sha256sum /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
        m=/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
        reflex generate "$m" "What is the capital of France?" --chat --temp 0 -n 16 --device cuda 2>&1 | tee "$OUT/smollm2.txt"
        reflex system1 "$m" "The capital of France is" --candidate " Paris" --candidate " London" --candidate " Berlin" \
            --device cuda 2>&1 | tee -a "$OUT/smollm2.txt"
        reflex generate "$m" "The capital of France is" --temp 0 -n 64 --ignore-eos --device cuda 2>&1 | tail -1 | tee -a "$OUT/smollm2.txt"
        reflex generate "$m" "The capital of France is" --temp 0 -n 64 --ignore-eos --device cpu 2>&1 | tee -a "$OUT/smollm2.txt"
    else
        echo "SmolLM2: $(ls /tmp/smollm2/*.part* | wc -l) pieces so far"
    fi
fi

if [ "${BENCH:-0}" != 0 ]; then
    tar -xJf .peers/llama.cpp-*.tar.xz llama.cpp/models/ggml-vocab-qwen2.gguf -O > /tmp/peer-vocab.gguf
    python3 tools/make_bench_model.py /tmp/peer-vocab.gguf /tmp/qwen3-0.6b-q4km.gguf 2>&1 | tail -2
    [ -n "${PEER:-}" ] && { wait "$PEER" || tail -20 "$OUT/llama-build.log"; }  # no compile beside the timings
    python3 tools/bench_gpu.py /tmp/qwen3-0.6b-q4km.gguf 2>&1 | tee "$OUT/bench.txt"
    if [ -n "${PEER:-}" ]; then
        /tmp/peer/build/bin/llama-bench -m /tmp/qwen3-0.6b-q4km.gguf -ngl 99 -p 16,1024 -n 64 -r 5 2>&1 | tee -a "$OUT/bench.txt"
    fi
fi
