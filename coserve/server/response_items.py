"""A stored response's conversation as the Responses API's items, and back: what a response's ``output`` adds to the
conversation that ``previous_response_id`` continues (``output_messages``), and the items ``GET
/v1/responses/{id}/input_items`` lists (``input_items``).

A stored conversation is chat messages (the shape the chat template reads); items are rebuilt from them with ids
derived from the response's id and the item's place, so that a listing pages the same way every time.
"""

from __future__ import annotations


def output_messages(output: list[dict]) -> list[dict]:
    """The chat messages a response's ``output`` adds to its conversation: its calls as one assistant message with
    ``tool_calls``, then its message's text (a reasoning item adds nothing, as reasoning models' templates drop
    earlier turns' reasoning)."""
    said: list[dict] = []
    calls = [o for o in output if o["type"] in ("function_call", "custom_tool_call")]
    if calls:
        said.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": c["call_id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            if c["type"] == "function_call" else
            {"id": c["call_id"], "type": "custom", "custom": {"name": c["name"], "input": c["input"]}}
            for c in calls]})
    for o in output:
        if o["type"] == "message":
            said.append({"role": "assistant", "content": "".join(p["text"] for p in o["content"])})
    return said


def input_items(response_id: str, messages: list[dict]) -> list[dict]:
    """The items of ``messages`` (a response's conversation before its output), oldest first: messages (their text
    ``input_text``, an assistant's ``output_text``), ``function_call`` / ``custom_tool_call`` items, and the calls'
    results as ``function_call_output`` / ``custom_tool_call_output`` by the kind of the call they answer."""
    key = response_id.removeprefix("resp_")
    custom: set[str] = set()  # call ids of custom tool calls
    items: list[dict] = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            kind = "custom_tool_call_output" if m["tool_call_id"] in custom else "function_call_output"
            items.append({"type": kind, "id": f"fco_{key}_{i}", "call_id": m["tool_call_id"],
                          "output": m["content"], "status": "completed"})
            continue
        for j, call in enumerate(m.get("tool_calls") or []):
            item = {"id": f"fc_{key}_{i}_{j}", "call_id": call["id"], "status": "completed"}
            if call["type"] == "custom":
                custom.add(call["id"])
                item |= {"type": "custom_tool_call", "name": call["custom"]["name"], "input": call["custom"]["input"]}
            else:
                item |= {"type": "function_call", "name": call["function"]["name"],
                         "arguments": call["function"]["arguments"]}
            items.append(item)
        if m.get("content") is not None:
            part = "output_text" if m["role"] == "assistant" else "input_text"
            items.append({"type": "message", "id": f"msg_{key}_{i}", "role": m["role"], "status": "completed",
                          "content": [{"type": part, "text": m["content"]}]})
    return items
