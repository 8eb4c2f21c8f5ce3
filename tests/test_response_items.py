"""A stored response's conversation as Responses API items (coserve/server/response_items.py), on plain data."""

from __future__ import annotations

from coserve.server.protocol import ResponsesRequest
from coserve.server.response_items import input_items, output_messages
from coserve.server.responses_api import input_messages

ITEMS = [
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather and a sum?"}]},
    {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{\"city\": \"Oslo\"}"},
    {"type": "custom_tool_call", "call_id": "c2", "name": "calc", "input": "1+2"},
    {"type": "function_call_output", "call_id": "c1", "output": "rain"},
    {"type": "custom_tool_call_output", "call_id": "c2", "output": "3"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rain; 3."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks."}]},
]


def _plain(item: dict) -> dict:
    return {k: v for k, v in item.items() if k not in ("id", "status")}


def test_input_items_give_back_the_items_a_conversation_was_made_of():
    messages = input_messages(ResponsesRequest.model_validate({"model": "m", "input": ITEMS}))
    items = input_items("resp_abc", messages)
    assert [_plain(i) for i in items] == [{k: v for k, v in i.items()} for i in ITEMS]
    assert len({i["id"] for i in items}) == len(items) and all("abc" in i["id"] for i in items)
    assert input_items("resp_abc", messages) == items  # the same ids every time


def test_a_responses_output_adds_its_calls_then_its_text_and_not_its_reasoning():
    output = [{"type": "reasoning", "id": "rs_1", "content": [{"type": "reasoning_text", "text": "hmm"}]},
              {"type": "function_call", "call_id": "c9", "name": "weather", "arguments": "{}"},
              {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]}]
    assert output_messages(output) == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c9", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "assistant", "content": "Let me see."}]
    assert [i["type"] for i in input_items("resp_x", output_messages(output))] == ["function_call", "message"]
