"""Helpers for the Runpod worker's tests: the worker in the SDK's local modes, and the engine itself."""
import ast
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
FIXTURE = os.path.join(REPO, "tests", "goldens", "qwen3", "qwen3-Q8_0.gguf")  # tiny, random, has a chat template
PROXY = os.path.join(REPO, "sidecar", "tests", "engine_proxy.py")  # records lines, stalls a stream on demand
SERVED = "tiny-qwen3"
TIMEOUT = 60


def worker_env(**extra) -> dict:
    env = {**os.environ, "REFLEX_MODEL": FIXTURE, "REFLEX_DEVICE": "cpu", "REFLEX_SERVED_MODEL_NAME": SERVED,
           "OPENBLAS_NUM_THREADS": "1", "RUNPOD_LOG_LEVEL": "INFO"}
    for name in ("RUNPOD_WEBHOOK_GET_JOB", "OPENAI_SERVED_MODEL_NAME_OVERRIDE", "PORT", "PORT_HEALTH"):
        env.pop(name, None)
    env.update(extra)
    return env


def start_local_test(job_input, **env) -> subprocess.Popen:
    """`python -m reflex_runpod --test_input JOB`: the SDK runs one job and exits."""
    return subprocess.Popen([sys.executable, "-m", "reflex_runpod", "--test_input", json.dumps({"input": job_input})],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=worker_env(**env), cwd=REPO)


def local_test_result(proc: subprocess.Popen) -> tuple[int, dict | None, str]:
    """(exit status, the job result the SDK logged, the whole log)."""
    out = proc.communicate(timeout=TIMEOUT)[0].decode()
    result = None
    for line in out.splitlines():
        if "Job result: " in line:
            result = ast.literal_eval(line.split("Job result: ", 1)[1])
    return proc.returncode, result, out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_api_server(port: int, **env) -> subprocess.Popen:
    """`python -m reflex_runpod --rp_serve_api`: the SDK's local API server (/run, /runsync, /stream)."""
    return subprocess.Popen([sys.executable, "-m", "reflex_runpod", "--rp_serve_api", "--rp_api_port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=worker_env(**env), cwd=REPO)


def wait_listening(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("the worker's API server did not start")


class Engine:
    """`reflex stdio FIXTURE --device cpu`, spoken to directly: what the engine itself answers."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "reflex_engine", "stdio", FIXTURE, "--device", "cpu"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        assert json.loads(self.proc.stdout.readline())["type"] == "ready"

    def generate(self, **request) -> dict:
        """The result line of a greedy generate (the worker's jobs below are greedy too)."""
        self.proc.stdin.write(json.dumps({"op": "generate", "temperature": 0, **request}) + "\n")
        self.proc.stdin.flush()
        line = json.loads(self.proc.stdout.readline())
        assert line["type"] == "result", line
        return line

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(TIMEOUT) == 0
