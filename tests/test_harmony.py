"""gpt-oss's harmony format on plain data (``coserve/server/harmony.py``): a reply's messages split into reasoning
and reply, whole or streamed in any pieces; its calls read by the ``openai`` tool-call format; its tokens telling
where the reply begins (a structured output's guide then constrains the final message's body alone)."""

from __future__ import annotations

import random

import pytest

from coserve.scheduler.sampling_params import HarmonyTokens
from coserve.server.harmony import CALL_OPEN, HarmonySplit
from coserve.server.reasoning import ReasoningParserError, reasoning_parser
from coserve.server.tool_parser import ParsedCall, call_views, parse_tool_calls, visible_text
from tests.test_reasoning import _Tokenizer

A = "<|channel|>analysis<|message|>"
NEXT = "<|end|><|start|>assistant"
FINAL = "<|channel|>final<|message|>"
TO_WEATHER = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"

# (a reply's text as decoded with its special tokens, its stop token left out; (reasoning, reply))
CASES = [
    (A + "Add them." + NEXT + FINAL + "The answer is 4.", ("Add them.", "The answer is 4.")),
    (FINAL + "Hi!", (None, "Hi!")),  # no reasoning
    (A + "Still going", ("Still going", None)),  # cut short: all reasoning
    (A + "Need the weather." + NEXT + TO_WEATHER + '{"city": "SF"}',
     ("Need the weather.", CALL_OPEN + 'get_weather<|message|>{"city": "SF"}')),
    # the recipient in the role's part of the header; a preamble before the call
    ("<|channel|>commentary<|message|>Checking." + NEXT + " to=functions.f<|channel|>commentary json<|message|>{}",
     (None, "Checking." + CALL_OPEN + "f<|message|>{}")),
    # two analysis messages around a call's result in the prompt: both reasoning
    (A + "First." + NEXT + A + "Second." + NEXT + FINAL + "Done", ("First.Second.", "Done")),
    ("Plain text, no harmony.", (None, "Plain text, no harmony.")),
    ("<|chan", (None, "<|chan")),  # only looked like a header's start
    ("", (None, None)),
    (A + "x<|en", ("x<|en", None)),  # at the end, a held-back tail is what it is
]


def _split(text: str, pieces: list[str] | None = None) -> tuple[str | None, str | None]:
    machine, reasoning, reply = HarmonySplit(), "", ""
    pieces = pieces if pieces is not None else [text]
    for i, piece in enumerate(pieces):
        r, c = machine.feed(piece, final=i == len(pieces) - 1)
        reasoning, reply = reasoning + r, reply + c
    return (reasoning if machine.reasoned else None), (reply or None)


@pytest.mark.parametrize("text,expected", CASES)
def test_a_whole_reply_splits_into_its_messages(text, expected):
    assert _split(text) == expected


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("text,expected", CASES)
def test_a_stream_in_any_pieces_adds_up_to_the_whole_split(text, expected, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8)))) if len(text) > 1 else []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] or [""]
    assert _split(text, pieces) == expected


def test_the_openai_format_reads_the_calls_the_split_leaves_in_the_reply():
    """Whole: the text before the calls and each call (the last one's ``<|call|>`` was its stop token); streamed:
    the text before the calls, then each call's name and arguments as written; a call whose arguments are no JSON
    object leaves the reply as text."""
    _, reply = _split(A + "Two calls." + NEXT + TO_WEATHER + '{"city": "SF"}<|call|>'
                      + "<|start|>assistant<|channel|>commentary to=functions.get_time<|message|>{}")
    _, with_text = _split("<|channel|>commentary<|message|>Let me look." + NEXT + TO_WEATHER + '{"city": "Rome"}')
    assert parse_tool_calls(reply, "openai") == (None, [ParsedCall("get_weather", '{"city": "SF"}'),
                                                        ParsedCall("get_time", "{}")])
    assert parse_tool_calls(with_text, "openai") == ("Let me look.", [ParsedCall("get_weather", '{"city": "Rome"}')])
    assert visible_text(with_text, "openai") == "Let me look."
    views = call_views(with_text[:-4], "openai")
    assert [(v.name, v.arguments) for v in views] == [("get_weather", '{"city": "Ro')]
    broken = CALL_OPEN + "f<|message|>not json"
    assert parse_tool_calls(broken, "openai") == (broken, [])


def test_harmony_tokens_start_the_reply_after_the_first_header_of_another_channel():
    """``<|channel|>`` 1, ``<|message|>`` 2, ``<|end|>`` 3, ``<|start|>`` 4, ``analysis`` 5, ``final`` 6: the
    reasoning (counted as reasoning tokens) runs through the analysis messages and the next header."""
    tokens = HarmonyTokens(1, 3, False, True, 2, (5,))
    body = [1, 5, 2, 10, 11, 3, 4, 12, 1, 6, 2]  # analysis "10 11", then the final header
    assert tokens.reply_start(body) == len(body) and tokens.reply_start(body + [20, 21]) == len(body)
    assert tokens.count(body + [20, 21]) == len(body)
    assert tokens.reply_start([1, 5, 2, 10]) is None and tokens.reply_start([1, 5]) is None  # still reasoning
    assert tokens.reply_start([]) == 0 and tokens.reply_start([20, 1, 5]) == 0  # nothing, or no harmony: all reply
    assert tokens.reply_start([1, 6, 2, 20]) == 3  # straight to the final message


def test_the_parser_needs_gpt_oss_markers_as_single_special_tokens():
    marks = {"<|channel|>": [1], "<|end|>": [3], "<|message|>": [2], "analysis": [5]}
    parser = reasoning_parser("openai_gptoss", _Tokenizer(marks, special=marks))
    assert parser.tokens([7, 8]) == HarmonyTokens(1, 3, False, True, 2, (5,))
    assert isinstance(parser.splitter(parser.tokens([7])), HarmonySplit)
    assert parser.split(parser.tokens([7]), A + "Hm." + NEXT + FINAL + "4") == ("Hm.", "4")
    with pytest.raises(ReasoningParserError, match="--reasoning-parser openai_gptoss: .*'<\\|message\\|>'"):
        reasoning_parser("openai_gptoss", _Tokenizer({k: v for k, v in marks.items() if k != "<|message|>"}))


def test_its_calls_stream_as_written_after_the_text_before_them():
    """A preamble then two calls, split and streamed in random pieces: the preamble streams as content, each call is
    announced once its name is whole, its arguments go out as written; joined, the deltas are the finished reply's
    calls."""
    from coserve.server.tool_stream import ToolCallStream
    from coserve.server.tools import tool_call
    from tests.test_tool_stream import feed
    raw = ("<|channel|>commentary<|message|>Checking. " + NEXT + TO_WEATHER + '{"city": "Par\\"is", "days": [1, 2]}'
           + "<|call|><|start|>assistant<|channel|>commentary to=functions.get_time<|message|>{}")
    for seed in range(20):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(raw)), 12))
        machine, text = HarmonySplit(), ""
        pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])]
        stream = ToolCallStream(True, "openai")
        got, calls = "", {}
        for i, piece in enumerate(pieces):
            thought, reply = machine.feed(piece, final=i == len(pieces) - 1)
            assert not thought
            text += reply
        content, made = parse_tool_calls(text, "openai")
        assert content == "Checking. " and [c.name for c in made] == ["get_weather", "get_time"]
        got, calls, early = feed(stream, text, iter(lambda: rng.randint(1, 6), None),
                                 (content, [tool_call(c.name, c.arguments) for c in made]))
        assert got == "Checking. " and not stream.broken
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in made]
        assert early > 1
