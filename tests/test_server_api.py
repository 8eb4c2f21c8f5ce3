"""The OpenAI-compatible server, live on localhost, through the official ``openai`` client (and httpx for
what lies outside OpenAI's API): inference, files, fine-tuning jobs co-served with chat, errors, tenants."""

from __future__ import annotations

import io
import json
import re
import shutil
import threading
import time

import httpx
import openai
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from peft_helpers import hf_greedy, peft_model
from server_helpers import CHAT_EXAMPLES, chat_jsonl, start_server, wait_for_job

ALICE, BOB = "key-alice", "key-bob"
BASE = "tiny-llama"
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server(model_factory, tmp_path_factory):
    model = model_factory("llama")
    root = tmp_path_factory.mktemp("serve")
    keys = root / "keys.txt"
    keys.write_text(f"# key tenant\n{ALICE} alice\n{BOB} bob\n")
    srv = start_server(model, root / "state", "--api-keys", str(keys), "--served-model-name", BASE,
                       "--allow-lora-loading", "--checkpoint-steps", "2", "--max-upload-bytes", "200000",
                       "--max-body-bytes", "100000", "--max-waiting-requests", "8", "--max-queued-jobs", "3",
                       "--max-loaded-models", "2", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                       "--log-level", "info")  # the access log lines too
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def alice(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key=ALICE, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def bob(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key=BOB, max_retries=0, timeout=60)


def upload(client, data: bytes, name: str = "train.jsonl"):
    return client.files.create(file=(name, io.BytesIO(data)), purpose="fine-tune")


def test_models_list_has_the_base(alice):
    ids = [m.id for m in alice.models.list().data]
    assert ids[0] == BASE
    assert alice.models.retrieve(BASE).id == BASE
    listed = alice.models.list().data[0].model_extra
    assert listed["max_model_len"] == alice.models.retrieve(BASE).model_extra["max_model_len"] == 512  # vLLM's field


def test_completion_streamed_equals_whole(alice):
    whole = alice.completions.create(model=BASE, prompt="The scheduler decides", max_tokens=12, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    pieces = [c.choices[0].text for c in alice.completions.create(
        model=BASE, prompt="The scheduler decides", max_tokens=12, temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == whole.choices[0].text


def test_the_access_log_says_where_a_streamed_chats_first_token_time_went(server, alice):
    from coserve.bench.server_load import engine_ttfts
    chunks = list(alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=3, temperature=0, stream=True))
    ident = chunks[0].id
    deadline = time.monotonic() + 10  # the line is written when the response has ended
    while time.monotonic() < deadline and ident not in server.log.read_text():
        time.sleep(0.05)
    line = next(json.loads(x.partition("coserve.access: ")[2]) for x in server.log.read_text().splitlines()
                if f'"{ident}"' in x)
    assert line["path"] == "/v1/chat/completions" and line["status"] == 200 and line["tenant"] == "alice"
    assert line["model"] == BASE and line["completion_tokens"] == 3 and line["prompt_tokens"] > 0
    assert 0 < line["engine_ttft_ms"] <= line["ttft_ms"] <= line["first_text_ms"] <= line["ms"]
    assert engine_ttfts(server.log.read_text())[ident] == (pytest.approx(line["engine_ttft_ms"] / 1000),
                                                          pytest.approx(line["ttft_ms"] / 1000),
                                                          pytest.approx(line["first_text_ms"] / 1000))


def test_a_streamed_response_logs_when_its_first_text_went_out(server, alice):
    events = list(alice.responses.create(model=BASE, input="Hello", max_output_tokens=4, temperature=0, stream=True))
    ident = events[-1].response.id
    deadline = time.monotonic() + 10  # the line is written when the response has ended
    while time.monotonic() < deadline and f'"{ident}"' not in server.log.read_text():
        time.sleep(0.05)
    line = next(json.loads(x.partition("coserve.access: ")[2]) for x in server.log.read_text().splitlines()
                if f'"{ident}"' in x)
    assert line["path"] == "/v1/responses" and 0 < line["ttft_ms"] <= line["first_text_ms"] <= line["ms"]


def test_chat_streamed_equals_whole_with_usage(alice):
    whole = alice.chat.completions.create(model=BASE, messages=HELLO, max_completion_tokens=10, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=10, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_stats_count_each_choice_as_it_streams(alice, route):
    """vLLM's ``stream_options.continuous_usage_stats``: with ``include_usage``, every chunk carries its choice's
    counts so far, from 0 on the first chunk to the choice's own total; the final usage chunk sums the choices.
    Without ``include_usage`` no chunk carries usage, as vLLM does."""
    def stream(options):
        kwargs = {"model": BASE, "max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 2, "stream": True,
                  "stream_options": options}
        if route == "chat":
            return list(alice.chat.completions.create(messages=HELLO, **kwargs))
        return list(alice.completions.create(prompt="Hello there", **kwargs))

    chunks = stream({"include_usage": True, "continuous_usage_stats": True})
    total = chunks[-1].usage
    assert not chunks[-1].choices and total.completion_tokens == 12
    counts = {0: [], 1: []}
    for c in chunks[:-1]:
        (choice,) = c.choices
        assert c.usage.prompt_tokens == total.prompt_tokens
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        counts[choice.index].append(c.usage.completion_tokens)
    for seen in counts.values():
        assert seen == sorted(seen) and seen[-1] == 6
    if route == "chat":
        assert counts[0][0] == counts[1][0] == 0  # the role chunks, before any token
    assert all(c.usage is None for c in stream({"continuous_usage_stats": True}))


def test_stop_n_seed_and_logprobs(alice):
    base = alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=12, temperature=0)
    text = base.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 3]
    if stop.strip():
        cut = alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=12, temperature=0, stop=[stop])
        assert cut.choices[0].message.content == text[:text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"
    two = alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=8, temperature=1.0, seed=7, n=2)
    again = alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=8, temperature=1.0, seed=7, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.message.content for c in two.choices] == [c.message.content for c in again.choices]
    lp = alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    # greedy: the chosen token is the most likely one
    assert all(abs(t.logprob - max(x.logprob for x in t.top_logprobs)) < 1e-5 for t in content)


