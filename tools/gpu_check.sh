#!/usr/bin/env bash
# One call on the GPU machine: build (or take the carried kernel image), smoke, the GPU tests,
# `reflex check --device cuda` on every golden fixture, SmolLM2 on CUDA; with BENCH=1 decode
# and prefill timings next to llama.cpp's llama-bench on the same file (BENCH=reflex: ours only,
# no llama.cpp build); with COLD=1 the cold-start harness (bench/cold_start.py) on Qwen3-0.6B-
# and 8B-shaped files beside the floor and llama.cpp, ending inside the call's 600 s.
# Results under $OUT (at most 8 files come back: logs go to log.txt).
# Carried (ignored) paths it uses when present:
#   .whl/                         wheels missing there (gguf, for the fixtures)
#   src/reflex_engine/cuda_image  kernels compiled here (REFLEX_CUDA_ARCH=sm_90), else built there
#   .peers/llama.cpp-*.tar.xz     llama.cpp source (../shared/peers), BENCH=1 and COLD=1
#   /tmp/smollm2/*.part*          SmolLM2 GGUF pieces left by earlier calls (the file exceeds one call)
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-/tmp/reflex-gpu-check}
mkdir -p "$OUT"
LOG=$OUT/log.txt
ROOT=$PWD
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
reflex() { python3 -m reflex_engine "$@"; }

if [ "${BENCH:-0}" = 1 ] || [ "${COLD:-0}" = 1 ] && ls .peers/llama.cpp-*.tar.xz >/dev/null 2>&1; then
    ( mkdir -p /tmp/peer && tar -xJf .peers/llama.cpp-*.tar.xz -C /tmp/peer \
      && cmake -S /tmp/peer/llama.cpp -B /tmp/peer/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
           -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
           -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
           -DGGML_CCACHE=OFF -DLLAMA_BUILD_COMMIT=0c1e57098 \
      && ninja -C /tmp/peer/build -j16 llama-bench llama-simple llama-completion ) > /tmp/llama-build.log 2>&1 &
    PEER=$!
fi

start=$(date +%s)
if [ -f src/reflex_engine/cuda_image/manifest.json ]; then  # keep the carried image: build only the C helper
    cp -r src/reflex_engine/cuda_image /tmp/carried_image
    REFLEX_CUDA=0 python3 setup.py -q build_ext --inplace > /tmp/build.log 2>&1 || echo "C helper not built (see build.log)"
    rm -rf src/reflex_engine/cuda_image && cp -r /tmp/carried_image src/reflex_engine/cuda_image
else
    REFLEX_CUDA=1 REFLEX_CUDA_COMPILER=nvcc REFLEX_CUDA_ARCH=sm_90 python3 setup.py -q build_ext --inplace > /tmp/build.log 2>&1 \
        || { echo "BUILD FAILED"; tail -30 /tmp/build.log; exit 1; }
fi
echo "build: $(( $(date +%s) - start )) s"

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader; python3 --version; nproc
  python3 -c 'import numpy; print("numpy", numpy.__version__)'; } 2>&1 | tee -a "$LOG"

CUDA_DISABLE_PTX_JIT=1 reflex smoke 2>&1 | tee -a "$LOG"

python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_ops.py tests/test_goldens.py tests/test_cuda_cold_path.py ${GPU_TESTS:-} --timeout 300 \
    > "$OUT/gpu-tests.log" 2>&1
tail -3 "$OUT/gpu-tests.log"
grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/gpu-tests.log" | head -40

