"""The Evals API's inputs on plain data (``coserve/server/eval_data.py``): items from ``evals`` files, a run's
conversations from a template or a reference into the item, criteria's pass thresholds, graders' sample namespace."""

from __future__ import annotations

import pytest

from coserve.server.errors import APIError
from coserve.server.eval_data import (RunSource, grader_sample, item_messages, parse_criterion, parse_eval_jsonl,
                                      parse_input_messages)


def test_evals_files_hold_items_or_items_with_samples():
    data = b'{"item": {"q": 1}, "sample": {"output_text": "a"}}\n\n{"q": 2}\n'
    assert parse_eval_jsonl(data) == [{"item": {"q": 1}, "sample": {"output_text": "a"}},
                                      {"item": {"q": 2}, "sample": None}]
    for bad, message in [(b'{"q": 1}\n[1]\n', "line 2: expected an object"), (b"{\n", "line 1: not JSON"),
                         (b'{"item": {}, "sample": 3}\n', "line 1.sample: expected an object"), (b"\n", "no items")]:
        with pytest.raises(ValueError, match=message):
            parse_eval_jsonl(bad)


def test_a_run_renders_each_items_conversation():
    template, _ = parse_input_messages({"type": "template", "template": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Q: {{ item.q }}"}]}]})
    source = RunSource([], "m", template)
    assert item_messages(source, {"q": "why?"}) == [{"role": "developer", "content": "Be brief."},
                                                    {"role": "user", "content": "Q: why?"}]
    with pytest.raises(ValueError, match="the item has no item.q"):
        item_messages(source, {})
    ref = RunSource([], "m", None, "item.chat")
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert item_messages(ref, {"chat": chat}) == chat
    assert item_messages(RunSource([], "m", None, "item.q"), {"q": "hi"}) == [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="the item has no item.chat"):
        item_messages(ref, {"other": 1})
    with pytest.raises(ValueError, match="expected a conversation"):
        item_messages(ref, {"chat": [{"role": "user"}]})
    with pytest.raises(APIError) as e:
        parse_input_messages({"type": "item_reference", "item_reference": "sample.x"})
    assert e.value.param == "data_source.input_messages.item_reference"


def test_criteria_pass_at_their_thresholds():
    check = parse_criterion({"type": "string_check", "name": "c", "input": "", "reference": "", "operation": "eq",
                             "pass_threshold": 0.1}, "c")
    assert check.threshold is None and check.passed(1.0) and not check.passed(0.0)  # a match, whatever the threshold
    python = parse_criterion({"type": "python", "name": "p", "source": "def grade(s, i):\n    return 1.0\n"}, "p")
    assert python.threshold == 0.5 and python.passed(0.5) and not python.passed(0.49)
    score = parse_criterion({"type": "score_model", "name": "s", "model": "m", "range": [1, 7],
                             "input": [{"role": "user", "content": "x"}]}, "s")
    assert score.threshold == 4.0
    given = parse_criterion({"type": "text_similarity", "name": "t", "input": "", "reference": "",
                             "evaluation_metric": "bleu", "pass_threshold": 0.25}, "t")
    assert given.passed(0.25) and not given.passed(0.2)


def test_the_graders_sample_of_a_run_sample():
    assert grader_sample({"output_text": '{"a": 1}'})["output_json"] == {"a": 1}  # a jsonl run's, as given
    assert grader_sample({"output_text": "x", "output_json": {"b": 2}})["output_json"] == {"b": 2}
    completions = {"output": [{"role": "assistant", "content": "hi"}], "error": None}
    assert grader_sample(completions) == {"output_text": "hi", "output_json": None, "output_tools": []}


def test_a_stored_completions_source_picks_by_metadata_model_time_and_limit(tmp_path):
    """The tenant's stored chat completions as items (the messages each answered) and samples (its reply), oldest
    first; none stored after ``as_of`` (a resumed run's creation), so that a restarted run has the items it had."""
    from coserve.server.eval_data import stored_entries
    from coserve.server.store import Store
    s = Store(tmp_path)
    try:
        for i, (model, tag) in enumerate([("a", "x"), ("b", "x"), ("a", "x"), ("a", "y")]):
            reply = {"id": f"chatcmpl-{i}", "created": 10 * (i + 1), "model": model, "metadata": {"tag": tag},
                     "choices": [{"message": {"role": "assistant", "content": f"r{i}"}, "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
            s.add_chat_completion("alice", reply, [{"role": "user", "content": f"q{i}"}])
        picked = stored_entries({"type": "stored_completions", "metadata": {"tag": "x"}, "model": "a"}, s, "alice")
        assert [e["item"] for e in picked] == [
            {"input": [{"role": "user", "content": "q0"}], "completion_id": "chatcmpl-0"},
            {"input": [{"role": "user", "content": "q2"}], "completion_id": "chatcmpl-2"}]
        assert picked[1]["sample"]["output"] == [{"role": "assistant", "content": "r2"}]
        assert picked[1]["sample"]["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        ids = lambda source, **kw: [e["item"]["completion_id"] for e in stored_entries(source, s, "alice", **kw)]
        assert ids({"metadata": {"tag": "x"}}, as_of=25) == ["chatcmpl-0", "chatcmpl-1"]
        assert ids({"created_after": 20, "created_before": 30}) == ["chatcmpl-1", "chatcmpl-2"]
        assert ids({"limit": 3}) == ["chatcmpl-0", "chatcmpl-1", "chatcmpl-2"]
    finally:
        s.close()
