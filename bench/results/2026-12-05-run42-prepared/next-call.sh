# Prepared in runs 41 and 42 (no device either session). Tree: main with its own image (src/reflex_engine/cuda_image).
# .variants/*.tar.xz, packages (tools/build_variant.sh NAME --python): spread (branch spread at ce63b23: the bulk Q4_K
# stage copies over every warp, held to 104 registers), o16 (main + o16.patch: o on the 16-warp bulk matvec), head
# (branch stream-head at be2b60d: a one-token launch past two waves as a wave of blocks walking its rows: the output
# head, its final norm fused, and 8B Q8_0's gate and up), pair (branch swiglu-pair at b972af3: SwiGLU made by gate and
# up's launch, its blocks in clusters of two, up's sums handed over in distributed shared memory), trips (branch trips
# at c84f6f9: the one-token matvecs' trips to L2 after the wait asked into L1: x's slices, the norm's sums, the
# stores' reads), combo (branch combo at ccdd225: trips + stream-head + swiglu-pair), tspread (branch trips-spread at
# 88a32ae: trips + spread's kernel).
# .clocks/clocks.tar.xz: main's timing build (tools/build_variant.sh clocks --clocks).
# 1. combo's GPU tests on its package (head's and pair's own only if combo's fail); 2. CUPTI's timeline and the blocks'
# clocks (tools/probe_clocks.py, first run) on the 8B decode step (main's own GPU tests left out: its kernels are run
# 40's to the byte); 3. greedy tokens; 4. `reflex bench` a-b-a-b on 8B Q4_K_M (2 rounds) and 0.6B (1 round), main
# against the seven; 5. with time left, 8B Q8_0 a-b.
# Back from $OUT (8 files at most): variants.txt, ab.txt, gpu-check.txt, log.txt, gpu-tests.log, clocks-8b-128.npz.
# carry: [".whl", "src/reflex_engine/cuda_image", ".peers", ".variants", ".clocks"]; command: bash .variants/next-call.sh
set -u
tar -xJf .peers/llama.cpp-*.tar.xz llama.cpp/models/ggml-vocab-qwen2.gguf -O > /tmp/peer-vocab.gguf
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
cp -r src/reflex_engine/cuda_image /tmp/img; REFLEX_CUDA=0 python3 setup.py -q build_ext --inplace >/dev/null 2>&1; rm -rf src/reflex_engine/cuda_image; cp -r /tmp/img src/reflex_engine/cuda_image
tests() {  # NAME "-k expression": a branch's GPU tests on its own package
    name=$1
    mkdir -p /tmp/$name && tar -xJf .variants/$name.tar.xz -C /tmp/$name && cp src/reflex_engine/_native*.so /tmp/$name/$name/src/reflex_engine/
    cp .variants/${name}_test_cuda_ops.py tests/test_${name}_variant.py
    echo "## $name's tests" | tee -a $OUT/variants.txt
    PYTHONPATH=/tmp/$name/$name/src:/tmp/site timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_${name}_variant.py -k "$2" 2>&1 | tail -5 | tee -a $OUT/variants.txt
    local rc=${PIPESTATUS[0]}
    rm tests/test_${name}_variant.py
    return $rc
}
if ! tests combo "matvec or norm or wave or swiglu or rope"; then
    tests head "many_waves or bulk_matvec or norm_between"; tests pair "swiglu or bulk_matvec or norm_between"
fi
for name in trips tspread; do mkdir -p /tmp/$name && tar -xJf .variants/$name.tar.xz -C /tmp/$name && cp src/reflex_engine/_native*.so /tmp/$name/$name/src/reflex_engine/; done
for s in 8b 0.6b; do PYTHONPATH=/tmp/site python3 tools/make_bench_model.py /tmp/peer-vocab.gguf /tmp/qwen3-$s-q4_k_m.gguf --shape $s --quant q4_k_m > /dev/null 2>&1; done; echo "models at $SECONDS s"
echo "gpu_check at $SECONDS s"  # main's GPU tests left out: its kernels are run 40's to the byte (the timing marks empty)
END=200 GPU_TESTS="-k nothing_here" CLOCKS=1 PROBES=tools/probe_timeline.py MAIN_SHAPES=8b bash tools/gpu_check.sh > $OUT/gpu-check.txt 2>&1
tail -5 $OUT/gpu-check.txt
for p in "$PWD/src" /tmp/trips/trips/src /tmp/tspread/tspread/src /tmp/combo/combo/src; do  # greedy tokens: main, trips and tspread (main's bits: the same), combo (head's fused final norm may move near-ties)
    PYTHONPATH=$p:/tmp/site timeout 60 python3 -m reflex_engine generate /tmp/qwen3-8b-q4_k_m.gguf "The capital of France is" -n 24 --temp 0 2>&1 | tail -2
done | tee -a $OUT/variants.txt
echo "## 8B Q4_K_M" | tee $OUT/ab.txt
PYTHONPATH=/tmp/site timeout 260 bash tools/ab_bench.sh /tmp/qwen3-8b-q4_k_m.gguf 2 -- --runs 3 2>&1 | tee -a $OUT/ab.txt
echo "## 0.6B Q4_K_M" | tee -a $OUT/ab.txt
PYTHONPATH=/tmp/site timeout 80 bash tools/ab_bench.sh /tmp/qwen3-0.6b-q4_k_m.gguf 1 -- --runs 3 2>&1 | tee -a $OUT/ab.txt
if [ $SECONDS -lt 420 ]; then
    timeout $(( 500 - SECONDS )) env PYTHONPATH=/tmp/site python3 tools/make_bench_model.py /tmp/peer-vocab.gguf /tmp/qwen3-8b-q8_0.gguf --shape 8b --quant q8_0 > /dev/null 2>&1
    echo "## 8B Q8_0" | tee -a $OUT/ab.txt
    [ -f /tmp/qwen3-8b-q8_0.gguf ] && PYTHONPATH=/tmp/site timeout $(( 575 - SECONDS )) bash tools/ab_bench.sh /tmp/qwen3-8b-q8_0.gguf 1 -- --runs 3 2>&1 | tee -a $OUT/ab.txt
fi
echo "done at $SECONDS s"; ls $OUT
