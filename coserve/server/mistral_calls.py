"""Mistral's tool calls (``--tool-call-parser mistral``), after the text's first ``[TOOL_CALLS]``, in either form:

- a JSON array of ``{"name", "arguments"}`` objects (tokenizers before v11: Mistral 7B Instruct v0.3, Mixtral
  8x22B Instruct): ``[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]``;
- one call per ``[TOOL_CALLS]``, its name then its arguments' JSON object after ``[ARGS]`` (v11 and later: Mistral
  Small 3.1/3.2, Devstral, Magistral, Ministral 3), with v13's ``[CALL_ID]id`` between them where the model writes
  one: ``[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[CALL_ID]a1b2c3d4e[ARGS]{}``. A name straight before its ``{``
  (what the text shows where ``[ARGS]`` is decoded away) is read too.

The text before the first ``[TOOL_CALLS]`` is the reply's content. Names are OpenAI's (letters, digits, ``_`` and
``-``); arguments are the JSON text the model wrote, so that a stream sends them as they are written
(``mistral_views``, read by ``tool_stream.ToolCallStream``) and the finished reply reads the same views.
"""

from __future__ import annotations

import json
import re

from coserve.server.call_text import CallView, NotACall, scan_call_list, skip_ws, value_end, whole_calls

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
NAME = re.compile(r"[A-Za-z0-9_-]*")


def call_array(text: str, keys: tuple[str, ...] = ("arguments",)) -> list[tuple[str, str]] | None:
    """The ``(name, arguments)`` of a JSON array of ``{"name", "arguments": {...}}`` objects and nothing else (None
    where ``text`` is not one); ``keys``: where a call's arguments may be (the first written counts)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not (isinstance(value, list) and value and all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and c["name"]
            and isinstance(next((c[k] for k in c if k in keys), {}), dict) for c in value)):
        return None
    return [(v.name, v.arguments) for v in scan_call_list(text, keys)]


def mistral_calls(text: str) -> tuple[str | None, list[tuple[str, str]]] | None:
    """``(content, [(name, arguments)])`` of a finished output whose calls follow its text (content None where
    blank); None where it has no ``[TOOL_CALLS]`` or what follows is not all whole calls."""
    at = text.find(TOOL_CALLS)
    if at < 0:
        return None
    content = text[:at] if text[:at].strip() else None
    body = skip_ws(text, at + len(TOOL_CALLS))
    if text.startswith("[", body):
        calls = call_array(text[body:])
        return None if calls is None else (content, calls)
    try:
        views = whole_calls(mistral_views(text))
    except NotACall:
        return None
    if views is None or skip_ws(text, views[-1].end) < len(text):
        return None  # not all whole calls, or text after them
    return content, [(v.name, v.arguments) for v in views]


def mistral_views(text: str) -> list[CallView]:
    """The calls of a growing output as far as they are written (the last one may be open); NotACall once the text
    after ``[TOOL_CALLS]`` cannot be calls. Text after a whole call ends the views (the finished text decides)."""
    at = text.find(TOOL_CALLS)
    if at < 0:
        return []
    i = skip_ws(text, at + len(TOOL_CALLS))
    if text.startswith("[", i):
        return scan_call_list(text[i:], ("arguments",))
    views: list[CallView] = []
    while True:
        view = _named_call(text, i)
        views.append(view)
        if view.end is None:
            return views
        i = skip_ws(text, view.end)
        if not text.startswith(TOOL_CALLS, i):
            return views  # the end so far, a marker half written, or text after the calls
        i = skip_ws(text, i + len(TOOL_CALLS))


def _named_call(text: str, start: int) -> CallView:
    """The call ``name[ARGS]{...}`` (or ``name[CALL_ID]id[ARGS]{...}``, or ``name{...}``) at ``text[start]``, as far
    as it is written."""
    name_end = NAME.match(text, start).end()
    rest = text[name_end:]
    opened = next((m for m in (ARGS, CALL_ID, "{") if rest.startswith(m)), None)
    if opened is None:
        if not rest or ARGS.startswith(rest) or CALL_ID.startswith(rest):
            return CallView(None, "", None)  # the name, or the marker after it, still being written
        raise NotACall(f"a Mistral call is a name then [ARGS]; {rest[:12]!r} follows {text[start:name_end]!r}")
    name = text[start:name_end]
    if not name:
        raise NotACall("a Mistral call begins with its name")
    i = name_end
    if opened == CALL_ID:
        i = text.find(ARGS, i)
        if i < 0:
            return CallView(name, "", None)
    if text.startswith(ARGS, i):
        i += len(ARGS)
    i = skip_ws(text, i)
    if i >= len(text):
        return CallView(name, "", None)
    if text[i] != "{":
        raise NotACall(f"a Mistral call's arguments are a JSON object; they begin with {text[i]!r}")
    end = value_end(text, i)
    return CallView(name, text[i:end if end is not None else len(text)], end)
