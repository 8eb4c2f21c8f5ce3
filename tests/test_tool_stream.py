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
from tests.test_tool_parser import SECTION_FORMS, section

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
    assert final.name == "get_weather" and final.end == len(text)
    assert json.loads(final.arguments) == {"city": "Pé", "n": [1, {"b": "}"}]}
    names = []
    for cut in range(len(text) + 1):
        view = scan_call(text[:cut], 0, ("arguments",))
        names.append(view.name)
        assert final.arguments.startswith(view.arguments)
    assert names.index("get_weather") == text.index('", "arguments"') + 1 and None not in names[names.index("get_weather"):]


@pytest.mark.parametrize("text", ['["a"]', '{"name" "x"}', '{"name": 3}', '{"name": "t", "arguments": [1]}', "{1: 2}",
                                  '{"na\\xme": "t"}', '{"name": "\\q"}', '{"name": "t", "arguments": "\\z"}'])
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


LLAMA = ('{"name": "get_weather", "parameters": {"city": "Par\\"is", "days": [1, 2], "deep": {"a": {}}}} ; '
         '{"parameters": "{\\"x\\": 1}", "name": "t"}')


def test_llama3_calls_stream_as_written_and_join_into_the_finished_reply():
    content, made = parse_tool_calls(LLAMA, "llama3_json")
    assert content is None and [c.name for c in made] == ["get_weather", "t"]
    final = (content, [tool_call(c.name, c.arguments) for c in made])
    for seed in range(20):
        rng = random.Random(seed)
        got_content, calls, early = feed(ToolCallStream(True, "llama3_json"), LLAMA,
                                         iter(lambda: rng.randint(1, 6), None), final)
        assert got_content == ""
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in made]
        assert early > 1
    text = "Paris is sunny; " + LLAMA  # text first: a reply in text, streamed as it comes
    assert feed(ToolCallStream(True, "llama3_json"), text, iter(lambda: 3, None), (text, [])) == (text, [], 0)
    spoiled = LLAMA + " and then more"  # calls streamed stand; the text comes at the end (as with hermes)
    got, calls, _ = feed(ToolCallStream(True, "llama3_json"), spoiled, iter(lambda: 5, None), (spoiled, []))
    assert got == spoiled and [c["name"] for c in calls] == ["get_weather", "t"]


PYTHONIC = "[get_weather(city='Par\"is, (x)', days=[1, 2], deep={'a': {}}), get_time()]"


def test_pythonic_calls_stream_each_named_first_and_its_arguments_once_whole():
    """A Python call's arguments become JSON only when its ``)`` is written: its name goes out first, its arguments
    in one piece; joined, the deltas are the finished reply's calls."""
    content, made = parse_tool_calls(PYTHONIC, "pythonic")
    assert content is None and [(c.name, json.loads(c.arguments)) for c in made] == [
        ("get_weather", {"city": 'Par"is, (x)', "days": [1, 2], "deep": {"a": {}}}), ("get_time", {})]
    final = (content, [tool_call(c.name, c.arguments) for c in made])
    for seed in range(20):
        rng = random.Random(seed)
        stream = ToolCallStream(True, "pythonic")
        got_content, calls, early = feed(stream, PYTHONIC, iter(lambda: rng.randint(1, 6), None), final)
        assert got_content == "" and not stream.broken
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in made]
        assert early >= 1  # the first call's arguments went out before the output ended
    text = "Sunny [f()]"
    assert feed(ToolCallStream(True, "pythonic"), text, iter(lambda: 2, None), (text, [])) == (text, [], 0)
    olmo3 = "<function_calls>\n" + PYTHONIC[1:-1].replace("), ", ")\n") + "\n</function_calls>"  # a call a line
    for seed in range(10):
        rng = random.Random(seed)
        got_content, calls, early = feed(ToolCallStream(True, "olmo3"), olmo3, iter(lambda: rng.randint(1, 6), None),
                                         final)
        assert got_content == "" and [(c["name"], c["arguments"]) for c in calls] == [
            (c.name, c.arguments) for c in made] and early >= 1
    wrapped = "<|python_start|>" + PYTHONIC + "<|python_end|>"  # Llama 4's, its special tokens kept
    got_content, calls, _ = feed(ToolCallStream(True, "llama4_pythonic"), wrapped, iter(lambda: 3, None), final)
    assert got_content == "" and [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in made]


@pytest.mark.parametrize("parser, before", [("mistral", "[TOOL_CALLS]"), ("granite", ""),
                                            ("granite", "<tool_call>"), ("phi4_mini_json", "functools")])
