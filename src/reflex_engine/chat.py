"""Chat templates (`tokenizer.chat_template`), rendered as transformers' `apply_chat_template`
renders them (transformers 5: `transformers/utils/chat_template_utils.py`).

The same jinja2 environment: ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks,
loop controls (`{% break %}`, `{% continue %}`), the `{% generation %}` tag (transformers marks
the assistant's text with it; its body renders as it is), transformers' `tojson` (json.dumps and
its options, not jinja2's HTML-escaping one), `raise_exception`, `strftime_now`, and its `dict`
and `namespace`, which expose nothing of Python. The same inputs: the keys set to None dropped
from each message, a message's reasoning also under the names templates read
(`reasoning_content`, `thinking`), everything rebuilt from plain JSON types.

Templates come with the GGUF, so they are untrusted: the sandbox keeps Python out of reach, and
a render is bounded, by counting rather than by a timer:
- MAX_STEPS steps: each loop iteration, call, filter, `~` and write is one, which ends runaway
  loops and recursion;
- MAX_CHARS characters written, counting the text that macros and blocks buffer;
- no value longer than MAX_CHARS from `~`, `+`, `%`, a filter or a call (which ends doubling),
  and `*` and `**` refused before they build one ('x' * 10**9, 9 ** 999999);
- MAX_SECONDS of wall time, looked at with each step: a step's own cost grows with the values
  it touches (`big | list` on a 4M-character string is ~25 ms), so steps alone do not bound time;
- the operations whose result can dwarf their operands refused before they run when it would be
  longer than MAX_CHARS: padding to a width or precision (`'%999999999s' % x`, `ljust`, `center`,
  `indent`, `'{:>999999999}'.format`), `replace`, `join`, `~` over many operands, `lipsum` and
  `batch` with a fill; and no constant folding (jinja2's optimizer would run filters at compile
  time, outside every bound).
What is left: a container holding many references to one long string (`[big] * 250` is refused,
a literal `[big, big, ...]` is not) can be as long as MAX_CHARS times its length when printed or
passed to `tojson` before the result is refused. Whatever goes wrong is one ReflexError line.

jinja2 is imported at the first render, not with this module: it is not on the plain cold path.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from time import monotonic
from typing import Any

from .errors import ReflexError

MAX_STEPS = 1_000_000  # a few seconds of CPython at most; real templates take 15-300 per message
MAX_SECONDS = 10.0  # real templates render in well under 10 ms
MAX_CHARS = 4 << 20  # ~1M tokens, more than any context we run
_MAX_BITS = 1 << 16  # of an integer that `*` or `**` builds

# render_chat's own parameters: template variables (its **kwargs) cannot take these names
OWN_PARAMETERS = ("template", "messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token",
                  "continue_final_message")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates read
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                tools: list[dict] | None = None, documents: list[dict] | None = None,
                bos_token: str | None = None, eos_token: str | None = None,
                continue_final_message: bool | str = False, **kwargs: Any) -> str:
    """`template` rendered as transformers' `tokenizer.apply_chat_template(messages,
    tokenize=False, ...)` renders it.

    tools: JSON schemas (`{"type": "function", "function": {...}}`); documents: dicts (e.g. with
    "title" and "text"); kwargs: more template variables (e.g. `enable_thinking=False`). A token
    left None is undefined in the template, as a tokenizer's missing token is in transformers.
    continue_final_message: end inside the last message (its "content", or the field named) so
    that the model continues it; it takes the place of add_generation_prompt, so pass that False.
    """
    if continue_final_message and add_generation_prompt:
        raise ReflexError("continue_final_message and add_generation_prompt exclude each other")
    if not isinstance(messages, (list, tuple)):
        raise ReflexError(f"chat messages must be a list, not {type(messages).__name__}")
    chat = [_message(m) for m in messages]
    for name, items in (("tools", tools), ("documents", documents)):
        if items is not None and not (isinstance(items, (list, tuple)) and all(isinstance(i, Mapping) for i in items)):
            raise ReflexError(f"{name} must be a list of dicts (tools: JSON schemas)")
    tokens = {name: text for name, text in (("bos_token", bos_token), ("eos_token", eos_token)) if text is not None}
    variables = _plain({**tokens, **kwargs})
    continued = _mark_final_message(chat, template, continue_final_message) if continue_final_message else None

    text = _render(_compile(template), messages=chat, tools=_plain(tools), documents=_plain(documents),
                   add_generation_prompt=add_generation_prompt, **variables)
    return text if continued is None else _cut_at_tag(text, continued)


# ---- the inputs, prepared as transformers prepares them

def _message(message: Any) -> dict:
    if not isinstance(message, dict):
        raise ReflexError(f"a chat message must be a dict, not {type(message).__name__}")
    # APIs send content=None or tool_calls=None; templates handle a missing key, not a None
    message = _plain({key: value for key, value in message.items() if value is not None})
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    # "thinking" for the templates that read that name (gpt-oss), unless the message has its own
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value: Any) -> Any:
    """A copy in plain JSON types (tuples stay tuples), so that the template reaches no method
    beyond theirs. transformers puts a placeholder for other objects (images, of which a template
    only checks the presence); Reflex takes text and refuses them."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # a subclass (str enum, numpy.float64): the base type's own method gives the base type
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    raise ReflexError(f"messages, tools, documents and template variables are JSON data, not {type(value).__name__}")


def _mark_final_message(chat: list[dict], template: str, field: bool | str) -> str:
    """Appends the tag to the text the model is to continue; returns that text."""
    field = field if isinstance(field, str) else "content"
    if not chat or chat[-1].get(field) is None:
        raise ReflexError(f"continue_final_message: the last message has no {field!r} to continue")
    last, text = chat[-1], chat[-1][field]
    # reasoning is there under several names: tag every copy, whichever the template reads
    fields = [f for f in _REASONING_FIELDS if last.get(f) == text] if field in _REASONING_FIELDS else [field]
    if not any(f in template for f in fields):
        raise ReflexError(f"continue_final_message: the chat template does not read {field!r}")
    if isinstance(text, (list, tuple)):  # content blocks: continue the last text block
        block = next((b for b in reversed(text) if isinstance(b, dict) and isinstance(b.get("text"), str)), None)
        if block is None:
            raise ReflexError("continue_final_message: the last message has no text to continue")
        text, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
    elif isinstance(text, str):
        for f in fields:
            last[f] = text + _CONTINUE_TAG
    else:
        raise ReflexError(f"continue_final_message: the last message's {field!r} is not text")
    return text


def _cut_at_tag(text: str, continued: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if continued.strip() not in text or tag not in text:
        raise ReflexError("continue_final_message: the chat template does not render the last message as given")
    at = text.rindex(tag)
    # where the tag's space survived the template kept the message as it is; where not, it
    # stripped the message, so strip before the tag too
    return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()


# ---- compiling and rendering, bounded

class _Budget:
    """What is left to one render (see the module's docstring)."""

    def __init__(self):
        self.steps, self.chars = MAX_STEPS, MAX_CHARS
        self.deadline = monotonic() + MAX_SECONDS


_budget: ContextVar[_Budget] = ContextVar("chat_template_budget")


@lru_cache(maxsize=16)
def _compile(template: str):
    from jinja2 import TemplateSyntaxError

    env = _environment()
    try:
        return env.from_string(env.parse_bounded(template))
    except TemplateSyntaxError as e:
        raise ReflexError(f"chat template has a syntax error at line {e.lineno}: {_one_line(e.message)}") from None
    except Exception as e:
        raise ReflexError(f"chat template failed to compile: {_reason(e)}") from None


def _render(compiled, **variables: Any) -> str:
    token = _budget.set(_Budget())
    try:
        return compiled.render(**variables)
    except ReflexError:
        raise
    except Exception as e:
        raise ReflexError(f"chat template failed: {_reason(e)}") from None
    finally:
        _budget.reset(token)


def _step() -> None:
    budget = _budget.get()
    budget.steps -= 1
    if budget.steps < 0:
        raise ReflexError(f"chat template failed: it ran past {MAX_STEPS:,} steps")
    if monotonic() > budget.deadline:
        raise ReflexError(f"chat template failed: it ran past {MAX_SECONDS:g} seconds")


def _written(value: Any) -> str:
    text = str(value)  # what jinja2 writes for the value
    budget = _budget.get()
    budget.chars -= len(text)
    if budget.chars < 0:
        raise ReflexError(f"chat template failed: it wrote over {MAX_CHARS:,} characters")
    return text


def _sized(value: Any) -> Any:
    if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_CHARS:
        raise ReflexError(f"chat template failed: it built a value of over {MAX_CHARS:,} items")
    return value


def _check_binop(operator: str, left: Any, right: Any) -> None:
    ints = isinstance(left, int) and isinstance(right, int)
    if operator == "*" and ints:
        too_big = left.bit_length() + right.bit_length() > _MAX_BITS
    elif operator == "*":
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        too_big = isinstance(seq, (str, list, tuple)) and isinstance(n, int) and _weight(seq) * n > MAX_CHARS
    elif operator == "**":
        too_big = ints and abs(left) > 1 and right * abs(left).bit_length() > _MAX_BITS
    else:
        too_big = operator == "%" and _printf_size(left, right) > MAX_CHARS
    if too_big:
        raise ReflexError(f"chat template failed: {operator!r} would build a value past the limits")


def _weight(seq: Any) -> int:
    """Characters and items in a sequence, one level down: what `seq * n` multiplies."""
    if isinstance(seq, str):
        return len(seq)
    return sum(len(item) if isinstance(item, (str, list, tuple, dict)) else 1 for item in seq) or len(seq)


def _refuse_over(size: int, what: str) -> None:
    if size > MAX_CHARS:
        raise ReflexError(f"chat template failed: {what} would build a value past the limits")


_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?")


def _number(digits: str) -> int:
    return int(digits) if len(digits) < 12 else MAX_CHARS + 1


def _ints(values: Any) -> list[int]:
    items = values.values() if isinstance(values, Mapping) else values if isinstance(values, (list, tuple)) else (values,)
    return [v for v in items if isinstance(v, int)]


def _printf_size(text: Any, values: Any) -> int:
    """The widest field of `text % values` (a width or precision)."""
    if not isinstance(text, str) or "%" not in text:
        return 0
    widest = 0
    for field in _PRINTF_FIELD.findall(text):
        for n in field:
            widest = max(widest, *_ints(values), 0) if n == "*" else max(widest, _number(n) if n else 0)
    return widest


def _format_size(text: str, args: tuple, kwargs: dict) -> int:
    """The widest field of `text.format(...)`: the numbers in its format specs, and any argument
    when a spec takes one (`{:{width}}`)."""
    from string import Formatter

    widest = 0
    try:
        for _, _, spec, _ in Formatter().parse(text):
            if spec:
                widest = max(widest, 0, *map(_number, re.findall(r"\d+", spec)))
                if "{" in spec:
                    widest = max(widest, 0, *_ints(args), *_ints(kwargs))
    except ValueError:
        return 0  # format itself raises on it
    return widest


def _replaced_size(text: Any, old: Any, new: Any, count: Any = -1) -> int:
    if not (isinstance(text, str) and isinstance(old, str) and isinstance(new, str) and isinstance(count, int)):
        return 0
    n = len(text) + 1 if old == "" else text.count(old)
    n = n if count < 0 else min(n, count)
    return len(text) + n * (len(new) - len(old))


def _joined_size(separator: Any, items: Any) -> int:
    if not (isinstance(separator, str) and isinstance(items, (list, tuple))):
        return 0
    return len(separator) * max(len(items) - 1, 0) + sum(len(i) for i in items if isinstance(i, str))


def _check_call(obj: Any, args: tuple, kwargs: dict) -> None:
    """A str method whose result would be longer than MAX_CHARS is refused before it runs."""
    obj = getattr(obj, "__wrapped__", obj)  # the sandbox's wrapper of str.format
    text, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(text, str):
        return
    if name in ("center", "ljust", "rjust", "zfill"):
        size = max(_ints(args[:1]), default=0)
    elif name == "expandtabs":
        size = len(text) + text.count("\t") * max(_ints(args[:1]) or _ints(kwargs) or [8])
    elif name == "replace":
        size = _replaced_size(text, *args[:3], **{k: v for k, v in kwargs.items() if k == "count"}) if len(args) >= 2 else 0
    elif name == "join":
        size = _joined_size(text, args[0]) if args else 0
    elif name in ("format", "format_map"):
        size = _format_size(text, args, kwargs)
    else:
        return
    _refuse_over(size, f"str.{name}")


def _bounded_filters(filters: dict) -> dict:
    """jinja2's filters that can build far more than they are given, checked first."""
    from jinja2.filters import pass_eval_context

    center, indent, format_, replace, join, batch = (filters[n] for n in ("center", "indent", "format", "replace", "join", "batch"))

    def do_center(value, width=80):
        _refuse_over(max(_ints(width), default=0), "center")
        return center(value, width)

    def do_indent(s, width=4, first=False, blank=False):
        if isinstance(s, str):
            pad = width if isinstance(width, int) else len(width) if isinstance(width, str) else 0
            _refuse_over(len(s) + (s.count("\n") + 1) * pad, "indent")
        return indent(s, width, first, blank)

    def do_format(value, *args, **kwargs):
        _refuse_over(_printf_size(value, kwargs or args), "format")
        return format_(value, *args, **kwargs)

    @pass_eval_context
    def do_replace(eval_ctx, s, old, new, count=None):
        _refuse_over(_replaced_size(s, old, new, -1 if count is None else count), "replace")
        return replace(eval_ctx, s, old, new, count)

    @pass_eval_context
    def do_join(eval_ctx, value, d="", attribute=None):
        if attribute is None and not isinstance(value, (str, list, tuple, dict)) and hasattr(value, "__iter__"):
            value = list(value)  # a generator: its items are references, its text is what join builds
        if attribute is None:
            _refuse_over(_joined_size(d, value), "join")
        return join(eval_ctx, value, d, attribute)

    def do_batch(value, linecount, fill_with=None):
        if fill_with is not None:
            _refuse_over(max(_ints(linecount), default=0), "batch")
        return batch(value, linecount, fill_with)

    return {"center": do_center, "indent": do_indent, "format": do_format, "replace": do_replace, "join": do_join,
            "batch": do_batch}


def _bounded_lipsum(lipsum):
    def bounded(n=5, html=True, min=20, max=100):
        words = (n if isinstance(n, int) else 0) * (max if isinstance(max, int) else 0)
        _refuse_over(words * 16, "lipsum")  # no word of its list is longer than 15
        return lipsum(n, html, min, max)

    return bounded


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {_one_line(e)}"


def _one_line(message: Any, limit: int = 300) -> str:
    text = " ".join(str(message).split()) or "(no message)"
    return text if len(text) <= limit else text[:limit] + "..."


# ---- the template's globals and filters, as transformers defines them

def _raise_exception(message: Any) -> None:
    raise ReflexError(f"chat template failed: {_one_line(message)}")


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML, and takes only indent
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Dict:
    """The template's `dict`: makes dicts and, unlike the dict type, has no other attribute."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


def _public_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise ReflexError(f"chat template failed: a namespace cannot hold {name!r} (no names starting with '_')")


@lru_cache(maxsize=1)
def _environment():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace
    from jinja2.visitor import NodeTransformer

    if tuple(int(n) for n in re.findall(r"\d+", jinja2.__version__)[:3]) < (3, 1, 6):
        # older sandboxes have known escapes (CVE-2024-56326, CVE-2025-27516)
        raise ReflexError(f"chat templates need jinja2>=3.1.6, this is {jinja2.__version__}: pip install -U jinja2")

    class Bounds(NodeTransformer):
        """Routes a parsed template's loops, writes, filters and `~` through the sandbox's
        checks, as calls of its methods (so each is a step too)."""

        def visit_For(self, node):
            node = self.generic_visit(node)
            node.iter = self.wrap("counted", node.iter)
            return node

        def visit_Output(self, node):  # all text, also what a macro or a {% set %} block buffers
            node = self.generic_visit(node)
            node.nodes = [self.wrap("written", nodes.Const(n.data) if isinstance(n, nodes.TemplateData) else n)
                          for n in node.nodes]
            return node

        def visit_Concat(self, node):  # a ~ b ~ c: one join, sized before it is built
            node = self.generic_visit(node)
            return self.wrap("concatenated", nodes.List(node.nodes, lineno=node.lineno))

        def visit_Filter(self, node):  # a {% filter %} block's filter has no node: its text is written
            node = self.generic_visit(node)
            return node if node.node is None else self.wrap("sized", node)

        @staticmethod
        def wrap(method, node):
            return nodes.Call(nodes.EnvironmentAttribute(method), [node], [], None, None, lineno=node.lineno)

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"+", "*", "**", "%"})
        written, sized = staticmethod(_written), staticmethod(_sized)

        def parse_bounded(self, source):
            ast = Bounds().visit(self.parse(source))
            ast.set_environment(self)
            return ast

        def call(self, context, obj, /, *args, **kwargs):  # every call in a template comes here
            _step()
            if getattr(obj, "__name__", None) == "join" and args and not isinstance(args[0], (str, list, tuple, dict)):
                args = (list(args[0]), *args[1:])  # str.join of a generator: sized as a list
            _check_call(obj, args, kwargs)
            return _sized(super().call(context, obj, *args, **kwargs))

        @staticmethod
        def concatenated(parts):
            texts = [part if isinstance(part, str) else str(part) for part in parts]
            _refuse_over(sum(map(len, texts)), "'~'")
            return "".join(texts)

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return _sized(super().call_binop(context, operator, left, right))

        def counted(self, iterable):
            for item in iterable:
                _step()
                yield item

    class Generation(Extension):
        """{% generation %}...{% endgeneration %}: transformers notes where the assistant's text
        is; the text is the body's."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class SafeNamespace(Namespace):
        """transformers' namespace: no names starting with '_', the way to Python's internals.
        (A Namespace answers attribute lookups from its own dict, hence the module-level check.)"""

        def __init__(*args, **kwargs):  # Namespace's signature, so that namespace(self=1) works
            attrs = dict(*args[1:], **kwargs)
            for name in attrs:
                _public_name(name)
            Namespace.__init__(args[0], attrs)

        def __setitem__(self, name, value):
            _public_name(name)
            Namespace.__setitem__(self, name, value)

    # optimized=False: no constant folding, which would run filters at compile time, unbounded
    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols], optimized=False)
    env.filters.update(_bounded_filters(env.filters), tojson=_tojson)
    env.globals["lipsum"] = _bounded_lipsum(env.globals["lipsum"])
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_Dict(), namespace=SafeNamespace)
    return env
