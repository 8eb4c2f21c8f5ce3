"""OpenAI's Conversations API against a live server, through the official ``openai`` client: conversations and
their items kept per tenant, and responses that go on with one, adding their input and output to it."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI

from server_helpers import API_KEYS

BASE = "tiny-llama"


@pytest.fixture(scope="module")
def alice(api_server):
    return OpenAI(base_url=f"{api_server.url}/v1", api_key=API_KEYS["alice"], max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def bob(api_server):
    return OpenAI(base_url=f"{api_server.url}/v1", api_key=API_KEYS["bob"], max_retries=0, timeout=60)


def test_a_conversation_keeps_its_items_pages_them_and_forgets_them(alice, bob):
    """Create with items and metadata, read, relabel; items listed newest first (or oldest), paged by ``after``, read
    and removed one by one; deleted whole. Another tenant's is a 404 everywhere."""
    conv = alice.conversations.create(metadata={"topic": "demo"}, items=[
        {"type": "message", "role": "user", "content": "Hello."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi there."}]},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"}])
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "demo"}
    assert alice.conversations.retrieve(conv.id).created_at == conv.created_at
    assert alice.conversations.update(conv.id, metadata={"topic": "other"}).metadata == {"topic": "other"}
    oldest = list(alice.conversations.items.list(conv.id, order="asc"))
    assert [i.type for i in oldest] == ["message", "message", "function_call", "function_call_output"]
    assert oldest[0].content[0].type == "input_text" and oldest[1].content[0].text == "Hi there."
    assert [i.id for i in alice.conversations.items.list(conv.id)] == [i.id for i in reversed(oldest)]
    page = alice.conversations.items.list(conv.id, order="asc", limit=2, after=oldest[0].id)
    assert [i.id for i in page.data] == [oldest[1].id, oldest[2].id] and page.has_more
    added = alice.conversations.items.create(conv.id, items=[{"role": "user", "content": "And?"}])
    assert len(added.data) == 1 and added.data[0].role == "user"
    assert alice.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id).id == added.data[0].id
    assert alice.conversations.items.delete(oldest[2].id, conversation_id=conv.id).id == conv.id
    assert len(list(alice.conversations.items.list(conv.id))) == 4
    for call in (lambda c: c.conversations.retrieve(conv.id), lambda c: list(c.conversations.items.list(conv.id)),
                 lambda c: c.conversations.items.create(conv.id, items=[{"role": "user", "content": "x"}]),
                 lambda c: c.conversations.delete(conv.id)):
        with pytest.raises(openai.NotFoundError):
            call(bob)
    with pytest.raises(openai.NotFoundError):
        alice.conversations.items.retrieve("msg_none", conversation_id=conv.id)
    assert alice.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        alice.conversations.retrieve(conv.id)


def test_a_response_goes_on_with_a_conversation_and_adds_its_turn(alice, bob):
    """``conversation`` on ``responses.create``: the reply is the one the conversation's items plus the new input
    give sent whole; the conversation then holds that input and the response's output items (their ids), so the
    next turn goes on from there; the response names its conversation."""
    conv = alice.conversations.create(items=[{"role": "user", "content": "Remember the word apple."},
                                             {"role": "assistant", "content": "Apple, noted."}])
    ask = {"model": BASE, "max_output_tokens": 6, "temperature": 0}
    first = alice.responses.create(conversation=conv.id, input="Which word?", **ask)
    whole = alice.responses.create(input=[{"role": "user", "content": "Remember the word apple."},
                                          {"role": "assistant", "content": "Apple, noted."},
                                          {"role": "user", "content": "Which word?"}], **ask)
    assert first.output_text == whole.output_text and first.conversation.id == conv.id
    items = list(alice.conversations.items.list(conv.id, order="asc"))
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "assistant"),
                                                ("message", "user"), ("message", "assistant")]
    assert items[2].content[0].text == "Which word?" and items[3].id == first.output[0].id
    assert items[3].content[0].text == first.output_text
    second = alice.responses.create(conversation={"id": conv.id}, input="Say it again.", **ask)
    again = alice.responses.create(input=[{"role": "user", "content": "Remember the word apple."},
                                          {"role": "assistant", "content": "Apple, noted."},
                                          {"role": "user", "content": "Which word?"},
                                          {"role": "assistant", "content": first.output_text},
                                          {"role": "user", "content": "Say it again."}], **ask)
    assert second.output_text == again.output_text
    assert len(list(alice.conversations.items.list(conv.id))) == 6
    streamed = list(alice.responses.create(conversation=conv.id, input="Once more.", stream=True, **ask))
    assert streamed[-1].response.conversation.id == conv.id
    assert len(list(alice.conversations.items.list(conv.id))) == 8  # a streamed turn is kept too
    with pytest.raises(openai.NotFoundError) as e:
        bob.responses.create(conversation=conv.id, input="Hi.", **ask)
    assert e.value.body["param"] == "conversation"
    with pytest.raises(openai.BadRequestError) as e:
        alice.responses.create(conversation=conv.id, previous_response_id=first.id, input="Hi.", **ask)
    assert e.value.body["param"] == "conversation"


