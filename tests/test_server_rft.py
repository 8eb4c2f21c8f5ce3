"""Reinforcement fine-tuning jobs (OpenAI's ``method: {"type": "reinforcement"}``) on a live server through the
official ``openai`` client: a file of prompts with reference answers, a grader, the job co-served with chat to a
servable model whose adapter is the one ``LLM.finetune``'s GRPO trains with the same grader and seed; bad requests
refused naming the field; cancel, pause and resume; a server killed mid-job resumes it exactly."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest
from openai import OpenAI

from coserve import LLM, FinetuneConfig, LoraConfig
from coserve.finetune.graders import grader_reward, parse_grader
from coserve.peft.adapter_dir import read_adapter_tensors
from server_helpers import API_KEYS, refused_job, start_server, wait_for_job

BASE = "tiny-llama"
ANSWERS = [("Count to three.", "1 2 3"), ("Name a colour.", "red"), ("Say hello.", "hello"), ("Spell cat.", "c a t")]
GRADER = {"type": "text_similarity", "name": "close", "evaluation_metric": "fuzzy_match",
          "input": "{{ sample.output_text }}", "reference": "{{ item.answer }}"}
HYPER = {"n_epochs": 2, "batch_size": 2, "learning_rate_multiplier": 50}  # 4 steps; lr 50 x 1e-4
COSERVE = {"num_generations": 2, "max_completion_tokens": 5, "r": 4, "target_modules": ["q_proj", "down_proj"]}


VALID = [("Count to two.", "1 2"), ("Say bye.", "bye")]
LABEL = {"type": "label_model", "name": "judge", "model": BASE, "labels": ["right", "wrong", "unsure", "maybe"],
         "passing_labels": ["right", "unsure"],
         "input": [{"role": "user", "content": "Expected {{ item.answer }}, got {{ sample.output_text }}"}]}


def _prompts(records=ANSWERS) -> bytes:
    return "".join(json.dumps({"messages": [{"role": "user", "content": q}], "answer": a}) + "\n"
                   for q, a in records).encode()


@pytest.fixture(scope="module")
def client(api_server):
    return OpenAI(base_url=f"{api_server.url}/v1", api_key=API_KEYS["alice"], max_retries=0, timeout=60)


def _upload(client, data: bytes):
    return client.files.create(file=("prompts.jsonl", io.BytesIO(data)), purpose="fine-tune")


@pytest.fixture(scope="module")
def oracle(model_factory, tmp_path_factory):
    """``oracle(copies)``: the GRPO run a reinforcement job of ``HYPER`` on ``ANSWERS * copies`` should be, through
    the Python API with the grader as its reward and ``VALID`` as its validation prompts: its completions' token ids
    in order, its adapter, and its validations' lines."""
    llm = LLM(model_factory("llama"), dtype="float32", device="cpu")
    runs = {}

    def run(copies: int = 1):
        if copies not in runs:
            out = tmp_path_factory.mktemp("rft-oracle")
            data = out / "prompts.jsonl"
            data.write_bytes(_prompts(ANSWERS * copies))
            (out / "valid.jsonl").write_bytes(_prompts(VALID))
            cfg = FinetuneConfig(output_dir=str(out / "local"), method="grpo", epochs=2, batch_size=4, lr=50e-4,
                                 seed=11, num_generations=2, max_completion_tokens=5)
            handle = llm.finetune(str(data), peft=LoraConfig(r=4, target_modules=["q_proj", "down_proj"]),
                                  config=cfg, reward_funcs=[grader_reward(parse_grader(GRADER))],
                                  validation=str(out / "valid.jsonl"))
            assert handle.wait(300)["status"] == "succeeded"
            local = [json.loads(x) for x in (out / "local" / "rollouts.jsonl").read_text().splitlines()]
            valid = [json.loads(x) for x in (out / "local" / "grpo_valid.jsonl").read_text().splitlines()]
            runs[copies] = [r["completion_token_ids"] for r in local], read_adapter_tensors(out / "local"), valid
        return runs[copies]

    return run


def _create(client, training, hyper=None, grader=GRADER, validation=None, **coserve):
    method = {"type": "reinforcement", "reinforcement": {"grader": grader, "hyperparameters": hyper or {}}}
    return client.fine_tuning.jobs.create(model=BASE, training_file=training.id, seed=11, method=method,
                                          extra_body={"coserve": {**COSERVE, **coserve}},
                                          **({"validation_file": validation.id} if validation else {}))


