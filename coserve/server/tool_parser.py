"""Tool calls a model writes freely in its text, for ``tool_choice: "auto"`` (vLLM's ``--tool-call-parser``).

Only the Hermes format is known (``hermes``: Hermes, Qwen2/2.5 and the many models trained on it): each
call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, after any text. A reply whose blocks
are not all whole JSON calls is text, as vLLM leaves it; names are not checked against the request's
tools (as vLLM does not). A call's ``arguments`` are the JSON text the model wrote for them (so that a
stream can send them as they are written: ``tool_stream.py``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from coserve.server.call_text import NotACall, scan_call

PARSERS = ("hermes",)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")  # where a Hermes call's arguments may be (the first written counts)
BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's tool_calls carry it


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedCall]]:
    """``(content, calls)`` of a finished output: the text before the first block (None when blank) and each
    block's call; ``(text, [])`` when there is no block or one is not a call."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = []
    for m in BLOCK.finditer(text, start):
        call = _call(m.group(1))
        if call is None:
            return text, []
        calls.append(call)
    if BLOCK.sub("", text[start:]).strip():
        return text, []  # text between or after the blocks: not a reply of calls
    content = text[:start]
    return (content if content.strip() else None), calls


def _call(body: str) -> ParsedCall | None:
    """The call of a block's body, its arguments the text the model wrote for them (what a stream sent)."""
    try:
        value = json.loads(body)
        view = scan_call(body, 0, ARGUMENT_KEYS)
    except (json.JSONDecodeError, NotACall):
        return None
    if not isinstance(value, dict) or not view.name:
        return None
    try:
        json.loads(view.arguments)  # a string's content must be JSON text too
    except json.JSONDecodeError:
        return None
    return ParsedCall(view.name, view.arguments)


def visible_text(text: str) -> str:
    """What of a growing output may be streamed as text now: everything before a block has begun, less a tail
    that could still turn into ``<tool_call>``."""
    start = text.find(OPEN)
    if start >= 0:
        return text[:start]
    for keep in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-keep:]):
            return text[:-keep]
    return text