def test_echo_with_logprobs_scores_the_prompt_as_hf_does(alice, model_factory, hf_model_cache):
    """The legacy completions API's prompt scoring (what evaluation harnesses send): echo with logprobs and the
    official client, whole and streamed; the prompt's logprobs are HF's log-softmax, the first token's is null."""
    import torch

    prompt = [5, 17, 99, 240, 31, 8, 77]
    out = alice.completions.create(model=BASE, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == sorted(lp.text_offset)
    texted = alice.completions.create(model=BASE, prompt="Hello there", max_tokens=2, temperature=0, echo=True,
                                      logprobs=1).choices[0].logprobs  # a text prompt: BOS first, offsets still grow
    assert texted.token_logprobs[0] is None and texted.text_offset == sorted(texted.text_offset)
    assert texted.text_offset[1:] == [sum(len(t) for t in texted.tokens[:i]) for i in range(1, len(texted.tokens))]
    with torch.inference_mode():
        ref = hf_model_cache(model_factory("llama"))(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for i in range(1, len(prompt)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
        assert len(lp.top_logprobs[i]) <= 2 and max(lp.top_logprobs[i].values()) == pytest.approx(
            ref[i - 1].max().item(), abs=1e-4)
    stream = alice.completions.create(model=BASE, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=2,
                                      stream=True)
    streamed = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [t for part in streamed for t in part.token_logprobs] == lp.token_logprobs


def test_best_of_returns_the_n_candidates_with_the_highest_logprob_per_token(alice):
    """OpenAI's legacy ``best_of``: ``best_of`` completions per prompt are generated and the ``n`` with the highest
    mean token logprob return, best first, indexed from 0 per request; usage counts every candidate's tokens. The
    oracle: the same request with ``n=best_of`` (the same per-choice seeds) and its tokens' logprobs, ranked here."""
    prompts = ["Hello there", "Once upon"]
    common = {"model": BASE, "prompt": prompts, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    every = alice.completions.create(n=4, logprobs=0, **common)
    best = alice.completions.create(n=2, best_of=4, **common)
    expected = []
    for p in range(len(prompts)):
        group = [c for c in every.choices if c.index // 4 == p]
        mean = {c.index: sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in group}
        assert len(set(mean.values())) == 4, "distinct candidates, so the ranking is the test's"
        expected += [c.text for c in sorted(group, key=lambda c: -mean[c.index])[:2]]
    assert [c.text for c in best.choices] == expected
    assert [c.index for c in best.choices] == [0, 1, 2, 3] and all(c.logprobs is None for c in best.choices)
    assert best.usage.completion_tokens == every.usage.completion_tokens
    assert best.usage.prompt_tokens == every.usage.prompt_tokens
    with_logprobs = alice.completions.create(n=1, best_of=4, logprobs=1, **{**common, "prompt": prompts[0]})
    assert with_logprobs.choices[0].text == expected[0] and len(with_logprobs.choices[0].logprobs.tokens) == 6


@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
])
def test_bad_chat_requests_are_400_naming_the_field(alice, kwargs, param):
    body = {"model": BASE, "messages": HELLO, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        alice.chat.completions.create(**body)
    assert e.value.status_code == 400 and e.value.body["param"] == param


SMALL_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
                "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 12, "x"]}}}


def test_structured_outputs_match_the_schema_streamed_or_not(alice):
    """response_format json_schema (OpenAI's), guided_json (vLLM's), streamed and whole: the same JSON text."""
    import jsonschema

    rf = {"type": "json_schema", "json_schema": {"name": "record", "schema": SMALL_SCHEMA, "strict": True}}
    whole = alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=40, temperature=0, response_format=rf)
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SMALL_SCHEMA)
    stream = alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=40, temperature=0,
                                           response_format=rf, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    vllm = alice.completions.create(model=BASE, prompt="JSON:", max_tokens=40, temperature=0.7, seed=5,
                                    extra_body={"guided_json": json.dumps(SMALL_SCHEMA)})
    jsonschema.validate(json.loads(vllm.choices[0].text), SMALL_SCHEMA)
    obj = alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=8, temperature=0,
                                        response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")
    for extra in ({"guided_choice": ["yes", "no"]}, {"structured_outputs": {"choice": ["yes", "no"]}}):
        picked = alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=5, temperature=1.0, seed=2,
                                               extra_body=extra)
        assert picked.choices[0].message.content in ("yes", "no")
    newer = alice.completions.create(model=BASE, prompt="JSON:", max_tokens=40, temperature=0,
                                     extra_body={"structured_outputs": {"json": SMALL_SCHEMA}})
    jsonschema.validate(json.loads(newer.choices[0].text), SMALL_SCHEMA)
    for extra in ({"guided_regex": r"\d{2}-(yes|no)"}, {"structured_outputs": {"regex": r"\d{2}-(yes|no)"}},
                  {"guided_grammar": 'root ::= [0-9]{2} "-" ("yes" | "no")'},
                  {"structured_outputs": {"grammar": 'root ::= d d "-" a\nd ::= [0-9]\na ::= "yes" | "no"'}},
                  {"guided_grammar": 'start: DIGIT DIGIT "-" ("yes" | "no")\n%import common.DIGIT'}):  # Lark
        matched = alice.completions.create(model=BASE, prompt="Code:", max_tokens=8, temperature=1.0, seed=3,
                                           extra_body=extra)
        assert re.fullmatch(r"\d{2}-(yes|no)", matched.choices[0].text)
    for extra, param in (({"guided_choice": []}, "guided_choice"), ({"structured_outputs": {"xml": "x"}},
                                                                     "structured_outputs"),
                         ({"guided_grammar": 'root ::= root "a"'}, "guided_grammar"),
                         ({"guided_grammar": 'start: "a"\n%declare X'}, "guided_grammar"),
                         ({"guided_regex": "(a"}, "guided_regex"),
                         ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
                         ({"guided_choice": ["a"], "guided_json": {}}, "guided_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=4, extra_body=extra)
        assert e.value.body["param"] == param


@pytest.mark.parametrize("response_format, message", [
    ({"type": "xml"}, "response_format.type: must be one of text, json_object, json_schema"),
    ({"type": "json_schema"}, "response_format.json_schema: must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}, "json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "number", "multipleOf": 2}}},
     "response_format.json_schema.schema: keyword 'multipleOf' is not supported"),
    ({"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "string", "pattern": "(?=a)"}}},
     "response_format.json_schema.schema.pattern: lookaround"),
])
def test_bad_response_formats_are_400_naming_the_field(alice, response_format, message):
    with pytest.raises(openai.BadRequestError) as e:
        alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=4, response_format=response_format)
    assert e.value.body["param"] == "response_format" and message in e.value.body["message"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters


def streamed_calls(stream) -> tuple[dict[int, dict], str]:
    """A streamed reply's tool calls (by index; arguments joined) and its finish reason."""
    calls: dict[int, dict] = {}
    reason = None
    for chunk in stream:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": "", "pieces": 0})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["name"] = d.function.name or call["name"]
                    call["arguments"] += d.function.arguments or ""
                    call["pieces"] += bool(d.function.arguments)
            reason = choice.finish_reason or reason
    return calls, reason


def test_tool_calls_named_and_required_streamed_or_not(alice):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=40, temperature=0,
                                          tools=[WEATHER, TIME], tool_choice=named)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(json.loads(call.function.arguments)) == {"city", "unit"}
    calls, reason = streamed_calls(alice.chat.completions.create(
        model=BASE, messages=HELLO, max_tokens=40, temperature=0, tools=[WEATHER, TIME], tool_choice=named,
        stream=True))
    assert reason == "tool_calls" and [(c["name"], c["arguments"]) for c in calls.values()] == [
        ("get_weather", call.function.arguments)]

    required = alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=60, temperature=0.9, seed=4,
                                             tools=[WEATHER, TIME], tool_choice="required",
                                             parallel_tool_calls=False)
    assert required.choices[0].finish_reason == "tool_calls"
    (made,) = required.choices[0].message.tool_calls  # parallel_tool_calls false: exactly one
    args = json.loads(made.function.arguments)
    assert (made.function.name, sorted(args)) in [("get_weather", ["city", "unit"]), ("get_time", [])]
    calls, reason = streamed_calls(alice.chat.completions.create(
        model=BASE, messages=HELLO, max_tokens=60, temperature=0.9, seed=4, tools=[WEATHER, TIME],
        tool_choice="required", parallel_tool_calls=False, stream=True))
    assert reason == "tool_calls" and [(c["name"], c["arguments"]) for c in calls.values()] == [
        (made.function.name, made.function.arguments)]
    assert calls[0]["pieces"] > 1 or made.function.arguments == "{}"  # streamed as written


