"""Guided decoding by a Lark grammar: the machine against the Lark parsing toolkit itself (Earley with the
``dynamic_complete`` lexer: a text matches when some split into tokens parses), on texts the grammar writes and
on random ones; its errors; the engine's guided requests."""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coserve import LLM, SamplingParams
from coserve.guided.grammar import compile_grammar, is_gbnf
from coserve.guided.guide import Guide
from guided_helpers import assert_grammar_refused, ended_walks, llama_vocab

lark = pytest.importorskip("lark")

# Lark's own calculator and JSON examples (left recursion, aliases, ?rules, imports, %ignore)
CALC = r'''
?start: sum
?sum: product
    | sum "+" product   -> add
    | sum "-" product   -> sub
?product: atom
    | product "*" atom  -> mul
    | product "/" atom  -> div
?atom: NUMBER           -> number
     | "-" atom         -> neg
     | NAME             -> var
     | "(" sum ")"

%import common.CNAME -> NAME
%import common.NUMBER
%import common.WS_INLINE
%ignore WS_INLINE
'''
JSON = r'''
?start: value
?value: object
      | array
      | string
      | SIGNED_NUMBER      -> number
      | "true"             -> true
      | "false"            -> false
      | "null"             -> null
array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : string ":" value
string : ESCAPED_STRING     // a comment

%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS
'''
# regex terminals with flags, case-insensitive literals, ranges, ~ repeats, [optional], priorities, ! and _
GREETINGS = r'''
start: greeting ("," greeting) ~ 0..2 [PUNCT]
!greeting: HELLO _name | "bye"i
_name: NAME NAME?
HELLO.2: /h[ae]llo/i
NAME: "A".."Z" LOWER ~ 1..3
LOWER: /[a-z]/
PUNCT: /[!?.]/
%ignore " "
'''
CALC_ALPHABET = list("0123456789.e+-*/() xy_Z\t")
JSON_ALPHABET = list('{}[]",: 0123456789-.eEtrufalsn\\x\n')
GREETINGS_ALPHABET = list("heloaHELOAbyBYZz!?., ")


def lark_accepts(grammar: str, text: str) -> bool:
    parser = _oracles.get(grammar)
    if parser is None:
        parser = _oracles[grammar] = lark.Lark(grammar, parser="earley", lexer="dynamic_complete")
    try:
        parser.parse(text)
        return True
    except lark.exceptions.LarkError:
        return False


_oracles: dict[str, object] = {}


def expressions(draw_int, depth: int = 0) -> str:
    """A random calculator expression, spaced at random."""
    sp = lambda: " " * draw_int(0, 2)  # noqa: E731
    kind = draw_int(0, 5 if depth < 3 else 1)
    if kind == 0:
        return str(draw_int(0, 999)) + ("." + str(draw_int(0, 99)) if draw_int(0, 1) else "")
    if kind == 1:
        return random.Random(draw_int(0, 99)).choice(["x", "y_1", "Zed", "_q"])
    if kind == 2:
        return "-" + sp() + expressions(draw_int, depth + 1)
    if kind == 3:
        return "(" + sp() + expressions(draw_int, depth + 1) + sp() + ")"
    op = "+-*/"[draw_int(0, 3)]
    return expressions(draw_int, depth + 1) + sp() + op + sp() + expressions(draw_int, depth + 1)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_calculator_expressions_match_as_lark_parses_them(data):
    text = expressions(lambda lo, hi: data.draw(st.integers(lo, hi)))
    cut = data.draw(st.integers(0, len(text)))
    for t in (text, text[:cut], text[cut:]):
        assert compile_grammar(CALC).matches(t) == lark_accepts(CALC, t), t


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(CALC_ALPHABET), max_size=10))
def test_random_text_matches_the_calculator_exactly_when_lark_parses_it(text):
    assert compile_grammar(CALC).matches(text) == lark_accepts(CALC, text), text


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**9, 10**9) | st.text(max_size=5)
    | st.floats(allow_nan=False, allow_infinity=False, width=32),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6)


