"""DPO fine-tuning jobs on a live server through the official ``openai`` client: a file of OpenAI's preference
records, ``method: {"type": "dpo"}``, the job co-served with chat to a servable model; bad DPO requests and files
refused naming the field or line. And OpenAI's supervised-then-DPO path: a job on a fine-tuned model trains on
from its adapter (the DPO reference too)."""

from __future__ import annotations

import io
import json
import math

import openai
import pytest
from openai import OpenAI

from server_helpers import API_KEYS, chat_jsonl, refused_job, wait_for_job

KEY, OTHER = API_KEYS["alice"], API_KEYS["bob"]
BASE = "tiny-llama"


def _pair(word: str) -> dict:
    return {"input": {"messages": [{"role": "user", "content": f"Tell me about {word}."}]},
            "preferred_output": [{"role": "assistant", "content": f"{word.title()} are wonderful."}],
            "non_preferred_output": [{"role": "assistant", "content": "No."}]}


def _jsonl(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


@pytest.fixture(scope="module")
def client(api_server):
    alice = OpenAI(base_url=f"{api_server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    alice.other = OpenAI(base_url=f"{api_server.url}/v1", api_key=OTHER, max_retries=0, timeout=60)  # tenant bob
    return alice


def _upload(client, data: bytes):
    return client.files.create(file=("pairs.jsonl", io.BytesIO(data)), purpose="fine-tune")


def test_a_dpo_job_trains_a_servable_model_while_chat_is_served(client):
    training = _upload(client, _jsonl(_pair(w) for w in ("cats", "dogs", "owls", "bees")))
    held_out = _upload(client, _jsonl(_pair(w) for w in ("ants", "frogs")))
    job = client.fine_tuning.jobs.create(
        model=BASE, training_file=training.id, validation_file=held_out.id, suffix="prefs",
        method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2, "n_epochs": 2, "batch_size": 2,
                                                             "learning_rate_multiplier": 100}}})
    assert job.method.type == "dpo" and job.method.dpo.hyperparameters.beta == 0.2
    messages = [{"role": "user", "content": "Tell me about cats."}]
    while client.fine_tuning.jobs.retrieve(job.id).status in ("validating_files", "queued", "running"):
        reply = client.chat.completions.create(model=BASE, messages=messages, max_tokens=4)  # served meanwhile
        assert reply.choices[0].finish_reason in ("length", "stop")
        if client.fine_tuning.jobs.retrieve(job.id).status not in ("validating_files", "queued", "running"):
            break
    done = wait_for_job(client, job.id)
    assert done.status == "succeeded", done.error
    metrics = [e.data for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data if e.type == "metrics"]
    assert sorted(m["step"] for m in metrics) == [1, 2, 3, 4]
    assert all("train_reward_accuracy" in m and "train_reward_margin" in m for m in metrics)
    assert sorted(m["step"] for m in metrics if "full_valid_loss" in m) == [2, 4]  # each epoch's end
    tuned = client.chat.completions.create(model=done.fine_tuned_model, messages=messages, max_tokens=6,
                                           temperature=0)
    assert tuned.model == done.fine_tuned_model and tuned.usage.completion_tokens > 0


@pytest.mark.parametrize("method, extra, param", [
    ({"type": "dpo", "dpo": {"hyperparameters": {"beta": 5}}}, {}, "method.dpo.hyperparameters.beta"),
    ({"type": "dpo", "supervised": {}}, {}, "method.supervised"),
    ({"type": "kto"}, {}, "method.type"),
    ({"type": "dpo"}, {"extra_body": {"coserve": {"dpo_loss": "ipo", "dpo_label_smoothing": 0.1}}},
     "coserve.dpo_label_smoothing"),
    ({"type": "dpo"}, {"extra_body": {"coserve": {"dpo_loss": "kto"}}}, "coserve.dpo_loss"),
    ({"type": "dpo"}, {"extra_body": {"coserve": {"dpo_loss": "orpo", "dpo_label_smoothing": 0.1}}},
     "coserve.dpo_label_smoothing"),
    ({"type": "dpo"}, {"extra_body": {"coserve": {"dpo_loss": "simpo", "simpo_gamma": -1}}}, "coserve.simpo_gamma"),
])
def test_bad_dpo_jobs_are_refused_naming_the_field(client, method, extra, param):
    body = refused_job(client, BASE, _upload(client, _jsonl([_pair("cats")])).id, method, extra)
    assert body["param"] == param, body