def test_a_conversation_with_past_tool_calls_renders_and_none_answers_in_text(alice, server):
    history = HELLO + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 and snowing"}]
    reply = alice.chat.completions.create(model=BASE, messages=history, max_tokens=4, temperature=0,
                                          tools=[WEATHER], tool_choice="none")
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content is not None
    ids = httpx.post(f"{server.url}/tokenize", headers={"Authorization": f"Bearer {ALICE}"},
                     json={"model": BASE, "messages": history}).json()["tokens"]
    text = httpx.post(f"{server.url}/detokenize", headers={"Authorization": f"Bearer {ALICE}"},
                      json={"model": BASE, "tokens": ids}).json()["prompt"]
    # this template never mentions tool_calls: the call is inlined as the JSON tool_choice 'required' writes
    assert '[{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}]' in text and "-3 and snowing" in text


def test_auto_tool_choice_reads_hermes_calls_from_the_text(alice):
    """tool_choice 'auto' (the default with tools) on a server started with --tool-call-parser hermes: a call the
    model writes as <tool_call>{json}</tool_call> becomes tool_calls, the text before it the content, whole and
    streamed. This random-weight model is made to write one by guided_regex; left free, it answers in text."""
    forced = {"guided_regex": r'Checking\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", '
                              r'"unit": "C"\}\}</tool_call>'}
    whole = alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=200, temperature=0,
                                          tools=[WEATHER, TIME], extra_body=forced)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] == "C"
    stream = alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=200, temperature=0,
                                           tools=[WEATHER, TIME], tool_choice="auto", extra_body=forced, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Checking."
    calls, reason = streamed_calls(chunks)
    assert reason == "tool_calls" and [(c["name"], c["arguments"]) for c in calls.values()] == [
        ("get_weather", call.function.arguments)]
    assert calls[0]["pieces"] > 3  # the arguments came as they were written, not whole at the end

    free = alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=12, temperature=0, tools=[WEATHER])
    assert free.choices[0].message.tool_calls is None and free.choices[0].message.content
    text = "".join(c.choices[0].delta.content or "" for c in alice.chat.completions.create(
        model=BASE, messages=HELLO, max_tokens=12, temperature=0, tools=[WEATHER], stream=True) if c.choices)
    assert text == free.choices[0].message.content
    reply = alice.responses.create(model=BASE, input="Hello", max_output_tokens=8, temperature=0,
                                   tools=[{"type": "function", "name": "get_time"}])
    assert reply.output[0].type == "message"


@pytest.mark.parametrize("parser, calls, pieces", [
    ("llama3_json", r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Oslo)", "unit": "C"\}\}; '
                    r'\{"name": "get_time", "parameters": \{\}\}', 3),  # arguments in pieces as written
    ("pythonic", r"\[get_weather\(city='(Paris|Oslo)', unit='C'\), get_time\(\)\]", 1),  # whole once closed
    ("mistral", r'\[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "(Paris|Oslo)", "unit": "C"\}'
                r'\[TOOL_CALLS\]get_time\[ARGS\]\{\}', 3),
    ("kimi_k2", r'<\|tool_calls_section_begin\|><\|tool_call_begin\|>functions\.get_weather:0'
                r'<\|tool_call_argument_begin\|>\{"city": "(Paris|Oslo)", "unit": "C"\}<\|tool_call_end\|>'
                r'<\|tool_call_begin\|>functions\.get_time:1<\|tool_call_argument_begin\|>\{\}<\|tool_call_end\|>'
                r'<\|tool_calls_section_end\|>', 3),
    ("qwen3_coder", r"<tool_call>\n<function=get_weather>\n<parameter=city>\n(Paris|Oslo)\n</parameter>\n"
                    r"<parameter=unit>\nC\n</parameter>\n</function>\n</tool_call>\n"
                    r"<tool_call>\n<function=get_time>\n</function>\n</tool_call>", 1),
])
def test_auto_tool_choice_reads_the_calls_of_the_servers_parser(model_factory, tmp_path, parser, calls, pieces):
    """--tool-call-parser llama3_json (a reply of {"name", "parameters"} objects separated by ';'), pythonic (a
    Python list of calls), mistral ([TOOL_CALLS]name[ARGS]{...}), kimi_k2 (a section of marked calls, each with
    its own id) and qwen3_coder (XML blocks): the calls become tool_calls with no content, whole and streamed; a
    reply that begins with text is text. The random-weight model is made to write calls by guided_regex. (granite
    and the DeepSeek formats are read on plain data: test_tool_parser.py, test_tool_stream.py.)"""
    srv = start_server(model_factory("llama"), tmp_path / "state", "--served-model-name", BASE,
                       "--enable-auto-tool-choice", "--tool-call-parser", parser)
    try:
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
        ask = dict(model=BASE, messages=HELLO, max_tokens=200, temperature=0, tools=[WEATHER, TIME],
                   extra_body={"guided_regex": calls})
        choice = client.chat.completions.create(**ask).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather", "get_time"]
        assert json.loads(choice.message.tool_calls[0].function.arguments)["unit"] == "C"
        if parser == "kimi_k2":  # the ids the model wrote, which its template writes back
            assert [c.id for c in choice.message.tool_calls] == ["functions.get_weather:0", "functions.get_time:1"]
        chunks = list(client.chat.completions.create(**ask, stream=True))
        streamed, reason = streamed_calls(chunks)
        assert reason == "tool_calls" and [(c["name"], c["arguments"]) for c in streamed.values()] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        if parser == "kimi_k2":
            assert [c["id"] for c in streamed.values()] == [c.id for c in choice.message.tool_calls]
        assert streamed[0]["pieces"] >= pieces
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        text = client.chat.completions.create(**{**ask, "extra_body": {"guided_regex": r"Sunny; \{\}\[\]"}})
        assert text.choices[0].message.content == "Sunny; {}[]" and text.choices[0].message.tool_calls is None
    finally:
        srv.stop()


def test_the_responses_api_streams_required_calls_as_they_are_written(alice):
    """tool_choice 'required' on the Responses API: each call an item whose arguments come in pieces (the
    streamed events on plain data, 'auto' included: test_tool_stream.py)."""
    tool = {"type": "function", **WEATHER["function"]}
    events = list(alice.responses.create(model=BASE, input="Weather?", tools=[tool], max_output_tokens=80,
                                         temperature=0, tool_choice="required", parallel_tool_calls=False,
                                         stream=True))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    (call,) = [o for o in final.output if o.type == "function_call"]
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    assert [e.item.id for e in events if e.type == "response.output_item.done"] == [call.id]


SUMS = 'start: INT (("+" | "*") INT) ~ 0..3\nINT: DIGIT ~ 1..3\n%import common.DIGIT'  # Lark, bounded
SUMS_RE = r"[0-9]{1,3}([+*][0-9]{1,3}){0,3}"


def custom_tool(name: str, fmt: dict | None) -> dict:
    return {"type": "custom", "custom": {"name": name, "description": "a custom tool",
                                         **({"format": fmt} if fmt else {})}}


