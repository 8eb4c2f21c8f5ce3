"""The ways of guiding an output, by their ``SamplingParams`` field, and what compiles each (every one raises a
``ValueError`` naming what is wrong). Compiled forms are shared, so checking a field at the boundary costs the
guide nothing later."""

from __future__ import annotations

from coserve.guided.grammar import compile_grammar
from coserve.guided.regex import compile_regex
from coserve.guided.schema import compile_choices, compile_schema

COMPILERS = {"guided_json": compile_schema, "guided_choice": compile_choices, "guided_regex": compile_regex,
             "guided_grammar": compile_grammar}
