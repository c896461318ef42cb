"""The Runpod queue worker: starts the sidecar (which starts `reflex stdio`), waits for it to be
ready, then takes jobs through the runpod SDK. docs/serverless.md has the environment table.

Why through the sidecar and not `reflex stdio` directly: `openai_route` jobs are OpenAI requests,
and the sidecar is where Reflex already speaks OpenAI (validation, chat fallback, stop-text
hold-back, logprobs, SSE), tested against OpenAI's published schemas; a second translation here
would drift from it. The sidecar also already supervises the engine and exits 1 when it dies,
which is the signal this worker turns into its own non-zero exit. The cost, the sidecar's start,
overlaps the engine's load (it spawns the engine before importing its HTTP stack), and this
module starts it before importing the runpod SDK (~1-3 s of imports) for the same reason.

The sidecar is spoken to on 127.0.0.1 only; its model name is internal and rewritten both ways.
"""
from __future__ import annotations

import atexit
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import NoReturn

from .jobs import JobError, Request, normalise, plain_output, plain_piece, rename

INTERNAL_NAME = "reflex-runpod-internal"  # what the sidecar serves; clients see the served name
POLL_S = 0.05


def _log(message: str) -> None:
    print(f"reflex-runpod: {message}", file=sys.stderr, flush=True)


def fail(message: str) -> NoReturn:
    _log(message)
    os._exit(1)  # from any thread: the platform replaces a worker that exits


class Config:
    """Everything from the environment (docs/serverless.md); a bad value is a one-line exit 1."""

    def __init__(self, env=os.environ):
        self.model = env.get("REFLEX_MODEL", "")
        if not self.model:
            fail("REFLEX_MODEL is not set: the GGUF file (or org/repo:file.gguf) to serve")
        self.served_name = (env.get("OPENAI_SERVED_MODEL_NAME_OVERRIDE") or env.get("REFLEX_SERVED_MODEL_NAME")
                            or os.path.basename(self.model))
        command = env.get("REFLEX_RUNPOD_SIDECAR_CMD")
        if command:
            self.sidecar = shlex.split(command)
        elif shutil.which("reflex-openai"):
            self.sidecar = ["reflex-openai"]
        else:
            self.sidecar = [sys.executable, "-m", "reflex_openai"]
        self.ready_timeout = _number(env, "REFLEX_RUNPOD_READY_TIMEOUT", 900.0)
        self.concurrency = int(_number(env, "REFLEX_RUNPOD_CONCURRENCY", 1, integer=True))
        self.exit_grace = _number(env, "REFLEX_RUNPOD_EXIT_GRACE", 2.0)


def _number(env, name: str, default, integer: bool = False):
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        fail(f"{name}={raw!r}: expected {'an integer' if integer else 'a number'}")
    if value <= 0:
        fail(f"{name}={raw!r}: must be > 0")
    return value


class Sidecar:
    """The reflex-openai child on a free local port; its exit ends this worker (status 1)."""

    def __init__(self, config: Config):
        self.config = config
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = {**os.environ, "REFLEX_MODEL": config.model, "REFLEX_HOST": "127.0.0.1",
               "REFLEX_PORT": str(self.port), "REFLEX_SERVED_MODEL_NAME": INTERNAL_NAME,
               "REFLEX_ON_ENGINE_EXIT": "exit"}
        for name in ("PORT", "PORT_HEALTH", "REFLEX_API_KEY"):  # a load-balancer's settings, not ours
            env.pop(name, None)
        self.base = f"http://127.0.0.1:{self.port}"
        self.active = 0  # jobs being answered: let them report before exiting
        self.stopping = False  # this worker is exiting by itself: the sidecar's exit is expected
        try:
            self.proc = subprocess.Popen(config.sidecar, env=env, stdin=subprocess.DEVNULL)
        except OSError as e:
            fail(f"cannot start the sidecar ({' '.join(config.sidecar)}): {e}")
        threading.Thread(target=self._watch, daemon=True).start()
        atexit.register(self.stop)

    def stop(self) -> None:
        """SIGTERM to the sidecar: it finishes what it serves, closes the engine's input, exits 0."""
        self.stopping = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=35)  # the sidecar's own drain is 30 s
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def _watch(self) -> None:
        status = self.proc.wait()
        if self.stopping:
            return
        deadline = time.monotonic() + self.config.exit_grace
        while self.active and time.monotonic() < deadline:  # the failed job's result goes out first
            time.sleep(POLL_S)
        fail(f"the sidecar exited (status {status}): the engine is gone; stopping this worker")

    def wait_ready(self) -> None:
        """Blocks until /healthz says 200; exits 1 when the sidecar dies or the timeout passes."""
        deadline = time.monotonic() + self.config.ready_timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.base + "/healthz", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 (the watcher ends the worker when it exits)
            time.sleep(POLL_S)
        fail(f"the engine was not ready after {self.config.ready_timeout:g} s (REFLEX_RUNPOD_READY_TIMEOUT)")


