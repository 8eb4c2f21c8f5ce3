"""Tool calling on the chat API, as vLLM does it without a model-specific parser: by guided decoding.

``tool_choice`` a named function: the output is that function's arguments, guided by its ``parameters``
schema. ``"required"``: the output is a JSON array of one or more ``{"name", "parameters"}`` calls (one
at most with ``parallel_tool_calls`` false), each guided by its function's schema. Either way the reply
carries ``tool_calls`` (``finish_reason`` "tool_calls") instead of content. ``"none"``: the tools are
given to the chat template and the reply is text. ``"auto"`` (OpenAI's default when tools are given):
the model writes freely and calls in its text are read by the server's ``--tool-call-parser``
(``tool_parser.py``; the format depends on the model's training); a server started without one answers
400 naming the way out, rather than ignoring the tools.

Custom tools (OpenAI's ``{"type": "custom"}``: called with one string, ``input``, free text or text that a
Lark grammar or a regular expression matches) are called when ``tool_choice`` names one
(``{"type": "custom", "custom": {"name": ...}}``): the output is the input, guided by the tool's format. Under
"auto" or "required" a request with custom tools is a 400 (no parser reads them from free text yet); under
"none" or a named function they are listed to the template as functions of one string parameter, ``input``.

Past calls in the conversation (assistant messages with ``tool_calls``, ``tool`` messages with results)
reach the chat template as HF templates expect them (a custom call as a function call with arguments
``{"input": ...}``); a template that never mentions ``tool_calls`` sees the calls inlined as the JSON the
``required`` mode writes.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from coserve.guided.compilers import COMPILERS
from coserve.server.call_text import scan_call_list
from coserve.server.errors import bad_request
from coserve.server.protocol import (ChatCompletionRequest, ChatMessage, CustomDef, CustomTool, CustomToolCall,
                                     NamedCustomChoice, Tool)
from coserve.server.response_format import checked_schema
from coserve.server.tool_parser import FORMATS, parse_tool_calls
from coserve.server.tool_stream import ToolCallStream

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How a request's output becomes tool calls: ``function`` named (a custom tool's with ``custom``), ``None``
    for a ``required`` list, or ``auto`` (no guide: calls read from the text by the server's parser)."""

    function: str | None
    schema: dict | None  # what guides a function's arguments or a required list (None: auto, custom)
    auto: bool = False
    custom: bool = False  # the named tool is a custom one: the output is its input, as written
    custom_guide: dict | None = None  # a custom tool's guide: {"guided_grammar": ...} / {"guided_regex": ...}
    parser: str = "hermes"  # auto: the format calls are read in (tool_parser.PARSERS)
    schemas: dict[str, dict] | None = None  # auto: each function's parameters, by name (qwen3_coder types values)

    def guide(self) -> dict | None:
        """The ``SamplingParams`` guide of the output (None: free text)."""
        if self.custom:
            return self.custom_guide
        return None if self.schema is None else {"guided_json": self.schema}

    def head(self) -> dict:
        """A streamed named call's first ``tool_calls`` delta: its id, type and name, nothing written yet."""
        return {"index": 0, **(custom_call(self.function, "") if self.custom else tool_call(self.function, ""))}

    def piece(self, text: str) -> dict:
        """A streamed named call's ``tool_calls`` delta carrying more of what it is called with."""
        return {"index": 0, **({"custom": {"input": text}} if self.custom else {"function": {"arguments": text}})}

    def stream(self) -> ToolCallStream:
        """A streamed choice's reader of a listed reply (``listed``): calls in free text in the server's format
        (``auto``), or a guided list."""
        return ToolCallStream(self.auto, self.parser, self.schemas)

    @property
    def keeps_special(self) -> bool:
        """Whether the output's text must show special tokens (the parser's markers are such tokens, as Mistral's
        ``[TOOL_CALLS]``): vLLM's parsers turn ``skip_special_tokens`` off for such requests too."""
        return self.auto and FORMATS[self.parser].keeps_special

    @property
    def listed(self) -> bool:
        """Whether the output is a list of calls (``required``, or read from free text), not one named call's
        arguments."""
        return self.function is None

    def reply(self, text: str) -> tuple[str | None, list[dict]]:
        """``(content, tool_calls)`` of an output that ended by itself; no calls: ``(text, [])``."""
        if self.auto:
            content, parsed = parse_tool_calls(text, self.parser, self.schemas)
            return content, [tool_call(c.name, c.arguments, c.ident) for c in parsed]
        made = self.calls(text)
        return (text, []) if made is None else (None, made)

    def calls(self, text: str) -> list[dict] | None:
        """The ``tool_calls`` of a finished guided output, or None if it is not a whole document (cut by
        max_tokens)."""
        if self.custom:  # the guide ended it: the input is whatever was written
            return [custom_call(self.function, text)]
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if self.function is not None:
            return [tool_call(self.function, text)]
        # the guide makes this shape; a stop string of the request's could still cut it to another
        if not isinstance(value, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                  and "parameters" in c for c in value):
            return None
        # each call's arguments are the text written for its parameters (what a stream sent of them)
        return [tool_call(v.name, v.arguments) for v in scan_call_list(text)]


