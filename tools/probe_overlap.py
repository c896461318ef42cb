"""Why the first pass does not overlap the weights' upload, and whether the driver's init is slower
beside the host path than alone: fresh `reflex generate -n 1` processes under variants, their
result lines' phases side by side.

    python3 tools/probe_overlap.py MODEL [MODEL ...] [--n 3] [--prompt-tokens 1024]

Variants: the engine as it is; every copy landed before the pass starts (no overlap); the
driver's default work and copy queues (8 each) instead of Reflex's one and one. "Marked" rows add
the moments after the driver's init: the backend handed over, the model loaded, the pass begun (ms
since the import; their patch imports the engine first, so the init starts later). (Earlier
variants and what they showed are in docs/perf-notes.md: the upload without pinning, pinned before
the first copy, on 2 or 8 threads, in 8 or 64 MB chunks; the driver's init alone before the host
path; CUDA's eager module loading; the first pass's kernels made ready on a thread beside the load.)
A throwaway measurement tool: the engine path is what it is, monkeypatched here per variant.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
# the moments after the driver's init, on the result line: the backend handed over, the model loaded, the pass begun
MARKS = """
from reflex_engine import backends, engine, timing
MARKS = {}
def marking(name, f):
    def call(*args, **kwargs):
        if name.startswith("begin"):
            MARKS.setdefault(name[6:] + "_ms", timing.since_start_ms())
        out = f(*args, **kwargs)
        MARKS.setdefault(name + "_ms", timing.since_start_ms())
        return out
    return call
backends.BackendStart.ops = marking("ops_ready", backends.BackendStart.ops)
engine.ModelFile.load = marking("load_end", engine.ModelFile.load)
engine.Model._next_logits = marking("begin_pass_start", engine.Model._next_logits)
reported = timing.reported_phases
timing.reported_phases = lambda phases: {**reported(phases), **{k: round(v, 3) for k, v in MARKS.items()}}
"""
PATCHES = {
    "as is": "",
    "as is, marked": MARKS,
    "every copy landed before the pass, marked": MARKS + """
from reflex_engine.backends.cuda import ops
commit = ops.CudaOps.commit_weights
def patched(self):
    n = commit(self)
    for i in range(len(self._upload._chunks_of)):
        self._upload.wait(i)
    return n
ops.CudaOps.commit_weights = patched
""",
}
EIGHT_QUEUES = {"CUDA_DEVICE_MAX_CONNECTIONS": "8", "CUDA_DEVICE_MAX_COPY_CONNECTIONS": "8"}


def run(model: str, prompt: str, patch: str, env: dict) -> dict:
    code = patch + "\nimport sys\nfrom reflex_engine.launch import run\nrun()\n"
    argv = [sys.executable, "-c", code, "generate", model, prompt, "--device", "cuda", "--temp", "0", "-n", "1",
            "--ignore-eos"]
    started = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": SRC, **env})
    exit_ms = (time.perf_counter() - started) * 1e3
    line = [l for l in proc.stdout.splitlines() + proc.stderr.splitlines() if "first_token_ms=" in l]
    if proc.returncode or not line:
        return {"error": proc.stderr[-300:]}
    return {**{k: float(v) for k, v in re.findall(r"(\w+_ms)=([0-9.]+)", line[-1])}, "exit_ms": exit_ms}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    args = ap.parse_args()
    prompt = " ".join(["hello"] * args.prompt_tokens)
    variants = [(name, patch, {}) for name, patch in PATCHES.items()] + [("8 work + 8 copy queues", "", EIGHT_QUEUES)]
    print(f"{args.prompt_tokens}-token prompt; first_token_ms counts from reflex_engine's import, exit_ms from the launch")
    print("| model | variant | n | cuda_init_ms | cuda_ready_ms | ops_ready_ms | model_load_ms | load_end_ms | pass_start_ms | "
          "upload_ms | prompt_eval_ms | first_token_ms | exit_ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for name, patch, env in variants:
            runs = [run(model, prompt, patch, env) for _ in range(args.n)]
            ok = [r for r in runs if "error" not in r]
            if not ok:
                print(f"| {os.path.basename(model)} | {name} | 0 | {runs[0]['error']!r} |")
                continue
            med = lambda k: f"{statistics.median(r[k] for r in ok):.1f}" if all(k in r for r in ok) else "–"
            cells = " | ".join(med(k) for k in ("cuda_init_ms", "cuda_ready_ms", "ops_ready_ms", "model_load_ms", "load_end_ms",
                                                 "pass_start_ms", "upload_ms", "prompt_eval_ms", "first_token_ms", "exit_ms"))
            print(f"| {os.path.basename(model)} | {name} | {len(ok)} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
