#!/usr/bin/env bash
# One call on the GPU machine, in stages, each switched by a variable, ending inside the call's
# limit (END seconds, default 575):
#   always      build the C helper (keeping a carried kernel image, else nvcc builds sm_90), smoke,
#               the GPU tests (GPU_TESTS adds files); CHECK=1 adds `reflex check --device cuda` on
#               every golden fixture
#   BENCH=1     random Qwen3-0.6B- and 8B-shaped files (QUANTS: q4_k_m q8_0), `reflex bench` on each
#               and llama.cpp's llama-bench on the same files, after llama.cpp is built: bench/warm.py's tables
#               ($OUT/warm/table.md, both engines' figures in raw.json)
#   COLD=1      the cold-start harness (bench/cold_start.py) beside the floor and llama.cpp, with the
#               structured-extraction rows on 0.6B (--json-schema, llama.cpp with its JSON-schema grammar)
#   WITH_LLAMA=0  BENCH and COLD without llama.cpp, so without its build; COLD_LLAMA=0 COLD alone without it
#   MAIN_SHAPES   the Qwen3 shapes BENCH and COLD take (default "0.6b 8b"; COLD's structured rows need 0.6b);
#   COLD_PROMPTS  their prompt lengths in COLD (default 16,1024); COLD_STRUCTURED=0 leaves out the structured rows
#   MOE=1       BENCH and COLD also on MoE-shaped files, MOE_SHAPES (default: 30b-a3b dsv2-lite, that is
#               Qwen3-30B-A3B and DeepSeek-V2-Lite, Q4_K_M only; COLD: 16-token prompt, one table of their own,
#               unless MOE_COLD=0)
#   HYBRID=1    BENCH and COLD also on a Qwen3.5-0.8B-shaped file (qwen35: Gated DeltaNet + gated attention;
#               BENCH in QUANTS; COLD: 16- and 1,024-token prompts, its own table)
#   PROFILE=1   tools/profile_kernels.py on each shape's Q4_K_M file: GPU time per kernel of a PROFILE_TOKENS-token
#               (16) prompt's pass and of a decode step, beside the passes' wall time
#   NCU="8b:512 0.6b:16:q8_0"  ncu's serialized kernel times (tools/ncu_table.py) of one prompt's pass of that many tokens
#               on the shape's file (Q4_K_M unless named) (the decode step after it too), with CHECK's and BENCH's files
#   NCU_DETAIL="8b:16:q4_k_m:gemm_q4_K[:skip]"  ncu --set full on one launch of that kernel (after skip), $OUT/ncu-detail.txt,
#               at the clocks the benchmarks run at (run 15's ran at ncu's locked base clock: SMs at 1.36 GHz, below their boost),
#               and its SASS with each line's stall samples, $OUT/ncu-source-KERNEL.csv.gz (read by tools/ncu_stalls.py)
#   LAUNCH_PROBE=1  tools/probe_launch_shapes.py on each MAIN_SHAPES file of QUANTS (LAUNCH_PROBE_ARGS): weights a
#               launch and the short-prompt GEMM's column splits against decode and prefill 16 and 64
#   PROBES="tools/probe_graph_nodes.py ..."  each of those tools on each MAIN_SHAPES Q4_K_M file: probe_timeline (a decode
#               step's critical path from CUPTI's kernel times), probe_graph_nodes (a
#               replayed decode step at 128 and 4,096 tokens of context with kernels switched off by name), probe_gemm_crossover (prompt passes through either
#               GEMM), probe_prompt_graphs, probe_decode_ahead (GRAPH_NODES=1 and CROSSOVER=1 before run 12)
#   VARIANTS=1  tools/probe_launch_shapes.py (the image's probe_args file, else VARIANT_ARGS) on each MAIN_SHAPES Q4_K_M
#               file with each kernel image in .variants/ (sm_90 images built here: tools/build_variant.sh) in place of the carried one,
#               or with a variant's own package (build_variant.sh --python); VARIANT_ROUNDS=N (N > 1): N rounds, each the
#               carried tree's probe first (with VARIANT_ARGS), then every variant's (a-b-a-b: cross-process spread is ~1%);
#               one round (the default) runs the variants alone
#   CLOCKS=1    tools/probe_clocks.py (CLOCKS_ARGS) on each MAIN_SHAPES Q4_K_M file with the timing package .clocks/clocks
#               (built here: tools/build_variant.sh clocks --clocks, or packed as .clocks/clocks.tar.xz): when each decode node's blocks start against the
#               node before's end, and what the matvecs' steps wait on; one replay's first 60 launches' marks in
#               $OUT/clocks-SHAPE-CONTEXT.npz
#   PROBE=1     tools/probe_overlap.py on PROBE_SHAPES' files (the first MAIN_SHAPES; 16-token prompt, n=PROBE_N, 10, PROBE_VARIANTS, PROBE_ARGS):
#               fresh processes beside the Python floor: the upload's overlap, the driver's queues, the way out
#   SIDECAR=1   with COLD: the sidecar's cold start (sidecar/tools/cold_start.py, its wheels in .whl/)
#   RESERVE_S   with COLD: seconds the main harness leaves for the MoE, hybrid and sidecar runs after it
#   SMOLLM2=1   SmolLM2 on CUDA, from .smollm2/ pieces gathered over consecutive warm calls
# llama.cpp builds in the background from the first second when BENCH or COLD asks for it; no
# timing starts before that build ends. Results under $OUT (at most 8 files come back).
# Carried (ignored) paths it uses when present:
#   .whl/                         wheels missing there (gguf, for the fixtures)
#   src/reflex_engine/cuda_image  kernels compiled here (REFLEX_CUDA_ARCH=sm_90)
#   .peers/llama.cpp-*.tar.xz     llama.cpp source (../shared/peers)
set -uo pipefail
T0=$(date +%s)
END=${END:-575}
elapsed() { echo $(( $(date +%s) - T0 )); }
OUT=${OUT:-/tmp/reflex-gpu-check}
mkdir -p "$OUT"
LOG=$OUT/log.txt
ROOT=$PWD
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
reflex() { python3 -m reflex_engine "$@"; }
LLAMA=/tmp/peer/build/bin

