"""``--reasoning-parser`` on a live server, with the ``openai`` client: a Qwen3 model's ``<think>`` reasoning comes
apart from its reply (``reasoning_content``), whole and streamed, counted in ``usage``, and a structured output
constrains only the reply after it.

The random-weight model does not reason; a LoRA adapter trained here for a few seconds (``coserve finetune``) makes
it answer two questions with ``<think>...</think>`` and a reply, as a reasoning model does.
"""

from __future__ import annotations

import json

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from server_helpers import start_server, train_replies, wait_for_job

THOUGHT, ANSWER = "Two and two make four.", "The answer is 4."
TWO = [{"role": "user", "content": "What is 2+2?"}]
COLOUR = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def thinker(model_factory, tmp_path_factory):
    """The tiny Qwen3 model and an adapter that thinks before it answers."""
    pairs = [(TWO, f"<think>{THOUGHT}</think>{ANSWER}"), (COLOUR, "<think>Pick one.</think>Blue.")]
    model = model_factory("qwen3")
    return model, train_replies(model, pairs, tmp_path_factory.mktemp("reasoning") / "think")


@pytest.fixture(scope="module")
def server(thinker, tmp_path_factory):
    model, adapter = thinker
    srv = start_server(model, tmp_path_factory.mktemp("reasoning-state") / "state", "--reasoning-parser", "qwen3",
                       "--adapter", f"think={adapter}")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def _tokens(model, text: str) -> int:
    return len(AutoTokenizer.from_pretrained(str(model))(text, add_special_tokens=False)["input_ids"])


def test_the_reasoning_comes_apart_from_the_reply_whole_and_streamed(client, thinker):
    whole = client.chat.completions.create(model="think", messages=TWO, max_tokens=40, temperature=0)
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == THOUGHT  # both vLLM names
    assert message.content == ANSWER and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens_details.reasoning_tokens == _tokens(thinker[0], f"<think>{THOUGHT}</think>")
    assert whole.usage.completion_tokens > whole.usage.completion_tokens_details.reasoning_tokens

    chunks = list(client.chat.completions.create(model="think", messages=TWO, max_tokens=40, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = [d.model_extra.get("reasoning_content") or "" for d in deltas]
    assert thought == [d.model_extra.get("reasoning") or "" for d in deltas]
    said = [d.content or "" for d in deltas]
    assert "".join(thought) == THOUGHT and "".join(said) == ANSWER
    assert sum(bool(t) for t in thought) > 3  # the reasoning streamed as it was written
    last_thought = max(i for i, t in enumerate(thought) if t)
    assert not any(said[:last_thought + 1])  # the reply after it
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == \
        whole.usage.completion_tokens_details.reasoning_tokens


def test_include_reasoning_false_leaves_the_reasoning_out(client, thinker):
    """vLLM's ``include_reasoning``: False sends the reply alone, whole and streamed; the reasoning is still split
    off it and counted."""
    ask = dict(model="think", messages=TWO, max_tokens=40, temperature=0, extra_body={"include_reasoning": False})
    whole = client.chat.completions.create(**ask)
    message = whole.choices[0].message
    assert message.content == ANSWER and not {"reasoning_content", "reasoning"} & set(message.model_extra or {})
    assert whole.usage.completion_tokens_details.reasoning_tokens == _tokens(thinker[0], f"<think>{THOUGHT}</think>")
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**ask, stream=True) if c.choices]
    assert "".join(d.content or "" for d in deltas) == ANSWER
    assert not any({"reasoning_content", "reasoning"} & set(d.model_extra or {}) for d in deltas)


def test_a_reply_without_reasoning_is_all_content(client):
    """The base model never opens <think>: with the qwen3 parser its whole reply is content, none of it reasoning."""
    whole = client.chat.completions.create(model=client.models.list().data[0].id, messages=TWO, max_tokens=12,
                                           temperature=0)
    message = whole.choices[0].message
    assert not {"reasoning_content", "reasoning"} & set(message.model_extra or {}) and message.content
    assert whole.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_prompt_that_opens_the_reasoning_makes_the_output_reasoning_until_it_ends(client):
    """An assistant message left open with ``<think>`` (continue_final_message, as templates that open it in the
    prompt do): the output, which then has no <think> of its own, is reasoning up to </think>."""
    messages = [*TWO, {"role": "assistant", "content": "<think>"}]
    whole = client.chat.completions.create(model="think", messages=messages, max_tokens=40, temperature=0,
                                           extra_body={"continue_final_message": True,
                                                       "add_generation_prompt": False})
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == THOUGHT and message.content == ANSWER


