"""Checking an uploaded fine-tuning file: JSONL in one of OpenAI's formats, one format a file (its first record's),
every line named in the errors: the chat format (supervised jobs), its reinforcement fine-tuning format (chat
messages that end before the assistant's turn, for ``method.type: reinforcement``; the record's other fields are
the grader's item) or its DPO format (``preference.py``: preference pairs, for ``method.type: dpo``)."""

from __future__ import annotations

from coserve.finetune.chat_format import validate_messages
from coserve.finetune.grpo_prompts import prompt_messages
from coserve.finetune.preference import is_preference_record, preference_messages
from coserve.server.jsonl_file import parse_jsonl

PURPOSES = ("fine-tune",)
FORMATS = {"chat": "chat records", "prompt": "reinforcement prompts (messages that end before the assistant's turn)",
           "preference": "preference pairs"}


def record_format(record: dict) -> str:
    """``preference``, ``prompt`` (its messages' last is not the assistant's) or ``chat``."""
    if is_preference_record(record):
        return "preference"
    messages = record.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict) \
            and messages[-1].get("role") != "assistant":
        return "prompt"
    return "chat"


def validate_training_jsonl(data: bytes) -> int:
    """The number of examples in ``data``; ValueError listing the first bad lines (``line 3: messages[1].role: ...``).
    The first record's format is every record's: each record is checked as one of that format."""
    formats: list[str] = []

    def example(record: dict, number: int) -> dict:
        if not formats:
            formats.append(record_format(record))
        if formats[0] == "preference":
            if "messages" in record and not is_preference_record(record):
                raise ValueError("a chat record in a file of preference pairs (one format a file)")
            preference_messages(record)
        elif "messages" not in record:
            if is_preference_record(record):
                raise ValueError(f"a preference pair in a file of {FORMATS[formats[0]]} (one format a file)")
            raise ValueError("no 'messages' field (the chat format is "
                             '{"messages": [{"role": ..., "content": ...}, ...]}; the DPO format is '
                             '{"input": {"messages": [...]}, "preferred_output": [...], '
                             '"non_preferred_output": [...]})')
        elif formats[0] == "prompt":
            prompt_messages(record["messages"], "messages")
        else:
            validate_messages(record["messages"])
        return record

    examples = parse_jsonl(data, example)
    if not examples:
        raise ValueError("the file holds no example")
    return len(examples)
