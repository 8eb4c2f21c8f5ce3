"""Tool calls in a section of marker tokens after any text: DeepSeek's and Kimi K2's (``--tool-call-parser``
``deepseek_v3``, ``deepseek_v31``, ``kimi_k2``, by vLLM's names).

- ``deepseek_v3`` (DeepSeek-V3, R1-0528): ``<｜tool▁calls▁begin｜>`` then per call ``<｜tool▁call▁begin｜>function
  <｜tool▁sep｜>name`` and the arguments in a fenced JSON block (`````json`` ... `````), ``<｜tool▁call▁end｜>``;
  then ``<｜tool▁calls▁end｜>``;
- ``deepseek_v31`` (DeepSeek-V3.1 and later): per call ``<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}
  <｜tool▁call▁end｜>`` in the same section;
- ``kimi_k2`` (Kimi K2): ``<|tool_calls_section_begin|>`` then per call ``<|tool_call_begin|>functions.name:0
  <|tool_call_argument_begin|>{...}<|tool_call_end|>``, then ``<|tool_calls_section_end|>``. The call's id is the
  ``functions.name:0`` the model wrote (its chat template writes past calls back by it), as vLLM keeps it.

The markers are special tokens of those tokenizers: a request read by these parsers decodes them into its text
(``tool_parser.CallFormat.keeps_special``). The text before the section is the reply's content; arguments are the
JSON object the model wrote, sent by a stream as written (``section_views``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from coserve.server.call_text import CallView, NotACall, skip_ws, value_end, whole_calls


@dataclass(frozen=True, slots=True)
class Section:
    """One format's markers and how a call's head (what comes before its arguments) names it."""

    begin: str  # the section's first marker (also what the calls after any text begin with)
    call_begin: str
    head_end: str  # what ends a call's head
    call_end: str
    end: str  # the section's last marker
    fenced: bool = False  # DeepSeek-V3: the name follows head_end, and the arguments are a ```json block
    kimi_ids: bool = False  # the head is an id, functions.name:index; the name is read from it


DEEPSEEK_BEGIN, DEEPSEEK_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK = dict(begin=DEEPSEEK_BEGIN, call_begin="<｜tool▁call▁begin｜>", head_end="<｜tool▁sep｜>",
                call_end="<｜tool▁call▁end｜>", end=DEEPSEEK_END)
SECTIONS = {
    "deepseek_v3": Section(**DEEPSEEK, fenced=True),
    "deepseek_v31": Section(**DEEPSEEK),
    "kimi_k2": Section("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                       "<|tool_call_end|>", "<|tool_calls_section_end|>", kimi_ids=True),
}
FENCE_OPEN, FENCE_CLOSE = "```json", "```"
NAME = re.compile(r"[A-Za-z0-9_-]+")
KIMI_ID = re.compile(r"(?:[\w.-]*\.)?([A-Za-z0-9_-]+):\d+")


def section_calls(text: str, form: Section) -> tuple[str | None, list[tuple[str, str, str | None]]] | None:
    """``(content, [(name, arguments, id), ...])`` of a finished output whose calls follow its text in ``form``'s
    section (content None where blank; the id the model wrote, else None); None where there is no section or it is
    not all whole calls."""
    at = text.find(form.begin)
    if at < 0:
        return None
    try:
        views = whole_calls(section_views(text, form))
    except NotACall:
        return None
    if views is None:
        return None
    i = skip_ws(text, views[-1].end)
    if text.startswith(form.end, i):
        i = skip_ws(text, i + len(form.end))
    if i < len(text):
        return None  # text after the calls: not a reply of calls
    return (text[:at] if text[:at].strip() else None), [(v.name, v.arguments, v.ident) for v in views]


def section_views(text: str, form: Section) -> list[CallView]:
    """The calls of a growing output as far as they are written (the last one may be open; ``end``: past its
    ``call_end``); NotACall once the section cannot be calls. Text after a whole call ends the views."""
    at = text.find(form.begin)
    if at < 0:
        return []
    i = skip_ws(text, at + len(form.begin))
    views: list[CallView] = []
    while True:
        if not text.startswith(form.call_begin, i):
            if not form.call_begin.startswith(text[i:]) and not views:
                raise NotACall(f"a section of calls begins with {form.call_begin!r}")
            return views  # the end so far, a marker half written, the section's end, or text after the calls
        view = _call(text, i + len(form.call_begin), form)
        views.append(view)
        if view.end is None:
            return views
        i = skip_ws(text, view.end)


def _call(text: str, start: int, form: Section) -> CallView:
    """The call whose head begins at ``text[start]``, as far as it is written."""
    sep = text.find(form.head_end, start)
    if sep < 0:
        return CallView(None, "", None)  # its head still being written
    head, i = text[start:sep].strip(), sep + len(form.head_end)
    ident = None
    if form.fenced:  # DeepSeek-V3: "function", then the name up to the fence
        if head != "function":
            raise NotACall(f"a DeepSeek-V3 call's head is 'function', not {head[:20]!r}")
        fence = text.find(FENCE_OPEN, i)
        if fence < 0:
            return CallView(None, "", None)
        name, i = text[i:fence].strip(), fence + len(FENCE_OPEN)
    elif form.kimi_ids:
        match = KIMI_ID.fullmatch(head)
        if match is None:
            raise NotACall(f"a Kimi K2 call's id is functions.name:index, not {head[:40]!r}")
        name, ident = match.group(1), head
    else:
        name = head
    if not NAME.fullmatch(name):
        raise NotACall(f"not a function's name: {name[:40]!r}")
    i = skip_ws(text, i)
    if i >= len(text):
        return CallView(name, "", None, ident)
    if text[i] != "{":
        raise NotACall(f"a call's arguments are a JSON object; they begin with {text[i]!r}")
    end = value_end(text, i)
    if end is None:
        return CallView(name, text[i:], None, ident)
    arguments, j = text[i:end], skip_ws(text, end)
    if form.fenced:
        if not text.startswith(FENCE_CLOSE, j):
            return _open_or_not(text, j, FENCE_CLOSE, name, arguments, ident)
        j = skip_ws(text, j + len(FENCE_CLOSE))
    if not text.startswith(form.call_end, j):
        return _open_or_not(text, j, form.call_end, name, arguments, ident)
    return CallView(name, arguments, j + len(form.call_end), ident)


def _open_or_not(text: str, j: int, marker: str, name: str, arguments: str, ident: str | None) -> CallView:
    """A call whose arguments are whole but whose closing ``marker`` is not: still open while what follows may
    become it, else not a call."""
    if marker.startswith(text[j:]):
        return CallView(name, arguments, None, ident)
    raise NotACall(f"{marker!r} was expected after a call's arguments, not {text[j:j + 20]!r}")