def test_a_replys_logprobs_are_read_back_where_include_asks_for_them(alice):
    """A response made with ``include: ["message.output_text.logprobs"]`` keeps its reply's token logprobs in the
    conversation; listing or reading the item returns them only where ``include`` names them (else ``[]``), as
    OpenAI does. Pages come from SQLite: ``after`` and ``limit`` both ways across 25 items."""
    conv = alice.conversations.create()
    reply = alice.responses.create(model=BASE, conversation=conv.id, input="Hi.", max_output_tokens=4, temperature=0,
                                   include=["message.output_text.logprobs"])
    want = [lp.token for lp in reply.output[0].content[0].logprobs]
    assert len(want) == 4
    include = ["message.output_text.logprobs"]
    newest = alice.conversations.items.list(conv.id, include=include).data[0]
    assert newest.id == reply.output[0].id and [lp.token for lp in newest.content[0].logprobs] == want
    assert alice.conversations.items.list(conv.id).data[0].content[0].logprobs == []
    item = alice.conversations.items.retrieve(reply.output[0].id, conversation_id=conv.id, include=include)
    assert [lp.token for lp in item.content[0].logprobs] == want
    assert alice.conversations.items.retrieve(reply.output[0].id, conversation_id=conv.id).content[0].logprobs == []
    with pytest.raises(openai.BadRequestError) as e:
        alice.conversations.items.list(conv.id, include=["file_search_call.results"])
    assert e.value.body["param"] == "include[0]"
    for n in range(23):  # 25 items in all
        alice.conversations.items.create(conv.id, items=[{"role": "user", "content": f"line {n}"}])
    oldest = [i.id for i in alice.conversations.items.list(conv.id, order="asc", limit=100).data]
    assert len(oldest) == 25
    newest_first = [i.id for i in alice.conversations.items.list(conv.id, limit=100).data]
    assert newest_first == oldest[::-1]
    page = alice.conversations.items.list(conv.id, order="asc", limit=10, after=oldest[9])
    assert [i.id for i in page.data] == oldest[10:20] and page.has_more
    page = alice.conversations.items.list(conv.id, limit=10, after=oldest[9])  # newest first: those before it
    assert [i.id for i in page.data] == oldest[:9][::-1] and not page.has_more
    assert [i.id for i in alice.conversations.items.list(conv.id, order="asc")] == oldest  # the client's pages


@pytest.mark.parametrize("call, param", [
    (lambda c, conv: c.conversations.create(items=[{"role": "user", "content": "x"}] * 21), "items"),
    (lambda c, conv: c.conversations.create(items=[{"type": "message", "role": "robot", "content": "x"}]), "items.0"),
    (lambda c, conv: c.conversations.items.create(conv, items=[]), "items"),
    (lambda c, conv: c.conversations.items.list(conv, limit=0), "limit"),
    (lambda c, conv: c.conversations.items.list(conv, order="sideways"), "order"),
    (lambda c, conv: c.conversations.items.list(conv, after="msg_none"), "after"),
])
def test_bad_conversation_requests_are_refused_naming_the_field(alice, call, param):
    conv = alice.conversations.create().id
    with pytest.raises(openai.BadRequestError) as e:
        call(alice, conv)
    assert e.value.body["param"] == param


def test_truncation_auto_drops_the_oldest_items_to_fit_the_context(alice):
    """A conversation longer than the context: with ``truncation`` disabled (the default) the request is a 400
    naming ``input``; with ``auto`` the oldest messages are dropped until it fits, the reply the one its kept
    messages sent whole give (found by their token count), and the conversation keeps every item."""
    said = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Line {i}: " + "lorem ipsum dolor " * 12}
            for i in range(24)]
    conv = alice.conversations.create(items=said[:20])
    alice.conversations.items.create(conv.id, items=said[20:])
    ask = {"model": BASE, "max_output_tokens": 4, "temperature": 0}
    with pytest.raises(openai.BadRequestError) as e:
        alice.responses.create(conversation=conv.id, input="Sum it up.", **ask)
    assert e.value.body["code"] == "context_length_exceeded"
    cut = alice.responses.create(conversation=conv.id, input="Sum it up.", truncation="auto", **ask)
    assert cut.truncation == "auto" and cut.usage.input_tokens + 4 <= 512
    messages = said + [{"role": "user", "content": "Sum it up."}]
    for k in range(1, len(messages)):  # the suffix the server kept: the one of its token count
        whole = alice.responses.create(input=messages[-k:], **ask)
        if whole.usage.input_tokens >= cut.usage.input_tokens:
            break
    assert whole.usage.input_tokens == cut.usage.input_tokens and whole.output_text == cut.output_text
    assert len(list(alice.conversations.items.list(conv.id, limit=100))) == 24 + 2
