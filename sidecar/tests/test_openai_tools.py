"""tools, tool_choice, response_format and chat_template_kwargs through the official OpenAI SDK,
against a sidecar over a real `reflex stdio` child (CPU): the tiny random fixture with Qwen3-0.6B's
own chat template written in (tests/chat_templates/), so that tools, tool messages and
`enable_thinking` reach a real template.

Random weights never choose a tool call, so what a forced one returns is the grammar's work, and
is checked with jsonschema against the function's random `parameters`. The sidecar sends the
messages, tools and template variables for the engine to render; what the engine evaluated is
checked against the template rendered here by plain jinja2 (as transformers renders it) and
tokenized by the reference engine. What the model writes in `auto` is parsed by
chat_output.py: test_openai_parsing.py feeds it random Qwen3 markup through the same server.
"""
import json
import os
import random

import jsonschema
import openai
import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from openai_harness import (CALL_TOKENS, QWEN3_TEMPLATE, TIMEOUT, Reference, Sidecar, openai_sampling, qwen3_model,
                            sse_events, validate)
from random_outputs import random_name, random_parameters, random_tools

NAME = "qwen3-tools"
CTX = ("-c", "2048")  # Qwen3's tool instructions are ~600 of the fixture's byte-sized tokens
SEED = int.from_bytes(os.urandom(4), "little")
USER = [{"role": "user", "content": "What is the weather like?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return qwen3_model(str(tmp_path_factory.mktemp("qwen3-tools")))


@pytest.fixture(scope="module")
def sidecar(model):
    s = Sidecar(model, "--served-model-name", NAME, "--ctx-size", CTX[1])
    yield s
    assert s.stop() == 0
    assert b"Traceback" not in s.output()


@pytest.fixture(scope="module")
def reference(model):
    r = Reference(model, *CTX)
    yield r
    r.close()


@pytest.fixture(scope="module")
def client(sidecar):
    return openai.OpenAI(base_url=sidecar.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def rendered(messages: list[dict], **variables) -> str:
    """Qwen3's template rendered as transformers renders it (its sandbox, options and tojson)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    with open(QWEN3_TEMPLATE) as f:
        return env.from_string(f.read()).render(messages=messages, add_generation_prompt=True, **variables)


def expected_ids(reference, messages, **variables) -> list[int]:
    return reference.call(op="tokenize", text=rendered(messages, **variables), add_bos=False)["tokens"]


def last_request(sidecar) -> dict:
    return [entry["line"] for entry in sidecar.lines() if entry["dir"] == "in"][-1]


def check_rendered(sidecar, reference, messages, tools=None, **variables) -> dict:
    """The last request went to the engine as messages, tools and template variables (no token ids),
    and the engine evaluated what plain jinja2 renders: the reference, given those ids for the
    prompt, answers the same. Returns the request."""
    sent = last_request(sidecar)
    assert "prompt" not in sent and sent.get("tools") == tools and sent.get("chat_template_kwargs", {}) == variables
    result = [e["line"] for e in sidecar.lines() if e["line"].get("op") == "generate"][-1]
    ids = expected_ids(reference, messages, tools=tools, **variables)
    by_ids = {k: v for k, v in sent.items() if k not in ("id", "stream", "messages", "tools", "chat_template_kwargs")}
    _, again = reference.generate(**by_ids, prompt=ids)
    assert (result["usage"]["prompt_tokens"], result["tokens"]) == (len(ids), again["tokens"])
    return sent


def schema_of(tools, name) -> dict:
    return next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)


def check_calls(message, tools) -> list:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schema_of(tools, call.function.name))
    assert len({call.id for call in message.tool_calls}) == len(message.tool_calls)
    return message.tool_calls


def template_view(message) -> dict:
    """An assistant message returned by the API, as a chat template reads it (transformers' form:
    content "" for none, arguments as JSON objects)."""
    return {"role": "assistant", "content": message.content or "",
            "tool_calls": [{"id": c.id, "type": "function",
                            "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                           for c in message.tool_calls]}


# -- tools -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [SEED])
def test_a_required_tool_call_round_trip(client, sidecar, reference, seed):
    rng = random.Random(seed)
    tools = random_tools(rng, rng.randint(1, 3))
    answer = client.chat.completions.create(model=NAME, messages=USER, tools=tools, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=300, seed=seed)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = check_calls(choice.message, tools)
    validate("CreateChatCompletionResponse", answer.model_dump(exclude_unset=True))
    sent = check_rendered(sidecar, reference, USER, tools=tools)
    assert sent["messages"] == USER
    # the markup is written with the model's own tokens for it, not spelled out
    tokens = [entry["line"] for entry in sidecar.lines() if entry["line"].get("type") == "result"][-1]["tokens"]
    assert (tokens[0], tokens[-1]) == CALL_TOKENS

    # the call's result sent back in a tool message: both rendered by the template, and answered
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": random_name(rng)})}
    messages = [*USER, choice.message.model_dump(exclude_none=True), result]
    again = client.chat.completions.create(model=NAME, messages=messages, tools=tools, max_tokens=4, seed=seed)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    sent = check_rendered(sidecar, reference, [*USER, template_view(choice.message), result], tools=tools)
    assert "grammar" not in sent  # auto: the model is free
    assert "<tool_response>" in rendered([*USER, template_view(choice.message), result], tools=tools)


@pytest.mark.parametrize("seed", [SEED + 1])
def test_a_named_tool_call_streams_as_openai_streams_one(client, sidecar, seed):
    rng = random.Random(seed)
    tools = random_tools(rng, rng.randint(2, 4))
    name = rng.choice(tools)["function"]["name"]
    request = dict(model=NAME, messages=USER, tools=tools, tool_choice={"type": "function", "function": {"name": name}},
                   max_tokens=300, seed=seed)
    whole = client.chat.completions.create(**request)
    [call] = check_calls(whole.choices[0].message, tools)
    assert call.function.name == name

    chunks = list(client.chat.completions.create(**request, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    first, *rest = deltas
    assert (first.index, first.type, first.function.name, first.function.arguments) == (0, "function", name, "")
    assert first.id.startswith("call_") and rest
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    assert "".join(d.function.arguments for d in rest) == call.function.arguments  # the same seed, the same call
    assert not any(c.choices[0].delta.content for c in chunks)  # no markup streamed as content
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    raw = sidecar.http.post("/v1/chat/completions", json={**request, "stream": True})
    for event in sse_events(raw)[:-1]:
        validate("CreateChatCompletionStreamResponse", event)


@pytest.mark.parametrize("seed", [SEED + 2])
def test_required_lets_the_model_make_several_calls(client, seed):
    rng = random.Random(seed)
    tools = random_tools(rng, 2)
    for i in range(3):
        answer = client.chat.completions.create(model=NAME, messages=USER, tools=tools, tool_choice="required",
                                                max_tokens=600, seed=seed + i)
        if answer.choices[0].finish_reason != "length":
            check_calls(answer.choices[0].message, tools)
            assert answer.choices[0].finish_reason == "tool_calls"


def test_auto_offers_the_tools_and_none_leaves_them_out(client, sidecar, reference):
    rng = random.Random(SEED + 3)
    tools = random_tools(rng, 2)
    client.chat.completions.create(model=NAME, messages=USER, tools=tools, max_tokens=2, seed=1)
    sent = check_rendered(sidecar, reference, USER, tools=tools)
    assert not {"grammar", "json_schema", "json_object"} & sent.keys()

    answer = client.chat.completions.create(model=NAME, messages=USER, tools=tools, tool_choice="none", max_tokens=3,
                                            seed=2)
    sent = last_request(sidecar)
    assert sent["messages"] == USER and not {"tools", "grammar"} & sent.keys()  # the template gets no tools
    _, result = reference.generate(messages=USER, max_tokens=3, seed=2, **openai_sampling())
    assert answer.choices[0].message.content == result["text"] and not answer.choices[0].message.tool_calls


# -- response_format -------------------------------------------------------------------------------

def content_and_finish(client, request: dict, stream: bool) -> tuple[str, str]:
    """An answer's content and finish_reason, whole or put together from its streamed deltas."""
    if stream:
        chunks = list(client.chat.completions.create(**request, stream=True))
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason
    answer = client.chat.completions.create(**request)
    return answer.choices[0].message.content, answer.choices[0].finish_reason


@pytest.mark.parametrize("seed", [SEED + 4])
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates_and_is_the_engines(client, reference, seed, stream):
    rng = random.Random(seed)
    schema = random_parameters(rng)
    request = dict(model=NAME, messages=USER, max_tokens=300, seed=seed,
                   response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                          "strict": True}})
    content, finish = content_and_finish(client, request, stream)
    assert finish == "stop"
    jsonschema.validate(json.loads(content), schema)
    _, result = reference.generate(messages=USER, json_schema=schema, max_tokens=300, seed=seed, **openai_sampling())
    assert content == result["text"]


def test_json_object_output_is_an_object(client):
    rng = random.Random(SEED + 5)
    for _ in range(20):  # a random model closes an unconstrained object about half the time within 300 tokens
        stream = rng.random() < 0.5
        request = dict(model=NAME, messages=USER, max_tokens=300, seed=rng.randrange(1 << 30),
                       response_format={"type": "json_object"})
        content, finish = content_and_finish(client, request, stream)
        if finish == "stop":
            assert isinstance(json.loads(content), dict)
            return
        assert content.startswith("{")
    pytest.fail("no JSON object was finished in 20 tries")


@pytest.mark.parametrize("seed", [SEED + 6])
def test_auto_with_a_response_format_answers_either_a_call_or_the_json(client, seed):
    rng = random.Random(seed)
    tools, schema = random_tools(rng, 2), random_parameters(rng)
    seen = set()
    for i in range(4):
        answer = client.chat.completions.create(
            model=NAME, messages=USER, tools=tools, max_tokens=300, seed=seed + i,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
        message = answer.choices[0].message
        if message.tool_calls:
            check_calls(message, tools)
            seen.add("call")
        elif answer.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(message.content), schema)
            seen.add("json")
    assert seen


# -- chat_template_kwargs --------------------------------------------------------------------------

def test_chat_template_kwargs_reach_the_template(client, sidecar, reference):
    client.chat.completions.create(model=NAME, messages=USER, max_tokens=2, seed=3,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert check_rendered(sidecar, reference, USER, enable_thinking=False)["messages"] == USER
    assert rendered(USER, enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    assert expected_ids(reference, USER, enable_thinking=False) != expected_ids(reference, USER)


# -- bad requests ----------------------------------------------------------------------------------

FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
BAD = [  # (changes to a good request, param)
    ({"tools": FUNCTION}, "tools"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": [FUNCTION, FUNCTION]}, "tools[1].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [FUNCTION], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [FUNCTION], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [FUNCTION], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [FUNCTION], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "1"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f",
                                                                                          "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": "f"}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": "x", "reasoning_content": 5}]}, "messages[0].reasoning_content"),
]


def check_400(sidecar, changes: dict, param: str) -> dict:
    body = {"model": NAME, "messages": USER, "max_tokens": 2, **changes}
    for stream in (False, True):
        response = sidecar.http.post("/v1/chat/completions", json={**body, "stream": stream})
        assert response.status_code == 400, response.text
        validate("ErrorResponse", response.json())
        error = response.json()["error"]
        assert error["param"] == param and error["message"] and "Traceback" not in response.text
    return error


@pytest.mark.parametrize("changes,param", BAD)
def test_a_bad_tool_or_format_parameter_is_a_400(sidecar, changes, param):
    check_400(sidecar, changes, param)


REFUSED = {"type": "object", "properties": {"a": {"type": "objekt"}}}  # valid JSON, not a schema


@pytest.mark.parametrize("changes,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": REFUSED}}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": REFUSED}}], "tool_choice": "required"},
     "tools"),
])
def test_a_schema_the_engine_refuses_is_a_400(sidecar, changes, param):
    assert check_400(sidecar, changes, param)["code"] == "invalid_constraint"
