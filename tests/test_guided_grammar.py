"""Guided decoding by a GBNF grammar (vLLM's guided_grammar): the machine against oracles (``json.loads`` for a
JSON grammar, a counter for nested parentheses, ``re.fullmatch`` for a regular grammar), its errors, and the
engine's guided requests."""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coserve import LLM, SamplingParams
from coserve.guided.grammar import MAX_SYMBOLS, compile_grammar
from coserve.guided.guide import Guide
from guided_helpers import assert_grammar_refused, ended_walks, llama_vocab

# JSON as llama.cpp's json.gbnf writes it (whitespace limited so that a model cannot pad forever)
JSON = r'''
root   ::= value
value  ::= object | array | string | number | ("true" | "false" | "null")
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}"
array  ::= "[" ws ( value ("," ws value)* )? "]"
string ::= "\"" ( [^"\\\x00-\x1f] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\""
number ::= "-"? ("0" | [1-9] [0-9]{0,19}) ("." [0-9]{1,24})? ([eE] [-+]? [0-9]{1,3})?
ws     ::= " "?
'''
PARENS = 'root ::= ("(" root ")")*   # balanced parentheses, nested any depth'
LIST = '''root ::= item ("," " "? item)*
item ::= "yes" | "no" | [0-9]{1,3} | "é"+'''
LIST_RE = r"(yes|no|[0-9]{1,3}|é+)(, ?(yes|no|[0-9]{1,3}|é+))*"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.text(max_size=6)
    | st.floats(allow_nan=False, allow_infinity=False, width=32),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(value=json_values, ascii_only=st.booleans(), compact=st.booleans())
def test_json_grammar_accepts_what_json_dumps_writes_and_no_strict_prefix(value, ascii_only, compact):
    text = json.dumps(value, ensure_ascii=ascii_only, separators=(",", ":") if compact else (",", ": "))
    machine = compile_grammar(JSON)
    assert machine.matches(text), text
    if isinstance(value, (dict, list)) or isinstance(value, str):
        assert not machine.matches(text[:-1])


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list('{}[]",: 0123456789-.eEtrufalsn\\xé')), max_size=12))
def test_json_grammar_never_accepts_what_json_loads_refuses(text):
    if compile_grammar(JSON).matches(text):
        json.loads(text)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("()x")), max_size=14))
def test_nesting_of_any_depth_is_followed(text):
    depth, balanced = 0, "x" not in text
    for c in text:
        depth += 1 if c == "(" else -1 if c == ")" else 0
        balanced = balanced and depth >= 0
    assert compile_grammar(PARENS).matches(text) == (balanced and depth == 0)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("yesno0129é, x")), max_size=12))
def test_a_regular_grammar_matches_what_its_regex_matches(text):
    assert compile_grammar(LIST).matches(text) == (re.fullmatch(LIST_RE, text) is not None)


@pytest.mark.parametrize("grammar, oracle", [
    ('root ::= root "x" | "y"', r"yx*"),
    ('root ::= root "+" num | root "-" num | num | root\nnum ::= [0-9]+', r"[0-9]+([-+][0-9]+)*"),
])
def test_immediate_left_recursion_is_rewritten_to_the_same_texts(grammar, oracle):
    machine = compile_grammar(grammar)
    for text in ["", "y", "yx", "yxxx", "x", "yyx", "1", "12+3", "1-2+30", "+1", "1+", "1++2", "y+1"]:
        assert machine.matches(text) == (re.fullmatch(oracle, text) is not None), text


@pytest.mark.parametrize("grammar, message", [
    ('root ::= a "b"\na ::= root "a" | "b"', "left recursion"),  # through another rule
    ('root ::= x* root "a"\nx ::= "x"', "left recursion"),
    ('root ::= root "a"', "left recursion"),  # nothing to start from
    ('item ::= "x"', "no rule 'root'"),
    ('root ::= thing', "rule 'thing' is used but never defined"),
    ('root ::= "a"\nroot ::= "b"', "line 2: rule 'root' is defined twice"),
    ('root ::= [b-a]', "bad character range b-a"),
    ('root ::= "abc', "line 1: unterminated string literal"),
    ('root ::= "a"{3,1}', "the maximum is below the minimum"),
    ('root ::= "\\q"', "unknown escape"),
    ('root ::= ("a"', r"missing '\)'"),
    ('', "the grammar is empty"),
    (f'root ::= "a"{{{MAX_SYMBOLS + 1}}}', "grammar too large"),
])
def test_grammars_it_cannot_follow_are_errors_naming_the_line(grammar, message):
    assert_grammar_refused(grammar, message)


@pytest.fixture(scope="module")
def vocab(model_factory):
    return llama_vocab(model_factory)


def test_random_guided_walks_that_end_are_json(vocab):
    ended = ended_walks(Guide(None, vocab, grammar=JSON), vocab, random.Random(5), 25, 80, 0.4)
    for data in ended:
        json.loads(data.decode())
    assert len(ended) >= 10


def test_guided_grammar_requests_match_and_leave_others_alone(model_factory):
    llm = LLM(model_factory("llama"), dtype="float32", device="cpu")
    free = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    alone = llm.generate(["Hello there"], free)
    outs = llm.generate(["Hello there", "Answer:", "Parens:"],
                        [free, SamplingParams(max_tokens=16, temperature=0.9, seed=2, guided_grammar=LIST),
                         SamplingParams(max_tokens=16, temperature=0, guided_grammar='root ::= "(" ("(" ")")* ")"')])
    assert outs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert outs[1].outputs[0].finish_reason == "stop" and re.fullmatch(LIST_RE, outs[1].outputs[0].text)
    assert outs[2].outputs[0].finish_reason == "stop" and re.fullmatch(r"\((\(\))*\)", outs[2].outputs[0].text)


@pytest.mark.parametrize("grammar", ["root ::= " + "(" * 2000 + '"a"' + ")" * 2000,
                                     "start: " + "(" * 2000 + '"a"' + ")" * 2000])
def test_a_grammar_nested_too_deeply_is_a_grammar_error(grammar):
    with pytest.raises(ValueError, match="nests its groups too deeply"):
        compile_grammar(grammar)
