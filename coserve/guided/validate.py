"""A JSON value checked against a schema by the machine that guides generation (``machine.py``): the value, written
as ``json.dumps`` writes it, is fed byte by byte; it matches when the machine ends in an accepting state. So a value
matches exactly when the guide would have let a model write it (the keywords of ``schema.py``; numbers within the
machine's digit limits), except that a float with no fraction counts as the integer it equals, as JSON Schema says
(``3.0`` is an ``integer``)."""

from __future__ import annotations

import json
from typing import Any

from coserve.guided.machine import JsonMachine, initial_state
from coserve.guided.schema import compile_schema


class SchemaValidator:
    """``matches(value)`` for one schema, compiled once (``SchemaError`` if it cannot be)."""

    def __init__(self, schema: dict | bool) -> None:
        compiled = compile_schema(schema)
        self.machine, self.root = JsonMachine(compiled.nodes), compiled.root

    def matches(self, value: Any) -> bool:
        state = initial_state(self.root)
        for b in json.dumps(_integral(value), ensure_ascii=False).encode():
            state = self.machine.step(state, b)
            if not state:
                return False
        return self.machine.accepting(state)


def _integral(value: Any) -> Any:
    """``value`` with every float that is a whole number (within 1e15) written as that integer."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    return value
