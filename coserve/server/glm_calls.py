"""Tool calls as GLM-4.5 and 4.6 write them (vLLM's ``glm45`` parser), after any text::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

A value is read as vLLM reads it: as written (stripped) where the request's tool declares the parameter a string,
else as JSON, else as a Python literal, else as written. A call's ``arguments`` are those values as a JSON object.
A stream announces a call once its name's line is written and sends its arguments whole once ``</tool_call>`` is.
"""

from __future__ import annotations

import json
import re

from coserve.server.call_text import CallView
from coserve.server.xml_calls import CLOSE, OPEN, block_calls, blocks, json_or_literal

NAME = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*(?=\n|<arg_key>|$)")
PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def parse_glm_calls(text: str, schemas: dict[str, dict]) -> tuple[str | None, list[tuple[str, str]]] | None:
    """``(content, [(name, arguments), ...])`` of a finished output (``xml_calls.block_calls``): a call per closed
    block."""
    def read(body: str, closed: bool) -> list[tuple[str, str]] | None:
        call = _call(body, schemas) if closed else None
        return None if call is None else [call]
    return block_calls(text, (OPEN, CLOSE), read)


def glm_views(text: str, schemas: dict[str, dict]) -> list[CallView]:
    """The calls of a growing output's blocks as far as they are written: named once the name's line is, with
    their arguments once the block is closed. A block that cannot be a call ends the views."""
    views: list[CallView] = []
    for _, body, end, closed in blocks(text, (OPEN, CLOSE)):
        if closed:
            call = _call(body, schemas)
            if call is None:
                break
            views.append(CallView(*call, end))
            continue
        named = NAME.match(body)
        if named is not None and named.end() < len(body):  # (else its name may still be growing)
            views.append(CallView(named.group(1), "", None))
        break
    return views


def _call(body: str, schemas: dict[str, dict]) -> tuple[str, str] | None:
    """A closed block's call: its name and arguments as JSON text; None if the body is not one."""
    named = NAME.match(body)
    if named is None:
        return None
    name, rest = named.group(1), body[named.end():]
    if PAIR.sub("", rest).strip():
        return None  # text that is no argument
    properties = (schemas.get(name) or {}).get("properties") or {}
    arguments = {key.strip(): _value(value.strip(), properties.get(key.strip())) for key, value in PAIR.findall(rest)}
    return name, json.dumps(arguments, ensure_ascii=False)


def _value(raw: str, schema: dict | None):
    """A value as its parameter's declared type reads it: a string as written, anything else JSON or a Python
    literal where it is one."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        return raw
    return json_or_literal(raw, raw)
