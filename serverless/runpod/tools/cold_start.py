"""Cold start of the queue worker in the SDK's local test mode, as the parent sees it:

    python serverless/runpod/tools/cold_start.py MODEL [-n 5] [--device cpu]

For each of n fresh runs: launch -> the worker's `ready:` line (the engine ready behind the
sidecar), the SDK's import inside that, and launch -> the worker's exit after one 1-token job;
beside it a bare `reflex stdio` launch -> `ready` line. Prints p50 and each run, in ms.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time


def worker_run(model: str, device: str) -> dict:
    job = {"input": {"prompt": "Hello", "sampling_params": {"max_tokens": 1, "temperature": 0}}}
    env = {**os.environ, "REFLEX_MODEL": model, "REFLEX_DEVICE": device}
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "reflex_runpod", "--test_input", json.dumps(job)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    ready = sdk = None
    for line in proc.stderr:
        if ready is None and (m := re.search(r"reflex-runpod: ready: .*import took (\d+) ms", line)):
            ready, sdk = (time.monotonic() - start) * 1000, float(m.group(1))
    assert proc.wait() == 0, "the job failed"
    return {"ready": ready, "sdk_import": sdk, "exit": (time.monotonic() - start) * 1000}


def stdio_run(model: str, device: str) -> float:
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "reflex_engine", "stdio", model, "--device", device],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert json.loads(proc.stdout.readline())["type"] == "ready"
    elapsed = (time.monotonic() - start) * 1000
    proc.stdin.close()
    proc.wait()
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("-n", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    rows = []
    for _ in range(args.n):  # interleaved, so that a noisy moment hits both
        rows.append({**worker_run(args.model, args.device), "stdio_ready": stdio_run(args.model, args.device)})
    for key in ("stdio_ready", "ready", "sdk_import", "exit"):
        values = [r[key] for r in rows]
        print(f"{key:12} p50 {statistics.median(values):7.0f} ms   runs: {' '.join(f'{v:.0f}' for v in values)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
