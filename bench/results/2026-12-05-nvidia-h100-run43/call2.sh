# Run 43 call 2 (warm, right after call 1): the chain's GPU tests with the package on the path; a-b of chain, main, handoff.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
ls src/reflex_engine/_native*.so >/dev/null 2>&1 || { cp -r src/reflex_engine/cuda_image /tmp/img; REFLEX_CUDA=0 python3 setup.py -q build_ext --inplace >/dev/null 2>&1; rm -rf src/reflex_engine/cuda_image; cp -r /tmp/img src/reflex_engine/cuda_image; }
[ -f /tmp/qwen3-8b-q4_k_m.gguf ] || { tar -xJf .peers/llama.cpp-*.tar.xz llama.cpp/models/ggml-vocab-qwen2.gguf -O > /tmp/peer-vocab.gguf; PYTHONPATH=/tmp/site python3 tools/make_bench_model.py /tmp/peer-vocab.gguf /tmp/qwen3-8b-q4_k_m.gguf --shape 8b --quant q4_k_m > /dev/null 2>&1; }
PYTHONPATH=$PWD/src:/tmp/site timeout 80 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_ops.py -k "handoffs or bulk_matvec" 2>&1 | tail -6 | tee $OUT/tests.txt
echo "## 8B Q4_K_M at $SECONDS s" | tee $OUT/ab.txt
PYTHONPATH=/tmp/site timeout 120 bash tools/ab_bench.sh /tmp/qwen3-8b-q4_k_m.gguf 2 -- --runs 3 2>&1 | tee -a $OUT/ab.txt
echo "done at $SECONDS s"
