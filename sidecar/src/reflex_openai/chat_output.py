"""A chat model's output split, as it streams, into reasoning, content and tool calls, in the
markup Qwen3 (and the Hermes format it follows) writes:

    <think>\\nreasoning\\n</think>\\n\\ncontent<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>

Reasoning is recognised only where the output starts with `<think>`; tool calls only when the
request offered tools. Text that could still be the start of a marker is held back until it is
decided, so no markup is ever released as content; whatever else the model writes is content as
it came. Streaming and whole answers both come from here, so the two always agree.

A call written name first, as Qwen3 is told to write it, is released as soon as its name is
known, and its arguments as they come (the JSON text as the model wrote it); one written in
another order is released whole at its `</tool_call>`, its arguments as JSON text of our own.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import NamedTuple

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# The head of a call written name first: {"name": "NAME", "arguments": (then the arguments' JSON, then "}")
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


class ToolCall(NamedTuple):
    id: str
    name: str


class Piece(NamedTuple):
    """One part of the output: "reasoning" or "content" text; a tool call's start ("call", with its id
    and name), then its "arguments" text, in one piece or several."""

    kind: str
    text: str = ""
    call: ToolCall | None = None


def _new_call(name: str) -> Piece:
    return Piece("call", call=ToolCall(f"call_{uuid.uuid4().hex[:24]}", name))


def _whole_call(body: str) -> list[Piece] | None:
    """The pieces of a `<tool_call>` block's `{"name": ..., "arguments": {...}}`, None if it is not one."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments", {}), dict)):
        return None
    return [_new_call(call["name"]), Piece("arguments", json.dumps(call.get("arguments", {}), ensure_ascii=False))]


def _undecided(text: str, marker: str) -> int:
    """How many characters at the end of text could begin the marker (and must wait)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ChatOutput:
    """feed() the output's text as it comes, then finish(); each returns the pieces now decided."""

    def __init__(self, tools: bool):
        self.tools = tools  # whether `<tool_call>` blocks are calls (the request offered tools)
        self.state = "start"  # start, reasoning, content, call (before its name), arguments
        self.pending = ""  # text not yet released
        self.trim = False  # drop the whitespace that follows a closed marker

    def feed(self, text: str) -> list[Piece]:
        self.pending += text
        return self._advance(final=False)

    def finish(self) -> list[Piece]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        while self.pending or final:
            if self.trim:
                self.pending = self.pending.lstrip()
                if not self.pending and not final:
                    break
                self.trim = False
            step = getattr(self, f"_{self.state}")(final)
            if step is None:  # undecided until more text comes (or nothing left at the end)
                break
            pieces.extend(step)
        return [p for p in pieces if p.text or p.call]

    def _start(self, final: bool):
        if self.pending.startswith(THINK_OPEN):
            self.pending, self.state, self.trim = self.pending[len(THINK_OPEN):], "reasoning", True
            return []
        if THINK_OPEN.startswith(self.pending) and not final:
            return None
        self.state = "content"
        return []

    def _reasoning(self, final: bool):
        end = self.pending.find(THINK_CLOSE)
        if end >= 0:
            text, self.pending = self.pending[:end].rstrip(), self.pending[end + len(THINK_CLOSE):]
            self.state, self.trim = "content", True
            return [Piece("reasoning", text)]
        return self._release("reasoning", THINK_CLOSE, final)

    def _content(self, final: bool):
        if not self.tools:
            text, self.pending = self.pending, ""
            return [Piece("content", text)] if text else None
        start = self.pending.find(CALL_OPEN)
        if start >= 0:
            text, self.pending = self.pending[:start].rstrip(), self.pending[start + len(CALL_OPEN):]
            self.state = "call"
            return [Piece("content", text)]
        return self._release("content", CALL_OPEN, final)

    def _call(self, final: bool):
        head = _HEAD.match(self.pending)
        if head:
            self.pending, self.state, self.trim = self.pending[head.end():], "arguments", True
            return [_new_call(json.loads(head.group(1)))]
        end = self.pending.find(CALL_CLOSE)
        if end < 0:
            if not final:
                return None  # its head may still come, or the block is read whole
            text, self.pending, self.state = CALL_OPEN + self.pending, "", "content"  # cut short: not a call
            return [Piece("content", text)]
        body, self.pending = self.pending[:end], self.pending[end + len(CALL_CLOSE):]
        self.state, self.trim = "content", True
        return _whole_call(body) or [Piece("content", CALL_OPEN + body + CALL_CLOSE)]

    def _arguments(self, final: bool):
        """The arguments' text, all but the call's own closing brace (held back: any "}" may be it)."""
        end = self.pending.find(CALL_CLOSE)
        if end >= 0:
            text = self.pending[:end].rstrip()
            self.pending, self.state, self.trim = self.pending[end + len(CALL_CLOSE):], "content", True
            return [Piece("arguments", text[:-1].rstrip() if text.endswith("}") else text)]
        if final:  # cut short: what was written
            text, self.pending, self.state = self.pending, "", "content"
            return [Piece("arguments", text)]
        brace = self.pending.rfind("}")
        cut = min(len(self.pending) - _undecided(self.pending, CALL_CLOSE), brace if brace >= 0 else len(self.pending))
        text = self.pending[:cut].rstrip()
        self.pending = self.pending[len(text):]
        return [Piece("arguments", text)] if text else None

    def _release(self, kind: str, marker: str, final: bool):
        """All but what could begin the marker and, before it, trailing whitespace (dropped if the marker comes)."""
        text = self.pending
        if not final:
            text = text[:len(text) - _undecided(text, marker)].rstrip()
        self.pending = self.pending[len(text):]
        return [Piece(kind, text)] if text else None
