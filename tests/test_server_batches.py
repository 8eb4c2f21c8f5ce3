"""OpenAI's Batch API against a live server, through the official ``openai`` client: a batch of chat requests runs
to an output file (the same replies as the requests sent one by one) and an error file; bad batches are 4xx naming
the field or line; a batch is the tenant's alone; cancelling keeps what finished; a server killed (SIGKILL) in the
middle of a batch goes on with it after a restart, no request lost or run twice. The first server schedules by
priority (batch requests get priority 1 unless they name one), the restarted one first come, first served."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from openai import OpenAI

from server_helpers import start_server

ALICE, BOB = "sk-alice-batch", "sk-bob-batch"
BASE = "tiny"


@pytest.fixture(scope="module")
def server(model_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("batches")
    keys = root / "keys.txt"
    keys.write_text(f"{ALICE} alice\n{BOB} bob\n")
    srv = start_server(model_factory("llama"), root / "state", "--api-keys", str(keys), "--served-model-name", BASE,
                       "--scheduling-policy", "priority")  # batch requests then wait behind interactive ones
    yield srv
    srv.stop()


def client(srv, key: str = ALICE) -> OpenAI:
    return OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=60)


def chat_line(custom_id: str, content: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": BASE, "messages": [{"role": "user", "content": content}], "max_tokens": 6,
                     "temperature": 0, **body}}


def upload(c: OpenAI, lines: list[dict], purpose: str = "batch"):
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return c.files.create(file=("batch.jsonl", data), purpose=purpose)


def wait(c: OpenAI, batch_id: str, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = c.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} did not finish in {timeout} s")


def records(c: OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in c.files.content(file_id).text.splitlines()]


def test_a_batch_runs_to_output_and_error_files_with_the_replies_of_single_requests(server):
    c = client(server)
    lines = [chat_line(f"req-{i}", f"Hello number {i}") for i in range(3)] + [chat_line("bad", "x", max_tokens=-1)]
    source = upload(c, lines)
    batch = c.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h",
                             metadata={"run": "test"})
    assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 4
    done = wait(c, batch.id)
    assert done.status == "completed" and done.metadata == {"run": "test"}
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 1)
    out = records(c, done.output_file_id)
    assert [r["custom_id"] for r in out] == ["req-0", "req-1", "req-2"]  # the input's order
    for r, line in zip(out, lines):
        assert r["id"].startswith("batch_req_") and r["response"]["status_code"] == 200 and r["error"] is None
        single = c.chat.completions.create(**line["body"], extra_body={"priority": -1})
        assert r["response"]["body"]["choices"][0]["message"]["content"] == single.choices[0].message.content
    (err,) = records(c, done.error_file_id)
    assert err["custom_id"] == "bad" and err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["param"] == "max_tokens"
    assert c.files.retrieve(done.output_file_id).purpose == "batch_output"
    listed = c.batches.list(limit=10)
    assert batch.id in [b.id for b in listed.data]
    with pytest.raises(openai.NotFoundError):  # another tenant's batch and files are not there for bob
        client(server, BOB).batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        client(server, BOB).files.content(done.output_file_id)
    with pytest.raises(openai.ConflictError):
        c.batches.cancel(batch.id)
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'coserve_batches{state="completed"}' in metrics and 'coserve_batches{state="completed"} 0.0' not in metrics


def test_bad_batches_are_4xx_naming_the_field_or_line(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        upload(c, [chat_line("a", "hi"), {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}])
    assert "line 2: custom_id: 'a' is also the custom_id of line 1" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        upload(c, [{**chat_line("s", "hi"), "body": {"model": BASE, "stream": True}}])
    assert "line 1: body.stream" in e.value.body["message"]
    good = upload(c, [chat_line("a", "hi")])
    tuning = c.files.create(file=("t.jsonl", b'{"messages": [{"role": "user", "content": "a"}, '
                                             b'{"role": "assistant", "content": "b"}]}\n'), purpose="fine-tune")
    for kwargs, param in (({"input_file_id": tuning.id}, "input_file_id"),
                          ({"endpoint": "/v1/completions"}, "input_file_id"),
                          ({"endpoint": "/v1/moderations"}, "endpoint"),
                          ({"completion_window": "1h"}, "completion_window")):
        with pytest.raises(openai.BadRequestError) as e:
            c.batches.create(**{"input_file_id": good.id, "endpoint": "/v1/chat/completions",
                                "completion_window": "24h", **kwargs})
        assert e.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        c.batches.create(input_file_id="file-" + "0" * 24, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client(server, BOB).batches.create(input_file_id=good.id, endpoint="/v1/chat/completions",
                                           completion_window="24h")


def test_cancelling_a_batch_keeps_what_finished(server):
    c = client(server)
    source = upload(c, [chat_line(f"slow-{i}", "Tell me more", max_tokens=40, ignore_eos=True) for i in range(40)])
    batch = c.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.ConflictError):  # its input file is in use
        c.files.delete(source.id)
    assert c.batches.cancel(batch.id).status == "cancelling"
    done = wait(c, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    kept = records(c, done.output_file_id)
    assert done.request_counts.completed == len(kept) < 40
    assert all(r["response"]["status_code"] == 200 for r in kept)


def test_sigkill_mid_batch_then_resume(model_factory, tmp_path):
    model = model_factory("llama")
    state = tmp_path / "state"
    srv = start_server(model, state, "--served-model-name", BASE)
    lines = [chat_line(f"r{i}", f"Count to {i}", max_tokens=24, ignore_eos=True) for i in range(24)]
    try:
        c = client(srv)
        batch = c.batches.create(input_file_id=upload(c, lines).id, endpoint="/v1/chat/completions",
                                 completion_window="24h")
        progress = state / "batches" / f"{batch.id}.jsonl"
        deadline = time.monotonic() + 120
        while not (progress.is_file() and progress.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline, "no request of the batch finished"
            time.sleep(0.05)
        srv.crash()
    finally:
        srv.stop(kill=True)
    finished_before = progress.read_text().count("\n")
    assert finished_before < len(lines), "the batch finished before the kill: nothing to resume"

    again = start_server(model, state, "--served-model-name", BASE)
    try:
        c = client(again)
        done = wait(c, batch.id)
        assert done.status == "completed" and done.request_counts.completed == len(lines)
        out = records(c, done.output_file_id)
        assert [r["custom_id"] for r in out] == [line["custom_id"] for line in lines]  # each once, in order
        assert not progress.exists()
    finally:
        again.stop()
