"""The server's small pure pieces: streamed text deltas, names, keys files, upload checks, the load workload."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import pytest

from coserve.bench.server_load import build_requests, finetune_jsonl
from coserve.server.auth import load_keys_file
from coserve.server.config import is_loopback
from coserve.server.generation import TextDelta
from coserve.server.models import checkpoint_name, fine_tuned_name
from coserve.server.training_files import validate_training_jsonl


def test_text_delta_holds_back_what_a_stop_string_may_cut():
    d = TextDelta.for_stops(["END"])
    assert d.next("hello E", False) == "hello"  # the last len("END") - 1 = 2 characters are held back
    assert d.next("hello EN", False) == " "
    assert d.next("hello ", True) == ""  # the stop string completed and was cut: nothing of it was sent
    whole = TextDelta.for_stops([])
    assert whole.next("ab", False) == "ab" and whole.next("abc", True) == "c"


def test_text_delta_holds_an_unfinished_utf8_character():
    d = TextDelta.for_stops([])
    assert d.next("caf\ufffd", False) == "caf"
    assert d.next("café", False) == "é"


def test_model_names():
    name = fine_tuned_name("base", "sfx", "ftjob-" + "a" * 24)
    assert name == "ft:base:sfx:ftjob-" + "a" * 24
    assert checkpoint_name(name, 7).endswith(":ckpt-step-7")
    assert fine_tuned_name("base", None, "j") == "ft:base::j"


def test_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")


def test_keys_file_errors_name_the_line(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\nk1 alice\nk2\n")
    with pytest.raises(ValueError, match=r"keys:3: expected 'KEY TENANT'"):
        load_keys_file(f)
    f.write_text("k1 alice\nk1 bob\n")
    with pytest.raises(ValueError, match=r"keys:2: this key is already given"):
        load_keys_file(f)
    f.write_text("k1 ../etc\n")
    with pytest.raises(ValueError, match="tenant"):
        load_keys_file(f)
    f.write_text("k1 alice\nk2 bob\n")
    assert load_keys_file(f) == {"k1": "alice", "k2": "bob"}


def test_training_upload_check():
    good = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    assert validate_training_jsonl((good + "\n\n" + good + "\n").encode()) == 2
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        validate_training_jsonl((good + "\n{oops\n").encode())
    with pytest.raises(ValueError, match=r"line 1: messages\[0\].role"):
        validate_training_jsonl(b'{"messages": [{"role": "bot", "content": "x"}]}\n')
    with pytest.raises(ValueError, match="line 2: not UTF-8"):
        validate_training_jsonl(good.encode() + b"\n\xff\xfe\n")
    with pytest.raises(ValueError, match="no example"):
        validate_training_jsonl(b"\n\n")


def test_finetune_jsonl_turns_alpaca_into_chat(tmp_path):
    f = tmp_path / "a.json"
    f.write_text(json.dumps([{"instruction": "Add", "input": "1 and 2", "output": "3"}, {"text": "skipped"}]))
    lines = finetune_jsonl(f).decode().splitlines()
    assert json.loads(lines[0]) == {"messages": [{"role": "user", "content": "Add\n\n1 and 2"},
                                                 {"role": "assistant", "content": "3"}]}
    assert len(lines) == 1
    validate_training_jsonl(finetune_jsonl(f))


def test_load_workload_fits_the_context(tiny_model):
    from coserve.model.tokenizer import load_tokenizer
    tok = load_tokenizer(tiny_model)
    args = argparse.Namespace(seed=1, prompts=str(tiny_model / "absent.json"), num_requests=30, rate=5.0,
                              length_scale=1.0, max_prompt_len=10_000, max_tokens=400, model=str(tiny_model))
    reqs = build_requests(args, tok)
    assert len(reqs) == 30 and [r[0] for r in reqs] == sorted(r[0] for r in reqs)
    for _, text, out in reqs:
        assert len(tok(text)["input_ids"]) + out <= 512


def test_what_http_adds_is_the_difference_of_the_two_phases_median_ttfts():
    from coserve.bench.server_load import http_added_ms

    def row(phase, p50):
        return {"phase": phase, "ttft_s": {"p50": p50}}

    assert abs(http_added_ms(row("in-process", 0.060), row("http", 0.0635)) - 3.5) < 1e-9
    assert http_added_ms(row("in-process", 0.060), None) is None  # one phase only
    assert http_added_ms(row("in-process", 0.060), row("http", None)) is None  # no request got a first token
    assert abs(http_added_ms(row("in-process (all)", 0.055), row("http (all)", 0.058)) - 3.0) < 1e-9


def _choice(index, submitted_at, first_token_at, prompt_len, output_len, first_text_at=None):
    from types import SimpleNamespace

    from coserve.server.choices import Choice
    out = SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(output_len)))], num_cached_tokens=0)
    return Choice(index, list(range(prompt_len)), SimpleNamespace(submitted_at=submitted_at), TextDelta(),
                  out=out, first_token_at=first_token_at, first_text_at=first_text_at)


def test_a_generation_logs_where_its_first_tokens_time_went():
    from coserve.server.choices import Job
    job = Job("chatcmpl-x", 0, "base", n=2, arrived=10.0)
    assert job.log_fields() == {"id": "chatcmpl-x", "model": "base"}  # refused before any choice started
    job.choices = [_choice(0, 10.002, 10.050, 5, 3), _choice(1, 10.002, 10.040, 5, 4)]
    fields = job.log_fields()
    assert fields["ttft_ms"] == pytest.approx(40.0) and fields["engine_ttft_ms"] == pytest.approx(38.0)  # choice 1
    assert (fields["prompt_tokens"], fields["completion_tokens"]) == (5, 7)  # one prompt, both choices' outputs
    assert "first_text_ms" not in fields  # not streamed: no event was written
    job.choices = [_choice(0, 10.002, 10.050, 5, 3, first_text_at=10.060),  # its text held back 10 ms
                   _choice(1, 10.002, 10.040, 5, 4, first_text_at=10.090)]
    assert job.log_fields()["first_text_ms"] == pytest.approx(60.0)  # the first event of any choice


def test_a_streams_first_text_held_back_after_its_first_token_is_split_from_the_client_and_the_wire():
    from coserve.bench.metrics import RequestRecord
    r = RequestRecord(0.0, 0.100, 0.5, 10, 5, engine_ttft_s=0.040, server_ttft_s=0.042, server_text_s=0.090)
    assert r.server_before_engine_s == pytest.approx(0.002) and r.client_and_wire_s == pytest.approx(0.058)
    assert r.held_text_s == pytest.approx(0.048)  # of the client's and the wire's 58 ms, 48 were the server's hold
    assert RequestRecord(0.0, 0.1, 0.5, 10, 5, server_ttft_s=0.042).held_text_s is None  # not logged


def test_the_access_log_line_carries_the_arrival_and_the_generations_fields(caplog):
    """The middleware notes the arrival for the route, and adds the route's Job fields to its JSON line."""
    import asyncio
    import logging

    from coserve.server.auth import Authenticator
    from coserve.server.metrics import ServerMetrics
    from coserve.server.middleware import ACCESS_LOGGER, ServerMiddleware
    seen = {}

    class FakeJob:
        def log_fields(self):
            return {"id": "cmpl-1", "engine_ttft_ms": 12.5}

    async def app(scope, receive, send):
        seen["arrived"] = scope["state"]["arrived"]
        if scope["path"] == "/v1/completions":
            scope["state"]["job"] = FakeJob()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    middleware = ServerMiddleware(app, Authenticator({}), ServerMetrics(dict, dict), 1000, 1000)

    async def call(path):
        scope = {"type": "http", "path": path, "method": "POST", "headers": []}

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            pass
        await middleware(scope, receive, send)

    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        asyncio.run(call("/v1/completions"))
        asyncio.run(call("/v1/models"))
    first, second = (json.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER)
    assert isinstance(seen["arrived"], float)
    assert first["id"] == "cmpl-1" and first["engine_ttft_ms"] == 12.5 and first["status"] == 200
    assert first["tenant"] == "default" and first["path"] == "/v1/completions"
    assert "id" not in second and second["path"] == "/v1/models"


