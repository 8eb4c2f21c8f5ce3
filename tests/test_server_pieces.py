"""The server's small pure pieces: streamed text deltas, names, keys files, upload checks, the load workload."""

from __future__ import annotations

import argparse
import json

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
