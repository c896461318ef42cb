"""`reflex stdio` and `reflex uds` driven by a scripted client, on the CPU and a tiny fixture model:
every op, every error code a request can cause, cancel, sequencing, EOF, a socket served one
connection at a time, a lost device, and 10,000 fuzzed lines. Every line the engine writes is
checked against the schema shipped in the package; answers are compared with the Python API's.
The API additions the protocol stands on (logprobs, cancel, chat messages and what their template
is given besides them) are tested first."""
import itertools
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from importlib import resources

import jsonschema
import numpy as np
import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

import reflex_engine
from reflex_engine import protocol
from reflex_engine.chat import OWN_PARAMETERS
from reflex_engine.errors import ReflexError
from reflex_engine.sampling import SamplingParams

from model_files import GOLDEN_QWEN3, rewrite

MODEL = os.path.join(os.path.dirname(__file__), "goldens", "qwen3", "qwen3-Q8_0.gguf")  # has a chat template
ENGINE = [sys.executable, "-m", "reflex_engine"]
SCHEMA = json.loads(resources.files("reflex_engine").joinpath("protocol.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
TIMEOUT = 60  # seconds an answer may take before the test fails instead of hanging
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
SAMPLED = dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, repeat_penalty=1.3, presence_penalty=0.2, seed=11)
# a real template that reads tools and enable_thinking, and refuses some conversations (raise_exception)
QWEN35_TEMPLATE = os.path.join(os.path.dirname(__file__), "chat_templates", "Qwen3.5-4B.jinja")
TEMPLATE_CTX = 2048  # its tool instructions are ~1,200 of the fixture's byte-sized tokens
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now — in °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
NO_THINKING = {"enable_thinking": False}
# what generate and system1 give the template besides the messages, each changing what it renders
TEMPLATE_INPUTS = [{"tools": TOOLS}, {"chat_template_kwargs": NO_THINKING},
                   {"tools": TOOLS, "chat_template_kwargs": NO_THINKING}]


def checked(raw: bytes) -> dict:
    """One line the engine wrote: JSON, valid against the shipped schema."""
    line = json.loads(raw)
    VALIDATOR.validate(line)
    return line


@pytest.fixture(scope="module")
def model():
    return reflex_engine.load(MODEL, device="cpu")


def log_softmax(rows):
    rows = rows.astype(np.float64)
    top = rows.max(axis=-1, keepdims=True)
    return rows - top - np.log(np.exp(rows - top).sum(axis=-1, keepdims=True))


# -- the Python API ------------------------------------------------------------------------------


def test_logprobs_are_the_models_own_before_penalties_and_filters(model):
    prompt = model.tokenize("The cat sat on")
    gen = model.generate(prompt, max_tokens=6, sampling=SamplingParams(**SAMPLED), top_logprobs=5, ignore_eos=True)
    events = [e for e in gen if e.id is not None]
    assert [e.id for e in events] == gen.tokens and len(events) == 6
    # a fresh prefill over the same tokens: the reference the decode loop's numbers must match
    expected = log_softmax(model.logits(prompt + gen.tokens[:-1])[len(prompt) - 1 :])
    for e, row in zip(events, expected):
        assert e.logprob == pytest.approx(row[e.id], abs=1e-4)
        top = np.argsort(-row, kind="stable")[:5]
        assert [t.token for t in e.top_logprobs] == top.tolist()
        np.testing.assert_allclose([t.logprob for t in e.top_logprobs], row[top], atol=1e-4)
        pieces = [model.tokenizer.token_bytes(int(t)).decode("utf-8", "replace") for t in top]
        assert [t.text for t in e.top_logprobs] == pieces
    plain = model.generate(prompt, max_tokens=6, sampling=SamplingParams(**SAMPLED), ignore_eos=True)
    assert all(e.logprob is None for e in plain) and plain.tokens == gen.tokens  # scoring changes no choice
    only_logprob = next(iter(model.generate(prompt, max_tokens=1, logprobs=True)))
    assert only_logprob.logprob is not None and only_logprob.top_logprobs is None


def test_cancel_ends_at_the_next_token_boundary(model):
    gen = model.generate("Once", max_tokens=100, ignore_eos=True)
    for i, _ in enumerate(gen):
        if i == 2:
            gen.cancel()
    assert gen.finish_reason == "cancelled" and len(gen.tokens) == 3


def test_chat_messages_are_a_prompt(model):
    greedy = SamplingParams(temperature=0)
    rendered = model.tokenize(model.file.render_chat(MESSAGES), add_bos=False)
    gen = model.generate(MESSAGES, max_tokens=5, sampling=greedy, ignore_eos=True)
    list(gen)
    by_ids = model.generate(rendered, max_tokens=5, sampling=greedy, ignore_eos=True)
    list(by_ids)
    assert gen.prompt_tokens == len(rendered) and gen.tokens == by_ids.tokens
    assert model.system1(MESSAGES, ["a", "b"]).candidates == model.system1(rendered, ["a", "b"]).candidates


@pytest.fixture(scope="module")
def templated(tmp_path_factory) -> str:
    """The fixture (F32: gguf-py writes float tensors only) with Qwen3.5's chat template."""
    with open(QWEN35_TEMPLATE) as f:
        values = {"tokenizer.chat_template": f.read()}
    return rewrite(GOLDEN_QWEN3, str(tmp_path_factory.mktemp("templated") / "qwen3-templated.gguf"), values=values)


@pytest.fixture(scope="module")
def templated_model(templated):
    return reflex_engine.load(templated, device="cpu", n_ctx=TEMPLATE_CTX)


def plain_jinja_ids(model, tools=None, chat_template_kwargs=None) -> list[int]:
    """MESSAGES in Qwen3.5's template, rendered by plain jinja2 as transformers renders it (its
    sandbox, options and tojson), tokenized as the engine tokenizes a rendered chat (no BOS)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    with open(QWEN35_TEMPLATE) as f:
        text = env.from_string(f.read()).render(messages=MESSAGES, tools=tools, add_generation_prompt=True,
                                                **(chat_template_kwargs or {}))
    return model.tokenize(text, add_bos=False)


def test_tools_and_template_variables_reach_the_chat_template(templated_model):
    model, greedy = templated_model, SamplingParams(temperature=0)
    for inputs in TEMPLATE_INPUTS:
        ids = plain_jinja_ids(model, **inputs)
        assert ids != plain_jinja_ids(model)  # so a generate that ignored them would fail below
        rendered = model.file.render_chat(MESSAGES, tools=inputs.get("tools"), **inputs.get("chat_template_kwargs", {}))
        assert model.tokenize(rendered, add_bos=False) == ids
        gen = model.generate(MESSAGES, max_tokens=3, sampling=greedy, logprobs=True, **inputs)
        by_ids = model.generate(ids, max_tokens=3, sampling=greedy, logprobs=True)
        assert [(e.id, e.logprob) for e in gen] == [(e.id, e.logprob) for e in by_ids]
        assert gen.prompt_tokens == len(ids)
        assert model.system1(MESSAGES, ["a", "b"], **inputs).candidates == model.system1(ids, ["a", "b"]).candidates


def test_tools_and_template_variables_go_with_messages_and_set_no_name_of_render_chats(templated_model):
    refused = [("Hi", {"tools": TOOLS}, "tools"), ([5, 6], {"chat_template_kwargs": {}}, "chat_template_kwargs"),
               *((MESSAGES, {"chat_template_kwargs": {name: False}}, "chat_template_kwargs") for name in OWN_PARAMETERS)]
    for prompt, inputs, field in refused:
        for run in (lambda: templated_model.generate(prompt, **inputs), lambda: templated_model.system1(prompt, ["a"], **inputs)):
            with pytest.raises(ReflexError) as e:
                run()
            assert e.value.field == field and field in str(e.value)
    with pytest.raises(ReflexError, match="System message must be at the beginning"):  # the template's own refusal
        templated_model.generate(MESSAGES[::-1], tools=TOOLS)


def test_held_back_text_is_released_by_an_event_without_a_token(model):
    greedy = dict(max_tokens=8, sampling=SamplingParams(temperature=0), ignore_eos=True)
    text = model.generate("Once", **greedy)
    list(text)
    gen = model.generate("Once", stop=[text.text[-1] + "\u0001"], **greedy)  # a stop string never completed
    events = list(gen)
    assert events[-1].id is None and events[-1].text.endswith(text.text[-1])
    assert "".join(e.text for e in events) == gen.text == text.text and gen.finish_reason == "length"


# -- a scripted client ---------------------------------------------------------------------------


class Peer:
    """The client's end: writes request lines, reads the engine's lines (each checked)."""

    def __init__(self, write, read, fileno: int):
        self._write, self._read, self._fileno, self._buffer = write, read, fileno, b""

    def send(self, *requests):
        """Requests (dicts, or raw bytes for a line as is), written at once."""
        self._write(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in requests))

    def line(self, timeout: float = TIMEOUT) -> dict | None:
        """The next line; None if none comes within `timeout`."""
        while b"\n" not in self._buffer:
            if not select.select([self._fileno], [], [], timeout)[0]:
                return None
            chunk = self._read(1 << 16)
            assert chunk, "the engine closed its output"
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\n", 1)
        return checked(raw)

    def answer(self) -> tuple[list[dict], dict]:
        """A request's token lines and its final line."""
        tokens = []
        while (line := self.line())["type"] == "token":
            tokens.append(line)
        return tokens, line

    def call(self, **request) -> dict:
        self.send(request)
        tokens, final = self.answer()
        assert not tokens or request.get("stream")
        return final


def start(*args, stdin=subprocess.PIPE):
    """A `reflex` process; its stderr goes to a file, which cannot fill up and block it as a pipe can."""
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([*ENGINE, *args], stdin=stdin, stdout=subprocess.PIPE, stderr=log)
    proc.log = log
    return proc, Peer(lambda data: (proc.stdin.write(data), proc.stdin.flush()), lambda n: os.read(proc.stdout.fileno(), n),
                      proc.stdout.fileno())


def stderr_of(proc) -> bytes:
    proc.log.seek(0)
    return proc.log.read()


def start_stdio(*options):
    return start("stdio", MODEL, "--device", "cpu", *options)


@pytest.fixture(scope="module")
def stdio():
    proc, peer = start_stdio()
    ready = peer.line()
    assert ready["type"] == "ready"
    yield peer
    proc.stdin.close()
    assert proc.wait(TIMEOUT) == 0
    assert b"Traceback" not in stderr_of(proc)


def test_ready_and_info_describe_the_model():
    proc, peer = start_stdio("-c", "256")
    ready = peer.line()
    assert ready["type"] == "ready"
    model_fields = {k: v for k, v in ready.items() if k not in ("type", "timings")}
    assert model_fields == {"protocol_version": protocol.PROTOCOL_VERSION, "engine_version": reflex_engine.__version__,
                            "model": MODEL, "architecture": "qwen3", "device": "cpu", "n_ctx": 256, "n_vocab": 384,
                            "chat_template": True}
    assert {"gguf_open_ms", "model_load_ms", "ready_ms"} <= set(ready["timings"])
    info = peer.call(op="info", id="i")
    assert {k: v for k, v in info.items() if k not in ("type", "id", "op")} == model_fields
    proc.stdin.close()
    assert proc.wait(TIMEOUT) == 0


def test_every_op_answers_as_the_python_api(stdio, model):
    assert stdio.call(op="ping", id=7) == {"type": "pong", "id": 7}
    text = "Hello <|im_end|> world"
    assert stdio.call(op="tokenize", id="t", text=text)["tokens"] == model.tokenize(text)
    plain = stdio.call(op="tokenize", text=text, parse_special=False, add_bos=True)
    assert plain["tokens"] == model.tokenize(text, add_bos=True, parse_special=False)
    ids = model.tokenize(text)
    assert stdio.call(op="detokenize", ids=ids) == {"type": "result", "id": None, "op": "detokenize",
                                                    "text": model.detokenize(ids)}
    assert stdio.call(op="cancel", id="c") == {"type": "result", "id": "c", "op": "cancel"}

    for prompt in ({"prompt": "The cat sat on"}, {"prompt": model.tokenize("The cat")}, {"messages": MESSAGES}):
        answer = stdio.call(op="generate", id="g", max_tokens=8, top_logprobs=3, stop=["zz"], **SAMPLED, **prompt)
        gen = model.generate(next(iter(prompt.values())), max_tokens=8, sampling=SamplingParams(**SAMPLED), stop=["zz"],
                             top_logprobs=3)
        events = [e for e in gen if e.id is not None]
        assert (answer["text"], answer["tokens"], answer["finish_reason"]) == (gen.text, gen.tokens, gen.finish_reason)
        assert answer["usage"] == {"prompt_tokens": gen.prompt_tokens, "cached_tokens": 0, "completion_tokens": len(gen.tokens)}
        assert [entry["logprob"] for entry in answer["logprobs"]] == [e.logprob for e in events]
        assert [entry["top_logprobs"] for entry in answer["logprobs"]] == [
            [t._asdict() for t in e.top_logprobs] for e in events]
        assert {"prompt_eval_ms", "first_token_ms", "total_ms"} <= set(answer["timings"])

    candidates = [" mat", " dog", " the moon"]
    answer = stdio.call(op="system1", id=1, prompt="The cat sat on", candidates=candidates)
    result = model.system1("The cat sat on", candidates)
    assert answer["candidates"] == [c._asdict() for c in result.candidates]
    assert (answer["best"], answer["entropy"]) == (result.best, result.entropy)
    assert answer["usage"] == {"prompt_tokens": result.prompt_tokens, "cached_tokens": 0}
    assert stdio.call(op="system1", messages=MESSAGES, candidates=candidates)["candidates"] == [
        c._asdict() for c in model.system1(MESSAGES, candidates).candidates]


def test_tools_and_template_variables_render_as_the_python_api(templated, templated_model):
    proc, peer = start("stdio", templated, "--device", "cpu", "-c", str(TEMPLATE_CTX))
    assert peer.line()["type"] == "ready"
    model, greedy = templated_model, SamplingParams(temperature=0)
    for inputs in TEMPLATE_INPUTS:
        ids = plain_jinja_ids(model, **inputs)
        answer = peer.call(op="generate", messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True, **inputs)
        gen = model.generate(ids, max_tokens=3, sampling=greedy, logprobs=True)
        logprobs = [e.logprob for e in gen if e.id is not None]
        assert (answer["tokens"], [entry["logprob"] for entry in answer["logprobs"]]) == (gen.tokens, logprobs)
        assert answer["usage"]["prompt_tokens"] == len(ids)
        scored = peer.call(op="system1", messages=MESSAGES, candidates=["a", "b"], **inputs)
        assert scored["candidates"] == [c._asdict() for c in model.system1(ids, ["a", "b"]).candidates]
    refused = peer.call(op="generate", id="r", messages=MESSAGES[::-1], tools=TOOLS)  # raise_exception in the template
    assert (refused["code"], refused["id"]) == ("invalid_request", "r")
    assert "System message must be at the beginning" in refused["message"]
    proc.stdin.close()
    assert proc.wait(TIMEOUT) == 0
    assert b"Traceback" not in stderr_of(proc)


def test_streamed_tokens_add_up_to_the_result(stdio, model):
    stdio.send({"op": "generate", "id": "s", "prompt": "Once", "max_tokens": 12, "stream": True, "logprobs": True,
                **SAMPLED})
    tokens, result = stdio.answer()
    assert all(t["id"] == "s" for t in tokens) and result["id"] == "s"
    assert "".join(t["text"] for t in tokens) == result["text"]
    assert [t["token"] for t in tokens if t["token"] is not None] == result["tokens"]
    assert all("logprob" in t for t in tokens if t["token"] is not None) and "logprobs" not in result
    gen = model.generate("Once", max_tokens=12, sampling=SamplingParams(**SAMPLED), logprobs=True)
    assert [t["logprob"] for t in tokens if t["token"] is not None] == [e.logprob for e in gen if e.id is not None]


OVER_CONTEXT = " ".join(["word"] * 600)  # more tokens than the fixture's 512-token context
ERRORS = [  # (line, code, field)
    (b"not json", "invalid_json", None),
    (b'{"op": "ping"', "invalid_json", None),
    (b'{"op": "ping", "id": \xff}', "invalid_json", None),
    (b'{"op": "generate", "prompt": "x", "temperature": NaN}', "invalid_json", None),
    (b"[" * 100_000, "invalid_json", None),
    (b'{"op": "ping", "id": ' + b"9" * 5000 + b"}", "invalid_json", None),
    (b"", "invalid_json", None),
    (b"[1, 2]", "invalid_request", None),
    (b'{"id": 1}', "invalid_request", None),
    (b'{"op": "generate", "prompt": "x", "messages": []}', "invalid_request", None),
    (b'{"op": "generate"}', "invalid_request", None),
    (b'{"op": "system1", "prompt": "x"}', "invalid_request", "candidates"),
    (b'{"op": "tokenize"}', "invalid_request", "text"),
    (b'{"op": "generate", "prompt": "x", "temperature": 1e999}', "invalid_request", "temperature"),
    (b'{"op": "generate", "prompt": "x", "temperature": -1}', "invalid_request", None),
    (b'{"op": "generate", "prompt": "x", "top_p": 0}', "invalid_request", None),
    (b'{"op": "generate", "prompt": "x", "seed": -3}', "invalid_request", None),
    (b'{"op": "generate", "prompt": "x", "max_tokens": 0}', "invalid_request", None),
    (b'{"op": "generate", "prompt": "x", "top_logprobs": 21}', "invalid_request", None),
    (b'{"op": "generate", "prompt": "x", "stop": [""]}', "invalid_request", None),
    (b'{"op": "generate", "prompt": ""}', "invalid_request", None),
    (b'{"op": "generate", "prompt": [384]}', "invalid_request", None),
    (b'{"op": "generate", "messages": [{"role": "user", "content": "x"}, {"role": "user"}]}', "invalid_request", None),
    (b'{"op": "system1", "prompt": "x", "candidates": []}', "invalid_request", None),
    (b'{"op": "system1", "prompt": "x", "candidates": [""]}', "invalid_request", None),
    (b'{"op": "detokenize", "ids": [-1]}', "invalid_request", None),
    (b'{"op": "generate", "prompt": "x", "tools": []}', "invalid_request", "tools"),
    (b'{"op": "generate", "prompt": [5], "chat_template_kwargs": {}}', "invalid_request", "chat_template_kwargs"),
    (b'{"op": "system1", "prompt": "x", "candidates": ["a"], "tools": []}', "invalid_request", "tools"),
    (b'{"op": "generate", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": '
     b'{"add_generation_prompt": false}}', "invalid_request", "chat_template_kwargs"),
    (b'{"op": "system1", "messages": [{"role": "user", "content": "x"}], "candidates": ["a"], '
     b'"chat_template_kwargs": {"bos_token": ""}}', "invalid_request", "chat_template_kwargs"),
    (b'{"op": "launch"}', "unknown_op", "op"),
    (b'{"op": "ping", "verbose": true}', "unknown_field", "verbose"),
    (b'{"op": "generate", "prompt": "x", "top-k": 3}', "unknown_field", "top-k"),
    (b'{"op": 3}', "wrong_type", "op"),
    (b'{"op": "ping", "id": [1]}', "wrong_type", "id"),
    (b'{"op": "ping", "id": true}', "wrong_type", "id"),
    (b'{"op": "generate", "prompt": {"text": "x"}}', "wrong_type", "prompt"),
    (b'{"op": "generate", "prompt": [1, "2"]}', "wrong_type", "prompt"),
    (b'{"op": "generate", "prompt": "x", "stream": "yes"}', "wrong_type", "stream"),
    (b'{"op": "generate", "prompt": "x", "top_k": 1.5}', "wrong_type", "top_k"),
    (b'{"op": "generate", "prompt": "x", "max_tokens": true}', "wrong_type", "max_tokens"),
    (b'{"op": "generate", "messages": ["hi"]}', "wrong_type", "messages"),
    (b'{"op": "generate", "messages": [], "tools": {"type": "function"}}', "wrong_type", "tools"),
    (b'{"op": "generate", "messages": [], "tools": ["get_weather"]}', "wrong_type", "tools"),
    (b'{"op": "system1", "messages": [], "candidates": ["a"], "chat_template_kwargs": []}', "wrong_type",
     "chat_template_kwargs"),
    (b'{"op": "system1", "prompt": "x", "candidates": " a"}', "wrong_type", "candidates"),
    (b'{"op": "detokenize", "ids": [1.0]}', "wrong_type", "ids"),
    (json.dumps({"op": "generate", "prompt": OVER_CONTEXT}).encode(), "context_exceeded", None),
    (json.dumps({"op": "generate", "prompt": [1] * 512}).encode(), "context_exceeded", None),
    (json.dumps({"op": "system1", "prompt": "x", "candidates": [OVER_CONTEXT]}).encode(), "context_exceeded", None),
]


def test_every_error_is_one_line_and_the_loop_goes_on(stdio):
    for line, code, field in ERRORS:
        stdio.send(line)
        tokens, answer = stdio.answer()
        assert not tokens and answer["type"] == "error", line[:80]
        assert (answer["code"], answer.get("field")) == (code, field), (line[:80], answer)
        # the id is echoed whenever the line got as far as reading a valid one
        if line.startswith(b"{") and code not in ("invalid_json",) and field != "id":
            stdio.send(line[:-1] + b', "id": "e1"}')
            assert stdio.answer()[1] == {**answer, "id": "e1"}
    assert stdio.call(op="ping", id="still") == {"type": "pong", "id": "still"}


def test_a_line_over_the_limit_is_refused_and_skipped(stdio):
    stdio.send(b'{"op": "tokenize", "text": "' + b"a" * protocol.MAX_LINE_BYTES + b'"}', {"op": "ping", "id": 2})
    answer = stdio.answer()[1]
    assert answer["code"] == "invalid_request" and "longer than" in answer["message"]
    assert stdio.answer()[1] == {"type": "pong", "id": 2}


def test_an_id_that_is_not_unicode_is_echoed_escaped(stdio):
    assert stdio.call(op="ping", id="\ud800") == {"type": "pong", "id": "\ud800"}


def test_cancel_stops_a_generation_at_a_token_boundary(stdio):
    stdio.send({"op": "generate", "id": "long", "prompt": "Once", "max_tokens": -1, "ignore_eos": True, "stream": True})
    first = stdio.line()
    assert first["type"] == "token" and first["id"] == "long"
    stdio.send({"op": "cancel", "id": "stop"}, {"op": "ping", "id": "after"})
    tokens, result = stdio.answer()
    assert result["type"] == "result" and result["id"] == "long" and result["finish_reason"] == "cancelled"
    assert result["usage"]["completion_tokens"] == len([t for t in [first, *tokens] if t["token"] is not None]) < 500
    assert stdio.answer()[1] == {"type": "result", "id": "stop", "op": "cancel"}
    assert stdio.answer()[1] == {"type": "pong", "id": "after"}


def test_requests_written_at_once_are_answered_in_order(stdio):
    stdio.send({"op": "generate", "id": "a", "prompt": "Once", "max_tokens": 20, "ignore_eos": True, "stream": True},
               {"op": "tokenize", "id": "b", "text": "hi"}, {"op": "generate", "id": "c", "prompt": "Two", "max_tokens": 5,
                                                              "ignore_eos": True, "stream": True}, {"op": "ping", "id": "d"})
    order = []
    for _ in range(4):
        tokens, final = stdio.answer()
        assert len(tokens) >= {"a": 20, "b": 0, "c": 5, "d": 0}[final["id"]]
        order += [t["id"] for t in tokens] + [final["id"]]
    assert [request_id for request_id, _ in itertools.groupby(order)] == ["a", "b", "c", "d"]


def test_end_of_input_is_a_clean_exit_after_the_last_answer():
    proc = subprocess.run([*ENGINE, "stdio", MODEL, "--device", "cpu"], capture_output=True, timeout=TIMEOUT,
                          input=b'{"op": "generate", "prompt": "Once", "max_tokens": 3, "id": 1}\n{"op": "ping", "id": 2}')
    assert proc.returncode == 0, proc.stderr
    lines = [checked(raw) for raw in proc.stdout.splitlines()]
    assert [line["type"] for line in lines] == ["ready", "result", "pong"]
    assert proc.stderr == b""


def test_a_model_that_does_not_load_is_an_error_line_and_the_clis_exit_code(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 4)
    for args, code in (([MODEL, "-c", "0"], 1), ([str(bad)], 2)):  # 2: a malformed GGUF
        proc = subprocess.run([*ENGINE, "stdio", *args, "--device", "cpu"], capture_output=True, timeout=TIMEOUT, input=b"")
        assert proc.returncode == code
        (line,) = proc.stdout.splitlines()
        assert checked(line)["code"] == "load_failed" and proc.stderr.decode().startswith("reflex: error: ")


LOST_DEVICE = """
import sys
from types import SimpleNamespace

import reflex_engine
from reflex_engine.backends.cuda.driver import CudaError
from reflex_engine.cli import main
from reflex_engine.engine import TokenEvent
from reflex_engine.timing import Timings


class LostDevice:  # a model whose GPU fails under the second token
    file = SimpleNamespace(gguf=SimpleNamespace(path="lost.gguf"), chat_template=None, timings=Timings())
    config = SimpleNamespace(arch="qwen3", n_vocab=384)
    device, n_ctx = "cuda", 512

    def generate(self, prompt, **options):
        yield TokenEvent(5, "x")
        raise CudaError("cuStreamSynchronize", 700, "CUDA_ERROR_ILLEGAL_ADDRESS")


reflex_engine.load = lambda *args, **kwargs: LostDevice()
sys.exit(main(["stdio", "lost.gguf"]))
"""


def test_a_lost_device_is_a_last_error_line_and_exit_code_3():
    requests = b'{"op":"ping","id":1}\n{"op":"generate","prompt":"x","stream":true,"id":2}\n{"op":"ping","id":3}\n'
    proc = subprocess.run([sys.executable, "-c", LOST_DEVICE], capture_output=True, timeout=TIMEOUT, input=requests)
    assert proc.returncode == 3, proc.stderr
    lines = [checked(raw) for raw in proc.stdout.splitlines()]
    assert [line["type"] for line in lines] == ["ready", "pong", "token", "error"]  # nothing after the loss
    lost = lines[-1]
    assert lost["id"] == 2 and lost["code"] == "device_lost" and "CUDA_ERROR_ILLEGAL_ADDRESS" in lost["message"]


# -- the Unix socket -------------------------------------------------------------------------------


def connect(path) -> tuple[socket.socket, Peer]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    return sock, Peer(sock.sendall, sock.recv, sock.fileno())


def test_unix_socket_serves_one_connection_at_a_time(tmp_path, model):
    path = tmp_path / "reflex.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # a socket file left behind by a killed run
    stale.close()
    proc, engine = start("uds", MODEL, str(path), "--device", "cpu", stdin=subprocess.DEVNULL)
    try:
        announced = engine.line()
        assert announced["type"] == "ready"
        a, first = connect(path)
        assert first.line() == announced
        b, second = connect(path)  # accepted by the kernel, served only once the first is done
        assert first.call(op="ping", id=1) == {"type": "pong", "id": 1}
        answer = first.call(op="generate", prompt="The cat", max_tokens=6, **SAMPLED)
        gen = model.generate("The cat", max_tokens=6, sampling=SamplingParams(**SAMPLED))
        list(gen)
        assert (answer["text"], answer["tokens"]) == (gen.text, gen.tokens)
        assert first.call(op="detokenize", ids=[999])["code"] == "invalid_request"
        assert second.line(timeout=0.3) is None
        first.send({"op": "generate", "prompt": "Once", "max_tokens": -1, "ignore_eos": True, "stream": True})
        assert first.line()["type"] == "token"
        a.close()  # gone mid-generation: the engine drops it and takes the next connection
        assert second.line() == announced
        assert second.call(op="tokenize", text="hi", id="b")["tokens"] == model.tokenize("hi")
        b.close()
        c, third = connect(path)
        assert third.line() == announced and third.call(op="ping") == {"type": "pong", "id": None}
        c.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT) == 0
        assert not path.exists()
    finally:
        proc.kill()
        proc.wait()
    assert b"Traceback" not in stderr_of(proc)


