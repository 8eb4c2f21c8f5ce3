"""Tool calls in Qwen3-Coder's XML (vLLM's ``qwen3_coder`` parser; ``seed_oss``: the same in ``<seed:tool_call>``
blocks), after any text::

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
from collections.abc import Callable, Iterator

from coserve.server.call_text import CallView

OPEN, CLOSE = "<tool_call>", "</tool_call>"
SEED_OPEN, SEED_CLOSE = "<seed:tool_call>", "</seed:tool_call>"  # Seed-OSS writes the same calls in these
FUNCTION_CLOSE = "</function>"
FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.DOTALL)
NAMED = re.compile(r"\s*<function=([^>\n]+)>")
PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
STRINGS = ("string", "str", "text", "varchar", "char", "enum")


def blocks(text: str, tags: tuple[str, str]) -> Iterator[tuple[int, str, int, bool]]:
    """``(start, body, end, closed)`` of each block between ``tags`` in order, found by ``str.find`` (a stream
    re-reads the text at every token); the last one may still be open (its body running to the end)."""
    opening, closing = tags
    start = text.find(opening)
    while start >= 0:
        close = text.find(closing, start + len(opening))
        if close < 0:
            yield start, text[start + len(opening):], len(text), False
            return
        yield start, text[start + len(opening):close], close + len(closing), True
        start = text.find(opening, close + len(closing))


def block_calls(text: str, tags: tuple[str, str], read: Callable[[str, bool], list | None]
                ) -> tuple[str | None, list] | None:
    """``(content, calls)`` of a finished output whose calls are in blocks between ``tags`` after any text: the text
    before the first block (None when blank) and the calls ``read(body, closed)`` finds in each block (None: the
    block is not calls); None when there is no block, one is not calls, or text is between or after them."""
    calls, first, last = [], None, 0
    for start, body, end, closed in blocks(text, tags):
        found = read(body, closed)
        if found is None or (first is not None and text[last:start].strip()):
            return None
        first = start if first is None else first
        calls += found
        last = end
    if first is None or text[last:].strip():
        return None
    content = text[:first]
    return (content if content.strip() else None), calls


def parse_xml_calls(text: str, schemas: dict[str, dict], tags: tuple[str, str] = (OPEN, CLOSE)
                    ) -> tuple[str | None, list[tuple[str, str]]] | None:
    """``(content, [(name, arguments), ...])`` of a finished output (``block_calls``), a call per block.
    ``schemas``: each tool's ``parameters`` schema, by name; ``tags``: the blocks' (Seed-OSS's are its own)."""
    return block_calls(text, tags, lambda body, closed: None if (call := _call(body, schemas)) is None else [call])


def xml_views(text: str, schemas: dict[str, dict], tags: tuple[str, str] = (OPEN, CLOSE)) -> list[CallView]:
    """The calls of a growing output's blocks as far as they are written: named once ``<function=name>`` is,
    with their arguments once ``</function>`` is."""
    views: list[CallView] = []
    for _, body, end, closed in blocks(text, tags):
        call, function_end = None, body.rfind(FUNCTION_CLOSE) + len(FUNCTION_CLOSE)
        if function_end >= len(FUNCTION_CLOSE) and (closed or tags[1].startswith(body[function_end:].lstrip())):
            call = _call(body[:function_end], schemas)  # whole, its block closed or closing
        if call is not None:
            views.append(CallView(call[0], call[1], end))
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
    arguments = {key.strip(): typed_value(raw, properties.get(key.strip()))
                 for key, raw in PARAMETER.findall(inner)}
    return name, json.dumps(arguments, ensure_ascii=False)


def typed_value(raw: str, schema: dict | None):
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
    return json_or_literal(text, raw)


def json_or_literal(text: str, raw: str):
    """``text`` read as JSON, else as a Python literal that JSON can carry; else ``raw`` (a string). NaN and
    Infinity, which JSON text cannot carry, stay text."""
    try:
        return json.loads(text, parse_constant=_not_json)
    except ValueError:  # JSONDecodeError too
        pass
    try:
        value = ast.literal_eval(text)
        json.dumps(value, allow_nan=False)  # a tuple is a list; a set, bytes or nan is not JSON
        return value
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return raw


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")
