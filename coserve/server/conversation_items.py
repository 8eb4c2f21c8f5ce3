"""The Responses API's input items as chat messages, and as the items a conversation keeps (OpenAI's Conversations
API: ``coserve/server/conversations_api.py``).

Items arrive as the Responses API takes them (messages, calls and their results, reasoning); a conversation keeps
each whole, with an id (the given one, else a new one of the item's kind) and ``status: completed``, and reads them
back as the chat messages the chat template renders (``messages_of``).
"""

from __future__ import annotations

import secrets
from typing import Any

from pydantic import TypeAdapter, ValidationError

from coserve.server.errors import bad_request
from coserve.server.protocol import (CustomToolCallInput, CustomToolCallOutputInput, FunctionCallInput,
                                     FunctionCallOutputInput, InputMessage, ReasoningInput)

Item = InputMessage | FunctionCallInput | FunctionCallOutputInput | CustomToolCallInput | CustomToolCallOutputInput \
    | ReasoningInput
_ITEMS = TypeAdapter(list[Item])
PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "custom_tool_call": "ctc",
          "custom_tool_call_output": "ctco", "reasoning": "rs"}
MAX_ITEMS = 20  # items one request may add (OpenAI's)


def parse_items(given: Any, where: str = "items") -> list[Item]:
    """``given`` as input items; a 400 naming ``where`` and the item's place where one is not an item."""
    if not isinstance(given, list):
        raise bad_request(f"{where}: expected an array of items", where)
    try:
        return _ITEMS.validate_python(given)
    except ValidationError as e:
        err = e.errors()[0]
        place = ".".join(str(p) for p in err["loc"][:1])
        raise bad_request(f"{where}.{place}: {err['msg']}", f"{where}.{place}") from None


def messages_of(items: list[Item]) -> list[dict]:
    """Input items as chat messages: earlier calls as assistant ``tool_calls`` (calls made together in one
    message), their results as ``tool`` messages; reasoning dropped, as reasoning models' chat templates drop the
    reasoning of earlier turns."""
    messages: list[dict] = []
    for item in items:
        if isinstance(item, InputMessage):
            content = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            messages.append({"role": item.role, "content": content})
        elif isinstance(item, ReasoningInput):
            continue
        elif isinstance(item, (FunctionCallInput, CustomToolCallInput)):
            call = ({"id": item.call_id, "type": "function",
                     "function": {"name": item.name, "arguments": item.arguments}}
                    if isinstance(item, FunctionCallInput)
                    else {"id": item.call_id, "type": "custom", "custom": {"name": item.name, "input": item.input}})
            last = messages[-1] if messages else {}
            if last.get("role") == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def kept_items(items: list[Item], taken: set[str]) -> list[dict]:
    """Input items as a conversation keeps them: whole, ``status: completed``, each with its own id (the given one
    where no kept item has it, else a new one); a message's text as content parts (``input_text``, an assistant's
    ``output_text``). ``taken`` (the conversation's item ids) gains theirs."""
    kept = []
    for item in items:
        obj = item.model_dump(exclude_none=True)
        if isinstance(item, InputMessage):
            text = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            part = "output_text" if item.role == "assistant" else "input_text"
            obj = {"type": "message", "role": item.role, "content": [{"type": part, "text": text}]}
        given = getattr(item, "id", None)
        ident = given if given and given not in taken else f"{PREFIX[obj['type']]}_{secrets.token_hex(12)}"
        taken.add(ident)
        kept.append({**obj, "id": ident, "status": "completed"})
    return kept


def shown(item: dict, logprobs: bool) -> dict:
    """A kept item as the API returns it: a reply's ``output_text`` parts with their token logprobs where ``include``
    asks for them (``message.output_text.logprobs``), else with none (``logprobs: []``), as OpenAI returns them."""
    if logprobs or item.get("type") != "message" or not any(p.get("logprobs") for p in item.get("content", ())):
        return item
    return {**item, "content": [{**p, "logprobs": []} if p.get("logprobs") else p for p in item["content"]]}


def output_items(output: list[dict], taken: set[str]) -> list[dict]:
    """A finished response's ``output`` as a conversation keeps it (its items and their ids as the response has
    them, a taken id replaced)."""
    kept = []
    for o in output:
        ident = o["id"] if o["id"] not in taken else f"{PREFIX.get(o['type'], 'item')}_{secrets.token_hex(12)}"
        taken.add(ident)
        kept.append({**o, "id": ident})
    return kept