def _error_text(status: int, body: bytes) -> str:
    try:
        error = json.loads(body)["error"]
        param = f" ({error['param']})" if error.get("param") else ""
        return f"{status} {error.get('code') or error.get('type')}{param}: {error['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{status}: {body[:200].decode(errors='replace')}"


def make_handler(sidecar: Sidecar, config: Config):
    import aiohttp  # the runpod SDK's own HTTP client

    async def handler(job):
        """An async generator: one item for a non-streamed job, the pieces for a streamed one."""
        try:
            request = normalise(job.get("input"), served_name=config.served_name, internal_name=INTERNAL_NAME)
        except JobError as e:
            yield {"error": str(e)}
            return
        sidecar.active += 1
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as client:
                async for item in _serve(client, sidecar.base, request, config.served_name):
                    yield item
        except (aiohttp.ClientError, ConnectionError) as e:
            yield {"error": f"the engine is unavailable ({e}); this worker stops"}
        finally:
            sidecar.active -= 1

    return handler


async def _serve(client, base: str, request: Request, served_name: str):
    method = "GET" if request.body is None else "POST"
    async with client.request(method, base + request.route, json=request.body) as r:
        if r.status != 200:
            yield {"error": _error_text(r.status, await r.read())}
            return
        if not request.stream:
            answer = rename(await r.json(), INTERNAL_NAME, served_name)
            yield answer if request.openai else plain_output(answer)
            return
        async for raw in r.content:  # server-sent events: `data: {...}` lines, blank lines between
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                if request.openai:
                    yield "data: [DONE]\n\n"
                return
            event = json.loads(data)
            if "error" in event:  # the engine died mid-stream (the sidecar's last event)
                yield {"error": _error_text(503, data.encode())}
                return
            event = rename(event, INTERNAL_NAME, served_name)
            if request.openai:
                yield f"data: {json.dumps(event)}\n\n"  # as the sidecar streams it, for an OpenAI client
            elif (piece := plain_piece(event)) is not None:
                yield piece


def collected(handler):
    """For the SDK's --test_input mode, which runs a handler once and does not iterate generators:
    the whole stream as one list (what /runsync and return_aggregate_stream give), or its error."""
    async def run(job):
        items = []
        async for item in handler(job):
            if isinstance(item, dict) and "error" in item:
                return {"error": item["error"]}
            items.append(item)
        return items

    return run


def main() -> int:
    start = time.monotonic()
    config = Config()
    sidecar = Sidecar(config)  # the engine loads while the SDK imports
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the platform's stop: atexit stops the sidecar
    import runpod

    imported = time.monotonic()
    sidecar.wait_ready()
    _log(f"ready: {(time.monotonic() - start) * 1000:.0f} ms from the worker's start to the engine's "
         f"readiness (the runpod SDK's import took {(imported - start) * 1000:.0f} ms of it, beside the load)")
    handler = make_handler(sidecar, config)
    local_test = any(a == "--test_input" or a.startswith("--test_input=") for a in sys.argv)
    runpod.serverless.start({"handler": collected(handler) if local_test else handler,
                             "return_aggregate_stream": True,
                             "concurrency_modifier": lambda current: config.concurrency})
    return 0
