# run 39, call 3 on persistent-lean (c99db42): where a chained 8B decode step's time goes (tools/probe_chain_step.py),
# and the matvec-only chain against today's graph of the same matvecs (tools/probe_decode_chain.py).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=$PWD/src:/tmp/site
cp -r src/reflex_engine/cuda_image /tmp/img; REFLEX_CUDA=0 python3 setup.py -q build_ext --inplace >/dev/null 2>&1; rm -rf src/reflex_engine/cuda_image; cp -r /tmp/img src/reflex_engine/cuda_image
tar -xJf .peers/llama.cpp-*.tar.xz llama.cpp/models/ggml-vocab-qwen2.gguf -O > /tmp/v.gguf
python3 tools/make_bench_model.py /tmp/v.gguf /tmp/8b.gguf --shape 8b --quant q4_k_m > /dev/null 2>&1; echo "model at $SECONDS s"
timeout 60 python3 tools/probe_chain_step.py /tmp/8b.gguf > $OUT/chain-step.txt 2>&1; tail -40 $OUT/chain-step.txt; echo "step probe at $SECONDS s"
timeout $((165 - SECONDS)) python3 tools/probe_decode_chain.py --layers 36 --splits 1 --runs 10 --mixes q4_k_m > $OUT/chain-probe.txt 2>&1; grep -v "^  down in" $OUT/chain-probe.txt | tail -45
