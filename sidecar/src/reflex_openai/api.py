"""OpenAI's request bodies into the engine's `generate` requests, and its answers back into OpenAI's
response objects. No I/O here: every function is plain data in, plain data out.

An OpenAI parameter we cannot honour is a 400, never ignored; a null value means "not given", as
in OpenAI's API. Sampling follows OpenAI's meaning: temperature and top_p only, so the engine's
llama.cpp-style top-k, min-p and repeat penalty are switched off unless a request asks for them
(by vLLM's extra parameter names).
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

from . import structured
from .chat_output import Piece
from .errors import APIError, bad, type_error


@dataclass
class Defaults:
    """Sampling used when a request leaves a parameter out (flags --default-*)."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None  # None: OpenAI's (chat: until the context is full; completions: 16)


@dataclass
class Call:
    """One parsed request: what to ask the engine, and how to answer the client."""
    kind: str  # "chat" or "completion"
    model: str
    request: dict  # the engine's generate request, without id and stream
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    stop: list[str] = field(default_factory=list)
    tools: structured.Tools | None = None  # chat: the tools offered (none with tool_choice "none")
    response_format: dict | None = None  # chat: the engine's constraint field for it

    @property
    def constraint_param(self) -> str:
        """The parameter a constraint the engine refuses came from."""
        return "tools" if self.tools is not None and (self.tools.forced or not self.response_format) else "response_format"


# -- parameters ------------------------------------------------------------------------------------

# Parameters of OpenAI's API we do not implement: accepted only when null or this neutral value.
_CHAT_UNSUPPORTED = {"audio": None, "function_call": None, "functions": None, "modalities": None, "moderation": None,
                     "prediction": None, "reasoning_effort": None, "service_tier": None, "store": False,
                     "verbosity": None, "web_search_options": None, "metadata": None,
                     "prompt_cache_key": None, "prompt_cache_retention": None, "safety_identifier": None,
                     "frequency_penalty": 0, "logit_bias": {}, "n": 1}
_COMPLETION_UNSUPPORTED = {"echo": False, "suffix": None, "best_of": 1, "frequency_penalty": 0, "logit_bias": {}, "n": 1}
_IGNORED = {"user"}  # an end-user id for abuse monitoring: nothing for us to do with it
# chat_template_kwargs: vLLM's extension, the chat template's variables
_CHAT_FIELDS = {"model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
                "top_p", "stop", "seed", "logprobs", "top_logprobs", "presence_penalty", "tools", "tool_choice",
                "parallel_tool_calls", "response_format", "chat_template_kwargs"}
_COMPLETION_FIELDS = {"model", "prompt", "stream", "stream_options", "max_tokens", "temperature", "top_p", "stop", "seed",
                      "logprobs", "presence_penalty"}
EXTENSIONS = {"top_k", "min_p", "repetition_penalty", "ignore_eos"}  # vLLM's names for the engine's extra samplers
ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_STOPS = 4  # OpenAI's limit
FALLBACK_STOP = "\nUser:"


