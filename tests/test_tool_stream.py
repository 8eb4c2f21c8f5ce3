"""Tool calls streamed as they are written: every prefix of a call's text shows a name only once it is whole and
arguments that the final text's arguments extend; fed piece by piece, a stream's deltas join into exactly the
reply read from the finished text (content and calls), with the arguments sent before the output ends."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coserve.server.call_text import NotACall, scan_call, scan_call_list
from coserve.server.tool_parser import parse_tool_calls
from coserve.server.tool_stream import ToolCallStream
from coserve.server.tools import ToolPlan, tool_call

HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\\"is", "days": [1, 2], '
          '"deep": {"a": {}}}}\n</tool_call>\n<tool_call>{"arguments": "{\\"x\\": 1}", "name": "t"}</tool_call>')


def feed(stream: ToolCallStream, text: str, sizes, final: tuple[str | None, list[dict]]):
    """Stream ``text`` in pieces of the given sizes, then finish it; what a client would put together."""
    content, calls, pieces_before_end = "", {}, 0

    def take(new_content, deltas, at_end):
        nonlocal content, pieces_before_end
        content += new_content
        for d in deltas:
            call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in d:
                assert call["id"] is None and d["type"] == "function" and "name" in d["function"]
                call["id"], call["name"] = d["id"], d["function"]["name"]
            assert call["name"] is not None  # a call's first delta names it
            piece = d["function"].get("arguments", "")
            call["arguments"] += piece
            pieces_before_end += bool(piece) and not at_end
    at, sizes = 0, iter(sizes)
    while at < len(text):
        at = min(len(text), at + next(sizes))
        take(*stream.update(text[:at]), False)
    take(*stream.finish(text, *final), True)
    return content, [calls[i] for i in sorted(calls)], pieces_before_end


def test_a_call_shows_its_name_once_whole_and_arguments_that_only_grow():
    text = '{"name": "get_weather", "arguments": {"city": "P\\u00e9", "n": [1, {"b": "}"}]}}'
    final = scan_call(text, 0, ("arguments",))
    assert final.name == "get_weather" and final.end == len(text) and final.arguments_done
    assert json.loads(final.arguments) == {"city": "Pé", "n": [1, {"b": "}"}]}
    names = []
    for cut in range(len(text) + 1):
        view = scan_call(text[:cut], 0, ("arguments",))
        names.append(view.name)
        assert final.arguments.startswith(view.arguments)
    assert names.index("get_weather") == text.index('", "arguments"') + 1 and None not in names[names.index("get_weather"):]


@pytest.mark.parametrize("text", ['["a"]', '{"name" "x"}', '{"name": 3}', '{"name": "t", "arguments": [1]}', "{1: 2}"])
def test_what_cannot_become_a_call_is_said_at_once(text):
    with pytest.raises(NotACall):
        scan_call(text, 0, ("arguments",))


def test_hermes_calls_stream_as_written_and_join_into_the_finished_reply():
    content, made = parse_tool_calls(HERMES)
    final = (content, [tool_call(c.name, c.arguments) for c in made])
    for seed in range(20):
        rng = random.Random(seed)
        got_content, calls, early = feed(ToolCallStream(auto=True), HERMES, iter(lambda: rng.randint(1, 6), None),
                                         final)
        assert got_content == content == "Let me look.\n"
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in made]
        assert early > 1  # the first call's arguments went out in pieces before the output ended
    assert json.loads(made[0].arguments)["city"] == 'Par"is' and made[1].arguments == '{"x": 1}'


def test_a_required_list_streams_each_calls_parameters_as_written():
    plan = ToolPlan(None, {"type": "array"})
    text = json.dumps([{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}},
                       {"name": "get_time", "parameters": {}}])
    content, final = plan.reply(text)
    assert content is None and [c["function"]["arguments"] for c in final] == ['{"city": "Oslo", "unit": "C"}', "{}"]
    got_content, calls, early = feed(ToolCallStream(auto=False), text, iter(lambda: 3, None), (content, final))
    assert got_content == "" and [(c["name"], c["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in final]
    assert early > 1


def test_text_that_turns_out_not_to_be_calls_ends_as_content():
    text = HERMES + " and then more text"
    content, made = parse_tool_calls(text)
    assert made == [] and content == text
    got_content, calls, _ = feed(ToolCallStream(auto=True), text, iter(lambda: 4, None), (content, []))
    assert got_content == text  # the text held back from the first block on comes at the end
    assert [c["name"] for c in calls] == ["get_weather", "t"]  # what was streamed as calls stands (as with vLLM)
    plain = "No calls here, just <b>text</b> < and >."
    assert feed(ToolCallStream(auto=True), plain, iter(lambda: 2, None), (plain, [])) == (plain, [], 0)


def test_a_required_list_cut_short_streams_what_it_had_and_no_text():
    text = json.dumps([{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}])[:-9]
    stream = ToolCallStream(auto=False)
    content, calls, _ = feed(stream, text, iter(lambda: 5, None), (text, []))
    assert content == "" and calls == [{"id": stream.ids[0], "name": "get_weather", "arguments": '{"city": "Oslo", "unit'}]
    assert feed(ToolCallStream(auto=False), '[{"na', iter(lambda: 1, None), ('[{"na', []))[:2] == ('[{"na', [])


names = st.text(st.characters(codec="utf-8", exclude_characters='"\\'), min_size=1, max_size=8)
values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                      max_leaves=8)
call_lists = st.lists(st.tuples(names, st.dictionaries(st.text(max_size=5), values, max_size=3)), min_size=1,
                      max_size=3)


@settings(max_examples=150, deadline=None)
@given(call_lists, st.sampled_from([(", ", ": "), (",", ":")]), st.booleans(), st.randoms(use_true_random=False))
def test_any_call_list_streamed_in_any_pieces_joins_into_its_reply(items, separators, ensure_ascii, rng):
    text = json.dumps([{"name": n, "parameters": p} for n, p in items], separators=separators,
                      ensure_ascii=ensure_ascii)
    content, final = ToolPlan(None, {"type": "array"}).reply(text)
    assert [json.loads(c["function"]["arguments"]) for c in final] == [p for _, p in items]
    _, calls, _ = feed(ToolCallStream(auto=False), text, iter(lambda: rng.randint(1, 8), None), (content, final))
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in final]
    hermes = "Sure." + "".join(f'<tool_call>{json.dumps({"name": n, "arguments": p}, ensure_ascii=ensure_ascii)}'
                               "</tool_call>\n" for n, p in items)
    content, made = parse_tool_calls(hermes)
    assert content == "Sure." and [json.loads(c.arguments) for c in made] == [p for _, p in items]
    got, calls, _ = feed(ToolCallStream(auto=True), hermes, iter(lambda: rng.randint(1, 8), None),
                         (content, [tool_call(c.name, c.arguments) for c in made]))
    assert got == content and [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in made]
    assert scan_call_list(text)[-1].end is not None
