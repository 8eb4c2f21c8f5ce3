"""Tool calls a model writes freely in its text, for ``tool_choice: "auto"`` (vLLM's ``--tool-call-parser``).

Seventeen formats, by vLLM's names:
- ``hermes`` (Hermes, Qwen2/2.5/3 and the many models trained on it): each call is ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``, after any text;
- ``llama3_json`` (Llama 3.1 and 3.2's JSON tool calling): the reply is nothing but calls, ``{"name": ...,
  "parameters": {...}}`` objects separated by ``;`` (their ``<|python_tag|>``, a special token, is not in the text);
  a reply that does not begin with ``{`` is text;
- ``pythonic`` (Llama 3.2 and 4, ToolACE): the reply is a Python list of calls, ``[f(a=1), g(b="x")]``
  (``pythonic_calls.py``); a reply that does not begin with ``[`` is text; ``llama4_pythonic`` reads the same
  inside Llama 4's ``<|python_start|>`` ... ``<|python_end|>`` where the text keeps them, and ``llama4_json`` is
  ``llama3_json`` (as in vLLM);
- ``phi4_mini_json`` (Phi-4-mini): the reply is ``functools[`` then the JSON array of ``{"name", "arguments"}``
  calls; ``olmo3`` (OLMo 3): the reply is ``<function_calls>`` then one Python call per line
  (``olmo3_calls.py``);
- ``mistral``: the calls after ``[TOOL_CALLS]``, after any text, in either of Mistral's forms: a JSON array of
  ``{"name", "arguments"}`` objects (Mistral 7B Instruct v0.3, Mixtral 8x22B Instruct), or ``name[ARGS]{...}``
  per call, each after its own ``[TOOL_CALLS]`` (tokenizers v11 and later: Mistral Small 3.1/3.2, Devstral,
  Magistral, Ministral 3; v13's ``name[CALL_ID]id[ARGS]{...}`` too). Its markers are special tokens: as vLLM does,
  a request read by this parser decodes special tokens into its text (``keeps_special``).
- ``granite`` (IBM Granite 3): the JSON array of Mistral's first form, after ``<tool_call>`` where the model writes
  it as text (its ``<|tool_call|>`` token is special);
- ``qwen3_coder`` (Qwen3-Coder): ``<tool_call><function=name><parameter=key>value</parameter></function>
  </tool_call>`` blocks after any text, each value read by the type the request's tool declares for it
  (``xml_calls.py``; ``schemas``: the tools' ``parameters`` by name); ``seed_oss`` (Seed-OSS): the same in
  ``<seed:tool_call>`` blocks;
- ``glm45`` (GLM-4.5/4.6): ``<tool_call>name`` then ``<arg_key>k</arg_key><arg_value>v</arg_value>`` pairs,
  ``</tool_call>``, after any text (``glm_calls.py``);
- ``minimax_m2`` (MiniMax-M2): ``<invoke name="f"><parameter name="a">1</parameter></invoke>`` calls in
  ``<minimax:tool_call>`` blocks after any text (``minimax_calls.py``), values typed as ``qwen3_coder``'s;
- ``deepseek_v3``, ``deepseek_v31`` and ``kimi_k2``: a section of marker tokens after any text
  (``section_calls.py``), decoded into the text as ``mistral``'s are;
- ``openai`` (gpt-oss): its harmony ``commentary`` messages to ``functions.NAME``, as ``--reasoning-parser
  openai_gptoss`` leaves them in the reply (``harmony.py``), after any text.
A reply that is not all whole calls is text, as vLLM leaves it; names are not checked against the request's tools
(as vLLM does not). A JSON call's ``arguments`` are the JSON text the model wrote for them, so that a stream can send
them as they are written (``tool_stream.py``, through ``call_views``); a Python or XML call's are made from its
values, and go whole once the call is.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from coserve.server.call_text import (CallView, NotACall, after_lead, scan_call, scan_call_list, skip_ws,
                                      value_end)
from coserve.server.glm_calls import glm_views, parse_glm_calls
from coserve.server.harmony import CALL_OPEN as HARMONY_CALL, harmony_calls, harmony_views
from coserve.server.minimax_calls import OPEN as MINIMAX_OPEN, minimax_views, parse_minimax_calls
from coserve.server.mistral_calls import TOOL_CALLS, call_array, mistral_calls, mistral_views
from coserve.server.olmo3_calls import OPEN as OLMO3_OPEN, olmo3_views, parse_olmo3
from coserve.server.pythonic_calls import parse_pythonic, pythonic_views
from coserve.server.section_calls import SECTIONS, section_calls, section_views
from coserve.server.xml_calls import SEED_CLOSE, SEED_OPEN, block_calls, parse_xml_calls, xml_views

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")  # where a Hermes call's arguments may be (the first written counts)


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's tool_calls carry it
    ident: str | None = None  # the id the model wrote for it (Kimi K2), else one is made


def parse_tool_calls(text: str, parser: str = "hermes", schemas: dict[str, dict] | None = None
                     ) -> tuple[str | None, list[ParsedCall]]:
    """``(content, calls)`` of a finished output: the text before the calls (None when blank) and each call;
    ``(text, [])`` when there is none or one is not a call. ``schemas``: the tools' ``parameters``, by name."""
    return FORMATS[parser].parse(text, schemas or {})


