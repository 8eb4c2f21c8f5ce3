"""Reasoning parsers on plain data: a reply split into reasoning and content, whole or streamed in any pieces."""

from __future__ import annotations

import random

import pytest

from coserve.scheduler.sampling_params import ReasoningTokens
from coserve.server.reasoning import (FORMATS, HARMONY, PARSERS, ReasoningParser, ReasoningParserError,
                                      ReasoningSplit, reasoning_parser)

START, END = 90, 91  # the tags' ids in these tests
QWEN3 = ReasoningParser("qwen3", START, END)
R1 = ReasoningParser("deepseek_r1", START, END)

# (text, opened, (reasoning, content)): what a whole reply splits into
CASES = [
    ("<think>Add them.</think>The answer is 4.", False, ("Add them.", "The answer is 4.")),
    ("<think>Add them.</think>", False, ("Add them.", None)),
    ("<think>Still going", False, ("Still going", None)),  # cut short: all reasoning
    ("Just the answer.", False, (None, "Just the answer.")),
    ("The answer </think> is text", False, (None, "The answer </think> is text")),  # no reasoning began
    ("A <think> later is text", False, (None, "A <think> later is text")),
    ("<thin", False, (None, "<thin")),  # a reply that only looked like the tag's start
    ("", False, (None, None)),
    ("Add them.</think>4", True, ("Add them.", "4")),  # the prompt left <think> open
    ("Add them.", True, ("Add them.", None)),
    ("</think>4", True, ("", "4")),
    ("a</think>b</think>c", True, ("a", "b</think>c")),  # only the first tag ends it
    ("<think>Add them.</think>4", True, ("Add them.", "4")),  # a leading <think> dropped, opened or not
    ("<thinking>", True, ("<thinking>", None)),
    ("<<think>x", False, (None, "<<think>x")),
    ("<think></thi", False, ("</thi", None)),  # at the end, a held-back tail is what it is
]


