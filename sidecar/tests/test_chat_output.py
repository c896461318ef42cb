"""chat_output.py on random outputs (random_outputs.py): reasoning, content and tool calls as the
markup means them, the same however the text is cut into pieces."""
import os
import random

import pytest

from random_outputs import output, split, without_tools
from reflex_openai.chat_output import ChatOutput

SEED = int.from_bytes(os.urandom(4), "little")  # printed in a failure's parameters: rerun with it


def parsed(pieces: list[str], tools: bool) -> dict:
    out = ChatOutput(tools)
    got = [p for piece in pieces for p in out.feed(piece)] + out.finish()
    calls = []
    for p in got:
        if p.kind == "call":
            calls.append({"name": p.call.name, "arguments": ""})
        elif p.kind == "arguments":
            calls[-1]["arguments"] += p.text
    content = "".join(p.text for p in got if p.kind == "content")
    reasoning = "".join(p.text for p in got if p.kind == "reasoning")
    return {"reasoning": reasoning or None, "content": content or (None if calls else ""), "calls": calls}


@pytest.mark.parametrize("seed", [SEED + i for i in range(300)])
def test_random_outputs_split_anywhere(seed):
    rng = random.Random(seed)
    text, expected = output(rng, ["get_weather", "f-2"])
    assert parsed(split(rng, text), tools=True) == expected
    assert parsed([text], tools=True) == expected
    # without tools, tool-call markup is plain content
    assert parsed(split(rng, text), tools=False) == {"reasoning": expected["reasoning"], "calls": [],
                                                     "content": without_tools(text, expected)}


@pytest.mark.parametrize("text", ["<tool_call>\nnot json\n</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                                  '<tool_call>{"arguments": [1], "name": "f"}</tool_call>', '<tool_call>\n{"name"'])
def test_what_is_not_a_tool_call_stays_content(text):
    assert parsed(list(text), tools=True) == {"reasoning": None, "content": text, "calls": []}


def test_a_call_cut_short_after_its_name_keeps_what_was_written():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": [1, '
    assert parsed(list(text), tools=True) == {"reasoning": None, "content": None,
                                              "calls": [{"name": "f", "arguments": '{"a": [1, '}]}


def test_arguments_stream_as_they_come():
    out = ChatOutput(tools=True)
    pieces = [p for c in '<tool_call>\n{"name": "f", "arguments": {"a": "x}y", "b": {"c": 1}}}\n</tool_call>'
              for p in out.feed(c)] + out.finish()
    assert [p.kind for p in pieces][:2] == ["call", "arguments"] and len(pieces) > 5
    assert "".join(p.text for p in pieces) == '{"a": "x}y", "b": {"c": 1}}'


def test_ids_are_unique_and_no_markup_is_released_early():
    out = ChatOutput(tools=True)
    released = [p for c in '<think>hm</think>Hi <tool_call>{"name": "f", "arguments": {}}</tool_call>' for p in out.feed(c)]
    assert all("<" not in p.text and not p.text.endswith("}}") for p in released)
    ids = {p.call.id for p in released + out.finish() if p.call}
    out = ChatOutput(tools=True)
    again = out.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>') + out.finish()
    assert len(ids) == 1 and again[0].call.id not in ids and again[0].call.id.startswith("call_")