def parse_chat(body: dict, defaults: Defaults) -> Call:
    _check_fields(body, _CHAT_FIELDS, _CHAT_UNSUPPORTED)
    messages = _messages(body.get("messages"))
    max_tokens = _int(body, "max_completion_tokens", lo=1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", lo=1)
    logprobs = _bool(body, "logprobs") or False
    top_logprobs = _int(body, "top_logprobs", lo=0, hi=20)
    if top_logprobs is not None and not logprobs:
        raise bad("logprobs must be true when top_logprobs is given", "top_logprobs")
    call = _call("chat", body, defaults, {"messages": messages}, max_tokens=max_tokens, default_max=-1,
                 logprobs=logprobs, top_logprobs=top_logprobs or 0)
    call.tools = structured.parse_tools(body)
    call.response_format = structured.parse_response_format(body.get("response_format"))
    if call.tools is not None:
        call.request["tools"] = call.tools.functions
    variables = body.get("chat_template_kwargs")
    if variables is not None and not isinstance(variables, dict):
        raise type_error("chat_template_kwargs", "an object")
    if variables:  # the engine refuses the names it gives the template itself
        call.request["chat_template_kwargs"] = variables
    return call


def parse_completion(body: dict, defaults: Defaults) -> Call:
    _check_fields(body, _COMPLETION_FIELDS, _COMPLETION_UNSUPPORTED)
    top_logprobs = _int(body, "logprobs", lo=0, hi=5)  # the legacy API's logprobs: how many alternatives
    return _call("completion", body, defaults, {"prompt": _prompt(body.get("prompt"))},
                 max_tokens=_int(body, "max_tokens", lo=1), default_max=16, logprobs=top_logprobs is not None,
                 top_logprobs=top_logprobs or 0)


def _call(kind: str, body: dict, defaults: Defaults, prompt: dict, *, max_tokens, default_max, logprobs, top_logprobs):
    model = body.get("model")
    if model is None:
        raise bad("you must provide a model parameter", "model")
    if not isinstance(model, str):
        raise type_error("model", "a string")
    stream = _bool(body, "stream") or False
    options = body.get("stream_options")
    if options is not None and not stream:
        raise bad("stream_options is only allowed when stream is true", "stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise type_error("stream_options", "an object")
        for key in options:
            if key != "include_usage":
                raise bad(f"stream_options.{key} is not supported by this server", f"stream_options.{key}")
        include_usage = _bool(options, "include_usage", "stream_options.include_usage") or False
    if max_tokens is None:
        max_tokens = defaults.max_tokens if defaults.max_tokens is not None else default_max
    temperature = _number(body, "temperature", lo=0, hi=2)
    top_p = _number(body, "top_p", lo=0, hi=1, lo_open=True)  # OpenAI allows 0; the engine's nucleus cannot be empty
    top_k = _int(body, "top_k", lo=-1)
    request = {"op": "generate", **prompt, "max_tokens": max_tokens,
               "temperature": defaults.temperature if temperature is None else temperature,
               "top_p": defaults.top_p if top_p is None else top_p,
               "top_k": 0 if top_k is None or top_k == -1 else top_k,  # vLLM's -1 is "off", the engine's 0
               "min_p": _or(_number(body, "min_p", lo=0, hi=1), 0.0),
               "repeat_penalty": _or(_number(body, "repetition_penalty", lo=0, lo_open=True), 1.0),
               "presence_penalty": _or(_number(body, "presence_penalty", lo=-2, hi=2), 0.0)}
    seed = _int(body, "seed", lo=0)  # the engine's seeds are unsigned
    if seed is not None:
        request["seed"] = seed
    stop = _stop(body.get("stop"))
    if stop:
        request["stop"] = stop
    if _bool(body, "ignore_eos"):
        request["ignore_eos"] = True
    if logprobs:
        request["logprobs"] = True
        if top_logprobs:
            request["top_logprobs"] = top_logprobs
    return Call(kind, model, request, stream=stream, include_usage=include_usage, logprobs=logprobs,
                top_logprobs=top_logprobs, stop=stop)


def _check_fields(body: dict, supported: set, unsupported: dict) -> None:
    for name, value in body.items():
        if name in supported or name in EXTENSIONS or name in _IGNORED:
            continue
        if name in unsupported:
            neutral = unsupported[name]
            if value is None or (value == neutral and type(value) is type(neutral)):
                continue
            raise bad(f"{name} is not supported by this server", name, "unsupported_parameter")
        raise bad(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")


def _or(value, default):
    return default if value is None else value


def _bool(body: dict, name: str, param: str | None = None):
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise type_error(param or name, "a boolean")
    return value


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise type_error(name, "an integer")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise bad(f"Invalid '{name}': {value} is out of range ({_range(lo, hi)})", name, "invalid_value")
    return value


def _number(body: dict, name: str, lo=None, hi=None, lo_open: bool = False):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise type_error(name, "a number")
    if (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi):
        raise bad(f"Invalid '{name}': {value} is out of range ({_range(lo, hi, lo_open)})", name, "invalid_value")
    return float(value)


def _finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past a float's range (JSON's 1 followed by 400 zeros)
        return False


def _range(lo, hi, lo_open: bool = False) -> str:
    low = "" if lo is None else f"{'>' if lo_open else '>='} {lo}"
    high = "" if hi is None else f"<= {hi}"
    return ", ".join(part for part in (low, high) if part)


def _stop(value) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise type_error("stop", "a string or an array of strings")
    if len(stops) > MAX_STOPS:
        raise bad(f"Invalid 'stop': at most {MAX_STOPS} sequences", "stop", "invalid_value")
    if any(not s for s in stops):
        raise bad("Invalid 'stop': a stop sequence must not be empty", "stop", "invalid_value")
    return stops


def _messages(value) -> list[dict]:
    if value is None:
        raise bad("Missing required parameter: 'messages'", "messages", "missing_required_parameter")
    if not isinstance(value, list):
        raise type_error("messages", "an array")
    if not value:
        raise bad("Invalid 'messages': empty array. Expected an array with minimum length 1", "messages", "empty_array")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(value)]


def _message(message, where: str) -> dict:
    if not isinstance(message, dict):
        raise type_error(where, "an object")
    role = message.get("role")
    if not isinstance(role, str):
        raise bad(f"Missing or invalid '{where}.role'", f"{where}.role")
    if role == "function":
        raise bad(f"'{where}.role': function messages (deprecated) are not supported: use tool messages",
                  f"{where}.role", "unsupported_value")
    if role not in ROLES:
        raise bad(f"Invalid '{where}.role': {role!r} is not one of {sorted(ROLES)}", f"{where}.role", "invalid_value")
    calls = _tool_calls(message["tool_calls"], where) if role == "assistant" and message.get("tool_calls") else None
    content = message.get("content")
    # an assistant turn that only calls tools has no content; templates read "" (transformers' do too)
    out = {"role": "system" if role == "developer" else role,
           "content": "" if content is None and calls else _content(content, where)}
    if calls:
        out["tool_calls"] = calls
    fields = {"name": True, "tool_calls": role == "assistant", "reasoning_content": role == "assistant",
              "tool_call_id": role == "tool"}
    for key, value in message.items():
        if key in ("role", "content", "tool_calls") or value is None:
            continue
        if not fields.get(key):
            raise bad(f"'{where}.{key}' is not supported by this server", f"{where}.{key}", "unsupported_parameter")
        if not isinstance(value, str):
            raise type_error(f"{where}.{key}", "a string")
        out[key] = value
    if role == "tool" and "tool_call_id" not in out:
        raise bad(f"Missing required parameter: '{where}.tool_call_id'", f"{where}.tool_call_id",
                  "missing_required_parameter")
    return out


def _tool_calls(value, where: str) -> list[dict]:
    """An assistant message's tool calls, their arguments read as JSON (the form templates render)."""
    if not isinstance(value, list):
        raise type_error(f"{where}.tool_calls", "an array")
    calls = []
    for i, call in enumerate(value):
        at = f"{where}.tool_calls[{i}]"
        if not (isinstance(call, dict) and call.get("type", "function") == "function"
                and isinstance(call.get("function"), dict)):
            raise type_error(at, "a function tool call object")
        function, call_id = call["function"], call.get("id")
        if not isinstance(function.get("name"), str):
            raise type_error(f"{at}.function.name", "a string")
        if not isinstance(function.get("arguments"), str):
            raise type_error(f"{at}.function.arguments", "a string of JSON")
        if call_id is not None and not isinstance(call_id, str):
            raise type_error(f"{at}.id", "a string")
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            raise bad(f"Invalid '{at}.function.arguments': not valid JSON", f"{at}.function.arguments",
                      "invalid_value") from None
        calls.append({**({"id": call_id} if call_id else {}), "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only, joined as vLLM joins them
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise type_error(f"{where}.content[{i}]", "a content part object")
            if part["type"] != "text":
                raise bad(f"'{where}.content[{i}]': {part['type']} content is not supported (text only)",
                          f"{where}.content[{i}].type", "unsupported_value")
            if not isinstance(part.get("text"), str):
                raise type_error(f"{where}.content[{i}].text", "a string")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad(f"Missing or invalid '{where}.content': expected a string or an array of text parts",
              f"{where}.content")


def _prompt(value):
    """The legacy prompt: a string or token ids, or a list of exactly one of those."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    if value is None:
        raise bad("Missing required parameter: 'prompt'", "prompt", "missing_required_parameter")
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise bad("Invalid 'prompt': one prompt per request (this server does not batch)", "prompt", "unsupported_value")
    raise type_error("prompt", "a string, an array of token ids, or an array holding one of those")


def fallback_prompt(messages: list[dict]) -> str:
    """For a model file without a chat template: each message labelled with its role."""
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"


# -- engine errors ---------------------------------------------------------------------------------

_PARAM_NAMES = {"repeat_penalty": "repetition_penalty"}


def engine_error(code: str, message: str, field: str | None, call: Call) -> APIError:
    """An engine `error` line answering the request, as the client should see it."""
    if code == "context_exceeded":
        return bad(message, "messages" if call.kind == "chat" else "prompt", "context_length_exceeded")
    if code in ("invalid_request", "wrong_type", "unknown_field", "invalid_json"):
        return bad(message, _PARAM_NAMES.get(field, field))
    if code == "invalid_constraint":  # a schema the grammar engine cannot compile
        return bad(message, call.constraint_param, "invalid_constraint")
    if code == "device_lost":
        return APIError(503, f"the engine lost its device: {message}", type="server_error", code="engine_unavailable")
    return APIError(500, f"the engine failed: {message}", type="server_error", code="engine_error")


# -- answers ---------------------------------------------------------------------------------------

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


@dataclass
class Meta:
    """What every object of one response shares."""
    id: str
    created: int
    model: str
    system_fingerprint: str

    @classmethod
    def new(cls, call: Call, model: str, fingerprint: str) -> Meta:
        prefix = "chatcmpl" if call.kind == "chat" else "cmpl"
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model, fingerprint)


def usage(result: dict) -> dict:
    engine = result["usage"]
    prompt, completion = engine["prompt_tokens"], engine["completion_tokens"]
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if "cached_tokens" in engine:  # prompt tokens the engine did not evaluate (a KV state it held)
        out["prompt_tokens_details"] = {"cached_tokens": engine["cached_tokens"]}
    return out


def chat_logprobs(steps: list[dict], texts: list[str]) -> dict:
    """steps: the engine's token lines (each with logprob, maybe top_logprobs); texts: each token's own text."""
    return {"content": [{"token": text, "logprob": step["logprob"], "bytes": list(text.encode()),
                         "top_logprobs": [{"token": t["text"], "logprob": t["logprob"], "bytes": list(t["text"].encode())}
                                          for t in step.get("top_logprobs", [])]}
                        for step, text in zip(steps, texts)],
            "refusal": None}


def completion_logprobs(steps: list[dict], texts: list[str], offset: int = 0) -> dict:
    offsets, tops = [], []
    for step, text in zip(steps, texts):
        offsets.append(offset)
        offset += len(text)
        top = {}
        for t in step.get("top_logprobs", []):
            top.setdefault(t["text"], t["logprob"])  # two tokens of the same text: the likelier one
        tops.append(top)
    return {"tokens": texts, "token_logprobs": [step["logprob"] for step in steps], "top_logprobs": tops,
            "text_offset": offsets}


def finish_reason(result: dict, called: bool) -> str:
    """OpenAI's finish_reason; "tool_calls" when the model ended its answer with tool calls."""
    finish = FINISH_REASONS[result["finish_reason"]]
    return "tool_calls" if called and finish == "stop" else finish


def chat_message(pieces: list[Piece]) -> dict:
    """The assistant message the output's pieces (chat_output.py) make."""
    content = "".join(p.text for p in pieces if p.kind == "content")
    calls = []
    for piece in pieces:
        if piece.kind == "call":
            calls.append({"id": piece.call.id, "type": "function", "function": {"name": piece.call.name, "arguments": ""}})
        elif piece.kind == "arguments":
            calls[-1]["function"]["arguments"] += piece.text
    message = {"role": "assistant", "content": content or (None if calls else ""), "refusal": None}
    if calls:
        message["tool_calls"] = calls
    reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
    if reasoning:
        message["reasoning_content"] = reasoning  # vLLM's and DeepSeek's name
    return message


def piece_delta(piece: Piece, index: int) -> dict:
    """A piece as a stream delta; index: the tool call's (from 0) that a "call" piece starts or an
    "arguments" piece continues. A call streams as OpenAI streams one: index, id and name, then its
    arguments in pieces."""
    if piece.kind == "call":
        return {"tool_calls": [{"index": index, "id": piece.call.id, "type": "function",
                                "function": {"name": piece.call.name, "arguments": ""}}]}
    if piece.kind == "arguments":
        return {"tool_calls": [{"index": index, "function": {"arguments": piece.text}}]}
    return {"reasoning_content" if piece.kind == "reasoning" else "content": piece.text}


ROLE_DELTA = {"role": "assistant", "content": "", "refusal": None}  # a chat stream's first delta


def response(call: Call, meta: Meta, result: dict, logprobs: dict | None, pieces: list[Piece] = ()) -> dict:
    """The whole answer; a chat's message is made of the output's pieces."""
    if call.kind == "chat":
        message = chat_message(list(pieces))
        choice = {"index": 0, "message": message, "logprobs": logprobs,
                  "finish_reason": finish_reason(result, "tool_calls" in message)}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": result["text"], "logprobs": logprobs,
                  "finish_reason": finish_reason(result, False)}
        obj = "text_completion"
    return {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model,
            "system_fingerprint": meta.system_fingerprint, "choices": [choice], "usage": usage(result)}


def chunk(call: Call, meta: Meta, *, text: str | None = None, delta: dict | None = None, finish: str | None = None,
          logprobs: dict | None = None, usage: dict | None = None, final_usage: bool = False) -> dict:
    """One streamed object: a chat's delta or a completion's text, the finish, or the usage."""
    if call.kind == "chat":
        obj = "chat.completion.chunk"
        choices = [{"index": 0, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish}]
    else:
        obj = "text_completion"
        choices = [{"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}]
    out = {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model,
           "system_fingerprint": meta.system_fingerprint, "choices": [] if final_usage else choices}
    if call.include_usage:
        out["usage"] = usage
    return out
