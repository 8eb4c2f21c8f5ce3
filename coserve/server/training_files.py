"""Checking an uploaded fine-tuning file: JSONL in OpenAI's chat format (supervised jobs) or its DPO format
(``preference.py``: preference pairs, for ``method.type: dpo``), one format a file, every line named in the
errors."""

from __future__ import annotations

from coserve.finetune.chat_format import validate_messages
from coserve.finetune.preference import is_preference_record, preference_messages
from coserve.server.jsonl_file import parse_jsonl

PURPOSES = ("fine-tune",)


def validate_training_jsonl(data: bytes) -> int:
    """The number of examples in ``data``; ValueError listing the first bad lines (``line 3: messages[1].role: ...``).
    The first record's format (chat or preference) is every record's."""
    formats: list[bool] = []  # whether the first record is a preference pair

    def example(record: dict, number: int) -> dict:
        if not formats:
            formats.append(is_preference_record(record))
        if formats[0]:
            if "messages" in record and not is_preference_record(record):
                raise ValueError("a chat record in a file of preference pairs (one format a file)")
            preference_messages(record)
            return record
        if "messages" not in record:
            if is_preference_record(record):
                raise ValueError("a preference pair in a file of chat records (one format a file)")
            raise ValueError("no 'messages' field (the chat format is "
                             '{"messages": [{"role": ..., "content": ...}, ...]}; the DPO format is '
                             '{"input": {"messages": [...]}, "preferred_output": [...], '
                             '"non_preferred_output": [...]})')
        validate_messages(record["messages"])
        return record

    examples = parse_jsonl(data, example)
    if not examples:
        raise ValueError("the file holds no example")
    return len(examples)
