"""OpenAI's grader endpoints on a live server through the official ``openai`` client: graders validated (errors
naming the field) and run on a model sample against an item, with OpenAI's response shape and its error flags."""

from __future__ import annotations

import json
from types import SimpleNamespace

import openai
import pytest
from openai import OpenAI

from coserve.server.errors import APIError
from coserve.server.graders_api import checked_grader
from server_helpers import API_KEYS

EXACT = {"type": "string_check", "name": "exact", "input": "{{ sample.output_text }}",
         "reference": "{{ item.answer }}", "operation": "eq"}
CLOSE = {"type": "text_similarity", "name": "close", "input": "{{ sample.output_text }}",
         "reference": "{{ item.answer }}", "evaluation_metric": "fuzzy_match"}
PYTHON = {"type": "python", "name": "digits",
          "source": "def grade(sample, item):\n    text = sample['output_text']\n"
                    "    return sum(c.isdigit() for c in text) / len(text)\n"}


@pytest.fixture(scope="module")
def graders(api_server):
    return OpenAI(base_url=f"{api_server.url}/v1", api_key=API_KEYS["alice"], max_retries=0,
                  timeout=60).fine_tuning.alpha.graders


def test_graders_run_on_a_sample_and_an_item(graders):
    item = {"answer": "Paris"}
    assert graders.run(grader=EXACT, model_sample="Paris", item=item).reward == 1.0
    run = graders.run(grader=CLOSE, model_sample="Pari", item=item)
    assert run.reward == pytest.approx(8 / 9)
    assert run.metadata.name == "close" and run.metadata.type == "text_similarity"
    assert not any(v for k, v in run.metadata.errors.model_dump().items() if k.endswith("_error"))
    multi = {"type": "multi", "name": "both", "graders": {"exact": EXACT, "close": CLOSE},
             "calculate_output": "0.5 * exact + 0.5 * close"}
    run = graders.run(grader=multi, model_sample="Pari", item=item)
    assert run.reward == pytest.approx(4 / 9)
    assert run.sub_rewards == pytest.approx({"exact": 0.0, "close": 8 / 9})
    assert graders.run(grader=PYTHON, model_sample="a1b2", item={}).reward == 0.5  # python graders are on


def test_a_sample_that_cannot_be_graded_scores_0_with_the_reason(graders):
    run = graders.run(grader=EXACT, model_sample="Paris", item={"question": "?"})
    assert run.reward == 0.0 and run.metadata.errors.invalid_variable_error
    run = graders.run(grader=PYTHON, model_sample="", item={})
    assert run.reward == 0.0 and run.metadata.errors.python_grader_runtime_error
    assert "ZeroDivisionError" in run.metadata.errors.python_grader_runtime_error_details
    formula = {"type": "multi", "name": "ratio", "graders": {"exact": EXACT}, "calculate_output": "1 / exact"}
    run = graders.run(grader=formula, model_sample="Lyon", item={"answer": "Paris"})
    assert run.reward == 0.0 and run.metadata.errors.other_error


def test_graders_are_validated_naming_the_field(graders):
    assert graders.validate(grader=CLOSE).grader.name == "close"
    bad = dict(CLOSE, evaluation_metric="meteor")
    with pytest.raises(openai.BadRequestError) as err:
        graders.validate(grader=bad)
    assert err.value.body["param"] == "grader.evaluation_metric" and "WordNet" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        graders.run(grader=dict(EXACT, reference="{{ answer }}"), model_sample="x")
    assert err.value.body["param"] == "grader.reference"
    with pytest.raises(openai.BadRequestError) as err:
        graders.run(grader={"type": "score_model", "name": "judge", "model": "x", "input": []}, model_sample="x")
    assert err.value.body["param"] == "grader.input"
    with pytest.raises(openai.BadRequestError) as err:  # a model the caller may not use (bob's, or none)
        graders.validate(grader={"type": "multi", "name": "m", "calculate_output": "j",
                                 "graders": {"j": dict(LABEL, model="ft:tiny-llama::ftjob-000000000000000000000000")}})
    assert err.value.body["param"] == "grader.graders.j.model" and err.value.body["code"] == "model_not_found"


BASE = "tiny-llama"
LABEL = {"type": "label_model", "name": "tone", "model": BASE, "labels": ["kind", "rude", "flat"],
         "passing_labels": ["kind", "flat"],
         "input": [{"role": "developer", "content": "Label the reply's tone."},
                   {"role": "user", "content": [{"type": "input_text", "text": "Reply to {{ item.q }}: "},
                                                {"type": "output_text", "text": "{{ sample.output_text }}"}]}]}
SCORE = {"type": "score_model", "name": "stars", "model": BASE, "range": [0, 100],
         "sampling_params": {"max_completions_tokens": 24}, "input": LABEL["input"]}


def _judged_by_chat(api_server, grader: dict, guide: dict, samples: list[str]) -> list[str]:
    """What the grader's model says to each sample's conversation through the chat API (greedy, the same guide)."""
    chat = OpenAI(base_url=f"{api_server.url}/v1", api_key=API_KEYS["alice"], max_retries=0, timeout=60).chat
    texts = []
    for sample in samples:
        messages = [{"role": "system", "content": "Label the reply's tone."},
                    {"role": "user", "content": f"Reply to why?: {sample}"}]
        reply = chat.completions.create(model=grader["model"], messages=messages, temperature=0,
                                        max_tokens=grader.get("sampling_params", {}).get("max_completions_tokens",
                                                                                         64), extra_body=guide)
        texts.append((reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage))
    return texts


def test_model_graders_ask_the_served_model_as_a_chat_request_would(graders, api_server):
    samples = ["fine.", "no!", "ok", "thanks a lot"]
    labels = _judged_by_chat(api_server, LABEL, {"guided_choice": LABEL["labels"]}, samples)
    for sample, (label, _, usage) in zip(samples, labels):
        run = graders.run(grader=LABEL, model_sample=sample, item={"q": "why?"})
        assert run.reward == (1.0 if label in ("kind", "flat") else 0.0), (sample, label)
        assert not run.metadata.errors.model_grader_parse_error
        assert run.metadata.sampled_model_name == BASE and run.metadata.token_usage == usage.total_tokens
        assert run.model_grader_token_usage_per_model[BASE] == {
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "cached_tokens": 0}
    schema = {"type": "object", "properties": {"result": {"type": "number", "minimum": 0, "maximum": 100}},
              "required": ["result"], "additionalProperties": False}
    replies = _judged_by_chat(api_server, SCORE, {"guided_json": schema}, samples)
    for sample, (text, finish, _) in zip(samples, replies):  # (the tiny model's numbers end within the tokens)
        run = graders.run(grader=SCORE, model_sample=sample, item={"q": "why?"})
        assert finish == "stop" and run.reward == json.loads(text)["result"]
        assert not run.metadata.errors.model_grader_parse_error
    run = graders.run(grader=LABEL, model_sample="x", item={})
    assert run.reward == 0.0 and run.metadata.errors.invalid_variable_error


def test_without_the_flag_python_graders_are_refused():
    ctx = SimpleNamespace(config=SimpleNamespace(python_graders=False), models=None)
    with pytest.raises(APIError) as err:
        checked_grader(PYTHON, ctx, "alice")
    assert err.value.status == 400 and err.value.param == "grader.type" and "--python-graders" in str(err.value)
    assert checked_grader(CLOSE, ctx, "alice").name == "close"


def test_grader_endpoints_need_a_key(api_server):
    anonymous = OpenAI(base_url=f"{api_server.url}/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        anonymous.fine_tuning.alpha.graders.validate(grader=EXACT)