def test_files_hold_one_format_and_a_chat_file_fails_a_dpo_job_naming_the_line(client):
    with pytest.raises(openai.BadRequestError) as e:
        _upload(client, _jsonl([_pair("cats"), {"messages": [{"role": "user", "content": "a"},
                                                             {"role": "assistant", "content": "b"}]}]))
    assert "line 2: a chat record in a file of preference pairs" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        _upload(client, _jsonl([{**_pair("cats"), "preferred_output": "yes"}]))
    assert "line 1: preferred_output: expected an array of one assistant message" in e.value.body["message"]
    chat = _upload(client, _jsonl([{"messages": [{"role": "user", "content": "a"},
                                                 {"role": "assistant", "content": "b"}]}]))
    job = client.fine_tuning.jobs.create(model=BASE, training_file=chat.id, method={"type": "dpo"})
    failed = wait_for_job(client, job.id)
    assert failed.status == "failed" and "line 1: record: no 'input'" in failed.error.message


def test_supervised_then_dpo_on_the_fine_tuned_model(client):
    """OpenAI's recommended path: a supervised job, then jobs whose ``model`` is its fine-tuned model. Each trains
    on from that model's adapter (its PEFT config, r 4, kept): a second supervised job's first loss is the first
    job's validation loss after its last step on the same file (one batch of it all); a DPO job takes the model as
    its reference as well, so its first loss is log 2, and with a negligible learning rate it answers as the
    model does (a fresh adapter would answer as the base)."""
    chat = _upload(client, chat_jsonl())
    first = wait_for_job(client, client.fine_tuning.jobs.create(
        model=BASE, training_file=chat.id, validation_file=chat.id, suffix="sft", seed=1,
        hyperparameters={"n_epochs": 2, "batch_size": 3, "learning_rate_multiplier": 100},
        extra_body={"coserve": {"r": 4, "target_modules": ["v_proj", "down_proj"]}}).id)
    assert first.status == "succeeded", first.error
    events = client.fine_tuning.jobs.list_events(first.id, limit=100).data
    after = max((e.data for e in events if e.type == "metrics"), key=lambda m: m["step"])["full_valid_loss"]
    sft = first.fine_tuned_model

    more = client.fine_tuning.jobs.create(model=sft, training_file=chat.id, suffix="more", seed=2,
                                          hyperparameters={"n_epochs": 1, "batch_size": 6})
    assert more.model == sft and more.coserve["peft_config"]["r"] == 4
    more = wait_for_job(client, more.id)
    assert more.status == "succeeded", more.error
    assert more.fine_tuned_model.startswith(f"ft:{BASE}:more:")
    events = client.fine_tuning.jobs.list_events(more.id, limit=100).data
    step = next(e.data for e in events if e.type == "metrics")
    assert step["step"] == 1 and step["train_loss"] == pytest.approx(after, rel=1e-5)
    assert any(e.message.startswith(f"Fine-tuning job started from {sft}") for e in events)

    pairs = _upload(client, _jsonl(_pair(w) for w in ("cats", "dogs")))
    dpo = wait_for_job(client, client.fine_tuning.jobs.create(
        model=sft, training_file=pairs.id, suffix="dpo", method={"type": "dpo", "dpo": {"hyperparameters": {
            "n_epochs": 1, "batch_size": 2, "learning_rate_multiplier": 1e-4}}}).id)
    assert dpo.status == "succeeded", dpo.error
    step = next(e.data for e in client.fine_tuning.jobs.list_events(dpo.id, limit=100).data if e.type == "metrics")
    assert step["train_loss"] == pytest.approx(math.log(2), abs=1e-4) and abs(step["train_reward_margin"]) < 1e-4
    messages = [{"role": "user", "content": "What do bees make?"}]

    def answer(model):
        return client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True}).choices[0].message.content
    assert answer(dpo.fine_tuned_model) == answer(sft) != answer(BASE)

    # a checkpoint is a fine-tuned model too
    checkpoint = client.fine_tuning.jobs.checkpoints.list(first.id).data[-1].fine_tuned_model_checkpoint
    queued = client.fine_tuning.jobs.create(model=checkpoint, training_file=chat.id)
    assert client.fine_tuning.jobs.cancel(queued.id).status == "cancelled"
    # the model decides the adapter's settings; another tenant's model, or an unknown one, is not found
    with pytest.raises(openai.BadRequestError) as e:
        client.fine_tuning.jobs.create(model=sft, training_file=chat.id, extra_body={"coserve": {"r": 8}})
    assert e.value.body["param"] == "coserve.r"
    bobs = _upload(client.other, chat_jsonl())
    for name in (sft, f"ft:{BASE}:x:ftjob-000000000000000000000000", "other-model"):
        with pytest.raises(openai.NotFoundError) as e:
            client.other.fine_tuning.jobs.create(model=name, training_file=bobs.id)
        assert e.value.body["param"] == "model"


