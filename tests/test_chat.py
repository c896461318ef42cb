"""Chat templates: rendered as transformers renders them, inside jinja2's sandbox."""
import pytest

from reflex_engine.chat import render_chat
from reflex_engine.engine import ModelFile
from reflex_engine.errors import ReflexError

from model_files import GOLDEN_QWEN3, rewrite


def test_chatml_template_from_the_gguf():
    file = ModelFile(GOLDEN_QWEN3)
    text = file.render_chat([{"role": "user", "content": "Hello"}])
    assert text == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    ids = file.encode(text, add_bos=False)
    assert ids[0] == 369 and ids.count(370) == 1  # <|im_start|> and <|im_end|> as single tokens


def test_whitespace_control_matches_transformers():
    # transformers renders with trim_blocks and lstrip_blocks
    template = "{% for m in messages %}\n    {{ m.content }}\n{% endfor %}"
    assert render_chat(template, [{"role": "user", "content": "x"}], bos_token="", eos_token="") == "    x\n"


def test_raise_exception_is_a_clean_error():
    template = "{{ raise_exception('only user and assistant roles are supported') }}"
    with pytest.raises(ReflexError, match="only user and assistant roles"):
        render_chat(template, [], bos_token="", eos_token="")


def test_sandbox_blocks_attribute_escapes():
    template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ReflexError, match="chat template failed"):
        render_chat(template, [], bos_token="", eos_token="")


def test_a_file_without_template_is_a_clear_error(tmp_path):
    path = rewrite(GOLDEN_QWEN3, str(tmp_path / "no-template.gguf"), drop_key="tokenizer.chat_template")
    with pytest.raises(ReflexError, match="has no chat template"):
        ModelFile(path).render_chat([{"role": "user", "content": "hi"}])
