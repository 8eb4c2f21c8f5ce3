"""A JSON Schema, compiled into the node table the byte-level JSON machine (``machine.py``) walks.

Supported (what OpenAI's structured outputs and vLLM's guided JSON are used with): ``type`` (one or a
list), ``properties``, ``required``, ``additionalProperties`` (a bool or a schema), ``items``,
``minItems``, ``maxItems``, ``enum``, ``const``, ``anyOf`` / ``oneOf`` (any branch), ``minLength`` /
``maxLength``, ``pattern`` (found anywhere in the string unless anchored, as JSON Schema says; the syntax of
``regex.py``), ``minimum`` / ``maximum`` (exclusive ones too on integers; numbers with bounds take whole-number
bounds and are written without exponent), ``format`` on strings for the formats of ``formats.py`` (date,
time, date-time, uuid, ipv4, hostname, email; a ``pattern`` beside it wins; other formats are annotations),
local ``$ref`` into ``$defs`` / ``definitions`` (recursion allowed), and ``{}`` / ``true`` for any value.
Annotations (``title``, ``description``, ``default``, ``examples``, ``$schema``, ``$id``, ``strict``, other
``format``s) are ignored. Any other keyword is a constraint this module cannot
enforce: ``SchemaError`` names it (and where it is) rather than letting output slip past it.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from coserve.guided.formats import FORMATS
from coserve.guided.number_range import integer_range, number_range
from coserve.guided.regex import RegexError, compile_regex, search_pattern

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "format",
                         "strict", "$defs", "definitions", "deprecated", "readOnly", "writeOnly"})
HANDLED = frozenset({"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
                     "enum", "const", "anyOf", "oneOf", "minLength", "maxLength", "pattern", "minimum", "maximum",
                     "exclusiveMinimum", "exclusiveMaximum", "$ref"})
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
MAX_NODES = 10_000  # a schema compiling to more is refused (a request cannot make the server build without end)


class SchemaError(ValueError):
    """A schema this module cannot compile; the message names the keyword and its path."""


@dataclass(frozen=True, slots=True)
class Node:
    """One compiled schema: ``kind`` is ``any``, ``union`` (``options``), ``literal`` (``texts``: the JSON
    texts of the allowed values), or one of ``TYPES``."""

    kind: str
    options: tuple[int, ...] = ()  # union: node ids, any of which may match
    texts: tuple[bytes, ...] = ()  # literal: each allowed value, serialised compactly
    properties: tuple[tuple[bytes, int], ...] = ()  # object: (key as JSON text with its quotes, value node)
    required: frozenset[bytes] = frozenset()  # object: keys (JSON text) that must appear
    additional: int | None = None  # object: node of other keys' values; None = no other keys
    items: int = 0  # array: node of every item
    min_items: int = 0
    max_items: int | None = None
    min_length: int = 0  # string: in characters
    max_length: int | None = None
    pattern: str | None = None  # string: a pattern (``regex.py`` syntax) the whole decoded content matches;
    #   number / integer: a pattern the number's text matches (its bounds, number_range.py)

    def property_node(self, key: bytes) -> int | None:
        return next((nid for k, nid in self.properties if k == key), None)

    def next_keys(self, seen: frozenset[bytes]) -> tuple[bytes, ...]:
        """A closed object's keys that may come next, ``seen`` written: those declared after the last written
        one, up to the first required one (which cannot be skipped). Keys come in the schema's order, as
        OpenAI's structured outputs and llama.cpp's schema grammars write them."""
        last = max((i for i, (k, _) in enumerate(self.properties) if k in seen), default=-1)
        keys = []
        for k, _ in self.properties[last + 1:]:
            keys.append(k)
            if k in self.required:
                break
        return tuple(keys)


@dataclass(slots=True)
class CompiledSchema:
    """The node table; node ``root`` is the whole value, node 0 is "any JSON value"."""

    nodes: list[Node] = field(default_factory=list)
    root: int = 0


ANY, ANY_OBJECT, ANY_ARRAY, ANY_STRING = 0, 1, 2, 3  # the first nodes of every table


def compile_schema(schema: Any) -> CompiledSchema:
    """Compile ``schema`` (a dict or a bool); raises ``SchemaError`` naming what is unsupported or invalid.

    Tables are shared by the schema's ``repr`` (a request's schema is compiled at the server, in
    ``SamplingParams`` and by the engine's guide); nothing mutates a compiled table."""
    try:
        key = repr(schema)
    except RecursionError:
        raise SchemaError("schema: nests too deeply to compile") from None
    with _LOCK:  # the server's loop and the engine thread both compile
        table = _COMPILED.get(key)
        if table is not None:
            _COMPILED.move_to_end(key)
            return table
    try:
        table = _Compiler(schema).run()
    except RecursionError:  # the compiler recurses once per level of subschemas
        raise SchemaError("schema: nests too deeply to compile") from None
    with _LOCK:
        _COMPILED[key] = table
        if len(_COMPILED) > MAX_COMPILED:
            _COMPILED.popitem(last=False)
    return table


