"""Tool calls read from a JSON text that is still being written: ``{"name": ..., "arguments": {...}}`` objects
(a Hermes ``<tool_call>`` block's body) and arrays of ``{"name": ..., "parameters": {...}}`` objects (what
``tool_choice: "required"`` makes the model write).

What a stream may send of a call before the output ends: its name once the name's string is whole, and its
arguments' JSON text character by character as it grows (an object's text up to where the model has got:
every character of it belongs to the arguments, so nothing is held back). Arguments given as a JSON string
holding JSON text (``"arguments": "{\\"x\\": 1}"``) are sent once the string is whole, decoded. The final
reply reads the same text with the same functions, so what was streamed is always a prefix of the final
arguments. Syntax is followed only as far as finding where values end; whether the whole is valid is decided
by ``json.loads`` on the finished text (``tool_parser.parse_tool_calls``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\n\r"
_DECODER = json.JSONDecoder()


class NotACall(ValueError):
    """The text cannot be (the beginning of) a call object."""


@dataclass(frozen=True, slots=True)
class CallView:
    """What a call object's text shows so far."""

    name: str | None  # once its string is whole
    arguments: str  # the arguments' text so far: an object's raw text, or a string's decoded content once whole
    end: int | None  # index just past the object's closing brace, once it is written
    ident: str | None = None  # the call's id, where the model writes one (Kimi K2)


def after_lead(text: str, lead: str, required: bool = True) -> str | None:
    """What follows ``lead`` at the start of a growing reply of calls (blanks before it aside): None while the
    reply is blank or the lead half written; where it begins otherwise, the reply itself if the lead is not
    ``required``, else NotACall."""
    rest = text[skip_ws(text, 0):]
    if lead.startswith(rest):
        return None
    if rest.startswith(lead):
        return rest[len(lead):]
    if required:
        raise NotACall(f"a reply of calls begins with {lead!r}")
    return rest


def whole_calls(views: list[CallView]) -> list[CallView] | None:
    """``views`` where there is at least one and each is a whole call (its end written, a name, a JSON object's
    arguments); None otherwise."""
    for view in views:
        try:
            if view.end is None or not view.name or not isinstance(json.loads(view.arguments), dict):
                return None
        except json.JSONDecodeError:
            return None
    return views or None


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """Index just past the JSON value that starts at ``text[i]``; None while it is not whole (or, for an
    object or array, not valid JSON: the finished text's ``json.loads`` says so). Objects, arrays and numbers
    are read by ``json``'s C scanner, so that a stream re-reading a long call's arguments at every token costs
    little."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return _string_end(text, i)
    try:
        _, end = _DECODER.raw_decode(text, i)
    except json.JSONDecodeError:
        return None
    if end == len(text) and text[i] not in "{[":
        return None  # a number or literal at the end may go on
    return end


def _string_end(text: str, i: int) -> int | None:
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def _loads(text: str):
    """A whole JSON string's value (a bad escape in it: NotACall, as any text that cannot be a call)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise NotACall(f"not JSON: {text[:20]!r} ({e.msg})") from None


def scan_call(text: str, start: int, argument_keys: tuple[str, ...], strings_hold_json: bool = True) -> CallView:
    """The call object whose ``{`` is at ``text[start]`` (after any whitespace), as far as it is written. Its
    arguments are the first member named one of ``argument_keys`` (in the order written: a model writes one).
    With ``strings_hold_json`` (Hermes) a string value is JSON text, decoded; without, any value is the
    arguments' own JSON (its raw text, whole once it ends, an object's as it grows). NotACall where the text
    cannot become such an object."""
    i = skip_ws(text, start)
    if i >= len(text):
        return CallView(None, "", None)
    if text[i] != "{":
        raise NotACall(f"a call is a JSON object; it begins with {text[i]!r}")
    name, arguments, args_found = None, "", False
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            break
        if text[i] == "}":
            return CallView(name, arguments if args_found else "{}", i + 1)
        if text[i] == ",":
            i = skip_ws(text, i + 1)
            if i >= len(text):
                break
        if text[i] != '"':
            raise NotACall(f"a key was expected at {text[i:i + 10]!r}")
        key_end = _string_end(text, i)
        if key_end is None:
            break
        key = _loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text):
            break
        if text[i] != ":":
            raise NotACall(f"':' was expected after the key {key!r}")
        i = skip_ws(text, i + 1)
        if i >= len(text):
            break
        end = value_end(text, i)
        if key == "name" and name is None:
            if end is None:
                break
            value = _loads(text[i:end])
            if not isinstance(value, str):
                raise NotACall("a call's name is a string")
            name = value
        elif key in argument_keys and not args_found:
            args_found = True
            if text[i] == "{":
                arguments = text[i:end if end is not None else len(text)]
            elif text[i] == '"' and strings_hold_json:  # JSON text in a string: sent whole, decoded
                if end is not None:
                    arguments = _loads(text[i:end])
            elif strings_hold_json:
                raise NotACall(f"a call's {key} is an object or a string holding one")
            elif end is not None:
                arguments = text[i:end]
        if end is None:
            break
        i = end
    return CallView(name, arguments, None)


def scan_call_list(text: str, argument_keys: tuple[str, ...] = ("parameters",)) -> list[CallView]:
    """The calls of a JSON array of call objects, as far as it is written (NotACall where it cannot be one)."""
    i = skip_ws(text, 0)
    if i >= len(text):
        return []
    if text[i] != "[":
        raise NotACall(f"a list of calls is a JSON array; it begins with {text[i]!r}")
    views: list[CallView] = []
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text) or text[i] == "]":
            return views
        if text[i] == ",":
            i += 1
            continue
        view = scan_call(text, i, argument_keys, strings_hold_json=False)
        views.append(view)
        if view.end is None:
            return views
        i = view.end
