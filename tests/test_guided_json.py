"""Guided decoding: the JSON machine against ``json``/``jsonschema`` as oracles, its token masks against a
brute-force walk of the vocabulary, and the engine's guided requests (valid, schema-conforming output; other
requests in the same batch untouched)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import random
import uuid

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coserve import LLM, SamplingParams
from coserve.guided.guide import Guide, Vocabulary
from coserve.guided.machine import JsonMachine, initial_state
from coserve.guided.schema import SchemaError, compile_schema
from coserve.guided.vocab import token_bytes
from coserve.model.tokenizer import load_tokenizer
from guided_helpers import ended_walks

RECORD = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tags"],
          "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 12, "x", None]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
                         "score": {"type": "number"}, "count": {"type": "integer"},
                         "kind": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/leaf"}]}},
          "$defs": {"leaf": {"type": "object", "properties": {"id": {"const": "a\"b"}}, "required": ["id"],
                             "additionalProperties": False}}}


def accepts(schema, text: str) -> bool | None:
    """True: a whole value; False: a live prefix; None: rejected at some byte."""
    compiled = compile_schema(schema)
    machine, state = JsonMachine(compiled.nodes), initial_state(compiled.root)
    for b in text.encode():
        state = machine.step(state, b)
        if not state:
            return None
    return machine.accepting(state)


def valid_under(schema, text: str) -> bool:
    """The oracle: ``jsonschema``'s verdict on the document."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except jsonschema.ValidationError:
        return False
    return True


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(value=st.dictionaries(st.text(max_size=5), json_values, max_size=4), ascii_only=st.booleans())
def test_any_object_as_json_dumps_writes_it_is_accepted_and_no_prefix_is_whole(value, ascii_only):
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert accepts({"type": "object"}, text) is True
    assert accepts({"type": "object"}, text[:-1]) is False


@pytest.mark.parametrize("text", ['{"a" : 1}', '[1]', '{"a": 01}', '{"a": 1,}', '{"a":  1}', '{"a": tru}',
                                  '{"a": "\x01"}', '{"a": "\\x"}', '{"a": 1.}', '{"a": -}', '{"a": 1e}', ' {}'])
def test_not_json_or_not_an_object_is_rejected(text):
    assert accepts({"type": "object"}, text) is None


@pytest.mark.parametrize("text, whole", [
    ('{"ok": true, "n": 1, "tags": []}', True),
    ('{"ok": false, "n": 12, "tags": ["abcd", "\u00e9"], "score": -0.5e3, "count": 7}', True),
    ('{"ok": true, "n": null, "tags": [], "kind": {"id": "a\\"b"}}', True),
    ('{"ok": true, "n": "x", "tags": [], "kind": null}', True),
    ('{"ok": true, "n": 1', False),
])
def test_documents_matching_the_schema_are_accepted(text, whole):
    assert accepts(RECORD, text) is whole
    if whole:
        jsonschema.validate(json.loads(text), RECORD)


@pytest.mark.parametrize("text, whole", [
    ('{"ok": true, "n": 1, "tags": [], "count": 7}', True),  # optional keys may be left out, in order
    ('{"ok": true, "n": 1, "tags": [], "kind": null}', True),
    ('{"tags": [], "n": 12, "ok": false}', None),  # out of the schema's order
    ('{"ok": true, "tags": [], "n": 1}', None),  # a required key skipped
    ('{"ok": true, "n": 1, "tags": [], "count": 7, "score": 1}', None),  # an optional key after a later one
])
def test_a_closed_objects_keys_come_in_the_schemas_order(text, whole):
    """As OpenAI's structured outputs and llama.cpp's schema grammars write them: the model decides each value
    knowing the keys before it (a tool call's function before its parameters). Every order is valid JSON Schema;
    the guide keeps one."""
    assert accepts(RECORD, text) is whole
    assert valid_under(RECORD, text)