@pytest.mark.parametrize("text,opened,expected", CASES)
def test_a_whole_reply_splits_at_the_tags(text, opened, expected):
    assert QWEN3.split(ReasoningTokens(START, END, opened), text) == expected


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("text,opened,expected", CASES)
def test_a_stream_in_any_pieces_adds_up_to_the_whole_split(text, opened, expected, seed):
    """Pieces of every size, a tag cut anywhere: the streamed reasoning and content concatenate to the whole split,
    and no piece of reasoning follows a piece of content."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] or [""]
    machine = ReasoningSplit(opened)
    reasoning, content, seen_content = "", "", False
    for i, piece in enumerate(pieces):
        r, c = machine.feed(piece, final=i == len(pieces) - 1)
        assert not (r and seen_content)
        seen_content = seen_content or bool(c)
        reasoning, content = reasoning + r, content + c
    want_reasoning, want_content = expected
    assert (reasoning if machine.reasoned else None) == want_reasoning
    assert (content or None) == want_content


def test_a_tag_is_held_back_until_the_next_text_settles_it():
    machine = ReasoningSplit(opened=True)
    assert machine.feed("<thi") == ("", "")  # opened, but a leading <think> would still be dropped
    assert machine.feed("nk>Add them.</th") == ("Add them.", "")
    assert machine.feed("ink>4") == ("", "4")
    machine = ReasoningSplit(opened=True)
    assert machine.feed("x </") == ("x ", "")
    assert machine.feed("b>") == ("</b>", "")  # not the tag after all: reasoning
    start = ReasoningSplit(opened=False)
    assert start.feed("") == ("", "")  # no text yet (a stop string's start held back): still undecided
    assert start.feed("<th") == ("", "")
    assert start.feed("ink>a") == ("a", "") and start.reasoned


def test_the_prompt_decides_whether_the_output_begins_inside_the_reasoning():
    assert QWEN3.tokens([1, 2, 3]) == ReasoningTokens(START, END, False)  # the model may open it itself
    assert QWEN3.tokens([1, START, 5]) == ReasoningTokens(START, END, True)  # the template opened it
    assert QWEN3.tokens([1, START, 5, END, 6]) == ReasoningTokens(START, END, False)  # thinking turned off
    assert R1.tokens([1, 2, 3]).opened  # DeepSeek-R1's output is reasoning until </think>
    assert not R1.tokens([START, END]).opened
    assert R1.split(R1.tokens([1]), "all thought") == ("all thought", None)


def test_reasoning_tokens_are_counted_by_id_and_the_reply_starts_after_the_end_tag():
    closed, opened = ReasoningTokens(START, END, False), ReasoningTokens(START, END, True)
    assert closed.reply_start([]) == 0 and closed.count([]) == 0  # nothing out: a guide may begin (or <think>)
    assert closed.reply_start([7, 8]) == 0 and closed.count([7, 8]) == 0
    assert closed.reply_start([START, 7]) is None and closed.count([START, 7]) == 2
    assert closed.reply_start([START, 7, END, 8, 9]) == 3 and closed.count([START, 7, END, 8, 9]) == 3
    assert opened.reply_start([]) is None and opened.count([7, 7]) == 2
    assert opened.reply_start([7, END]) == 2 and opened.count([7, END, 5]) == 2


class _Tokenizer:
    def __init__(self, vocab, special=()):
        self.vocab, self.special = vocab, set(special)

    def encode(self, text, add_special_tokens=True):
        return list(self.vocab.get(text, [1, 2, 3]))

    def decode(self, ids, skip_special_tokens=False):
        names = {i: t for t, (i, *_) in self.vocab.items()}
        return "".join("" if skip_special_tokens and names[i] in self.special else names[i] for i in ids)


def test_a_parser_needs_the_tags_as_single_tokens():
    assert reasoning_parser("qwen3", _Tokenizer({"<think>": [90], "</think>": [91]})) == QWEN3
    with pytest.raises(ReasoningParserError, match=r"--reasoning-parser qwen3: .*'</think>'.*3 tokens"):
        reasoning_parser("qwen3", _Tokenizer({"<think>": [90]}))
    with pytest.raises(ReasoningParserError, match="--reasoning-parser: 'o1'"):
        reasoning_parser("o1", _Tokenizer({}))


SEED = {"<seed:think>": [70], "</seed:think>": [71]}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("text,opened,expected", CASES)
def test_seed_oss_splits_at_its_own_tags_as_the_others_do_at_think(text, opened, expected, seed):
    """The same replies written with Seed-OSS's tags split as they do with ``<think>``, whole and streamed; its
    ``<think>`` is plain text."""
    seed_text = text.replace("<think>", "<seed:think>").replace("</think>", "</seed:think>")
    swap = lambda part: part if part is None else part.replace("<think>", "<seed:think>").replace(  # noqa: E731
        "</think>", "</seed:think>")
    parser = reasoning_parser("seed_oss", _Tokenizer(SEED))
    assert parser.split(ReasoningTokens(70, 71, opened), seed_text) == tuple(map(swap, expected))
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(seed_text)), min(len(seed_text) - 1, 4))) if len(seed_text) > 1 else []
    machine, reasoning, content = parser.splitter(ReasoningTokens(70, 71, opened)), "", ""
    pieces = [seed_text[a:b] for a, b in zip([0, *cuts], [*cuts, len(seed_text)])] or [""]
    for i, piece in enumerate(pieces):
        r, c = machine.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    assert ((reasoning if machine.reasoned else None), content or None) == tuple(map(swap, expected))
    assert parser.split(ReasoningTokens(70, 71, True), "a<think>b</think>c") == ("a<think>b</think>c", None)


@pytest.mark.parametrize("name", [p for p in PARSERS if p != HARMONY])  # harmony's: test_harmony.py
def test_each_parser_begins_the_output_where_its_models_template_leaves_it(name):
    """With no tag in the prompt, DeepSeek-R1, MiniMax-M2 and Seed-OSS begin inside the reasoning (their templates
    open it, or the models never write the start tag); the others (Qwen3, GLM-4.5, DeepSeek-V3.1, Magistral) begin
    with the reply unless they write the start tag first. A prompt's last tag decides for every parser."""
    tags = FORMATS[name]
    parser = reasoning_parser(name, _Tokenizer({tags.start: [START], tags.end: [END]}))
    assert parser.tokens([1, 2]).opened == (name in ("deepseek_r1", "minimax_m2", "seed_oss"))
    assert not parser.special
    assert parser.tokens([1, START, 2]).opened and not parser.tokens([START, END, 2]).opened
    assert parser.split(parser.tokens([1]), f"x{tags.end}y") == (("x", "y") if parser.tokens([1]).opened
                                                                  else (None, f"x{tags.end}y"))


def test_a_parser_whose_tags_the_vocabulary_lacks_is_refused_naming_them():
    with pytest.raises(ReasoningParserError, match=r"--reasoning-parser seed_oss: .*'<seed:think>'"):
        reasoning_parser("seed_oss", _Tokenizer({"<think>": [90], "</think>": [91]}))


def test_magistrals_think_tags_are_special_tokens_so_its_text_keeps_them():
    """Mistral's ``[THINK]`` and ``[/THINK]`` are special tokens: the parser says so, and each request's tags carry
    it (the engine then decodes special tokens into the text); the reply is reasoning only after ``[THINK]``."""
    tags = {"[THINK]": [30], "[/THINK]": [31]}
    parser = reasoning_parser("mistral", _Tokenizer(tags, special=tags))
    assert parser.special and parser.tokens([1, 2]) == ReasoningTokens(30, 31, False, True)
    assert parser.split(parser.tokens([1]), "[THINK]Add them.[/THINK]4") == ("Add them.", "4")
    assert parser.split(parser.tokens([1]), "4") == (None, "4")
    assert not reasoning_parser("mistral", _Tokenizer(tags)).special  # written as text: nothing to keep
