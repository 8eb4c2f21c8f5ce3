"""Checking an uploaded fine-tuning file: JSONL in OpenAI's chat format, every line named in the errors."""

from __future__ import annotations

import json

from coserve.finetune.chat_format import json_type, validate_messages

PURPOSES = ("fine-tune",)
MAX_ERRORS_SHOWN = 5


def validate_training_jsonl(data: bytes) -> int:
    """The number of examples in ``data``; ValueError listing the first bad lines (``line 3: messages[1].role: ...``)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ValueError(f"line {line}: not UTF-8 text") from e
    errors: list[str] = []
    examples = 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            errors.append(f"line {number}: not valid JSON ({e.msg} at column {e.colno})")
            continue
        if not isinstance(record, dict):
            errors.append(f"line {number}: expected a JSON object, got {json_type(record)}")
            continue
        if "messages" not in record:
            errors.append(f"line {number}: no 'messages' field (the chat format is "
                          '{"messages": [{"role": ..., "content": ...}, ...]})')
            continue
        try:
            validate_messages(record["messages"])
        except ValueError as e:
            errors.append(f"line {number}: {e}")
            continue
        examples += 1
    if errors:
        shown = "; ".join(errors[:MAX_ERRORS_SHOWN])
        more = f" (and {len(errors) - MAX_ERRORS_SHOWN} more)" if len(errors) > MAX_ERRORS_SHOWN else ""
        raise ValueError(f"{len(errors)} invalid line(s): {shown}{more}")
    if not examples:
        raise ValueError("the file holds no example")
    return examples