MAX_COMPILED = 128
_COMPILED: OrderedDict[str, CompiledSchema] = OrderedDict()
_LOCK = threading.Lock()


MAX_CHOICES = 4096


def compile_choices(choices: Any) -> CompiledSchema:
    """A table whose root matches exactly one of ``choices`` as raw text (vLLM's ``guided_choice``: no quotes)."""
    if (not isinstance(choices, (list, tuple)) or not choices or len(choices) > MAX_CHOICES
            or any(not isinstance(c, str) or not c for c in choices)):
        raise SchemaError(f"choices: must be 1 to {MAX_CHOICES} non-empty strings, got {choices!r}"[:300])
    table = _Compiler(True).table
    table.nodes.append(Node("literal", texts=tuple(dict.fromkeys(c.encode() for c in choices))))
    table.root = len(table.nodes) - 1
    return table


def json_text(value: Any) -> bytes:
    """The compact JSON text of a value, as the machine matches it (``json.dumps`` with ``", "`` and
    ``": "`` separators and non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False).encode()


class _Compiler:
    def __init__(self, schema: Any) -> None:
        self.top = schema
        self.table = CompiledSchema([Node("any"), Node("object", additional=ANY), Node("array", items=ANY),
                                     Node("string")])
        self.refs: dict[str, int] = {}

    def run(self) -> CompiledSchema:
        self.table.root = self.node(self.top, "schema")
        return self.table

    def add(self, node: Node) -> int:
        if len(self.table.nodes) >= MAX_NODES:
            raise SchemaError(f"schema: too large (more than {MAX_NODES} nodes)")
        self.table.nodes.append(node)
        return len(self.table.nodes) - 1

    def node(self, s: Any, path: str) -> int:
        if s is True or s == {}:
            return ANY
        if s is False:
            raise SchemaError(f"{path}: false matches nothing")
        if not isinstance(s, dict):
            raise SchemaError(f"{path}: a schema must be an object or a bool, got {type(s).__name__}")
        unknown = sorted(set(s) - HANDLED - ANNOTATIONS)
        if unknown:
            raise SchemaError(f"{path}: keyword '{unknown[0]}' is not supported (supported: "
                              f"{', '.join(sorted(HANDLED))})")
        if "$ref" in s:
            if set(s) & (HANDLED - {"$ref"}):
                raise SchemaError(f"{path}: $ref beside other constraints is not supported")
            return self.ref(s["$ref"], path)
        if "const" in s:
            return self.add(Node("literal", texts=(json_text(s["const"]),)))
        if "enum" in s:
            if not isinstance(s["enum"], list) or not s["enum"]:
                raise SchemaError(f"{path}.enum: must be a non-empty array")
            return self.add(Node("literal", texts=tuple(dict.fromkeys(json_text(v) for v in s["enum"]))))
        for key in ("anyOf", "oneOf"):
            if key in s:
                branches = s[key]
                if not isinstance(branches, list) or not branches:
                    raise SchemaError(f"{path}.{key}: must be a non-empty array")
                rest = {k: v for k, v in s.items() if k != key and k not in ANNOTATIONS}
                if rest:
                    raise SchemaError(f"{path}: {key} beside other constraints is not supported")
                return self.union([self.node(b, f"{path}.{key}[{i}]") for i, b in enumerate(branches)])
        types = s.get("type")
        if types is None:
            types = [t for t, keys in (("object", ("properties", "required", "additionalProperties")),
                                       ("array", ("items", "minItems", "maxItems")),
                                       ("string", ("minLength", "maxLength", "pattern")),
                                       ("number", BOUNDS))
                     if any(k in s for k in keys)]
            if not types:
                return ANY
        if isinstance(types, str):
            types = [types]
        if not isinstance(types, list) or not types or any(t not in TYPES for t in types):
            raise SchemaError(f"{path}.type: must be one of {', '.join(TYPES)} or a list of them, got {types!r}")
        return self.union([self.typed(t, s, path) for t in dict.fromkeys(types)])

    def union(self, ids: list[int]) -> int:
        return ids[0] if len(ids) == 1 else self.add(Node("union", options=tuple(ids)))

    def ref(self, ref: Any, path: str) -> int:
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise SchemaError(f"{path}.$ref: only local references (#/$defs/...) are supported, got {ref!r}")
        if ref in self.refs:
            return self.refs[ref]
        target: Any = self.top
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise SchemaError(f"{path}.$ref: {ref} does not resolve")
            target = target[part]
        # A placeholder union of one, filled in once the target is compiled (so recursion terminates).
        slot = self.add(Node("union", options=()))
        self.refs[ref] = slot
        self.table.nodes[slot] = Node("union", options=(self.node(target, ref),))
        return slot

    def typed(self, t: str, s: dict, path: str) -> int:
        if t == "object":
            props = s.get("properties", {})
            if not isinstance(props, dict):
                raise SchemaError(f"{path}.properties: must be an object")
            required = s.get("required", [])
            if not isinstance(required, list) or any(not isinstance(r, str) for r in required):
                raise SchemaError(f"{path}.required: must be an array of property names")
            missing = [r for r in required if r not in props]
            if missing:
                raise SchemaError(f"{path}.required: '{missing[0]}' is not among the properties")
            extra = s.get("additionalProperties", True)
            additional = None if extra is False else self.node(extra, f"{path}.additionalProperties")
            return self.add(Node("object", properties=tuple((json_text(k), self.node(v, f"{path}.properties.{k}"))
                                                            for k, v in props.items()),
                                 required=frozenset(json_text(r) for r in required), additional=additional))
        if t == "array":
            lo, hi = self.bounds(s, "minItems", "maxItems", path)
            return self.add(Node("array", items=self.node(s.get("items", True), f"{path}.items"),
                                 min_items=lo, max_items=hi))
        if t == "string":
            lo, hi = self.bounds(s, "minLength", "maxLength", path)
            pattern = None
            if "pattern" in s:
                try:
                    pattern = search_pattern(s["pattern"])
                    compile_regex(pattern)
                except RegexError as e:
                    raise SchemaError(f"{path}.pattern: {e}") from None
            elif s.get("format") in FORMATS:  # a known format, unless a pattern says more (formats.py)
                pattern = FORMATS[s["format"]]
            if (lo, hi, pattern) == (0, None, None):
                return ANY_STRING
            return self.add(Node("string", min_length=lo, max_length=hi, pattern=pattern))
        if t == "boolean":
            return self.add(Node("literal", texts=(b"true", b"false")))
        if t == "null":
            return self.add(Node("literal", texts=(b"null",)))
        if any(k in s for k in BOUNDS):
            return self.add(Node(t, pattern=self.bounded(t, s, path)))
        return self.add(Node(t))  # number, integer

    @staticmethod
    def bounded(t: str, s: dict, path: str) -> str:
        """The pattern of a number or integer within ``minimum`` / ``maximum`` (and, for integers, the exclusive
        bounds): exact for integers; numbers take integer inclusive bounds and are written without exponent."""
        for key in BOUNDS:
            v = s.get(key)
            if key in s and (isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or abs(v) == float("inf")):
                raise SchemaError(f"{path}.{key}: must be a finite number, got {v!r}")
        if t == "integer":
            lo = [math.ceil(s["minimum"])] if "minimum" in s else []
            lo += [math.floor(s["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in s else []
            hi = [math.floor(s["maximum"])] if "maximum" in s else []
            hi += [math.ceil(s["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in s else []
            pattern = integer_range(max(lo, default=None), min(hi, default=None))
        else:
            for key in ("exclusiveMinimum", "exclusiveMaximum"):
                if key in s:
                    raise SchemaError(f"{path}.{key}: not supported on a number (only on integers); use minimum / "
                                      "maximum")
            for key in ("minimum", "maximum"):
                if key in s and not float(s[key]).is_integer():
                    raise SchemaError(f"{path}.{key}: only whole-number bounds are supported on a number, got "
                                      f"{s[key]!r}")
            pattern = number_range(int(s["minimum"]) if "minimum" in s else None,
                                   int(s["maximum"]) if "maximum" in s else None)
        if pattern is None:
            raise SchemaError(f"{path}: no {t} lies within its bounds")
        return pattern

    @staticmethod
    def bounds(s: dict, lo_key: str, hi_key: str, path: str) -> tuple[int, int | None]:
        lo, hi = s.get(lo_key, 0), s.get(hi_key)
        for key, v in ((lo_key, lo), (hi_key, hi)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise SchemaError(f"{path}.{key}: must be a non-negative integer, got {v!r}")
        if hi is not None and hi < lo:
            raise SchemaError(f"{path}.{hi_key}: {hi} is below {lo_key} {lo}")
        return lo, hi
