"""Cold start through the sidecar, as a platform sees it: a fresh `reflex-openai` process per run,
timed from its launch to the first `/healthz` 200, and to the first streamed token of a chat.
Each run is paired with one of a bare `reflex stdio` (launch to its `ready` line, and to the first
`token` line of the same chat), so the difference is what the sidecar costs.

    python sidecar/tools/cold_start.py MODEL [--device cuda] [-n 10] [--port 8765]

Prints one line per run and the p50/p95 of each; the wall clock is this script's.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time

import httpx

POLL_S = 0.005  # a poll costs the sidecar CPU that the engine, loading, may need


def one_run(args) -> tuple[float, float]:
    url = f"http://127.0.0.1:{args.port}"
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "reflex_openai", args.model, "--port", str(args.port),
                             "--device", args.device, "--served-model-name", "m"], stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            while True:
                try:
                    if http.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass  # not listening yet
                if proc.poll() is not None:
                    raise SystemExit(f"the sidecar exited with status {proc.returncode}")
                time.sleep(POLL_S)
            ready = time.perf_counter()
            body = {"model": "m", "messages": [{"role": "user", "content": args.prompt}], "max_tokens": 8,
                    "temperature": 0, "stream": True}
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                        break
            first_token = time.perf_counter()
    finally:
        proc.terminate()
        proc.wait(60)
    return (ready - started) * 1000, (first_token - started) * 1000


def engine_run(args) -> tuple[float, float]:
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "reflex_engine", "stdio", args.model, "--device", args.device],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert json.loads(proc.stdout.readline())["type"] == "ready"
        ready = time.perf_counter()
        request = {"op": "generate", "messages": [{"role": "user", "content": args.prompt}], "max_tokens": 8,
                   "temperature": 0, "stream": True}
        proc.stdin.write(json.dumps(request).encode() + b"\n")
        proc.stdin.flush()
        while (line := json.loads(proc.stdout.readline()))["type"] == "token" and not line["text"]:
            pass
        first_token = time.perf_counter()
    finally:
        proc.stdin.close()
        proc.kill()
        proc.wait(60)
    return (ready - started) * 1000, (first_token - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--device", default="auto")
    parser.add_argument("-n", type=int, default=10)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--prompt", default="What is the capital of France?")
    args = parser.parse_args()
    runs, bare = [], []
    for i in range(args.n):
        runs.append(one_run(args))
        bare.append(engine_run(args))
        print(f"run {i}: sidecar launch to /healthz 200 {runs[-1][0]:.0f} ms, to first streamed token "
              f"{runs[-1][1]:.0f} ms; reflex stdio alone: to ready {bare[-1][0]:.0f} ms, to first token {bare[-1][1]:.0f} ms")
    for name, values in (("sidecar launch to /healthz 200", [r[0] for r in runs]),
                         ("sidecar launch to first streamed token", [r[1] for r in runs]),
                         ("reflex stdio launch to ready", [r[0] for r in bare]),
                         ("reflex stdio launch to first token", [r[1] for r in bare])):
        values = sorted(values)
        p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
        print(f"{name}: p50 {statistics.median(values):.0f} ms, p95 {p95:.0f} ms (n={len(values)})")


if __name__ == "__main__":
    main()