PEER=
if { [ "${BENCH:-0}" = 1 ] || [ "${COLD:-0}" = 1 ]; } && [ "${WITH_LLAMA:-1}" = 1 ] && [ ! -x $LLAMA/llama-bench ] && ls .peers/llama.cpp-*.tar.xz >/dev/null 2>&1; then
    ( mkdir -p /tmp/peer && tar -xJf .peers/llama.cpp-*.tar.xz -C /tmp/peer \
      && cmake -S /tmp/peer/llama.cpp -B /tmp/peer/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
           -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
           -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
           -DGGML_CCACHE=OFF -DLLAMA_BUILD_COMMIT=0c1e57098 \
      && ninja -C /tmp/peer/build -j16 llama-bench llama-simple llama-completion ) > /tmp/llama-build.log 2>&1 &
    PEER=$!
fi
wait_peer() { [ -n "$PEER" ] && { wait "$PEER" || tail -20 /tmp/llama-build.log; PEER=; echo "llama.cpp built at $(elapsed) s"; }; }

if [ -f src/reflex_engine/cuda_image/manifest.json ]; then  # keep the carried image: build only the C helper
    cp -r src/reflex_engine/cuda_image /tmp/carried_image
    REFLEX_CUDA=0 python3 setup.py -q build_ext --inplace > /tmp/build.log 2>&1 || echo "C helper not built (see build.log)"
    rm -rf src/reflex_engine/cuda_image && cp -r /tmp/carried_image src/reflex_engine/cuda_image
else
    REFLEX_CUDA=1 REFLEX_CUDA_COMPILER=nvcc REFLEX_CUDA_ARCH=sm_90 python3 setup.py -q build_ext --inplace > /tmp/build.log 2>&1 \
        || { echo "BUILD FAILED"; tail -30 /tmp/build.log; exit 1; }