def test_json_array_calls_stream_as_written_and_join_into_the_finished_reply(parser, before):
    text = before + json.dumps([{"name": "get_weather", "arguments": {"city": 'Par"is', "days": [1, 2]}},
                                {"name": "get_time", "arguments": {}}])
    content, made = parse_tool_calls(text, parser)
    assert content is None and len(made) == 2
    final = (content, [tool_call(c.name, c.arguments) for c in made])
    for seed in range(10):
        rng = random.Random(seed)
        got_content, calls, early = feed(ToolCallStream(True, parser), text, iter(lambda: rng.randint(1, 6), None),
                                         final)
        assert got_content == "" and [(c["name"], c["arguments"]) for c in calls] == [
            (c.name, c.arguments) for c in made]
        assert early > 1


@pytest.mark.parametrize("before", ["", "Checking. "])
def test_mistral_named_calls_stream_as_written_after_the_text_before_them(before):
    """Mistral's v11 form: the text before ``[TOOL_CALLS]`` streams as content, each call is announced once its
    name is whole (``[ARGS]`` or ``[CALL_ID]`` after it), its arguments go out as written; joined, the deltas are the
    finished reply's calls."""
    text = (before + '[TOOL_CALLS]get_weather[ARGS]{"city": "Par\\"is", "days": [1, 2]}'
            '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}')
    content, made = parse_tool_calls(text, "mistral")
    assert content == (before or None) and [c.name for c in made] == ["get_weather", "get_time"]
    final = (content, [tool_call(c.name, c.arguments) for c in made])
    for seed in range(20):
        rng = random.Random(seed)
        stream = ToolCallStream(True, "mistral")
        got_content, calls, early = feed(stream, text, iter(lambda: rng.randint(1, 6), None), final)
        assert got_content == before and not stream.broken
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in made]
        assert early > 1


@pytest.mark.parametrize("parser", SECTION_FORMS)
def test_section_calls_stream_as_written_after_the_text_before_them(parser):
    """DeepSeek's and Kimi K2's sections: the text before streams as content, each call is announced once its
    name is whole (with the id a Kimi call wrote), its arguments go out as written; joined, the deltas are the
    finished reply's calls."""
    text = section(parser, [("get_weather", '{"city": "Par\\"is", "days": [1, 2]}'), ("get_time", "{}")],
                   "Checking. ")
    content, made = parse_tool_calls(text, parser)
    final = (content, [tool_call(c.name, c.arguments, c.ident) for c in made])
    for seed in range(20):
        rng = random.Random(seed)
        stream = ToolCallStream(True, parser)
        got_content, calls, early = feed(stream, text, iter(lambda: rng.randint(1, 6), None), final)
        assert got_content == "Checking. " and not stream.broken
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in made]
        assert [c["id"] for c in calls][0].startswith("functions.get_weather:0" if parser == "kimi_k2" else "call_")
        assert early > 1


@pytest.mark.parametrize("parser", ["glm45", "seed_oss", "minimax_m2"])
def test_glm45_seed_oss_and_minimax_calls_stream_each_named_first_and_its_arguments_once_whole(parser):
    schemas = {"get_weather": {"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
    if parser == "glm45":
        blocks = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>days"
                  "</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n<tool_call>get_time\n</tool_call>")
    elif parser == "minimax_m2":
        blocks = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Oslo</parameter>\n'
                  '<parameter name="days">2</parameter>\n</invoke>\n<invoke name="get_time">\n</invoke>\n'
                  "</minimax:tool_call>")
    else:
        blocks = ("<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>"
                  "\n2\n</parameter>\n</function>\n</seed:tool_call>\n<seed:tool_call>\n<function=get_time>\n"
                  "</function>\n</seed:tool_call>")
    text = "Checking.\n" + blocks
    content, made = parse_tool_calls(text, parser, schemas)
    assert content == "Checking.\n" and [(c.name, json.loads(c.arguments)) for c in made] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {})]
    final = (content, [tool_call(c.name, c.arguments) for c in made])
    for seed in range(20):
        rng = random.Random(seed)
        stream = ToolCallStream(True, parser, schemas)
        got_content, calls, early = feed(stream, text, iter(lambda: rng.randint(1, 6), None), final)
        assert got_content == content and not stream.broken
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in made]
        assert early >= 1


@pytest.mark.parametrize("parser", ["qwen3_coder", "seed_oss"])
def test_an_xml_call_whose_block_is_closing_keeps_the_arguments_it_sent(parser, caplog):
    """Between ``</function>`` and the block's closing tag the call is whole: a stream fed a character at a time
    never has to take back arguments it sent (the reader warns if it would)."""
    tag = "seed:tool_call" if parser == "seed_oss" else "tool_call"
    text = f"<{tag}>\n<function=f>\n<parameter=a>\nx\n</parameter>\n</function>\n</{tag}>"
    stream = ToolCallStream(True, parser)
    sent = "".join(d["function"].get("arguments", "") for at in range(1, len(text) + 1)
                   for d in stream.update(text[:at])[1])
    assert sent == '{"a": "x"}' and "do not extend" not in caplog.text


