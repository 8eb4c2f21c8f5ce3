"""The server against clients' mistakes and clients that leave: every mistake is a 4xx in OpenAI's error shape
(never a 500, never an engine brought down), and a request whose client goes away is aborted in the engine."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from server_helpers import CHAT_EXAMPLES, chat_jsonl, start_server

ALICE, BOB = "key-alice", "key-bob"
BASE = "tiny"
HELLO = [{"role": "user", "content": "Hello there"}]
CHAT, COMPLETIONS, JOBS = "/v1/chat/completions", "/v1/completions", "/v1/fine_tuning/jobs"
NO_JOB = "ftjob-000000000000000000000000"
ERROR_FIELDS = {"message", "type", "param", "code"}
JOB_GB = 258_048 / 2**30  # what one default LoRA job on the tiny model holds (coserve.finetune.memory_budget)


@pytest.fixture(scope="module")
def server(model_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-errors")
    keys = root / "keys.txt"
    keys.write_text(f"{ALICE} alice\n{BOB} bob\n")
    srv = start_server(model_factory("llama"), root / "state", "--api-keys", str(keys), "--served-model-name", BASE,
                       "--allow-lora-loading", "--max-upload-bytes", "20000", "--max-waiting-requests", "8",
                       "--max-running-jobs", "3", "--finetune-memory-gb", str(2.5 * JOB_GB))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def alice(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {ALICE}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def bob(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {BOB}"}, timeout=60) as c:
        yield c


def error_of(r: httpx.Response, status: int) -> dict:
    """The error object of an OpenAI-shaped error response with ``status``."""
    assert r.status_code == status, (r.status_code, r.text[:300])
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, body
    return body["error"]


def gauge(server, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return 0.0


def outcomes(server) -> dict[str, float]:
    return {o: gauge(server, f'coserve_generation_requests_total{{outcome="{o}"}}') for o in ("ok", "cancelled")}


def wait_idle(server, timeout: float = 10) -> None:
    """Until the engine has no running or waiting request (fails after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while gauge(server, "coserve_requests_running") or gauge(server, "coserve_requests_waiting"):
        assert time.monotonic() < deadline, "requests are left in the engine"
        time.sleep(0.05)


def assert_alive(server) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_health_answers_head_as_get_without_a_key(server):
    """A load balancer's check may send HEAD; it needs no key, as GET does."""
    r = httpx.head(f"{server.url}/health")
    assert r.status_code == 200 and r.content == b""


def test_version_says_which_build_answers_without_a_key(server):
    """vLLM's ``GET /version``."""
    import coserve

    assert httpx.get(f"{server.url}/version").json() == {"version": coserve.__version__}


# ---- wrong JSON ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, param", [
    (CHAT, {"n": "2"}, "n"),
    (CHAT, {"stop": 5}, "stop"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    (CHAT, {"model": 5}, "model"),
    (CHAT, {"max_tokens": 2.5}, "max_tokens"),
    (CHAT, {"stream_options": "x", "stream": True}, "stream_options"),
    (CHAT, {"seed": 2**70}, "seed"),  # used to stop the engine (torch cannot seed with it)
    (CHAT, {"reasoning_effort": "lots"}, "reasoning_effort"),
    ("/v1/responses", {"model": BASE, "input": "hi", "reasoning": {"effort": "lots"}}, "reasoning.effort"),
    (COMPLETIONS, {"prompt": {"a": 1}}, "prompt"),
    (COMPLETIONS, {"prompt": ["a", 1]}, "prompt[1]"),
    (COMPLETIONS, {"prompt": "a", "echo": "yes"}, "echo"),
    (JOBS, {"hyperparameters": {"n_epochs": "abc"}}, "hyperparameters.n_epochs"),
    (JOBS, {"hyperparameters": {"learning_rate_multiplier": "abc"}}, "hyperparameters.learning_rate_multiplier"),
    (JOBS, {"metadata": {"a": 1}}, "metadata.a"),
    (JOBS, {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    (JOBS, {"training_file": 5}, "training_file"),
    (JOBS, {"seed": 2**40}, "seed"),
    (JOBS, {"method": "supervised"}, "method"),
    ("/v1/load_lora_adapter", {"lora_name": 5, "lora_path": "/x"}, "lora_name"),
])
def test_wrong_json_types_are_400_naming_the_field(alice, path, body, param):
    defaults = {CHAT: {"model": BASE, "messages": HELLO, "max_tokens": 2},
                COMPLETIONS: {"model": BASE, "prompt": "hi", "max_tokens": 2},
                JOBS: {"model": BASE, "training_file": "file-000000000000000000000000"}}.get(path, {})
    error = error_of(alice.post(path, json={**defaults, **body}), 400)
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, JOBS, "/v1/load_lora_adapter"])
@pytest.mark.parametrize("content, content_type", [
    (b"", "application/json"), (b"[1, 2]", "application/json"), (b"null", "application/json"),
    (b"{not json", "application/json"), (b'{"model": "\xff\xfe"}', "application/json"),
    (b'{"model": "tiny"}', "text/plain"), (b"model=tiny", "application/x-www-form-urlencoded")])
def test_bodies_that_are_no_json_object_are_400(alice, path, content, content_type):
    error_of(alice.post(path, content=content, headers={"content-type": content_type}), 400)


# a JSON string escape of an unpaired UTF-16 surrogate: Python's json decodes it to a str no tokenizer, encoder or
# SQLite bind takes (these were 500s: the tokenizer's TypeError, the store's UnicodeEncodeError)
LONE = "\\ud800x"


