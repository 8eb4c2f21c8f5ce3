"""Tool calls written as a Python list of calls (vLLM's ``pythonic`` parser: Llama 3.2 and 4, ToolACE and others):
``[get_weather(city="Paris", days=[1, 2]), get_time()]``, keyword arguments of Python literals. The reply is nothing
but the list (Llama 4's ``<|python_start|>`` and ``<|python_end|>``, special tokens, are not in the text); a call's
``arguments`` are its keywords as a JSON object (``True`` as ``true``, a tuple as a list).

A stream announces a call once its name and ``(`` are written, and sends its arguments whole once its ``)`` is:
Python literals become JSON only when whole. The finished text is read by Python's own parser (``ast``); the growing
one is followed as far as finding where each call ends (strings, brackets), and read the same way call by call.
"""

from __future__ import annotations

import ast
import json
import re

from coserve.server.call_text import CallView, NotACall, skip_ws

OPENING, CLOSING = "([{", ")]}"
PLAIN = re.compile(r"[^'\"()\[\]{},]+")  # a run of characters the scan has nothing to do with


JSON_NAMES = {"null": None, "true": True, "false": False}  # what OLMo 3 writes for Python's None, True and False


class _JsonNames(ast.NodeTransformer):
    """JSON's ``null``, ``true`` and ``false`` in a call's values, read as the constants they name."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.copy_location(ast.Constant(JSON_NAMES[node.id]), node) if node.id in JSON_NAMES else node


def parse_pythonic(text: str, json_names: bool = False) -> list[tuple[str, str]] | None:
    """``(name, arguments)`` of each call of a finished reply that is a non-empty list of calls; None otherwise.
    ``json_names``: ``null``, ``true`` and ``false`` are values too (OLMo 3's)."""
    body = text.strip()
    if not (body.startswith("[") and body.endswith("]")):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = [_call(e, json_names) for e in tree.elts]
    return None if any(c is None for c in calls) else calls


def _call(node: ast.expr, json_names: bool = False) -> tuple[str, str] | None:
    """A call node's name and keywords as JSON text; None if it is not ``name(keyword=literal, ...)``."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    if any(k.arg is None for k in node.keywords):  # **mapping
        return None
    try:
        arguments = {k.arg: ast.literal_eval(_JsonNames().visit(k.value) if json_names else k.value)
                     for k in node.keywords}
        return node.func.id, json.dumps(arguments, ensure_ascii=False)
    except (ValueError, TypeError, SyntaxError, RecursionError):  # not a literal, or not JSON (a set, bytes)
        return None


def pythonic_views(text: str, json_names: bool = False) -> list[CallView]:
    """The calls of a growing reply as far as they are written: each named once ``name(`` is, with its arguments
    once its ``)`` is; NotACall once the text cannot be a list of calls."""
    i = skip_ws(text, 0)
    if i == len(text):
        return []
    if text[i] != "[":
        raise NotACall("a reply of Python calls begins with [")
    views: list[CallView] = []
    start, depth, pos = i + 1, 0, i + 1
    while pos < len(text):
        plain = PLAIN.match(text, pos)  # skipped by the regex engine: a stream re-reads the text at every token
        if plain is not None:
            pos = plain.end()
            continue
        c = text[pos]
        if c in "'\"":
            end = _string_end(text, pos)
            if end is None:
                break
            pos = end
            continue
        if c in OPENING:
            if depth == 0:
                if c != "(":
                    raise NotACall("a list element that is not a call")
                name = text[start:pos].strip()
                if not name.isidentifier():
                    raise NotACall(f"{name!r} is not a function's name")
                views.append(CallView(name, "", None))
            depth += 1
        elif c in CLOSING:
            depth -= 1
            if depth < 0:  # the list's own ]
                break
            if depth == 0:
                try:
                    call = _call(ast.parse(text[start:pos + 1].strip(), mode="eval").body, json_names)
                except SyntaxError:
                    call = None
                if call is None:
                    raise NotACall("a list element that is not name(keyword=literal, ...)")
                views[-1] = CallView(call[0], call[1], pos + 1)
        elif c == "," and depth == 0:
            start = pos + 1
        pos += 1
    return views


def _string_end(text: str, i: int) -> int | None:
    """Index just past the Python string literal whose quote is at ``text[i]`` (single or triple quoted); None
    while it is not closed."""
    quote = text[i] * 3 if text.startswith(text[i] * 3, i) else text[i]
    start = pos = i + len(quote)
    while (pos := text.find(quote, pos)) >= 0:  # found by str.find: a stream re-reads the text at every token
        slash = pos
        while slash > start and text[slash - 1] == "\\":
            slash -= 1
        if (pos - slash) % 2 == 0:  # not escaped
            return pos + len(quote)
        pos += 1
    return None
