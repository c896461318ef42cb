"""A Runpod job's input, in the shapes Runpod users send, normalised into one request to the sidecar.

    {"messages": [...], "sampling_params": {...}, "stream": false}      -> POST /v1/chat/completions
    {"prompt": "...", "sampling_params": {...}, "stream": false}        -> POST /v1/completions
    {"openai_route": "/v1/chat/completions", "openai_input": {...}}     -> that route, as worker-vllm takes it

`sampling_params` are OpenAI's parameters with vLLM's names for the rest (max_tokens, temperature,
top_p, top_k, min_p, repetition_penalty, presence_penalty, stop, seed, ignore_eos): the sidecar
validates them and names any it does not know. No I/O here.
"""
from __future__ import annotations

from dataclasses import dataclass

ROUTES = {"/v1/chat/completions": "POST", "/v1/completions": "POST", "/v1/models": "GET"}
PLAIN_KEYS = {"messages", "prompt", "sampling_params", "stream"}
OPENAI_KEYS = {"openai_route", "openai_input"}


class JobError(Exception):
    """The job's input is not one we can serve; the message says why, in one line."""


@dataclass(frozen=True)
class Request:
    route: str  # the sidecar's path
    body: dict | None  # the OpenAI body, `model` already the sidecar's name; None for a GET
    stream: bool
    openai: bool  # True: answer in OpenAI's objects (openai_route); False: the plain shapes' output


def normalise(job_input, *, served_name: str, internal_name: str) -> Request:
    """The one request a job's input asks for. `model`, when given, must be the served name; it is
    rewritten to the name the sidecar serves (the answers are rewritten back: `rename`)."""
    if not isinstance(job_input, dict):
        raise JobError(f"the job's input must be an object, not {type(job_input).__name__}")
    if "openai_route" in job_input or "openai_input" in job_input:
        return _openai(job_input, served_name, internal_name)
    return _plain(job_input, internal_name)


def _openai(job_input: dict, served_name: str, internal_name: str) -> Request:
    _only(job_input, OPENAI_KEYS)
    route = job_input.get("openai_route")
    if route not in ROUTES:
        raise JobError(f"openai_route must be one of {sorted(ROUTES)}, not {route!r}")
    body = job_input.get("openai_input")
    if ROUTES[route] == "GET":
        if body not in (None, {}):
            raise JobError(f"{route} takes no openai_input")
        return Request(route, None, stream=False, openai=True)
    if not isinstance(body, dict):
        raise JobError("openai_input must be an object (the OpenAI request body)")
    model = body.get("model")
    if model is not None and model != served_name:
        raise JobError(f"model {model!r} is not served here; this endpoint serves {served_name!r}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise JobError("openai_input.stream must be a boolean")
    return Request(route, {**body, "model": internal_name}, stream=stream, openai=True)


def _plain(job_input: dict, internal_name: str) -> Request:
    _only(job_input, PLAIN_KEYS)
    has_messages, has_prompt = "messages" in job_input, "prompt" in job_input
    if has_messages == has_prompt:
        raise JobError("give exactly one of messages, prompt (or openai_route with openai_input)")
    params = job_input.get("sampling_params", {})
    if not isinstance(params, dict):
        raise JobError("sampling_params must be an object")
    for key in ("model", "messages", "prompt", "stream", "stream_options"):
        if key in params:
            raise JobError(f"sampling_params.{key}: give it at the top of the input, not in sampling_params")
    stream = job_input.get("stream", False)
    if not isinstance(stream, bool):
        raise JobError("stream must be a boolean")
    body = {"model": internal_name, **params}
    if has_messages:
        route, body["messages"] = "/v1/chat/completions", job_input["messages"]
    else:
        route, body["prompt"] = "/v1/completions", job_input["prompt"]
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return Request(route, body, stream=stream, openai=False)


def _only(job_input: dict, allowed: set) -> None:
    for key in job_input:
        if key not in allowed:
            raise JobError(f"unknown input field {key!r} (expected {', '.join(sorted(allowed))})")


def rename(obj, internal_name: str, served_name: str):
    """An answer from the sidecar with its model names given as the served name."""
    if isinstance(obj, dict):
        if obj.get("object") == "list":  # /v1/models
            return {**obj, "data": [rename(m, internal_name, served_name) for m in obj.get("data", [])]}
        if obj.get("object") == "model" and obj.get("id") == internal_name:
            return {**obj, "id": served_name}
        if obj.get("model") == internal_name:
            return {**obj, "model": served_name}
    return obj


def plain_output(response: dict) -> dict:
    """A non-streamed OpenAI answer as the plain shapes' one output item."""
    choice = response["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return {"text": text, "finish_reason": choice["finish_reason"], "usage": response["usage"],
            "model": response["model"]}


def plain_piece(chunk: dict) -> dict | None:
    """One streamed OpenAI chunk as a plain output item: {"text": piece}, then the finish and usage."""
    if not chunk.get("choices"):
        return {"usage": chunk["usage"], "model": chunk["model"]} if chunk.get("usage") else None
    choice = chunk["choices"][0]
    text = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
    if choice.get("finish_reason"):
        return {"text": text or "", "finish_reason": choice["finish_reason"]}
    return {"text": text} if text else None
