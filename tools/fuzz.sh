#!/usr/bin/env bash
# Run one fuzz harness for as long as asked:  tools/fuzz.sh NAME SECONDS [libFuzzer flags...]
#
# NAME is a harness in fuzz/: gguf native vocab sidecar tokenizer chat ipc lora openai kvstate.
# The corpus lives in build/fuzz/corpus/NAME, seeded from the fixtures on the first run
# (fuzz/make_corpus.py) and grown by every run; crashes, hangs and out-of-memory inputs land in
# build/fuzz/crashes/NAME-*, and the run's log in build/fuzz/NAME.log. For a harness that reaches
# _native.c, the corpus is then replayed through an AddressSanitizer + UBSan build of it (gcc;
# atheris's coverage cannot run under gcc's ASan runtime, so the sanitizer pass is a replay, not a
# second fuzzing run).
#
# PYTHON: an interpreter with the package and atheris installed (default python3).
# FUZZ_ASAN=0 skips the sanitizer replay; FUZZ_ASAN_MUTANTS (default 2000) sets how many seeded
# mutations of the corpus it adds.
set -euo pipefail
usage="usage: tools/fuzz.sh NAME SECONDS [libFuzzer flags...]"
name=${1:?$usage}
seconds=${2:?$usage}
shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
harness=$root/fuzz/fuzz_$name.py
if [[ ! -f $harness ]]; then
    echo "tools/fuzz.sh: no harness fuzz/fuzz_$name.py" >&2
    exit 2
fi
out=$root/build/fuzz
corpus=$out/corpus/$name
mkdir -p "$out/crashes"
cd "$root/fuzz"
[[ -d $corpus ]] || "$python" make_corpus.py "$out/corpus" "$name"
export OPENBLAS_NUM_THREADS=1  # the tiny models gain nothing from more, and the machine is shared
scratch=$(mktemp -d "${TMPDIR:-/dev/shm}/reflex-fuzz-$name.XXXXXX" 2>/dev/null || mktemp -d)
trap 'rm -rf "$scratch"' EXIT
export REFLEX_FUZZ_SCRATCH=$scratch  # the files a harness writes its inputs to

status=0
"$python" "fuzz_$name.py" -max_total_time="$seconds" -print_final_stats=1 \
    -artifact_prefix="$out/crashes/$name-" "$@" "$corpus" >"$out/$name.log" 2>&1 || status=$?
grep -E '^#[0-9]+ +(INITED|DONE)|^stat::|ERROR|Traceback|Error:' "$out/$name.log" | tail -n 20 || true
if [[ $status != 0 ]]; then
    echo "tools/fuzz.sh: $name stopped on a failure (exit $status); see $out/$name.log and $out/crashes/" >&2
    exit "$status"
fi

if [[ ${FUZZ_ASAN:-1} != 0 ]] && grep -q '^REACHES_NATIVE = True' "$harness"; then
    asan=$(gcc -print-file-name=libasan.so 2>/dev/null || true)
    if [[ -z $asan || ! -f $asan ]]; then
        echo "tools/fuzz.sh: no gcc with libasan here: the sanitizer replay is skipped" >&2
        exit 0
    fi
    lib=$out/_native_asan.so
    src=$root/src/reflex_engine/_native.c
    if [[ ! -f $lib || $src -nt $lib ]]; then
        gcc -O1 -g -fPIC -shared -fno-omit-frame-pointer -fsanitize=address,undefined \
            -fno-sanitize-recover=all "$src" -o "$lib"
    fi
    # PYTHONMALLOC=malloc: Python's buffers come from malloc, so ASan puts red zones around them
    PYTHONMALLOC=malloc LD_PRELOAD=$asan ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
        REFLEX_FUZZ_NATIVE=$lib "$python" replay.py "$name" "$corpus" --mutants "${FUZZ_ASAN_MUTANTS:-2000}"
fi
