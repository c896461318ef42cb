"""The endpoints, driven by the official OpenAI SDK (sync, async, streaming), curl and raw malformed
requests, against one sidecar over a real `reflex stdio` child (CPU, tiny fixture model). What
the sidecar answers is compared with what the engine itself answers over stdio for the same
request, and every body with the schemas of OpenAI's published OpenAPI spec."""
import asyncio
import json
import shutil
import socket
import subprocess

import httpx
import openai
import pytest

from openai_harness import FIXTURE, TIMEOUT, Reference, Sidecar, openai_sampling, sse_events, validate

MODEL = FIXTURE  # the served name defaults to MODEL as given
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # the engine's reasons in OpenAI's words
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def sidecar():
    s = Sidecar()
    yield s
    assert s.stop() == 0
    assert b"Traceback" not in s.output()


@pytest.fixture(scope="module")
def reference():
    r = Reference()
    yield r
    r.close()


@pytest.fixture(scope="module")
def client(sidecar):
    return openai.OpenAI(base_url=sidecar.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def text_of(tokens) -> str:
    return "".join(t["text"] for t in tokens)


# -- chat ------------------------------------------------------------------------------------------


def test_chat_equals_the_engine_for_the_same_seed(client, reference):
    completion = client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=5, temperature=0.9, top_p=0.8,
                                                max_tokens=12, stop=["zz"])
    tokens, result = reference.generate(messages=MESSAGES, seed=5, max_tokens=12, stop=["zz"],
                                        **openai_sampling(temperature=0.9, top_p=0.8))
    choice = completion.choices[0]
    assert choice.message.content == result["text"] and choice.message.role == "assistant"
    assert choice.finish_reason == FINISH[result["finish_reason"]]
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (
        result["usage"]["prompt_tokens"], result["usage"]["completion_tokens"])
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    assert completion.model == MODEL and completion.object == "chat.completion"


def test_chat_defaults_are_openais(client, reference):
    """No sampling parameters: temperature 1, top_p 1, nothing else; a developer message is a system one."""
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    completion = client.chat.completions.create(model=MODEL, messages=messages, seed=9, max_completion_tokens=10)
    _, result = reference.generate(messages=[{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Hello\nthere"}],
                                   seed=9, max_tokens=10, **openai_sampling())
    assert completion.choices[0].message.content == result["text"]


def test_raw_chat_bodies_match_openais_schemas(sidecar):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "seed": 1, "logprobs": True, "top_logprobs": 2}
    response = sidecar.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    validate("CreateChatCompletionResponse", response.json())
    stream = sidecar.http.post("/v1/chat/completions", json={**body, "stream": True,
                                                             "stream_options": {"include_usage": True}})
    assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
    events = sse_events(stream)
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        validate("CreateChatCompletionStreamResponse", event)
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 6
    assert all(e["usage"] is None for e in events[:-2])
    assert len({e["id"] for e in events[:-1]}) == 1


def test_async_streaming_equals_the_engine(sidecar, reference):
    async def stream():
        async with openai.AsyncOpenAI(base_url=sidecar.url + "/v1", api_key="unused", max_retries=0) as client:
            chunks = await client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=3, temperature=0.7,
                                                          max_tokens=16, stream=True,
                                                          stream_options={"include_usage": True})
            return [chunk async for chunk in chunks]

    chunks = asyncio.run(stream())
    tokens, result = reference.generate(messages=MESSAGES, seed=3, max_tokens=16, **openai_sampling(temperature=0.7))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == result["text"]
    assert pieces == [t["text"] for t in tokens if t["text"]]  # streamed as the engine released it
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == FINISH[result["finish_reason"]]
    assert chunks[-1].usage.completion_tokens == result["usage"]["completion_tokens"]


def test_sync_stream_with_the_sdk(client, reference):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=4, max_tokens=8, stream=True))
    _, result = reference.generate(messages=MESSAGES, seed=4, max_tokens=8, **openai_sampling())
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == result["text"]
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_are_the_engines(client, reference, stream):
    kwargs = dict(model=MODEL, messages=MESSAGES, seed=8, temperature=1.2, max_tokens=10, logprobs=True, top_logprobs=3)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        content = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    else:
        content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    tokens, result = reference.generate(messages=MESSAGES, seed=8, max_tokens=10, logprobs=True, top_logprobs=3,
                                        **openai_sampling(temperature=1.2))
    steps = [t for t in tokens if t["token"] is not None]
    assert [e.logprob for e in content] == [t["logprob"] for t in steps]
    pieces = [reference.call(op="detokenize", ids=[t["token"]])["text"] for t in steps]
    assert [e.token for e in content] == pieces
    assert [e.bytes for e in content] == [list(p.encode()) for p in pieces]
    assert [[(t.token, t.logprob) for t in e.top_logprobs] for e in content] == [
        [(t["text"], t["logprob"]) for t in step["top_logprobs"]] for step in steps]


