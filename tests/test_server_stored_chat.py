"""OpenAI's stored chat completions on a live server, with the ``openai`` client: ``store: true`` keeps a completion
(streamed or not) with its metadata and messages, for its tenant alone; list, filter, page, relabel and delete."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI

from server_helpers import API_KEYS

BASE = "tiny-llama"
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def clients(api_server):
    return {t: OpenAI(base_url=f"{api_server.url}/v1", api_key=k, max_retries=0, timeout=60)
            for t, k in API_KEYS.items()}


def test_stored_completions_are_kept_listed_relabelled_and_deleted(clients):
    alice, bob = clients["alice"], clients["bob"]
    kept = alice.chat.completions.create(model=BASE, messages=ASK, max_tokens=6, temperature=0, store=True,
                                         metadata={"topic": "colour", "run": "1"})
    stored = alice.chat.completions.retrieve(kept.id)
    assert stored.choices[0].message.content == kept.choices[0].message.content
    assert stored.usage == kept.usage and stored.model == BASE and stored.metadata == {"topic": "colour", "run": "1"}
    messages = alice.chat.completions.messages.list(kept.id).data
    assert [(m.role, m.content) for m in messages] == [(m["role"], m["content"]) for m in ASK]
    assert [m.id for m in messages] == [f"{kept.id}-0", f"{kept.id}-1"]
    assert [m.content for m in alice.chat.completions.messages.list(kept.id, order="desc", limit=1).data] == \
        ["Name a colour."]
    # streamed: kept once the stream has ended, as the same request whole would be
    chunks = list(alice.chat.completions.create(model=BASE, messages=ASK, max_tokens=6, temperature=0, store=True,
                                                stream=True, metadata={"topic": "colour", "run": "2"}))
    streamed = alice.chat.completions.retrieve(chunks[0].id)
    assert streamed.choices[0].message.content == kept.choices[0].message.content
    assert streamed.choices[0].finish_reason == kept.choices[0].finish_reason
    unkept = alice.chat.completions.create(model=BASE, messages=ASK, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        alice.chat.completions.retrieve(unkept.id)
    # listed oldest first, filtered by metadata and model, paged
    mine = [c.id for c in alice.chat.completions.list(metadata={"topic": "colour"}).data]
    assert mine[-2:] == [kept.id, streamed.id]
    assert [c.id for c in alice.chat.completions.list(metadata={"topic": "colour", "run": "2"}).data] == [streamed.id]
    assert alice.chat.completions.list(model="another-model").data == []
    page = alice.chat.completions.list(metadata={"topic": "colour"}, order="desc", limit=1)
    assert [c.id for c in page.data] == [streamed.id] and page.has_more
    rest = alice.chat.completions.list(metadata={"topic": "colour"}, order="desc", after=streamed.id)
    assert [c.id for c in rest.data] == [kept.id]
    # relabelled; deleted
    assert alice.chat.completions.update(kept.id, metadata={"topic": "done"}).metadata == {"topic": "done"}
    assert [c.id for c in alice.chat.completions.list(metadata={"topic": "done"}).data] == [kept.id]
    gone = alice.chat.completions.delete(kept.id)
    assert gone.deleted and gone.id == kept.id and gone.object == "chat.completion.deleted"
    with pytest.raises(openai.NotFoundError):
        alice.chat.completions.retrieve(kept.id)
    # the tenant's alone
    assert streamed.id not in [c.id for c in bob.chat.completions.list().data]
    for call in (bob.chat.completions.retrieve, bob.chat.completions.delete, bob.chat.completions.messages.list):
        with pytest.raises(openai.NotFoundError):
            call(streamed.id)
    with pytest.raises(openai.NotFoundError):
        bob.chat.completions.update(streamed.id, metadata={})


@pytest.mark.parametrize("kwargs,param", [
    ({"limit": 0}, "limit"), ({"order": "newest"}, "order"), ({"after": "chatcmpl-nope"}, "after"),
])
def test_bad_listings_are_refused_naming_the_parameter(clients, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        clients["alice"].chat.completions.list(**kwargs)
    assert e.value.body["param"] == param


def test_bad_metadata_is_refused_naming_the_field(clients):
    with pytest.raises(openai.BadRequestError) as e:
        clients["alice"].chat.completions.create(model=BASE, messages=ASK, max_tokens=2, store=True,
                                                 metadata={"k" * 65: "v"})
    assert e.value.body["param"].startswith("metadata")


def test_bad_relabels_and_query_types_are_400s_naming_the_field(clients, api_server):
    import httpx
    alice = clients["alice"]
    kept = alice.chat.completions.create(model=BASE, messages=ASK, max_tokens=2, store=True)
    headers = {"Authorization": f"Bearer {API_KEYS['alice']}"}
    for method, path, kwargs, param in (
            ("post", f"/v1/chat/completions/{kept.id}", {"json": {"metadata": {"k": 3}}}, "metadata"),
            ("post", f"/v1/chat/completions/{kept.id}", {"json": {}}, "metadata"),
            ("get", "/v1/chat/completions", {"params": {"limit": "many"}}, "limit"),
            ("get", f"/v1/chat/completions/{kept.id}/messages", {"params": {"order": "sideways"}}, "order")):
        r = getattr(httpx, method)(f"{api_server.url}{path}", headers=headers, timeout=30, **kwargs)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"].startswith(param), (path, r.text)