def test_engine_ttfts_are_read_from_the_servers_access_log():
    from coserve.bench.server_load import engine_ttfts
    log = "\n".join([
        "2026-11-25 10:00:00,000 INFO coserve.server: a job started",
        '2026-11-25 10:00:00,001 INFO coserve.access: {"path": "/v1/models", "status": 200}',
        '2026-11-25 10:00:00,002 INFO coserve.access: {"id": "chatcmpl-a", "engine_ttft_ms": 61.5, "ttft_ms": 62.5, '
        '"first_text_ms": 70.0}',
        '2026-11-25 10:00:00,003 INFO coserve.access: {"id": "chatcmpl-b"}',  # no first token: not counted
        "2026-11-25 10:00:00,004 INFO coserve.access: {not json",
        '2026-11-25 10:00:00,005 INFO coserve.access: ["a list"]',
        '2026-11-25 10:00:00,006 INFO coserve.access: {"id": "chatcmpl-c", "engine_ttft_ms": 40.0}',
    ])
    found = engine_ttfts(log)
    assert found == {"chatcmpl-a": (pytest.approx(0.0615), pytest.approx(0.0625), pytest.approx(0.070)),
                     "chatcmpl-c": (pytest.approx(0.040), None, None)}


def test_what_http_adds_outside_the_engine_is_the_difference_of_the_per_request_medians():
    from coserve.bench.metrics import RequestRecord
    from coserve.bench.server_load import LoadSpec, http_added_ms, phase_row
    spec = LoadSpec("m", [], None, 0.05, 5.0, 60.0, "float32", None, 0)
    inproc = [RequestRecord(0.0, 0.0605, 0.2, 10, 5, engine_ttft_s=0.060),  # 0.5 ms outside the engine
              RequestRecord(1.0, 1.1006, 1.3, 10, 5, engine_ttft_s=0.100)]  # 0.6 ms
    http = [RequestRecord(0.0, 0.0545, 0.2, 10, 5, engine_ttft_s=0.050),  # 4.5 ms
            RequestRecord(1.0, 1.1045, 1.3, 10, 5, engine_ttft_s=0.100),  # 4.5 ms
            RequestRecord(2.0, 2.3, 2.5, 10, 5),  # its engine's part unknown: not in the split
            RequestRecord(3.0, None, None, 0, 0, failed=True)]
    a, b = phase_row("in-process", inproc, {"elapsed_s": 2.0}, spec), phase_row("http", http, {"elapsed_s": 4.0}, spec)
    assert (a["num_split"], b["num_split"]) == (2, 2)
    assert a["outside_engine_s"]["p50"] == pytest.approx(0.00055) and b["outside_engine_s"]["p50"] == pytest.approx(0.0045)
    assert http_added_ms(a, b, "outside_engine_s") == pytest.approx(3.95)
    assert http_added_ms(a, b, "engine_ttft_s") == pytest.approx(-5.0)  # the engine's waits: 75 against 80 ms


