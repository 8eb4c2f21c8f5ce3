"""Tool calls written in the text (``tool_choice: "auto"`` with ``--tool-call-parser hermes``): what is a call,
what stays text, and what a stream may show before the output ends."""

from __future__ import annotations

import json

import pytest

from coserve.server.config import ServerConfig
from coserve.server.tool_parser import ParsedCall, parse_tool_calls, visible_text

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("text, content, calls", [
    ("Just text.", "Just text.", []),
    ("Let me check.\n" + CALL, "Let me check.\n", [ParsedCall("get_weather", '{"city": "Paris"}')]),
    (CALL + "\n" + '<tool_call>{"name": "t", "arguments": "{\\"x\\": 1}"}</tool_call>', None,
     [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("t", '{"x": 1}')]),
    ('<tool_call>{"name": "t"}', None, [ParsedCall("t", "{}")]),  # ended before its closing tag
    ('<tool_call>{"name": "t", "parameters": {"a": "é"}}</tool_call>', None, [ParsedCall("t", '{"a": "é"}')]),
])
def test_hermes_calls_are_read_with_the_text_before_them(text, content, calls):
    assert parse_tool_calls(text) == (content, calls)
    for call in calls:
        json.loads(call.arguments)


@pytest.mark.parametrize("text", [
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "t", "arguments": "{bad"}</tool_call>',
    '<tool_call>{"name": "t", "arguments": [1]}</tool_call>',
    CALL + " and then more text",
])
def test_anything_but_whole_calls_stays_text(text):
    assert parse_tool_calls(text) == (text, [])


def test_a_stream_holds_back_what_may_become_a_call():
    assert visible_text("Hello") == "Hello"
    assert visible_text("Hello <tool") == "Hello "
    assert visible_text("Hello <") == "Hello "
    assert visible_text("Hello <tool_call>{\"na") == "Hello "
    assert visible_text("a < b") == "a < b"


def test_an_unknown_parser_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--tool-call-parser: must be one of hermes"):
        ServerConfig(model="m", state_dir="s", tool_call_parser="mistral")