@pytest.mark.parametrize("path, body, param", [
    (CHAT, {"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),  # a lean route
    (CHAT, {"model": LONE}, "model"),
    (COMPLETIONS, {"prompt": ["ok", LONE]}, "prompt[1]"),
    ("/v1/responses", {"model": BASE, "input": LONE}, "input"),
    (JOBS, {"training_file": LONE}, "training_file"),  # a FastAPI route
    ("/tokenize", {"model": BASE, "prompt": LONE}, "prompt"),
    ("/v1/batches", {"input_file_id": LONE, "endpoint": CHAT, "completion_window": "24h"}, "input_file_id"),
])
def test_strings_that_are_no_unicode_text_are_400_naming_the_field(server, alice, path, body, param):
    defaults = {CHAT: {"model": BASE, "messages": HELLO, "max_tokens": 2},
                COMPLETIONS: {"model": BASE, "prompt": "hi", "max_tokens": 2},
                JOBS: {"model": BASE, "training_file": "file-000000000000000000000000"}}.get(path, {})
    raw = json.dumps({**defaults, **body}).replace("\\\\ud800", "\\ud800")  # the escape itself, as a client sends it
    error = error_of(alice.post(path, content=raw, headers={"content-type": "application/json"}), 400)
    assert error["param"] == param and error["code"] == "invalid_unicode", error
    assert error["message"].startswith(f"{param}: ") and "surrogate" in error["message"], error
    assert_alive(server)


@pytest.mark.parametrize("path, body, param", [
    (CHAT, {"x": [[[[]]]]}, None),  # not too deep: unknown fields are ignored
    (CHAT, {"x": json.loads("[" * 900 + "]" * 900)}, None),
    (JOBS, {"x": "DEEP"}, "body"), (CHAT, {"x": "DEEP"}, "body"),  # deeper than json parses: FastAPI's answer
    (CHAT, {"guided_regex": "(" * 600 + "a" + ")" * 600}, "guided_regex"),
    (CHAT, {"guided_grammar": "root ::= " + "(" * 600 + '"a"' + ")" * 600}, "guided_grammar"),
    (CHAT, {"guided_json": "NESTED"}, "guided_json"),
])
def test_bodies_nested_too_deeply_are_400(server, alice, path, body, param):
    """Nesting that made the parser or a compiler recurse past the interpreter's limit was a 500."""
    defaults = {CHAT: {"model": BASE, "messages": HELLO, "max_tokens": 2},
                JOBS: {"model": BASE, "training_file": "file-000000000000000000000000"}}[path]
    raw = json.dumps({**defaults, **body})
    raw = raw.replace('"DEEP"', "[" * 5000 + "]" * 5000)
    raw = raw.replace('"NESTED"', '{"type": "array", "items": ' * 450 + "{}" + "}" * 450)
    r = alice.post(path, content=raw, headers={"content-type": "application/json"})
    if param is None:
        assert r.status_code == 200, r.text[:300]
    else:
        error = error_of(r, 400)
        assert param == "body" and error["message"] == "There was an error parsing the body" or \
            error["param"] == param and "too deeply" in error["message"], error
    assert_alive(server)


def test_paired_surrogate_escapes_and_escaped_backslashes_are_text(alice):
    raw = json.dumps({"model": BASE, "max_tokens": 2, "messages": [{"role": "user", "content": "\U0001F600 a"}]})
    assert "\\ud83d\\ude00" in raw  # json.dumps writes the emoji as a pair of escapes
    assert alice.post(CHAT, content=raw, headers={"content-type": "application/json"}).status_code == 200
    raw = json.dumps({"model": BASE, "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800 is text"}]})
    assert alice.post(CHAT, content=raw, headers={"content-type": "application/json"}).status_code == 200


def test_a_training_file_line_that_is_no_unicode_text_is_refused_at_upload(alice):
    lines = chat_jsonl().decode().splitlines()
    lines[2] = lines[2].replace("What is two", "What is \\udc00 two")
    error = error_of(alice.post("/v1/files", files={"file": ("t.jsonl", "\n".join(lines).encode()),
                                                    "purpose": (None, "fine-tune")}), 400)
    assert "line 3: messages[0].content: " in error["message"] and "surrogate" in error["message"], error


def test_values_that_used_to_stop_the_engine(server, alice):
    """A seed torch cannot take, or a positive temperature so small that the logits overflow, stopped the engine
    thread (every later request failed); now the first is a 400 and the second is served."""
    for seed in (2**63, -2**63 - 1):
        error_of(alice.post(CHAT, json={"model": BASE, "messages": HELLO, "seed": seed}), 400)
    for seed in (2**63 - 1, -2**63):  # the ends of the range, with n > 1 (the server adds the choice's index)
        r = alice.post(CHAT, json={"model": BASE, "messages": HELLO, "seed": seed, "n": 2, "max_tokens": 2})
        assert r.status_code == 200, r.text
    r = alice.post(COMPLETIONS, json={"model": BASE, "prompt": "hi", "temperature": 5e-324, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert_alive(server)


# every field of a valid body (nested ones too) set in turn to each of these, or left out: a 2xx or a 4xx in
# OpenAI's shape, never a 5xx. A wider run of the same (28 values, also raw NaN/Infinity/huge numbers, 4,183
# requests over eight routes) found the surrogate and nesting 500s above.
ODD_VALUES = [None, -1, 0, 2**64, 1e308, 0.5, "", "x" * 3000, "\ud800", [], [None], {}, {"a": 1}, True]
VALID_BODIES = {
    CHAT: {"model": BASE, "max_tokens": 2, "messages": [{"role": "system", "content": "be brief"},
                                                       {"role": "user", "content": "hi"}],
           "temperature": 0.7, "top_p": 0.9, "n": 2, "stop": ["x"], "seed": 3, "logprobs": True, "top_logprobs": 2,
           "logit_bias": {"5": 1.0}, "stream": True, "stream_options": {"include_usage": True}, "top_k": 5,
           "repetition_penalty": 1.1, "response_format": {"type": "json_object"},
           "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
           "tool_choice": "none"},
    COMPLETIONS: {"model": BASE, "prompt": ["hi", "there"], "max_tokens": 2, "echo": True, "logprobs": 2,
                  "stop": "x", "temperature": 0, "prompt_logprobs": 1, "allowed_token_ids": [1, 2, 3],
                  "guided_regex": "[ab]+"},
    JOBS: {"model": BASE, "training_file": "FILE", "suffix": "s", "seed": 1,
           "hyperparameters": {"n_epochs": 1, "batch_size": 1, "learning_rate_multiplier": 1.0},
           "method": {"type": "supervised"}, "coserve": {"r": 4, "max_steps": 1, "target_modules": ["q_proj"]}},
    "/tokenize": {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True,
                  "chat_template_kwargs": {"enable_thinking": False}},
}


def _field_paths(value, prefix=()):
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        yield (*prefix, k)
        yield from _field_paths(v, (*prefix, k))


@pytest.mark.parametrize("path", list(VALID_BODIES))
def test_no_mutation_of_a_valid_body_is_a_server_error(server, alice, path):
    file_id = alice.post("/v1/files", files={"file": ("t.jsonl", chat_jsonl()), "purpose": (None, "fine-tune")}
                         ).json()["id"]
    valid = json.loads(json.dumps(VALID_BODIES[path]).replace('"FILE"', json.dumps(file_id)))
    first = alice.post(path, json=valid)
    assert first.status_code == 200, first.text[:300]  # so that each mutation is the one change from a valid body
    faults, jobs, ok = [], [first.json()["id"]] if path == JOBS else [], 0
    for where in _field_paths(valid):
        variants = [("=", v) for v in ODD_VALUES] + [("without", None)]
        for how, value in variants:
            body = json.loads(json.dumps(valid))
            parent = body
            for k in where[:-1]:
                parent = parent[k]
            if how == "without":
                if not isinstance(parent, dict):
                    continue
                del parent[where[-1]]
            else:
                parent[where[-1]] = value
            r = alice.post(path, content=json.dumps(body), headers={"content-type": "application/json"})  # escaped
            if r.status_code >= 500 or r.status_code >= 400 and set(r.json().get("error", {})) != ERROR_FIELDS:
                faults.append((where, how, repr(value)[:30], r.status_code, r.text[:200]))
            ok += r.status_code == 200
            if path == JOBS and r.status_code == 200:
                jobs.append(r.json()["id"])
    assert not faults, faults[:5]
    assert ok >= 10  # mutations the server took and ran (76, 41, 15 and 19 when written), not only refusals
    for job in jobs:  # what the mutations created runs no further
        alice.post(f"{JOBS}/{job}/cancel")
    assert_alive(server)


def test_a_priority_on_a_first_come_first_served_server_is_400(alice):
    error = error_of(alice.post(COMPLETIONS, json={"model": BASE, "prompt": "hi", "max_tokens": 2, "priority": 1}), 400)
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
    assert alice.post(COMPLETIONS, json={"model": BASE, "prompt": "hi", "max_tokens": 2, "priority": 0}).status_code == 200


def test_auto_tool_choice_without_a_parser_is_400_naming_the_flags(alice):
    weather = {"type": "function", "function": {"name": "get_weather"}}
    for extra in ({}, {"tool_choice": "auto"}):
        error = error_of(alice.post(CHAT, json={"model": BASE, "messages": HELLO, "max_tokens": 2,
                                                "tools": [weather], **extra}), 400)
        assert error["param"] == "tool_choice" and "--tool-call-parser hermes" in error["message"]


@pytest.mark.parametrize("path, field, value", [
    (COMPLETIONS, "suffix", "end"),
    (CHAT, "functions", [{"name": "f"}]), (CHAT, "function_call", {"name": "f"}),
    (CHAT, "stream_options", {"include_usage": True}),
])
def test_parameters_the_server_cannot_honour_are_400(alice, path, field, value):
    body = {"model": BASE, "max_tokens": 2, field: value,
            **({"messages": HELLO} if path == CHAT else {"prompt": "hi"})}
    assert error_of(alice.post(path, json=body), 400)["param"] == field
    neutral = {"suffix": None, "functions": [], "function_call": "none", "stream_options": None}[field]
    assert alice.post(path, json={**body, field: neutral}).status_code == 200


@pytest.mark.parametrize("extra, message", [
    ({"best_of": 1, "n": 2}, "at least n (2)"),
    ({"best_of": 3, "stream": True}, "cannot be streamed"),
    ({"best_of": 3, "use_beam_search": True}, "use_beam_search"),
    ({"best_of": 0}, None), ({"best_of": 17}, None), ({"best_of": "3"}, None), ({"best_of": True}, None),
    ({"best_of": 2.0}, None),
])
def test_a_best_of_that_cannot_be_honoured_is_400(alice, extra, message):
    body = {"model": BASE, "prompt": "hi", "max_tokens": 2, **extra}
    error = error_of(alice.post(COMPLETIONS, json=body), 400)
    assert error["param"] == "best_of" and (message is None or message in error["message"])
    same = {**body, "best_of": body.get("n", 1)}  # as many candidates as choices: honoured, streamed or not
    assert alice.post(COMPLETIONS, json=same).status_code == 200


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_penalties_and_logit_bias_are_honoured_and_bad_biases_are_400(alice, model_factory, path):
    from coserve.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_factory("llama"))
    body = {"model": BASE, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            **({"messages": HELLO} if path == CHAT else {"prompt": [5, 6, 7]})}

    def text(**extra) -> str:
        r = alice.post(path, json={**body, **extra})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if path == CHAT else choice["text"]

    plain = text()
    for field, value in (("presence_penalty", -2.0), ("frequency_penalty", 1.5), ("repetition_penalty", 1.2)):
        assert alice.post(path, json={**body, field: value}).status_code == 200
    forced = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(" forced"))[-1]
    assert text(logit_bias={str(forced): 100}) == tokenizer.decode([forced] * 4) != plain
    for bad in ({"abc": 1}, {"-3": 1}, {"99999999": 1}, {"5": 101}):
        assert error_of(alice.post(path, json={**body, "logit_bias": bad}), 400)["param"] == "logit_bias"
    assert error_of(alice.post(path, json={**body, "presence_penalty": 3}), 400)["param"] == "presence_penalty"


