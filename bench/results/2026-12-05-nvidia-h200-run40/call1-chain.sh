# on persistent-lean: where a chained 8B decode step's time goes, and the chain's knobs
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=$PWD/src:/tmp/site
cp -r src/reflex_engine/cuda_image /tmp/img; REFLEX_CUDA=0 python3 setup.py -q build_ext --inplace >/dev/null 2>&1; rm -rf src/reflex_engine/cuda_image; cp -r /tmp/img src/reflex_engine/cuda_image
tar -xJf .peers/llama.cpp-*.tar.xz llama.cpp/models/ggml-vocab-qwen2.gguf -O > /tmp/v.gguf
python3 tools/make_bench_model.py /tmp/v.gguf /tmp/8b.gguf --shape 8b --quant q4_k_m > /dev/null 2>&1; echo "model at $SECONDS s"
timeout 60 python3 tools/probe_chain_step.py /tmp/8b.gguf > $OUT/chain-step.txt 2>&1; tail -40 $OUT/chain-step.txt; echo "step probe at $SECONDS s"
for c in "0 1 8" "1 1 8" "1 2 8" "1 3 8" "1 6 8" "1 3 16"; do set -- $c
  echo "chain=$1 splits=$2 attn=$3: $(REFLEX_CUDA_CHAIN=$1 REFLEX_CUDA_CHAIN_SPLITS=$2 REFLEX_CUDA_CHAIN_ATTENTION_SPLITS=$3 timeout 60 python3 -m reflex_engine bench /tmp/8b.gguf --runs 3 --json 2>/dev/null | python3 -c 'import json,sys; d=json.load(sys.stdin); print({k: round(v["tokens_per_s"],1) for k,v in d["decode"].items()})' 2>&1 | tail -1)"
done | tee $OUT/chain-knobs.txt
timeout $((560 - SECONDS)) python3 tools/probe_decode_chain.py --layers 36 --splits 1 2 3 --runs 10 > $OUT/chain-probe.txt 2>&1; grep -v "^  down in" $OUT/chain-probe.txt | tail -60
