# run 39, call 1 on persistent-lean (c99db42): every GPU test with the chain's; then 8B Q4_K_M `reflex bench`: the tree with
# REFLEX_CUDA_CHAIN=1 twice, and tools/ab_bench.sh a-b-a-b: the tree (lean's bulk Q4_K + Q6_K units, the bulk Q6_K matvec,
# chain off), lean's package (a8598fb), main's (ac5d176's code).
set -u
mkdir -p /tmp/aside && mv .variants/head1w.tar.xz /tmp/aside/ 2>/dev/null
tar -xJf .peers/llama.cpp-*.tar.xz llama.cpp/models/ggml-vocab-qwen2.gguf -O > /tmp/v.gguf
( python3 -m pip install -q --no-index --no-deps --target /tmp/msite .whl/*.whl
  PYTHONPATH=/tmp/msite python3 tools/make_bench_model.py /tmp/v.gguf /tmp/8b.gguf --shape 8b --quant q4_k_m ) > $OUT/models.txt 2>&1 &
GPU_TESTS=tests/test_cuda_chain.py END=250 bash tools/gpu_check.sh 2>&1 | tail -45
if grep -q "FAILED.*chain" $OUT/gpu-tests.log; then for kinds in matvec matvec,swiglu matvec,swiglu,rope matvec,swiglu,attention; do
  echo "kinds $kinds: $(REFLEX_CUDA_CHAIN_KINDS=$kinds PYTHONPATH=$PWD/src:/tmp/site timeout 45 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_chain.py 2>&1 | tail -1)"; done; fi
wait; echo "model at $SECONDS s"; tail -2 $OUT/models.txt
export PYTHONPATH=/tmp/site
for r in $(seq ${CHAIN_ROUNDS:-2}); do
  REFLEX_CUDA_CHAIN=1 PYTHONPATH=$PWD/src:/tmp/site timeout 60 python3 -m reflex_engine bench /tmp/8b.gguf --runs 3 --json > /tmp/c.json 2> /tmp/c.err
  echo "chain r$r (rc $?): $(python3 -c 'import json; d=json.load(open("/tmp/c.json")); print({k: round(v["tokens_per_s"]) for k, v in d["prefill"].items()}, {k: round(v["tokens_per_s"], 1) for k, v in d["decode"].items()})' 2>&1 | tail -1)"
  tail -3 /tmp/c.err
done 2>&1 | tee $OUT/chain-bench.txt
echo "ab from $SECONDS s"
timeout $((${END:-590} - SECONDS)) bash tools/ab_bench.sh /tmp/8b.gguf 2 -- --runs 3 2>&1 | tee $OUT/ab-8b.txt
