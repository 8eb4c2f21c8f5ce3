"""Tool calls streamed as the model writes them (``tool_choice`` ``"auto"`` with a parser, and ``"required"``),
as OpenAI and vLLM stream them: a call's first delta carries its index, id, type and name; then its
arguments' text comes in pieces, each delta ``{"index", "function": {"arguments": piece}}``; joined, the
pieces are the final reply's arguments.

The text before the first call streams as content (less a tail that may become one). A call is
announced once its name is whole, calls in order. The final reply is decided on the finished text as without
streaming (``ToolPlan.reply``); ``finish`` sends what is left. Where the finished text is not calls after all
(a malformed block, text after the calls, or an output cut short) the calls already streamed stand, as with
vLLM (a stream cannot take back what it sent), and the finish reason says it: ``stop`` with the rest of the
text as content (``auto``), or ``length``.
"""

from __future__ import annotations

import logging
import secrets

from coserve.server.call_text import NotACall, scan_call_list
from coserve.server.tool_parser import call_views, visible_text

log = logging.getLogger("coserve.server")


class ToolCallStream:
    """One streamed choice's content and tool-call deltas, from its text as it grows (``update``) to its end
    (``finish``). ``auto``: calls in free text, read by ``parser`` (``tool_parser.PARSERS``); else a guided JSON
    array of ``{"name", "parameters"}`` calls."""

    def __init__(self, auto: bool, parser: str = "hermes", schemas: dict[str, dict] | None = None) -> None:
        self.auto = auto
        self.parser = parser
        self.schemas = schemas  # the tools' parameters, by name (qwen3_coder reads values by their types)
        self.content_sent = 0  # characters of the text sent as content (auto)
        self.ids: list[str] = []  # the announced calls' ids, in order
        self.arguments_sent: list[str] = []  # each announced call's arguments sent so far
        self.broken = False  # the text stopped looking like calls: no more call deltas until the end

    def update(self, text: str) -> tuple[str, list[dict]]:
        """``(content, tool_call_deltas)`` new since the last call, for the text written so far (none of which a
        stop string can still cut)."""
        content = ""
        if self.auto:
            shown = visible_text(text, self.parser)
            if shown.strip():  # blank text before the calls is no content (as the finished reply reads it)
                content, self.content_sent = shown[self.content_sent:], len(shown)
        if self.broken:
            return content, []
        try:
            views = call_views(text, self.parser, self.schemas) if self.auto else scan_call_list(text)
        except NotACall:
            self.broken = True
            return content, []
        deltas = []
        for i, view in enumerate(views):
            if view.name is None:
                break  # calls are announced in order, each with its name
            delta = self._announce(i, view.name, view.ident) if i == len(self.ids) else None
            piece = self._piece(i, view.arguments)
            if delta is not None:
                delta["function"]["arguments"] = piece
                deltas.append(delta)
            elif piece:
                deltas.append({"index": i, "function": {"arguments": piece}})
        return content, deltas

    def finish(self, text: str, content: str | None, calls: list[dict]) -> tuple[str, list[dict]]:
        """``(content, tool_call_deltas)`` still to send once the output has ended: ``content`` and ``calls`` are
        the final reply's (no calls: the output is text)."""
        if not calls:  # text after all: what was not sent of it (auto), or all of it if nothing was (required)
            if self.auto:
                return text[self.content_sent:], []
            return ("" if self.ids else text), []
        rest = (content or "")[self.content_sent:] if self.auto else ""
        deltas = []
        for i, call in enumerate(calls):
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            if i < len(self.ids):
                piece = self._piece(i, arguments)
                if piece:
                    deltas.append({"index": i, "function": {"arguments": piece}})
            else:
                delta = self._announce(i, name, call["id"])
                delta["function"]["arguments"] = self._piece(i, arguments)
                deltas.append(delta)
        return rest, deltas

    def _announce(self, i: int, name: str, ident: str | None = None) -> dict:
        self.ids.append(ident or f"call_{secrets.token_hex(12)}")
        self.arguments_sent.append("")
        return {"index": i, "id": self.ids[i], "type": "function", "function": {"name": name}}

    def _piece(self, i: int, arguments: str) -> str:
        """What of ``arguments`` call ``i`` has not been sent yet."""
        sent = self.arguments_sent[i]
        if not arguments.startswith(sent):  # cannot happen while one scanner reads both: kept visible if it does
            log.warning("tool call %d: the final arguments do not extend what was streamed", i)
            return ""
        self.arguments_sent[i] = arguments
        return arguments[len(sent):]