@pytest.mark.parametrize("text", [
    '{"ok": true, "n": 2, "tags": []}',  # not in the enum
    '{"ok": true, "tags": []}',  # n is required
    '{"ok": true, "n": 1, "tags": ["abcde"]}',  # over maxLength
    '{"ok": true, "n": 1, "tags": ["a", "b", "c"]}',  # over maxItems
    '{"ok": true, "n": 1, "tags": [], "extra": 1}',  # additionalProperties is false
    '{"ok": true, "n": 1, "tags": [], "count": 1.5}',  # not an integer
    '{"ok": true, "n": 1, "tags": [], "kind": {"id": "ab"}}',  # not the const
])
def test_documents_breaking_the_schema_are_rejected(text):
    assert accepts(RECORD, text) in (None, False)
    with pytest.raises((jsonschema.ValidationError, json.JSONDecodeError)):
        jsonschema.validate(json.loads(text), RECORD)


PATTERNED = {"type": "object", "additionalProperties": False, "required": ["code", "name"],
             "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{2,3}$"},
                            "name": {"type": "string", "pattern": "é|a\\\\b", "maxLength": 6}}}


@settings(max_examples=300, deadline=None)
@given(code=st.sampled_from(["AB-12", "ZZ-999", "AB-1", "ab-12", "AB-1234", "xAB-12"]),
       name=st.text(alphabet=st.sampled_from(list('abé"\\\nxy\u00ff')), max_size=8), ascii_only=st.booleans())
def test_pattern_is_searched_in_the_decoded_string_as_jsonschema_does(code, name, ascii_only):
    """JSON Schema's pattern (``re.search`` on the decoded content, via ``jsonschema``) is the oracle; escapes
    such as \\u00e9 and \\\\ are decoded before the pattern sees them."""
    text = json.dumps({"code": code, "name": name}, ensure_ascii=ascii_only)
    assert (accepts(PATTERNED, text) is True) == valid_under(PATTERNED, text)


def test_a_pattern_string_refuses_a_surrogate_escape_and_closes_only_when_matched():
    schema = {"type": "string", "pattern": "^x+$"}
    assert accepts(schema, '"xx"') is True
    assert accepts(schema, '"x') is False
    assert accepts(schema, '""') is None
    assert accepts(schema, '"\\ud83d\\ude00"') is None
    assert accepts({"type": "string"}, '"\\ud83d\\ude00"') is True


BOUNDED = {"type": "object", "additionalProperties": False, "required": ["n", "x"],
           "properties": {"n": {"type": "integer", "minimum": -12, "exclusiveMaximum": 250},
                          "x": {"type": "number", "minimum": -3, "maximum": 7}}}


@settings(max_examples=300, deadline=None)
@given(n=st.integers(-400, 400), x=st.one_of(st.integers(-20, 20), st.decimals(-20, 20, places=3).map(float)))
def test_minimum_and_maximum_are_kept_exactly_as_jsonschema_checks_them(n, x):
    text = json.dumps({"n": n, "x": x})
    assert (accepts(BOUNDED, text) is True) == valid_under(BOUNDED, text)


def test_a_bounded_number_is_written_without_exponent_and_ends_where_the_value_may():
    schema = {"type": "integer", "minimum": 10, "maximum": 300}
    assert accepts(schema, "25") is True and accepts(schema, "3") is False  # "3" may still become 30..300
    assert accepts(schema, "301") is None and accepts(schema, "0") is None and accepts(schema, "-5") is None
    assert accepts({"type": "number", "maximum": 7}, "7.0") is True and accepts({"type": "number", "maximum": 7},
                                                                                  "7.5") is None
    assert accepts({"type": "number", "minimum": 0}, "1e3") is None


FORMAT_CHECKS = {
    "date": datetime.date.fromisoformat, "time": datetime.time.fromisoformat,
    "date-time": datetime.datetime.fromisoformat, "uuid": uuid.UUID, "ipv4": ipaddress.IPv4Address,
    "email": lambda t: t.count("@") == 1 and "." in t.split("@")[1] or throw(),
    "hostname": lambda t: all(0 < len(p) <= 63 and p[0] != "-" and p[-1] != "-" for p in t.split(".")) or throw(),
}


def throw():
    raise ValueError("invalid")


