"""Host-side pieces of the cold path, each timed in fresh processes (median of N).

    python tools/bench_host_path.py VOCAB.gguf [--runs 7]

Measures: interpreter start, importing the generate path (no numpy), `import numpy`,
GGUF open and tokenizer build + first chat-prompt encode, unprepared and after
`reflex prepare` (on a copy in a temp dir). Prints one table; numbers go to docs/perf-notes.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"

OPEN_AND_ENCODE = """
import json, sys, time
t0 = time.perf_counter()
from reflex_engine.gguf import GGUFFile
from reflex_engine.tokenizer import Tokenizer
t1 = time.perf_counter()
f = GGUFFile(sys.argv[1])
t2 = time.perf_counter()
tok = Tokenizer.from_gguf(f)
t3 = time.perf_counter()
tok.encode(sys.argv[2])
t4 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "gguf_open": t2 - t1, "tokenizer": t3 - t2, "first_encode": t4 - t3}))
"""


def fresh_process_ms(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return (time.perf_counter() - start) * 1e3


def phases(path: str, runs: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {}
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", OPEN_AND_ENCODE, path, PROMPT], check=True, capture_output=True, text=True).stdout
        for key, seconds in json.loads(out).items():
            samples.setdefault(key, []).append(seconds * 1e3)
    return {key: statistics.median(values) for key, values in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("vocab", help="a GGUF with a tokenizer (e.g. llama.cpp's models/ggml-vocab-qwen2.gguf)")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()

    rows = []
    for label, code in (("python3 -c pass", "pass"),
                        ("import generate path (cli, engine)", "import reflex_engine.cli, reflex_engine.engine"),
                        ("import numpy", "import numpy")):
        rows.append((label, statistics.median(fresh_process_ms(code) for _ in range(args.runs))))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, os.path.basename(args.vocab))
        shutil.copy(args.vocab, path)
        for state in ("unprepared", "prepared"):
            if state == "prepared":
                subprocess.run([sys.executable, "-m", "reflex_engine", "prepare", path], check=True, capture_output=True)
            for key, ms in phases(path, args.runs).items():
                rows.append((f"{state}: {key}", ms))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, median of {args.runs} fresh processes")
    for label, ms in rows:
        print(f"{label:45s} {ms:8.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
