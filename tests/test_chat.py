"""Chat templates: rendered as transformers renders them, inside jinja2's sandbox.

The reference is transformers' own `apply_chat_template(..., tokenize=False)` (a tokenizer built
here, no download) on real templates: tests/chat_templates/ (see its README), the demo model's
GGUF and the goldens'. Every pair must be the same string; where transformers raises, we must
raise a one-line ReflexError that carries its message.
"""
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, models

from reflex_engine import chat
from reflex_engine.chat import render_chat
from reflex_engine.demo import demo_model_path
from reflex_engine.engine import ModelFile
from reflex_engine.errors import ReflexError

from model_files import GOLDEN_QWEN3, rewrite

TEMPLATES = Path(__file__).parent / "chat_templates"
GOLDENS = Path(__file__).parent / "goldens"

# (bos_token, eos_token) in each family's style; None: the tokenizer has none
TOKENS = {
    "Qwen-Qwen3-0.6B": (None, "<|im_end|>"),
    "Qwen-Qwen2.5-7B-Instruct": (None, "<|im_end|>"),
    "Qwen3.5-4B": (None, "<|im_end|>"),
    "Qwen-QwQ-32B": (None, "<|im_end|>"),
    "meta-llama-Llama-3.1-8B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("<s>", "</s>"),
    "Mistral-Small-3.2-24B-Instruct-2506": ("<s>", "</s>"),
    "google-gemma-2-2b-it": ("<bos>", "<eos>"),
    "google-gemma-4-31B-it": ("<bos>", "<eos>"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "deepseek-ai-DeepSeek-V3.1": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "microsoft-Phi-3.5-mini-instruct": ("<s>", "<|endoftext|>"),
    "HuggingFaceTB-SmolLM3-3B": (None, "<|im_end|>"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("<|begin_of_text|>", "<|im_end|>"),
    "openai-gpt-oss-120b": ("<|startoftext|>", "<|return|>"),
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    "ibm-granite-granite-3.3-2B-Instruct": ("<|end_of_text|>", "<|end_of_text|>"),
    "LFM2.5-8B-A1B": ("<|startoftext|>", "<|im_end|>"),
    "NVIDIA-Nemotron-Nano-v2": ("<s>", "</s>"),
    "GLM-4.6": (None, "<|endoftext|>"),
}

# Text that jinja2's own tojson would HTML-escape or \u-escape: <, >, &, ' and non-ASCII.
TOOLS = [{"type": "function", "function": {
    "name": "get_weather",
    "description": "Current weather for a city; 'units' < or & \"quoted\" — café",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "e.g. Zürich, 東京"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}]
CALL = {"id": "abc123def", "type": "function",  # a 9-character id, as Mistral's templates require
        "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}}
STRING_CALL = {**CALL, "function": {**CALL["function"], "arguments": '{"city": "Zürich"}'}}  # OpenAI's form
DOCUMENTS = [{"title": "Zürich <weather>", "text": "Sunny & warm, 24 °C."}, {"title": "Paris", "text": "Rain."}]

SYSTEM_USER = [{"role": "system", "content": "You are terse. Use <b> & 'quotes'."},
               {"role": "user", "content": "Hi — naïve café 東京 <x> & y"}]
MULTI_TURN = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
              {"role": "user", "content": "And 3+3?"}]
SYSTEM_MULTI_TURN = [{"role": "system", "content": "Be brief."}, *MULTI_TURN]
TOOL_USE = [{"role": "user", "content": "Weather in Zürich?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "abc123def", "name": "get_weather", "content": '{"temp": 24}'},
            {"role": "assistant", "content": "24 °C and sunny."},
            {"role": "user", "content": "Thanks!"}]
TOOL_USE_CONTENT_NONE = [TOOL_USE[0], {**TOOL_USE[1], "content": None}, *TOOL_USE[2:]]  # None: the key is dropped
TOOL_USE_STRING_ARGS = [TOOL_USE[0], {"role": "assistant", "content": "", "tool_calls": [STRING_CALL]}, TOOL_USE[2]]
THINKING = [{"role": "user", "content": "Why is the sky blue?"},
            {"role": "assistant", "reasoning_content": "Scattering goes as 1/λ⁴.", "content": "Scattering."},
            {"role": "user", "content": "Sure?"}]
# templates show the reasoning of the turns after the last user message only
THINKING_LAST = THINKING[:2]
THINKING_OLD_NAME = [THINKING[0], {"role": "assistant", "reasoning": "Short light scatters.", "content": "Yes."}]
PREFILL = [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "Autumn moonlight — "}]

# name -> (messages, keyword arguments); each runs with add_generation_prompt True and False
CASES = {
    "system_user": (SYSTEM_USER, {}),
    "multi_turn": (MULTI_TURN, {}),
    "system_multi_turn": (SYSTEM_MULTI_TURN, {}),
    "tool_use": (TOOL_USE, {"tools": TOOLS}),
    "tool_use_content_none": (TOOL_USE_CONTENT_NONE, {"tools": TOOLS}),
    "tool_use_string_args": (TOOL_USE_STRING_ARGS, {"tools": TOOLS}),
    "tools_empty": (MULTI_TURN, {"tools": []}),
    "thinking": (THINKING, {}),
    "thinking_on": (THINKING, {"enable_thinking": True}),
    "thinking_off": (THINKING, {"enable_thinking": False}),
    "thinking_last": (THINKING_LAST, {}),
    "thinking_old_name": (THINKING_OLD_NAME, {}),
    "documents": (SYSTEM_USER, {"documents": DOCUMENTS}),
    "tools_documents_date": (TOOL_USE, {"tools": TOOLS, "documents": DOCUMENTS, "date_string": "01 Dec 2026"}),
    "continue_final_message": (PREFILL, {"continue_final_message": True}),
}


def template(name):
    return (TEMPLATES / f"{name}.jinja").read_text()


@pytest.fixture(scope="module")
def hf():
    """transformers' apply_chat_template(tokenize=False) with the given special tokens."""
    # a test dependency from Python 3.11 on (see pyproject.toml)
    PreTrainedTokenizerFast = pytest.importorskip("transformers", minversion="5.23").PreTrainedTokenizerFast
    tokenizers = {}

    def render(template, messages, bos_token=None, eos_token=None, **kwargs):
        if (bos_token, eos_token) not in tokenizers:
            vocab = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
            tokenizers[bos_token, eos_token] = PreTrainedTokenizerFast(
                tokenizer_object=vocab, bos_token=bos_token, eos_token=eos_token)
        return tokenizers[bos_token, eos_token].apply_chat_template(
            messages, chat_template=template, tokenize=False, **kwargs)

    return render


def assert_same(ours, theirs):
    """Both render the same string, or both fail: ours with one line that carries theirs."""
    try:
        expected = theirs()
    except Exception as e:
        with pytest.raises(ReflexError) as ours_error:
            ours()
        message = str(ours_error.value)
        assert "\n" not in message
        assert " ".join(str(e).split())[:200] in message
        return False
    assert ours() == expected
    return True


def test_the_vendored_templates_are_the_ones_listed():
    assert sorted(p.stem for p in TEMPLATES.glob("*.jinja")) == sorted(TOKENS)
    readme = (TEMPLATES / "README.md").read_text()
    assert all(f"{name}.jinja" in readme for name in TOKENS)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", TOKENS)
def test_real_templates_render_as_in_transformers(hf, name, case):
    messages, kwargs = CASES[case]
    bos, eos = TOKENS[name]
    for add_generation_prompt in ([False] if "continue_final_message" in kwargs else [True, False]):
        assert_same(lambda: render_chat(template(name), messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=bos, eos_token=eos, **kwargs),
                    lambda: hf(template(name), messages, bos, eos, add_generation_prompt=add_generation_prompt,
                               **kwargs))


@pytest.mark.parametrize("name", TOKENS)
def test_every_template_renders_real_conversations(hf, name):
    # both failing on everything would also be "the same": check that they render
    bos, eos = TOKENS[name]
    rendered = {case: assert_same(
        lambda: render_chat(template(name), messages, add_generation_prompt=False, bos_token=bos, eos_token=eos,
                            **kwargs),
        lambda: hf(template(name), messages, bos, eos, add_generation_prompt=False, **kwargs))
        for case, (messages, kwargs) in CASES.items()}
    assert sum(rendered.values()) >= 3, rendered


@pytest.mark.parametrize("path", ["demo", *(str(p) for p in sorted(GOLDENS.glob("*/*-F32.gguf")))],
                         ids=os.path.basename)
def test_gguf_templates_render_as_in_transformers(hf, path):
    # the templates that ship in GGUFs here, through ModelFile: the demo model's and the goldens'
    file = ModelFile(demo_model_path() if path == "demo" else path)
    tok = file.tokenizer
    bos, eos = (tok.decode([i], special=True) for i in (tok.bos_id, tok.eos_id))
    for case, (messages, kwargs) in CASES.items():
        for add_generation_prompt in ([False] if "continue_final_message" in kwargs else [True, False]):
            assert_same(lambda: file.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs),
                        lambda: hf(file.chat_template, messages, bos, eos,
                                   add_generation_prompt=add_generation_prompt, **kwargs))


def test_the_comparison_can_fail(hf):
    """jinja2's own sandbox (the old renderer) gives other strings, so the tests above can fail."""
    def plain_jinja(text, **variables):
        return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(text).render(**variables)

    qwen3 = template("Qwen-Qwen3-0.6B")
    expected = hf(qwen3, SYSTEM_USER, tools=TOOLS, add_generation_prompt=True)
    assert render_chat(qwen3, SYSTEM_USER, tools=TOOLS) == expected
    old = plain_jinja(qwen3, messages=SYSTEM_USER, tools=TOOLS, add_generation_prompt=True)
    assert old != expected and "\\u003c" in old and "Zürich" not in old and "Zürich" in expected
    with pytest.raises(Exception, match="generation"):  # LFM2.5 marks its assistant text
        plain_jinja(template("LFM2.5-8B-A1B"), messages=MULTI_TURN)


def test_chatml_template_from_the_gguf():
    file = ModelFile(GOLDEN_QWEN3)
    text = file.render_chat([{"role": "user", "content": "Hello"}])
    assert text == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    ids = file.encode(text, add_bos=False)
    assert ids[0] == 369 and ids.count(370) == 1  # <|im_start|> and <|im_end|> as single tokens
    assert file.render_chat([{"role": "user", "content": "Hello"}], add_generation_prompt=False) == \
        "<|im_start|>user\nHello<|im_end|>\n"


def test_a_call_with_tools_takes_the_tool_use_template():
    # transformers picks a tokenizer's "tool_use" template when tools are given
    file = ModelFile(GOLDEN_QWEN3)
    file.gguf.metadata["tokenizer.chat_template.tool_use"] = "{{ tools | map(attribute='function.name') | join }}"
    assert file.render_chat(MULTI_TURN, tools=TOOLS) == "get_weather"
    assert file.render_chat(MULTI_TURN).startswith("<|im_start|>user")


def test_own_parameters_are_render_chats():
    # a template variable of one of these names would collide with render_chat's own (generate refuses it)
    assert set(chat.OWN_PARAMETERS) == set(inspect.signature(render_chat).parameters) - {"kwargs"}


def test_whitespace_control_matches_transformers():
    # transformers renders with trim_blocks and lstrip_blocks
    template = "{% for m in messages %}\n    {{ m.content }}\n{% endfor %}"
    assert render_chat(template, [{"role": "user", "content": "x"}], bos_token="", eos_token="") == "    x\n"


def test_transformers_extras():
    messages = [{"role": "user", "content": "<é & ü>"}]
    assert render_chat("{{ messages[0] | tojson }}", messages) == '{"role": "user", "content": "<é & ü>"}'
    assert render_chat("{{ messages[0] | tojson(indent=1, sort_keys=true, separators=(',', ':')) }}", messages) == \
        '{\n "content":"<é & ü>",\n "role":"user"\n}'
    assert render_chat("{% generation %}{{ messages[0].role }}{% endgeneration %}", messages) == "user"
    assert render_chat("{% for i in range(9) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}", []) == "01"
    assert render_chat("{% for i in range(4) %}{% if i == 1 %}{% continue %}{% endif %}{{ i }}{% endfor %}",
                       []) == "023"
    assert render_chat("{{ strftime_now('%Y') | int > 2000 }}", []) == "True"
    assert render_chat("{{ dict(a=1) | tojson }} {{ namespace(x=2).x }}", []) == '{"a": 1} 2'
    assert render_chat("[{{ bos_token is defined }} {{ eos_token }}]", [], eos_token="</s>") == "[False </s>]"
    assert render_chat("{{ enable_thinking }} {{ add_generation_prompt }}", [], enable_thinking=False) == "False True"


def test_inputs_as_transformers_prepares_them():
    template = "{{ messages | tojson }}"
    assert render_chat(template, [{"role": "assistant", "content": None, "reasoning": "r"}]) == \
        '[{"thinking": "r", "role": "assistant", "reasoning": "r", "reasoning_content": "r"}]'
    with pytest.raises(ReflexError, match="must be a dict"):
        render_chat(template, ["hello"])
    with pytest.raises(ReflexError, match="are JSON data, not object"):
        render_chat(template, [{"role": "user", "content": object()}])
    with pytest.raises(ReflexError, match="tools must be a list of dicts"):
        render_chat(template, [], tools=["get_weather"])
    with pytest.raises(ReflexError, match="documents must be a list of dicts"):
        render_chat(template, [], documents=5)
    with pytest.raises(ReflexError, match="exclude each other"):
        render_chat(template, PREFILL, continue_final_message=True)


def test_raise_exception_is_a_clean_error():
    template = "{{ raise_exception('only user and\\nassistant roles are supported') }}"
    with pytest.raises(ReflexError, match="^chat template failed: only user and assistant roles are supported$"):
        render_chat(template, [], bos_token="", eos_token="")


@pytest.mark.parametrize("template, reason", [
    ("{% for m in messages %}\n{{ m.content }", "syntax error at line 2: unexpected '}'"),
    ("{{ messages | no_such_filter }}", "syntax error at line 1: No filter named 'no_such_filter'"),
    ("{% extends 'base.jinja' %}", "TypeError: no loader for this environment specified"),
    ("{{ messages[0].content.nothing.more }}", "UndefinedError: 'str object' has no attribute 'nothing'"),
    ("{{ messages[0].content + 1 }}", "TypeError: can only concatenate str"),
    ("{{ 1 / 0 }}", "ZeroDivisionError: division by zero"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError: maximum recursion depth exceeded"),
    ("{% set ns = namespace() %}{% set ns._hidden = 1 %}", "a namespace cannot hold '_hidden'"),
])
def test_whatever_the_template_raises_is_one_line(template, reason):
    with pytest.raises(ReflexError) as error:
        render_chat(template, [{"role": "user", "content": "hi"}])
    assert reason in str(error.value) and "\n" not in str(error.value)


# CVE-2024-34359 (llama-cpp-python rendered GGUF templates outside a sandbox) and its kin
ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{{ joiner.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{{ namespace.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{{ lipsum.__globals__['os'].popen('touch MARKER').read() }}",
    "{{ self.__init__.__globals__.__builtins__.__import__('os').system('touch MARKER') }}",
    "{{ raise_exception.__globals__['__builtins__']['__import__']('os').system('touch MARKER') }}",
    "{{ strftime_now.__globals__['__builtins__']['__import__']('os').system('touch MARKER') }}",
    "{{ (''|attr('__class__')|attr('__mro__'))[1].__subclasses__() }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "{{ '%s'|format(messages.__class__.__mro__) }}",
    "{% for c in ().__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
    "{{ messages[0].__class__.__init__.__globals__ }}",
    "{{ dict.mro()[1].__subclasses__() }}",
    "{% set ns = namespace(__class__=1) %}{{ ns.__class__ }}",
    "{{ messages.append(1) }}{{ messages[0].update({'role': 'system'}) }}",
]


@pytest.mark.parametrize("payload", ESCAPES)
def test_nothing_outside_the_sandbox_is_reachable(payload, tmp_path):
    marker = tmp_path / "escaped"
    with pytest.raises(ReflexError, match="^chat template failed: [^\n]+$"):
        render_chat(payload.replace("MARKER", str(marker)), [{"role": "user", "content": "hi"}])
    assert not marker.exists()


@pytest.mark.parametrize("template, reason", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran past 1,000,000 steps"),
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "wrote over 4,194,304 characters"),
    # text that a macro buffers counts as written, though it never reaches the output
    ("{% macro m() %}{% for i in range(50000) %}{{ 'y' * 100 }}{% endfor %}{% endmacro %}{% set s = m() %}",
     "wrote over"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "'~' would build a value past the limits"),
    ("{% set a = 'x' * 4000000 %}{% set b = a + a %}", "built a value of over"),
    ("{% set a = 'x' * 4000000 %}{% set b = [a, a] | join %}", "join would build a value past the limits"),
    ("{{ 'x' * 10 ** 9 }}", "'*' would build a value past the limits"),
    ("{{ [0] * 10 ** 8 }}", "'*' would build a value past the limits"),
    ("{{ 9 ** 999999 }}", "'**' would build a value past the limits"),
    ("{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
     "'*' would build a value past the limits"),
    ("{{ range(10 ** 6) | list }}", "OverflowError: Range too big"),
])
def test_a_render_is_bounded(template, reason):
    with pytest.raises(ReflexError) as error:
        render_chat(template, [])
    assert reason in str(error.value) and "\n" not in str(error.value)


# Found while building fuzz/fuzz_chat.py: each allocated ~1 GB before its result was refused (all
# memory with a wider width); the filters did it at compile time, where jinja2 folded constants.
@pytest.mark.parametrize("template", [
    "{{ 'x'|center(999999999) }}",
    "{{ 'x'|indent(999999999, true) }}",
    "{{ '%999999999s'|format('x') }}",
    "{{ '%999999999s' % 'x' }}",
    "{{ '%.999999999f' % 1.0 }}",
    "{{ '%*s' % (999999999, 'x') }}",
    "{{ '{:>999999999}'.format('x') }}",
    "{{ '{:{w}}'.format('x', w=999999999) }}",
    "{{ 'x'.ljust(999999999) }}",
    "{{ ('\t' * 1000).expandtabs(999999) }}",
    "{% set b = 'y' * 4000000 %}{{ ('x' * 300).replace('x', b) }}",
    "{% set b = 'y' * 4000000 %}{{ ('x' * 300)|replace('x', b) }}",
    "{% set b = 'y' * 4000000 %}{{ ''.join([b] * 300) }}",
    "{% set b = 'y' * 4000000 %}{{ [b, b, b]|join }}",
    "{% set b = 'y' * 4000000 %}{{ " + " ~ ".join(["b"] * 300) + " }}",
    "{{ [1]|batch(999999999, 0)|list }}",
    "{{ lipsum(200000) }}",
])
def test_what_a_template_would_build_past_the_limits_is_refused_before_it_is_built(template):
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(ReflexError, match="would build a value past the limits"):
            render_chat(template, [])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB"


def test_a_render_is_bounded_in_time_when_each_step_is_costly(monkeypatch):
    # every step is legal and under MAX_STEPS, but each copies 4M characters: 25 ms a step
    monkeypatch.setattr(chat, "MAX_SECONDS", 0.5)
    template = ("{% set a = 'x' * 4000000 %}{% for i in range(1000) %}{% for j in range(1000) %}"
                "{% set b = a|list %}{% endfor %}{% endfor %}")
    with pytest.raises(ReflexError, match="ran past 0.5 seconds"):
        render_chat(template, [])


def test_recursion_is_bounded_by_steps(monkeypatch):
    monkeypatch.setattr(chat, "MAX_STEPS", 10_000)  # 2**60 calls, each a step
    with pytest.raises(ReflexError, match="ran past 10,000 steps"):
        render_chat("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}", [])
    assert render_chat("{% for m in messages %}{{ m.content }}{% endfor %}", MULTI_TURN) == "2+2?4And 3+3?"


def test_a_file_without_template_is_a_clear_error(tmp_path):
    path = rewrite(GOLDEN_QWEN3, str(tmp_path / "no-template.gguf"), drop_key="tokenizer.chat_template")
    with pytest.raises(ReflexError, match="has no chat template"):
        ModelFile(path).render_chat([{"role": "user", "content": "hi"}])


def test_importing_chat_does_not_import_jinja2():
    code = "import sys, reflex_engine.chat, reflex_engine.engine; print('jinja2' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