def test_a_warm_up_sends_one_untimed_request_and_its_failure_raises_naming_it_where_a_load_counts_a_failure():
    import asyncio

    from coserve.bench.server_load import WARM_UP, LoadSpec, drive, warm_up
    spec = LoadSpec("m", [(0.0, "a", 3), (0.01, "b", 4)], None, 0.05, 5.0, 60.0, "float32", None, 0)
    sent = []

    async def send(message, max_tokens, clock):
        sent.append((message, max_tokens))
        if message == "b":
            raise ConnectionError("reset")
        return clock(), 5, max_tokens, None, f"id-{message}"

    asyncio.run(warm_up(send))
    assert sent == [WARM_UP]
    records, ids, _ = asyncio.run(drive(spec, send))
    assert sent == [WARM_UP, ("a", 3), ("b", 4)]  # the load itself: each request once
    assert ids == ["id-a", None] and [r.num_output_tokens for r in records] == [3, 0]
    assert not records[0].failed and records[1].failed and "reset" in records[1].error  # a load request: counted

    async def refused(message, max_tokens, clock):
        raise ConnectionError("refused")

    with pytest.raises(RuntimeError, match="warm-up request before the load failed: ConnectionError: refused"):
        asyncio.run(warm_up(refused))


@pytest.mark.parametrize("client_stream, client_http", [("objects", "aiohttp"), ("lines", "httpx")])
def test_the_http_phase_drives_a_live_server_from_a_client_at_its_nice_value(model_factory, client_stream,
                                                                             client_http):
    """``bench-server``'s HTTP phase end to end: a ``coserve serve`` child, the load from a spawned client process
    at ``client_nice`` (reading chunk objects or the events' lines, over the openai client's aiohttp or httpx
    transport), and each request's engine part read back from the server's access log."""
    from coserve.bench.server_load import LoadSpec, phase_row, run_http
    spec = LoadSpec(str(model_factory("llama")), [(0.0, "Hello there", 3), (0.05, "Tell me a story", 4)], None,
                    0.05, 5.0, 120.0, "float32", None, 0, client_nice=3, client_stream=client_stream,
                    client_http=client_http)
    records, extra = run_http(spec)
    assert extra["client_nice"] == min(19, os.nice(0) + 3)  # this process's value, plus 3
    assert extra["client_stream"] == client_stream and extra["client_http"] == client_http
    assert [(r.completed, r.num_output_tokens) for r in records] == [(True, 3), (True, 4)]
    assert all(r.num_prompt_tokens > 5 for r in records)  # the usage event was read
    assert all(r.engine_ttft_s is not None and 0 < r.engine_ttft_s <= r.ttft_s for r in records)
    row = phase_row("http", records, extra, spec)
    assert row["client_nice"] == extra["client_nice"] and row["num_split"] == 2 and row["num_failed"] == 0
    assert row["client_cpu_ms_per_request"] == pytest.approx(1000 * extra["client_cpu_s"] / 2) and extra["client_cpu_s"] > 0
    # the time outside the engine splits into the server's part before it and the client's and the wire's
    for r in records:
        assert 0 < r.server_before_engine_s and 0 < r.client_and_wire_s
        assert r.server_before_engine_s + r.client_and_wire_s == pytest.approx(r.outside_engine_s)
    assert row["server_before_engine_s"]["p50"] > 0 and row["client_and_wire_s"]["p50"] > 0
    # the server's event loop ran the two requests (its main thread's CPU time, read from /proc)
    assert extra["server_loop_cpu_s"] > 0
    assert row["server_loop_cpu_ms_per_request"] == pytest.approx(1000 * extra["server_loop_cpu_s"] / 2)


