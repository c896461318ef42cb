"""The JSON-lines IPC (ipc.py, protocol.py) as `reflex stdio` serves it: the input's bytes are what
arrives on stdin, read in chunks by the Inbox, answered by a Session on a tiny model (the qwen3
golden, CPU, 128 positions; generations capped at 4 tokens so that an input stays fast).

Properties: every line gets exactly one final answer, in order, each a line of JSON valid against
protocol.schema.json (the token lines of a streamed generation too); none is an "internal" error
(a bug the Session caught); the session ends with EXIT_OK when the input ends.
Lines longer than 2 KiB are refused while an input is served (protocol.MAX_LINE_BYTES, 16 MiB in
the engine), so that the overlong path is reached with inputs of fuzzing size.
"""
from __future__ import annotations

import functools
import json
import os
from importlib import resources

import common

with common.instrumented():
    from reflex_engine import ipc, protocol

MAX_LEN = 1 << 13
MODEL = os.path.join(common.ROOT, "tests", "goldens", "qwen3", "qwen3-Q8_0.gguf")
MAX_LINE_BYTES = 2048  # protocol.MAX_LINE_BYTES while an input is served


class _Capped:
    """The model, with every generation capped at 4 tokens."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def generate(self, prompt, **options):
        options["max_tokens"] = min(options.get("max_tokens", 4), 4)
        return self._model.generate(prompt, **options)


@functools.lru_cache(maxsize=None)
def model():
    import reflex_engine

    return _Capped(reflex_engine.load(MODEL, device="cpu", n_ctx=128))


@functools.lru_cache(maxsize=None)
def validator():
    import jsonschema

    schema = json.loads(resources.files("reflex_engine").joinpath("protocol.schema.json").read_text())
    return jsonschema.Draft202012Validator(schema)


def one_input(data: bytes) -> None:
    chunks = [data[i : i + 1000] for i in range(0, len(data), 1000)]
    sent: list[bytes] = []
    limit, protocol.MAX_LINE_BYTES = protocol.MAX_LINE_BYTES, MAX_LINE_BYTES
    try:
        inbox = ipc.Inbox(lambda n: chunks.pop(0) if chunks else b"")
        assert ipc.Session(model(), inbox, sent.append).serve() == ipc.EXIT_OK
    finally:
        protocol.MAX_LINE_BYTES = limit
    parts = data.split(b"\n")
    expected = len(parts) - 1 + (1 if parts[-1] else 0)
    finals = 0
    for raw in sent:
        assert raw.endswith(b"\n") and raw.count(b"\n") == 1, raw
        line = json.loads(raw)
        validator().validate(line)
        assert line.get("code") != "internal", line
        finals += line["type"] != "token"
    assert finals == expected, (finals, expected)


def seeds() -> dict[str, bytes]:
    import random

    from test_ipc import fuzz_lines  # its random lines: bad JSON, wrong types, deep nesting, odd numbers

    valid = [{"op": "ping", "id": 1}, {"op": "info"}, {"op": "tokenize", "text": "h\u00e9llo <|im_end|>", "id": "t"},
             {"op": "detokenize", "ids": [1, 2, 300]}, {"op": "cancel"},
             {"op": "generate", "prompt": "Once", "max_tokens": 2, "stream": True, "top_logprobs": 2, "seed": 1},
             {"op": "generate", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0},
             {"op": "generate", "prompt": [5, 6, 7], "stop": ["a"], "logprobs": True, "temperature": 0.9, "top_k": 20},
             {"op": "system1", "prompt": "The cat", "candidates": [" a", " bc"]}]
    out = {f"valid-{i}": json.dumps(r).encode() + b"\n" for i, r in enumerate(valid)}
    out["all-valid"] = b"".join(out.values())
    lines = fuzz_lines(random.Random(14), 120)
    for i in range(0, len(lines), 6):
        out[f"fuzz-lines-{i}"] = b"\n".join(lines[i : i + 6]) + b"\n"
    out["overlong"] = b'{"op": "tokenize", "text": "' + b"x" * 3000 + b'"}\n{"op": "ping"}'
    out["no-newline"] = b'{"op": "ping"}'
    return out


if __name__ == "__main__":
    common.fuzz(one_input, max_len=MAX_LEN, dictionary="json.dict")
