"""gpt-oss's harmony format, read from an output's text (its markers are special tokens, kept in the text): vLLM's
``--reasoning-parser openai_gptoss`` and ``--tool-call-parser openai``.

A gpt-oss reply is a run of messages, each a header and a body: ``<|channel|>analysis<|message|>...<|end|>`` (its
reasoning), then ``<|start|>assistant<|channel|>final<|message|>...`` (the reply, ended by ``<|return|>``, a stop token
left out of the text) or a call, ``<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}``
(ended by ``<|call|>``, a stop token too; the recipient may stand in the role's part of the header instead,
``<|start|>assistant to=functions.f<|channel|>commentary json<|message|>``). A ``commentary`` message without a
recipient is a preamble the user may see.

``HarmonySplit`` splits such a text as it grows into reasoning (the ``analysis`` bodies) and reply (the ``final`` and
preamble bodies), the headers dropped; a call goes into the reply as ``<|channel|>commentary to=NAME<|message|>ARGS``
(``<|call|>`` after it where written), which the ``openai`` tool-call format reads (``harmony_calls``,
``harmony_views``). A text that does not begin with a header is all reply.
"""

from __future__ import annotations

import json
import re

from coserve.server.call_text import CallView, NotACall

START, CHANNEL, MESSAGE, END, CALL, RETURN = (
    "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>")
ENDS = (END, CALL, RETURN)
CALL_OPEN = CHANNEL + "commentary to="  # a call as the reply carries it: CALL_OPEN + name + MESSAGE + arguments
FUNCTIONS = "functions."  # the recipient's namespace of the request's tools
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"([^\s<]+)")


def header_kind(header: str) -> tuple[str, str | None]:
    """A message's kind from its header: ``analysis`` (reasoning), ``call`` (with its recipient: the function's name
    without ``functions.``), or ``reply`` (``final``, a preamble, any other channel)."""
    recipient = _RECIPIENT.search(header)
    channel = _CHANNEL.search(header)
    if recipient is not None:
        name = recipient.group(1)
        return "call", name[len(FUNCTIONS):] if name.startswith(FUNCTIONS) else name
    if channel is not None and channel.group(1) == "analysis":
        return "analysis", None
    return "reply", None


class HarmonySplit:
    """Feeds a reply's text as it grows; each ``feed`` returns the new ``(reasoning, reply)`` text (as
    ``ReasoningSplit``'s). A tail that could still become a marker is held back until the next text (or the end)."""

    def __init__(self) -> None:
        self.mode = "start"  # start (nothing read), header, body, plain (no harmony: all reply)
        self.kind = "reply"  # the current message's kind (header_kind)
        self.reasoned = False  # whether any of the reply was reasoning
        self._held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        buf, self._held = self._held + text, ""
        reasoning: list[str] = []
        reply: list[str] = []
        while buf:
            if self.mode == "start":
                if buf.startswith((CHANNEL, START)):
                    self.mode = "header"
                elif not final and (CHANNEL.startswith(buf) or START.startswith(buf)):
                    self._held = buf
                    break
                else:
                    self.mode = "plain"
            if self.mode == "plain":
                reply.append(buf)
                break
            if self.mode == "header":
                at = buf.find(MESSAGE)
                if at < 0:  # the header still being written (at the end: a header without a body, dropped)
                    self._held = "" if final else buf
                    break
                self.kind, name = header_kind(buf[:at])
                if self.kind == "call":
                    reply.append(CALL_OPEN + name + MESSAGE)
                buf, self.mode = buf[at + len(MESSAGE):], "body"
                continue
            found = [(i, marker) for marker in ENDS if (i := buf.find(marker)) >= 0]
            if not found:
                keep = 0 if final else max(_marker_prefix(buf, marker) for marker in ENDS)
                self._body(buf[:len(buf) - keep], reasoning, reply)
                self._held = buf[len(buf) - keep:]
                break
            at, marker = min(found)
            self._body(buf[:at], reasoning, reply)
            if self.kind == "call":
                reply.append(CALL)
            buf, self.mode = buf[at + len(marker):], "header"
        return "".join(reasoning), "".join(reply)

    def _body(self, text: str, reasoning: list[str], reply: list[str]) -> None:
        if not text:
            return
        if self.kind == "analysis":
            self.reasoned = True
            reasoning.append(text)
        else:
            reply.append(text)


def _marker_prefix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return keep
    return 0


def harmony_views(text: str) -> list[CallView]:
    """The calls of a growing reply (``HarmonySplit``'s) from its first ``CALL_OPEN`` on, as far as written (an open
    call's arguments less a tail that may begin ``<|call|>``); NotACall where the text after a call is not
    another."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return []
    views, i = [], start
    while i < len(text):
        if not text.startswith(CALL_OPEN, i):
            if CALL_OPEN.startswith(text[i:]):
                break
            raise NotACall("after a call, only another call")
        name_end = text.find(MESSAGE, i)
        if name_end < 0:
            views.append(CallView(None, "", None))
            break
        body = name_end + len(MESSAGE)
        close = text.find(CALL, body)
        name = text[i + len(CALL_OPEN):name_end]
        if close < 0:  # its arguments so far, less a tail that may begin its <|call|>
            args = text[body:]
            views.append(CallView(name, args[:len(args) - _marker_prefix(args, CALL)], None))
            break
        views.append(CallView(name, text[body:close], close + len(CALL)))
        i = close + len(CALL)
    return views


def harmony_calls(text: str) -> tuple[str | None, list[tuple[str, str]]] | None:
    """``(content before the calls, [(name, arguments)])`` of a finished reply whose calls, each a JSON object, end
    it (the last one's ``<|call|>`` may be left out: it stopped the output); None where it has no calls or one is
    not whole."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return None
    try:
        views = harmony_views(text + CALL if not text.endswith(CALL) else text)  # the last call ended by the end
    except NotACall:
        return None
    calls = []
    for view in views:
        try:
            if not view.name or not isinstance(json.loads(view.arguments), dict):
                return None
        except json.JSONDecodeError:
            return None
        calls.append((view.name, view.arguments))
    return (text[:start] if text[:start].strip() else None), calls
