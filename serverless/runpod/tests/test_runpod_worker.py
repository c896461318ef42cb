"""The Runpod queue worker in the SDK's local test mode (--test_input) and its local API server
(--rp_serve_api), on the CPU backend over the tiny fixture model. Every answer is compared with
what `reflex stdio` answers directly for the same request (greedy, so the text is determined)."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from runpod_harness import (PROXY, SERVED, TIMEOUT, Engine, free_port, local_test_result, start_api_server,
                            start_local_test, wait_listening, worker_env)

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
PROMPT = "The capital of France is"
N = 12
GREEDY = {"max_tokens": N, "temperature": 0}

CASES = {  # name -> the job's input
    "messages": {"messages": MESSAGES, "sampling_params": GREEDY},
    "messages-stream": {"messages": MESSAGES, "sampling_params": GREEDY, "stream": True},
    "prompt": {"prompt": PROMPT, "sampling_params": GREEDY},
    "prompt-stream": {"prompt": PROMPT, "sampling_params": GREEDY, "stream": True},
    "openai-chat": {"openai_route": "/v1/chat/completions",
                    "openai_input": {"model": SERVED, "messages": MESSAGES, **GREEDY}},
    "openai-chat-stream": {"openai_route": "/v1/chat/completions",
                           "openai_input": {"model": SERVED, "messages": MESSAGES, "stream": True, **GREEDY}},
    "openai-completions": {"openai_route": "/v1/completions", "openai_input": {"prompt": PROMPT, **GREEDY}},
    "openai-completions-stream": {"openai_route": "/v1/completions",
                                  "openai_input": {"model": SERVED, "prompt": PROMPT, "stream": True, **GREEDY}},
    "openai-models": {"openai_route": "/v1/models"},
}


@pytest.fixture(scope="module")
def expected():
    """The engine's own answers: chat for the messages, a completion for the prompt."""
    engine = Engine()
    try:
        yield {"chat": engine.generate(messages=MESSAGES, max_tokens=N),
               "completion": engine.generate(prompt=PROMPT, max_tokens=N)}
    finally:
        engine.close()


@pytest.fixture(scope="module")
def local_runs():
    """Every case in --test_input mode, the workers started together (each loads its own engine)."""
    procs = {name: start_local_test(job) for name, job in CASES.items()}
    return {name: local_test_result(proc) for name, proc in procs.items()}


def sse(items: list) -> list:
    """An openai_route stream's items ("data: ...\\n\\n" strings) decoded; the last must be [DONE]."""
    assert all(isinstance(i, str) and i.startswith("data: ") and i.endswith("\n\n") for i in items), items
    assert items[-1] == "data: [DONE]\n\n"
    return [json.loads(i[6:]) for i in items[:-1]]