fi
echo "build done at $(elapsed) s"

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader; python3 --version; nproc; env | grep "^PYTHON"
  python3 -c 'import numpy; print("numpy", numpy.__version__)'; } 2>&1 | tee -a "$LOG"
CUDA_DISABLE_PTX_JIT=1 reflex smoke 2>&1 | tee -a "$LOG"

# the transformers checks on CUDA: test_goldens, test_moe, test_mla, test_hybrid (device-parametrised, gpu-marked)
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_ops.py tests/test_goldens.py tests/test_moe.py tests/test_mla.py \
    tests/test_hybrid.py tests/test_cuda_cold_path.py tests/test_cuda_graphs.py tests/test_cuda_moe.py tests/test_cuda_mla.py \
    tests/test_cuda_delta_net.py tests/test_cuda_upload.py ${GPU_TESTS:-} --timeout 300 > "$OUT/gpu-tests.log" 2>&1
tail -3 "$OUT/gpu-tests.log"
grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/gpu-tests.log" | head -40
echo "tests done at $(elapsed) s"

if [ "${CHECK:-0}" = 1 ]; then
    echo "| fixture | worst relative logit error | tolerance | greedy |" | tee -a "$LOG"
    echo "|---|---|---|---|" | tee -a "$LOG"
    for model in tests/goldens/*/*.gguf; do
        arch=$(basename "$(dirname "$model")"); qtype=$(basename "$model" .gguf); qtype=${qtype#"$arch"-}
        log=$(reflex check "$model" --reference "tests/goldens/$arch/goldens-$qtype.npz" --device cuda 2>&1)
        grep -q "runs on the CPU backend" <<< "$log" && { echo "| $arch $qtype | CPU only | | |" | tee -a "$LOG"; continue; }
        worst=$(grep -oE "worst=[^ ]+" <<< "$log" | cut -d= -f2); tol=$(grep -oE "tolerance=[^ ]+" <<< "$log" | cut -d= -f2)
        echo "| $arch $qtype | ${worst:-ERROR} | $tol | $(grep -c "identical" <<< "$log")/2 identical |" | tee -a "$LOG"
        grep -E "MISMATCH|error" <<< "$log" | head -3
    done
fi

if [ "${SMOLLM2:-0}" = 1 ]; then
    mkdir -p /tmp/smollm2 && cp .smollm2/*.part* /tmp/smollm2/ 2>/dev/null
    if [ "$(ls /tmp/smollm2/*.part* 2>/dev/null | wc -l)" = "${SMOLLM2_PARTS:-4}" ]; then
        m=/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
        cat /tmp/smollm2/*.part* > $m && sha256sum $m
        reflex generate "$m" "What is the capital of France?" --chat --temp 0 -n 16 --device cuda 2>&1 | tee -a "$LOG"
        reflex system1 "$m" "The capital of France is" --candidate " Paris" --candidate " London" --candidate " Berlin" \
            --device cuda 2>&1 | tee -a "$LOG"
    else
        echo "SmolLM2: $(ls /tmp/smollm2/*.part* 2>/dev/null | wc -l) pieces so far"
    fi
fi

model_file() { case $1 in dsv2-lite|qwen35-*) echo "/tmp/$1-$2.gguf" ;; *) echo "/tmp/qwen3-$1-$2.gguf" ;; esac; }
MOE_SHAPES=${MOE_SHAPES:-30b-a3b dsv2-lite}
q4_only() { case " $MOE_SHAPES " in *" $1 "*) return 0 ;; esac; return 1; }  # the MoE files: Q4_K_M alone
if [ "${BENCH:-0}" = 1 ] || [ "${COLD:-0}" = 1 ] || [ "${PROFILE:-0}" = 1 ] || [ "${PROBE:-0}" = 1 ] || [ -n "${NCU:-}" ] || [ -n "${NCU_DETAIL:-}" ] || [ "${LAUNCH_PROBE:-0}" = 1 ] || [ "${VARIANTS:-0}" = 1 ] || [ -n "${PROBES:-}" ] || [ "${CLOCKS:-0}" = 1 ]; then
    tar -xJf .peers/llama.cpp-*.tar.xz llama.cpp/models/ggml-vocab-qwen2.gguf -O > /tmp/peer-vocab.gguf
    QUANTS=${QUANTS:-q4_k_m}
    SHAPES=${MAIN_SHAPES:-0.6b 8b}; [ "${MOE:-0}" = 1 ] && SHAPES="$SHAPES $MOE_SHAPES"; [ "${HYBRID:-0}" = 1 ] && SHAPES="$SHAPES qwen35-0.8b"
    for shape in $SHAPES; do
        for quant in $QUANTS; do
            q4_only $shape && [ "$quant" != q4_k_m ] && continue
            f=$(model_file $shape $quant)
            [ -f "$f" ] || python3 tools/make_bench_model.py /tmp/peer-vocab.gguf "$f" --shape $shape --quant $quant 2>&1 | tail -1
        done
    done
    echo "models done at $(elapsed) s"
fi

if [ "${PROFILE:-0}" = 1 ]; then  # before BENCH waits for llama.cpp, whose build may run beside it (host times then loaded)
    for shape in $SHAPES; do
        f=$(model_file $shape q4_k_m)
        [ "$(elapsed)" -gt $(( END - 60 )) ] && { echo "profile: no time left for $shape"; continue; }
        python3 tools/profile_kernels.py "$f" --prompt-tokens "${PROFILE_TOKENS:-16}" 2>&1 | tee -a "$LOG"
    done
fi

for run in ${NCU:-}; do  # shape:tokens[:quant]
    IFS=: read -r shape tokens quant <<< "$run"; quant=${quant:-q4_k_m}; f=$(model_file $shape $quant)
    [ "$(elapsed)" -gt $(( END - 90 )) ] && { echo "ncu: no time left for $run"; continue; }
    [ -f "$f" ] || python3 tools/make_bench_model.py /tmp/peer-vocab.gguf "$f" --shape $shape --quant $quant 2>&1 | tail -1
    ncu --clock-control none --cache-control none --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum \
        --log-file "/tmp/ncu-$shape-$tokens.csv" python3 tools/profile_kernels.py "$f" --prompt-tokens "$tokens" --decode 1 --once \
        > /tmp/ncu-$shape-$tokens.log 2>&1 || tail -5 /tmp/ncu-$shape-$tokens.log
    echo "## ncu: $shape $quant, a $tokens-token pass and one decode step" | tee -a "$LOG"
    python3 tools/ncu_table.py "/tmp/ncu-$shape-$tokens.csv" 2>&1 | head -40 | tee -a "$LOG"
done

for run in ${NCU_DETAIL:-}; do  # shape:tokens:quant:kernel[:skip]: ncu's full report of one launch, into $OUT
    IFS=: read -r shape tokens quant kernel skip <<< "$run"; f=$(model_file $shape $quant)
    [ "$(elapsed)" -gt $(( END - 90 )) ] && { echo "ncu detail: no time left for $run"; continue; }
    [ -f "$f" ] || python3 tools/make_bench_model.py /tmp/peer-vocab.gguf "$f" --shape $shape --quant $quant 2>&1 | tail -1
    ncu --set full --clock-control none --kernel-name "$kernel" --launch-skip "${skip:-0}" --launch-count 1 --page details \
        --export /tmp/ncu-detail --force-overwrite python3 tools/profile_kernels.py "$f" --prompt-tokens "$tokens" --decode 1 --once \
        > "$OUT/ncu-detail.txt.tmp" 2>&1
    { echo "## ncu --set full: $run"; grep -vE "^(==PROF==|  *$)" "$OUT/ncu-detail.txt.tmp"; } >> "$OUT/ncu-detail.txt"
    rm -f "$OUT/ncu-detail.txt.tmp"
    # its SASS with each line's warp-stall samples by reason (the source page), gzipped
    ncu --import /tmp/ncu-detail.ncu-rep --page source --csv --print-source sass 2>&1 | gzip > "$OUT/ncu-source-$kernel.csv.gz"
    python3 tools/ncu_stalls.py "$OUT/ncu-source-$kernel.csv.gz" | tee -a "$LOG" | head -12
done

if [ "${LAUNCH_PROBE:-0}" = 1 ]; then  # the matmuls' launch shapes
    for shape in ${MAIN_SHAPES:-0.6b 8b}; do
        for quant in $QUANTS; do
            python3 tools/probe_launch_shapes.py "$(model_file $shape $quant)" ${LAUNCH_PROBE_ARGS:-} 2>&1 | tee -a "$LOG"
        done
    done
fi

for probe in ${PROBES:-}; do
    for shape in ${MAIN_SHAPES:-0.6b 8b}; do
        python3 "$probe" "$(model_file $shape q4_k_m)" 2>&1 | tee -a "$LOG"
    done
done

if [ "${CLOCKS:-0}" = 1 ]; then  # the timing package's own image and Python, the helper built here
    [ -f .clocks/clocks.tar.xz ] && tar -xJf .clocks/clocks.tar.xz -C .clocks  # packed to fit the call's 64 MiB
    cp src/reflex_engine/_native*.so .clocks/clocks/src/reflex_engine/ 2>/dev/null
    for shape in ${MAIN_SHAPES:-0.6b 8b}; do
        PYTHONPATH=$ROOT/.clocks/clocks/src${PYTHONPATH#"$ROOT/src"} python3 tools/probe_clocks.py "$(model_file $shape q4_k_m)" \
            --save "$OUT/clocks-$shape" ${CLOCKS_ARGS:-} 2>&1 | tee -a "$LOG"
    done
fi

if [ "${VARIANTS:-0}" = 1 ]; then  # kernel images (or packages) built here, each in turn in place of the carried one
    wait_peer  # nothing compiles beside the timings
    cp -r src/reflex_engine/cuda_image /tmp/main_image
    rounds=${VARIANT_ROUNDS:-1}
    for round in $(seq "$rounds"); do
        for v in $([ "$rounds" -gt 1 ] && echo carried) .variants/*/; do
            path=$PYTHONPATH image=/tmp/main_image
            if [ -d "$v/src" ]; then
                path=$ROOT/${v%/}/src${PYTHONPATH#"$ROOT/src"}  # its own package (and image) in place of ours
            elif [ "$v" != carried ]; then
                image=$v
            fi
            rm -rf src/reflex_engine/cuda_image && cp -r "$image" src/reflex_engine/cuda_image
            for shape in ${MAIN_SHAPES:-0.6b 8b}; do
                echo "### variant $(basename "$v"), round $round" | tee -a "$LOG"
                PYTHONPATH=$path python3 tools/probe_launch_shapes.py "$(model_file $shape q4_k_m)" --fused 3 --gemm-blocks 2 \
                    $(cat "$v/probe_args" 2>/dev/null || echo "${VARIANT_ARGS:-}") 2>&1 | tee -a "$LOG"
            done
        done
    done
    rm -rf src/reflex_engine/cuda_image && cp -r /tmp/main_image src/reflex_engine/cuda_image
fi

floor_and_venv() {  # the floor's cubin and a clean interpreter, as a user's venv: no site-packages .pth hooks
    [ -x /tmp/floor/floor ] || { mkdir -p /tmp/floor && gcc -O2 -o /tmp/floor/floor bench/floor.c -ldl \
        && nvcc -cubin -arch=sm_90 -o /tmp/floor/floor.cubin bench/floor_kernel.cu; }
    [ -x /tmp/cold-venv/bin/python ] || python3 -m venv --without-pip /tmp/cold-venv
}

if [ "${PROBE:-0}" = 1 ]; then  # fresh processes of the clean venv's python3 beside the Python floor
    floor_and_venv
    wait_peer  # nothing compiles beside the timings
    for shape in ${PROBE_SHAPES:-${SHAPES%% *}}; do
        python3 tools/probe_overlap.py "$(model_file $shape q4_k_m)" --n "${PROBE_N:-10}" --prompt-tokens 16 \
            --floor-bin /tmp/floor --python /tmp/cold-venv/bin/python ${PROBE_ARGS:-} ${PROBE_VARIANTS:+--variants "$PROBE_VARIANTS"} 2>&1 | tee -a "$LOG"
    done
fi

if [ "${BENCH:-0}" = 1 ]; then  # bench/warm.py: reflex bench and llama-bench on each file, one table with the ratios
    wait_peer
    files=
    for quant in $QUANTS; do
        for shape in $SHAPES; do
            q4_only $shape && [ "$quant" != q4_k_m ] && continue
            files="$files $shape-$quant=$(model_file $shape $quant)"
        done
    done
    llama=; [ "${WITH_LLAMA:-1}" = 1 ] && [ -x $LLAMA/llama-bench ] && llama="--llama-bench $LLAMA/llama-bench"
    echo "## warm tables from $(elapsed) s" | tee -a "$LOG"
    python3 bench/warm.py $files $llama --runs 3 --out "$OUT/warm" --deadline-s $(( END - $(elapsed) - 90 )) 2>&1 | tee -a "$LOG"
fi

if [ "${COLD:-0}" = 1 ]; then
    floor_and_venv
    wait_peer  # nothing compiles beside the timings
    echo "harness starts at $(elapsed) s"
    llama_bin=; [ "${WITH_LLAMA:-1}" = 1 ] && [ "${COLD_LLAMA:-1}" = 1 ] && llama_bin="--llama-bin $LLAMA"
    main_models=; for shape in ${MAIN_SHAPES:-0.6b 8b}; do main_models="$main_models --model $shape=$(model_file $shape q4_k_m)"; done
    structured=; [ "${COLD_STRUCTURED:-1}" = 1 ] && structured="--structured 0.6b"
    python3 bench/cold_start.py $main_models --prompt-tokens "${COLD_PROMPTS:-16,1024}" $structured \
        $llama_bin --floor-bin /tmp/floor --python /tmp/cold-venv/bin/python --n "${COLD_N:-10}" \
        --deadline-s $(( END - $(elapsed) - ${RESERVE_S:-0} )) --out "$OUT/cold" 2>&1 | tee /tmp/cold-main.log | tail -60
    grep -m 6 "^FAILED" /tmp/cold-main.log | cut -c 1-700 | tee -a "$LOG"
    left() { echo $(( END - $(elapsed) - ${SIDECAR:-0} * 40 )); }  # the sidecar's 40 s kept
    if [ "${MOE:-0}" = 1 ] && [ "${MOE_COLD:-1}" = 1 ]; then  # half of what is left when the hybrid run follows
        moe_models=; for shape in $MOE_SHAPES; do moe_models="$moe_models --model $shape=$(model_file $shape q4_k_m)"; done
        python3 bench/cold_start.py $moe_models --prompt-tokens 16 \
            $llama_bin --floor-bin /tmp/floor --python /tmp/cold-venv/bin/python --n "${COLD_N:-10}" \
            --deadline-s $(( $(left) / (1 + ${HYBRID:-0}) )) --out "$OUT/cold-moe" 2>&1 | tail -30
    fi
    if [ "${HYBRID:-0}" = 1 ]; then
        python3 bench/cold_start.py --model qwen35-0.8b="$(model_file qwen35-0.8b q4_k_m)" \
            $llama_bin --floor-bin /tmp/floor --python /tmp/cold-venv/bin/python --n "${COLD_N:-10}" \
            --deadline-s "$(left)" --out "$OUT/cold-hybrid" 2>&1 | tail -30
    fi
    if [ "${SIDECAR:-0}" = 1 ]; then  # the system python3, for the sidecar and the bare engine alike
        python3 -m compileall -q sidecar/src > /dev/null  # its bytecode, as pip installs it (cold_start.compile_bytecode)
        PYTHONPATH=$ROOT/sidecar/src:$PYTHONPATH python3 sidecar/tools/cold_start.py "$(model_file 0.6b q4_k_m)" --device cuda \
            -n "${COLD_N:-10}" 2>&1 | tee "$OUT/cold/sidecar.txt" | tail -6
    fi
fi
echo "done at $(elapsed) s"
