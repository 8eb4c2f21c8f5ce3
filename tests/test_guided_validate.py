"""``SchemaValidator`` (a value against a schema, by the guided-decoding machine) against the ``jsonschema``
library on random values: the same verdict on every one."""

from __future__ import annotations

import random

import jsonschema
import pytest

from coserve.guided.validate import SchemaValidator

SCHEMAS = [
    {"type": "object", "properties": {"q": {"type": "string", "maxLength": 4}, "n": {"type": "integer", "minimum": 0,
                                                                                    "maximum": 9}},
     "required": ["q"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", 1]}, "maxItems": 2}},
     "additionalProperties": False},
    {"anyOf": [{"type": "string", "pattern": "^x+$"}, {"type": "array", "items": {"type": "number"}, "minItems": 1},
               {"type": "null"}]},
    {"type": "object", "properties": {"q": {"const": "hi"}, "n": {"type": ["boolean", "integer"]}},
     "required": ["q", "n"], "additionalProperties": {"type": "string"}},
]


def _value(rng: random.Random, depth: int = 0):
    if depth == 0 and rng.random() < 0.6:  # mostly objects at the top, which most of the schemas want
        return {k: _value(rng, 1) for k in rng.sample(["q", "n", "tags", "extra"], rng.randint(1, 3))}
    kind = rng.choice(["str", "int", "float", "bool", "null", "list", "dict"] if depth < 2 else
                      ["str", "int", "float", "bool", "null"])
    if kind == "str":
        return rng.choice(["", "x", "xx", "hi", "abcde", "a", "b", "é", 'q"'])
    if kind == "int":
        return rng.randint(-3, 12)
    if kind == "float":
        return rng.choice([0.5, -1.25, 1e-7, 3.0])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {k: _value(rng, depth + 1) for k in rng.sample(["q", "n", "tags", "extra"], rng.randint(0, 4))}


@pytest.mark.parametrize("schema", SCHEMAS)
def test_the_machine_validates_as_jsonschema_does(schema):
    rng = random.Random(7)
    ours = SchemaValidator(schema)
    verdicts = []
    edges = [{"q": "hi", "n": True, "x": "s"}, {"q": "hi", "n": 2.0}, {"q": "ab", "n": 3}, {"tags": ["a", 1]},
             {"tags": ["a", 1.0]}, "xxx", [1.5], None, {"q": "hi", "n": 1, "x": 1}]  # each valid somewhere
    for value in edges + [_value(rng) for _ in range(400)]:
        expected = jsonschema.Draft202012Validator(schema).is_valid(value)
        assert ours.matches(value) == expected, value
        verdicts.append(expected)
    assert any(verdicts) and not all(verdicts)  # both answers were tested
