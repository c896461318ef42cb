"""Chat templates from the fuzzer, rendered with messages from the fuzzer.

Input: the template's text, a NUL byte, then JSON for render_chat's arguments (messages, tools,
documents, add_generation_prompt, continue_final_message, tokens and other variables); JSON
that does not parse means a fixed two-turn chat. Properties: render_chat returns text of at most
MAX_CHARS or raises a one-line ReflexError; and the sandbox holds: while a template renders, no
audit event (sys.addaudithook) is raised beyond the few that building a value raises, none that
opens a file, imports, runs code, spawns a process or reads a frame, except where jinja2's own
code does it (see _JINJA_FILES).
"""
from __future__ import annotations

import json
import os
import sys

import common

with common.instrumented():
    import jinja2

    from reflex_engine import chat
    from reflex_engine.errors import ReflexError

MAX_LEN = 1 << 14
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello", "reasoning_content": "greet"}, {"role": "user", "content": "2+2?"}]
ARGUMENTS = ("tools", "documents", "add_generation_prompt", "continue_final_message", "bos_token", "eos_token")
MAX_SECONDS = 2.0  # chat.MAX_SECONDS here, under libFuzzer's -timeout: a render the deadline ends is not a hang
HARMLESS = frozenset({"builtins.id"})
# jinja2's own code, not the template's: it compiles and runs code and reads frames to rewrite the
# traceback of an error (debug.py), and reads a function's __code__ to mark it internal (utils.py)
_JINJA_EVENTS = frozenset({"compile", "exec", "code.__new__", "object.__getattr__"})
_JINJA_FILES = tuple(os.path.join(os.path.dirname(jinja2.__file__), name) for name in ("debug.py", "utils.py"))


class _Watch:
    rendering = False
    seen: list = []


def _audit(event: str, args) -> None:
    if not _Watch.rendering or event in HARMLESS or event == "sys._getframe":
        return
    if event in _JINJA_EVENTS and sys._getframe(1).f_code.co_filename in _JINJA_FILES:
        return
    _Watch.seen.append((event, repr(args)[:200]))


sys.addaudithook(_audit)
try:  # warm up what an error imports the first time
    chat.render_chat("{{ x.y }}", [])
except ReflexError:
    pass


def split(data: bytes) -> tuple[str, dict]:
    template, _, arguments = data.partition(b"\x00")
    try:
        kwargs = json.loads(arguments)
    except (ValueError, RecursionError):
        kwargs = None
    if not isinstance(kwargs, dict):
        kwargs = {"messages": MESSAGES}
    return template.decode("utf-8", "replace"), kwargs


def one_input(data: bytes) -> None:
    template, kwargs = split(data)
    messages = kwargs.pop("messages", MESSAGES)
    kwargs.pop("template", None)
    if kwargs.get("continue_final_message"):
        kwargs.setdefault("add_generation_prompt", False)
    try:
        chat._compile(template)  # outside the watch: compiling runs jinja2's code generator
    except ReflexError:
        pass
    _Watch.seen, _Watch.rendering = [], True
    deadline, chat.MAX_SECONDS = chat.MAX_SECONDS, MAX_SECONDS
    try:
        text = chat.render_chat(template, messages, **kwargs)
    except ReflexError as e:
        assert "\n" not in str(e), str(e)
        text = ""
    except TypeError as e:  # the harness's own call: a keyword render_chat does not take
        if "keyword argument" not in str(e):
            raise
        text = ""
    finally:
        _Watch.rendering, chat.MAX_SECONDS = False, deadline
    assert not _Watch.seen, f"the template reached outside the sandbox: {_Watch.seen[:5]}"
    assert isinstance(text, str) and len(text) <= chat.MAX_CHARS, len(text)


def seeds() -> dict[str, bytes]:
    import glob
    import os

    from test_chat import ESCAPES  # the CVE-2024-34359 payloads and their kin

    conversations = [
        {"messages": MESSAGES},
        {"messages": MESSAGES[:2], "add_generation_prompt": True, "enable_thinking": False},
        {"messages": MESSAGES[:3], "continue_final_message": True, "add_generation_prompt": False},
        {"messages": [{"role": "user", "content": "weather?"},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"type": "function", "function": {"name": "get", "arguments": {"city": "Paris"}}}]},
                      {"role": "tool", "content": "sunny", "name": "get"}],
         "tools": [{"type": "function", "function": {"name": "get", "description": "weather",
                                                     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "documents": [{"title": "t", "text": "d"}]},
    ]
    out = {}
    folder = os.path.join(common.ROOT, "tests", "chat_templates")
    for i, path in enumerate(sorted(glob.glob(os.path.join(folder, "*.jinja")))):
        with open(path, "rb") as f:
            template = f.read()
        out[os.path.basename(path)] = template + b"\x00" + json.dumps(conversations[i % len(conversations)]).encode()
    for i, payload in enumerate(ESCAPES):
        out[f"escape-{i}"] = payload.replace("MARKER", "/tmp/reflex-fuzz-escaped").encode() + b"\x00" + json.dumps(conversations[0]).encode()
    return out


if __name__ == "__main__":
    common.fuzz(one_input, max_len=MAX_LEN, dictionary="jinja.dict")
