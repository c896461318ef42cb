# run 40 call 2 (main's kernels, 26ea9a4): the 8B decode step's critical path now, and ncu's full report of the three
# matvec kernels that carry most of it (gate+up bulk, the Q4_K downs' bulk16, the Q6_K downs' int16 1w)
set -u
export END=560 MAIN_SHAPES=8b PROBES=tools/probe_timeline.py \
  NCU_DETAIL="8b:16:q4_k_m:matvec_x16_bulk_q4_K:2 8b:16:q4_k_m:matvec_x16_bulk16_q4_K 8b:16:q4_k_m:matvec_x16_1w_q6_K"
bash tools/gpu_check.sh 2>&1 | tail -150