@pytest.mark.parametrize("fmt", list(FORMAT_CHECKS))
def test_string_formats_are_kept_by_random_guided_walks(vocab, fmt):
    """Soundness: every string a guided walk ends is valid for its format by Python's own parsers (dates against
    the calendar: February 29th only in leap years)."""
    _, v = vocab
    schema = {"type": "string", "format": fmt}
    # end when allowed; otherwise lean towards the bytes that move a walk on (the quote, '@', '.')
    ended = ended_walks(Guide(schema, v), v, random.Random(list(FORMAT_CHECKS).index(fmt)), 20, 120, 1.0,
                        lean=b'"@.', lean_chance=0.3)
    for data in ended:
        FORMAT_CHECKS[fmt](json.loads(data.decode()))
    assert len(ended) >= 12
    assert accepts({"type": "string", "format": "date"}, '"2023-02-29"') is None
    assert accepts({"type": "string", "format": "date"}, '"2024-02-29"') is True
    assert accepts({"type": "string", "format": "date", "pattern": "^x$"}, '"x"') is True  # the pattern wins
    assert accepts({"type": "string", "format": "color"}, '"red"') is True  # an unknown format: an annotation


def test_a_key_twice_is_rejected_though_json_loads_would_keep_the_last():
    assert accepts(RECORD, '{"ok": true, "n": 1, "tags": [], "ok": false}') is None
    assert accepts({"type": "object", "properties": {"a": {}}}, '{"a": 1, "a": 2}') is None


@pytest.mark.parametrize("schema, message", [
    ({"type": "string", "pattern": "(a"}, "schema.pattern: missing"),
    ({"type": "string", "pattern": "a{3,1}"}, "schema.pattern: quantifier"),
    ({"type": "object", "properties": {"a": {"multipleOf": 3}}}, "schema.properties.a: keyword 'multipleOf'"),
    ({"type": "number", "exclusiveMinimum": 0}, "schema.exclusiveMinimum: not supported on a number"),
    ({"type": "number", "minimum": 0.5}, "schema.minimum: only whole-number bounds"),
    ({"type": "integer", "minimum": 3, "maximum": 2.5}, "schema: no integer lies within its bounds"),
    ({"type": "integer", "minimum": True}, "schema.minimum: must be a finite number"),
    ({"type": "thing"}, "schema.type: must be one of"),
    ({"$ref": "#/$defs/missing"}, "does not resolve"),
    ({"type": "object", "properties": {}, "required": ["a"]}, "'a' is not among the properties"),
    (False, "false matches nothing"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "maxItems: 1 is below minItems 3"),
])
def test_unsupported_or_invalid_schemas_name_the_keyword(schema, message):
    with pytest.raises(SchemaError, match=message.replace("(", r"\(")):
        compile_schema(schema)
    with pytest.raises(ValueError, match="guided_json: "):
        SamplingParams(guided_json=schema)


@pytest.fixture(scope="module")
def vocab(model_factory):
    tokenizer = load_tokenizer(model_factory("llama"))
    return tokenizer, Vocabulary(token_bytes(tokenizer, len(tokenizer)), frozenset({tokenizer.eos_token_id}),
                                 torch.device("cpu"))


def test_token_bytes_are_what_the_tokenizer_decodes(vocab):
    tokenizer, v = vocab
    text = 'Ünïcode {"key": [1, 2.5, "naïve ✓"]}\n'
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert b"".join(v.vocab[i] for i in ids).decode() == text
    assert all(v.vocab[i] is None for i in tokenizer.all_special_ids)


MIXED = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}},
         "additionalProperties": {"type": "string", "minLength": 1}}  # keys collected; strings counted


@pytest.mark.parametrize("schema", [RECORD, {"type": "object"}, MIXED], ids=["record", "json_object", "mixed"])
def test_masks_are_exactly_the_tokens_the_machine_takes(vocab, schema):
    """At random points of random guided walks, the allowed ids equal a brute-force check of every token (inside
    strings too, where plain tokens are allowed without a walk)."""
    _, v = vocab
    guide, trie = Guide(schema, v), _byte_trie(v.vocab)
    rng = random.Random(0)
    for _ in range(3):
        state = guide.start
        for _ in range(25):
            allowed = guide.allowed_ids(state)
            brute = _takes_any(guide, state, trie)
            whole = guide.machine.accepting(state)
            assert sorted(allowed) == sorted(brute + (v.eos_ids if whole or not brute else []))
            assert guide.allowed(state).nonzero().flatten().tolist() == sorted(allowed)
            token = rng.choice(allowed)
            if token in v.eos_ids:
                break
            state = guide.advance(state, token)