def test_no_logprobs_unless_asked(client):
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices[0].logprobs is None


# -- legacy completions and models -----------------------------------------------------------------


def test_completion_equals_the_engine(client, reference, sidecar):
    for prompt in ("The cat sat on", reference.call(op="tokenize", text="The cat")["tokens"]):
        completion = client.completions.create(model=MODEL, prompt=prompt, seed=2, max_tokens=9, temperature=0.8,
                                               logprobs=2)
        tokens, result = reference.generate(prompt=prompt, seed=2, max_tokens=9, logprobs=True, top_logprobs=2,
                                            **openai_sampling(temperature=0.8))
        choice = completion.choices[0]
        assert choice.text == result["text"]
        assert completion.usage.completion_tokens == result["usage"]["completion_tokens"]
        steps = [t for t in tokens if t["token"] is not None]
        assert choice.logprobs.token_logprobs == [t["logprob"] for t in steps]
        pieces = [reference.call(op="detokenize", ids=[t["token"]])["text"] for t in steps]
        assert choice.logprobs.tokens == pieces
        assert choice.logprobs.text_offset == [sum(map(len, pieces[:i])) for i in range(len(pieces))]
    # OpenAI's legacy default is 16 tokens
    assert client.completions.create(model=MODEL, prompt="Once", temperature=0).usage.completion_tokens <= 16
    raw = sidecar.http.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 3})
    validate("CreateCompletionResponse", raw.json())


def test_completion_stream(client, reference, sidecar):
    chunks = list(client.completions.create(model=MODEL, prompt=["Once upon"], seed=6, max_tokens=7, stream=True,
                                            stream_options={"include_usage": True}))
    _, result = reference.generate(prompt="Once upon", seed=6, max_tokens=7, **openai_sampling())
    assert "".join(c.choices[0].text for c in chunks if c.choices) == result["text"]
    assert chunks[-1].usage.completion_tokens == result["usage"]["completion_tokens"]
    raw = sidecar.http.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 3, "stream": True})
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    # The spec says streamed and whole completions share one shape; but OpenAI's own streams carry
    # "finish_reason": null until the last chunk, which that shape does not allow. All else must fit.
    *pieces, last = events[:-1]
    for event in pieces:
        assert event["choices"][0]["finish_reason"] is None
        validate("CreateCompletionResponse", {**event, "choices": [{**event["choices"][0], "finish_reason": "stop"}]})
    validate("CreateCompletionResponse", last)


def test_models(client, sidecar):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    validate("ListModelsResponse", sidecar.http.get("/v1/models").json())
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.code == "model_not_found"


def test_an_unknown_model_is_a_404(client, sidecar):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    validate("ErrorResponse", e.value.response.json())


# -- curl --------------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_curl(sidecar, reference):
    def curl(*args):
        return subprocess.run(["curl", "-sS", "--max-time", str(TIMEOUT), *args], capture_output=True, text=True,
                              check=True).stdout

    body = {"model": MODEL, "messages": MESSAGES, "seed": 12, "max_tokens": 6}
    answer = json.loads(curl(sidecar.url + "/v1/chat/completions", "-H", "Content-Type: application/json",
                             "-d", json.dumps(body)))
    _, result = reference.generate(messages=MESSAGES, seed=12, max_tokens=6, **openai_sampling())
    assert answer["choices"][0]["message"]["content"] == result["text"]
    streamed = curl("-N", sidecar.url + "/v1/chat/completions", "-d", json.dumps({**body, "stream": True}))
    events = [json.loads(block[6:]) for block in streamed.split("\n\n") if block.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == result["text"]
    assert streamed.rstrip().endswith("data: [DONE]")
    status = curl("-o", "/dev/null", "-w", "%{http_code}", sidecar.url + "/v1/chat/completions", "-d", "{oops")
    assert status == "400"


# -- malformed requests ----------------------------------------------------------------------------

GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_BODIES = [  # (raw body, param the error names)
    (b"{oops", None),
    (b"", None),
    (b"[1, 2]", None),
    (b'"just a string"', None),
    (b'{"model": "m", "messages": [], "temperature": NaN}', None),
    (b"\xff\xfe{}", None),
    (b"[" * 50_000, None),
    (json.dumps({**GOOD, "max_tokens": 1e999}).encode().replace(b"Infinity", b"1e999"), None),
]
BAD_FIELDS = [  # (changes to a good request, param)
    ({"model": None}, "model"),
    ({"model": 3}, "model"),
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi", "audio": {"id": "x"}}]}, "messages[0].audio"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"seed": 1.5}, "seed"),
    ({"seed": -3}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"n": 2}, "n"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"temprature": 0.5}, "temprature"),
    ({"top_k": 1.5}, "top_k"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"temperature": 10 ** 400}, "temperature"),  # found by fuzz/fuzz_openai.py: was OverflowError, a 500
]


