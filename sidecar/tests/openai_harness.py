"""What the sidecar's tests share: starting a sidecar process (its engine behind engine_proxy.py),
a `reflex stdio` reference process spoken to directly, OpenAI's vendored response schemas, and
the fixture model with Qwen3's chat template and tool-call tokens."""
from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import jsonschema

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
FIXTURE = os.path.join(REPO, "tests", "goldens", "qwen3", "qwen3-Q8_0.gguf")  # tiny, random, has a chat template
QWEN3_TEMPLATE = os.path.join(REPO, "tests", "chat_templates", "Qwen-Qwen3-0.6B.jinja")  # Qwen3-0.6B's own
CALL_TOKENS = (373, 374)  # <tool_call>, </tool_call> in qwen3_model()'s vocabulary
ENGINE = [sys.executable, "-m", "reflex_engine"]
TIMEOUT = 60  # seconds anything may take before the test fails instead of hanging
# One BLAS thread per engine: on a small shared machine, spinning BLAS threads made each request
# several times slower. The sidecar's engine and the reference get the same, so their numbers agree.
ENGINE_ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}



def _nullable(node):
    """OpenAPI 3.0's `nullable: true`, which parts of the 3.1 spec still use, as JSON Schema says it."""
    if isinstance(node, list):
        return [_nullable(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable(v) for k, v in node.items()}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node


with open(os.path.join(HERE, "openapi", "openai-schemas.json")) as f:
    OPENAPI = _nullable(json.load(f))


def validate(schema: str, obj) -> None:
    """obj against the named schema of OpenAI's published OpenAPI spec."""
    jsonschema.Draft202012Validator({**OPENAPI, "$ref": f"#/components/schemas/{schema}"}).validate(obj)


def qwen3_model(folder: str) -> str:
    """The fixture (F32: gguf-py writes float tensors only) with Qwen3-0.6B's chat template, and
    `<tool_call>`, `</tool_call>` as tokens of their own in place of two padding ones, as Qwen3's
    vocabulary has them (user-defined, like the fixture's `<think>`)."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from gguf import GGUFReader
    from model_files import rewrite  # gguf-py, as the engine's tests write model files

    source = FIXTURE.replace("Q8_0", "F32")
    fields = GGUFReader(source).fields
    tokens, types = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()
    assert tokens[CALL_TOKENS[0]:CALL_TOKENS[1] + 1] == [f"[PAD{i}]" for i in CALL_TOKENS]
    for token, text in zip(CALL_TOKENS, ("<tool_call>", "</tool_call>")):
        tokens[token], types[token] = text, types[tokens.index("<think>")]
    with open(QWEN3_TEMPLATE) as f:
        template = f.read()
    return rewrite(source, os.path.join(folder, "qwen3-tools.gguf"), values={
        "tokenizer.chat_template": template, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})


def openai_sampling(**overrides) -> dict:
    """What an OpenAI request means in the engine's terms: temperature and top_p only (OpenAI's
    defaults, 1 and 1), the engine's other samplers off. Written from OpenAI's docs, not the sidecar."""
    return {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0,
            "presence_penalty": 0.0, **overrides}


class Sidecar:
    """A `reflex-openai` process on a free port, its engine behind the proxy (engine_proxy.py)."""

    def __init__(self, model: str = FIXTURE, *options: str, env: dict | None = None, wait: bool = True):
        self.dir = tempfile.mkdtemp(prefix="reflex-openai-test-")
        self.log = open(os.path.join(self.dir, "sidecar.log"), "w+b")
        engine_cmd = " ".join([sys.executable, os.path.join(HERE, "engine_proxy.py"), self.dir, "--", *ENGINE])
        argv = [sys.executable, "-m", "reflex_openai", model, "--port", "0", "--device", "cpu",
                "--engine-cmd", engine_cmd, *options]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=self.log, env={**ENGINE_ENV, **(env or {})})
        self.port = int(self._await_log(rb"serving the API on http://[^:]+:(\d+)").group(1))
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=TIMEOUT)
        if wait:
            self.wait_ready()

    def _await_log(self, pattern: bytes):
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if match := re.search(pattern, self.output()):
                return match
            assert self.proc.poll() is None, f"the sidecar exited: {self.output().decode(errors='replace')}"
            time.sleep(0.02)
        raise AssertionError(f"no {pattern!r} in the sidecar's log: {self.output().decode(errors='replace')}")

    def output(self) -> bytes:
        with open(self.log.name, "rb") as f:
            return f.read()

    def wait_ready(self) -> None:
        self.wait_for_health(200)

    def wait_for_health(self, status: int) -> None:
        deadline = time.monotonic() + TIMEOUT
        while (got := self.http.get("/healthz").status_code) != status:
            assert time.monotonic() < deadline, f"/healthz stays {got}, not {status}"
            time.sleep(0.02)

    def engine_pid(self) -> int:
        with open(os.path.join(self.dir, "engine.pid")) as f:
            return int(f.read())

    def stats(self) -> dict:
        with open(os.path.join(self.dir, "stats.json")) as f:
            return json.load(f)

    def lines(self) -> list[dict]:
        """Every line between the sidecar and its engine: {"dir": "in"|"out", "line": ...}."""
        with open(os.path.join(self.dir, "lines.jsonl")) as f:
            return [json.loads(line) for line in f]

    def metric(self, name: str, **labels) -> float:
        text = self.http.get("/metrics").text
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if labels else "") + r" (\S+)"
        match = re.search("^" + pattern + "$", text, re.M)
        return float(match.group(1)) if match else 0.0

    def stop(self) -> int:
        """SIGTERM, as a platform stops a worker; returns the exit status."""
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(TIMEOUT)
        finally:
            self.log.close()


class Reference:
    """`reflex stdio MODEL --device cpu`, spoken to directly: what the engine itself answers."""

    def __init__(self, model: str = FIXTURE, *options: str):
        self.proc = subprocess.Popen([*ENGINE, "stdio", model, "--device", "cpu", *options], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=ENGINE_ENV)
        self._buffer = b""
        self.ready = None  # read on first use, so that several processes can load at once

    def _started(self) -> None:
        if self.ready is None:
            self.ready = self._line()
            assert self.ready["type"] == "ready", self.ready

    def _line(self) -> dict:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            assert select.select([fd], [], [], TIMEOUT)[0], "the reference engine does not answer"
            chunk = os.read(fd, 1 << 16)
            assert chunk, "the reference engine closed its output"
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def generate(self, **request) -> tuple[list[dict], dict]:
        """Streamed: the token lines, then the result line."""
        self._started()
        self.proc.stdin.write(json.dumps({"op": "generate", "stream": True, **request}).encode() + b"\n")
        self.proc.stdin.flush()
        tokens = []
        while (line := self._line())["type"] == "token":
            tokens.append(line)
        assert line["type"] == "result", line
        return tokens, line

    def call(self, **request) -> dict:
        self._started()
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        return self._line()

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(TIMEOUT) == 0


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of a server-sent event stream, JSON-decoded ("[DONE]" kept as is)."""
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events
