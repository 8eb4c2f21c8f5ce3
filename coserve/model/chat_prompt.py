"""A conversation rendered to prompt text by the model's chat template, with vLLM's controls over it.

vLLM's chat API and ``LLM.chat`` take three options beside the messages, which this module checks and applies the
same way for the server and the Python API:

- ``add_generation_prompt`` (default on): open the assistant's turn after the last message;
- ``continue_final_message``: leave the last message open, so the model continues it (a reply's prefix written by
  the caller: ``{"role": "assistant", "content": "{\\"name\\": "}``); it cannot be set with the first;
- ``chat_template_kwargs``: more variables for the template (``enable_thinking`` and the like).
"""

from __future__ import annotations

import inspect
from typing import Any

from transformers import PreTrainedTokenizerBase

# apply_chat_template's own parameters: a template variable of one of these names would change how the call
# itself behaves (tokenize, return_dict, ...), not what the template reads
RESERVED_KWARGS = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"kwargs"}


class ChatPromptError(ValueError):
    """A conversation or an option that the chat template cannot render; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def render_conversation(tokenizer: PreTrainedTokenizerBase, messages: list[dict], *, tools: list[dict] | None = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of ``messages`` (``{"role", "content", ...}`` dicts as HF chat templates read them)."""
    if add_generation_prompt and continue_final_message:
        raise ChatPromptError("continue_final_message: cannot be set with add_generation_prompt (set that to false: "
                              "the last message is continued, no new turn is opened)", "continue_final_message")
    if continue_final_message and not messages:
        raise ChatPromptError("continue_final_message: there is no message to continue", "continue_final_message")
    extra = dict(chat_template_kwargs or {})
    for key in extra:
        if not isinstance(key, str) or not key.isidentifier():
            raise ChatPromptError(f"chat_template_kwargs: {key!r} is not a template variable's name",
                                  "chat_template_kwargs")
        if key in RESERVED_KWARGS:
            raise ChatPromptError(f"chat_template_kwargs.{key}: a parameter of the template call, not a template "
                                  f"variable" + (" (it is a field of its own)" if key in
                                                 ("add_generation_prompt", "continue_final_message", "tools") else ""),
                                  f"chat_template_kwargs.{key}")
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tokenize=False, **extra)
    except Exception as e:  # jinja and transformers raise many kinds for a conversation a template rejects
        if continue_final_message and "final message" in str(e).lower():
            raise ChatPromptError(f"continue_final_message: the chat template does not write the last message's "
                                  f"content as given, so it cannot be continued ({e})", "continue_final_message") from e
        raise ChatPromptError(f"messages: the model's chat template cannot render them ({e})", "messages") from e
