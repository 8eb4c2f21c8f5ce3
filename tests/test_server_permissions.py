"""OpenAI's checkpoint permissions on a live server, with the ``openai`` client: a tenant shares its fine-tuned model
(or a checkpoint) with another, which then serves it and fine-tunes on it as its own, until the owner revokes the
permission or deletes the model; only the owner grants, lists, revokes and deletes."""

from __future__ import annotations

import io

import openai
import pytest
from openai import OpenAI

from server_helpers import API_KEYS, chat_jsonl, wait_for_job

BASE = "tiny-llama"
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def clients(api_server):
    return {t: OpenAI(base_url=f"{api_server.url}/v1", api_key=k, max_retries=0, timeout=60)
            for t, k in API_KEYS.items()}


@pytest.fixture(scope="module")
def alices_model(clients) -> str:
    """A fine-tuned model of alice's, for the tests of bad grants and listings."""
    return _tuned(clients["alice"], "grants").fine_tuned_model


def _tuned(client, suffix: str):
    f = client.files.create(file=("chat.jsonl", io.BytesIO(chat_jsonl())), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(model=BASE, training_file=f.id, suffix=suffix, seed=1, hyperparameters={
        "n_epochs": 1, "batch_size": 2, "learning_rate_multiplier": 100}, extra_body={"coserve": {"r": 4}})
    done = wait_for_job(client, job.id)
    assert done.status == "succeeded", done.error
    return done


def _reply(client, model: str) -> str:
    return client.chat.completions.create(model=model, messages=HELLO, max_tokens=8, temperature=0).choices[0]\
        .message.content


def test_a_shared_model_is_served_and_fine_tuned_by_its_grantee_until_revoked(clients):
    alice, bob = clients["alice"], clients["bob"]
    done = _tuned(alice, "shared")
    model = done.fine_tuned_model
    permissions = alice.fine_tuning.checkpoints.permissions
    with pytest.raises(openai.NotFoundError):
        _reply(bob, model)
    granted = permissions.create(model, project_ids=["bob", "bob"]).data
    assert [(p.object, p.project_id) for p in granted] == [("checkpoint.permission", "bob")]
    assert permissions.create(model, project_ids=["bob"]).data[0].id == granted[0].id  # granted once
    # bob uses it as his own: served (the same replies as alice's), listed, described, fine-tuned on
    assert _reply(bob, model) == _reply(alice, model) != _reply(alice, BASE)
    listed = {m.id: m.owned_by for m in bob.models.list().data}
    assert listed[model] == "alice" and bob.models.retrieve(model).owned_by == "alice"
    f = bob.files.create(file=("chat.jsonl", io.BytesIO(chat_jsonl())), purpose="fine-tune")
    on_top = bob.fine_tuning.jobs.create(model=model, training_file=f.id, hyperparameters={"n_epochs": 1})
    on_top = wait_for_job(bob, on_top.id)
    assert on_top.status == "succeeded", on_top.error
    assert any(f"started from {model}" in e.message for e in bob.fine_tuning.jobs.list_events(on_top.id).data)
    assert on_top.fine_tuned_model not in [m.id for m in alice.models.list().data]  # bob's own
    # only the owner grants, lists, revokes and deletes
    with pytest.raises(openai.NotFoundError):
        bob.fine_tuning.checkpoints.permissions.create(model, project_ids=["alice"])
    with pytest.raises(openai.NotFoundError):
        bob.fine_tuning.checkpoints.permissions.list(model)
    with pytest.raises(openai.NotFoundError):
        bob.fine_tuning.checkpoints.permissions.delete(granted[0].id, fine_tuned_model_checkpoint=model)
    with pytest.raises(openai.PermissionDeniedError):
        bob.models.delete(model)
    assert [p.project_id for p in permissions.list(model, project_id="bob").data] == ["bob"]
    assert permissions.list(model, project_id="carol").data == []
    # revoked: bob's next requests are 404s; revoking again is one too
    gone = permissions.delete(granted[0].id, fine_tuned_model_checkpoint=model)
    assert gone.deleted and gone.id == granted[0].id
    with pytest.raises(openai.NotFoundError):
        _reply(bob, model)
    assert model not in [m.id for m in bob.models.list().data]
    with pytest.raises(openai.NotFoundError):
        permissions.delete(granted[0].id, fine_tuned_model_checkpoint=model)
    # a checkpoint is shared on its own; a model its owner deleted is served to no one
    checkpoint = alice.fine_tuning.jobs.checkpoints.list(done.id).data[-1].fine_tuned_model_checkpoint
    permissions.create(checkpoint, project_ids=["bob"])
    assert _reply(bob, checkpoint) == _reply(alice, checkpoint)
    permissions.create(model, project_ids=["bob"])
    alice.models.delete(model)
    with pytest.raises(openai.NotFoundError):
        _reply(bob, model)
    with pytest.raises(openai.NotFoundError):
        permissions.list(model)


@pytest.mark.parametrize("project_ids,param", [
    ([], "project_ids"), (["carol"], "project_ids[0]"), (["bob", "alice"], "project_ids[1]"), ("bob", "project_ids"),
])
def test_bad_grants_are_refused_naming_the_field(clients, alices_model, project_ids, param):
    with pytest.raises(openai.BadRequestError) as e:
        clients["alice"].fine_tuning.checkpoints.permissions.create(alices_model, project_ids=project_ids)
    assert e.value.body["param"] == param


def test_listing_pages_newest_first_or_oldest_first(clients, alices_model):
    model = alices_model
    permissions = clients["alice"].fine_tuning.checkpoints.permissions
    permissions.create(model, project_ids=["bob"])
    (only,) = permissions.list(model, order="ascending").data
    page = permissions.retrieve(model, limit=1)  # the deprecated form: the list object itself
    assert [p.id for p in page.data] == [only.id] and not page.has_more
    with pytest.raises(openai.BadRequestError, match="limit"):
        permissions.list(model, limit=101)
    with pytest.raises(openai.BadRequestError, match="after"):
        permissions.list(model, after="cp_nope")
    with pytest.raises(openai.NotFoundError):
        permissions.create("ft:tiny-llama::ftjob-000000000000000000000000", project_ids=["bob"])

