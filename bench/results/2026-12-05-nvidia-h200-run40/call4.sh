# run 40 call 4: the spread copies held to 104 registers (__maxnreg__, as main's 102 allocate) against main (26ea9a4,
# .variants/base.tar.xz): 8B Q4_K_M `reflex bench` a-b-a-b first, then the GPU tests.
set -u
tar -xJf .peers/llama.cpp-*.tar.xz llama.cpp/models/ggml-vocab-qwen2.gguf -O > /tmp/peer-vocab.gguf
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
cp -r src/reflex_engine/cuda_image /tmp/img; REFLEX_CUDA=0 python3 setup.py -q build_ext --inplace >/dev/null 2>&1; rm -rf src/reflex_engine/cuda_image; cp -r /tmp/img src/reflex_engine/cuda_image
PYTHONPATH=/tmp/site python3 tools/make_bench_model.py /tmp/peer-vocab.gguf /tmp/8b.gguf --shape 8b --quant q4_k_m > /dev/null 2>&1; echo "model at $SECONDS s"
export PYTHONPATH=/tmp/site
timeout 120 bash tools/ab_bench.sh /tmp/8b.gguf 2 -- --runs 3 2>&1 | tee $OUT/ab-8b.txt
echo "tests at $SECONDS s"
END=150 bash tools/gpu_check.sh 2>&1 | tail -4