def test_tokenize_and_detokenize_as_vllm(alice, model_factory):
    from coserve.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_factory("llama"))
    r = alice.post("/tokenize", json={"model": BASE, "prompt": "Hello world"})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tokenizer("Hello world")["input_ids"] and r.json()["count"] == len(r.json()["tokens"])
    chat = alice.post("/tokenize", json={"model": BASE, "messages": HELLO}).json()
    rendered = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    back = alice.post("/detokenize", json={"model": BASE, "tokens": r.json()["tokens"]})
    assert back.json()["prompt"] == tokenizer.decode(r.json()["tokens"])
    assert error_of(alice.post("/detokenize", json={"model": BASE, "tokens": [10**9]}), 400)["param"] == "tokens"
    assert error_of(alice.post("/tokenize", json={"model": BASE}), 400)["param"] == "prompt"
    assert error_of(alice.post("/tokenize", json={"model": "nope", "prompt": "x"}), 404)["param"] == "model"
    assert httpx.post(f"{alice.base_url}/tokenize", json={"model": BASE, "prompt": "x"}).status_code == 401


def test_tokenizing_a_huge_prompt_does_not_stall_other_requests(server, alice):
    """A prompt of megabytes takes the tokenizer a second or more; on the event loop's thread it stalled every
    other request (and stream) meanwhile."""
    import threading

    done = []

    def post_big():
        start = time.monotonic()
        done.append(alice.post(COMPLETIONS, json={
            "model": BASE, "prompt": "hello world, this is a test. " * 50_000, "max_tokens": 2}))
        done.append(time.monotonic() - start)
    big = threading.Thread(target=post_big)
    big.start()
    time.sleep(0.3)
    start = time.monotonic()
    assert_alive(server)
    waited = time.monotonic() - start
    big.join()
    assert error_of(done[0], 400)["code"] == "context_length_exceeded"
    # Relative to the big request's own time, not a fixed bound (a loaded machine slows both): behind the
    # tokenizer on the event loop, /health would wait out most of it
    assert waited < 0.25 * done[1], f"/health waited {waited:.2f} s of the big request's {done[1]:.2f} s"