def test_a_reinforcement_job_trains_what_llm_finetune_trains_while_chat_is_served(client, api_server, oracle):
    training = _upload(client, _prompts())
    job = _create(client, training, HYPER, validation=_upload(client, _prompts(VALID)))
    assert job.method.reinforcement.hyperparameters.eval_interval == "auto"
    assert job.method.type == "reinforcement" and job.method.reinforcement.grader.name == "close"
    messages = [{"role": "user", "content": "Say hello."}]
    while client.fine_tuning.jobs.retrieve(job.id).status in ("validating_files", "queued", "running"):
        reply = client.chat.completions.create(model=BASE, messages=messages, max_tokens=3)  # served meanwhile
        assert reply.choices[0].finish_reason in ("length", "stop")
    done = wait_for_job(client, job.id)
    assert done.status == "succeeded", done.error
    metrics = sorted((e.data for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data
                      if e.type == "metrics"), key=lambda m: m["step"])
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    model_dir = api_server.state_dir / "jobs" / job.id / "model"
    rollouts = [json.loads(x) for x in (model_dir / "rollouts.jsonl").read_text().splitlines()]
    for m in metrics:  # each step's mean reward is its rollouts' (4 completions: 2 prompts x 2)
        step = [r["reward"] for r in rollouts if r["step"] == m["step"]]
        assert len(step) == 4 and m["train_reward_mean"] == pytest.approx(sum(step) / 4)
        assert m["rewards/close"] == pytest.approx(m["train_reward_mean"])
        assert m["scores"]["graders"] == [{"name": "close", "type": "text_similarity", "train_reward_mean":
                                           m["train_reward_mean"], **({"valid_reward_mean": m["valid_reward_mean"]}
                                                                      if "valid_reward_mean" in m else {})}]
        timing = m["timing"]["step"]
        assert {"sampling", "grading", "training"} <= set(timing) and all(v >= 0 for v in timing.values())
        assert ("eval" in timing) == ("valid_reward_mean" in m) and m["total_steps"] == 4
    assert [("valid_reward_mean" in m) for m in metrics] == [False, True, False, True]  # at each checkpoint
    valid = [json.loads(x) for x in (model_dir / "grpo_valid.jsonl").read_text().splitlines()]
    for m, v in zip(metrics[1::2], valid):  # 2 validation prompts, 1 completion each ("auto")
        assert v["step"] == m["step"] and len(v["samples"]) == 2
        assert m["valid_reward_mean"] == m["full_valid_mean_reward"] == pytest.approx(
            sum(x["reward"] for x in v["samples"]) / 2)
    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert sorted(c.step_number for c in checkpoints) == [2, 4]  # each epoch's end
    assert all(c.metrics.model_extra["valid_reward_mean"] is not None for c in checkpoints)
    tuned = client.chat.completions.create(model=done.fine_tuned_model, messages=messages, max_tokens=4)
    assert tuned.model == done.fine_tuned_model and tuned.usage.completion_tokens > 0

    completions, adapter, oracle_valid = oracle()
    assert [r["completion_token_ids"] for r in rollouts] == completions
    _assert_close(read_adapter_tensors(model_dir), adapter)
    assert [[x["completion_token_ids"] for x in v["samples"]] for v in valid] == [
        [x["completion_token_ids"] for x in v["samples"]] for v in oracle_valid]
    assert [v["valid_reward"] for v in valid] == pytest.approx([v["valid_reward"] for v in oracle_valid], abs=1e-12)


