"""Guided decoding by a regular expression (vLLM's guided_regex): the byte-level machine against Python's
``re.fullmatch`` as the oracle, its UTF-8 handling, its errors, and the engine's guided requests."""

from __future__ import annotations

import random
import re
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coserve import LLM, SamplingParams
from coserve.guided.guide import Guide
from coserve.guided.regex import MAX_STATES, RegexError, compile_regex
from guided_helpers import ended_walks, llama_vocab

# pattern -> texts that match it whole (each also checked against re.fullmatch)
CASES = {
    r"\d{3}-\d{4}": ["555-1234", "000-0000"],
    r"[a-z]+@[a-z]+\.(com|org)": ["a@b.com", "joe@example.org"],
    r"(ab|a)*b?": ["", "ab", "aab", "abab", "b"],
    r"héllo|wörld+": ["héllo", "wörld", "wörlddd"],
    r"[α-ω]+\d?": ["αβγ", "ω9"],
    r"^\w+\s\w*$": ["abc ", "a_1\tx9"],
    r"(?:yes|no|maybe)": ["yes", "no", "maybe"],
    r"(?P<int>[0-9]+)(\.[0-9]+)?": ["12", "3.14"],
    r"[\d\-+.]{2,}": ["-1", "+3.5", ".."],
    r"a{2,4}?b+?": ["aab", "aaaabbb"],
    r"[^a-c\d]+": ["xyz", "é!", " "],
    r"x{,3}y": ["y", "xxxy"],
    r"\u00e9\x41": ["éA"],
    r".*": ["", "anything at all", "😀"],
    r"[]a]+": ["]", "a]a"],
    r"[\]\\]": ["]", "\\"],
    r"\{a\}|a{": ["{a}", "a{"],
    r"a*{}": ["a{}", "{}"],
    r"😀+|[😀-😂]z": ["😀😀", "😁z"],
    r"\S+\W": ["ab!", "é "],
    r"[-a]z-": ["-z-", "az-"],
    r"": [""],
}
ALPHABET = list("abcxyz019-.@\n é hlowördαω😀😁😂]\\{}A_+!") + ["\t"]


@pytest.mark.parametrize("pattern", list(CASES))
def test_the_machine_matches_what_re_fullmatch_matches(pattern):
    machine, ref = compile_regex(pattern), re.compile(pattern, re.ASCII)
    for text in CASES[pattern]:
        assert ref.fullmatch(text) and machine.matches(text), text
    rng = random.Random(zlib.crc32(pattern.encode()))  # the same texts in every run
    texts = {"".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 7))) for _ in range(1500)}
    texts |= {t[:-1] for t in CASES[pattern]} | {t + "a" for t in CASES[pattern]} | {t + "é" for t in CASES[pattern]}
    for text in texts:
        assert machine.matches(text) == (ref.fullmatch(text) is not None), repr(text)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(ALPHABET), max_size=10))
def test_any_text_is_judged_as_re_judges_it(text):
    for pattern in (r"(ab|a)*b?", r"[^a-c\d]+", r"\S+\W", r"(a|é|😀){1,3}z?"):
        assert compile_regex(pattern).matches(text) == (re.fullmatch(pattern, text, re.ASCII) is not None)


def test_a_partial_utf8_character_lives_only_while_some_completion_can_match():
    machine = compile_regex("é+")  # é is C3 A9
    assert machine.step(machine.start, 0xC3)
    assert not machine.step(machine.start, 0xC4)  # Ą..Ŀ: none of them is é
    assert not machine.step(machine.step(machine.start, 0xC3), 0xAA)  # ê
    assert not compile_regex("[a-z]+").step(compile_regex("[a-z]+").start, 0xC3)
    any_char = compile_regex(".")
    assert not any_char.step(any_char.start, 0xC0)  # never valid UTF-8
    assert not any_char.step(any_char.step(any_char.start, 0xE0), 0x80)  # an overlong form
    assert not any_char.step(any_char.step(any_char.start, 0xED), 0xA0)  # a surrogate
    assert not any_char.step(any_char.start, 0x80)  # a continuation byte first


@pytest.mark.parametrize("pattern, message", [
    (r"a**", "multiple repeat at position 2"),
    (r"a++a", "possessive quantifiers are not supported at position 2"),
    (r"(a", "missing '\\)', unterminated subpattern at position 0"),
    (r"a)", "unbalanced parenthesis"),
    (r"(a)\1", "backreferences are not supported at position 3"),
    (r"x(?=a)", "lookaround assertions are not supported at position 1"),
    (r"\bfoo", "word boundaries"),
    (r"[b-a]", "bad character range b-a"),
    (r"a{3,2}", "the maximum is below the minimum"),
    (r"*a", "nothing to repeat"),
    (r"(?i)a", "inline flags"),
    (r"\p{L}", "Unicode properties"),
    (r"a^b", "'\\^' is supported only at the start"),
    (r"\q", "bad escape \\\\q"),
    (r"[a", "unterminated character set"),
    (r"(a{100}){300}", f"more than {MAX_STATES} automaton states"),
])
def test_patterns_it_cannot_decide_are_errors_naming_the_place(pattern, message):
    with pytest.raises(RegexError, match=message):
        compile_regex(pattern)
    with pytest.raises(ValueError, match="guided_regex: "):
        SamplingParams(guided_regex=pattern)


def test_one_way_of_guiding_at_a_time():
    with pytest.raises(ValueError, match="give one of guided_json, guided_choice, guided_regex and guided_grammar"):
        SamplingParams(guided_regex="a", guided_json={"type": "object"})
    assert SamplingParams(guided_regex="a+").guided


@pytest.fixture(scope="module")
def vocab(model_factory):
    return llama_vocab(model_factory)


def test_random_guided_walks_that_end_match_the_pattern(vocab):
    """Soundness and liveness: sampling uniformly among the allowed tokens never gets stuck, and every walk
    that reaches end-of-sequence spells a text ``re.fullmatch`` accepts."""
    pattern = r"(\d{1,3}\.){2}[a-zé]{1,5}( ok)?"
    ended = ended_walks(Guide(None, vocab, regex=pattern), vocab, random.Random(3), 30, 60, 0.3)
    for data in ended:
        assert re.fullmatch(pattern, data.decode(), re.ASCII)
    assert len(ended) >= 20


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(model_factory("llama"), dtype="float32", device="cpu")


def test_guided_regex_requests_match_and_leave_others_alone(llm):
    free = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    alone = llm.generate(["Hello there"], free)
    patterns = [r"\d{3}-[a-z]{2,4}", r"(yes|no)!", r"[αβγ]{2}x?"]
    params = [free] + [SamplingParams(max_tokens=12, temperature=t, seed=s, guided_regex=p)
                       for p, (t, s) in zip(patterns, ((0, None), (1.0, 4), (0.9, 5)))]
    outs = llm.generate(["Hello there", "Phone:", "Answer:", "Greek:"], params)
    assert outs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    for out, pattern in zip(outs[1:], patterns):
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(pattern, out.outputs[0].text, re.ASCII), out.outputs[0].text


@pytest.mark.parametrize("pattern", ["(" * 2000 + "a" + ")" * 2000, "(a|" * 2000 + "b" + ")" * 2000])
def test_a_pattern_nested_too_deeply_is_a_regex_error(pattern):
    """The parser recurses once per group: past the interpreter's limit that was a RecursionError (a 500)."""
    with pytest.raises(RegexError, match="nests its groups too deeply"):
        compile_regex(pattern)
    with pytest.raises(ValueError, match="nests its groups too deeply"):
        SamplingParams(guided_regex=pattern)