def test_a_named_custom_tool_is_called_with_input_its_grammar_matches_streamed_or_not(alice):
    lark_fmt = {"type": "grammar", "grammar": {"syntax": "lark", "definition": SUMS}}
    regex_fmt = {"type": "grammar", "grammar": {"syntax": "regex", "definition": SUMS_RE}}
    tools = [WEATHER, custom_tool("calc", lark_fmt), custom_tool("calc_re", regex_fmt), custom_tool("note", None)]
    for name in ("calc", "calc_re"):
        pick = {"type": "custom", "custom": {"name": name}}
        whole = alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=30, temperature=0.8, seed=5,
                                              tools=tools, tool_choice=pick)
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "custom" and call.custom.name == name and call.id.startswith("call_")
        assert re.fullmatch(SUMS_RE, call.custom.input), call.custom.input
        pieces, head = [], None
        for chunk in alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=30, temperature=0.8,
                                                   seed=5, tools=tools, tool_choice=pick, stream=True):
            for d in chunk.choices[0].delta.tool_calls or []:
                custom = d.model_extra.get("custom") or {}
                head = head or (d.id, d.type, custom.get("name"))
                pieces.append(custom.get("input", ""))
        assert head[1:] == ("custom", name) and head[0].startswith("call_")
        assert "".join(pieces) == call.custom.input and (len(pieces) > 2 or len(call.custom.input) < 2)
    free = alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=6, temperature=0, tools=tools,
                                         tool_choice={"type": "custom", "custom": {"name": "note"}}).choices[0]
    text = alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=6, temperature=0, tools=tools,
                                         tool_choice="none").choices[0].message.content
    if free.finish_reason == "length":  # cut short, as a named function's arguments: no call, the text as content
        assert free.message.tool_calls is None and free.message.content == text
    else:  # a text format: the input is whatever the model wrote, unguided
        assert free.message.tool_calls[0].custom.input == text
    history = HELLO + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "custom", "custom": {"name": "calc", "input": "1+2"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    after = alice.chat.completions.create(model=BASE, messages=history, max_tokens=4, tools=tools, tool_choice="none")
    assert after.choices[0].message.content is not None


def test_the_responses_api_calls_a_named_custom_tool_streamed_or_not(alice):
    tool = {"type": "custom", "name": "calc", "description": "sums",
            "format": {"type": "grammar", "syntax": "lark", "definition": SUMS}}
    ask = {"model": BASE, "input": "Add:", "tools": [tool], "tool_choice": {"type": "custom", "name": "calc"},
           "max_output_tokens": 30, "temperature": 0}
    whole = alice.responses.create(**ask)
    (item,) = whole.output
    assert item.type == "custom_tool_call" and item.name == "calc" and re.fullmatch(SUMS_RE, item.input)
    assert item.id.startswith("ctc_") and item.call_id.startswith("call_")
    events = list(alice.responses.create(**ask, stream=True))
    final = events[-1].response
    (streamed,) = final.output
    assert streamed.input == item.input
    assert "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta") == item.input
    (done,) = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert done.input == item.input and done.item_id == streamed.id
    answered = alice.responses.create(model=BASE, previous_response_id=whole.id, max_output_tokens=4,
                                      input=[{"type": "custom_tool_call_output", "call_id": item.call_id,
                                              "output": "7"}])
    assert answered.output[0].type == "message"
    listed = alice.responses.input_items.list(answered.id, order="asc").data
    assert [i.type for i in listed] == ["message", "custom_tool_call", "custom_tool_call_output"]
    assert (listed[1].call_id, listed[1].name, listed[1].input) == (item.call_id, "calc", item.input)
    assert (listed[2].call_id, listed[2].output) == (item.call_id, "7")


@pytest.mark.parametrize("kwargs, param, message", [
    ({"tools": [{"type": "custom", "custom": {"name": "calc"}}]}, "tool_choice", "custom tools are called when"),
    ({"tools": [{"type": "custom", "custom": {"name": "calc"}}], "tool_choice": "required"}, "tool_choice",
     "custom tools are called when"),
    ({"tools": [WEATHER], "tool_choice": {"type": "custom", "custom": {"name": "calc"}}}, "tool_choice",
     "no custom tool named 'calc'"),
    ({"tools": [{"type": "custom", "custom": {"name": "calc", "format": {
        "type": "grammar", "grammar": {"syntax": "lark", "definition": "start: nope"}}}}],
      "tool_choice": {"type": "custom", "custom": {"name": "calc"}}}, "tools",
     "tools[0].custom.format.grammar.definition: line 1: 'nope' is used but never defined"),
    ({"tools": [{"type": "custom", "custom": {"name": "calc", "format": {"type": "grammar"}}}],
      "tool_choice": {"type": "custom", "custom": {"name": "calc"}}}, "tools", "a grammar format needs"),
    ({"tools": [WEATHER, {"type": "custom", "custom": {"name": "get_weather"}}],
      "tool_choice": {"type": "custom", "custom": {"name": "get_weather"}}}, "tools", "distinct"),
])
def test_bad_custom_tool_requests_are_400_naming_the_field(alice, kwargs, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        alice.chat.completions.create(**{"model": BASE, "messages": HELLO, "max_tokens": 4, **kwargs})
    assert e.value.body["param"] == param and message in e.value.body["message"]


@pytest.mark.parametrize("kwargs, param, message", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "no function named 'nope'"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "distinct"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "number", "multipleOf": 2}}}],
      "tool_choice": "required"}, "tools", "tools[0].function.parameters: keyword 'multipleOf'"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id", "answers a call"),
])
def test_bad_tool_requests_are_400_naming_the_field(alice, kwargs, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        alice.chat.completions.create(**{"model": BASE, "messages": HELLO, "max_tokens": 4, **kwargs})
    assert e.value.body["param"] == param and message in e.value.body["message"]


def test_responses_api_text_streamed_or_whole_with_usage_and_cached_tokens(alice, server):
    """OpenAI's Responses API through the official client: the same text whole and streamed (with the typed events
    in order), 'incomplete' when max_output_tokens cuts it, and the prefix cache's tokens in the usage."""
    ask = {"model": BASE, "input": "Hello there, " * 8, "instructions": "Be brief.", "max_output_tokens": 6,
           "temperature": 0}
    whole = alice.responses.create(**ask)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 6 and whole.output[0].role == "assistant"
    again = alice.responses.create(**ask)
    assert again.output_text == whole.output_text and again.usage.input_tokens_details.cached_tokens > 0
    kinds, text, final = [], "", None
    for event in alice.responses.create(**ask, stream=True):
        kinds.append(event.type)
        text += event.delta if event.type == "response.output_text.delta" else ""
        final = event.response if event.type in ("response.completed", "response.incomplete") else final
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert text == final.output_text == whole.output_text
    chat = alice.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "Hello there, " * 8}],
                                         max_tokens=2)
    again = alice.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "Hello there, " * 8}],
                                          max_tokens=2)
    assert chat.usage.prompt_tokens_details.cached_tokens == 0 < again.usage.prompt_tokens_details.cached_tokens
    metrics = {ln.split()[0]: float(ln.split()[1]) for ln in httpx.get(f"{server.url}/metrics").text.splitlines()
               if ln.startswith("coserve_") and " " in ln}
    assert metrics["coserve_prefix_cache_hits_total"] > 0
    assert metrics["coserve_prefix_cache_queries_total"] >= metrics["coserve_prefix_cache_hits_total"]
    assert metrics["coserve_spec_decode_draft_tokens_total"] == 0  # speculative decoding is off by default


