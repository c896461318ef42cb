"""The sidecar's life around its engine child: readiness while it loads (/healthz, /ping, the health
port), a full queue (429), the child's death (503s, /healthz 503, exit status 1) or restart, a
model that does not load, the API key, and the chat fallback for a model without a template."""
import asyncio
import os
import signal
import socket
import sys
import time

import openai
import pytest

from openai_harness import FIXTURE, REPO, TIMEOUT, Reference, Sidecar, openai_sampling, validate

MESSAGES = [{"role": "user", "content": "Hello"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_for(sidecar, **kwargs):
    return openai.AsyncOpenAI(base_url=sidecar.url + "/v1", api_key=kwargs.pop("api_key", "unused"), max_retries=0,
                              timeout=TIMEOUT, **kwargs)


def await_metric(sidecar, name: str, value: float, **labels) -> None:
    deadline = time.monotonic() + TIMEOUT
    while (got := sidecar.metric(name, **labels)) != value:
        assert time.monotonic() < deadline, f"{name}{labels} stays {got}, not {value}"
        time.sleep(0.02)


def test_readiness_while_the_engine_loads(tmp_path):
    hold, health_port = tmp_path / "loaded", free_port()
    sidecar = Sidecar(FIXTURE, env={"REFLEX_PROXY_HOLD": str(hold), "PORT_HEALTH": str(health_port)}, wait=False)
    health = f"http://127.0.0.1:{health_port}"
    try:
        time.sleep(0.5)  # the engine has loaded by now; the proxy holds its ready line back
        assert sidecar.http.get("/healthz").status_code == 204
        assert sidecar.http.get("/ping").status_code == 204
        assert sidecar.http.get(health + "/ping").status_code == 204
        assert sidecar.metric("reflex_openai_engine_ready") == 0
        hold.touch()
        sidecar.wait_ready()
        assert sidecar.http.get("/ping").status_code == 200
        assert sidecar.http.get(health + "/ping").status_code == 200
        assert sidecar.http.get(health + "/healthz").status_code == 200
        not_here = sidecar.http.get(health + "/v1/models")  # the health port serves health only
        assert not_here.status_code == 404
        validate("ErrorResponse", not_here.json())
    finally:
        assert sidecar.stop() == 0


def test_a_full_queue_answers_429_and_loses_nothing(tmp_path):
    """64 streaming clients while the engine loads: 40 wait in the queue, 24 get a clean 429 at once.
    Once it is ready, each of the 40 gets exactly the engine's own answer to its request."""
    hold = tmp_path / "loaded"
    reference = Reference()
    sidecar = Sidecar(FIXTURE, "--max-queue", "40", "--retry-after", "2", env={"REFLEX_PROXY_HOLD": str(hold)},
                      wait=False)

    def request(i):
        return dict(messages=[{"role": "user", "content": f"client {i}"}], seed=i, max_tokens=4)

    async def one(client, i):
        try:
            stream = await client.chat.completions.create(model=FIXTURE, stream=True, **request(i))
        except openai.RateLimitError as e:
            return e
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def everyone():
        async with client_for(sidecar) as client:
            tasks = [asyncio.ensure_future(one(client, i)) for i in range(64)]
            await asyncio.to_thread(await_metric, sidecar, "reflex_openai_requests_total", 24,
                                    endpoint="/v1/chat/completions", status="429")
            await asyncio.to_thread(await_metric, sidecar, "reflex_openai_queue_depth", 40)
            hold.touch()
            return await asyncio.gather(*tasks)

    try:
        answers = asyncio.run(everyone())
        refused = [a for a in answers if isinstance(a, openai.RateLimitError)]
        served = {i: a for i, a in enumerate(answers) if isinstance(a, str)}
        assert len(refused) == 24 and len(served) == 40
        for e in refused:
            assert e.status_code == 429 and e.response.headers["retry-after"] == "2"
            validate("ErrorResponse", e.response.json())
            assert e.code == "rate_limit_exceeded"
        for i, text in served.items():
            assert text == reference.generate(**request(i), **openai_sampling())[1]["text"], i
        stats = sidecar.stats()
        assert stats["requests"] == 40 and stats["overlapping"] == 0 and stats["misrouted"] == 0
    finally:
        reference.close()
        assert sidecar.stop() == 0


def test_killing_the_engine_mid_request_gives_503s_then_exits_non_zero():
    # the proxy passes on 3 tokens, then nothing: the first request is still running when the engine dies
    sidecar = Sidecar(FIXTURE, "--exit-delay", "2", env={"REFLEX_PROXY_STALL": "3"})

    async def scenario():
        async with client_for(sidecar) as client:
            first_token = asyncio.Event()

            async def running():
                stream = await client.chat.completions.create(model=FIXTURE, messages=MESSAGES, max_tokens=100,
                                                              stream=True, extra_body={"ignore_eos": True})
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        first_token.set()

            async def queued(stream: bool):
                return await client.chat.completions.create(model=FIXTURE, messages=MESSAGES, max_tokens=2,
                                                            stream=stream)

            a = asyncio.ensure_future(running())
            await asyncio.wait_for(first_token.wait(), TIMEOUT)
            b, c = asyncio.ensure_future(queued(False)), asyncio.ensure_future(queued(True))
            await asyncio.to_thread(await_metric, sidecar, "reflex_openai_queue_depth", 2)
            os.kill(sidecar.engine_pid(), signal.SIGKILL)
            return await asyncio.gather(a, b, c, return_exceptions=True)

    try:
        running, queued_whole, queued_stream = asyncio.run(scenario())
        assert isinstance(running, openai.APIError)  # its status line was sent: the error comes in the stream
        assert "engine" in str(running.message)
        for e in (queued_whole, queued_stream):
            assert isinstance(e, openai.InternalServerError) and e.status_code == 503, e
            validate("ErrorResponse", e.response.json())
        health = sidecar.http.get("/healthz")
        assert health.status_code == 503 and health.json()["status"] == "dead"
        assert sidecar.http.get("/ping").status_code == 503
        late = sidecar.http.post("/v1/chat/completions", json={"model": FIXTURE, "messages": MESSAGES})
        assert late.status_code == 503
        validate("ErrorResponse", late.json())
        assert sidecar.proc.wait(TIMEOUT) == 1
    finally:
        sidecar.stop()
    assert b"Traceback" not in sidecar.output()


def test_restart_replaces_a_dead_engine():
    sidecar = Sidecar(FIXTURE, "--on-engine-exit", "restart", env={"REFLEX_PROXY_STALL": "3"})
    try:
        with sidecar.http.stream("POST", "/v1/chat/completions", json={
                "model": FIXTURE, "messages": MESSAGES, "max_tokens": 50, "ignore_eos": True, "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            first = sidecar.engine_pid()
            os.kill(first, signal.SIGKILL)
            rest = "\n".join(lines)
        assert '"error"' in rest and "[DONE]" not in rest
        deadline = time.monotonic() + TIMEOUT
        while sidecar.engine_pid() == first or sidecar.http.get("/healthz").status_code != 200:
            assert time.monotonic() < deadline, "no new engine"
            time.sleep(0.02)
        answer = sidecar.http.post("/v1/chat/completions", json={"model": FIXTURE, "messages": MESSAGES,
                                                                 "max_tokens": 2, "ignore_eos": True})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
        assert sidecar.proc.poll() is None
    finally:
        assert sidecar.stop() == 0


@pytest.mark.parametrize("on_exit", ["exit", "restart"])  # restarting an engine that never loaded would not help
def test_a_model_that_does_not_load_is_unhealthy_and_exits(tmp_path, on_exit):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 64)
    sidecar = Sidecar(str(broken), "--exit-delay", "1", "--on-engine-exit", on_exit, wait=False)
    try:
        sidecar.wait_for_health(503)
        assert sidecar.http.post("/v1/completions", json={"model": str(broken), "prompt": "x"}).status_code == 503
        assert sidecar.proc.wait(TIMEOUT) == 1
    finally:
        sidecar.stop()


def test_an_api_key_guards_the_api_but_not_the_probes():
    sidecar = Sidecar(FIXTURE, env={"REFLEX_API_KEY": "sekret"})

    async def calls():
        async with client_for(sidecar, api_key="wrong") as client:
            with pytest.raises(openai.AuthenticationError) as e:
                await client.chat.completions.create(model=FIXTURE, messages=MESSAGES, max_tokens=1)
            assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
            validate("ErrorResponse", e.value.response.json())
            with pytest.raises(openai.AuthenticationError):
                await client.models.list()
        async with client_for(sidecar, api_key="sekret") as client:
            answer = await client.chat.completions.create(model=FIXTURE, messages=MESSAGES, max_tokens=1,
                                                          extra_body={"ignore_eos": True})
            assert answer.usage.completion_tokens == 1

    try:
        asyncio.run(calls())
        for headers in ({}, {"Authorization": "sekret"}, {"Authorization": "Basic sekret"}):
            refused = sidecar.http.post("/v1/completions", json={"model": FIXTURE, "prompt": "x"}, headers=headers)
            assert refused.status_code == 401
            validate("ErrorResponse", refused.json())
        assert sidecar.http.get("/healthz").status_code == 200 and sidecar.http.get("/metrics").status_code == 200
    finally:
        assert sidecar.stop() == 0


def test_a_model_without_a_chat_template_gets_the_role_labelled_fallback(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from model_files import rewrite  # gguf-py, as the engine's tests write model files

    source = FIXTURE.replace("Q8_0", "F32")  # gguf-py writes float tensors only
    plain = rewrite(source, str(tmp_path / "plain.gguf"), drop_key="tokenizer.chat_template")
    reference = Reference(plain)
    sidecar = Sidecar(plain, "--served-model-name", "plain-model", wait=False)
    try:
        # the engine alone cannot serve messages for this file
        assert reference.call(op="generate", messages=MESSAGES)["code"] == "invalid_request"
        sidecar.wait_ready()
        answer = sidecar.http.post("/v1/chat/completions", json={
            "model": "plain-model", "seed": 4, "max_tokens": 8, "messages": [
                {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]})
        assert answer.status_code == 200 and answer.json()["model"] == "plain-model"
        _, result = reference.generate(prompt="System: Be brief.\nUser: Hello\nAssistant:", stop=["\nUser:"], seed=4,
                                       max_tokens=8, **openai_sampling())
        assert answer.json()["choices"][0]["message"]["content"] == result["text"]
        assert sidecar.http.post("/v1/chat/completions", json={"model": plain, "messages": MESSAGES}).status_code == 404
    finally:
        reference.close()
        assert sidecar.stop() == 0


def test_sigint_stops_cleanly_with_130():
    sidecar = Sidecar(FIXTURE)
    sidecar.proc.send_signal(signal.SIGINT)
    assert sidecar.proc.wait(TIMEOUT) == 130
    assert b"Traceback" not in sidecar.output()
    sidecar.stop()
