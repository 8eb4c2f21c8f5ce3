"""OpenAI's graders (the reinforcement fine-tuning method's reward, and ``/v1/fine_tuning/alpha/graders``): a JSON
spec checked once (:func:`parse_grader`, errors naming the field), then scores in [0, 1] for samples against their
data-set items (:meth:`Grader.grade`).

- ``string_check``: ``input`` against ``reference`` by ``operation``: ``eq``, ``ne``, ``like`` (the reference
  occurs in the input) or ``ilike`` (the same, ignoring case): 1 or 0.
- ``text_similarity``: ``evaluation_metric`` of ``input`` against ``reference`` (``text_similarity.py``).
- ``python``: ``grade(sample, item)`` of the ``source`` (``python_grader.py``), where the caller allows it.
- ``multi``: named ``graders`` combined by ``calculate_output`` (``grader_formula.py``).

``input`` and ``reference`` are templates: ``{{ item.answer }}`` is the data-set line's ``answer`` field (a path
``item.a.b`` goes deeper), ``{{ sample.output_text }}`` the model's output, ``{{ sample.output_json.x }}`` a field
of that output read as JSON. Model graders (``score_model``, ``label_model``) are not supported.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from coserve.finetune.grader_formula import Formula
from coserve.finetune.python_grader import check_source, run_python_grader
from coserve.finetune.text_similarity import METRICS, UNSUPPORTED, similarity

OPERATIONS = ("eq", "ne", "like", "ilike")
TYPES = ("string_check", "text_similarity", "python", "multi")
_PLACE = re.compile(r"\{\{\s*(.*?)\s*\}\}")
_PATH = re.compile(r"(item|sample)((?:\.[A-Za-z_][A-Za-z0-9_-]*|\.\d+)*)")
SAMPLE_FIELDS = ("output_text", "output_json", "output_tools")


class GradingError(ValueError):
    """A sample that cannot be scored; ``kind`` is the flag of OpenAI's grader-run ``metadata.errors`` it sets."""

    def __init__(self, message: str, kind: str = "other_error") -> None:
        super().__init__(message)
        self.kind = kind


def make_sample(text: str) -> dict:
    """The ``sample`` namespace of a model output: its text, the text read as JSON (None when it is not JSON) and
    its tool calls (none: coserve's completions are text)."""
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    return {"output_text": text, "output_json": parsed, "output_tools": []}


class Template:
    """A grader's ``input`` or ``reference``: text with ``{{ item.* }}`` and ``{{ sample.* }}`` places."""

    def __init__(self, text: object, where: str) -> None:
        if not isinstance(text, str):
            raise ValueError(f"{where}: expected text (a template such as '{{{{ item.answer }}}}')")
        self.text, self.where = text, where
        self.places: list[tuple[str, tuple[str, ...]]] = []
        for m in _PLACE.finditer(text):
            path = _PATH.fullmatch(m.group(1))
            if path is None:
                raise ValueError(f"{where}: {m.group(0)} is not item.<field> or sample.<field>")
            keys = tuple(path.group(2).split(".")[1:])
            if path.group(1) == "sample" and (not keys or keys[0] not in SAMPLE_FIELDS
                                               or (keys[0] != "output_json" and len(keys) > 1)):
                raise ValueError(f"{where}: {m.group(0)}: the sample has {', '.join(SAMPLE_FIELDS)} "
                                 "(output_json.<field> goes into the output read as JSON)")
            self.places.append((path.group(1), keys))

    def render(self, item: Any, sample: dict) -> str:
        """The text with each place filled (text as it is, other values as JSON); ValueError naming a place the
        item or the sample does not have."""
        values = iter(self.places)

        def fill(m: re.Match) -> str:
            root, keys = next(values)
            value: Any = item if root == "item" else sample
            for k in keys:
                if isinstance(value, dict) and k in value:
                    value = value[k]
                elif isinstance(value, list) and k.isdigit() and int(k) < len(value):
                    value = value[int(k)]
                else:
                    raise ValueError(f"{self.where}: {m.group(0)}: the {root} has no {'.'.join((root, *keys))}")
            return value if isinstance(value, str) else json.dumps(value)

        return _PLACE.sub(fill, self.text)