def test_qwen3_coder_calls_stream_each_named_first_and_its_arguments_once_whole():
    schemas = {"get_weather": {"properties": {"days": {"type": "integer"}}}}
    text = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>"
            "\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
    content, made = parse_tool_calls(text, "qwen3_coder", schemas)
    assert content == "Checking.\n" and [(c.name, json.loads(c.arguments)) for c in made] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {})]
    final = (content, [tool_call(c.name, c.arguments) for c in made])
    for seed in range(20):
        rng = random.Random(seed)
        stream = ToolCallStream(True, "qwen3_coder", schemas)
        got_content, calls, early = feed(stream, text, iter(lambda: rng.randint(1, 6), None), final)
        assert got_content == content and not stream.broken
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in made]
        assert early >= 1


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


def test_blank_text_before_the_calls_is_not_streamed_as_content():
    text = "\n\n" + HERMES[HERMES.index("<tool_call>"):]
    content, made = parse_tool_calls(text)
    assert content is None and len(made) == 2
    got, calls, _ = feed(ToolCallStream(auto=True), text, iter(lambda: 1, None),
                         (content, [tool_call(c.name, c.arguments) for c in made]))
    assert got == "" and [c["name"] for c in calls] == ["get_weather", "t"]
    assert feed(ToolCallStream(auto=True), "  \n", iter(lambda: 1, None), ("  \n", []))[0] == "  \n"


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


def responses_events(text: str, tools: ToolPlan, step: int = 3) -> list[dict]:
    """The Responses API's streamed events for an output growing ``step`` characters at a time (no engine)."""
    import asyncio
    from types import SimpleNamespace

    from coserve.engine.outputs import CompletionOutput, RequestOutput
    from coserve.server.choices import Choice, Job
    from coserve.server.generation import TextDelta
    from coserve.server.protocol import ResponsesRequest
    from coserve.server.responses_api import ResponseShape

    async def outputs():
        for end in [*range(step, len(text), step), len(text)]:
            done = end == len(text)
            yield RequestOutput("r", None, [1, 2], [CompletionOutput(0, text[:end], list(range(end)),
                                                                       "stop" if done else None)], finished=done)
    observe = SimpleNamespace(observe=lambda _: None)
    ctx = SimpleNamespace(metrics=SimpleNamespace(ttft=observe, tpot=observe, request_done=lambda *_: None))
    job = Job("resp_1", 0, "m", 1, [Choice(0, [1, 2], outputs(), TextDelta())])
    body = ResponsesRequest(model="m", input="x", store=False, stream=True,
                            tools=[{"type": "function", "name": "get_weather"}])

    async def collect():
        return [json.loads(e.split("data: ", 1)[1]) async for e in ResponseShape(job, body, tools, "t", []).events(ctx)]
    return asyncio.run(collect())


def test_the_responses_api_streams_the_text_then_each_call_as_written():
    events = responses_events(HERMES, ToolPlan(None, None, auto=True))
    kinds = [e["type"] for e in events]
    assert "error" not in kinds and kinds[-1] == "response.completed"
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call", "function_call"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Let me look.\n"
    assert final["output"][0]["content"][0]["text"] == "Let me look.\n"
    added = [e for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in added] == [e["output_index"] for e in done] == [0, 1, 2]
    assert [e["item"] for e in done] == final["output"]  # the same ids, call ids and arguments
    for index, item in ((1, final["output"][1]), (2, final["output"][2])):
        pieces = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                  and e["output_index"] == index]
        assert "".join(pieces) == item["arguments"]
    assert len([e for e in events if e["type"] == "response.function_call_arguments.delta"
                and e["output_index"] == 1]) > 3  # in pieces, as written
    order = [(e["type"], e.get("output_index")) for e in events]
    assert order.index(("response.output_item.done", 0)) < order.index(("response.output_item.added", 1))
    assert order.index(("response.output_item.done", 1)) < order.index(("response.output_item.added", 2))


def test_the_responses_api_streams_plain_text_under_auto_as_it_comes():
    text = "No call, just an answer that goes on for a while."
    events = responses_events(text, ToolPlan(None, None, auto=True))
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) > 5 and "".join(deltas) == text == events[-1]["response"]["output"][0]["content"][0]["text"]
    blank = responses_events("", ToolPlan(None, None, auto=True))
    assert [o["type"] for o in blank[-1]["response"]["output"]] == ["message"]
    assert [e["type"] for e in blank].count("response.output_item.done") == 1