def test_chat_and_tokenize_take_vllms_chat_template_options(alice, model_factory):
    """``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs`` render as HF's
    ``apply_chat_template`` renders them (the oracle); a continued reply is the greedy continuation of exactly
    that prompt (the completions API on its ids); options that cannot apply are 400s naming the field."""
    from coserve.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_factory("llama"))
    prefixed = HELLO + [{"role": "assistant", "content": "Well, the"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    text = tokenizer.apply_chat_template(prefixed, tokenize=False, continue_final_message=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert alice.post("/tokenize", json={"model": BASE, "messages": prefixed, **options}).json()["tokens"] == ids
    closed = alice.post("/tokenize", json={"model": BASE, "messages": HELLO, "add_generation_prompt": False}).json()
    assert closed["tokens"] == tokenizer(tokenizer.apply_chat_template(HELLO, tokenize=False),
                                         add_special_tokens=False)["input_ids"]
    greedy = {"model": BASE, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    chat = alice.post(CHAT, json={**greedy, "messages": prefixed, **options,
                                  "chat_template_kwargs": {"enable_thinking": False}}).json()
    plain = alice.post(COMPLETIONS, json={**greedy, "prompt": ids}).json()
    assert chat["usage"]["prompt_tokens"] == len(ids)
    assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
    for body, param in [({"continue_final_message": True}, "continue_final_message"),
                        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
                        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
                        ({"add_generation_prompt": "yes"}, "add_generation_prompt")]:
        for path, extra in [(CHAT, greedy), ("/tokenize", {"model": BASE})]:
            assert error_of(alice.post(path, json={**extra, "messages": prefixed, **body}), 400)["param"] == param


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens_on_both_routes(alice):
    """vLLM's ``truncate_prompt_tokens``: a completion is the one the prompt's last k tokens give (echoed as their
    text), a chat's prompt is its rendered messages' last k tokens; a prompt over the context fits once cut; 0 and
    more than the context are 400s naming the field."""
    ids = list(range(20, 60))
    greedy = {"model": BASE, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    cut = alice.post(COMPLETIONS, json={**greedy, "prompt": ids, "truncate_prompt_tokens": 6, "echo": True}).json()
    plain = alice.post(COMPLETIONS, json={**greedy, "prompt": ids[-6:], "echo": True}).json()
    assert cut["usage"]["prompt_tokens"] == 6 and cut["choices"][0]["text"] == plain["choices"][0]["text"]
    chat = alice.post(CHAT, json={**greedy, "messages": HELLO, "truncate_prompt_tokens": 3}).json()
    rendered = alice.post("/tokenize", json={"model": BASE, "messages": HELLO}).json()["tokens"]
    assert chat["usage"]["prompt_tokens"] == 3
    alone = alice.post(COMPLETIONS, json={**greedy, "prompt": rendered[-3:]}).json()
    assert chat["choices"][0]["message"]["content"] == alone["choices"][0]["text"]
    too_long = {**greedy, "prompt": [21] * 5000}
    assert error_of(alice.post(COMPLETIONS, json=too_long), 400)["code"] == "context_length_exceeded"
    assert alice.post(COMPLETIONS, json={**too_long, "truncate_prompt_tokens": 16}).json()["usage"][
        "prompt_tokens"] == 16
    for bad in (0, -2, 10**6, "4"):
        for path, extra in [(COMPLETIONS, {"prompt": ids}), (CHAT, {"messages": HELLO})]:
            body = {**greedy, **extra, "truncate_prompt_tokens": bad}
            assert error_of(alice.post(path, json=body), 400)["param"] == "truncate_prompt_tokens"


def test_skip_special_tokens_false_streams_them_as_it_returns_them(alice, model_factory):
    """vLLM's ``skip_special_tokens`` on the server: False writes special tokens into the text, whole and
    streamed alike; True (the default) leaves them out."""
    from coserve.model.tokenizer import load_tokenizer

    special = load_tokenizer(model_factory("llama")).convert_tokens_to_ids("<|im_start|>")
    body = {"model": BASE, "messages": HELLO, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(special): 100}}
    assert alice.post(CHAT, json=body).json()["choices"][0]["message"]["content"] == ""
    whole = alice.post(CHAT, json={**body, "skip_special_tokens": False}).json()["choices"][0]["message"]["content"]
    assert whole == "<|im_start|>" * 3
    with alice.stream("POST", CHAT, json={**body, "skip_special_tokens": False, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == whole
    text = alice.post(COMPLETIONS, json={**body, "prompt": "x", "skip_special_tokens": False}).json()
    assert text["choices"][0]["text"] == whole
    assert error_of(alice.post(CHAT, json={**body, "skip_special_tokens": "no"}), 400)["param"] == "skip_special_tokens"


def test_bad_words_reach_the_engine_from_both_routes(alice, model_factory):
    """vLLM's ``bad_words``: a one-token word that ``logit_bias`` would force is never written; a blank word is a 400
    naming the field."""
    from coserve.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_factory("llama"))
    word, token = next((w, ids[0]) for w in ("the", "a", "hello", "x", "e")
                       for ids in [tokenizer.encode(w, add_special_tokens=False)] if len(ids) == 1)
    body = {"model": BASE, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logit_bias": {str(token): 100},
            "logprobs": 0, "prompt": "hi"}
    forced = alice.post(COMPLETIONS, json=body).json()["choices"][0]
    assert forced["text"] == tokenizer.decode([token] * 4)
    kept_out = alice.post(COMPLETIONS, json={**body, "bad_words": [word]}).json()["choices"][0]
    assert word not in kept_out["logprobs"]["tokens"]
    chat = {"model": BASE, "messages": HELLO, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(token): 100}, "logprobs": True}
    content = alice.post(CHAT, json={**chat, "bad_words": [word]}).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and word not in [t["token"] for t in content]
    for path, extra in [(COMPLETIONS, body), (CHAT, chat)]:
        assert error_of(alice.post(path, json={**extra, "bad_words": [" "]}), 400)["param"] == "bad_words"


def test_prompt_logprobs_in_vllms_form_on_both_routes(alice):
    """vLLM's ``prompt_logprobs``: per prompt token after the first, the token's own logprob and rank, then the
    top N, keyed by token id; the logprobs are the echoed prompt's (tested against HF elsewhere); a top-N
    token's rank is its place, and the token's own rank agrees with them. Not with ``stream``: a 400."""
    ids = [5, 17, 29, 41, 53, 65, 77]
    base = {"model": BASE, "max_tokens": 2, "temperature": 0}
    echoed = alice.post(COMPLETIONS, json={**base, "prompt": ids, "echo": True, "logprobs": 2}).json()["choices"][0]
    both = alice.post(COMPLETIONS, json={**base, "prompt": ids, "echo": True, "logprobs": 2,
                                         "prompt_logprobs": 3}).json()["choices"][0]
    assert both["logprobs"] == echoed["logprobs"]  # the echo's top-2 stays 2 though 3 were scored
    scored = both["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    for i, entry in enumerate(scored[1:], start=1):
        first, *top = entry.items()
        assert first[0] == str(ids[i]) and first[1]["logprob"] == echoed["logprobs"]["token_logprobs"][i]
        own = first[1]["rank"]  # the top 3 less the token itself where it is one of them
        assert [v["rank"] for _, v in top] == ([1, 2, 3] if len(top) == 3 else [r for r in (1, 2, 3) if r != own])
        assert own > sum(v["logprob"] > first[1]["logprob"] for _, v in top)
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())
    chat = alice.post(CHAT, json={**base, "messages": HELLO, "prompt_logprobs": 1, "n": 2}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert "prompt_logprobs" not in alice.post(CHAT, json={**base, "messages": HELLO}).json()
    for path, extra in [(COMPLETIONS, {"prompt": ids}), (CHAT, {"messages": HELLO})]:
        r = alice.post(path, json={**base, **extra, "prompt_logprobs": 1, "stream": True})
        assert error_of(r, 400)["param"] == "prompt_logprobs"
        assert error_of(alice.post(path, json={**base, **extra, "prompt_logprobs": 21}), 400)["param"] == \
            "prompt_logprobs"


def test_return_tokens_as_token_ids_names_each_logprob_by_its_id(alice, model_factory):
    """vLLM's ``return_tokens_as_token_ids`` (what RL trainers read exact tokens from): logprobs name tokens
    ``"token_id:N"``; the ids are the prompt's and those whose text is the reply's; nothing else changes."""
    from coserve.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_factory("llama"))
    ids = [5, 17, 29, 41]
    body = {"model": BASE, "prompt": ids, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "echo": True,
            "logprobs": 2}
    named = alice.post(COMPLETIONS, json={**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
    plain = alice.post(COMPLETIONS, json=body).json()["choices"][0]
    tokens = named["logprobs"]["tokens"]
    assert tokens[:4] == [f"token_id:{i}" for i in ids] and all(t.startswith("token_id:") for t in tokens)
    made = [int(t.split(":")[1]) for t in tokens[4:]]
    assert plain["text"] == tokenizer.decode(ids) + tokenizer.decode(made, skip_special_tokens=True)
    for key in ("token_logprobs", "text_offset"):
        assert named["logprobs"][key] == plain["logprobs"][key]
    assert all(k.startswith("token_id:") for top in named["logprobs"]["top_logprobs"][1:] for k in top)
    chat = {"model": BASE, "messages": HELLO, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}
    reply = alice.post(CHAT, json=chat).json()["choices"][0]
    content = reply["logprobs"]["content"]
    assert tokenizer.decode([int(t["token"].split(":")[1]) for t in content], skip_special_tokens=True) == \
        reply["message"]["content"]
    assert all(x["token"].startswith("token_id:") for t in content for x in t["top_logprobs"])


def test_chat_echo_begins_the_reply_with_the_continued_message(alice):
    """vLLM's chat ``echo``: with the last message the assistant's (as ``continue_final_message`` continues it), the
    reply is that message's text and then the new text, whole and streamed; with the last message a user's, echo
    adds nothing."""
    prefixed = HELLO + [{"role": "assistant", "content": "Well, the"}]
    body = {"model": BASE, "messages": prefixed, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "add_generation_prompt": False, "continue_final_message": True}
    plain = alice.post(CHAT, json=body).json()["choices"][0]["message"]["content"]
    echoed = alice.post(CHAT, json={**body, "echo": True}).json()["choices"][0]["message"]["content"]
    assert echoed == "Well, the" + plain
    with alice.stream("POST", CHAT, json={**body, "echo": True, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Well, the"}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == echoed
    user_last = {"model": BASE, "messages": HELLO, "max_tokens": 3, "temperature": 0}
    assert alice.post(CHAT, json={**user_last, "echo": True}).json()["choices"][0]["message"] == \
        alice.post(CHAT, json=user_last).json()["choices"][0]["message"]
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}}  # (a random model writes an unknown key on and on otherwise)
    named = {**body, "echo": True, "max_tokens": 40, "ignore_eos": False, "tools": [tool],
             "tool_choice": {"type": "function", "function": {"name": "lookup"}}}
    whole = alice.post(CHAT, json=named).json()["choices"][0]["message"]
    assert whole["content"] == "Well, the" and whole["tool_calls"][0]["function"]["name"] == "lookup"
    with alice.stream("POST", CHAT, json={**named, "stream": True}) as s:  # the echo rides in the role chunk too
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == whole["content"]
    assert "".join(call["function"].get("arguments") or "" for d in deltas for call in d.get("tool_calls") or []) \
        == whole["tool_calls"][0]["function"]["arguments"]


# ---- query parameters, paths, uploads ----------------------------------------------------------------------
@pytest.mark.parametrize("path", [
    "/v1/files?limit=abc", "/v1/files?limit=0", "/v1/files?order=sideways", "/v1/files?after=file-x",
    f"{JOBS}?limit=abc", f"{JOBS}?limit=0", f"{JOBS}?limit=101", f"{JOBS}?limit=99999999999999999999999",
    f"{JOBS}?after=ftjob-x"])
def test_bad_query_parameters_are_400(alice, path):
    param = path.split("?")[1].split("=")[0]
    assert error_of(alice.get(path), 400)["param"] == param


def test_files_are_paged_as_openai_does(alice):
    ids = [alice.post("/v1/files", files={"file": ("t.jsonl", chat_jsonl()), "purpose": (None, "fine-tune")})
           .json()["id"] for _ in range(3)]
    newest = alice.get("/v1/files", params={"limit": 1}).json()
    assert [f["id"] for f in newest["data"]] == ids[-1:] and newest["has_more"]
    rest = alice.get("/v1/files", params={"limit": 10, "after": ids[-1]}).json()
    assert [f["id"] for f in rest["data"]][:2] == [ids[1], ids[0]]
    oldest_first = [f["id"] for f in alice.get("/v1/files", params={"order": "asc"}).json()["data"]]
    assert oldest_first[-3:] == ids
    for i in ids:
        assert alice.delete(f"/v1/files/{i}").status_code == 200


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/files/{id}"), ("GET", "/v1/files/{id}/content"), ("DELETE", "/v1/files/{id}"),
    ("GET", JOBS + "/{id}"), ("POST", JOBS + "/{id}/cancel"), ("GET", JOBS + "/{id}/events"),
    ("GET", JOBS + "/{id}/checkpoints"), ("GET", "/v1/models/{id}")])
@pytest.mark.parametrize("odd", ["..%2F..%2Fstate.db", "x" * 5000, "file-000000000000000000000000", NO_JOB,
                                 "%00", "ft:tiny::" + NO_JOB])
def test_odd_or_unknown_ids_are_404(alice, method, path, odd):
    error_of(alice.request(method, path.replace("{id}", odd)), 404)


def test_upload_mistakes_are_4xx(server, alice):
    good = chat_jsonl()
    cases = [({"files": {"purpose": (None, "fine-tune")}}, 400, "file"),
             ({"files": {"file": ("t.jsonl", good)}}, 400, "purpose"),
             ({"files": {"file": ("t.jsonl", b"\xff\xfe{}"), "purpose": (None, "fine-tune")}}, 400, "file"),
             ({"files": {"file": ("t.jsonl", b""), "purpose": (None, "fine-tune")}}, 400, "file"),
             ({"files": [("file", ("a.jsonl", good)), ("file", ("b.jsonl", good)),
                         ("purpose", (None, "fine-tune"))]}, 400, None),
             ({"json": {"purpose": "fine-tune", "file": "x"}}, 400, "file"),
             ({"content": b"garbage", "headers": {"content-type": "multipart/form-data; boundary=zz"}}, 400, None),
             ({"content": b"garbage", "headers": {"content-type": "multipart/form-data"}}, 400, None)]
    for kwargs, status, param in cases:
        error = error_of(alice.post("/v1/files", **kwargs), status)
        assert param is None or error["param"] == param, (kwargs, error)

    def chunks():  # no content-length: the limit is enforced on the bytes as they arrive
        yield b'--zz\r\nContent-Disposition: form-data; name="file"; filename="t.jsonl"\r\n\r\n'
        for _ in range(30):
            yield good[:1000].ljust(1000)
        yield b"\r\n--zz--\r\n"
    error_of(alice.post("/v1/files", content=chunks(), headers={"content-type": "multipart/form-data; boundary=zz"}),
             413)
    assert_alive(server)


def test_a_file_in_use_cannot_be_deleted_and_unknown_jobs_cannot_be_cancelled(alice):
    long = chat_jsonl(CHAT_EXAMPLES * 20)  # 6,000 steps: running until cancelled
    f = alice.post("/v1/files", files={"file": ("t.jsonl", long), "purpose": (None, "fine-tune")}).json()
    job = alice.post(JOBS, json={"model": BASE, "training_file": f["id"], "hyperparameters": {"n_epochs": 50}}).json()
    assert error_of(alice.delete(f"/v1/files/{f['id']}"), 409)["code"] == "file_in_use"
    assert alice.post(f"{JOBS}/{job['id']}/cancel").json()["status"] == "cancelled"
    assert alice.delete(f"/v1/files/{f['id']}").json()["deleted"]
    error_of(alice.post(f"{JOBS}/{NO_JOB}/cancel"), 404)
    error_of(alice.delete(f"/v1/files/{f['id']}"), 404)


def test_jobs_wait_for_memory_and_start_fairly_across_tenants(alice, bob):
    """The finetuning memory budget has room for two jobs: a third waits, queued (it used to fail at once), and when
    a job ends, the next to start is that of the tenant running fewer jobs, not the oldest queued. Cancelling is
    prompt while jobs run (the engine thread took its lock back after each iteration: waits of seconds)."""
    def upload(client):
        return client.post("/v1/files", files={"file": ("t.jsonl", chat_jsonl(CHAT_EXAMPLES * 20)),
                                               "purpose": (None, "fine-tune")}).json()["id"]

    def create(client, file_id):
        return client.post(JOBS, json={"model": BASE, "training_file": file_id,
                                       "hyperparameters": {"n_epochs": 50}}).json()["id"]

    def cancel(client, job_id):  # promptly: between two iterations, not after the engine thread lets go its lock
        start = time.monotonic()
        assert client.post(f"{JOBS}/{job_id}/cancel").json()["status"] == "cancelled"
        assert time.monotonic() - start < 1.0, f"cancelling took {time.monotonic() - start:.2f} s"

    def status(client, job_id):
        return client.get(f"{JOBS}/{job_id}").json()["status"]

    def wait(client, job_id, want):
        deadline = time.monotonic() + 20
        while status(client, job_id) != want:
            assert time.monotonic() < deadline, f"{job_id} is still {status(client, job_id)}"
            time.sleep(0.05)

    def events(client, job_id):
        return [e["message"] for e in client.get(f"{JOBS}/{job_id}/events").json()["data"]]

    fa, fb = upload(alice), upload(bob)
    a = [create(alice, fa) for _ in range(3)]
    for j in a[:2]:
        wait(alice, j, "running")
    deadline = time.monotonic() + 20
    while not any(m.startswith("Waiting for finetuning memory") for m in events(alice, a[2])):
        assert status(alice, a[2]) == "queued" and time.monotonic() < deadline
        time.sleep(0.05)
    b = create(bob, fb)
    assert status(bob, b) == "queued"
    cancel(alice, a[0])
    wait(bob, b, "running")
    assert status(alice, a[2]) == "queued"
    cancel(alice, a[1])
    wait(alice, a[2], "running")
    cancel(alice, a[2])
    cancel(bob, b)


# ---- security ------------------------------------------------------------------------------------------------
def test_lora_path_in_the_state_directory_is_refused(server, bob, tmp_path):
    """A tenant's fine-tuned adapters lie in the state directory; loading one by path would serve it to all."""
    inside = server.state_dir / "jobs" / "ftjob-111111111111111111111111" / "model"
    inside.mkdir(parents=True)
    (inside / "adapter_config.json").write_text("{}")
    link = tmp_path / "innocent"
    link.symlink_to(inside)
    for path in (inside, link, f"{server.state_dir}/files/../jobs/ftjob-111111111111111111111111/model"):
        r = bob.post("/v1/load_lora_adapter", json={"lora_name": "stolen", "lora_path": str(path)})
        assert error_of(r, 403)["param"] == "lora_path"
    assert "stolen" not in [m["id"] for m in bob.get("/v1/models").json()["data"]]


def test_unrouted_paths_do_not_become_metric_labels(server, alice):
    alice.get("/v1/no-such-route-7f3a")
    httpx.get(f"{server.url}/v1/unauthenticated-9b2c")
    text = httpx.get(f"{server.url}/metrics").text
    assert "7f3a" not in text and "9b2c" not in text
    assert 'route="/v1/files/{file_id}"' in text or 'route="/v1/models"' in text


# ---- clients that leave, streaming -----------------------------------------------------------------------------
def test_a_non_streamed_request_is_aborted_when_its_client_leaves(server):
    wait_idle(server)
    before = outcomes(server)
    body = {"model": BASE, "prompt": "Once", "n": 4, "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}{COMPLETIONS}", json=body, headers={"Authorization": f"Bearer {ALICE}"}, timeout=0.2)
    wait_idle(server, timeout=5)
    after = outcomes(server)
    assert after["cancelled"] - before["cancelled"] == 4 and after["ok"] == before["ok"]


def test_a_streamed_request_is_aborted_when_its_client_leaves(server, alice):
    wait_idle(server)
    before = outcomes(server)
    body = {"model": BASE, "messages": HELLO, "n": 2, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with alice.stream("POST", CHAT, json=body) as r:
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # a first piece of text: leave
    wait_idle(server, timeout=5)
    after = outcomes(server)
    assert after["cancelled"] - before["cancelled"] == 2 and after["ok"] == before["ok"]


def streamed(client: httpx.Client, path: str, body: dict) -> tuple[dict[int, str], list[dict]]:
    """Each choice's streamed text, and every chunk."""
    texts: dict[int, str] = {}
    chunks = []
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    for d in data[:-1]:
        chunks.append(json.loads(d))
        for c in chunks[-1]["choices"]:
            piece = c["text"] if "text" in c else c["delta"].get("content")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
    return texts, chunks


def test_streams_match_whole_answers_with_stops_n_and_echo(alice):
    base = {"model": BASE, "prompt": "The scheduler decides", "max_tokens": 40, "temperature": 0}
    text = alice.post(COMPLETIONS, json=base).json()["choices"][0]["text"]
    for start, length in ((3, 1), (10, 3), (len(text) // 2, 5), (len(text) - 4, 2)):
        stops = [text[start:start + length], "never-generated-zq"]
        whole = alice.post(COMPLETIONS, json={**base, "stop": stops}).json()["choices"][0]
        got, _ = streamed(alice, COMPLETIONS, {**base, "stop": stops})
        assert got[0] == whole["text"] and not any(s in got[0] for s in stops), (stops, got[0])
    sampled = {"model": BASE, "messages": HELLO, "max_tokens": 6, "n": 3, "seed": 11, "temperature": 1}
    whole = alice.post(CHAT, json=sampled).json()
    got, chunks = streamed(alice, CHAT, sampled)
    assert got == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]) == [0, 1, 2]
    echo = {"model": BASE, "prompt": [[1, 500, 600], [1, 700]], "max_tokens": 3, "temperature": 0, "echo": True,
            "n": 2}
    whole = alice.post(COMPLETIONS, json=echo).json()
    got, _ = streamed(alice, COMPLETIONS, echo)
    assert got == {c["index"]: c["text"] for c in whole["choices"]} and len(got) == 4
    scored = {**echo, "logprobs": 2}  # echo with logprobs: the prompt's come with the first token, null first
    whole = alice.post(COMPLETIONS, json=scored).json()
    got, chunks = streamed(alice, COMPLETIONS, scored)
    assert got == {c["index"]: c["text"] for c in whole["choices"]}
    for c in whole["choices"]:
        parts = [ch["choices"][0]["logprobs"] for ch in chunks if ch["choices"][0]["index"] == c["index"]
                 and ch["choices"][0]["logprobs"]]
        joined = {k: [v for p in parts for v in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                                 "text_offset")}
        assert joined == c["logprobs"] and joined["token_logprobs"][0] is None


def test_an_event_stream_whose_generator_never_starts_still_aborts(monkeypatch):
    """A client gone before the first event: Starlette cancels the response before iterating the generator, whose
    ``finally`` then never runs; the requests, already in the engine, must be aborted all the same."""
    from coserve.server.choices import Choice, EventStream, Job
    from coserve.server.generation import TextDelta

    class FakeStream:
        closed = False

        async def aclose(self):
            self.closed = True

    class FakeMetrics:
        done: list = []

        def request_done(self, outcome, n=1):
            self.done.append((outcome, n))

    class FakeContext:
        metrics = FakeMetrics()

    async def never_iterated():
        raise AssertionError("not reached")
        yield ""

    async def gone():
        return {"type": "http.disconnect"}

    async def sink(message):
        await asyncio.sleep(0.01)

    job = Job("chatcmpl-x", 0, BASE, 2, [Choice(i, [1], FakeStream(), TextDelta()) for i in range(2)])
    gen = never_iterated()
    asyncio.run(EventStream(gen, job, FakeContext())({"type": "http", "asgi": {"spec_version": "2.3"}}, gone, sink))
    assert all(c.stream.closed for c in job.choices)
    assert FakeContext.metrics.done == [("cancelled", 2)]


def test_an_adapter_unloaded_before_its_request_reaches_the_engine(model_factory, tmp_path):
    """A route resolves ``model`` to an adapter, and only later does the engine thread take the request; an unload in
    between sees no request using the adapter and succeeds. The request must then fail alone (it used to reach the
    executor, whose KeyError stopped the engine for everyone)."""
    from peft_helpers import make_lora_adapter

    from coserve.engine.config import EngineConfig
    from coserve.engine.engine_loop import EngineLoop
    from coserve.engine.llm_engine import LLMEngine
    from coserve.scheduler import SamplingParams
    from coserve.server.errors import APIError
    from coserve.server.generation import EngineClient

    model = model_factory("llama")
    engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", device="cpu"))
    engine.load_adapter("shared", make_lora_adapter(model, tmp_path / "shared"))
    loop = EngineLoop(engine)
    params = SamplingParams(max_tokens=2)

    async def run() -> None:
        client = EngineClient(loop, 8)
        request, _ = engine.make_request([1, 2, 3], params, "shared", request_id="resolved-before-unload")
        loop.call(lambda: engine.unload_adapter("shared"))
        with pytest.raises(APIError) as e:
            [out async for out in client.submit(request)]
        assert e.value.status == 404
        other, _ = engine.make_request([1, 2, 3], params, None, request_id="after")
        assert [out async for out in client.submit(other)][-1].finished  # the engine still serves

    try:
        asyncio.run(run())
        assert loop.error is None
    finally:
        loop.stop()


def test_a_closed_stream_leaves_no_output_behind_in_the_engine_loop(model_factory):
    """A stream closed before its end (a client gone) aborted its request without a listener, so the abort's final
    output was kept for a ``wait_for`` no one calls: 600 of them after a minute of clients leaving."""
    from coserve.engine.config import EngineConfig
    from coserve.engine.engine_loop import EngineLoop
    from coserve.engine.llm_engine import LLMEngine
    from coserve.scheduler import SamplingParams
    from coserve.server.generation import EngineClient

    engine = LLMEngine(EngineConfig(model=str(model_factory("llama")), dtype="float32", device="cpu"))
    loop = EngineLoop(engine)

    async def leave_early() -> None:
        client = EngineClient(loop, 8)
        for i in range(6):
            request, _ = engine.make_request([1, 2, 3 + i], SamplingParams(max_tokens=64, ignore_eos=True),
                                             request_id=f"left-{i}")
            stream = client.submit(request)
            for _ in range(i % 3):  # closed before its first token, or after one or two
                await stream.__anext__()
            await stream.aclose()
        done, _ = engine.make_request([4, 5], SamplingParams(max_tokens=2), request_id="stays")
        assert [out async for out in client.submit(done)][-1].finished

    try:
        asyncio.run(leave_early())
        loop.wait_until(lambda: not engine.has_unfinished_requests())
        loop.call(lambda: None)  # the aborts' final outputs have been passed on
        assert loop.finished == {} and loop.listeners == {} and loop.error is None
    finally:
        loop.stop()


def test_requests_submitted_but_not_yet_queued_count_against_capacity():
    """Submissions wait for the engine thread before they show in the scheduler's queue: a burst used to pass a
    capacity check of that queue alone, however large."""
    from types import SimpleNamespace

    from coserve.server.errors import APIError
    from coserve.server.generation import EngineClient

    posted = []
    scheduler = SimpleNamespace(waiting=[], running=[])
    loop = SimpleNamespace(engine=SimpleNamespace(scheduler=scheduler), listeners={},
                           post=lambda fn, arrival=False: posted.append(arrival))

    async def burst() -> None:
        client = EngineClient(loop, max_waiting_requests=4)
        streams = []
        for i in range(4):
            client.check_capacity(1)
            streams.append(client.submit(SimpleNamespace(request_id=f"r{i}", adapter=None)))
        with pytest.raises(APIError) as e:
            client.check_capacity(1)
        assert e.value.status == 503
        await streams[0].aclose()  # a client gone: its place is free again
        client.check_capacity(1)

    asyncio.run(burst())
    assert posted == [True] * 4 + [False]  # four submissions (arrivals) and one abort


def test_capacity_is_whole_again_after_everything_above(server, alice):
    """Last in this module: every request of the tests above (finished, failed, aborted) has given back its place
    in the count of requests submitted and not ended; a leak would turn the server away with 503s for good."""
    wait_idle(server)
    r = alice.post(CHAT, json={"model": BASE, "messages": HELLO, "n": 8, "max_tokens": 2})  # the whole queue
    assert r.status_code == 200, r.text


def test_a_checkpoint_is_recorded_only_after_the_events_of_its_steps(tmp_path):
    """The watcher read a job's step records on the engine thread, then its checkpoints later on its own: a step the
    engine ran in between left a checkpoint in the store without its step's event, and a server killed then resumed
    from that checkpoint with the event lost for good (test_server_restart saw a step missing)."""
    from types import SimpleNamespace

    from coserve.finetune.job import StepRecord
    from coserve.server.config import ServerConfig
    from coserve.server.jobs import JobManager, Running
    from coserve.server.metrics import ServerMetrics
    from coserve.server.store import Store

    store = Store(tmp_path / "state")
    job_id = "ftjob-" + "a" * 24
    store.add_job("alice", {"id": job_id, "status": "running", "coserve": {"step": 0}})
    ft = SimpleNamespace(log=[], step=0, tokens_done=0, total_steps=10)
    engine = SimpleNamespace(job_states={job_id: SimpleNamespace(status="running", error=None, job=ft)})
    loop = SimpleNamespace(engine=engine, post_and_wait=lambda fn: fn())  # posted work runs at once
    jobs = JobManager(store, loop, ServerConfig(model="m", state_dir=str(tmp_path / "state")),
                      ServerMetrics(lambda: {}, lambda: {}), SimpleNamespace(base="base"))
    r = Running(job_id, "alice", f"ft:base::{job_id}", 1, ft)
    jobs.running[job_id] = r

    def engine_step():  # what the engine thread does at an optimizer step (checkpoint_every = 1)
        ft.step += 1
        ft.log.append(StepRecord(ft.step, loss=1.0, lr=1e-4, tokens=8, elapsed_s=0.0))
        r.saved.append((ft.step, tmp_path / f"step-{ft.step}"))

    add_event = store.add_event

    def add_event_while_the_engine_runs(*args, **kwargs):
        if ft.step == 1:  # once: the engine's next step lands while the watcher records the first one
            engine_step()
        return add_event(*args, **kwargs)
    store.add_event = add_event_while_the_engine_runs
    engine_step()
    for steps in ([1], [1, 2]):  # a kill may come after any round: the store must hold no checkpoint ahead
        jobs._follow()
        checkpoints = sorted(c["step_number"] for c in store.list_checkpoints(job_id, limit=100)[0])
        assert checkpoints == steps and all(store.has_step_event(job_id, step) for step in steps)


def test_checkpoints_are_written_off_the_engine_thread_and_all_recorded_when_the_job_ends(model_factory, tmp_path,
                                                                                          monkeypatch):
    """A checkpoint save used to run on the engine thread between two iterations, holding every request up for as
    long as the disk took. Now the engine thread only copies it; a writer thread writes it, and a job that ends
    while one is being written still has it recorded."""
    import threading
    from types import SimpleNamespace

    import torch

    from coserve.finetune import checkpoint
    from coserve.finetune.config import FinetuneConfig
    from coserve.finetune.job import Example, FinetuneJob
    from coserve.finetune.runner import run_job
    from coserve.model.loader import load_model
    from coserve.peft.config import LoraConfig
    from coserve.peft.trainable import TrainableLora, load_trainable
    from coserve.server import jobs as jobs_module
    from coserve.server.config import ServerConfig
    from coserve.server.jobs import JobManager, Running
    from coserve.server.metrics import ServerMetrics
    from coserve.server.store import Store

    model = load_model(model_factory("llama"), torch.float32, torch.device("cpu"))
    bypass = TrainableLora(LoraConfig(r=4, target_modules=["down_proj"]), model.module_shapes(),
                           model.cfg.num_layers, model.device, torch.Generator().manual_seed(0))
    examples = [Example(list(range(5, 25)), list(range(6, 25)) + [-100])] * 2
    ft = FinetuneJob(model, bypass, examples, FinetuneConfig(output_dir=str(tmp_path / "out"), max_steps=2,
                                                             batch_size=1, optimizer="adamw", lr=0.1))
    store = Store(tmp_path / "state")
    job_id = "ftjob-" + "b" * 24
    store.add_job("alice", {"id": job_id, "status": "running", "coserve": {"step": 0}})
    state = SimpleNamespace(status="running", error=None, job=ft)
    loop = SimpleNamespace(engine=SimpleNamespace(job_states={job_id: state}), post=lambda fn: fn(), error=None,
                           thread=SimpleNamespace(is_alive=lambda: True))
    jobs = JobManager(store, loop, ServerConfig(model="m", state_dir=str(tmp_path / "state")),
                      ServerMetrics(lambda: {}, lambda: {}), SimpleNamespace(base="base"))
    r = Running(job_id, "alice", f"ft:base::{job_id}", 1, ft)
    jobs.running[job_id] = r
    release, writers = threading.Event(), []

    def slow_write(path, snap):  # the disk is slow: the write waits until the test lets it go
        writers.append(threading.current_thread().name)
        release.wait(30)
        checkpoint.write_checkpoint(path, snap)
    monkeypatch.setattr(jobs_module, "write_checkpoint", slow_write)
    at_step_1 = {}

    def on_step(j):
        if j.step == 1:  # the engine thread's part returns while the write is still held up
            jobs._checkpoint(r)
            at_step_1.update({k: v.clone() for k, v in j.bypass.state_dict().items()})
    ft.on_step = on_step
    run_job(ft, progress=False)  # step 2 trains while step 1's checkpoint is still being written
    assert ft.step == 2 and len(r.writes) == 1 and not r.writes[0].done() and not r.saved
    state.status = "cancelled"
    threading.Timer(0.2, release.set).start()
    assert jobs._record(r, "cancelled", None, [], [], ft.step, ft.tokens_done) == "cancelled"
    assert writers == ["coserve-checkpoints_0"]
    assert [c["step_number"] for c in store.list_checkpoints(job_id, limit=10)[0]] == [1]
    saved = load_trainable(tmp_path / "state" / "jobs" / job_id / "checkpoints" / "step-1", model.module_shapes(),
                           model.cfg.num_layers, model.device)
    for name, tensor in saved.state_dict().items():  # the step-1 adapter, not what training made of it after
        assert torch.equal(tensor, at_step_1[name]) and not torch.equal(tensor, bypass.state_dict()[name])
    jobs.stop()


def test_a_checkpoint_that_cannot_be_written_is_told_and_training_goes_on(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from coserve.server import jobs as jobs_module
    from coserve.server.config import ServerConfig
    from coserve.server.jobs import JobManager, Running
    from coserve.server.metrics import ServerMetrics
    from coserve.server.store import Store

    def full_disk(path, snap):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(jobs_module, "write_checkpoint", full_disk)
    store = Store(tmp_path / "state")
    job_id = "ftjob-" + "c" * 24
    store.add_job("alice", {"id": job_id, "status": "running", "coserve": {"step": 0}})
    ft = SimpleNamespace(log=[], step=3, tokens_done=0, total_steps=10, snapshot=lambda: "snapshot")
    jobs = JobManager(store, SimpleNamespace(engine=None), ServerConfig(model="m", state_dir=str(tmp_path / "state")),
                      ServerMetrics(lambda: {}, lambda: {}), SimpleNamespace(base="base"))
    r = Running(job_id, "alice", f"ft:base::{job_id}", 1, ft)
    jobs._checkpoint(r)
    r.wait_for_writes()
    assert jobs._record(r, "running", None, [], [], 3, 0) == "running"
    events = store.list_events(job_id, limit=10)[0]
    assert any("checkpoint at step 3 could not be written (No space left on device)" in e["message"]
               and e["level"] == "warn" for e in events)
    assert store.list_checkpoints(job_id, limit=10)[0] == []
    jobs.stop()


def test_a_fine_tuned_model_is_read_off_the_engine_thread_once_for_a_burst_of_first_requests(model_factory, tmp_path):
    """Loading a fine-tuned model on first use used to read its files on the engine thread, holding every
    iteration up; and each of a burst of first requests read it again."""
    import threading

    from peft_helpers import make_lora_adapter

    from coserve.engine.config import EngineConfig
    from coserve.engine.engine_loop import EngineLoop
    from coserve.engine.llm_engine import LLMEngine
    from coserve.server.models import ModelRegistry
    from coserve.server.store import Store

    model = model_factory("llama")
    adapter_dir = make_lora_adapter(model, tmp_path / "ft")
    engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", device="cpu"))
    reads = []
    read = engine.read_adapter

    def counted(name, path):
        reads.append(threading.current_thread().name)
        return read(name, path)
    engine.read_adapter = counted
    loop = EngineLoop(engine)
    registry = ModelRegistry("base", loop, Store(tmp_path / "state"), tmp_path / "state")
    name = "ft:base:x:ftjob-" + "d" * 24
    registry.fine_tuned_path = lambda tenant, n: adapter_dir if n == name else None

    async def burst():
        return await asyncio.gather(*(registry.resolve("alice", name) for _ in range(5)))
    try:
        assert asyncio.run(burst()) == [name] * 5
        assert len(reads) == 1 and reads[0] not in ("coserve-engine", threading.main_thread().name)
        assert name in engine.adapters and list(registry.loaded) == [name]
        assert asyncio.run(registry.resolve("alice", name)) == name and len(reads) == 1  # loaded: not read again
    finally:
        loop.stop()
