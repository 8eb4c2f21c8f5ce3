"""Checking a batch input file (OpenAI's Batch API): JSONL of ``{"custom_id", "method", "url", "body"}``, every
bad line named in the errors."""

from __future__ import annotations

from dataclasses import dataclass

from coserve.server.jsonl_file import parse_jsonl

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
MAX_REQUESTS = 50_000  # OpenAI's limit per batch


@dataclass(frozen=True, slots=True)
class BatchLine:
    custom_id: str
    url: str
    body: dict


def parse_batch_jsonl(data: bytes) -> list[BatchLine]:
    """The requests of a batch input file; ValueError listing the first bad lines (``line 3: custom_id: ...``)."""
    seen: dict[str, int] = {}
    lines = parse_jsonl(data, lambda record, number: _line(record, number, seen))
    if not lines:
        raise ValueError("the file holds no request")
    if len(lines) > MAX_REQUESTS:
        raise ValueError(f"{len(lines)} requests; a batch holds at most {MAX_REQUESTS}")
    return lines


def _line(record: dict, number: int, seen: dict[str, int]) -> BatchLine:
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
