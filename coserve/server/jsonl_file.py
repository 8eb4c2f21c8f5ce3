"""An uploaded JSONL file read line by line, every bad line named in one error (training and batch files)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from coserve.finetune.chat_format import json_type

T = TypeVar("T")
MAX_ERRORS_SHOWN = 5


def parse_jsonl(data: bytes, parse: Callable[[dict, int], T]) -> list[T]:
    """``parse(record, line number)`` of every non-blank line's JSON object (a ValueError from it marks the line
    bad); ValueError counting the bad lines and listing the first (``line 3: messages[1].role: ...``)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ValueError(f"line {line}: not UTF-8 text") from e
    errors: list[str] = []
    parsed: list[T] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record: Any = json.loads(line)
        except json.JSONDecodeError as e:
            errors.append(f"line {number}: not valid JSON ({e.msg} at column {e.colno})")
            continue
        if not isinstance(record, dict):
            errors.append(f"line {number}: expected a JSON object, got {json_type(record)}")
            continue
        try:
            parsed.append(parse(record, number))
        except ValueError as e:
            errors.append(f"line {number}: {e}")
    if errors:
        shown = "; ".join(errors[:MAX_ERRORS_SHOWN])
        more = f" (and {len(errors) - MAX_ERRORS_SHOWN} more)" if len(errors) > MAX_ERRORS_SHOWN else ""
        raise ValueError(f"{len(errors)} invalid line(s): {shown}{more}")
    return parsed