def _byte_trie(vocab: list[bytes | None]) -> dict:
    """Every token's bytes as a path of nested dicts; a node's ``None`` key lists the ids whose bytes end there."""
    root: dict = {}
    for i, data in enumerate(vocab):
        if data is not None:
            node = root
            for b in data:
                node = node.setdefault(b, {})
            node.setdefault(None, []).append(i)
    return root


def _takes_any(guide: Guide, state, trie: dict) -> list[int]:
    """The ids whose every byte the machine takes from ``state``, stepping it byte by byte (each shared prefix of
    the vocabulary stepped once)."""
    taken, stack = [], [(trie, state)]
    while stack:
        node, at = stack.pop()
        for b, child in node.items():
            if b is None:
                continue
            after = guide.machine.step(at, b)
            if after:
                taken.extend(child.get(None, ()))
                stack.append((child, after))
    return taken


def test_random_guided_walks_that_end_are_valid_documents(vocab):
    """Soundness: sampling uniformly among the allowed tokens, every walk that reaches end-of-sequence spells a
    document ``jsonschema`` accepts."""
    _, v = vocab
    schema = {k: val for k, val in RECORD.items() if k != "required"} | {"required": ["ok"]}
    ended = ended_walks(Guide(schema, v), v, random.Random(1), 40, 200, 0.5)
    for data in ended:
        jsonschema.validate(json.loads(data.decode()), schema)
    assert len(ended) >= 10


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(model_factory("llama"), dtype="float32", device="cpu")


def test_guided_requests_match_their_schema_and_leave_others_alone(llm):
    small = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
             "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 12, "x"]}}}
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate(["Hello there", "Once upon"], free)
    prompts = ["Hello there", "Give me JSON", "Once upon", "More JSON"]
    params = [free, SamplingParams(max_tokens=40, temperature=0, guided_json=small), free,
              SamplingParams(max_tokens=40, temperature=0.8, seed=3, guided_json=small)]
    outs = llm.generate(prompts, params)
    for out in (outs[1], outs[3]):
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), small)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [o.outputs[0].token_ids for o in alone]


def test_guided_requests_with_patterns_and_bounds_validate(llm):
    for schema in (PATTERNED, BOUNDED):
        outs = llm.generate(["Code:", "Another:"], [SamplingParams(max_tokens=40, temperature=t, seed=7,
                                                                    guided_json=schema) for t in (0, 1.0)])
        for out in outs:
            assert out.outputs[0].finish_reason == "stop"
            jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_a_json_object_request_is_a_prefix_of_an_object_while_it_runs(llm):
    out = llm.generate(["Give me JSON"], SamplingParams(max_tokens=24, temperature=0,
                                                        guided_json={"type": "object"}))[0].outputs[0]
    assert accepts({"type": "object"}, out.text) is (out.finish_reason == "stop")


def test_guided_choice_outputs_exactly_one_of_the_choices(llm):
    choices = ["positive", "negative", "neutral", "neg"]  # "neg" is a prefix of another: both stay possible
    outs = llm.generate(["Sentiment of: great!", "Sentiment of: awful", "x", "y"],
                        [SamplingParams(max_tokens=10, temperature=t, seed=s, guided_choice=choices)
                         for t, s in ((0, None), (1.0, 1), (1.0, 2), (1.0, 3))])
    for out in outs:
        assert out.outputs[0].text in choices and out.outputs[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="guided_choice: "):
        SamplingParams(guided_choice=[])
    with pytest.raises(ValueError, match="give one of guided_json, guided_choice, guided_regex and guided_grammar"):
        SamplingParams(guided_choice=["a"], guided_json={"type": "object"})


@pytest.mark.parametrize("depth", [450, 3000])
def test_a_schema_nested_too_deeply_is_a_schema_error(depth):
    """The compiler recurses per level of subschemas (and the cache's key is the schema's ``repr``): past the
    interpreter's limit that was a RecursionError (a 500 at the server)."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    with pytest.raises(SchemaError, match="nests too deeply"):
        compile_schema(schema)
