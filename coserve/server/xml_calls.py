"""Tool calls in Qwen3-Coder's XML (vLLM's ``qwen3_coder`` parser), after any text::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text (one newline after its tag and one before its closing tag are not part of it),
read by the type the request's tool gives the parameter, as vLLM reads it: ``string`` as written, ``integer`` and
``number`` as numbers (a whole number as an integer), ``boolean`` as ``true`` when it says so, anything else as JSON
(or a Python literal), and ``null`` as null; a parameter the tool does not declare stays text. A call's
``arguments`` are those values as a JSON object.

A stream announces a call once ``<function=name>`` is written and sends its arguments whole once ``</function>`` is
(a value's type is known only when it is whole).
"""

from __future__ import annotations

import ast
import json
import math
import re

from coserve.server.call_text import CallView

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)
FUNCTION_CLOSE = "</function>"
FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.DOTALL)
NAMED = re.compile(r"\s*<function=([^>\n]+)>")
PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
STRINGS = ("string", "str", "text", "varchar", "char", "enum")


def parse_xml_calls(text: str, schemas: dict[str, dict]) -> tuple[str | None, list[tuple[str, str]]] | None:
    """``(content, [(name, arguments), ...])`` of a finished output: the text before the first block (None when
    blank) and each block's call; None when there is no block, one is not a call, or text follows them.
    ``schemas``: each tool's ``parameters`` schema, by name."""
    start = text.find(OPEN)
    if start < 0:
        return None
    calls = []
    for m in BLOCK.finditer(text, start):
        call = _call(m.group(1), schemas)
        if call is None:
            return None
        calls.append(call)
    if BLOCK.sub("", text[start:]).strip():
        return None
    content = text[:start]
    return (content if content.strip() else None), calls


def xml_views(text: str, schemas: dict[str, dict]) -> list[CallView]:
    """The calls of a growing output's blocks as far as they are written: named once ``<function=name>`` is,
    with their arguments once ``</function>`` is."""
    views: list[CallView] = []
    start = text.find(OPEN)
    while start >= 0:  # the blocks found by str.find (a stream re-reads the text at every token)
        close = text.find(CLOSE, start + len(OPEN))
        end = len(text) if close < 0 else close + len(CLOSE)
        body = text[start + len(OPEN):close if close >= 0 else len(text)]
        call = _call(body, schemas) if FUNCTION_CLOSE in body else None
        if call is not None:
            views.append(CallView(call[0], call[1], end))
            start = text.find(OPEN, end)
            continue
        named = NAMED.match(body)
        if named is not None:
            views.append(CallView(named.group(1).strip(), "", None))
        break
    return views


def _call(body: str, schemas: dict[str, dict]) -> tuple[str, str] | None:
    """A block's ``<function=...>`` call: its name and arguments as JSON text; None if the body is not one."""
    m = FUNCTION.match(body)
    if m is None:
        return None
    name, inner = m.group(1).strip(), m.group(2)
    if not name or PARAMETER.sub("", inner).strip():
        return None  # text that is no parameter
    properties = (schemas.get(name) or {}).get("properties") or {}
    arguments = {key.strip(): _value(raw, properties.get(key.strip())) for key, raw in PARAMETER.findall(inner)}
    return name, json.dumps(arguments, ensure_ascii=False)


def _value(raw: str, schema: dict | None):
    """A parameter's raw text as its declared type reads it (vLLM's conversion)."""
    if raw.strip().lower() == "null":
        return None
    kind = (schema or {}).get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["integer", "null"]: the first type that is not null
        kind = next((k for k in kind if k != "null"), None)
    if not isinstance(kind, str) or kind.lower() in STRINGS:
        return raw
    kind = kind.lower()
    text = raw.strip()
    try:
        if kind.startswith(("int", "uint", "long", "short")):
            return int(text)
        if kind.startswith(("num", "float", "double")):
            number = float(text)
            if not math.isfinite(number):
                return raw
            return int(number) if number.is_integer() else number
    except ValueError:
        return raw
    if kind.startswith("bool"):
        return text.lower() == "true"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        try:
            value = ast.literal_eval(text)
            json.dumps(value)  # a tuple is a list; a set or bytes is not JSON
            return value
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return raw