def test_a_reinforcement_job_graded_by_a_label_model_asks_the_served_model(client, api_server):
    """A label_model grader naming the base model: each rollout's reward is the label the model gives the
    grader's conversation, as a chat request with the same guide gets it, while the job trains on the rewards."""
    job = _create(client, _upload(client, _prompts()), {"n_epochs": 1, "batch_size": 2}, grader=LABEL)
    done = wait_for_job(client, job.id)
    assert done.status == "succeeded", done.error
    model_dir = api_server.state_dir / "jobs" / job.id / "model"
    rollouts = [json.loads(x) for x in (model_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 8
    said, tokens = [], {1: [0, 0], 2: [0, 0]}
    for r in rollouts:
        messages = [{"role": "user", "content": f"Expected {ANSWERS[r['prompt_line'] - 1][1]}, got {r['completion']}"}]
        reply = client.chat.completions.create(model=BASE, messages=messages, temperature=0, max_tokens=64,
                                               extra_body={"guided_choice": LABEL["labels"]})
        said.append(reply.choices[0].message.content)
        tokens[r["step"]][0] += reply.usage.prompt_tokens
        tokens[r["step"]][1] += reply.usage.completion_tokens
    assert [r["reward"] for r in rollouts] == [1.0 if x in ("right", "unsure") else 0.0 for x in said]
    assert 0 < sum(r["reward"] for r in rollouts) < 8
    metrics = sorted((e.data for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data
                      if e.type == "metrics"), key=lambda m: m["step"])
    assert len(metrics) == 2 and all("grading_errors" not in m for m in metrics)
    assert [m["model_graders_token_usage"] for m in metrics] == [
        {BASE: {"train_prompt_tokens": p, "train_completion_tokens": c}} for p, c in tokens.values()]

    cut = {"type": "score_model", "name": "stars", "model": BASE, "input": LABEL["input"],
           "sampling_params": {"max_completions_tokens": 2}}  # '{"result":' needs more: every sample unreadable
    done = wait_for_job(client, _create(client, _upload(client, _prompts()), {"n_epochs": 1, "batch_size": 2},
                                        grader=cut).id)
    assert done.status == "succeeded", done.error  # scored 0 each, and counted
    metrics = [e.data for e in client.fine_tuning.jobs.list_events(done.id, limit=100).data if e.type == "metrics"]
    assert [m["grading_errors"] for m in metrics] == [{"stars/model_grader_parse_error": 4}] * 2
    assert all(m["train_reward_mean"] == 0 for m in metrics)
    assert [m["errors"]["graders"] for m in metrics] == [[{
        "name": "stars", "type": "score_model", "train_model_grader_parse_error_count": 4,
        "train_model_grader_parse_error_mean": 1.0}]] * 2  # OpenAI's shape: 4 of the step's 4 samples


def test_a_reinforcement_job_on_a_fine_tuned_model_samples_that_model(client, api_server):
    """``model`` one of the caller's fine-tuned models: the job trains on from its adapter, so its first rollouts
    are that model's samples (the chat API's with the same seeds), not the base model's."""
    from coserve.peft.dropout import mix_seed
    first = wait_for_job(client, _create(client, _upload(client, _prompts()), {"n_epochs": 1, "batch_size": 2}).id)
    assert first.status == "succeeded", first.error
    job = client.fine_tuning.jobs.create(model=first.fine_tuned_model, training_file=_upload(client, _prompts()).id,
                                         seed=11, method={"type": "reinforcement", "reinforcement": {
                                             "grader": GRADER, "hyperparameters": {"n_epochs": 1, "batch_size": 2}}},
                                         extra_body={"coserve": {"num_generations": 2, "max_completion_tokens": 5}})
    done = wait_for_job(client, job.id)
    assert done.status == "succeeded", done.error
    events = client.fine_tuning.jobs.list_events(job.id, limit=100).data
    assert any(f"started from {first.fine_tuned_model}" in e.message for e in events)
    model_dir = api_server.state_dir / "jobs" / job.id / "model"
    rollouts = [json.loads(x) for x in (model_dir / "rollouts.jsonl").read_text().splitlines() if '"step": 1,' in x]

    def samples(model: str) -> list[str]:
        texts = []
        for group in (0, 1):
            line = next(r["prompt_line"] for r in rollouts if r["group"] == group)
            reply = client.chat.completions.create(model=model, messages=[{"role": "user",
                                                                          "content": ANSWERS[line - 1][0]}],
                                                   n=2, seed=mix_seed(11, 0, group), temperature=1.0, max_tokens=5)
            texts += [c.message.content for c in reply.choices]
        return texts

    assert [r["completion"] for r in rollouts] == samples(first.fine_tuned_model)
    assert samples(BASE) != samples(first.fine_tuned_model)


def test_a_reinforcement_job_with_a_response_format_samples_json_its_grader_reads(client, api_server):
    """``response_format``: every rollout is sampled under the schema (as the chat API samples with it, same seeds)
    and the grader reads its field as ``sample.output_json``."""
    from rapidfuzz import fuzz

    from coserve.peft.dropout import mix_seed
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 6}}, "required": ["answer"],
              "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "reply", "strict": True, "schema": schema}}
    grader = dict(GRADER, input="{{ sample.output_json.answer }}")
    method = {"type": "reinforcement", "reinforcement": {"grader": grader, "response_format": response_format,
                                                         "hyperparameters": {"n_epochs": 1, "batch_size": 2}}}
    job = client.fine_tuning.jobs.create(model=BASE, training_file=_upload(client, _prompts()).id, seed=11,
                                         method=method, extra_body={"coserve": {**COSERVE,
                                                                                "max_completion_tokens": 24}})
    assert job.method.reinforcement.model_extra["response_format"] == response_format
    done = wait_for_job(client, job.id)
    assert done.status == "succeeded", done.error
    model_dir = api_server.state_dir / "jobs" / job.id / "model"
    rollouts = [json.loads(x) for x in (model_dir / "rollouts.jsonl").read_text().splitlines()]
    for r in rollouts:
        answer = json.loads(r["completion"])["answer"] if r["finish_reason"] == "stop" else None
        assert r["reward"] == (0.0 if answer is None else
                               pytest.approx(fuzz.ratio(answer, ANSWERS[r["prompt_line"] - 1][1]) / 100, abs=1e-12))
    assert sum(r["finish_reason"] == "stop" for r in rollouts) >= 4
    texts = []
    for group in (0, 1):
        line = next(r["prompt_line"] for r in rollouts if r["step"] == 1 and r["group"] == group)
        reply = client.chat.completions.create(model=BASE, messages=[{"role": "user",
                                                                      "content": ANSWERS[line - 1][0]}],
                                               n=2, seed=mix_seed(11, 0, group), temperature=1.0, max_tokens=24,
                                               response_format=response_format)
        texts += [c.message.content for c in reply.choices]
    assert [r["completion"] for r in rollouts if r["step"] == 1] == texts
    bad = dict(method["reinforcement"], response_format={"type": "json_schema",
                                                         "json_schema": {"name": "r", "schema": {"type": "thing"}}})
    with pytest.raises(openai.BadRequestError) as e:
        client.fine_tuning.jobs.create(model=BASE, training_file=job.training_file,
                                       method={"type": "reinforcement", "reinforcement": bad})
    assert e.value.body["param"] == "method.reinforcement.response_format", e.value.body