def check_error(response: httpx.Response, status: int, param=None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    validate("ErrorResponse", body)
    assert "Traceback" not in response.text and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


@pytest.mark.parametrize("raw,param", BAD_BODIES)
def test_a_malformed_body_is_a_400(sidecar, raw, param):
    check_error(sidecar.http.post("/v1/chat/completions", content=raw), 400, param)
    check_error(sidecar.http.post("/v1/completions", content=raw), 400, param)


@pytest.mark.parametrize("changes,param", BAD_FIELDS)
def test_a_bad_or_unsupported_parameter_is_a_400(sidecar, changes, param):
    error = check_error(sidecar.http.post("/v1/chat/completions", json={**GOOD, **changes}), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("changes,param", [
    ({"prompt": None}, "prompt"), ({"prompt": 5}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, "x"]}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [True]}, "prompt"),
    ({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of"), ({"logprobs": 6}, "logprobs"),
    ({"logprobs": True}, "logprobs"), ({"messages": []}, "messages"), ({"prompt": [10**9]}, None), ({"prompt": ""}, None),
])
def test_a_bad_completion_request_is_a_400(sidecar, changes, param):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **changes}
    check_error(sidecar.http.post("/v1/completions", json={k: v for k, v in body.items()}), 400, param)


def test_neutral_values_of_unsupported_parameters_are_accepted(client):
    completion = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, n=1, frequency_penalty=0,
                                                logit_bias={}, tools=None, store=False, user="someone",
                                                response_format={"type": "text"}, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 2


def test_too_long_a_prompt_is_context_length_exceeded(sidecar, client):
    messages = [{"role": "user", "content": " ".join(["word"] * 600)}]  # the fixture's context is 512 tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    stream = sidecar.http.post("/v1/chat/completions", json={**GOOD, "messages": messages, "stream": True})
    assert check_error(stream, 400)["code"] == "context_length_exceeded"  # a stream that cannot start is a 400 too


def test_unknown_routes_and_methods_answer_in_openais_format(sidecar):
    assert check_error(sidecar.http.get("/v1/nothing"), 404)["code"] == "not_found"
    assert check_error(sidecar.http.get("/v1/chat/completions"), 405)["code"] == "method_not_allowed"
    assert check_error(sidecar.http.post("/v1/embeddings", json={}), 404)


def test_garbage_on_the_socket_does_not_hurt(sidecar, client):
    for garbage in (b"\x00\x01\x02 nonsense\r\n\r\n", b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 9\r\n\r\n{",
                    b"GET / HTTP/9.9\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", sidecar.port), timeout=TIMEOUT) as conn:
            conn.sendall(garbage)
            conn.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := conn.recv(65536):
                reply += chunk
        assert b"Traceback" not in reply and not reply.startswith(b"HTTP/1.1 5")
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 1


# -- many clients, one engine --------------------------------------------------------------------


def test_64_concurrent_streams_each_get_their_own_tokens(sidecar, reference):
    """The front door takes them all (the queue holds 64); the engine is sent one request at a time."""
    async def one(client, i):
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"client {i}"}],
                                                      seed=1000 + i, max_tokens=8, stream=True)
        chunks = [chunk async for chunk in stream]
        assert len({c.id for c in chunks}) == 1
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    async def everyone():
        async with openai.AsyncOpenAI(base_url=sidecar.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=TIMEOUT) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    before = sidecar.stats()
    texts = asyncio.run(everyone())
    expected = [reference.generate(messages=[{"role": "user", "content": f"client {i}"}], seed=1000 + i, max_tokens=8,
                                   **openai_sampling())[1]["text"] for i in range(64)]
    assert texts == expected
    after = sidecar.stats()
    assert after["requests"] - before["requests"] >= 64
    assert after["overlapping"] == 0 and after["max_in_flight"] == 1 and after["misrouted"] == 0
    assert sidecar.metric("reflex_openai_queue_depth") == 0


def test_metrics(sidecar, client):
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert sidecar.metric("reflex_openai_requests_total", endpoint="/v1/chat/completions", status="200") >= 1
    assert sidecar.metric("reflex_openai_requests_total", endpoint="/v1/chat/completions", status="400") >= 1
    assert sidecar.metric("reflex_openai_time_to_first_token_seconds_count") >= 1
    assert sidecar.metric("reflex_openai_tokens_per_second_count") >= 1
    assert sidecar.metric("reflex_openai_generated_tokens_total") >= 3
    assert sidecar.metric("reflex_openai_engine_ready") == 1
