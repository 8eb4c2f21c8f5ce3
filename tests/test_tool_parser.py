"""Tool calls written in the text (``tool_choice: "auto"`` with ``--tool-call-parser hermes``): what is a call,
what stays text, and what a stream may show before the output ends."""

from __future__ import annotations

import json

import pytest

from coserve.server.config import ServerConfig
from coserve.server.tool_parser import ParsedCall, parse_tool_calls, visible_text

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("text, content, calls", [
    ("Just text.", "Just text.", []),
    ("Let me check.\n" + CALL, "Let me check.\n", [ParsedCall("get_weather", '{"city": "Paris"}')]),
    (CALL + "\n" + '<tool_call>{"name": "t", "arguments": "{\\"x\\": 1}"}</tool_call>', None,
     [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("t", '{"x": 1}')]),
    ('<tool_call>{"name": "t"}', None, [ParsedCall("t", "{}")]),  # ended before its closing tag
    ('<tool_call>{"name": "t", "parameters": {"a": "é"}}</tool_call>', None, [ParsedCall("t", '{"a": "é"}')]),
])
def test_hermes_calls_are_read_with_the_text_before_them(text, content, calls):
    assert parse_tool_calls(text) == (content, calls)
    for call in calls:
        json.loads(call.arguments)


@pytest.mark.parametrize("text", [
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "t", "arguments": "{bad"}</tool_call>',
    '<tool_call>{"name": "t", "arguments": [1]}</tool_call>',
    CALL + " and then more text",
])
def test_anything_but_whole_calls_stays_text(text):
    assert parse_tool_calls(text) == (text, [])


def test_a_stream_holds_back_what_may_become_a_call():
    assert visible_text("Hello") == "Hello"
    assert visible_text("Hello <tool") == "Hello "
    assert visible_text("Hello <") == "Hello "
    assert visible_text("Hello <tool_call>{\"na") == "Hello "
    assert visible_text("a < b") == "a < b"


LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.mark.parametrize("text, calls", [
    (LLAMA, [ParsedCall("get_weather", '{"city": "Paris"}')]),
    ("\n " + LLAMA + " ; " + '{"name": "t", "arguments": {}};', [ParsedCall("get_weather", '{"city": "Paris"}'),
                                                               ParsedCall("t", "{}")]),
    ('{"name": "t", "parameters": "{\\"x\\": 1}"}', [ParsedCall("t", '{"x": 1}')]),
])
def test_llama3_json_calls_are_a_reply_of_objects_separated_by_semicolons(text, calls):
    assert parse_tool_calls(text, "llama3_json") == (None, calls)


@pytest.mark.parametrize("text", ["Just text.", "It is " + LLAMA, LLAMA + " and more", LLAMA + "; {oops}",
                                  '{"answer": 42}', LLAMA[:-3], "[" + LLAMA + "]"])
def test_anything_but_a_llama3_reply_of_calls_stays_text(text):
    assert parse_tool_calls(text, "llama3_json") == (text, [])


def test_a_llama3_stream_shows_text_only_once_it_cannot_be_calls():
    assert visible_text("  ", "llama3_json") == ""
    assert visible_text(' {"na', "llama3_json") == ""
    assert visible_text("Sure, {", "llama3_json") == "Sure, {"
    assert visible_text("<tool_call>", "llama3_json") == "<tool_call>"  # another format's tag is text here


@pytest.mark.parametrize("text, calls", [
    ('[get_weather(city="Paris")]', [ParsedCall("get_weather", '{"city": "Paris"}')]),
    (" [f(a=1, b=[1, (2, 3)], c={'k': None}, d=True, e='é'), g()]\n",
     [ParsedCall("f", '{"a": 1, "b": [1, [2, 3]], "c": {"k": null}, "d": true, "e": "é"}'), ParsedCall("g", "{}")]),
    ("[f(s='a, b) ]', t=\"\"\"x\ny\"\"\")]", [ParsedCall("f", '{"s": "a, b) ]", "t": "x\\ny"}')]),
])
def test_pythonic_calls_are_a_python_list_of_calls_with_literal_keywords(text, calls):
    assert parse_tool_calls(text, "pythonic") == (None, calls)


