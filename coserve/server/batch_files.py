"""Checking a batch input file (OpenAI's Batch API): JSONL of ``{"custom_id", "method", "url", "body"}``, every
bad line named in the errors."""

from __future__ import annotations

import json
from dataclasses import dataclass

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MAX_REQUESTS = 50_000  # OpenAI's limit per batch
MAX_ERRORS_SHOWN = 5


@dataclass(frozen=True, slots=True)
class BatchLine:
    custom_id: str
    url: str
    body: dict


def parse_batch_jsonl(data: bytes) -> list[BatchLine]:
    """The requests of a batch input file; ValueError listing the first bad lines (``line 3: custom_id: ...``)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ValueError(f"line {line}: not UTF-8 text") from e
    errors: list[str] = []
    lines: list[BatchLine] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            lines.append(_line(json.loads(raw), number, seen))
        except json.JSONDecodeError as e:
            errors.append(f"line {number}: not valid JSON ({e.msg} at column {e.colno})")
        except ValueError as e:
            errors.append(f"line {number}: {e}")
    if errors:
        more = f" (and {len(errors) - MAX_ERRORS_SHOWN} more)" if len(errors) > MAX_ERRORS_SHOWN else ""
        raise ValueError("; ".join(errors[:MAX_ERRORS_SHOWN]) + more)
    if not lines:
        raise ValueError("the file holds no request")
    if len(lines) > MAX_REQUESTS:
        raise ValueError(f"{len(lines)} requests; a batch holds at most {MAX_REQUESTS}")
    return lines


def _line(record, number: int, seen: dict[str, int]) -> BatchLine:
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
        raise ValueError("custom_id: must be a non-empty string of at most 512 characters")
    if custom_id in seen:
        raise ValueError(f"custom_id: {custom_id!r} is also the custom_id of line {seen[custom_id]}")
    seen[custom_id] = number
    if record.get("method") != "POST":
        raise ValueError(f"method: must be 'POST', got {record.get('method')!r}")
    url = record.get("url")
    if url not in ENDPOINTS:
        raise ValueError(f"url: must be one of {', '.join(ENDPOINTS)}, got {url!r}")
    body = record.get("body")
    if not isinstance(body, dict):
        raise ValueError("body: must be a JSON object (the request's body)")
    if body.get("stream"):
        raise ValueError("body.stream: a batch request cannot be streamed")
    return BatchLine(custom_id, url, body)
