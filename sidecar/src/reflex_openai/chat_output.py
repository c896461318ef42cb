"""A chat model's output split, as it streams, into reasoning, content and tool calls, in the
markup Qwen3 (and the Hermes format it follows) writes:

    <think>\\nreasoning\\n</think>\\n\\ncontent<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>

Reasoning is recognised only where the output starts with `<think>`; tool calls only when the
request offered tools. Text that could still be the start of a marker is held back until it is
decided, so no markup is ever released as content; whatever else the model writes is content as
it came. Streaming and whole answers both come from here, so the two always agree.
"""
from __future__ import annotations

import json
import uuid
from typing import NamedTuple

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


class ToolCall(NamedTuple):
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it


class Piece(NamedTuple):
    """One part of the output: kind "reasoning" or "content" with text, or "tool_call" with call."""

    kind: str
    text: str = ""
    call: ToolCall | None = None


def parse_tool_call(body: str) -> ToolCall | None:
    """The call a `<tool_call>` block holds (`{"name": ..., "arguments": {...}}`), None if it is not one."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments", {}), dict)):
        return None
    arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False)
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", call["name"], arguments)


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
        self.state = "start"  # start, reasoning, content, call
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
        end = self.pending.find(CALL_CLOSE)
        if end < 0:
            if not final:
                return None
            text, self.pending, self.state = CALL_OPEN + self.pending, "", "content"  # cut short: not a call
            return [Piece("content", text)]
        body, self.pending = self.pending[:end], self.pending[end + len(CALL_CLOSE):]
        self.state, self.trim = "content", True
        call = parse_tool_call(body)
        return [Piece("tool_call", call=call) if call else Piece("content", CALL_OPEN + body + CALL_CLOSE)]

    def _release(self, kind: str, marker: str, final: bool):
        """All but what could begin the marker and, before it, trailing whitespace (dropped if the marker comes)."""
        text = self.pending
        if not final:
            text = text[:len(text) - _undecided(text, marker)].rstrip()
        self.pending = self.pending[len(text):]
        return [Piece(kind, text)] if text else None