@pytest.mark.parametrize("text", ["Just text.", "[]", "[f(1)]", "[f(a=x)]", "[f(a={1, 2})]", "[f(**k)]", "[obj.f()]",
                                  "[f(a=1)] and more", "[f(a=1)", "Calls: [f()]", '[{"name": "f"}]'])
def test_anything_but_a_list_of_calls_stays_text_for_pythonic(text):
    assert parse_tool_calls(text, "pythonic") == (text, [])


def test_a_pythonic_stream_shows_text_only_once_it_cannot_be_calls():
    assert visible_text(" [get_w", "pythonic") == "" and visible_text("\n", "pythonic") == ""
    assert visible_text("It is [f()]", "pythonic") == "It is [f()]"


MISTRAL = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "t"}]'
NAMED = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]t[CALL_ID]a1b2c3d4e[ARGS]{}'


@pytest.mark.parametrize("text, content", [
    ("[TOOL_CALLS]" + MISTRAL, None),  # v0.3's array
    ("\n[TOOL_CALLS] " + MISTRAL + "\n", None),
    (NAMED, None),  # v11's name[ARGS]{...}, v13's [CALL_ID]
    ("Let me check. " + NAMED, "Let me check. "),
    ('[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]t{}', None),  # [ARGS] decoded away
])
def test_mistral_calls_follow_tool_calls_in_either_form(text, content):
    calls = [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("t", "{}")]
    assert parse_tool_calls(text, "mistral") == (content, calls)


@pytest.mark.parametrize("text", [
    "Just text.", MISTRAL, "[TOOL_CALLS]", "[TOOL_CALLS][]", '[TOOL_CALLS][{"name": "t", "arguments": "{}"}]',
    "[TOOL_CALLS]" + MISTRAL + " more", NAMED + " more", '[TOOL_CALLS]get weather[ARGS]{}',
    '[TOOL_CALLS][ARGS]{}', '[TOOL_CALLS]t[ARGS][1]', '[TOOL_CALLS]t[ARGS]{"a": }', '[TOOL_CALLS]t[ARGS]{"a": 1',
    '[TOOL_CALLS]t[CALL_ID]abc', "[TOOL_CALLS]t[ARGS]",
])
def test_anything_but_whole_mistral_calls_after_the_marker_is_text(text):
    assert parse_tool_calls(text, "mistral") == (text, [])


def test_a_mistral_stream_shows_the_text_before_the_marker():
    assert visible_text("Hi [TOOL_", "mistral") == "Hi " and visible_text("Hi [TOOL_CALLS]f", "mistral") == "Hi "
    assert visible_text("a [b]", "mistral") == "a [b]" and visible_text("[", "mistral") == ""


def test_a_mistral_auto_request_decodes_special_tokens_into_its_text():
    """Mistral's markers are special tokens: as vLLM's parser does, a request it reads keeps them in its text
    (``skip_special_tokens`` False), and no other parser's or plan's does."""
    from coserve.server.inference_api import sampling_params
    from coserve.server.protocol import ChatCompletionRequest
    from coserve.server.tools import ToolPlan

    assert ToolPlan(None, None, auto=True, parser="mistral").keeps_special
    assert ToolPlan(None, None, auto=True, parser="kimi_k2").keeps_special
    assert not ToolPlan(None, None, auto=True, parser="hermes").keeps_special
    assert not ToolPlan(None, {"type": "array"}, parser="mistral").keeps_special  # required: a guided list
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}])
    assert sampling_params(body, 8, None, 0).skip_special_tokens
    assert not sampling_params(body, 8, None, 0, keep_special=True).skip_special_tokens


V3_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"
V31_CALL = "<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"
KIMI_CALL = "<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{args}<|tool_call_end|>"
SECTION_FORMS = {
    "deepseek_v3": ("<｜tool▁calls▁begin｜>", V3_CALL, "<｜tool▁calls▁end｜>"),
    "deepseek_v31": ("<｜tool▁calls▁begin｜>", V31_CALL, "<｜tool▁calls▁end｜>"),
    "kimi_k2": ("<|tool_calls_section_begin|>", KIMI_CALL, "<|tool_calls_section_end|>"),
}


