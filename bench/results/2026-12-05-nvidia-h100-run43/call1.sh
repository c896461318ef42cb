# Run 43 call 1, short form (device time ran low on refused starts): tree = branch handoff-chain with its image;
# .variants/main.tar.xz main's package. The chain's GPU test, `reflex bench` a-b on 8B Q4_K_M, then greedy tokens and
# the chain's block clocks with time left.
set -u
tar -xJf .peers/llama.cpp-*.tar.xz llama.cpp/models/ggml-vocab-qwen2.gguf -O > /tmp/peer-vocab.gguf
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
cp -r src/reflex_engine/cuda_image /tmp/img; REFLEX_CUDA=0 python3 setup.py -q build_ext --inplace >/dev/null 2>&1; rm -rf src/reflex_engine/cuda_image; cp -r /tmp/img src/reflex_engine/cuda_image
(PYTHONPATH=/tmp/site python3 tools/make_bench_model.py /tmp/peer-vocab.gguf /tmp/qwen3-8b-q4_k_m.gguf --shape 8b --quant q4_k_m > /dev/null 2>&1; echo "model at $SECONDS s") &
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee $OUT/variants.txt
PYTHONPATH=/tmp/site timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_ops.py -k "handoffs or bulk_matvec" 2>&1 | tail -6 | tee -a $OUT/variants.txt
wait
mkdir -p /tmp/main && tar -xJf .variants/main.tar.xz -C /tmp/main && cp src/reflex_engine/_native*.so /tmp/main/main/src/reflex_engine/
echo "## 8B Q4_K_M at $SECONDS s" | tee $OUT/ab.txt
PYTHONPATH=/tmp/site timeout 150 bash tools/ab_bench.sh /tmp/qwen3-8b-q4_k_m.gguf 2 -- --runs 3 2>&1 | tee -a $OUT/ab.txt
echo "## greedy tokens: tree (chain), main at $SECONDS s" | tee -a $OUT/variants.txt
for p in "$PWD/src" /tmp/main/main/src; do
    PYTHONPATH=$p:/tmp/site timeout 40 python3 -m reflex_engine generate /tmp/qwen3-8b-q4_k_m.gguf "The capital of France is" -n 24 --temp 0 2>&1 | tail -2
done | tee -a $OUT/variants.txt
c=clocks-chain
tar -xJf .clocks/$c.tar.xz -C .clocks && cp src/reflex_engine/_native*.so .clocks/$c/src/reflex_engine/ 2>/dev/null
PYTHONPATH=$PWD/.clocks/$c/src:/tmp/site timeout 100 python3 tools/probe_clocks.py /tmp/qwen3-8b-q4_k_m.gguf --save $OUT/$c > $OUT/$c.txt 2>&1
echo "done at $SECONDS s"; ls $OUT
