"""Chat templates from the GGUF (`tokenizer.chat_template`), rendered in a jinja2 sandbox.

jinja2 is imported only here, when --chat is asked for: it is not on the plain cold path.
"""
from __future__ import annotations

from datetime import datetime

from .errors import ReflexError


def render_chat(template: str, messages: list[dict], *, bos_token: str, eos_token: str,
                add_generation_prompt: bool = True) -> str:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    # The same environment settings as transformers' apply_chat_template.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(
            messages=messages, bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
        )
    except TemplateError as e:
        raise ReflexError(f"chat template failed: {e}") from None
