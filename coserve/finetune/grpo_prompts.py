"""GRPO's data: prompts only, one per JSON record: TRL's prompt-only format, ``{"prompt": "text"}`` or
``{"prompt": [chat messages]}``, or OpenAI's reinforcement fine-tuning format, ``{"messages": [chat messages]}``
(messages are rendered with the model's chat template and its generation prompt), with any other fields kept and
passed to the reward functions or the grader (e.g. a reference ``answer``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coserve.finetune.chat_format import check_message, is_unicode_text, json_type
from coserve.finetune.dataset import DatasetReport, load_records


@dataclass(slots=True)
class PromptRecord:
    """One prompt as the reward functions see it (``prompt``: the text or the messages) and as the model reads it."""

    prompt: str | list[dict[str, str]]
    token_ids: list[int]
    columns: dict[str, Any] = field(default_factory=dict)  # the record's other fields
    line: int = 0

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def encode_prompt(record: Any, tokenizer, max_prompt_tokens: int) -> PromptRecord:
    """A record's prompt tokenized (text as ``tokenizer(text)``, with its special tokens, as ``LLM.generate`` reads
    it; messages by the chat template). Raises ``ValueError`` naming the field."""
    if not isinstance(record, dict):
        raise ValueError(f"expected an object with a prompt, got {json_type(record)}")
    key = "messages" if "prompt" not in record and "messages" in record else "prompt"  # OpenAI's RFT or TRL's
    prompt = record.get(key)
    if key == "messages" and not isinstance(prompt, list):
        raise ValueError(f"messages: expected an array of messages, got {json_type(prompt)}")
    if isinstance(prompt, str):
        if not prompt or not is_unicode_text(prompt):
            raise ValueError("prompt: expected non-empty Unicode text")
        ids = list(tokenizer(prompt)["input_ids"])
    elif isinstance(prompt, list):
        messages = prompt_messages(prompt, key)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("prompt: messages need a chat template, and the tokenizer has none")
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja raises its own types for a template that rejects the input
            raise ValueError(f"prompt: the chat template fails ({type(e).__name__}: {e})") from e
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        prompt = messages
    else:
        raise ValueError(f"prompt: expected text or an array of messages, got {json_type(prompt)}")
    if len(ids) > max_prompt_tokens:
        raise ValueError(f"prompt: {len(ids)} tokens; at most {max_prompt_tokens} leave room for the completion "
                         "(max_seq_len - max_completion_tokens)")
    return PromptRecord(prompt, ids, {k: v for k, v in record.items() if k != key})


def prompt_messages(prompt: list, key: str = "prompt") -> list[dict[str, str]]:
    """A prompt's messages reduced to role and content; ValueError naming ``key[i]`` for a bad one, or a prompt that
    ends with an assistant message (the completion is what comes next)."""
    if not prompt:
        raise ValueError(f"{key}: an empty array of messages")
    out = []
    for i, m in enumerate(prompt):
        role, content = check_message(m, f"{key}[{i}]")
        out.append({"role": role, "content": content})
    if out[-1]["role"] == "assistant":
        raise ValueError(f"{key}[{len(out) - 1}]: the prompt ends with an assistant message; the completion is "
                         "what the model writes next")
    return out


def load_prompts(path: str | Path, tokenizer, max_seq_len: int, max_completion_tokens: int
                 ) -> tuple[list[PromptRecord], DatasetReport]:
    """A JSON-array or JSONL file of prompt records; malformed ones are skipped and reported by line, as
    ``load_dataset`` does, and a file without one valid prompt is an error naming it."""
    room = max_seq_len - max_completion_tokens
    if room < 1:
        raise ValueError(f"max_completion_tokens: {max_completion_tokens} leaves no room for a prompt in "
                         f"max_seq_len {max_seq_len}")

    def encode(record):
        return encode_prompt(record, tokenizer, room), False

    return load_records(path, max_seq_len, encode)
