# Run 43 call 1: handoffs (a count of blocks done polled instead of griddepcontrol.wait). Tree: branch handoff-chain
# (8ab9f07: every bulk matvec, SwiGLU and the attention's clusters along a decode layer) with its own image.
# .variants: main.tar.xz (main's package, 4064dcf). (handoff.tar.xz, branch handoff afb3cd1, the attention -> o and
# SwiGLU -> down pairs only). .clocks: timing builds of main and the chain. 1. the tree's GPU tests (handoffs, bulk,
# attention, norm, rope, matvec, graph, swiglu); 2. greedy tokens of the three on the 8B file; 3. `reflex bench`
# a-b-a-b, 8B Q4_K_M 2 rounds; 4. the block clocks of the chain and main on the 8B step (0.6B has no handoff).
# carry: [".whl", "src/reflex_engine/cuda_image", ".peers", ".variants", ".clocks"]; command: bash .variants/call1.sh
set -u
tar -xJf .peers/llama.cpp-*.tar.xz llama.cpp/models/ggml-vocab-qwen2.gguf -O > /tmp/peer-vocab.gguf
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
cp -r src/reflex_engine/cuda_image /tmp/img; REFLEX_CUDA=0 python3 setup.py -q build_ext --inplace >/dev/null 2>&1; rm -rf src/reflex_engine/cuda_image; cp -r /tmp/img src/reflex_engine/cuda_image
(for s in 8b 0.6b; do PYTHONPATH=/tmp/site python3 tools/make_bench_model.py /tmp/peer-vocab.gguf /tmp/qwen3-$s-q4_k_m.gguf --shape $s --quant q4_k_m > /dev/null 2>&1; done; echo "models at $SECONDS s") &
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee $OUT/variants.txt
echo "## the tree's GPU tests" | tee -a $OUT/variants.txt
PYTHONPATH=/tmp/site timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_ops.py tests/test_cuda_graphs.py -k "handoffs or bulk_matvec or graph" 2>&1 | tail -8 | tee -a $OUT/variants.txt
wait
for v in main; do mkdir -p /tmp/$v && tar -xJf .variants/$v.tar.xz -C /tmp/$v && cp src/reflex_engine/_native*.so /tmp/$v/$v/src/reflex_engine/; done
echo "## greedy tokens: tree (chain), main" | tee -a $OUT/variants.txt
for p in "$PWD/src" /tmp/main/main/src; do
    PYTHONPATH=$p:/tmp/site timeout 60 python3 -m reflex_engine generate /tmp/qwen3-8b-q4_k_m.gguf "The capital of France is" -n 24 --temp 0 2>&1 | tail -2
done | tee -a $OUT/variants.txt
echo "ab at $SECONDS s"
echo "## 8B Q4_K_M" | tee $OUT/ab.txt
PYTHONPATH=/tmp/site timeout 200 bash tools/ab_bench.sh /tmp/qwen3-8b-q4_k_m.gguf 2 -- --runs 3 2>&1 | tee -a $OUT/ab.txt
echo "clocks at $SECONDS s"
for c in clocks-chain clocks-main; do
    tar -xJf .clocks/$c.tar.xz -C .clocks && cp src/reflex_engine/_native*.so .clocks/$c/src/reflex_engine/ 2>/dev/null
    [ $SECONDS -lt 480 ] && PYTHONPATH=$PWD/.clocks/$c/src:/tmp/site timeout $(( 540 - SECONDS )) python3 tools/probe_clocks.py /tmp/qwen3-8b-q4_k_m.gguf --save $OUT/$c > $OUT/$c.txt 2>&1
    tail -3 $OUT/$c.txt
done
echo "done at $SECONDS s"; ls $OUT
