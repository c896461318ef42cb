"""Random chat outputs in Qwen3's markup, and what an OpenAI client should get from each: written
from the markup's definition (Qwen3's chat template and its tool-call instructions), not from the
sidecar's parser. Texts mix in pieces of the markers (`<tool`, `</think`, `<`) so that text held
back as a possible marker is exercised; whole markers appear only where they mean something.
Also random function tools, whose `parameters` have short instances (a random model finishes them).
"""
import json
import random
import string

MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
PARTS = ["a", "Z", "7", " ", "  ", "\n", "\t", "<", ">", "/", "<tool", "</think", "<think", "tool_call>", "{", "}",
         '"', "é", "日本", "😀", "\\", "call"]
BLANKS = ["", " ", "\n", "\n\n", " \n"]


def text(rng: random.Random, n: int = 12) -> str:
    """Random text that begins and ends with a non-blank and holds no whole marker."""
    while True:
        out = "".join(rng.choice(PARTS) for _ in range(rng.randint(1, n))).strip()
        if out and not any(m in out for m in MARKERS):
            return out


def value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["int", "str", "bool", "null", "list", "dict"] if depth < 2 else ["int", "str", "bool"])
    if kind == "int":
        return rng.randint(-10 ** 6, 10 ** 6)
    if kind == "str":
        return text(rng, 4)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {text(rng, 2): value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def output(rng: random.Random, names: list[str]) -> tuple[str, dict]:
    """A model's output and the message it means when tools were offered: reasoning, content and
    tool calls ({"name", "arguments"}: arguments as the JSON text OpenAI's API carries, the model's
    own where it wrote the name first, as Qwen3 is told to, else laid out as json.dumps does)."""
    reasoning = text(rng) if rng.random() < 0.6 else None
    content = text(rng) if rng.random() < 0.7 else ""
    calls = [{"name": rng.choice(names), "arguments": {text(rng, 2): value(rng) for _ in range(rng.randint(0, 3))},
              "name_first": rng.random() < 0.8, "separators": rng.choice([(", ", ": "), (",", ":")]),
              "ascii": rng.random() < 0.5} for _ in range(rng.randint(0, 2))]
    out = ""
    if reasoning is not None:
        out += "<think>" + rng.choice(BLANKS) + reasoning + rng.choice(BLANKS) + "</think>" + rng.choice(BLANKS)
    out += content
    for call in calls:
        keys = ["name", "arguments"] if call["name_first"] else ["arguments", "name"]
        body = json.dumps({key: call[key] for key in keys}, ensure_ascii=call["ascii"], separators=call["separators"])
        out += rng.choice(BLANKS) + "<tool_call>" + rng.choice(BLANKS) + body + rng.choice(BLANKS) + "</tool_call>"
    out += rng.choice(BLANKS) if calls else ""
    expected = {"reasoning": reasoning, "content": content or (None if calls else ""),
                "calls": [{"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=c["ascii"],
                                                                      separators=c["separators"])
                           if c["name_first"] else json.dumps(c["arguments"], ensure_ascii=False)} for c in calls]}
    return out, expected


def without_tools(out: str, expected: dict) -> str:
    """The content when no tools were offered: everything after the reasoning, markup and all."""
    if expected["reasoning"] is None:
        return out
    return out.split("</think>", 1)[1].lstrip()


def split(rng: random.Random, out: str) -> list[str]:
    """The text cut at random places, as an engine releases it token by token."""
    cuts = sorted(rng.sample(range(1, len(out)), min(len(out) - 1, rng.randint(0, len(out))))) if len(out) > 1 else []
    return [out[a:b] for a, b in zip([0, *cuts], [*cuts, len(out)])]


def random_name(rng) -> str:
    return rng.choice(string.ascii_letters) + "".join(rng.choices(string.ascii_letters + string.digits + "_-",
                                                                  k=rng.randint(0, 12)))


def random_parameters(rng) -> dict:
    """A random object schema whose instances are short."""
    properties = {}
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["enum", "integer", "boolean", "string"])
        if kind == "enum":
            schema = {"type": "string", "enum": [random_name(rng) for _ in range(rng.randint(1, 4))]}
        elif kind == "integer":
            low = rng.randint(-1000, 1000)
            schema = {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 50)}
        elif kind == "string":
            schema = {"type": "string", "maxLength": rng.randint(0, 6)}
        else:
            schema = {"type": "boolean"}
        properties[random_name(rng)] = schema
    required = rng.sample(sorted(properties), rng.randint(0, len(properties)))
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def random_tools(rng, n: int) -> list[dict]:
    names = set()
    while len(names) < n:
        names.add(random_name(rng))
    return [{"type": "function", "function": {"name": name, "description": f"does {name}",
                                              "parameters": random_parameters(rng)}} for name in sorted(names)]
