"""The OpenAI sidecar's request parsing (sidecar/src/reflex_openai/api.py): a request body from the
fuzzer (JSON; the first byte picks /v1/chat/completions or /v1/completions), parsed as the server
parses it. Properties: the parser returns a Call or raises APIError with a 400, nothing else; and
the engine request a Call holds is one the engine's protocol accepts (protocol.parse), as the
server sends it (streamed, with an id).
"""
from __future__ import annotations

import json
import os
import sys

import common

sys.path.insert(0, os.path.join(common.ROOT, "sidecar", "src"))  # the sidecar is its own package

with common.instrumented():
    from reflex_engine import protocol
    from reflex_openai import api

MAX_LEN = 1 << 12
DEFAULTS = api.Defaults()


def one_input(data: bytes) -> None:
    kind, body = (data[0] & 1, data[1:]) if data else (0, b"")
    try:
        body = json.loads(body)
    except (ValueError, RecursionError):
        return  # the server answers a body that is not JSON before parsing it
    if not isinstance(body, dict):
        return  # likewise a body that is not an object
    parse = api.parse_chat if kind == 0 else api.parse_completion
    try:
        call = parse(body, DEFAULTS)
    except api.APIError as e:
        assert e.status == 400 and isinstance(e.message, str) and json.dumps(e.body()), e.body()
        return
    line = json.dumps({**call.request, "stream": True, "id": 1}, allow_nan=False).encode()
    try:
        request = protocol.parse(line)
    except protocol.ProtocolError as e:
        raise AssertionError(f"the sidecar accepted {body!r} but the engine refuses {line!r}: {e}") from None
    assert request.op == "generate" and call.kind in ("chat", "completion")


def seeds() -> dict[str, bytes]:
    chat = {"model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    bodies = {
        "chat": (0, chat),
        "chat-all": (0, {**chat, "stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 5,
                         "temperature": 0.5, "top_p": 0.9, "stop": ["x", "y"], "seed": 3, "logprobs": True,
                         "top_logprobs": 2, "presence_penalty": 0.1, "top_k": 40, "min_p": 0.05,
                         "repetition_penalty": 1.1, "ignore_eos": True, "user": "u", "n": 1}),
        "chat-parts": (0, {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
        "chat-tools": (0, {**chat, "tools": [{"type": "function"}], "tool_choice": "auto"}),
        "completion": (1, {"model": "m", "prompt": "Once upon", "max_tokens": 3, "logprobs": 2, "echo": False}),
        "completion-ids": (1, {"model": "m", "prompt": [[1, 2, 3]], "temperature": 0, "stop": "\n"}),
        "completion-big-int": (1, {"model": "m", "prompt": "x", "temperature": 10 ** 30}),
    }
    return {name: bytes([kind]) + json.dumps(body).encode() for name, (kind, body) in bodies.items()}


if __name__ == "__main__":
    common.fuzz(one_input, max_len=MAX_LEN, dictionary="json.dict")