def test_the_load_client_transport_is_checked_at_the_boundary_naming_the_flag(monkeypatch):
    import importlib.util

    from coserve.bench.server_load import check_client_http
    check_client_http("httpx")
    check_client_http("aiohttp")  # the test extras install openai[aiohttp]
    with pytest.raises(ValueError, match="--client-http: one of aiohttp, httpx, got 'curl'"):
        check_client_http("curl")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "aiohttp" else real(name, *a))
    with pytest.raises(ValueError, match=r"--client-http aiohttp: .*openai\[aiohttp\].*--client-http httpx"):
        check_client_http("aiohttp")
    check_client_http("httpx")


def test_the_client_niceness_is_checked_at_the_boundary_and_a_negative_one_is_tried_first(monkeypatch):
    import subprocess

    from coserve.bench.server_load import check_client_nice
    for ok in (0, 19):
        check_client_nice(ok)
    for bad in (-21, 20):
        with pytest.raises(ValueError, match=f"--client-nice: must be -20 to 19, got {bad}"):
            check_client_nice(bad)
    tried = []

    def run(cmd, **kw):
        tried.append(cmd[-1])
        return subprocess.CompletedProcess(cmd, 1)  # as for a user without the privilege
    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(ValueError, match="--client-nice -5: lowering a niceness needs root or CAP_SYS_NICE"):
        check_client_nice(-5)
    assert tried == ["import os; os.nice(-5)"]
    check_client_nice(-5, client_runs=False)  # --phase in-process: no client, nothing to try
    assert tried == ["import os; os.nice(-5)"]
    with pytest.raises(ValueError, match="--client-nice: must be -20 to 19, got 20"):
        check_client_nice(20, client_runs=False)  # still a bad value