def test_a_socket_in_use_is_refused(tmp_path):
    path = tmp_path / "busy.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as busy:
        busy.bind(str(path))
        busy.listen()
        proc = subprocess.run([*ENGINE, "uds", MODEL, str(path), "--device", "cpu"], capture_output=True, timeout=TIMEOUT)
    assert proc.returncode == 1 and b"another process is serving" in proc.stderr


# -- fuzz ------------------------------------------------------------------------------------------


def fuzz_lines(rng: random.Random, n: int) -> list[bytes]:
    """Random bytes, truncated JSON, wrong types, huge numbers, deep nesting, unknown fields and
    valid-looking requests with bad values; valid requests that generate ask for few tokens."""
    valid = [
        {"op": "ping"}, {"op": "info"}, {"op": "cancel"}, {"op": "tokenize", "text": "héllo <|im_end|>"},
        {"op": "detokenize", "ids": [1, 2, 300]},
        {"op": "generate", "prompt": "Once", "max_tokens": 2, "stream": True, "top_logprobs": 2, "seed": 1},
        {"op": "generate", "messages": MESSAGES, "max_tokens": 1, "temperature": 0},
        {"op": "generate", "prompt": [5, 6, 7], "max_tokens": 3, "stop": ["a"], "logprobs": True, **SAMPLED},
        {"op": "system1", "prompt": "The cat", "candidates": [" a", " bc"]},
    ]
    strange = [None, True, False, 0, -1, 1.5, 10**30, -(10**30), 1e308, -1e-308, "", "x" * 300, "\u0000\ud7ff",
               [], [1, -2], [[[]]], {}, {"a": [None]}, 2**63, 384, 0.0]

    def value():
        return rng.choice(strange)

    def line() -> bytes:
        kind = rng.randrange(10)
        request = dict(rng.choice(valid))
        if kind == 0:
            return bytes(rng.choice([b for b in range(256) if b != 10]) for _ in range(rng.randrange(120)))
        if kind == 1:
            text = json.dumps(request).encode()
            return text[: rng.randrange(len(text))]
        if kind == 2:  # a field of the wrong type or a strange value
            request[rng.choice(sorted(request))] = value()
        elif kind == 3:
            name = rng.choice(sorted(protocol.FIELDS.get(request["op"], {})) or ["id"])
            request[name] = value()
        elif kind == 4:
            request[rng.choice(["Op", "prompt_", "x", "", "\u00e9", "max-tokens"])] = value()
        elif kind == 5:
            depth = rng.choice([10, 500, 5000])
            return b'{"op": "generate", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
        elif kind == 6:
            return rng.choice([b"1e999", b"-" + b"9" * 400, b'{"op": "ping", "id": 1e400}', b"NaN", b"Infinity",
                               b'{"op": "generate", "prompt": "x", "max_tokens": 1, "top_p": -Infinity}'])
        elif kind == 7:
            request["id"] = rng.choice([value(), rng.randrange(10**6), "fuzz"])
        if request.get("op") == "generate" and isinstance(request.get("max_tokens"), int):
            request["max_tokens"] = max(1, min(request["max_tokens"], 3))  # keep it fast; bad values come from other fields
        return json.dumps(request).encode()

    return [line() for _ in range(n)]