def section(parser: str, calls: list[tuple[str, str]], before: str = "", end: bool = True) -> str:
    begin, call, close = SECTION_FORMS[parser]
    return before + begin + "".join(call.format(name=n, args=a, index=i) for i, (n, a) in enumerate(calls)) + (
        close if end else "")


@pytest.mark.parametrize("parser", SECTION_FORMS)
@pytest.mark.parametrize("before, end", [("", True), ("Let me check. ", True), ("", False)])
def test_section_calls_follow_the_text_before_their_markers(parser, before, end):
    """DeepSeek-V3's fenced calls, V3.1's and Kimi K2's: the text before the section is content; each call's
    arguments are the JSON the model wrote; Kimi's calls keep the ids the model wrote."""
    text = section(parser, [("get_weather", '{"city": "Paris"}'), ("t", "{}")], before, end)
    content, calls = parse_tool_calls(text, parser)
    assert content == (before or None)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}'), ("t", "{}")]
    assert [c.ident for c in calls] == (["functions.get_weather:0", "functions.t:1"] if parser == "kimi_k2"
                                        else [None, None])
    assert visible_text(before + SECTION_FORMS[parser][0][:5], parser) == before


@pytest.mark.parametrize("parser", SECTION_FORMS)
def test_anything_but_whole_section_calls_is_text(parser):
    begin, call, close = SECTION_FORMS[parser]
    good = section(parser, [("f", '{"a": 1}')])
    for text in ("Just text.", begin, begin + "junk", good + " more", section(parser, [("f g", "{}")]),
                 section(parser, [("f", "[1]")]), section(parser, [("f", '{"a": ')]), good.replace(close, "")[:-3]):
        assert parse_tool_calls(text, parser) == (text, [])


SCHEMAS = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}, "where": {"type": "object"}, "note": {"type": ["string", "null"]},
    "limit": {"type": ["integer", "null"]}}}}
XML = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n 007 Paris\n</parameter>\n<parameter=days>\n3\n"
       "</parameter>\n<parameter=temp>\n21.0\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
       "<parameter=hours>\n[9, 12]\n</parameter>\n<parameter=where>\n{'lat': 1.5}\n</parameter>\n"
       "<parameter=note>\nnull\n</parameter>\n<parameter=limit>\nmany\n</parameter>\n<parameter=extra>\n{\"a\": 1}\n"
       "</parameter>\n</function>\n</tool_call>")


def test_qwen3_coder_calls_are_read_by_their_parameters_types():
    """Each value as the tool declares it, as vLLM's qwen3_coder reads it: a string as written (one newline each
    side dropped), numbers (a whole one as an integer), booleans, JSON or a Python literal, null; a value that is not
    its type, or a parameter the tool does not declare, stays text."""
    content, calls = parse_tool_calls("Let me see.\n" + XML + "\n" + XML.replace("get_weather", "get_time"),
                                      "qwen3_coder", SCHEMAS)
    assert content == "Let me see.\n" and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": " 007 Paris", "days": 3, "temp": 21, "metric": True,
                                              "hours": [9, 12], "where": {"lat": 1.5}, "note": None, "limit": "many",
                                              "extra": '{"a": 1}'}
    assert json.loads(calls[1].arguments)["days"] == "3"  # get_time declares nothing: text
    for text in ("Just text.", XML + " and more", "<tool_call>\n{\"name\": \"t\"}\n</tool_call>",
                 "<tool_call><function=f>stray text<parameter=a>1</parameter></function></tool_call>"):
        assert parse_tool_calls(text, "qwen3_coder", SCHEMAS) == (text, [])
    assert visible_text("Hi <tool_c", "qwen3_coder") == "Hi "


