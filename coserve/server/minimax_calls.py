"""Tool calls as MiniMax-M2 writes them (vLLM's ``minimax_m2`` parser), after any text::

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    <invoke name="get_time">
    </invoke>
    </minimax:tool_call>

Each ``invoke`` is a call. A parameter's value (stripped) is read by the type the request's tool declares for it, as
Qwen3-Coder's are (``xml_calls.typed_value``). A stream announces a call once its ``<invoke name=...>`` is written
and sends its arguments whole once ``</invoke>`` is.
"""

from __future__ import annotations

import json
import re

from coserve.server.call_text import CallView
from coserve.server.xml_calls import block_calls, blocks, typed_value

OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
INVOKE_CLOSE = "</invoke>"
INVOKE = re.compile(r"\s*<invoke name=([\"']?)([^\"'>\n]+)\1>(.*?)</invoke>", re.DOTALL)
NAMED = re.compile(r"\s*<invoke name=([\"']?)([^\"'>\n]+)\1>")
PARAMETER = re.compile(r"<parameter name=([\"']?)([^\"'>\n]+)\1>(.*?)</parameter>", re.DOTALL)


def parse_minimax_calls(text: str, schemas: dict[str, dict]) -> tuple[str | None, list[tuple[str, str]]] | None:
    """``(content, [(name, arguments), ...])`` of a finished output (``xml_calls.block_calls``): each block's calls,
    a block holding anything else not calls."""
    def read(body: str, closed: bool) -> list[tuple[str, str]] | None:
        found, rest = _invokes(body, 0, schemas)
        return None if not found or rest.strip() else [(v.name, v.arguments) for v in found]
    return block_calls(text, (OPEN, CLOSE), read)


def minimax_views(text: str, schemas: dict[str, dict]) -> list[CallView]:
    """The calls of a growing output as far as they are written: named once ``<invoke name=...>`` is, with their
    arguments once ``</invoke>`` is."""
    views: list[CallView] = []
    for start, body, _, closed in blocks(text, (OPEN, CLOSE)):
        found, rest = _invokes(body, start + len(OPEN), schemas)
        views += found
        named = NAMED.match(rest)
        if named is not None and not closed:
            views.append(CallView(named.group(2).strip(), "", None))
        if not closed or rest.strip():
            break
    return views


def _invokes(body: str, offset: int, schemas: dict[str, dict]) -> tuple[list[CallView], str]:
    """The whole calls at the start of a block's body (which begins at ``offset`` in the text), and the rest of
    it."""
    views, i = [], 0
    while (close := body.find(INVOKE_CLOSE, i)) >= 0:  # found by str.find: a stream re-reads the text each token
        m = INVOKE.match(body, i, close + len(INVOKE_CLOSE))
        if m is None:
            break
        name, inner = m.group(2).strip(), m.group(3)
        if PARAMETER.sub("", inner).strip():
            break  # text that is no parameter: not a call
        properties = (schemas.get(name) or {}).get("properties") or {}
        arguments = {key.strip(): typed_value(value.strip(), properties.get(key.strip()))
                     for _, key, value in PARAMETER.findall(inner)}
        views.append(CallView(name, json.dumps(arguments, ensure_ascii=False), offset + m.end()))
        i = m.end()
    return views, body[i:]