def test_a_stream_line_is_read_as_its_event_and_an_error_event_raises_with_its_message():
    from coserve.bench.server_load import stream_event
    assert stream_event('data: {"id": "c1", "choices": []}') == {"id": "c1", "choices": []}
    assert stream_event("data: [DONE]") is None and stream_event("") is None and stream_event(": ping") is None
    with pytest.raises(RuntimeError, match="engine failed"):
        stream_event('data: {"error": {"message": "The engine failed", "type": "server_error"}}')


def test_the_http_phases_server_gets_the_stream_interval_and_the_slo_options_the_serve_parser_reads():
    from coserve.bench.server_load import LoadSpec, server_command
    from coserve.server.serve_command import add_arguments
    spec = LoadSpec("m", [(0.0, "hi", 3)], None, 0.04, 5.0, 60.0, "float32", None, 0, stream_interval=4,
                    slo={"slo_tpot_ms": 40.0, "slo_margin": 0.1, "load_margin_max": 0.1, "finetune_burst_ms": None})
    cmd = server_command(spec, 8123, "/tmp/state")
    assert cmd[1:4] == ["-m", "coserve.cli", "serve"] and "--finetune-burst-ms" not in cmd
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(cmd[4:])
    assert (args.stream_interval, args.slo_tpot_ms, args.slo_margin, args.load_margin_max) == (4, 40.0, 0.1, 0.1)
    assert args.gil_switch_interval_ms == 0.5
    assert args.finetune_burst_ms is None and args.port == 8123


def test_a_threads_cpu_time_is_read_and_an_unreadable_one_is_none():
    from coserve.bench.server_load import thread_cpu_s
    before = thread_cpu_s(os.getpid(), threading.get_native_id())
    end = time.thread_time() + 0.05  # this thread's own CPU time (the kernel counts it in 10 ms ticks)
    while time.thread_time() < end:
        pass
    assert thread_cpu_s(os.getpid(), threading.get_native_id()) > before
    assert thread_cpu_s(os.getpid(), 2**31 - 1) is None


def test_the_interleaved_load_starts_once_its_client_is_warm_and_a_client_that_ends_first_raises_naming_it():
    import multiprocessing
    from concurrent.futures import Future

    from coserve.bench.interleaved import await_warm
    ours, theirs = multiprocessing.Pipe()
    theirs.send("warm")
    await_warm(ours, Future(), 1.0)  # the client's word arrived: the start can be sent
    failed = Future()
    failed.set_exception(RuntimeError("the interleaved run's HTTP client failed: warm-up request ... refused"))
    with pytest.raises(RuntimeError, match="HTTP client failed: warm-up request"):
        await_warm(ours, failed, 1.0)  # its own error, not a wait for the timeout
    ended = Future()
    ended.set_result(([], {}))
    with pytest.raises(RuntimeError, match="HTTP client ended before its warm-up request"):
        await_warm(ours, ended, 1.0)
    with pytest.raises(RuntimeError, match="HTTP client was not warm in 0 s"):
        await_warm(ours, Future(), 0.1)