def tool_call(name: str, arguments: str, ident: str | None = None) -> dict:
    """An OpenAI ``tool_calls`` entry; ``ident``: the id the model wrote (Kimi K2's), else a new one."""
    return {"id": ident or f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def custom_call(name: str, text: str) -> dict:
    return {"id": f"call_{secrets.token_hex(12)}", "type": "custom", "custom": {"name": name, "input": text}}


def tool_plan(body: ChatCompletionRequest, parser: str | None = None) -> ToolPlan | None:
    """None for a reply in text; else the plan; 400 naming the field for a choice that cannot be honoured.
    ``parser``: the server's ``--tool-call-parser`` (None: ``auto`` cannot be served)."""
    choice, tools = body.tool_choice, body.tools or []
    if choice is not None and choice != "none" and not tools:
        raise bad_request("tool_choice: needs tools", "tool_choice")
    if not tools or choice == "none":
        return None
    if any(isinstance(t, CustomTool) for t in tools) and choice in (None, "auto", "required"):
        raise bad_request("tool_choice: custom tools are called when tool_choice names one ({\"type\": \"custom\", "
                          "\"custom\": {\"name\": ...}}); with 'auto' or 'required' no parser reads their calls from "
                          "free text", "tool_choice")
    if choice in (None, "auto"):
        if parser is None:
            raise bad_request("tool_choice: 'auto' (the default when tools are given) needs a parser of the tool "
                              "calls a model writes freely; this server was started without one (coserve serve "
                              "--enable-auto-tool-choice --tool-call-parser hermes); set tool_choice to 'required', "
                              "to a named function, or to 'none'", "tool_choice")
        schemas = {t.function.name: t.function.parameters or {} for t in tools if isinstance(t, Tool)}
        return ToolPlan(None, None, auto=True, parser=parser, schemas=schemas)  # parameters are the model's to
        #   follow: nothing guides them
    if any(getattr(body, f) is not None for f in ("response_format", "guided_json", "guided_choice",
                                                   "guided_regex", "guided_grammar", "structured_outputs")):
        raise bad_request("tool_choice: a named or required call is guided already (by its parameters or its "
                          "format); drop response_format and vLLM's guided_* / structured_outputs", "tool_choice")
    names = [tool_name(t) for t in tools]
    if len(set(names)) < len(names):
        raise bad_request("tools: function names must be distinct", "tools")
    if isinstance(choice, NamedCustomChoice):
        name = choice.custom.name
        found = [(i, t.custom) for i, t in enumerate(tools) if isinstance(t, CustomTool) and t.custom.name == name]
        if not found:
            raise bad_request(f"tool_choice: no custom tool named {name!r} among the tools", "tool_choice")
        return ToolPlan(name, None, custom=True, custom_guide=_custom_guide(*found[0]))
    functions = [(i, t) for i, t in enumerate(tools) if isinstance(t, Tool)]
    fnames = [t.function.name for _, t in functions]
    params = [_parameters(t, i) for i, t in functions]
    if choice == "required":
        return ToolPlan(None, _calls_schema(fnames, params, body.parallel_tool_calls))
    name = choice.function.name
    if name not in fnames:
        raise bad_request(f"tool_choice: no function named {name!r} among the tools", "tool_choice")
    return ToolPlan(name, params[fnames.index(name)])


def tool_name(tool: Tool | CustomTool) -> str:
    return tool.custom.name if isinstance(tool, CustomTool) else tool.function.name


def _custom_guide(i: int, tool: CustomDef) -> dict | None:
    """What guides a custom tool's input: its Lark grammar or regular expression (None: free text)."""
    fmt, param = tool.format, f"tools[{i}].custom.format"
    if fmt is None or fmt.type == "text":
        return None
    if fmt.grammar is None:
        raise bad_request(f"{param}.grammar: a grammar format needs {{\"definition\", \"syntax\"}}", "tools")
    field = "guided_grammar" if fmt.grammar.syntax == "lark" else "guided_regex"
    try:
        COMPILERS[field](fmt.grammar.definition)
    except ValueError as e:
        raise bad_request(f"{param}.grammar.definition: {e}", "tools") from None
    return {field: fmt.grammar.definition}


def _parameters(tool: Tool, i: int) -> dict:
    schema = tool.function.parameters
    if schema is None:
        return NO_PARAMETERS
    return checked_schema(schema, f"tools[{i}].function.parameters", "tools")


def _calls_schema(names: list[str], params: list[dict], parallel: bool) -> dict:
    """An array of ``{"name", "parameters"}`` objects, each function's parameters under its own schema; the
    functions' ``$defs`` are gathered at the top (where their ``#/$defs/...`` references resolve)."""
    defs: dict[str, Any] = {}
    branches = []
    for i, (name, p) in enumerate(zip(names, params)):
        for key in ("$defs", "definitions"):
            for def_name, def_schema in (p.get(key) or {}).items():
                if defs.setdefault(key, {}).setdefault(def_name, def_schema) != def_schema:
                    raise bad_request(f"tools[{i}].function.parameters.{key}.{def_name}: another function defines "
                                      "it differently; with tool_choice 'required' the functions share one "
                                      "namespace of definitions", "tools")
        own = {k: v for k, v in p.items() if k not in ("$defs", "definitions")}
        branches.append({"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                         "properties": {"name": {"const": name}, "parameters": own}})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}, **defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def template_messages(messages: list[ChatMessage], template: str) -> list[dict]:
    """The conversation as the chat template reads it (system for developer; text parts joined)."""
    inline = "tool_calls" not in template
    out = []
    for i, m in enumerate(messages):
        content = "".join(p.text for p in m.content) if isinstance(m.content, list) else m.content or ""
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.role == "tool":
            if not m.tool_call_id:
                raise bad_request(f"messages[{i}].tool_call_id: a tool message answers a call, named by its id",
                                  f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(f"messages[{i}].tool_calls: only assistant messages make tool calls",
                                  f"messages[{i}].tool_calls")
            calls = [(c.custom.name, {"input": c.custom.input}) if isinstance(c, CustomToolCall)
                     else (c.function.name, _arguments(c.function.arguments, i)) for c in m.tool_calls]
            if inline:
                msg["content"] = content + json.dumps([{"name": n, "parameters": a} for n, a in calls],
                                                      ensure_ascii=False)
            else:
                msg["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": n, "arguments": a}}
                                     for c, (n, a) in zip(m.tool_calls, calls)]
        out.append(msg)
    return out


def _arguments(text: str, i: int) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_request(f"messages[{i}].tool_calls: arguments must be JSON text ({e})",
                          f"messages[{i}].tool_calls") from None


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as HF chat templates take them (``apply_chat_template(..., tools=...)``)."""
    if not tools:
        return None
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} if isinstance(t, Tool)
            else {"type": "function", "function": {  # a custom tool: a function of one string
                "name": t.custom.name, **({"description": t.custom.description} if t.custom.description else {}),
                "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}}
            for t in tools]