def test_responses_api_function_calls_and_structured_text(alice):
    import jsonschema

    tool = {"type": "function", **WEATHER["function"]}
    named = alice.responses.create(model=BASE, input="Weather?", tools=[tool], max_output_tokens=40, temperature=0,
                                   tool_choice={"type": "function", "name": "get_weather"})
    (call,) = named.output
    assert named.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city", "unit"}
    events = list(alice.responses.create(model=BASE, input="Weather?", tools=[tool], max_output_tokens=40,
                                         temperature=0, tool_choice={"type": "function", "name": "get_weather"},
                                         stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments and events[-1].type == "response.completed"
    follow_up = alice.responses.create(model=BASE, max_output_tokens=4, temperature=0, tools=[tool], tool_choice="none",
                                       input=[{"role": "user", "content": "Weather?"},
                                              {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                               "arguments": call.arguments},
                                              {"type": "function_call_output", "call_id": call.call_id,
                                               "output": "sunny"}])
    assert follow_up.output[0].type == "message"
    structured = alice.responses.create(model=BASE, input="JSON please", max_output_tokens=40, temperature=0,
                                        text={"format": {"type": "json_schema", "name": "r", "schema": SMALL_SCHEMA}})
    jsonschema.validate(json.loads(structured.output_text), SMALL_SCHEMA)


def test_responses_are_stored_chained_and_private_to_their_tenant(alice, bob):
    first = alice.responses.create(model=BASE, input="Remember the word apple.", instructions="Be brief.",
                                   max_output_tokens=4, temperature=0)
    assert alice.responses.retrieve(first.id).output_text == first.output_text
    follow = alice.responses.create(model=BASE, input="Which word?", previous_response_id=first.id,
                                    max_output_tokens=4, temperature=0)
    assert follow.previous_response_id == first.id
    # the same conversation sent whole (first input, first reply, new input) gets the same reply and prompt
    whole = alice.responses.create(model=BASE, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "Remember the word apple."},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "Which word?"}])
    assert whole.output_text == follow.output_text and whole.usage.input_tokens == follow.usage.input_tokens
    # what each answered, newest first (the chained one's earlier turns too; instructions and its own output apart)
    listed = alice.responses.input_items.list(follow.id)
    assert [(i.type, i.role, i.content[0].type, i.content[0].text) for i in listed.data] == [
        ("message", "user", "input_text", "Which word?"), ("message", "assistant", "output_text", first.output_text),
        ("message", "user", "input_text", "Remember the word apple.")]
    assert not listed.has_more and [i.id for i in alice.responses.input_items.list(follow.id).data] == \
        [i.id for i in listed.data]  # ids stable from listing to listing
    page = alice.responses.input_items.list(follow.id, limit=2, order="asc")
    assert [i.content[0].text for i in page.data] == ["Remember the word apple.", first.output_text] and page.has_more
    rest = alice.responses.input_items.list(follow.id, limit=2, order="asc", after=page.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["Which word?"] and not rest.has_more
    assert [i.content[0].text for i in alice.responses.input_items.list(first.id).data] == \
        ["Remember the word apple."]
    with pytest.raises(openai.BadRequestError, match="limit"):
        alice.responses.input_items.list(follow.id, limit=0)
    with pytest.raises(openai.BadRequestError, match="after"):
        alice.responses.input_items.list(follow.id, after="msg_nope")
    with pytest.raises(openai.NotFoundError):
        bob.responses.input_items.list(follow.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.create(model=BASE, input="hi", previous_response_id=first.id, max_output_tokens=2)
    unsaved = alice.responses.create(model=BASE, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(unsaved.id)
    alice.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(first.id)


def test_a_responses_requests_input_tokens_are_counted_without_answering_it(alice, bob):
    """``responses.input_tokens.count``: the prompt's tokens as ``responses.create`` reports them in ``usage``, its
    instructions, tools, and the response it goes on from included; the model may be left out; an unknown model or
    another tenant's response is a 404, an empty input a 400."""
    lookup = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
    ask = {"input": "Remember the word apple.", "instructions": "Be brief.", "tools": [lookup], "tool_choice": "none"}
    counted = alice.responses.input_tokens.count(model=BASE, **ask)
    first = alice.responses.create(model=BASE, max_output_tokens=3, temperature=0, **ask)
    assert counted.object == "response.input_tokens" and counted.input_tokens == first.usage.input_tokens
    assert alice.responses.input_tokens.count(**ask).input_tokens == counted.input_tokens  # no model
    plain = alice.responses.input_tokens.count(input="Remember the word apple.")
    assert plain.input_tokens < counted.input_tokens  # less the instructions and the tool
    chained = alice.responses.input_tokens.count(input="Which word?", previous_response_id=first.id)
    follow = alice.responses.create(model=BASE, input="Which word?", previous_response_id=first.id,
                                    max_output_tokens=2, temperature=0)
    assert chained.input_tokens == follow.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        alice.responses.input_tokens.count(model="no-such-model", input="hi")
    with pytest.raises(openai.NotFoundError):
        bob.responses.input_tokens.count(input="hi", previous_response_id=first.id)
    with pytest.raises(openai.BadRequestError) as e:
        alice.responses.input_tokens.count(input=[])
    assert e.value.body["param"] == "input"


@pytest.mark.parametrize("kwargs, param", [
    ({"text": {"format": {"type": "json_schema", "name": "r", "schema": {"type": "number", "multipleOf": 2}}}},
     "text.format"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"max_output_tokens": 100_000}, "max_output_tokens"),
    ({"input": []}, "input"),
])
def test_bad_responses_requests_are_400_naming_the_field(alice, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        alice.responses.create(**{"model": BASE, "input": "hi", "max_output_tokens": 4, **kwargs})
    assert e.value.body["param"] == param


def test_vllm_sampling_extras_through_the_client(alice, model_factory):
    tokenizer = AutoTokenizer.from_pretrained(str(model_factory("llama")))
    body = dict(model=BASE, prompt="Hello", max_tokens=12, temperature=1.0, seed=3)
    out = alice.completions.create(**body, logprobs=0, extra_body={
        "allowed_token_ids": [11, 12, 13], "min_tokens": 12, "min_p": 0.01, "ignore_eos": True})
    assert set(out.choices[0].logprobs.tokens) <= {tokenizer.decode([i]) for i in (11, 12, 13)}
    assert out.usage.completion_tokens == 12
    free = alice.completions.create(model=BASE, prompt="Hello", max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    stop = free.choices[0].text[2:5]
    kept = alice.completions.create(model=BASE, prompt="Hello", max_tokens=8, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text.endswith(stop) and free.choices[0].text.startswith(kept.choices[0].text)
    for extra, param in (({"allowed_token_ids": [10**6]}, "allowed_token_ids"), ({"min_tokens": 50}, "min_tokens"),
                         ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"min_p": 2}, "min_p")):
        with pytest.raises(openai.BadRequestError) as e:
            alice.completions.create(model=BASE, prompt="Hello", max_tokens=8, extra_body=extra)
        assert e.value.body["param"] == param


def test_beam_search_completions_are_the_engines_beams(alice, model_factory):
    """vLLM's use_beam_search: n beams, the n best completions, as LLM.beam_search finds them."""
    from coserve import LLM, BeamSearchParams
    out = alice.completions.create(model=BASE, prompt=[5, 6, 7, 8], max_tokens=6, n=3,
                                   extra_body={"use_beam_search": True, "ignore_eos": True})
    llm = LLM(model_factory("llama"), dtype="float32", device="cpu")
    ref = llm.beam_search([[5, 6, 7, 8]], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))[0]
    assert [c.text for c in out.choices] == [s.text for s in ref.sequences]
    assert out.usage.completion_tokens == 18
    with pytest.raises(openai.BadRequestError) as e:
        alice.completions.create(model=BASE, prompt="hi", max_tokens=4, stream=True,
                                 extra_body={"use_beam_search": True})
    assert e.value.body["param"] == "stream"
    with pytest.raises(openai.BadRequestError) as e:
        alice.completions.create(model=BASE, prompt="hi", max_tokens=4,
                                 extra_body={"use_beam_search": True, "guided_regex": "a+"})
    assert e.value.body["param"] == "guided_regex"


def test_prompt_over_the_context_is_400(alice):
    with pytest.raises(openai.BadRequestError) as e:
        alice.completions.create(model=BASE, prompt=[5] * 600, max_tokens=4)
    assert e.value.code == "context_length_exceeded"


def test_http_errors_in_openai_shape(server):
    url = f"{server.url}/v1"
    h = {"Authorization": f"Bearer {ALICE}"}
    r = httpx.post(f"{url}/chat/completions", content=b"{not json", headers={**h, "content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{url}/models").status_code == 401
    r = httpx.get(f"{url}/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{url}/chat/completions", headers=h, json={"model": BASE, "messages": HELLO,
                                                                 "stop": "x" * 200_000})
    assert r.status_code == 413
    r = httpx.post(f"{url}/chat/completions", headers=h, json={"model": BASE, "messages": HELLO, "n": 9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"  # more than the whole queue: never fits
    assert httpx.get(f"{url}/nothing", headers=h).status_code == 404
    assert httpx.get(f"{server.url}/health").status_code == 200  # and it keeps serving


def test_unknown_model_file_and_job_are_404(alice):
    with pytest.raises(openai.NotFoundError):
        alice.chat.completions.create(model="no-such-model", messages=HELLO)
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve("file-000000000000000000000000")
    with pytest.raises(openai.NotFoundError):
        alice.fine_tuning.jobs.retrieve("ftjob-000000000000000000000000")
    with pytest.raises(openai.NotFoundError):
        alice.fine_tuning.jobs.create(model=BASE, training_file="file-000000000000000000000000")


def test_files_upload_list_delete_and_isolation(alice, bob):
    f = upload(alice, chat_jsonl())
    assert f.purpose == "fine-tune" and f.bytes == len(chat_jsonl())
    assert f.id in [x.id for x in alice.files.list().data]
    assert f.id not in [x.id for x in bob.files.list().data]
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        bob.files.delete(f.id)
    with pytest.raises(openai.NotFoundError):
        bob.fine_tuning.jobs.create(model=BASE, training_file=f.id)
    assert alice.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(f.id)


def test_bad_uploads_name_the_line(alice):
    bad = chat_jsonl() + b'{"messages": [{"role": "user", "content": "q"}]}\nnot json\n'
    with pytest.raises(openai.BadRequestError) as e:
        upload(alice, bad)
    message = e.value.body["message"]
    assert "line 7" in message and "no assistant message" in message and "line 8" in message
    with pytest.raises(openai.BadRequestError):
        alice.files.create(file=("x.jsonl", io.BytesIO(chat_jsonl())), purpose="assistants")
    with pytest.raises(openai.APIStatusError) as e:
        upload(alice, chat_jsonl() * 300)  # over --max-upload-bytes
    assert e.value.status_code == 413


def test_fine_tune_while_chatting_then_serve_the_model(server, alice, bob, tmp_path):
    f = upload(alice, chat_jsonl())
    job = alice.fine_tuning.jobs.create(
        model=BASE, training_file=f.id, validation_file=f.id, suffix="facts", seed=3,
        hyperparameters={"n_epochs": 2, "batch_size": 1, "learning_rate_multiplier": 100},
        extra_body={"coserve": {"target_modules": ["q_proj", "v_proj", "down_proj"], "r": 8, "eval_steps": 2,
                                "memory_target": 0.75}})
    assert job.status in ("queued", "running") and job.hyperparameters.n_epochs == 2
    served, errors = [], []

    def chat_meanwhile():
        for _ in range(6):
            try:
                served.append(alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=8, temperature=0))
            except Exception as e:  # collected: the test fails below with it
                errors.append(e)
    t = threading.Thread(target=chat_meanwhile)
    t.start()
    done = wait_for_job(alice, job.id)
    t.join()
    assert not errors and len(served) == 6
    assert done.status == "succeeded", done.error
    assert done.fine_tuned_model == f"ft:{BASE}:facts:{job.id}" and done.trained_tokens > 0
    events = alice.fine_tuning.jobs.list_events(job.id, limit=100).data
    steps = [e for e in events if e.type == "metrics"]
    assert len(steps) == 2 * len(CHAT_EXAMPLES) and events[0].message == "The job has successfully completed"
    started = [e.message for e in events if e.message.startswith("Fine-tuning job started")]
    assert len(started) == 1 and "(rematerialize cheap, memory target 0.75)" in started[0], started
    checkpoints = alice.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [c.step_number for c in checkpoints][0] == 2 * len(CHAT_EXAMPLES) and len(checkpoints) >= 2
    # the validation file's loss after each epoch, in that step's event and checkpoint
    valid = {e.data["step"]: e.data.get("full_valid_loss") for e in steps}
    epochs = {len(CHAT_EXAMPLES), 2 * len(CHAT_EXAMPLES)}
    assert {s for s, v in valid.items() if v is not None} == epochs
    assert all(0 < valid[s] < 100 for s in epochs)
    assert checkpoints[0].metrics.full_valid_loss == valid[2 * len(CHAT_EXAMPLES)]
    assert all(0 <= e.data["train_mean_token_accuracy"] <= 1 for e in steps)  # OpenAI's metric names
    assert all(0 <= e.data["full_valid_mean_token_accuracy"] <= 1 for e in steps if e.data["step"] in epochs)
    assert checkpoints[0].metrics.train_mean_token_accuracy == steps[0].data["train_mean_token_accuracy"]
    batches = {e.data["step"]: e.data for e in steps if "valid_loss" in e.data}  # eval_steps 2: a validation batch
    assert set(batches) == {2, 4, 8, 10} and all(0 < d["valid_loss"] < 100 and 0 <= d["valid_mean_token_accuracy"]
                                                 <= 1 for d in batches.values())
    # the model and its checkpoints are servable at once, and differ from the base
    base = alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=8, temperature=0)
    tuned = alice.chat.completions.create(model=done.fine_tuned_model, messages=HELLO, max_tokens=8, temperature=0)
    assert tuned.choices[0].message.content != base.choices[0].message.content
    early = alice.chat.completions.create(model=checkpoints[-1].fine_tuned_model_checkpoint, messages=HELLO,
                                          max_tokens=4)
    assert early.choices[0].message.content is not None
    assert done.fine_tuned_model in [m.id for m in alice.models.list().data]
    assert alice.models.retrieve(checkpoints[-1].fine_tuned_model_checkpoint).owned_by == "alice"
    # bob sees none of it
    assert done.fine_tuned_model not in [m.id for m in bob.models.list().data]
    for name in (done.fine_tuned_model, checkpoints[-1].fine_tuned_model_checkpoint):
        with pytest.raises(openai.NotFoundError):
            bob.chat.completions.create(model=name, messages=HELLO)
        with pytest.raises(openai.NotFoundError):
            bob.models.retrieve(name)
    for call in (bob.fine_tuning.jobs.retrieve, bob.fine_tuning.jobs.cancel, bob.fine_tuning.jobs.list_events,
                 bob.fine_tuning.jobs.checkpoints.list):
        with pytest.raises(openai.NotFoundError):
            call(job.id)
    with pytest.raises(openai.NotFoundError):
        bob.fine_tuning.jobs.create(model=BASE, training_file=upload(bob, chat_jsonl()).id, validation_file=f.id)
    assert job.id not in [j.id for j in bob.fine_tuning.jobs.list().data]
    # a finished job cannot be cancelled
    with pytest.raises(openai.ConflictError):
        alice.fine_tuning.jobs.cancel(job.id)
    # vLLM's runtime LoRA loading serves an adapter to every tenant under a plain name; not one of the state
    # directory's (a tenant's own), so alice publishes a copy
    h = {"Authorization": f"Bearer {BOB}"}
    path = server.state_dir / "jobs" / job.id / "model"
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", headers=h,
                   json={"lora_name": "facts", "lora_path": str(path)})
    assert r.status_code == 403 and r.json()["error"]["param"] == "lora_path"
    published = shutil.copytree(path, tmp_path / "published")
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", headers=h,
                   json={"lora_name": "facts", "lora_path": str(published)})
    assert r.status_code == 200, r.text
    shared = bob.chat.completions.create(model="facts", messages=HELLO, max_tokens=8, temperature=0)
    assert shared.choices[0].message.content == tuned.choices[0].message.content
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", headers=h, json={"lora_name": "facts"})
    assert r.status_code == 200
    with pytest.raises(openai.NotFoundError):
        bob.chat.completions.create(model="facts", messages=HELLO)
    # OpenAI's model deletion: only the owner's fine-tuned model; its checkpoints stay servable
    for name in (done.fine_tuned_model, BASE, checkpoints[0].fine_tuned_model_checkpoint):
        with pytest.raises(openai.NotFoundError if name != BASE else openai.PermissionDeniedError):
            bob.models.delete(name)
    with pytest.raises(openai.PermissionDeniedError):
        alice.models.delete(checkpoints[0].fine_tuned_model_checkpoint)
    deleted = alice.models.delete(done.fine_tuned_model)
    assert deleted.deleted and deleted.id == done.fine_tuned_model
    assert done.fine_tuned_model not in [m.id for m in alice.models.list().data]
    with pytest.raises(openai.NotFoundError):
        alice.chat.completions.create(model=done.fine_tuned_model, messages=HELLO, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        alice.models.delete(done.fine_tuned_model)
    last = alice.chat.completions.create(model=checkpoints[0].fine_tuned_model_checkpoint, messages=HELLO,
                                         max_tokens=8, temperature=0)
    assert last.choices[0].message.content == tuned.choices[0].message.content  # the same adapter
    assert alice.fine_tuning.jobs.retrieve(job.id).fine_tuned_model == done.fine_tuned_model
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'coserve_fine_tuning_jobs{state="succeeded"}' in metrics
    count = [ln for ln in metrics.splitlines() if ln.startswith("coserve_time_to_first_token_seconds_count")]
    assert count and float(count[0].split()[-1]) > 0


def test_cancel_a_running_job_and_queue_limit(alice):
    f = upload(alice, chat_jsonl(CHAT_EXAMPLES * 20))  # 6,000 steps: running until cancelled
    job = alice.fine_tuning.jobs.create(model=BASE, training_file=f.id,
                                        hyperparameters={"n_epochs": 50})
    cancelled = alice.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled"
    assert alice.fine_tuning.jobs.retrieve(job.id).status == "cancelled"
    with pytest.raises(openai.ConflictError):
        alice.fine_tuning.jobs.cancel(job.id)
    many = [alice.fine_tuning.jobs.create(model=BASE, training_file=f.id, hyperparameters={"n_epochs": 50})
            for _ in range(3)]
    with pytest.raises(openai.RateLimitError):
        alice.fine_tuning.jobs.create(model=BASE, training_file=f.id)
    for j in many:
        alice.fine_tuning.jobs.cancel(j.id)
    page = alice.fine_tuning.jobs.list(limit=2)
    assert len(page.data) == 2 and page.has_more


def test_job_with_bad_data_fails_naming_the_line(alice):
    lines = chat_jsonl().decode().splitlines()
    lines[1] = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]})
    f = upload(alice, ("\n".join(lines) + "\n").encode())
    job = alice.fine_tuning.jobs.create(model=BASE, training_file=f.id)
    done = wait_for_job(alice, job.id)
    assert done.status == "failed" and "line 2" in done.error.message
    assert alice.chat.completions.create(model=BASE, messages=HELLO, max_tokens=2).choices  # still serving