def test_values_json_text_cannot_carry_stay_text():
    """NaN and Infinity (JSON's parser takes them, JSON text does not) and a set stay the text the model wrote:
    the arguments are always JSON."""
    xml = ("<tool_call>\n<function=f>\n<parameter=a>\nNaN\n</parameter>\n<parameter=b>\n{1, 2}\n</parameter>\n"
           "<parameter=c>\n[Infinity]\n</parameter>\n<parameter=d>\n(1, 2)\n</parameter>\n</function>\n</tool_call>")
    schemas = {"f": {"properties": {k: {"type": "object"} for k in "abcd"}}}
    (call,) = parse_tool_calls(xml, "qwen3_coder", schemas)[1]
    assert json.loads(call.arguments) == {"a": "NaN", "b": "{1, 2}", "c": "[Infinity]", "d": [1, 2]}


def test_seed_oss_calls_are_qwen3_coders_in_blocks_of_their_own():
    seed = XML.replace("<tool_call>", "<seed:tool_call>").replace("</tool_call>", "</seed:tool_call>")
    assert parse_tool_calls("Hi " + seed, "seed_oss", SCHEMAS) == (
        "Hi ", parse_tool_calls(XML, "qwen3_coder", SCHEMAS)[1])
    assert parse_tool_calls(XML, "seed_oss", SCHEMAS) == (XML, [])
    assert visible_text("Hi <seed:tool", "seed_oss") == "Hi "


GLM = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value> 007 Paris</arg_value>\n<arg_key>days</arg_key>"
       "\n<arg_value>3</arg_value>\n<arg_key>where</arg_key>\n<arg_value>{'lat': 1.5}</arg_value>\n<arg_key>note"
       "</arg_key>\n<arg_value>many\nlines</arg_value>\n<arg_key>n</arg_key><arg_value>NaN</arg_value>\n</tool_call>")


def test_glm45_calls_read_their_values_as_vllm_does():
    """A value the tool declares a string is as written (stripped); any other is JSON, else a Python literal, else
    as written (NaN, which JSON text cannot carry, too)."""
    content, calls = parse_tool_calls("Checking.\n" + GLM + "\n<tool_call>get_time\n</tool_call>", "glm45",
                                      {"get_weather": {"properties": {"city": {"type": "string"}}}})
    assert content == "Checking.\n" and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "007 Paris", "days": 3, "where": {"lat": 1.5},
                                              "note": "many\nlines", "n": "NaN"}
    assert calls[1].arguments == "{}"
    as_strings = {"get_weather": {"properties": {"days": {"type": "string"}, "where": {"type": "string"}}}}
    assert json.loads(parse_tool_calls(GLM, "glm45", as_strings)[1][0].arguments) == {
        "city": "007 Paris", "days": "3", "where": "{'lat': 1.5}", "note": "many\nlines", "n": "NaN"}
    for text in ("Just text.", GLM + " more", GLM[:-len("</tool_call>")], "<tool_call>get weather\n</tool_call>",
                 "<tool_call>f\nstray<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
                 GLM + " between " + GLM):
        assert parse_tool_calls(text, "glm45") == (text, [])


MINIMAX = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city"> Paris </parameter>\n'
           '<parameter name="days">3</parameter>\n<parameter name="where">{"lat": 1.5}</parameter>\n</invoke>\n'
           "<invoke name=get_time>\n</invoke>\n</minimax:tool_call>")


def test_minimax_m2_calls_are_the_invokes_of_its_blocks():
    """Each ``invoke`` of a block is a call, its values (stripped) read by their declared types as Qwen3-Coder's
    are; anything else in a block, or text after the blocks, leaves the reply text."""
    content, calls = parse_tool_calls("Let me see.\n" + MINIMAX + "\n" + MINIMAX, "minimax_m2", SCHEMAS)
    assert content == "Let me see.\n" and [c.name for c in calls] == ["get_weather", "get_time"] * 2
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3, "where": {"lat": 1.5}}
    assert calls[1].arguments == "{}"
    for text in ("Just text.", MINIMAX + " more", MINIMAX.replace("</invoke>\n<invoke", "</invoke>x<invoke"),
                 '<minimax:tool_call><invoke name="f">stray</invoke></minimax:tool_call>',
                 "<minimax:tool_call>\n</minimax:tool_call>"):
        assert parse_tool_calls(text, "minimax_m2", SCHEMAS) == (text, [])
    assert visible_text("Hi <minimax:", "minimax_m2") == "Hi "


