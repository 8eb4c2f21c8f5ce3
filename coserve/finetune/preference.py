"""Preference data for DPO: each record a prompt with a preferred and a non-preferred completion, as two training
sequences whose loss tokens are the completions'.

A record is one of

* OpenAI's DPO format: ``{"input": {"messages": [...]}, "preferred_output": [{"role": "assistant", "content":
  ...}], "non_preferred_output": [...]}``, rendered with the chat template (``chat_format.py``): the completion's
  tokens are the final assistant message's content and the end-of-turn token after it (assistant messages in the
  input carry no loss);
* TRL's conversational form, ``{"prompt": [messages], "chosen": [assistant message], "rejected": [...]}``, read
  the same way;
* TRL's standard form, ``{"prompt": str, "chosen": str, "rejected": str}``: the prompt tokenized as the tokenizer
  tokenizes text (special tokens included), each completion without them and ended by eos.

Files are read as ``dataset.load_dataset`` reads them (JSON array or JSONL, bad records reported by line).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from coserve.finetune.chat_format import NOT_UNICODE, is_unicode_text, json_type, validate_messages
from coserve.finetune.dataset import DatasetReport, TrainingExample, encode_record, example_of, load_records


@dataclass(slots=True)
class PreferencePair:
    """One prompt's preferred (chosen) and non-preferred (rejected) sequences."""

    chosen: TrainingExample
    rejected: TrainingExample
    line: int = 0  # 1-based line (JSONL) or array index (JSON) of the source record


def _prompt_messages(value: object, name: str) -> list[dict]:
    """A conversation before the completion, checked as ``validate_messages`` checks one (errors name ``name``);
    its assistant messages carry no loss."""
    if not isinstance(value, list) or not value:
        what = "an empty array" if isinstance(value, list) else json_type(value)
        raise ValueError(f"{name}: expected a non-empty array of messages, got {what}")
    try:
        validate_messages(list(value) + [{"role": "assistant", "content": ""}])
    except ValueError as e:
        raise ValueError(str(e).replace("messages", name, 1)) from None
    return [{"role": m["role"], "content": m["content"], **({"weight": 0} if m["role"] == "assistant" else {})}
            for m in value]


def _completion_message(value: object, name: str) -> dict:
    """``[{"role": "assistant", "content": str}]``: the one message of a completion."""
    if not isinstance(value, list) or len(value) != 1:
        what = f"{len(value)} messages" if isinstance(value, list) else json_type(value)
        raise ValueError(f"{name}: expected an array of one assistant message, got {what}")
    m = value[0]
    if not isinstance(m, dict):
        raise ValueError(f"{name}[0]: expected an object, got {json_type(m)}")
    if m.get("role") != "assistant":
        raise ValueError(f"{name}[0].role: expected 'assistant', got {m.get('role')!r}")
    content = m.get("content")
    if not isinstance(content, str):
        raise ValueError(f"{name}[0].content: expected a string, got {json_type(content)}")
    if not is_unicode_text(content):
        raise ValueError(f"{name}[0].content: {NOT_UNICODE}")
    return {"role": "assistant", "content": content}


def _text(record: dict, key: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"{key}: expected a string, got {json_type(value)}")
    if not is_unicode_text(value):
        raise ValueError(f"{key}: {NOT_UNICODE}")
    return value


def _plain_pair(record: dict, tokenizer: PreTrainedTokenizerBase, max_seq_len: int) -> tuple[PreferencePair, bool]:
    """TRL's standard form: prompt text, then each completion's tokens and eos."""
    prompt, chosen, rejected = (_text(record, k) for k in ("prompt", "chosen", "rejected"))
    if tokenizer.eos_token_id is None:
        raise ValueError("chosen: the tokenizer has no eos token to end the completion with")
    prompt_ids = list(tokenizer(prompt, verbose=False)["input_ids"])
    examples, truncated = [], False
    for key, text in (("chosen", chosen), ("rejected", rejected)):
        if not text.strip():
            raise ValueError(f"{key}: empty")
        completion = list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        completion.append(tokenizer.eos_token_id)
        example, cut = example_of(prompt_ids + completion, [False] * len(prompt_ids) + [True] * len(completion),
                                  max_seq_len)
        examples.append(example)
        truncated = truncated or cut
    return PreferencePair(*examples), truncated


def is_preference_record(record: object) -> bool:
    """Whether ``record`` has the fields of a preference record (in any of the formats)."""
    return isinstance(record, dict) and (any(k in record for k in ("input", "preferred_output",
                                                                   "non_preferred_output"))
                                         or all(k in record for k in ("prompt", "chosen", "rejected")))


def preference_messages(record: object) -> tuple[list[dict], list[dict]] | None:
    """A chat-form preference record checked, as ``(prompt messages, [chosen message, rejected message])``; None
    for TRL's standard (text) form; ``ValueError`` naming the field for a bad one."""
    if not isinstance(record, dict):
        raise ValueError(f"record: expected a JSON object, got {json_type(record)}")
    if any(k in record for k in ("input", "preferred_output", "non_preferred_output")):
        source = record.get("input")
        if not isinstance(source, dict):
            raise ValueError(f"input: expected an object with messages, got {json_type(source)}")
        prompt = _prompt_messages(source.get("messages"), "input.messages")
        return prompt, [_completion_message(record.get(k), k) for k in ("preferred_output", "non_preferred_output")]
    if all(k in record for k in ("prompt", "chosen", "rejected")):
        if isinstance(record["prompt"], str):
            for key in ("prompt", "chosen", "rejected"):
                _text(record, key)
            return None
        return _prompt_messages(record["prompt"], "prompt"), [_completion_message(record[k], k)
                                                              for k in ("chosen", "rejected")]
    keys = ", ".join(map(repr, list(record)[:8])) or "none"
    raise ValueError(f"record: no 'input'/'preferred_output'/'non_preferred_output' or 'prompt'/'chosen'/"
                     f"'rejected' fields (fields: {keys})")


def encode_preference_record(record: object, tokenizer: PreTrainedTokenizerBase,
                             max_seq_len: int) -> tuple[PreferencePair, bool]:
    """One record as ``(pair, either sequence was truncated)``; ``ValueError`` naming the field for a bad record
    (``EmptyCompletionError`` where a completion is empty or cut off entirely)."""
    checked = preference_messages(record)
    if checked is None:
        return _plain_pair(record, tokenizer, max_seq_len)
    prompt, outputs = checked
    examples, truncated = [], False
    for output in outputs:
        example, cut = encode_record({"messages": prompt + [output]}, tokenizer, max_seq_len)
        examples.append(example)
        truncated = truncated or cut
    return PreferencePair(*examples), truncated


def load_preference_dataset(path: str | Path, tokenizer: PreTrainedTokenizerBase,
                            max_seq_len: int) -> tuple[list[PreferencePair], DatasetReport]:
    """A JSON-array or JSONL file of preference records as pairs; bad records are skipped and reported by line
    (``DatasetError`` when none is valid), as ``load_dataset`` does."""
    return load_records(path, max_seq_len, lambda record: encode_preference_record(record, tokenizer, max_seq_len))
