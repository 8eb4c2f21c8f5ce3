"""OpenAI's Evals API on a live server through the official ``openai`` client: an eval's testing criteria (graders)
over items; a completions run samples the served model through the chat route (each sample what the chat API
gives the same conversation) and grades every item (each score what the grader endpoint gives the same sample);
a jsonl run grades samples it is given, from an ``evals`` file; bad requests name the field; tenants see only their
own evals; cancel and delete."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest
from openai import OpenAI
from rapidfuzz import fuzz

from server_helpers import API_KEYS

BASE = "tiny-llama"
ITEMS = [{"q": "Capital of France?", "answer": "Paris"}, {"q": "Two plus two?", "answer": "4"},
         {"q": "Colour of the sky?", "answer": "blue"}]
CONTAINS = {"type": "string_check", "name": "contains", "input": "{{ sample.output_text }}",
            "reference": "{{ item.answer }}", "operation": "ilike"}
CLOSE = {"type": "text_similarity", "name": "close", "input": "{{ sample.output_text }}",
         "reference": "{{ item.answer }}", "evaluation_metric": "fuzzy_match", "pass_threshold": 0.1}
JUDGE = {"type": "label_model", "name": "judge", "model": BASE, "labels": ["right", "wrong", "unsure"],
         "passing_labels": ["right"],
         "input": [{"role": "user", "content": "Is {{ sample.output_text }} the answer to {{ item.q }}?"}]}
CONFIG = {"type": "custom", "include_sample_schema": True,
          "item_schema": {"type": "object", "properties": {"q": {"type": "string"}, "answer": {"type": "string"}}}}


@pytest.fixture(scope="module")
def client(api_server):
    return OpenAI(base_url=f"{api_server.url}/v1", api_key=API_KEYS["alice"], max_retries=0, timeout=60)


def _finished(client, eval_id: str, run_id: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = client.evals.runs.retrieve(run_id, eval_id=eval_id)
        if run.status in ("completed", "failed", "canceled"):
            return run
        time.sleep(0.2)
    raise AssertionError(f"run {run_id} still {run.status}")


def _items(client, eval_id: str, run_id: str) -> list:
    return sorted(client.evals.runs.output_items.list(run_id, eval_id=eval_id, limit=100).data,
                  key=lambda x: x.datasource_item_id)


def test_a_completions_run_samples_the_served_model_and_grades_each_item_as_the_graders_would(client):
    ev = client.evals.create(name="basics", data_source_config=CONFIG, testing_criteria=[CONTAINS, CLOSE, JUDGE])
    assert ev.object == "eval" and [c.name for c in ev.testing_criteria] == ["contains", "close", "judge"]
    assert ev.data_source_config.schema_["required"] == ["item", "sample"]
    sampling = {"temperature": 0.0, "max_completion_tokens": 6, "seed": 3}
    run = client.evals.runs.create(ev.id, name="tiny", data_source={
        "type": "completions", "model": BASE, "sampling_params": sampling,
        "source": {"type": "file_content", "content": [{"item": i} for i in ITEMS]},
        "input_messages": {"type": "template", "template": [{"role": "developer", "content": "Answer briefly."},
                                                            {"role": "user", "content": "{{ item.q }}"}]}})
    assert run.status in ("queued", "in_progress") and run.result_counts.total == 3
    run = _finished(client, ev.id, run.id)
    assert run.status == "completed", run.error
    items = _items(client, ev.id, run.id)
    assert [x.datasource_item for x in items] == ITEMS
    prompt_tokens = completion_tokens = 0
    for x, item in zip(items, ITEMS):
        messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": item["q"]}]
        reply = client.chat.completions.create(model=BASE, messages=messages, temperature=0, max_completion_tokens=6,
                                               seed=3)
        text = reply.choices[0].message.content
        assert x.sample.output[0].content == text and x.sample.finish_reason == reply.choices[0].finish_reason
        assert x.sample.usage.prompt_tokens == reply.usage.prompt_tokens
        prompt_tokens += reply.usage.prompt_tokens
        completion_tokens += reply.usage.completion_tokens
        scores = {r.name: r for r in x.results}
        assert scores["contains"].score == float(item["answer"].lower() in text.lower())
        assert scores["close"].score == pytest.approx(fuzz.ratio(text, item["answer"]) / 100, abs=1e-12)
        assert scores["close"].passed == (scores["close"].score >= 0.1)
        judged = client.fine_tuning.alpha.graders.run(grader=JUDGE, model_sample=text, item=item)
        assert scores["judge"].score == judged.reward
        assert x.status == ("pass" if all(r.passed for r in x.results) else "fail")
    counts = run.result_counts
    assert (counts.passed, counts.failed, counts.errored) == (sum(x.status == "pass" for x in items),
                                                              sum(x.status == "fail" for x in items), 0)
    per = {r.testing_criteria: (r.passed, r.failed) for r in run.per_testing_criteria_results}
    for name in ("contains", "close", "judge"):
        passed = sum(r.passed for x in items for r in x.results if r.name == name)
        assert per[name] == (passed, 3 - passed)
    usage = run.per_model_usage[0]
    assert (usage.run_model_name, usage.invocation_count) == (BASE, 3)
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, completion_tokens)
    failed = client.evals.runs.output_items.list(run.id, eval_id=ev.id, status="fail").data
    assert sorted(x.id for x in failed) == sorted(x.id for x in items if x.status == "fail")
    with pytest.raises(openai.ConflictError):
        client.evals.runs.cancel(run.id, eval_id=ev.id)


def test_a_jsonl_run_grades_the_samples_of_an_evals_file(client):
    lines = [{"item": ITEMS[0], "sample": {"output_text": "It is Paris."}},
             {"item": ITEMS[1], "sample": {"output_text": "five"}},
             {"item": {"q": "?"}, "sample": {"output_text": "x"}}]  # no answer: the graders cannot grade it
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    f = client.files.create(file=("items.jsonl", io.BytesIO(data)), purpose="evals")
    ev = client.evals.create(data_source_config=CONFIG, testing_criteria=[CONTAINS])
    run = client.evals.runs.create(ev.id, data_source={"type": "jsonl", "source": {"type": "file_id", "id": f.id}})
    run = _finished(client, ev.id, run.id)
    assert run.status == "completed" and run.model == ""
    items = _items(client, ev.id, run.id)
    assert [x.status for x in items] == ["pass", "fail", "error"]
    assert items[2].results[0].model_extra["error"]["code"] == "invalid_variable_error"
    assert (run.result_counts.passed, run.result_counts.failed, run.result_counts.errored) == (1, 1, 1)
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("bad.jsonl", io.BytesIO(b'{"item": 3}\n')), purpose="evals")
    assert "line 1.item: expected an object" in e.value.body["message"]


@pytest.mark.parametrize("kwargs, param", [
    ({"data_source_config": {"type": "traces"}, "testing_criteria": [CONTAINS]}, "data_source_config.type"),
    ({"data_source_config": {"type": "logs", "metadata": {"k": 1}}, "testing_criteria": [CONTAINS]},
     "data_source_config.metadata"),
    ({"data_source_config": CONFIG, "testing_criteria": []}, "testing_criteria"),
    ({"data_source_config": CONFIG, "testing_criteria": [dict(CLOSE, pass_threshold=None)]},
     "testing_criteria.0.pass_threshold"),
    ({"data_source_config": CONFIG, "testing_criteria": [CONTAINS, CONTAINS]}, "testing_criteria.1.name"),
    ({"data_source_config": CONFIG, "testing_criteria": [dict(JUDGE, model="nobody")]}, "testing_criteria.0.model"),
    ({"data_source_config": CONFIG, "testing_criteria": [{"type": "multi", "name": "m"}]},
     "testing_criteria.0.type"),
    ({"data_source_config": CONFIG, "testing_criteria": [dict(CONTAINS, operation="is")]},
     "testing_criteria.0.operation"),
])
def test_bad_evals_are_refused_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.evals.create(**kwargs)
    assert e.value.body["param"] == param, e.value.body


@pytest.mark.parametrize("source, param", [
    ({"type": "logs", "source": {"type": "file_content", "content": [{"item": {}}]}}, "data_source.type"),
    ({"type": "responses", "source": {"type": "file_content", "content": [{"item": {}}]}}, "data_source.model"),
    ({"type": "jsonl", "source": {"type": "file_content", "content": [{"item": {}}]}}, "data_source.source"),
    ({"type": "completions", "source": {"type": "file_content", "content": [{"item": {}}]}}, "data_source.model"),
    ({"type": "completions", "model": BASE, "source": {"type": "file_content", "content": [{"item": {}}]},
      "input_messages": {"type": "template", "template": [{"role": "robot", "content": "x"}]}},
     "data_source.input_messages.template.0.role"),
    ({"type": "completions", "model": BASE, "source": {"type": "file_content", "content": [{"item": {}}]},
      "input_messages": {"type": "item_reference", "item_reference": "item.q"},
      "sampling_params": {"stop": ["x"]}}, "data_source.sampling_params.stop"),
    ({"type": "jsonl", "source": {"type": "file_id", "id": "file-" + "0" * 24}}, "data_source.source.id"),
    ({"type": "jsonl", "source": {"type": "file_content", "content": [
        {"item": ITEMS[0], "sample": {"output_text": "x"}}, {"item": {"q": 3}, "sample": {"output_text": "x"}}]}},
     "data_source.source.content"),  # item 1 does not match the item_schema
])
def test_bad_runs_are_refused_naming_the_field(client, source, param):
    ev = client.evals.create(data_source_config=CONFIG, testing_criteria=[CONTAINS])
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as e:
        client.evals.runs.create(ev.id, data_source=source)
    assert e.value.body["param"] == param, e.value.body


def test_evals_are_the_tenants_own_and_can_be_listed_renamed_and_deleted(client, api_server):
    bob = OpenAI(base_url=f"{api_server.url}/v1", api_key=API_KEYS["bob"], max_retries=0, timeout=60)
    ev = client.evals.create(name="mine", data_source_config=CONFIG, testing_criteria=[CONTAINS])
    with pytest.raises(openai.NotFoundError):
        bob.evals.retrieve(ev.id)
    assert ev.id not in [e.id for e in bob.evals.list(limit=100).data]
    assert client.evals.update(ev.id, name="renamed").name == "renamed"
    newest = client.evals.list(order="desc", limit=1).data[0]
    assert newest.id == ev.id
    run = client.evals.runs.create(ev.id, data_source={"type": "jsonl", "source": {"type": "file_content", "content": [
        {"item": ITEMS[0], "sample": {"output_text": "Paris"}}]}})
    with pytest.raises(openai.NotFoundError):
        bob.evals.runs.retrieve(run.id, eval_id=ev.id)
    assert _finished(client, ev.id, run.id).result_counts.passed == 1
    assert client.evals.runs.delete(run.id, eval_id=ev.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.evals.runs.retrieve(run.id, eval_id=ev.id)
    assert client.evals.delete(ev.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.evals.retrieve(ev.id)


def test_sigkill_mid_run_then_restart_grades_each_item_once(model_factory, tmp_path):
    """A server killed while a completions run is under way: restarted on the same state directory, the run goes on
    with the items not yet stored and ends with every item once, each sample what the chat API gives it."""
    from server_helpers import start_server
    state = tmp_path / "state"
    items = [{"q": f"Question {i}?", "answer": "x"} for i in range(40)]
    srv = start_server(model_factory("llama"), state, "--served-model-name", BASE)
    try:
        c = OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
        ev = c.evals.create(data_source_config=CONFIG, testing_criteria=[CLOSE])
        run = c.evals.runs.create(ev.id, data_source={
            "type": "completions", "model": BASE, "sampling_params": {"temperature": 0, "max_completion_tokens": 16},
            "source": {"type": "file_content", "content": [{"item": i} for i in items]},
            "input_messages": {"type": "item_reference", "item_reference": "item.q"}})
        deadline = time.monotonic() + 120
        while not c.evals.runs.output_items.list(run.id, eval_id=ev.id).data:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert c.evals.runs.retrieve(run.id, eval_id=ev.id).status == "in_progress"  # killed in the middle
        srv.crash()
    finally:
        srv.stop(kill=True)
    again = start_server(model_factory("llama"), state, "--served-model-name", BASE)
    try:
        c = OpenAI(base_url=f"{again.url}/v1", api_key="none", max_retries=0, timeout=60)
        done = _finished(c, ev.id, run.id)
        assert done.status == "completed" and done.result_counts.total == 40
        got = list(c.evals.runs.output_items.list(run.id, eval_id=ev.id, limit=100))  # every page
        assert sorted(x.datasource_item_id for x in got) == list(range(40))
        assert done.result_counts.passed + done.result_counts.failed == 40
        for x in got[:3]:
            messages = [{"role": "user", "content": x.datasource_item["q"]}]
            reply = c.chat.completions.create(model=BASE, messages=messages, temperature=0, max_completion_tokens=16)
            assert x.sample.output[0].content == reply.choices[0].message.content
    finally:
        again.stop()


PARIS = {"type": "text_similarity", "name": "paris", "input": "{{ sample.output_text }}", "reference": "Paris",
         "evaluation_metric": "fuzzy_match", "pass_threshold": 0.0}


def _run_items(client, eval_id: str, data_source: dict) -> list:
    """A run of ``data_source``, completed, and its output items."""
    run = _finished(client, eval_id, client.evals.runs.create(eval_id, data_source=data_source).id)
    assert run.status == "completed", run.error
    return _items(client, eval_id, run.id)


def test_stored_chat_completions_are_graded_as_stored_or_sampled_again(client):
    """A ``stored_completions`` eval: a run with no model grades the stored replies themselves; one with a model
    samples it again on the messages each stored completion answered (``item.input``), as the chat API would."""
    tag = {"usecase": "stored-evals"}
    asked = [[{"role": "user", "content": q["q"]}] for q in ITEMS[:2]]
    stored = [client.chat.completions.create(model=BASE, messages=m, max_tokens=5, temperature=0, store=True,
                                             metadata=tag) for m in asked]
    ev = client.evals.create(data_source_config={"type": "stored_completions", "metadata": tag},
                             testing_criteria=[PARIS])
    assert ev.data_source_config.type == "stored_completions"
    items = _run_items(client, ev.id, {"type": "completions",
                                       "source": {"type": "stored_completions", "metadata": tag}})
    assert [x.datasource_item["completion_id"] for x in items] == [c.id for c in stored]
    for x, c, m in zip(items, stored, asked):
        reply = c.choices[0].message.content
        assert x.datasource_item["input"] == m and x.sample.output[0].content == reply
        assert x.results[0].score == pytest.approx(fuzz.ratio(reply, "Paris") / 100, abs=1e-12)
    again = _finished(client, ev.id, client.evals.runs.create(ev.id, data_source={
        "type": "completions", "model": BASE, "sampling_params": {"temperature": 0.0, "max_completion_tokens": 3},
        "source": {"type": "stored_completions", "metadata": tag, "limit": 1}}).id)
    (x,) = _items(client, ev.id, again.id)
    fresh = client.chat.completions.create(model=BASE, messages=asked[0], max_completion_tokens=3, temperature=0)
    assert x.sample.output[0].content == fresh.choices[0].message.content and x.sample.model == BASE
    for source, param in (({"type": "stored_completions", "metadata": {"usecase": "none such"}}, "data_source.source"),
                          ({"type": "stored_completions", "limit": 0}, "data_source.source.limit")):
        with pytest.raises(openai.BadRequestError) as e:
            client.evals.runs.create(ev.id, data_source={"type": "completions", "source": source})
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        client.evals.runs.create(ev.id, data_source={"type": "jsonl", "source": {"type": "stored_completions"}})
    assert e.value.body["param"] == "data_source.source.type"


def test_stored_responses_are_graded_as_stored_or_sampled_again(client):
    """A ``logs`` eval over stored responses (a ``responses`` run whose source is ``responses``): with no model the
    stored replies themselves are graded, picked by metadata, instructions, temperature and limit; with a model each
    stored response's input is answered again through the Responses API; ``users``, ``tools`` and
    ``reasoning_effort`` pick by the request's ``user``, the tools it offered and its ``reasoning.effort``. Unfinished
    responses are not items; a bad filter, or stored responses as a completions run's source, is a 400 naming the
    field."""
    tag = {"usecase": "stored-responses"}
    asked = [q["q"] for q in ITEMS[:3]]
    lookup = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
    extra = [{"user": "u1"}, {"tools": [lookup], "tool_choice": "none"}, {"reasoning": {"effort": "low"}}]
    stored = [client.responses.create(model=BASE, input=q, max_output_tokens=5, temperature=0, metadata=tag,
                                      instructions="Answer briefly." if i < 2 else None, **extra[i])
              for i, q in enumerate(asked)]
    ev = client.evals.create(data_source_config={"type": "logs", "metadata": tag}, testing_criteria=[PARIS])
    assert ev.data_source_config.type == "logs"
    items = _run_items(client, ev.id, {"type": "responses", "source": {"type": "responses", "metadata": tag}})
    assert [x.datasource_item["response_id"] for x in items] == [r.id for r in stored]
    for x, r, q in zip(items, stored, asked):
        assert x.datasource_item["input"] == [{"role": "user", "content": q}]
        assert x.sample.output[0].content == r.output_text
        assert x.results[0].score == pytest.approx(fuzz.ratio(r.output_text, "Paris") / 100, abs=1e-12)
    picked = _run_items(client, ev.id, {"type": "responses", "source": {
        "type": "responses", "metadata": tag, "instructions_search": "briefly", "temperature": 0, "limit": 1}})
    assert [x.datasource_item["response_id"] for x in picked] == [stored[0].id]
    assert stored[2].reasoning.effort == "low" and stored[0].reasoning.effort is None
    for field, value, want in (("users", ["u1", "u9"], [stored[0].id]), ("tools", ["lookup"], [stored[1].id]),
                               ("reasoning_effort", "low", [stored[2].id])):
        picked = _run_items(client, ev.id, {"type": "responses", "source": {"type": "responses", "metadata": tag,
                                                                              field: value}})
        assert [x.datasource_item["response_id"] for x in picked] == want, field
    again = _finished(client, ev.id, client.evals.runs.create(ev.id, data_source={
        "type": "responses", "model": BASE, "sampling_params": {"temperature": 0.0, "max_completion_tokens": 3},
        "source": {"type": "responses", "metadata": tag, "limit": 1}}).id)
    (x,) = _items(client, ev.id, again.id)
    fresh = client.responses.create(model=BASE, input=asked[0], max_output_tokens=3, temperature=0)
    assert x.sample.output[0].content == fresh.output_text and x.sample.model == BASE
    for data_source, param in (
            ({"type": "responses", "source": {"type": "responses", "metadata": {"usecase": "none such"}}},
             "data_source.source"),
            ({"type": "responses", "source": {"type": "responses", "reasoning_effort": "lots"}},
             "data_source.source.reasoning_effort"),
            ({"type": "responses", "source": {"type": "responses", "users": "u1"}}, "data_source.source.users"),
            ({"type": "responses", "source": {"type": "responses", "temperature": "hot"}},
             "data_source.source.temperature"),
            ({"type": "completions", "source": {"type": "responses"}}, "data_source.source.type")):
        with pytest.raises(openai.BadRequestError) as e:
            client.evals.runs.create(ev.id, data_source=data_source)
        assert e.value.body["param"] == param


def test_a_responses_run_samples_through_the_responses_api(client):
    """A ``responses`` run: each item's conversation sent to the Responses API (the same sampling), its reply text
    graded; the samples are what ``client.responses.create`` gives the same input."""
    ev = client.evals.create(data_source_config=CONFIG, testing_criteria=[CLOSE])
    run = _finished(client, ev.id, client.evals.runs.create(ev.id, data_source={
        "type": "responses", "model": BASE, "sampling_params": {"temperature": 0.0, "max_completion_tokens": 5},
        "source": {"type": "file_content", "content": [{"item": i} for i in ITEMS[:2]]},
        "input_messages": {"type": "template", "template": [{"role": "user", "content": "{{ item.q }}"}]}}).id)
    assert run.status == "completed", run.error
    for x, item in zip(_items(client, ev.id, run.id), ITEMS):
        reply = client.responses.create(model=BASE, input=[{"role": "user", "content": item["q"]}], temperature=0,
                                        max_output_tokens=5)
        assert x.sample.output[0].content == reply.output_text and x.sample.model == BASE
        assert x.sample.usage.completion_tokens == reply.usage.output_tokens
        assert x.results[0].score == pytest.approx(fuzz.ratio(reply.output_text, item["answer"]) / 100, abs=1e-12)
    usage = run.per_model_usage[0]
    assert (usage.run_model_name, usage.invocation_count) == (BASE, 2)