def test_a_structured_output_constrains_only_the_reply_after_the_reasoning(client):
    """The guide lets the model open and finish its reasoning freely, then holds the reply to the choices."""
    whole = client.chat.completions.create(model="think", messages=TWO, max_tokens=40, temperature=0,
                                           extra_body={"guided_choice": ["yes", "no", "maybe"]})
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == THOUGHT
    assert message.content in ("yes", "no", "maybe")
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 8}}, "required": ["colour"],
              "additionalProperties": False}
    reply = client.chat.completions.create(
        model="think", messages=COLOUR, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    assert reply.choices[0].message.model_extra["reasoning_content"] == "Pick one."
    assert set(json.loads(reply.choices[0].message.content)) == {"colour"}


def test_a_tokenizer_without_the_tags_as_tokens_is_refused_at_start(model_factory, tmp_path, capsys):
    """A model whose tokenizer spells ``<think>`` in several tokens cannot be served with a reasoning parser: the
    server says so and does not start."""
    import shutil

    from coserve.cli import main
    model = tmp_path / "model"
    shutil.copytree(model_factory("qwen3"), model)
    spec = json.loads((model / "tokenizer.json").read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in ("<think>", "</think>")]
    (model / "tokenizer.json").write_text(json.dumps(spec))
    assert main(["serve", "--model", str(model), "--state-dir", str(tmp_path / "state"), "--device", "cpu",
                 "--reasoning-parser", "deepseek_r1"]) == 2
    assert "--reasoning-parser deepseek_r1: the model's tokenizer has no single token for '<think>'" in \
        capsys.readouterr().err


def _events(stream) -> list:
    return list(stream)


def test_the_responses_api_puts_the_reasoning_in_an_item_of_its_own(client, thinker):
    """A ``reasoning`` item (``reasoning_text``) before the message, whole and streamed (its events at output index
    0, the message's at 1), and the reasoning's tokens in ``usage``; ``output_text`` is the reply alone."""
    whole = client.responses.create(model="think", input="What is 2+2?", max_output_tokens=40, temperature=0)
    assert [o.type for o in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == THOUGHT and whole.output[0].status == "completed"
    assert whole.output_text == ANSWER
    assert whole.usage.output_tokens_details.reasoning_tokens == _tokens(thinker[0], f"<think>{THOUGHT}</think>")
    scored = client.responses.create(model="think", input="What is 2+2?", max_output_tokens=40, temperature=0,
                                     include=["message.output_text.logprobs"])
    tokens = [t.token for t in scored.output[1].content[0].logprobs]  # the reply's alone, after the reasoning
    assert len(tokens) == scored.usage.output_tokens - scored.usage.output_tokens_details.reasoning_tokens
    assert "".join(tokens).startswith(ANSWER)

    events = _events(client.responses.create(model="think", input="What is 2+2?", max_output_tokens=40,
                                             temperature=0, stream=True))
    kinds = [e.type for e in events]
    thought = [e for e in events if e.type == "response.reasoning_text.delta"]
    said = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in thought) == THOUGHT and {e.output_index for e in thought} == {0}
    assert "".join(e.delta for e in said) == ANSWER and {e.output_index for e in said} == {1}
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.done"]
    assert added == ["reasoning", "message"] and done == [(0, "reasoning"), (1, "message")]
    final = events[-1].response
    assert final.output[0].content[0].text == THOUGHT and final.output_text == ANSWER
    assert final.output[0].id == events[kinds.index("response.output_item.added")].item.id


def test_a_named_tool_call_follows_the_reasoning(client):
    """tool_choice naming a function: the model reasons freely, then the guide writes the call's arguments, which
    come as the item after the reasoning (index 1), whole and streamed."""
    tool = {"type": "function", "name": "answer", "parameters": {
        "type": "object", "properties": {"value": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["value"], "additionalProperties": False}}
    whole = client.responses.create(model="think", input="What is 2+2?", max_output_tokens=60, temperature=0,
                                    tools=[tool], tool_choice={"type": "function", "name": "answer"})
    assert [o.type for o in whole.output] == ["reasoning", "function_call"]
    assert whole.output[0].content[0].text == THOUGHT
    assert set(json.loads(whole.output[1].arguments)) == {"value"}
    events = _events(client.responses.create(model="think", input="What is 2+2?", max_output_tokens=60,
                                             temperature=0, tools=[tool],
                                             tool_choice={"type": "function", "name": "answer"}, stream=True))
    pieces = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(e.delta for e in pieces) == whole.output[1].arguments and {e.output_index for e in pieces} == {1}
    assert [o.type for o in events[-1].response.output] == ["reasoning", "function_call"]


def test_required_tool_calls_follow_the_reasoning_on_both_apis(client):
    """tool_choice 'required': the reasoning, then the calls the guide writes; on the chat API the reasoning is the
    message's reasoning_content beside its tool_calls, on the Responses API an item before the calls."""
    params = {"type": "object", "properties": {"value": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["value"], "additionalProperties": False}
    chat = client.chat.completions.create(
        model="think", messages=TWO, max_tokens=80, temperature=0, tool_choice="required", parallel_tool_calls=False,
        tools=[{"type": "function", "function": {"name": "answer", "parameters": params}}])
    message = chat.choices[0].message
    assert message.model_extra["reasoning_content"] == THOUGHT and chat.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in message.tool_calls] == ["answer"]
    stream = list(client.chat.completions.create(
        model="think", messages=TWO, max_tokens=80, temperature=0, tool_choice="required", parallel_tool_calls=False,
        stream=True, tools=[{"type": "function", "function": {"name": "answer", "parameters": params}}]))
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == THOUGHT
    arguments = "".join(t.function.arguments or "" for d in deltas for t in d.tool_calls or [])
    assert arguments == message.tool_calls[0].function.arguments

    tool = {"type": "function", "name": "answer", "parameters": params}
    events = _events(client.responses.create(model="think", input="What is 2+2?", max_output_tokens=80, temperature=0,
                                             tools=[tool], tool_choice="required", stream=True,
                                             parallel_tool_calls=False))
    done = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.done"]
    assert done == [(0, "reasoning"), (1, "function_call")]
    assert [o.type for o in events[-1].response.output] == ["reasoning", "function_call"]


def test_a_reinforcement_jobs_grader_reads_the_reply_after_the_reasoning(client, server, thinker):
    """A reinforcement job on a server with a reasoning parser: its grader reads the reply after the reasoning
    (OpenAI's graders read a reasoning model's output text), and ``rollouts.jsonl`` shows both parts. A prompt whose
    last tag opens ``<think>`` makes the whole output reasoning, so the reply graded is empty; one that closed it makes
    the whole output the reply."""
    import io

    opened, closed = "Two and two?<think>", "Two and two?<think>Easy.</think>"
    data = "".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in (opened, closed)).encode()
    training = client.files.create(file=("prompts.jsonl", io.BytesIO(data)), purpose="fine-tune")
    empty = {"type": "string_check", "name": "empty", "input": "{{ sample.output_text }}", "reference": "",
             "operation": "eq"}
    job = client.fine_tuning.jobs.create(
        model=thinker[0].name, training_file=training.id, seed=5,
        method={"type": "reinforcement", "reinforcement": {"grader": empty, "hyperparameters": {
            "n_epochs": 1, "batch_size": 2}}},
        extra_body={"coserve": {"num_generations": 2, "max_completion_tokens": 6, "r": 2,
                                "target_modules": ["q_proj"]}})
    done = wait_for_job(client, job.id)
    assert done.status == "succeeded", done.error
    rollouts = [json.loads(x) for x in
                (server.state_dir / "jobs" / job.id / "model" / "rollouts.jsonl").read_text().splitlines()]
    assert sorted(r["prompt_line"] for r in rollouts) == [1, 1, 2, 2]
    for r in rollouts:
        assert r["completion"]  # random text: a grader reading all of it would never see ""
        if r["prompt_line"] == 1:
            assert (r["reasoning"], r["reply"], r["reward"]) == (r["completion"], "", 1.0)
        else:
            assert (r["reasoning"], r["reply"], r["reward"]) == (None, r["completion"], 0.0)
    metrics = [e.data for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data if e.type == "metrics"]
    assert [m["train_reward_mean"] for m in metrics] == [0.5]


def test_a_model_grader_on_a_reasoning_model_reasons_before_its_label(client, thinker):
    """A label model grader whose model reasons (the adapter that thinks before it answers 2+2): the label's guide
    starts after the reasoning, so the model writes its ``<think>`` first and the grader reads the label after it,
    as the chat API's structured outputs do; the reasoning counts in the grader's token usage."""
    grader = {"type": "label_model", "name": "judge", "model": "think", "labels": ["yes", "no"],
              "passing_labels": ["yes"], "input": TWO}
    run = client.fine_tuning.alpha.graders.run(grader=grader, model_sample="4")
    assert not any(v for k, v in run.metadata.errors.model_dump().items() if k.endswith("error"))
    assert run.reward in (0.0, 1.0)
    used = run.model_grader_token_usage_per_model["think"]
    assert used["completion_tokens"] > _tokens(thinker[0], f"<think>{THOUGHT}</think>")  # the reasoning, then a label


def test_a_conversation_given_back_with_its_reasoning_items_is_answered_as_without_them(client):
    """A client that keeps the conversation itself appends each response's ``output``, reasoning item included, to
    its next ``input``: the item is read and dropped (as reasoning models' chat templates drop earlier turns'
    reasoning), so the next reply is the one the same conversation without it gets."""
    first = client.responses.create(model="think", input="What is 2+2?", max_output_tokens=40, temperature=0)
    earlier = [o.model_dump(exclude_none=True) for o in first.output]
    assert earlier[0]["type"] == "reasoning"
    asked = {"role": "user", "content": "Name a colour."}
    kept = client.responses.create(model="think", input=[{"role": "user", "content": "What is 2+2?"}, *earlier, asked],
                                   max_output_tokens=20, temperature=0)
    without = client.responses.create(model="think", input=[{"role": "user", "content": "What is 2+2?"},
                                                            *earlier[1:], asked], max_output_tokens=20, temperature=0)
    assert kept.output_text == without.output_text and kept.usage.input_tokens == without.usage.input_tokens
