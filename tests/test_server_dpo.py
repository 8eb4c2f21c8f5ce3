"""DPO fine-tuning jobs on a live server through the official ``openai`` client: a file of OpenAI's preference
records, ``method: {"type": "dpo"}``, the job co-served with chat to a servable model; bad DPO requests and files
refused naming the field or line."""

from __future__ import annotations

import io
import json

import openai
import pytest
from openai import OpenAI

from server_helpers import start_server, wait_for_job

KEY = "key-dpo"
BASE = "tiny-llama"


def _pair(word: str) -> dict:
    return {"input": {"messages": [{"role": "user", "content": f"Tell me about {word}."}]},
            "preferred_output": [{"role": "assistant", "content": f"{word.title()} are wonderful."}],
            "non_preferred_output": [{"role": "assistant", "content": "No."}]}


def _jsonl(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


@pytest.fixture(scope="module")
def client(model_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-dpo")
    keys = root / "keys.txt"
    keys.write_text(f"{KEY} alice\n")
    srv = start_server(model_factory("llama"), root / "state", "--api-keys", str(keys), "--served-model-name", BASE)
    yield OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    srv.stop()


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
    ({"type": "reinforcement"}, {}, "method.type"),
    ({"type": "dpo"}, {"extra_body": {"coserve": {"dpo_loss": "ipo", "dpo_label_smoothing": 0.1}}},
     "coserve.dpo_label_smoothing"),
    ({"type": "dpo"}, {"extra_body": {"coserve": {"dpo_loss": "kto"}}}, "coserve.dpo_loss"),
])
def test_bad_dpo_jobs_are_refused_naming_the_field(client, method, extra, param):
    training = _upload(client, _jsonl([_pair("cats")]))
    extra = {k: training.id if v == "same" else v for k, v in extra.items()}
    with pytest.raises(openai.BadRequestError) as e:
        client.fine_tuning.jobs.create(model=BASE, training_file=training.id, method=method, **extra)
    assert e.value.body["param"] == param, e.value.body


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
