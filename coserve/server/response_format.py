"""OpenAI's ``response_format`` (and vLLM's ``guided_json``, ``guided_choice``, ``guided_regex``,
``guided_grammar``, ``structured_outputs``) as what a request's output must match: a JSON schema, one of a
list of strings, a regular expression or a grammar (GBNF or Lark).

``{"type": "text"}`` or nothing: free text. ``{"type": "json_object"}``: any JSON object.
``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``: the schema (a
missing one: any JSON value). vLLM's ``guided_json``: a schema, as an object or as its JSON text. Every
schema is compiled here, so an unsupported keyword is a 400 naming it before anything is queued.
"""

from __future__ import annotations

import json
import re
from typing import Any

from coserve.guided.compilers import COMPILERS
from coserve.guided.schema import SchemaError, compile_choices, compile_schema
from coserve.server.errors import bad_request

TYPES = ("text", "json_object", "json_schema")
STRUCTURED = {"json": "guided_json", "choice": "guided_choice", "regex": "guided_regex", "grammar": "guided_grammar"}
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name


def guided_output(body: Any) -> dict[str, Any]:
    """The ``SamplingParams`` fields (``guided_json``, ``guided_choice``, ``guided_regex`` or ``guided_grammar``;
    none: free text) a request's output must match: from ``response_format``, vLLM's ``guided_*`` fields, or
    vLLM's newer ``structured_outputs`` (``{"json": ...}``, ``{"choice": [...]}``, ``{"regex": ...}`` or
    ``{"grammar": ...}``); at most one of them; 400 naming the field when one is bad."""
    given = {f: getattr(body, f, None) for f in COMPILERS}
    structured = getattr(body, "structured_outputs", None)
    if structured is not None:
        if not isinstance(structured, dict) or len(structured) != 1 or not set(structured) <= set(STRUCTURED):
            raise bad_request(f"structured_outputs: must be an object with one of {', '.join(STRUCTURED)}",
                              "structured_outputs")
        if any(v is not None for v in given.values()):
            raise bad_request("structured_outputs: give either structured_outputs or vLLM's guided_* fields",
                              "structured_outputs")
        ((kind, value),) = structured.items()
        given[STRUCTURED[kind]] = value
    named = [f for f, v in given.items() if v is not None]
    rf = getattr(body, "response_format", None)
    if len(named) > 1 or (named and named != ["guided_json"] and rf is not None):
        raise bad_request(f"{named[-1]}: give one way of guiding the output", named[-1])
    for field in ("guided_regex", "guided_grammar"):
        if given[field] is not None:
            try:
                COMPILERS[field](given[field])
            except ValueError as e:
                raise bad_request(f"{field}: {e}", field) from None
            return {field: given[field]}
    if given["guided_choice"] is not None:
        try:
            compile_choices(given["guided_choice"])
        except SchemaError as e:
            raise bad_request(f"guided_choice: {str(e).removeprefix('choices: ')}", "guided_choice") from None
        return {"guided_choice": list(given["guided_choice"])}
    schema = guided_schema(rf, given["guided_json"])
    return {} if schema is None else {"guided_json": schema}


def guided_schema(response_format: Any, guided_json: Any = None) -> dict | bool | None:
    """The schema the output must match, or None for free text; 400 naming the field when either is bad."""
    schema = _from_response_format(response_format)
    if guided_json is not None:
        if schema is not None:
            raise bad_request("guided_json: give either guided_json or a JSON response_format, not both",
                              "guided_json")
        if isinstance(guided_json, str):
            try:
                guided_json = json.loads(guided_json)
            except json.JSONDecodeError as e:
                raise bad_request(f"guided_json: not valid JSON ({e})", "guided_json") from None
        schema = checked_schema(guided_json, "guided_json", "guided_json")
    return schema


def _from_response_format(rf: Any) -> dict | bool | None:
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise bad_request("response_format: must be an object with a 'type'", "response_format")
    kind = rf.get("type")
    if kind not in TYPES:
        raise bad_request(f"response_format.type: must be one of {', '.join(TYPES)}, got {kind!r}",
                          "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema: must be an object with a 'name' and a 'schema'",
                          "response_format")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise bad_request("response_format.json_schema.name: must be 1 to 64 letters, digits, '_' or '-'",
                          "response_format")
    if "strict" in spec and not isinstance(spec["strict"], bool) and spec["strict"] is not None:
        raise bad_request("response_format.json_schema.strict: must be a boolean", "response_format")
    return checked_schema(spec.get("schema", True), "response_format.json_schema.schema", "response_format")


def checked_schema(schema: Any, field: str, param: str) -> dict | bool:
    """``schema`` if it compiles; else a 400 naming ``field`` and the keyword."""
    try:
        compile_schema(schema)
    except SchemaError as e:
        where = str(e).removeprefix("schema")  # the compiler names paths from "schema"
        raise bad_request(f"{field}{where}", param) from None
    return schema
