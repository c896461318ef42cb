"""`tools`, `tool_choice`, `parallel_tool_calls` and `response_format`: OpenAI's fields checked, and
turned into the one constraint field the engine takes (json_object, json_schema or a grammar).

A tool call the request forces (`required`, or a named function) is a grammar of Qwen3's markup,
`<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`, with ARGS constrained by the
function's `parameters` schema; `auto` leaves the model free (chat_output.py parses what it writes).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .errors import bad, type_error
from .chat_output import CALL_CLOSE, CALL_OPEN

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function and schema names
# The engine's own JSON layout for json_schema (constraints.py): fixed separators, else a small
# model may pad with whitespace forever. A schema inside a grammar carries them in "x-guidance".
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: parameters left out
MARKUP = (CALL_OPEN, CALL_CLOSE)  # a calls grammar writes each as the model's own token, where it has one


@dataclass
class Tools:
    """The tools a request offers the model (tool_choice `none` offers none)."""
    functions: list[dict]  # {"type": "function", "function": {"name", "description"?, "parameters"?}}, as given
    choice: str  # "auto", "required" or "named"
    name: str | None = None  # the function a named tool_choice forces
    parallel: bool = True  # parallel_tool_calls: more than one call per answer

    @property
    def forced(self) -> bool:
        return self.choice != "auto"


def parse_tools(body: dict) -> Tools | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise type_error("parallel_tool_calls", "a boolean")
    if tools is None:
        if choice not in (None, "none"):
            raise bad("Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.",
                      "tool_choice")
        return None
    functions = _functions(tools)
    if choice is None:
        choice = "auto"
    if choice == "none":
        return None  # the tools are left out of the prompt: the model cannot call them
    if choice in ("auto", "required"):
        return Tools(functions, choice, parallel=parallel is not False)
    name = _named_choice(choice)
    if name not in {f["function"]["name"] for f in functions}:
        raise bad(f"Invalid value for 'tool_choice': no function named {name!r} in 'tools'.", "tool_choice",
                  "invalid_value")
    return Tools(functions, "named", name, parallel=False)


def _functions(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise type_error("tools", "an array")
    if not tools:
        raise bad("Invalid 'tools': empty array. Expected an array with minimum length 1.", "tools", "empty_array")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise type_error(where, "an object")
        if tool.get("type") != "function":
            raise bad(f"Invalid '{where}.type': only 'function' tools are supported.", f"{where}.type", "invalid_value")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise type_error(f"{where}.function", "an object")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise bad(f"Invalid '{where}.function.name': expected a string of 1-64 letters, digits, '_' or '-'.",
                      f"{where}.function.name", "invalid_value")
        if name in names:
            raise bad(f"Invalid 'tools': the function name {name!r} is given twice.", f"{where}.function.name",
                      "invalid_value")
        names.add(name)
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise type_error(f"{where}.function.parameters", "a JSON schema object")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise type_error(f"{where}.function.description", "a string")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise type_error(f"{where}.function.strict", "a boolean")
    return tools


def _named_choice(choice) -> str:
    if isinstance(choice, str):
        raise bad(f"Invalid value for 'tool_choice': {choice!r}. Supported values are: 'none', 'auto', 'required', "
                  "or an object naming a function.", "tool_choice", "invalid_value")
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)):
        raise type_error("tool_choice", '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    return choice["function"]["name"]


def parse_response_format(value) -> dict | None:
    """The engine's constraint field for a response_format: {"json_object": true}, {"json_schema": ...} or None."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise type_error("response_format", "an object with a 'type'")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise bad(f"Invalid value for 'response_format.type': {kind!r}. Supported values are: 'text', 'json_object' "
                  "and 'json_schema'.", "response_format.type", "invalid_value")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("Missing required parameter: 'response_format.json_schema'.", "response_format.json_schema",
                  "missing_required_parameter")
    name = spec.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise bad("Invalid 'response_format.json_schema.name': expected a string of 1-64 letters, digits, '_' or '-'.",
                  "response_format.json_schema.name", "invalid_value")
    for key, test, what in (("strict", bool, "a boolean"), ("description", str, "a string"),
                            ("schema", dict, "a JSON schema object")):
        if spec.get(key) is not None and not isinstance(spec[key], test):
            raise type_error(f"response_format.json_schema.{key}", what)
    return {"json_schema": spec.get("schema") or {}}  # no schema: any JSON value, as OpenAI's optional field means


def writes_calls(tools: Tools | None, response_format: dict | None) -> bool:
    """Whether the constraint is a grammar of tool calls (forced ones, or calls or the JSON answer)."""
    return tools is not None and (tools.forced or bool(response_format))


def constraint(tools: Tools | None, response_format: dict | None, markup: dict[str, list[int]]) -> dict:
    """The engine request's constraint field. markup: each MARKUP text's token ids (the engine's
    `tokenize`, without a BOS), needed only when it writes_calls."""
    if not writes_calls(tools, response_format):
        return response_format or {}
    calls = _calls_grammar(tools, markup)
    if tools.forced:  # the forced call is the whole answer: a response_format has nothing left to shape
        return {"grammar": "start: calls\n" + calls}
    answer = {"type": "object"} if "json_object" in response_format else response_format["json_schema"]
    return {"grammar": f"start: calls | answer\nanswer: %json {_json(answer)}\n" + calls}


def _calls_grammar(tools: Tools, markup: dict[str, list[int]]) -> str:
    functions = [f["function"] for f in tools.functions if tools.name in (None, f["function"]["name"])]
    call_open, call_close = (_term(text, markup) for text in MARKUP)
    rules = [f'call: {call_open} "\\n" ({" | ".join(f"fn_{i}" for i in range(len(functions)))}) "\\n" {call_close}',
             'calls: call ("\\n" call)*' if tools.parallel else "calls: call"]
    for i, function in enumerate(functions):
        head = '{"name": ' + json.dumps(function["name"]) + ', "arguments": '
        rules.append(f'fn_{i}: {json.dumps(head)} %json {_json(function.get("parameters") or NO_PARAMETERS)} "}}"')
    return "\n".join(rules) + "\n"


def _term(text: str, markup: dict[str, list[int]]) -> str:
    """The Lark term that writes text: the model's own token where text is one (Qwen3's
    `<tool_call>`), which llguidance keeps apart from text, else the text itself."""
    ids = markup[text]
    return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(text)


def _json(schema) -> str:
    """A schema for `%json` in a grammar, laid out as the engine lays out json_schema."""
    return json.dumps({**schema, "x-guidance": JSON_LAYOUT})