echo "| fixture | worst relative logit error | tolerance | greedy |" | tee "$LOG"
echo "|---|---|---|---|" | tee -a "$LOG"
for model in tests/goldens/*/*.gguf; do
    arch=$(basename "$(dirname "$model")"); qtype=$(basename "$model" .gguf); qtype=${qtype#"$arch"-}
    log=$(reflex check "$model" --reference "tests/goldens/$arch/goldens-$qtype.npz" --device cuda 2>&1)
    worst=$(grep -oE "worst=[^ ]+" <<< "$log" | cut -d= -f2); tol=$(grep -oE "tolerance=[^ ]+" <<< "$log" | cut -d= -f2)
    greedy=$(grep -c "identical" <<< "$log")
    echo "| $arch $qtype | ${worst:-ERROR} | $tol | $greedy/2 identical |" | tee -a "$LOG"
    grep -E "MISMATCH|error" <<< "$log" | head -3
done

if ls /tmp/smollm2/*.part* >/dev/null 2>&1 || ls .smollm2/*.part* >/dev/null 2>&1; then
    mkdir -p /tmp/smollm2 && cp .smollm2/*.part* /tmp/smollm2/ 2>/dev/null
    if [ "$(ls /tmp/smollm2/*.part* | wc -l)" = "${SMOLLM2_PARTS:-4}" ]; then
        cat /tmp/smollm2/*.part* > /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
        sha256sum /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
        m=/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
        reflex generate "$m" "What is the capital of France?" --chat --temp 0 -n 16 --device cuda 2>&1 | tee -a "$LOG"
        reflex system1 "$m" "The capital of France is" --candidate " Paris" --candidate " London" --candidate " Berlin" \
            --device cuda 2>&1 | tee -a "$LOG"
        reflex generate "$m" "The capital of France is" --temp 0 -n 64 --ignore-eos --device cuda 2>&1 | tail -1 | tee -a "$LOG"
        reflex generate "$m" "The capital of France is" --temp 0 -n 64 --ignore-eos --device cpu 2>&1 | tee -a "$LOG"
    else
        echo "SmolLM2: $(ls /tmp/smollm2/*.part* | wc -l) pieces so far"
    fi
fi

if [ "${BENCH:-0}" != 0 ]; then
    tar -xJf .peers/llama.cpp-*.tar.xz llama.cpp/models/ggml-vocab-qwen2.gguf -O > /tmp/peer-vocab.gguf
    python3 tools/make_bench_model.py /tmp/peer-vocab.gguf /tmp/qwen3-0.6b-q4km.gguf 2>&1 | tail -2
    [ -n "${PEER:-}" ] && { wait "$PEER" || tail -20 /tmp/llama-build.log; }  # no compile beside the timings
    python3 tools/bench_gpu.py /tmp/qwen3-0.6b-q4km.gguf 2>&1 | tee -a "$LOG"
    if [ -n "${PEER:-}" ]; then
        /tmp/peer/build/bin/llama-bench -m /tmp/qwen3-0.6b-q4km.gguf -ngl 99 -p 16,1024 -n 64 -r 5 2>&1 | tee -a "$LOG"
    fi
fi

if [ "${COLD:-0}" = 1 ]; then
    tar -xJf .peers/llama.cpp-*.tar.xz llama.cpp/models/ggml-vocab-qwen2.gguf -O > /tmp/peer-vocab.gguf
    for shape in 0.6b 8b; do
        [ -f /tmp/qwen3-$shape-q4km.gguf ] || python3 tools/make_bench_model.py /tmp/peer-vocab.gguf /tmp/qwen3-$shape-q4km.gguf --shape $shape 2>&1 | tail -1
    done
    mkdir -p /tmp/floor && gcc -O2 -o /tmp/floor/floor bench/floor.c -ldl && nvcc -cubin -arch=sm_90 -o /tmp/floor/floor.cubin bench/floor_kernel.cu
    python3 -m venv --without-pip /tmp/cold-venv  # a clean interpreter, as a user's venv: no site-packages .pth hooks
    [ -n "${PEER:-}" ] && { wait "$PEER" || tail -20 /tmp/llama-build.log; }  # nothing compiles beside the timings
    echo "harness starts at $(( $(date +%s) - T0 )) s"
    python3 bench/cold_start.py --model 0.6b=/tmp/qwen3-0.6b-q4km.gguf --model 8b=/tmp/qwen3-8b-q4km.gguf \
        --llama-bin /tmp/peer/build/bin --floor-bin /tmp/floor --python /tmp/cold-venv/bin/python --n "${COLD_N:-10}" \
        --deadline-s $(( ${COLD_END:-575} - ($(date +%s) - T0) )) --out "$OUT/cold" 2>&1 | tail -60
fi