def test_an_interleaved_run_sends_alternate_requests_through_http_and_in_process_on_one_server(model_factory):
    """``bench-server --phase interleaved`` end to end: one spawned host serves HTTP (uvicorn, as ``coserve serve``
    runs) and drives the odd requests on its own objects; a client process sends the even ones over HTTP from the
    same start; a job created in the host trains beside both halves."""
    from coserve.bench.interleaved import halves, run_interleaved
    from coserve.bench.server_load import LoadSpec, phase_row
    data = b'{"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there"}]}\n'
    requests = [(0.0, "Hello there", 3), (0.05, "Tell me a story", 4), (0.1, "Why", 2), (0.15, "How so", 5)]
    spec = LoadSpec(str(model_factory("llama")), requests, data, 0.05, 5.0, 120.0, "float32", None, 0)
    inproc, http = halves(spec)
    assert [r[2] for r in http.requests] == [3, 2] and [r[2] for r in inproc.requests] == [4, 5]
    assert http.finetune_jsonl is None and inproc.finetune_jsonl == data  # the host creates the job
    swapped_inproc, swapped_http = halves(spec, swap=True)  # the next repeat: each request the other way
    assert swapped_inproc.requests == http.requests and swapped_http.requests == inproc.requests
    assert swapped_http.finetune_jsonl is None and swapped_inproc.finetune_jsonl == data
    done = run_interleaved(spec)
    (in_records, in_extra), (http_records, http_extra) = done["in-process"], done["http"]
    assert [(r.completed, r.num_output_tokens) for r in http_records] == [(True, 3), (True, 2)]
    assert [(r.completed, r.num_output_tokens) for r in in_records] == [(True, 4), (True, 5)]
    # one start for both halves: each request was sent at its arrival offset on the shared clock
    for record, (offset, _, _) in zip(http_records + in_records, http.requests + inproc.requests):
        assert offset - 0.005 <= record.arrival_s < offset + 1.0  # (timers wake within a ms)
    assert all(r.engine_ttft_s is not None and 0 < r.engine_ttft_s <= r.ttft_s for r in http_records + in_records)
    assert all(r.server_before_engine_s > 0 for r in http_records)  # read from the host's access log
    assert all(r.held_text_s >= 0 for r in http_records)  # the first text's event: at or after the first token
    # one job served both halves: both carry the run's time and tokens
    assert in_extra["finetune_tokens"] > 0 and http_extra["finetune_tokens"] == in_extra["finetune_tokens"]
    assert http_extra["elapsed_s"] == in_extra["elapsed_s"] and in_extra["job_status"] in ("running", "succeeded")
    row = phase_row("http (interleaved)", http_records, http_extra, spec)
    assert row["num_failed"] == 0 and row["num_split"] == 2 and row["client_cpu_ms_per_request"] > 0


def test_lora_modules_take_vllms_forms_beside_adapter(tmp_path):
    """``--lora-modules`` as vLLM takes it (NAME=PATH or a JSON object, several after one flag) serves the same
    adapters as ``--adapter``; a malformed one, or a name given twice, is refused naming the flag."""
    from coserve.server.serve_command import add_arguments, configs, served_adapters
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "m", "--state-dir", str(tmp_path / "state"), "--adapter", "a=/p/a",
                              "--lora-modules", "b=/p/b", '{"name": "c", "path": "/p/c", "base_model_name": "m"}'])
    config, _ = configs(args, warn_without_keys=False)
    assert config.adapters == {"a": "/p/a", "b": "/p/b", "c": "/p/c"}
    for specs, message in [(["b"], "--lora-modules: expected NAME=PATH"),
                           (['{"name": "b"}'], "--lora-modules: expected"),
                           (["{nope"], "--lora-modules: .* is not JSON"),
                           (["a=/other"], "--lora-modules: the adapter name 'a' is given twice")]:
        with pytest.raises(ValueError, match=message):
            served_adapters(["a=/p/a"], specs)