def call_views(text: str, parser: str, schemas: dict[str, dict] | None = None) -> list[CallView]:
    """The calls of a growing output as far as they are written (the last one may be open); NotACall once the
    text cannot be calls."""
    return FORMATS[parser].views(text, schemas or {})


def visible_text(text: str, parser: str = "hermes") -> str:
    """What of a growing output may be streamed as text now: everything before the calls have begun, less a tail
    that could still turn into their marker (``<tool_call>``, ``[TOOL_CALLS]``); in a format whose reply is nothing
    but calls, all of it once it does not begin as they do (none while it is blank)."""
    form = FORMATS[parser]
    if form.leads:
        rest = text[skip_ws(text, 0):]
        return "" if not rest or any(rest.startswith(lead) or lead.startswith(rest) for lead in form.leads) else text
    start = text.find(form.opens)
    if start >= 0:
        return text[:start]
    for keep in range(min(len(form.opens) - 1, len(text)), 0, -1):
        if form.opens.startswith(text[-keep:]):
            return text[:-keep]
    return text


def _hermes_calls(text: str, schemas: dict) -> tuple[str | None, list[ParsedCall]]:
    found = block_calls(text, (OPEN, CLOSE), lambda body, closed: None if (call := _call(body)) is None else [call])
    return (text, []) if found is None else found


def _call(body: str) -> ParsedCall | None:
    """The call of a block's body, its arguments the text the model wrote for them (what a stream sent)."""
    try:
        value = json.loads(body)
        view = scan_call(body, 0, ARGUMENT_KEYS)
    except (json.JSONDecodeError, NotACall):
        return None
    if not isinstance(value, dict) or not view.name:
        return None
    try:
        json.loads(view.arguments)  # a string's content must be JSON text too
    except json.JSONDecodeError:
        return None
    return ParsedCall(view.name, view.arguments)


def _llama3_calls(text: str, schemas: dict) -> tuple[str | None, list[ParsedCall]]:
    """Llama 3's reply of calls: JSON objects from the first character on (blanks aside), separated by ``;``."""
    i = skip_ws(text, 0)
    if not text.startswith("{", i):
        return text, []
    calls = []
    while i < len(text):
        end = value_end(text, i)
        call = None if end is None else _call(text[i:end])
        if call is None:
            return text, []
        calls.append(call)
        i = skip_ws(text, end)
        if i < len(text):
            if text[i] != ";":
                return text, []  # text after a call: not a reply of calls
            i = skip_ws(text, i + 1)
    return None, calls


def _mistral_calls(text: str, schemas: dict) -> tuple[str | None, list[ParsedCall]]:
    return _found(text, mistral_calls(text))


def _hermes_views(text: str, schemas: dict) -> list[CallView]:
    views: list[CallView] = []
    start = text.find(OPEN)
    while start >= 0:
        body = start + len(OPEN)
        close = text.find(CLOSE, body)
        views.append(scan_call(text[body:close if close >= 0 else len(text)], 0, ARGUMENT_KEYS))
        if close < 0:
            break
        start = text.find(OPEN, close + len(CLOSE))
    return views


def _llama3_views(text: str, schemas: dict) -> list[CallView]:
    i = skip_ws(text, 0)
    if i < len(text) and text[i] != "{":
        raise NotACall("a Llama 3 reply of calls begins with {")
    views: list[CallView] = []
    while i < len(text):
        view = scan_call(text, i, ARGUMENT_KEYS)
        views.append(view)
        if view.end is None:
            break
        i = skip_ws(text, view.end)
        if i < len(text):
            if text[i] != ";":
                break  # text after a whole call: not a reply of calls (the finished text says so), but the calls
                #   before it were whole, as a Hermes block before text after it
            i = skip_ws(text, i + 1)
    return views


def _pythonic_calls(text: str, schemas: dict) -> tuple[str | None, list[ParsedCall]]:
    calls = parse_pythonic(text)
    return (text, []) if calls is None else (None, [ParsedCall(name, arguments) for name, arguments in calls])


def _xml_calls(text: str, schemas: dict) -> tuple[str | None, list[ParsedCall]]:
    return _found(text, parse_xml_calls(text, schemas))


def _seed_calls(text: str, schemas: dict) -> tuple[str | None, list[ParsedCall]]:
    return _found(text, parse_xml_calls(text, schemas, (SEED_OPEN, SEED_CLOSE)))


def _glm_calls(text: str, schemas: dict) -> tuple[str | None, list[ParsedCall]]:
    return _found(text, parse_glm_calls(text, schemas))


def _minimax_calls(text: str, schemas: dict) -> tuple[str | None, list[ParsedCall]]:
    return _found(text, parse_minimax_calls(text, schemas))


def _found(text: str, found: tuple[str | None, list[tuple]] | None) -> tuple[str | None, list[ParsedCall]]:
    """A reader's ``(content, [(name, arguments[, id])])`` as the parsers give it; ``(text, [])`` for None."""
    return (text, []) if found is None else (found[0], [ParsedCall(*call) for call in found[1]])


