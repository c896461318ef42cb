"""Chat prompts rendered in the sidecar, for what the engine's protocol cannot pass to the chat
template yet: `tools` and template variables (`chat_template_kwargs`). The engine's own code does
it (reflex_engine's ModelFile and chat.py, on the file the engine's `ready` line names), so the
token ids sent are the ones the engine's `messages` would give: the template rendered as
transformers renders it, then tokenized without a BOS (the template writes its own).
"""
from __future__ import annotations

import json

from .errors import APIError, bad

# Names render_chat takes for itself: a request's template variables cannot set them.
RESERVED = {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "bos_token",
            "eos_token"}


class LocalTemplate:
    """One model file's chat template and tokenizer, opened here (blocking: run it off the event loop)."""

    def __init__(self, path: str):
        try:
            from reflex_engine.engine import ModelFile
        except ImportError:
            raise APIError(400, "tools and chat_template_kwargs need the reflex-engine package beside the sidecar "
                                "(it renders the chat template here)", code="unsupported_parameter") from None
        from reflex_engine.errors import ReflexError

        self._refusal = ReflexError
        try:
            self.file = ModelFile(path)
        except (OSError, ReflexError) as e:
            raise APIError(500, f"cannot open the engine's model file here to render its chat template: {e}",
                           type="server_error", code="engine_error") from None

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None, variables: dict) -> list[int]:
        try:
            text = self.file.render_chat(messages, tools=tools, **variables)
        except self._refusal as e:  # the template refused these messages (raise_exception) or failed
            raise bad(str(e), "messages") from None
        return self.file.encode(text, add_bos=False)

    def term(self, text: str) -> str:
        """The Lark term that writes text: the model's own token where text is one (Qwen3's
        `<tool_call>`), which llguidance keeps apart from text, else the text itself."""
        ids = self.file.encode(text, add_bos=False)
        return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(text)


def template_variables(value) -> dict:
    """chat_template_kwargs, checked: an object of JSON values, none of render_chat's own names."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad("Invalid type for 'chat_template_kwargs': expected an object", "chat_template_kwargs", "invalid_type")
    taken = sorted(RESERVED & value.keys())
    if taken:
        raise bad(f"Invalid 'chat_template_kwargs': {', '.join(taken)} cannot be set this way",
                  "chat_template_kwargs", "invalid_value")
    return value
