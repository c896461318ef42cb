"""Why the first pass does not overlap the weights' upload, and whether the driver's init is slower
beside the host path than alone: fresh `reflex generate -n 1` processes under variants, their
result lines' phases side by side.

    python3 tools/probe_overlap.py MODEL [MODEL ...] [--n 3] [--prompt-tokens 1024]

Variants: the engine as it is; every copy landed before the pass starts (no overlap); the
driver's init waited for before the host path begins (its cuda_init_ms then alone, against the
191-207 ms it took beside the host path in run 6 on the H200, where the whole Python floor process
with the same driver settings had its result 192 ms after launch); the driver's default work and
copy queues (8 each) instead of Reflex's one and one; the upload on fewer or more threads than its
4, in smaller or larger chunks than its 32 MB. (Earlier
variants, run against the upload as it then was, are in docs/perf-notes.md: no pinning at all,
every chunk pinned before the first copy, the pages unpinned or not.)
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
PATCHES = {
    "as is": "",
    "every copy landed before the pass": """
from reflex_engine.backends.cuda import ops
commit = ops.CudaOps.commit_weights
def patched(self):
    n = commit(self)
    for i in range(len(self._upload._chunks_of)):
        self._upload.wait(i)
    return n
ops.CudaOps.commit_weights = patched
""",
    "the driver's init before the host path": """
from reflex_engine import backends
init = backends.BackendStart.__init__
def patched(self, device):
    init(self, device)
    if self._thread is not None:
        self._thread.join()
backends.BackendStart.__init__ = patched
""",
    **{f"upload on {n} threads": f"""
from reflex_engine.backends.cuda import upload
init = upload.Upload.__init__
upload.Upload.__init__ = lambda self, device, copies, buffers=(), threads=0: init(self, device, copies, buffers, {n})
""" for n in (2, 8)},
    **{f"upload in {mb} MB chunks": f"""
from reflex_engine.backends.cuda import upload
upload.plan_chunks.__defaults__ = ({mb} << 20, upload.PAGE, upload.SMALL)
""" for mb in (8, 64)},
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
    print("| model | variant | n | cuda_init_ms | model_load_ms | upload_ms | prompt_eval_ms | first_token_ms | exit_ms |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for name, patch, env in variants:
            runs = [run(model, prompt, patch, env) for _ in range(args.n)]
            ok = [r for r in runs if "error" not in r]
            if not ok:
                print(f"| {os.path.basename(model)} | {name} | 0 | {runs[0]['error']!r} |")
                continue
            med = lambda k: f"{statistics.median(r[k] for r in ok):.1f}" if all(k in r for r in ok) else "–"
            print(f"| {os.path.basename(model)} | {name} | {len(ok)} | {med('cuda_init_ms')} | {med('model_load_ms')} | {med('upload_ms')} | "
                  f"{med('prompt_eval_ms')} | {med('first_token_ms')} | {med('exit_ms')} |", flush=True)


if __name__ == "__main__":
    main()