def _only_calls(text: str, calls: list[tuple[str, str]] | None) -> tuple[str | None, list[ParsedCall]]:
    """A reply that is nothing but ``calls`` (None: not calls)."""
    return _found(text, None if calls is None else (None, calls))


GRANITE_OPEN = "<tool_call>"  # what Granite 3.1 and later write before their calls (3.0: a special token)


def _granite_calls(text: str, schemas: dict) -> tuple[str | None, list[ParsedCall]]:
    return _only_calls(text, call_array(text.strip().removeprefix(GRANITE_OPEN)))


def _granite_views(text: str, schemas: dict) -> list[CallView]:
    rest = after_lead(text, GRANITE_OPEN, required=False)
    return [] if rest is None else scan_call_list(rest, ("arguments",))


PHI4_LEAD = "functools["  # what Phi-4-mini's reply of calls begins with
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"  # Llama 4's, around its calls (special tokens)


def _phi4_calls(text: str, schemas: dict) -> tuple[str | None, list[ParsedCall]]:
    body = text.strip()
    return _only_calls(text, call_array(body[len(PHI4_LEAD) - 1:], ARGUMENT_KEYS) if body.startswith(PHI4_LEAD)
                       else None)


def _phi4_views(text: str, schemas: dict) -> list[CallView]:
    rest = after_lead(text, PHI4_LEAD)
    return [] if rest is None else scan_call_list("[" + rest, ARGUMENT_KEYS)


def _unwrapped(text: str) -> str:
    """Llama 4's calls without the ``<|python_start|>`` and ``<|python_end|>`` a text decoded with its special
    tokens keeps around them."""
    body = text.strip()
    if body.startswith(PYTHON_START):
        body = body[len(PYTHON_START):].removesuffix(PYTHON_END)
    return body


def _olmo3_calls(text: str, schemas: dict) -> tuple[str | None, list[ParsedCall]]:
    return _only_calls(text, parse_olmo3(text))


def _llama4_calls(text: str, schemas: dict) -> tuple[str | None, list[ParsedCall]]:
    content, calls = _pythonic_calls(_unwrapped(text), schemas)
    return (text, []) if not calls else (content, calls)


def _llama4_views(text: str, schemas: dict) -> list[CallView]:
    rest = after_lead(text, PYTHON_START, required=False)
    return [] if rest is None else pythonic_views(rest.removesuffix(PYTHON_END))


@dataclass(frozen=True, slots=True)
class CallFormat:
    """One ``--tool-call-parser``: how a finished reply and a growing one are read."""

    parse: Callable[[str, dict], tuple[str | None, list[ParsedCall]]]
    views: Callable[[str, dict], list[CallView]]
    leads: tuple[str, ...] = ()  # what a reply of calls begins with, where it is nothing but calls (none: calls
    #   after any text, from ``opens`` on)
    opens: str = OPEN  # what the calls after any text begin with
    keeps_special: bool = False  # the markers are special tokens: a request read by it decodes them into its text


def _section_format(name: str) -> CallFormat:
    form = SECTIONS[name]
    return CallFormat(lambda text, schemas: _found(text, section_calls(text, form)),
                      lambda text, schemas: section_views(text, form), opens=form.begin, keeps_special=True)


FORMATS = {
    "hermes": CallFormat(_hermes_calls, _hermes_views),
    "llama3_json": CallFormat(_llama3_calls, _llama3_views, ("{",)),
    "pythonic": CallFormat(_pythonic_calls, lambda text, schemas: pythonic_views(text), ("[",)),
    "llama4_pythonic": CallFormat(_llama4_calls, _llama4_views, ("[", PYTHON_START)),
    "llama4_json": CallFormat(_llama3_calls, _llama3_views, ("{",)),
    "phi4_mini_json": CallFormat(_phi4_calls, _phi4_views, (PHI4_LEAD,)),
    "olmo3": CallFormat(_olmo3_calls, lambda text, schemas: olmo3_views(text), (OLMO3_OPEN,)),
    "mistral": CallFormat(_mistral_calls, lambda text, schemas: mistral_views(text), opens=TOOL_CALLS,
                          keeps_special=True),
    "granite": CallFormat(_granite_calls, _granite_views, ("[", GRANITE_OPEN)),
    "qwen3_coder": CallFormat(_xml_calls, xml_views),
    "seed_oss": CallFormat(_seed_calls, lambda text, schemas: xml_views(text, schemas, (SEED_OPEN, SEED_CLOSE)),
                           opens=SEED_OPEN, keeps_special=True),
    "glm45": CallFormat(_glm_calls, glm_views, keeps_special=True),
    "minimax_m2": CallFormat(_minimax_calls, minimax_views, opens=MINIMAX_OPEN, keeps_special=True),
    **{name: _section_format(name) for name in SECTIONS},
    "openai": CallFormat(lambda text, schemas: _found(text, harmony_calls(text)),
                         lambda text, schemas: harmony_views(text), opens=HARMONY_CALL, keeps_special=True),
}
PARSERS = tuple(FORMATS)