@dataclass(slots=True)
class Grader:
    """A checked grader. ``grade`` scores samples (``make_sample``) against their items, one score each, and gives
    the scores of a multi grader's graders too (by name)."""

    type: str
    name: str
    spec: dict  # as given (what validate returns)
    input: Template | None = None
    reference: Template | None = None
    operation: str = ""  # string_check's
    metric: str = ""  # text_similarity's
    source: str = ""  # python's
    graders: dict[str, Grader] = field(default_factory=dict)  # multi's
    formula: Formula | None = None  # multi's

    def grade(self, samples: list[dict], items: list[Any]) -> tuple[list[float], dict[str, list[float]]]:
        """``(scores, sub_scores)``; a ``GradingError`` naming the grader and the sample when one cannot be scored."""
        if self.type == "python":
            try:
                out = run_python_grader(self.source, list(zip(samples, items)))
            except ValueError as e:
                raise GradingError(f"grader {self.name!r}: {e}", "python_grader_server_error") from None
            for i, value in enumerate(out):
                if isinstance(value, str):
                    raise GradingError(f"grader {self.name!r}: sample {i}: {value}", "python_grader_runtime_error")
            return out, {}
        if self.type == "multi":
            subs = {key: g.grade(samples, items)[0] for key, g in self.graders.items()}
            scores = []
            for i in range(len(samples)):
                try:
                    scores.append(self.formula.value({k: v[i] for k, v in subs.items()}))
                except ValueError as e:
                    raise GradingError(f"grader {self.name!r}: sample {i}: {e}") from None
            return scores, subs
        scores = []
        for i, (sample, item) in enumerate(zip(samples, items)):
            try:
                text, ref = self.input.render(item, sample), self.reference.render(item, sample)
            except ValueError as e:
                raise GradingError(f"grader {self.name!r}: sample {i}: {e}", "invalid_variable_error") from None
            scores.append(similarity(self.metric, text, ref) if self.type == "text_similarity"
                          else float(_string_check(self.operation, text, ref)))
        return scores, {}


def _string_check(operation: str, text: str, ref: str) -> bool:
    if operation == "eq":
        return text == ref
    if operation == "ne":
        return text != ref
    if operation == "like":
        return ref in text
    return ref.lower() in text.lower()


def parse_grader(spec: object, where: str = "grader", allow_python: bool = True) -> Grader:
    """A checked :class:`Grader` from OpenAI's JSON spec; ValueError naming the field (``grader.operation: ...``).
    ``allow_python``: whether a ``python`` grader may run (a server runs one only when its operator allows it)."""
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: expected a grader object with a 'type'")
    kind = spec.get("type")
    if kind in ("score_model", "label_model"):
        raise ValueError(f"{where}.type: {kind} graders are not supported (coserve has no grader model); use one "
                         f"of {', '.join(TYPES)}")
    if kind not in TYPES:
        raise ValueError(f"{where}.type: expected one of {', '.join(TYPES)}, got {kind!r}")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name: expected a non-empty name")
    g = Grader(kind, name, spec)
    if kind in ("string_check", "text_similarity"):
        g.input, g.reference = Template(spec.get("input"), f"{where}.input"), Template(spec.get("reference"),
                                                                                          f"{where}.reference")
    if kind == "string_check":
        g.operation = spec.get("operation")
        if g.operation not in OPERATIONS:
            raise ValueError(f"{where}.operation: expected one of {', '.join(OPERATIONS)}, got {g.operation!r}")
    elif kind == "text_similarity":
        g.metric = spec.get("evaluation_metric")
        if g.metric not in METRICS:
            why = f" ({UNSUPPORTED[g.metric]})" if isinstance(g.metric, str) and g.metric in UNSUPPORTED else ""
            raise ValueError(f"{where}.evaluation_metric: {g.metric!r} is not supported{why}; one of "
                             f"{', '.join(METRICS)}")
    elif kind == "python":
        if not allow_python:
            raise ValueError(f"{where}.type: python graders are off on this server (its operator starts it with "
                             "--python-graders to run them)")
        g.source = check_source(spec.get("source"), f"{where}.source")
    else:
        g.graders = _sub_graders(spec.get("graders"), f"{where}.graders", allow_python)
        g.formula = Formula(spec.get("calculate_output"), set(g.graders), f"{where}.calculate_output")
    return g


def _sub_graders(graders: object, where: str, allow_python: bool) -> dict[str, Grader]:
    """A multi grader's graders: a mapping of names to graders (one grader alone goes by its own name)."""
    if isinstance(graders, dict) and "type" in graders:
        graders = {graders.get("name"): graders}
    if not isinstance(graders, dict) or not graders:
        raise ValueError(f"{where}: expected an object of named graders")
    out = {}
    for key, sub in graders.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"{where}: {key!r} is not a name a formula can use (letters, digits and '_')")
        if isinstance(sub, dict) and sub.get("type") == "multi":
            raise ValueError(f"{where}.{key}.type: a multi grader's graders cannot be multi graders")
        out[key] = parse_grader(sub, f"{where}.{key}", allow_python)
    return out


def grader_reward(grader: Grader):
    """The grader as a GRPO reward function (``LLM.finetune(reward_funcs=...)``): each completion scored against its
    record's other fields as the ``item`` (a chat completion's text is its message's content)."""

    def reward(prompts: list, completions: list, completion_ids: list | None = None, **columns: list) -> list[float]:
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        items = [{k: v[i] for k, v in columns.items()} for i in range(len(texts))]
        return grader.grade([make_sample(t) for t in texts], items)[0]

    reward.__name__ = grader.name
    return reward
