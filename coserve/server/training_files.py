"""Checking an uploaded fine-tuning file: JSONL in OpenAI's chat format, every line named in the errors."""

from __future__ import annotations

from coserve.finetune.chat_format import validate_messages
from coserve.server.jsonl_file import parse_jsonl

PURPOSES = ("fine-tune",)


def validate_training_jsonl(data: bytes) -> int:
    """The number of examples in ``data``; ValueError listing the first bad lines (``line 3: messages[1].role: ...``)."""
    examples = parse_jsonl(data, _example)
    if not examples:
        raise ValueError("the file holds no example")
    return len(examples)


def _example(record: dict, number: int) -> dict:
    if "messages" not in record:
        raise ValueError("no 'messages' field (the chat format is "
                         '{"messages": [{"role": ..., "content": ...}, ...]})')
    validate_messages(record["messages"])
    return record