def test_reference_free_methods_in_place_of_the_dpo_loss(client):
    """``coserve.dpo_loss`` orpo (or simpo) runs that method on the DPO job's pairs and beta: ORPO's first loss holds
    the chosen completions' cross-entropy (about log of the vocabulary for a random model), where DPO's starts at
    log 2."""
    pairs = _upload(client, _jsonl(_pair(w) for w in ("cats", "dogs")))
    losses = {}
    for loss in ("orpo", "simpo"):
        job = wait_for_job(client, client.fine_tuning.jobs.create(
            model=BASE, training_file=pairs.id, method={"type": "dpo", "dpo": {"hyperparameters": {
                "n_epochs": 1, "batch_size": 2, "beta": 0.5}}},
            extra_body={"coserve": {"dpo_loss": loss, "simpo_gamma": 0.2}}).id)
        assert job.status == "succeeded", job.error
        step = next(e.data for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data
                    if e.type == "metrics")
        assert "train_reward_margin" in step
        losses[loss] = step["train_loss"]
    assert losses["orpo"] > 5  # cross-entropy of a random model
    assert 0 < losses["simpo"] < 2 and abs(losses["simpo"] - math.log(2)) > 1e-3  # gamma shifts it from log 2


def test_jobs_are_listed_by_metadata_through_the_client(client):
    """OpenAI's ``metadata`` filter of ``GET /v1/fine_tuning/jobs`` (``metadata[k]=v``, ``metadata=null``)."""
    import httpx
    pairs = _upload(client, _jsonl([_pair("cats")]))
    tagged = client.fine_tuning.jobs.create(model=BASE, training_file=pairs.id, method={"type": "dpo"},
                                            metadata={"experiment": "tagged-1"})
    plain = client.fine_tuning.jobs.create(model=BASE, training_file=pairs.id, method={"type": "dpo"})
    for job in (tagged, plain):  # stopped, or already finished (one pair trains fast): either way listed alike
        try:
            client.fine_tuning.jobs.cancel(job.id)
        except openai.ConflictError:
            assert client.fine_tuning.jobs.retrieve(job.id).status in ("succeeded", "failed")
    assert [j.id for j in client.fine_tuning.jobs.list(metadata={"experiment": "tagged-1"})] == [tagged.id]
    assert list(client.fine_tuning.jobs.list(metadata={"experiment": "other"})) == []
    url, key = str(client.base_url).rstrip("/"), {"Authorization": f"Bearer {KEY}"}
    untagged = httpx.get(f"{url}/fine_tuning/jobs", params={"metadata": "null", "limit": 100}, headers=key).json()
    assert plain.id in [j["id"] for j in untagged["data"]] and all(j["metadata"] is None for j in untagged["data"])
    r = httpx.get(f"{url}/fine_tuning/jobs", params={"metadata": "null", "metadata[a]": "b"}, headers=key)
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata"
