"""The JSON-lines protocol of `reflex stdio` and `reflex uds` (docs/protocol.md): a request line
checked and read into its op and arguments, and the answer lines encoded. No I/O here, and only
the standard library: the engine's numerics are not imported to reject a bad line.

protocol.schema.json describes every line the engine writes; tests hold the two together.
"""
from __future__ import annotations

import json
import math
from typing import Any, Callable, NamedTuple

PROTOCOL_VERSION = 1
MAX_LINE_BYTES = 16 << 20  # a longer request line is refused (and skipped to its newline) unread
OVERLONG = object()  # what the reader passes on in place of such a line

# Every error line's code (docs/protocol.md says when each is used).
ERROR_CODES = ("invalid_json", "invalid_request", "unknown_op", "unknown_field", "wrong_type",
               "context_exceeded", "internal", "device_lost", "load_failed", "invalid_constraint")

RequestId = Any  # a string, an integer or None


class ProtocolError(Exception):
    """A line refused before the engine sees it: an error `code`, and the request's id when the
    line got as far as a valid one."""

    def __init__(self, code: str, message: str, *, field: str | None = None, request_id: RequestId = None):
        super().__init__(message)
        self.code, self.field, self.request_id = code, field, request_id


class Kind(NamedTuple):
    """A field's JSON type: how an error message names it, and the test a value must pass."""

    name: str
    accepts: Callable[[Any], bool]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _list_of(test: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and all(map(test, v))


def _is_str(v) -> bool:
    return isinstance(v, str)


STRING = Kind("a string", _is_str)
BOOLEAN = Kind("true or false", lambda v: isinstance(v, bool))
INTEGER = Kind("an integer", _is_int)
NUMBER = Kind("a number", lambda v: _is_int(v) or isinstance(v, float))
SEED = Kind("an integer or null", lambda v: v is None or _is_int(v))
PROMPT = Kind("a string or a list of token ids", lambda v: _is_str(v) or _list_of(_is_int)(v))
MESSAGES = Kind("a list of message objects", _list_of(lambda m: isinstance(m, dict)))
STOP = Kind("a string or a list of strings", lambda v: _is_str(v) or _list_of(_is_str)(v))
STRINGS = Kind("a list of strings", _list_of(_is_str))
TOKEN_IDS = Kind("a list of token ids", _list_of(_is_int))
OBJECT = Kind("an object", lambda v: isinstance(v, dict))
TOOLS = Kind("a list of tool objects", _list_of(lambda t: isinstance(t, dict)))

# SamplingParams' fields, by the same names
SAMPLING_FIELDS = {"temperature": NUMBER, "top_k": INTEGER, "top_p": NUMBER, "min_p": NUMBER, "repeat_penalty": NUMBER,
                   "presence_penalty": NUMBER, "repeat_last_n": INTEGER, "seed": SEED}
_PROMPT_FIELDS = {"prompt": PROMPT, "messages": MESSAGES}  # exactly one of the two
# with "messages" only: what the chat template is given besides them (tools, template variables)
TEMPLATE_FIELDS = {"tools": TOOLS, "chat_template_kwargs": OBJECT}
_STATE_FIELDS = {"import_kv": STRING, "export_kv": STRING}  # KV state files (kvstate.py), paths on the engine's machine
# constrained decoding (constraints.py), at most one: the schema inline, a regex, a Lark or GBNF grammar's text
CONSTRAINT_FIELDS = {"json_schema": OBJECT, "json_object": BOOLEAN, "regex": STRING, "grammar": STRING}

# op -> the fields it accepts besides "op" and "id"
FIELDS: dict[str, dict[str, Kind]] = {
    "generate": {**_PROMPT_FIELDS, **TEMPLATE_FIELDS, **SAMPLING_FIELDS, "max_tokens": INTEGER, "stop": STOP,
                 "ignore_eos": BOOLEAN, "logprobs": BOOLEAN, "top_logprobs": INTEGER, "stream": BOOLEAN, **_STATE_FIELDS,
                 **CONSTRAINT_FIELDS},
    "system1": {**_PROMPT_FIELDS, **TEMPLATE_FIELDS, "candidates": STRINGS, "json_schema": OBJECT,  # one of the two
                **_STATE_FIELDS},
    "tokenize": {"text": STRING, "add_bos": BOOLEAN, "parse_special": BOOLEAN},
    "detokenize": {"ids": TOKEN_IDS},
    "info": {},
    "ping": {},
    "cancel": {},
}
REQUIRED = {"tokenize": ("text",), "detokenize": ("ids",)}


class Request(NamedTuple):
    id: RequestId
    op: str
    args: dict[str, Any]  # the fields besides op and id, type-checked


def parse(line) -> Request:
    """A request line (bytes, or OVERLONG) -> Request; ProtocolError when the line is refused."""
    request = _decode(line)
    request_id = request.get("id")
    if not (request_id is None or _is_str(request_id) or _is_int(request_id)):
        raise ProtocolError("wrong_type", "id must be a string, an integer or null", field="id")

    def refuse(code: str, message: str, field: str | None = None):
        return ProtocolError(code, message, field=field, request_id=request_id)

    op = request.get("op")
    if op is None:
        raise refuse("invalid_request", 'a request needs an "op"')
    if not _is_str(op):
        raise refuse("wrong_type", "op must be a string", "op")
    if op not in FIELDS:
        raise refuse("unknown_op", f"unknown op {op[:64]!r} (one of {', '.join(FIELDS)})", "op")
    fields = FIELDS[op]
    args = {k: v for k, v in request.items() if k not in ("op", "id")}
    for name, value in args.items():
        kind = fields.get(name)
        if kind is None:
            raise refuse("unknown_field", f"{op} has no field {name[:64]!r}", name)
        if not kind.accepts(value):
            raise refuse("wrong_type", f"{name} must be {kind.name}", name)
        if isinstance(value, float) and not math.isfinite(value):  # 1e999 reads as inf
            raise refuse("invalid_request", f"{name} is out of range", name)
    for name in REQUIRED.get(op, ()):
        if name not in args:
            raise refuse("invalid_request", f"{op} needs {name!r}", name)
    if "prompt" in fields and ("prompt" in args) == ("messages" in args):
        raise refuse("invalid_request", f'{op} needs either "prompt" or "messages"')
    if op == "system1" and ("candidates" in args) == ("json_schema" in args):
        raise refuse("invalid_request", 'system1 needs either "candidates" or "json_schema" (whose instances are the candidates)',
                     "candidates")
    if sum(args.get(name, False) is not False for name in CONSTRAINT_FIELDS) > 1:  # "json_object": false is none
        raise refuse("invalid_request", f"give at most one of {', '.join(CONSTRAINT_FIELDS)}")
    return Request(request_id, op, args)


def _decode(line) -> dict:
    if line is OVERLONG:
        raise ProtocolError("invalid_request", f"the line is longer than {MAX_LINE_BYTES} bytes")
    try:
        request = json.loads(line.decode("utf-8"), parse_constant=_refuse_constant)
    except UnicodeDecodeError:
        raise ProtocolError("invalid_json", "the line is not UTF-8") from None
    except RecursionError:
        raise ProtocolError("invalid_json", "the JSON is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, an integer of more than 4300 digits
        raise ProtocolError("invalid_json", f"not JSON: {e}") from None
    if not isinstance(request, dict):
        raise ProtocolError("invalid_request", "a request is a JSON object")
    return request


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def is_cancel(line) -> bool:
    """Whether a line read ahead during a generation is a valid cancel request."""
    if not isinstance(line, bytes) or b"cancel" not in line:
        return False
    try:
        return parse(line).op == "cancel"
    except ProtocolError:
        return False


def error(request_id: RequestId, code: str, message: str, field: str | None = None) -> dict:
    assert code in ERROR_CODES, code
    line = {"type": "error", "id": request_id, "code": code, "message": " ".join(message.split())}
    if field is not None:
        line["field"] = field
    return line


def encode(answer: dict) -> bytes:
    """One answer line: compact JSON, UTF-8, newline-terminated. A lone surrogate echoed from a
    request (an id written "\\ud800") has no UTF-8, so such a line is written ASCII-escaped."""
    try:
        return (json.dumps(answer, ensure_ascii=False, allow_nan=False, separators=(",", ":")) + "\n").encode()
    except UnicodeEncodeError:
        return (json.dumps(answer, allow_nan=False, separators=(",", ":")) + "\n").encode()
