"""gpt-oss's harmony format on a live server, with the ``openai`` client: ``--reasoning-parser openai_gptoss`` takes
the ``analysis`` message apart from the ``final`` one (``reasoning_content``), whole and streamed, and ``--tool-call-parser
openai`` reads a ``commentary`` message to ``functions.NAME`` as a call.

gpt-oss's tokenizer cannot be downloaded here: the tiny Qwen3 model's is given harmony's markers as special tokens in
place of seven of its rarest tokens (the parsers read text and token ids, whatever the architecture), and a LoRA
adapter trained here for a few seconds (``coserve finetune``) makes the model answer in harmony's messages.
"""

from __future__ import annotations

import json
import shutil

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from server_helpers import start_server, train_replies

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
FIRST_ID = 8100  # the ids the markers take (rare merges of the tiny vocabulary's)
THOUGHT, ANSWER = "Two and two make four.", "The answer is 4."
TWO = [{"role": "user", "content": "What is 2+2?"}]
WEATHER = [{"role": "user", "content": "Weather in Paris?"}]
NEXT = "<|end|><|start|>assistant"
HEADER = "<|channel|>final<|message|>"
REPLY = f"<|channel|>analysis<|message|>{THOUGHT}{NEXT}{HEADER}{ANSWER}"
CALL = ('<|channel|>analysis<|message|>Need the weather.' + NEXT
        + '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _harmony_tokenizer(model_dir) -> None:
    """The model's tokenizer with ``MARKERS`` as special tokens of ids ``FIRST_ID``... (the tokens they replace and
    the merges that made them dropped)."""
    path = model_dir / "tokenizer.json"
    tj = json.loads(path.read_text())
    vocab = tj["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    removed = set()
    for offset, marker in enumerate(MARKERS):
        token = by_id[FIRST_ID + offset]
        removed.add(token)
        del vocab[token]
        vocab[marker] = FIRST_ID + offset
        tj["added_tokens"].append({"id": FIRST_ID + offset, "content": marker, "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False, "special": True})
    merges = [m.split(" ") if isinstance(m, str) else m for m in tj["model"]["merges"]]
    tj["model"]["merges"] = [m for m in merges if "".join(m) not in removed]
    path.write_text(json.dumps(tj))


@pytest.fixture(scope="module")
def harmonist(model_factory, tmp_path_factory):
    """The tiny Qwen3 model with harmony's markers, and an adapter that answers in harmony's messages."""
    root = tmp_path_factory.mktemp("harmony")
    model = root / "model"
    shutil.copytree(model_factory("qwen3"), model)
    _harmony_tokenizer(model)
    return model, train_replies(model, [(TWO, REPLY), (WEATHER, CALL)], root / "harmony")


@pytest.fixture(scope="module")
def client(harmonist, tmp_path_factory):
    model, adapter = harmonist
    srv = start_server(model, tmp_path_factory.mktemp("harmony-state") / "state", "--reasoning-parser",
                       "openai_gptoss", "--enable-auto-tool-choice", "--tool-call-parser", "openai",
                       "--adapter", f"harmony={adapter}")
    yield OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
    srv.stop()


def test_the_analysis_comes_apart_from_the_final_message_whole_and_streamed(client, harmonist):
    whole = client.chat.completions.create(model="harmony", messages=TWO, max_tokens=60, temperature=0)
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == THOUGHT and message.content == ANSWER
    assert whole.choices[0].finish_reason == "stop"
    tokenizer = AutoTokenizer.from_pretrained(str(harmonist[0]))
    before_reply = f"<|channel|>analysis<|message|>{THOUGHT}{NEXT}{HEADER}"  # the reasoning and the reply's header
    assert whole.usage.completion_tokens_details.reasoning_tokens == len(
        tokenizer(before_reply, add_special_tokens=False)["input_ids"])

    chunks = list(client.chat.completions.create(model="harmony", messages=TWO, max_tokens=60, temperature=0,
                                                 stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = [d.model_extra.get("reasoning_content") or "" for d in deltas]
    said = [d.content or "" for d in deltas]
    assert "".join(thought) == THOUGHT and "".join(said) == ANSWER
    assert not any(said[:max(i for i, t in enumerate(thought) if t) + 1])  # the reply after the reasoning


def test_a_commentary_message_to_a_function_is_a_tool_call_whole_and_streamed(client):
    whole = client.chat.completions.create(model="harmony", messages=WEATHER, max_tokens=60, temperature=0,
                                           tools=[TOOL])
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."
    call = choice.message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})

    chunks = list(client.chat.completions.create(model="harmony", messages=WEATHER, max_tokens=60, temperature=0,
                                                 tools=[TOOL], stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "Paris"}
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_guide_constrains_the_final_messages_body_alone(client):
    """The analysis message and the final message's header are written freely; the guide (vLLM's ``guided_choice``)
    constrains what follows ``<|message|>`` there."""
    whole = client.chat.completions.create(model="harmony", messages=TWO, max_tokens=60, temperature=0,
                                           extra_body={"guided_choice": ["four", "five"]})
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == THOUGHT and message.content in ("four", "five")