def test_phi4_mini_calls_follow_functools():
    calls = [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("t", "{}")]
    phi4 = 'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "t", "parameters": {}}]'
    assert parse_tool_calls("\n" + phi4, "phi4_mini_json") == (None, calls)
    for text in ("Just text.", MISTRAL, "functools[]", "Calls: " + phi4, phi4 + " more", phi4[:-2]):
        assert parse_tool_calls(text, "phi4_mini_json") == (text, [])
    assert visible_text(" functo", "phi4_mini_json") == "" and visible_text("fun fact", "phi4_mini_json") == "fun fact"


def test_llama4_reads_pythonic_calls_with_or_without_its_wrapper_and_json_as_llama3():
    calls = [ParsedCall("f", '{"a": 1}')]
    for text in ("[f(a=1)]", "<|python_start|>[f(a=1)]<|python_end|>", " <|python_start|>[f(a=1)]"):
        assert parse_tool_calls(text, "llama4_pythonic") == (None, calls)
    for text in ("Sunny", "<|python_start|>Sunny<|python_end|>", "[f(a=1)] more"):
        assert parse_tool_calls(text, "llama4_pythonic") == (text, [])
    assert visible_text("<|pyth", "llama4_pythonic") == ""
    assert parse_tool_calls(LLAMA, "llama4_json") == parse_tool_calls(LLAMA, "llama3_json")


OLMO3 = ('<function_calls>\nget_weather(city="Paris", days=3, metric=true, note=null, xs=[1, false])\nget_time()\n'
         "</function_calls>")


def test_olmo3_calls_are_python_calls_one_per_line_with_jsons_literals():
    content, calls = parse_tool_calls(OLMO3, "olmo3")
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3, "metric": True, "note": None, "xs": [1, False]}), ("get_time", {})]
    assert parse_tool_calls(OLMO3.removesuffix("</function_calls>"), "olmo3")[1] == calls  # cut after its last call
    for text in ("Just text.", "get_time()", OLMO3 + " more", "<function_calls>\nget time()\n</function_calls>",
                 "<function_calls>\nf(a=b)\n</function_calls>", "<function_calls></function_calls>"):
        assert parse_tool_calls(text, "olmo3") == (text, [])
    assert parse_tool_calls("[f(a=null)]", "pythonic") == ("[f(a=null)]", [])  # JSON's names are OLMo 3's alone
    assert visible_text("<func", "olmo3") == "" and visible_text("<b>", "olmo3") == "<b>"


def test_granite_calls_are_mistrals_array_after_any_tool_call_tag():
    calls = [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("t", "{}")]
    assert parse_tool_calls(MISTRAL, "granite") == (None, calls)
    assert parse_tool_calls(MISTRAL, "mistral") == (MISTRAL, [])  # Mistral's needs its marker
    assert parse_tool_calls(" <tool_call>" + MISTRAL, "granite") == (None, calls)
    for text in ("Just text.", "<tool_call>", "<tool_call>[]", "Calls: " + MISTRAL, "<tool_call>" + MISTRAL + " more"):
        assert parse_tool_calls(text, "granite") == (text, [])
    assert visible_text(" <tool_c", "granite") == "" and visible_text("<tool_call>[{", "granite") == ""
    assert visible_text("<b>", "granite") == "<b>"


def test_an_unknown_parser_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--tool-call-parser: must be one of hermes, llama3_json, pythonic, "
                                         "llama4_pythonic, llama4_json, phi4_mini_json, olmo3, mistral, granite, "
                                         "qwen3_coder, "
                                         "seed_oss, glm45, minimax_m2, deepseek_v3, deepseek_v31, kimi_k2"):
        ServerConfig(model="m", state_dir="s", tool_call_parser="hunyuan_a13b")