@settings(max_examples=80, deadline=None)
@given(value=json_values, indent=st.sampled_from([None, 1]), cut=st.integers(0, 40))
def test_json_text_matches_as_lark_parses_it(value, indent, cut):
    text = json.dumps(value, indent=indent)
    assert compile_grammar(JSON).matches(text)
    assert lark_accepts(JSON, text)
    assert compile_grammar(JSON).matches(text[:cut]) == lark_accepts(JSON, text[:cut]), text[:cut]


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(JSON_ALPHABET), max_size=10))
def test_random_text_matches_json_exactly_when_lark_parses_it(text):
    assert compile_grammar(JSON).matches(text) == lark_accepts(JSON, text), text


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(GREETINGS_ALPHABET), max_size=16))
def test_flags_ranges_repeats_and_optionals_match_as_lark_has_them(text):
    assert compile_grammar(GREETINGS).matches(text) == lark_accepts(GREETINGS, text), text


@pytest.mark.parametrize("text, matches", [
    ("hello Ann", True), ("HALLO Bob Cy!", True), ("BYE", True), ("bye, hello Ann , ByE.", True),
    ("hello ann", False), ("hello Annabel", False), ("bye, bye, bye, bye", False), ("hi Ann", False),
])
def test_greetings_examples(text, matches):
    assert compile_grammar(GREETINGS).matches(text) == matches == lark_accepts(GREETINGS, text)


def test_gbnf_and_lark_are_told_apart_as_vllm_does():
    assert is_gbnf('root ::= "a"') and is_gbnf('# comment\n  item-2 ::= "b"\nroot ::= item-2')
    assert not is_gbnf('start: "a"') and not is_gbnf('start: "x ::= y"')


@pytest.mark.parametrize("grammar, message", [
    ('start: thing', "line 1: 'thing' is used but never defined"),
    ('start: A\nA: b\nb: "x"', "line 2: a terminal cannot use the rule 'b'"),
    ('item: "x"', "no rule 'start'"),
    ('start: "a"\nstart: "b"', "line 2: 'start' is defined twice"),
    ('start: ""', "line 1: empty string literals"),
    ('start: /a(?=b)/', "line 1: regex /a\\(\\?=b\\)/: lookaround"),
    ('start: /ab/x', "flags 'x' are not supported"),
    ('start: "b".."a"', "line 1: bad range"),
    ('start: x\n_sep{a}: a', "line 2: templates"),
    ('start: "a"\n%declare X', "line 2: %declare is not supported"),
    ('%import .other.X\nstart: "a"', "line 1: expected a module"),
    ('%import mygrammars.X\nstart: "a"', "only %import common"),
    ('%import common.NOPE\nstart: "a"', "common has no terminal 'NOPE'"),
    ('start: "a" ~ 3..1', "bad repetition"),
    ('start: ("a"', r"expected '\)'"),
    ('start: "a" $', "unexpected '\\$'"),
    ('start: start "a"', "left recursion"),
    ('  \n', "the grammar is empty"),
])
def test_lark_grammars_it_cannot_follow_are_errors_naming_the_line(grammar, message):
    assert_grammar_refused(grammar, message)


@pytest.fixture(scope="module")
def vocab(model_factory):
    return llama_vocab(model_factory)


def test_random_guided_walks_that_end_are_what_lark_parses(vocab):
    ended = ended_walks(Guide(None, vocab, grammar=CALC), vocab, random.Random(3), 25, 40, 0.3)
    for data in ended:
        assert lark_accepts(CALC, data.decode()), data
    assert len(ended) >= 10


def test_lark_guided_requests_end_in_text_lark_parses(model_factory):
    sums = 'start: INT (("+" | "*") INT) ~ 0..3\nINT: DIGIT ~ 1..3\n%import common.DIGIT'  # bounded: it must end
    llm = LLM(model_factory("llama"), dtype="float32", device="cpu")
    free = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    alone = llm.generate(["Hello there"], free)
    # Sampled greetings may run out of tokens instead (random weights can repeat the ignored space; about half did,
    # with torch.multinomial as with the sampler now): each that ends must parse, and some end.
    greet = [SamplingParams(max_tokens=40, temperature=0.9, seed=seed, guided_grammar=GREETINGS) for seed in range(6)]
    outs = llm.generate(["Hello there", "Sum:"] + ["Greet:"] * len(greet),
                        [free, SamplingParams(max_tokens=40, temperature=0, guided_grammar=sums)] + greet)
    assert outs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    summed = outs[1].outputs[0]
    assert summed.finish_reason == "stop" and lark_accepts(sums, summed.text), summed.text
    assert re.search(r"[0-9]", summed.text)
    greetings = [out.outputs[0] for out in outs[2:]]
    for o in greetings:
        assert o.finish_reason == "length" or lark_accepts(GREETINGS, o.text), o.text
    assert sum(o.finish_reason == "stop" for o in greetings) >= 2, [o.text for o in greetings]
