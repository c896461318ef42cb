# Run 42 call 2 (H100): trips split into its parts after call 1 (trips -5.4% on 0.6B, neutral on 8B): tbulk (branch
# trips-bulk: trips without the int16 kernels' L1 asks) and tscale (branch trips-scale: only the storing warp's scale and
# the attention's slot read before its wait), their GPU tests, a-b-a-b against main (8B 3 rounds, 0.6B 2), and the
# timing build of tbulk on the 8B step (main's from call 1 to compare).
set -u
tar -xJf .peers/llama.cpp-*.tar.xz llama.cpp/models/ggml-vocab-qwen2.gguf -O > /tmp/peer-vocab.gguf
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
cp -r src/reflex_engine/cuda_image /tmp/img; REFLEX_CUDA=0 python3 setup.py -q build_ext --inplace >/dev/null 2>&1; rm -rf src/reflex_engine/cuda_image; cp -r /tmp/img src/reflex_engine/cuda_image
for s in 8b 0.6b; do PYTHONPATH=/tmp/site python3 tools/make_bench_model.py /tmp/peer-vocab.gguf /tmp/qwen3-$s-q4_k_m.gguf --shape $s --quant q4_k_m > /dev/null 2>&1 & done
for name in tbulk tscale; do
    mkdir -p /tmp/$name && tar -xJf .variants/$name.tar.xz -C /tmp/$name && cp src/reflex_engine/_native*.so /tmp/$name/$name/src/reflex_engine/
    echo "## $name's tests" | tee -a $OUT/variants.txt
    PYTHONPATH=/tmp/$name/$name/src:/tmp/site timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_ops.py tests/test_cuda_graphs.py -k "bulk or norm or attention or rope or matvec or graph" 2>&1 | tail -4 | tee -a $OUT/variants.txt
done
wait; echo "models at $SECONDS s"
echo "## 8B Q4_K_M" | tee $OUT/ab.txt
PYTHONPATH=/tmp/site timeout 240 bash tools/ab_bench.sh /tmp/qwen3-8b-q4_k_m.gguf 3 -- --runs 3 2>&1 | tee -a $OUT/ab.txt
echo "## 0.6B Q4_K_M" | tee -a $OUT/ab.txt
PYTHONPATH=/tmp/site timeout 100 bash tools/ab_bench.sh /tmp/qwen3-0.6b-q4_k_m.gguf 2 -- --runs 3 2>&1 | tee -a $OUT/ab.txt
echo "clocks at $SECONDS s"
for c in clocks-tbulk clocks; do  # tbulk's timing build, then main's (the same card: call 1 ran on another)
    tar -xJf .clocks/$c.tar.xz -C .clocks && cp src/reflex_engine/_native*.so .clocks/$c/src/reflex_engine/ 2>/dev/null
    [ $SECONDS -lt 540 ] && PYTHONPATH=$PWD/.clocks/$c/src:/tmp/site timeout $(( 595 - SECONDS )) python3 tools/probe_clocks.py /tmp/qwen3-8b-q4_k_m.gguf --save $OUT/$c > $OUT/$c.txt 2>&1
    tail -2 $OUT/$c.txt
done
echo "done at $SECONDS s"; ls $OUT