def test_fuzzed_lines_each_get_one_schema_valid_answer():
    lines = fuzz_lines(random.Random(20261201), 10_000)
    start = time.perf_counter()
    # One BLAS thread: on matrices this small more only spin, which made this test 8x slower on a
    # busy 2-core machine. (Elsewhere the engine keeps numpy's default, as the API it is compared to.)
    proc = subprocess.run([*ENGINE, "stdio", MODEL, "--device", "cpu"], capture_output=True, timeout=300,
                          input=b"\n".join(lines + [b'{"op": "ping", "id": "end"}']) + b"\n",
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    distinct = {raw: checked(raw) for raw in set(proc.stdout.splitlines())}  # many lines repeat: check each once
    answers = [distinct[raw] for raw in proc.stdout.splitlines()]
    assert answers[0]["type"] == "ready"
    finals = [a for a in answers[1:] if a["type"] != "token"]
    assert len(finals) == len(lines) + 1 and finals[-1] == {"type": "pong", "id": "end"}
    codes = {a.get("code") for a in finals}
    assert "internal" not in codes and b"Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert {"invalid_json", "invalid_request", "unknown_field", "wrong_type"} <= codes
    assert sum(a["type"] == "result" for a in finals) > 300  # the valid ones were served, not only refused
    print(f"fuzz: {len(lines)} lines in {time.perf_counter() - start:.1f} s")


def test_the_schema_names_every_error_code_and_refuses_malformed_lines():
    assert SCHEMA["$defs"]["error"]["properties"]["code"]["enum"] == list(protocol.ERROR_CODES)
    usage = {"prompt_tokens": 1, "cached_tokens": 0, "completion_tokens": 0}
    for line in ({"type": "pong"}, {"type": "pong", "id": 1, "extra": 1}, {"type": "token", "id": 1, "token": 5},
                 {"type": "result", "id": 1, "op": "generate", "text": "", "tokens": [], "finish_reason": "done",
                  "usage": usage, "timings": {}},
                 {"type": "result", "id": 1, "op": "tokenize", "tokens": [1], "text": "x"},
                 {"type": "result", "id": 1, "op": "launch"}, {"type": "error", "id": None, "code": "oops", "message": "x"},
                 {"type": "error", "id": None, "code": "internal", "message": "two\nlines"}, {"type": "ready"},
                 {"type": "hello", "id": 1}, {"id": 1}):
        assert not VALIDATOR.is_valid(line), line
