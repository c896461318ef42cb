# run 40 call 3: the bulk Q4_K matvecs' stage copies spread over the warps (working tree, d9ddc95's kernels) against
# main (26ea9a4, .variants/base.tar.xz), the same with a stage's next copies issued before its multiplies
# (early.tar.xz), and persistent-lean's bulk Q6_K matvec with its copies spread too (plq6.tar.xz): the GPU tests (the
# tree), each variant's greedy tokens against the tree's, `reflex bench` a-b-a-b on 8B Q4_K_M (2 rounds), ncu on 8B's
# gate + up, the 8B decode timeline, then 0.6B Q4_K_M a-b (1 round), the most wanted first.
set -u
tar -xJf .peers/llama.cpp-*.tar.xz llama.cpp/models/ggml-vocab-qwen2.gguf -O > /tmp/peer-vocab.gguf
( python3 -m pip install -q --no-index --no-deps --target /tmp/msite .whl/*.whl
  for s in 8b 0.6b; do PYTHONPATH=/tmp/msite python3 tools/make_bench_model.py /tmp/peer-vocab.gguf /tmp/qwen3-$s-q4_k_m.gguf --shape $s --quant q4_k_m; done ) > $OUT/models.txt 2>&1 &
END=200 bash tools/gpu_check.sh 2>&1 | tail -8
wait; echo "models at $SECONDS s"
export PYTHONPATH=/tmp/site
same() { PYTHONPATH=$1:/tmp/site timeout 60 python3 -m reflex_engine generate /tmp/qwen3-8b-q4_k_m.gguf "The capital of France is" -n 24 --temp 0 2>/dev/null | grep -v "^REFLEX_"; }
want=$(same $PWD/src)
for t in .variants/*.tar.xz; do
  n=$(basename $t .tar.xz); tar -xJf $t -C /tmp; cp src/reflex_engine/_native*.so /tmp/$n/src/reflex_engine/
  got=$(same /tmp/$n/src); if [ -z "$got" ]; then echo "$n: failed: dropped"; rm $t; elif [ "$got" = "$want" ]; then echo "$n: the tree's tokens"; else echo "$n: DIFFERENT tokens"; fi
done | tee $OUT/variants-tokens.txt
echo "ab at $SECONDS s"
timeout $((500 - SECONDS)) bash tools/ab_bench.sh /tmp/qwen3-8b-q4_k_m.gguf 2 -- --runs 3 2>&1 | tee $OUT/ab-8b.txt
echo "ncu at $SECONDS s"
export PYTHONPATH=$PWD/src:/tmp/site
ncu --set full --clock-control none --kernel-name matvec_x16_bulk_q4_K --launch-skip 2 --launch-count 1 --page details \
    --export /tmp/ncu-detail --force-overwrite python3 tools/profile_kernels.py /tmp/qwen3-8b-q4_k_m.gguf --prompt-tokens 16 --decode 1 --once > $OUT/ncu-detail.txt 2>&1
ncu --import /tmp/ncu-detail.ncu-rep --page source --csv --print-source sass 2>&1 | gzip > $OUT/ncu-source-matvec_x16_bulk_q4_K.csv.gz
python3 tools/ncu_stalls.py $OUT/ncu-source-matvec_x16_bulk_q4_K.csv.gz | head -12
echo "timeline at $SECONDS s"
timeout $((560 - SECONDS)) python3 tools/probe_timeline.py /tmp/qwen3-8b-q4_k_m.gguf > $OUT/timeline-8b.txt 2>&1; grep -A22 "^## " $OUT/timeline-8b.txt
export PYTHONPATH=/tmp/site
timeout $((590 - SECONDS)) bash tools/ab_bench.sh /tmp/qwen3-0.6b-q4_k_m.gguf 1 -- --runs 3 2>&1 | tee $OUT/ab-0.6b.txt
echo "done at $SECONDS s"