def _assert_close(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        assert float((got[name] - expected[name]).norm() / expected[name].norm()) <= 1e-5, name


def test_sigkill_mid_reinforcement_job_then_resume(model_factory, tmp_path, oracle):
    """A server killed in the middle of a reinforcement job: restarted on the same state directory, the job goes on
    from its last whole step and ends with the completions and adapter of a run that never stopped, every step's
    event recorded once."""
    state = tmp_path / "state"
    srv = start_server(model_factory("llama"), state, "--served-model-name", BASE)
    try:
        c = OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
        job = _create(c, _upload(c, _prompts(ANSWERS * 4)), HYPER)  # 16 steps: the kill comes in the middle
        deadline = time.monotonic() + 120
        while not [e for e in c.fine_tuning.jobs.list_events(job.id, limit=100).data if e.type == "metrics"]:
            assert time.monotonic() < deadline and c.fine_tuning.jobs.retrieve(job.id).status != "failed"
        srv.crash()
    finally:
        srv.stop(kill=True)
    again = start_server(model_factory("llama"), state, "--served-model-name", BASE)
    try:
        c = OpenAI(base_url=f"{again.url}/v1", api_key="none", max_retries=0, timeout=60)
        done = wait_for_job(c, job.id)
        assert done.status == "succeeded", done.error
        events = list(c.fine_tuning.jobs.list_events(job.id, limit=100))  # every page
        assert any(e.message.startswith("The server restarted") for e in events)
        assert sorted(e.data["step"] for e in events if e.type == "metrics") == list(range(1, 17))
        model_dir = state / "jobs" / job.id / "model"
        rollouts = [json.loads(x) for x in (model_dir / "rollouts.jsonl").read_text().splitlines()]
        completions, adapter, _ = oracle(4)
        assert [r["completion_token_ids"] for r in rollouts] == completions
        _assert_close(read_adapter_tensors(model_dir), adapter)
    finally:
        again.stop()


@pytest.mark.parametrize("method, extra, param", [
    ({"type": "reinforcement"}, {}, "method.reinforcement"),
    ({"type": "reinforcement", "reinforcement": {"grader": dict(GRADER, operation="eq", type="string_check",
                                                                 evaluation_metric=None) | {"operation": "is"}}},
     {}, "method.reinforcement.grader.operation"),
    ({"type": "reinforcement", "reinforcement": {"grader": {"type": "score_model", "name": "judge"}}}, {},
     "method.reinforcement.grader.model"),
    ({"type": "reinforcement", "reinforcement": {"grader": dict(LABEL, model="nobody's")}}, {},
     "method.reinforcement.grader.model"),
    ({"type": "reinforcement", "reinforcement": {"grader": GRADER,
                                                 "hyperparameters": {"reasoning_effort": "high"}}}, {},
     "method.reinforcement.hyperparameters.reasoning_effort"),
    ({"type": "reinforcement", "reinforcement": {"grader": GRADER,
                                                 "hyperparameters": {"compute_multiplier": 100}}}, {},
     "method.reinforcement.hyperparameters.compute_multiplier"),
    ({"type": "reinforcement", "reinforcement": {"grader": GRADER, "hyperparameters": {"eval_interval": 2}}}, {},
     "method.reinforcement.hyperparameters.eval_interval"),
    ({"type": "reinforcement", "reinforcement": {"grader": GRADER, "hyperparameters": {"eval_samples": 0}}},
     {"validation_file": "same"}, "method.reinforcement.hyperparameters.eval_samples"),
    ({"type": "reinforcement", "reinforcement": {"grader": GRADER}, "supervised": {}}, {}, "method.supervised"),
    ({"type": "supervised", "reinforcement": {"grader": GRADER}}, {}, "method.reinforcement"),
    ({"type": "reinforcement", "reinforcement": {"grader": GRADER}},
     {"extra_body": {"coserve": {"num_generations": 1}}}, "coserve.num_generations"),
])
def test_bad_reinforcement_jobs_are_refused_naming_the_field(client, method, extra, param):
    body = refused_job(client, BASE, _upload(client, _prompts()).id, method, extra)
    assert body["param"] == param, body


def test_prompt_files_hold_prompts_and_a_chat_file_fails_a_reinforcement_job_naming_the_line(client):
    with pytest.raises(openai.BadRequestError) as e:
        _upload(client, _prompts() + b'{"messages": [{"role": "user", "content": "a"}, '
                                     b'{"role": "assistant", "content": "b"}]}\n')
    assert "line 5: messages[1]: the prompt ends with an assistant message" in e.value.body["message"]
    chat = _upload(client, b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", '
                           b'"content": "b"}]}\n')
    done = wait_for_job(client, _create(client, chat).id)
    assert done.status == "failed" and done.error.code == "invalid_training_file"
    assert done.error.message.startswith(f"training_file {chat.id}: no valid training example among 1 record; "
                                         "line 1: messages[1]: the prompt ends with an assistant message")  # no path
    done = wait_for_job(client, _create(client, _upload(client, _prompts()), validation=chat).id)
    assert done.status == "failed" and done.error.code == "invalid_validation_file"
    assert done.error.message.startswith(f"validation_file {chat.id}: no valid training example among 1 record; "
                                         "line 1: ")


def test_a_reinforcement_job_pauses_resumes_and_cancels(client):
    training = _upload(client, _prompts(ANSWERS * 8))
    job = _create(client, training, {"n_epochs": 1, "batch_size": 2}, max_completion_tokens=24)
    while not [e for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data if e.type == "metrics"]:
        assert client.fine_tuning.jobs.retrieve(job.id).status in ("validating_files", "queued", "running")
    paused = client.fine_tuning.jobs.pause(job.id)
    assert paused.status == "paused"
    step = paused.model_extra["coserve"]["step"]
    assert step >= 1
    client.fine_tuning.jobs.resume(job.id)
    while True:
        events = client.fine_tuning.jobs.list_events(job.id, limit=100).data
        if len([e for e in events if e.type == "metrics"]) > step:
            break
    assert any(f"resumed at step {step}" in e.message for e in events)
    cancelled = client.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled"
    steps = [e.data["step"] for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data
             if e.type == "metrics"]
    assert sorted(steps) == list(range(1, len(steps) + 1))  # none repeated, none lost
    with pytest.raises(openai.ConflictError):
        client.fine_tuning.jobs.cancel(job.id)