def test_bad_job_requests(alice):
    f = upload(alice, chat_jsonl())
    cases = [({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs"),
             ({"suffix": "../../etc"}, "suffix"),
             ({"extra_body": {"coserve": {"target_modules": ["nope"]}}}, "coserve.target_modules"),
             ({"extra_body": {"coserve": {"memory_target": 1.5}}}, "coserve.memory_target"),
             ({"extra_body": {"coserve": {"memory_target": 0}}}, "coserve.memory_target"),
             ({"extra_body": {"coserve": {"rematerialize": "none"}}}, "coserve.rematerialize"),
             ({"method": {"type": "kto"}}, "method.type")]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            alice.fine_tuning.jobs.create(model=BASE, training_file=f.id, **kwargs)
        assert e.value.body["param"] == param, e.value.body


def test_an_ia3_job_is_servable(server, alice, model_factory):
    """An IA3 job's model serves at once, as HF PEFT computes it from the job's saved adapter."""
    f = upload(alice, chat_jsonl())
    hyper = {"n_epochs": 1, "batch_size": 1, "learning_rate_multiplier": 100}
    job = alice.fine_tuning.jobs.create(model=BASE, training_file=f.id, suffix="ia3", seed=3, hyperparameters=hyper,
                                        extra_body={"coserve": {"peft": "ia3"}})
    done = wait_for_job(alice, job.id)
    assert done.status == "succeeded", done.error
    prompt = [5, 17, 300, 42, 1000, 7]
    kwargs = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    tuned = alice.completions.create(model=done.fine_tuned_model, prompt=prompt, **kwargs).choices[0].text
    model = model_factory("llama")
    oracle = peft_model(model, server.state_dir / "jobs" / job.id / "model")
    assert tuned == AutoTokenizer.from_pretrained(str(model)).decode(hf_greedy(oracle, prompt, 8))
    assert tuned != alice.completions.create(model=BASE, prompt=prompt, **kwargs).choices[0].text


def test_least_recently_used_fine_tuned_models_are_unloaded(server, alice):
    f = upload(alice, chat_jsonl())
    job = alice.fine_tuning.jobs.create(model=BASE, training_file=f.id, seed=1,
                                        hyperparameters={"n_epochs": 1, "learning_rate_multiplier": 100})
    done = wait_for_job(alice, job.id)
    assert done.status == "succeeded", done.error
    names = [done.fine_tuned_model] + [c.fine_tuned_model_checkpoint
                                       for c in alice.fine_tuning.jobs.checkpoints.list(job.id).data][1:]
    assert len(names) >= 3  # the model and checkpoints at steps 2 and 4 (--checkpoint-steps 2)

    def chat(name):
        return alice.chat.completions.create(model=name, messages=HELLO, max_tokens=6, temperature=0).choices[0]

    first = chat(names[0]).message.content
    for name in names[1:]:
        chat(name)
    loaded = [ln for ln in httpx.get(f"{server.url}/metrics").text.splitlines()
              if ln.startswith("coserve_adapters_loaded ")]
    assert float(loaded[0].split()[-1]) <= 2
    assert chat(names[0]).message.content == first  # unloaded, loaded again: the same model


def test_a_background_response_is_queued_polled_and_cancellable(alice, bob):
    """OpenAI's ``background: true``: the response comes back at once, queued; GET polls it to the same output the
    request gets in the foreground; a long one is cancelled; only background responses are cancellable."""
    ask = {"model": BASE, "input": "Remember the word apple.", "max_output_tokens": 8, "temperature": 0}
    queued = alice.responses.create(**ask, background=True)
    assert queued.status in ("queued", "in_progress") and queued.background and queued.output == []
    deadline = time.monotonic() + 60
    while (polled := alice.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "the background response did not finish"
        time.sleep(0.05)
    foreground = alice.responses.create(**ask)
    assert polled.status == foreground.status and polled.output_text == foreground.output_text
    assert polled.usage.output_tokens == foreground.usage.output_tokens and polled.background
    assert foreground.background is False
    follow = alice.responses.create(model=BASE, input="Which word?", previous_response_id=queued.id,
                                    max_output_tokens=2)  # it continues as a stored response does
    assert follow.previous_response_id == queued.id
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(queued.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.cancel(queued.id)
    assert alice.responses.cancel(queued.id).status == polled.status  # ended already: as it ended
    long = alice.responses.create(model=BASE, input="Count.", max_output_tokens=450, background=True)
    cancelled = alice.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and alice.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError) as e:
        alice.responses.cancel(foreground.id)
    assert e.value.body["code"] == "response_not_cancellable"
    with pytest.raises(openai.BadRequestError) as e:
        alice.responses.create(**ask, background=True, store=False)
    assert e.value.body["param"] == "background"


def _text_of(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_a_background_response_streams_and_a_dropped_stream_picks_up_where_it_left_off(alice, bob):
    """``background`` with ``stream``: OpenAI's events, the response queued first; the stream can be dropped (the
    response runs on) and read again from any sequence number (``GET ?stream=true&starting_after=N``), while it runs
    and after it has ended, each reading the same events; a background response made without a stream streams by GET
    too. Only the owner's background responses stream; a cancelled one's stream ends there."""
    ask = {"model": BASE, "input": "Remember the word apple.", "max_output_tokens": 8, "temperature": 0}
    whole = list(alice.responses.create(**ask, background=True, stream=True))
    kinds = [e.type for e in whole]
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert whole[0].response.status == "queued" and whole[0].response.background
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in whole] == list(range(len(whole)))
    rid = whole[0].response.id
    foreground = alice.responses.create(**ask)
    assert _text_of(whole) == whole[-1].response.output_text == foreground.output_text
    assert alice.responses.retrieve(rid).output_text == foreground.output_text
    again = list(alice.responses.retrieve(rid, stream=True, starting_after=4))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in whole[5:]]
    assert [e.sequence_number for e in alice.responses.retrieve(rid, stream=True)] == list(range(len(whole)))

    long = alice.responses.create(model=BASE, input="Count.", max_output_tokens=120, temperature=0, background=True,
                                  stream=True)
    head = []
    for event in long:  # drop the stream a few events in
        head.append(event)
        if len(head) == 6:
            break
    long.close()
    rid = head[0].response.id
    rest = list(alice.responses.retrieve(rid, stream=True, starting_after=head[-1].sequence_number))
    assert rest[0].sequence_number == head[-1].sequence_number + 1 and rest[-1].type.startswith("response.")
    final = alice.responses.retrieve(rid)
    assert final.status in ("completed", "incomplete") and _text_of(head + rest) == final.output_text
    assert final.usage.output_tokens > 6  # it ran on with no stream reading it

    polled = alice.responses.create(**ask, background=True)  # made without a stream: streamed by GET all the same
    streamed = list(alice.responses.retrieve(polled.id, stream=True))
    assert streamed[-1].response.output_text == foreground.output_text
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(rid, stream=True)
    with pytest.raises(openai.BadRequestError) as e:
        alice.responses.retrieve(foreground.id, stream=True)
    assert e.value.body["param"] == "stream"
    with pytest.raises(openai.BadRequestError) as e:
        alice.responses.retrieve(rid, stream=True, starting_after=-2)
    assert e.value.body["param"] == "starting_after"

    cut = alice.responses.create(model=BASE, input="Count.", max_output_tokens=450, background=True, stream=True)
    first = next(iter(cut))
    assert alice.responses.cancel(first.response.id).status == "cancelled"
    assert not any(e.type == "response.completed" for e in cut)  # the stream ends where it was cancelled
    assert alice.responses.retrieve(first.response.id).status == "cancelled"
    alice.responses.delete(rid)  # a deleted response's events go with it
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(rid, stream=True)


def test_the_responses_api_gives_the_reply_texts_logprobs_as_the_chat_api_does(alice):
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: the reply's tokens, their logprobs and
    alternatives, equal to the chat API's for the same conversation; whole, and in a stream's deltas (each the
    tokens generated since the last), done events and final response; an unknown ``include`` value is a 400 naming
    it."""
    ask = {"model": BASE, "input": "Name a colour.", "max_output_tokens": 6, "temperature": 0}
    whole = alice.responses.create(**ask, include=["message.output_text.logprobs"], top_logprobs=2)
    chat = alice.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "Name a colour."}],
                                         max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    got = whole.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in got] == \
        [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in want]
    assert len(got) == whole.usage.output_tokens and all(len(t.top_logprobs) == 2 for t in got)
    assert alice.responses.create(**ask).output[0].content[0].logprobs == []  # not asked: none
    events = list(alice.responses.create(**ask, include=["message.output_text.logprobs"], stream=True))
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    final = events[-1].response.output[0].content[0].logprobs
    assert [t.logprob for t in done.logprobs] == [t.logprob for t in final] == [t.logprob for t in got]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and [t.token for e in deltas for t in e.logprobs] == [t.token for t in got]
    with pytest.raises(openai.BadRequestError) as e:
        alice.responses.create(**ask, include=["file_search_call.results"])
    assert e.value.body["param"] == "include[0]"
