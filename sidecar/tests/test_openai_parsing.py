"""What a model writes in Qwen3's markup (reasoning in <think>, tool calls in <tool_call>) as the
OpenAI SDK gets it from the sidecar, whole and streamed: `reasoning_content`, `content` and
`tool_calls`. A random-weight model never writes that markup, so the engine here is a script
(scripted_engine.py) that releases random outputs (random_outputs.py) in random pieces.
"""
import json
import os
import random
import sys

import openai
import pytest

from openai_harness import HERE, TIMEOUT, Sidecar, sse_events, validate
from random_outputs import output, random_tools, split, without_tools

NAME = "qwen3-scripted"
USER = [{"role": "user", "content": "What is the weather like?"}]

SEED = int.from_bytes(os.urandom(4), "little")


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scripted")
    script = str(folder / "script.json")
    engine = f"{sys.executable} {os.path.join(HERE, 'scripted_engine.py')} {script}"
    sidecar = Sidecar("scripted.gguf", "--served-model-name", NAME, "--engine-cmd", engine)  # a name the script echoes
    yield sidecar, script
    assert sidecar.stop() == 0
    assert b"Traceback" not in sidecar.output()


def answers(scripted, rng, **request) -> tuple:
    """One random output, answered whole and streamed: (its text, what it means, the whole answer, the stream's chunks)."""
    sidecar, script = scripted
    tools = random_tools(rng, 2)
    text, expected = output(rng, [t["function"]["name"] for t in tools])
    with open(script, "w") as f:
        json.dump(split(rng, text), f)
    client = openai.OpenAI(base_url=sidecar.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    request = {"model": NAME, "messages": USER, "tools": tools, **request}
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True))
    raw = sidecar.http.post("/v1/chat/completions", json=request)
    validate("CreateChatCompletionResponse", raw.json())
    for event in sse_events(sidecar.http.post("/v1/chat/completions", json={**request, "stream": True}))[:-1]:
        validate("CreateChatCompletionStreamResponse", event)
    return text, expected, whole, chunks


def streamed(chunks) -> dict:
    """A stream gathered as the SDKs gather it: text appended, tool calls by index."""
    message = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for chunk in chunks:
        delta = chunk.choices[0].delta
        message["content"] += delta.content or ""
        message["reasoning_content"] += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            if call.id:
                assert call.index not in message["tool_calls"] and call.function.arguments == ""
                message["tool_calls"][call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            else:
                message["tool_calls"][call.index]["arguments"] += call.function.arguments
    assert sorted(message["tool_calls"]) == list(range(len(message["tool_calls"])))
    return message


@pytest.mark.parametrize("seed", [SEED + i for i in range(6)])
def test_auto_returns_reasoning_content_and_tool_calls(scripted, seed):
    rng = random.Random(seed)
    text, expected, whole, chunks = answers(scripted, rng)
    message, choice = whole.choices[0].message, whole.choices[0]
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]
    assert calls == expected["calls"]
    assert message.content == expected["content"]
    assert getattr(message, "reasoning_content", None) == expected["reasoning"]
    assert choice.finish_reason == ("tool_calls" if calls else "stop")

    gathered = streamed(chunks)
    assert [{k: c[k] for k in ("name", "arguments")} for c in gathered["tool_calls"].values()] == expected["calls"]
    assert gathered["content"] == (expected["content"] or "")
    assert gathered["reasoning_content"] == (expected["reasoning"] or "")
    for field in ("content", "reasoning_content"):  # each apart: content ending "<think" before reasoning ">..." is no tag
        assert "<tool_call>" not in gathered[field] and "<think>" not in gathered[field]
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


@pytest.mark.parametrize("seed", [SEED + 100 + i for i in range(3)])
def test_with_tool_choice_none_the_markup_is_content(scripted, seed):
    rng = random.Random(seed)
    text, expected, whole, chunks = answers(scripted, rng, tool_choice="none")
    assert whole.choices[0].message.content == without_tools(text, expected)
    assert not whole.choices[0].message.tool_calls and whole.choices[0].finish_reason == "stop"
    assert streamed(chunks)["content"] == without_tools(text, expected)