def check_output(name: str, output, expected: dict) -> None:
    kind = "chat" if "messages" in name or "chat" in name else "completion"
    want = expected.get(kind)
    if name == "openai-models":
        (models,) = output
        assert [m["id"] for m in models["data"]] == [SERVED]
    elif name in ("messages", "prompt"):
        (item,) = output
        assert item["text"] == want["text"]
        assert item["finish_reason"] == "length" and want["finish_reason"] == "length"
        assert item["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
        assert item["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == N
        assert item["model"] == SERVED
    elif name in ("messages-stream", "prompt-stream"):
        assert len(output) >= 3  # pieces, the finish, the usage
        assert "".join(i.get("text", "") for i in output) == want["text"]
        assert [i["finish_reason"] for i in output if "finish_reason" in i] == ["length"]
        assert output[-1]["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
        assert output[-1]["model"] == SERVED
    elif name.endswith("-stream"):
        chunks = sse(output)
        assert {c["model"] for c in chunks} == {SERVED}
        if kind == "chat":
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        else:
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == want["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    else:
        (response,) = output
        assert response["model"] == SERVED
        choice = response["choices"][0]
        assert (choice["message"]["content"] if kind == "chat" else choice["text"]) == want["text"]
        assert response["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]


@pytest.mark.parametrize("name", list(CASES))
def test_local_test_mode(name, local_runs, expected):
    status, result, log = local_runs[name]
    assert status == 0, log
    assert "error" not in result, result
    check_output(name, result["output"], expected)


BAD = [  # the job's input -> words the error must contain
    ({"messages": MESSAGES, "prompt": PROMPT}, "exactly one of messages, prompt"),
    ({"prompt": PROMPT, "temperature": 0}, "unknown input field 'temperature'"),
    ({"prompt": PROMPT, "sampling_params": {"temperature": 5}}, "temperature"),
    ({"prompt": PROMPT, "sampling_params": {"best_of": 3}}, "best_of"),
    ({"openai_route": "/v1/embeddings", "openai_input": {}}, "openai_route must be one of"),
    ({"openai_route": "/v1/chat/completions", "openai_input": {"model": "gpt-4o", "messages": MESSAGES}},
     "model 'gpt-4o' is not served here"),
    ({"openai_route": "/v1/chat/completions", "openai_input": [1]}, "openai_input must be an object"),
]


@pytest.fixture(scope="module")
def api_server():
    port = free_port()
    proc = start_api_server(port)
    try:
        wait_listening(port, proc)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT) as client:
            yield client, proc
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(TIMEOUT)


def test_api_server_runsync_and_stream(api_server, expected):
    client, _ = api_server
    for name in ("openai-chat-stream", "messages", "prompt-stream"):
        answer = client.post("/runsync", json={"input": CASES[name]}).json()
        assert answer["status"] == "COMPLETED", answer
        check_output(name, answer["output"], expected)
    job = client.post("/run", json={"input": CASES["messages-stream"]}).json()
    streamed = client.post(f"/stream/{job['id']}").json()
    assert streamed["status"] == "COMPLETED", streamed
    check_output("messages-stream", [s["output"] for s in streamed["stream"]], expected)


@pytest.mark.parametrize("job_input, words", BAD, ids=[w for _, w in BAD])
def test_bad_input_is_a_clear_error(api_server, job_input, words):
    client, proc = api_server
    answer = client.post("/runsync", json={"input": job_input}).json()
    # The handler yields {"error": ...}: the SDK's worker loop (rp_job.handle_job) fails the job
    # with that message; its local API server shows the item as the output of a COMPLETED job.
    assert answer["output"] == [{"error": answer["output"][0]["error"]}], answer
    error = answer["output"][0]["error"]
    assert words in error and "Traceback" not in error, error
    assert proc.poll() is None  # a bad job is the job's failure, not the worker's


def test_bad_input_and_a_bad_model_in_local_test_mode():
    """(The API server's own schema refuses an input that is not an object before the handler.)"""
    procs = [(start_local_test(job), words) for job, words in [({"prompt": PROMPT, "stream": "yes"}, "stream must be a boolean"),
                                                              ("hello", "the job's input must be an object, not str")]]
    missing = start_local_test({"prompt": PROMPT}, REFLEX_MODEL="/nonexistent/model.gguf")
    procs.append((missing, "the engine is gone; stopping this worker"))  # a model that cannot load
    for proc, words in procs:
        status, result, log = local_test_result(proc)
        assert status == 1, log
        assert words in log and "Traceback" not in log, log


def test_engine_killed_mid_job_ends_the_worker(tmp_path):
    """The engine (behind the sidecar) is killed while a streamed job runs: the job fails, naming
    the engine, and the worker exits non-zero, for the platform to replace it."""
    port = free_port()
    engine_cmd = f"{os.sys.executable} {PROXY} {tmp_path} -- {os.sys.executable} -m reflex_engine"
    proc = start_api_server(port, REFLEX_ENGINE_CMD=engine_cmd, REFLEX_PROXY_STALL="3")
    try:
        wait_listening(port, proc)
        answers = []
        job = {"messages": MESSAGES, "sampling_params": {"max_tokens": 200, "temperature": 0}, "stream": True}

        def post():
            with httpx.Client(timeout=TIMEOUT) as client:
                try:
                    answers.append(client.post(f"http://127.0.0.1:{port}/runsync", json={"input": job}).json())
                except httpx.HTTPError as e:  # the worker may exit before it answers
                    answers.append(e)

        thread = threading.Thread(target=post)
        thread.start()
        lines = tmp_path / "lines.jsonl"
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:  # the engine has streamed its 3 tokens: the job is mid-way
            if lines.exists() and sum('"type": "token"' in line for line in lines.read_text().splitlines()) >= 3:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the job never started streaming")
        os.kill(int((tmp_path / "engine.pid").read_text()), signal.SIGKILL)
        status = proc.wait(TIMEOUT)
        thread.join(TIMEOUT)
        log = proc.stdout.read().decode()
        assert status == 1, log
        assert "the engine is gone; stopping this worker" in log
        if answers and isinstance(answers[0], dict):  # it answered before exiting: a failed job
            assert "engine" in answers[0]["output"][-1]["error"], answers
    finally:
        if proc.poll() is None:
            proc.kill()


def test_load_balancing_endpoint_from_the_environment(expected):
    """The runtime image's command, configured as Runpod's load balancer does it (PORT,
    PORT_HEALTH, everything else from the environment too): /ping on the health port says 204
    or 200 until it can serve, then the API port answers as the engine does."""
    port, health = free_port(), free_port()
    env = worker_env(PORT=str(port), PORT_HEALTH=str(health), REFLEX_HOST="127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "reflex_openai"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        seen, deadline = [], time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and 200 not in seen:
            try:
                seen.append(httpx.get(f"http://127.0.0.1:{health}/ping", timeout=5).status_code)
            except httpx.TransportError:
                time.sleep(0.05)
        assert seen and set(seen) <= {200, 204} and seen[-1] == 200, seen
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=TIMEOUT,
                            json={"model": SERVED, "messages": MESSAGES, **GREEDY}).json()
        assert answer["choices"][0]["message"]["content"] == expected["chat"]["text"]
        assert httpx.post(f"http://127.0.0.1:{health}/v1/chat/completions", timeout=TIMEOUT,
                          json={"model": SERVED, "messages": MESSAGES}).status_code == 404
    finally:
        proc.terminate()
        assert proc.wait(TIMEOUT) == 0
