"""OpenAI's graders (the reinforcement fine-tuning method's reward, and ``/v1/fine_tuning/alpha/graders``): a JSON
spec checked once (:func:`parse_grader`, errors naming the field), then scores (in [0, 1], or a score model's
``range``) for samples against their data-set items.

- ``string_check``: ``input`` against ``reference`` by ``operation``: ``eq``, ``ne``, ``like`` (the reference
  occurs in the input) or ``ilike`` (the same, ignoring case): 1 or 0.
- ``text_similarity``: ``evaluation_metric`` of ``input`` against ``reference`` (``text_similarity.py``).
- ``python``: ``grade(sample, item)`` of the ``source`` (``python_grader.py``), where the caller allows it.
- ``score_model``, ``label_model``: a model the engine serves grades the sample (``model_graders.py``), through the
  judge the caller gives.
- ``multi``: named ``graders`` combined by ``calculate_output`` (``grader_formula.py``).

``input`` and ``reference`` are templates (``grader_template.py``): ``{{ item.answer }}`` is the data-set line's
``answer`` field (a path ``item.a.b`` goes deeper), ``{{ sample.output_text }}`` the model's output,
``{{ sample.output_json.x }}`` a field of that output read as JSON.

``outcomes`` grades each sample on its own (a sample that cannot be graded is a ``GradingError`` whose ``kind`` is
OpenAI's error flag); ``grade`` raises the first such error.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from coserve.finetune.grader_formula import Formula
from coserve.finetune.grader_template import Template, make_sample
from coserve.finetune.model_graders import CountingJudge, Judge, ModelGrading, parse_model_grader
from coserve.finetune.python_grader import check_source, run_python_grader
from coserve.finetune.text_similarity import METRICS, UNSUPPORTED, similarity

OPERATIONS = ("eq", "ne", "like", "ilike")
TYPES = ("string_check", "text_similarity", "python", "multi", "score_model", "label_model")
MODEL_TYPES = ("score_model", "label_model")


class GradingError(ValueError):
    """A sample that cannot be scored; ``kind`` is the flag of OpenAI's grader-run ``metadata.errors`` it sets."""

    def __init__(self, message: str, kind: str = "other_error") -> None:
        super().__init__(message)
        self.kind = kind


Outcome = float | GradingError  # a sample's score, or why it has none


@dataclass(slots=True)
class Grader:
    """A checked grader. ``outcomes`` scores samples (``make_sample``) against their items, one outcome each, and
    gives the outcomes of a multi grader's graders too (by name)."""

    type: str
    name: str
    spec: dict  # as given (what validate returns)
    where: str = "grader"  # the field it was given as (grader.graders.x), for errors about it
    input: Template | None = None
    reference: Template | None = None
    operation: str = ""  # string_check's
    metric: str = ""  # text_similarity's
    source: str = ""  # python's
    graders: dict[str, Grader] = field(default_factory=dict)  # multi's
    formula: Formula | None = None  # multi's
    model: ModelGrading | None = None  # score_model's and label_model's

    def walk(self):
        """This grader and those within it."""
        yield self
        for g in self.graders.values():
            yield from g.walk()

    def grade(self, samples: list[dict], items: list[Any], judge: Judge | None = None
              ) -> tuple[list[float], dict[str, list[float]]]:
        """``(scores, sub_scores)``; the first sample's ``GradingError`` when any cannot be scored."""
        scores, subs = self.outcomes(samples, items, judge)
        for x in scores:
            if isinstance(x, GradingError):
                raise x
        return scores, subs

    def outcomes(self, samples: list[dict], items: list[Any], judge: Judge | None = None
                 ) -> tuple[list[Outcome], dict[str, list[Outcome]]]:
        """Each sample's score or ``GradingError`` (naming the grader and the sample), and a multi grader's
        graders' outcomes by name. ``judge`` runs a model grader's calls."""
        if self.type == "python":
            return self._python(samples, items), {}
        if self.type in MODEL_TYPES:
            return self._model(samples, items, judge), {}
        if self.type == "multi":
            subs = {key: g.outcomes(samples, items, judge)[0] for key, g in self.graders.items()}
            out: list[Outcome] = []
            for i in range(len(samples)):
                failed = next((v[i] for v in subs.values() if isinstance(v[i], GradingError)), None)
                if failed is not None:
                    out.append(failed)
                    continue
                try:
                    out.append(self.formula.value({k: v[i] for k, v in subs.items()}))
                except ValueError as e:
                    out.append(self._error(i, e, "other_error"))
            return out, subs
        out = []
        for i, (sample, item) in enumerate(zip(samples, items)):
            try:
                text, ref = self.input.render(item, sample), self.reference.render(item, sample)
            except ValueError as e:
                out.append(self._error(i, e, "invalid_variable_error"))
                continue
            out.append(similarity(self.metric, text, ref) if self.type == "text_similarity"
                       else float(_string_check(self.operation, text, ref)))
        return out, {}

    def _error(self, i: int, e: Exception, kind: str) -> GradingError:
        return GradingError(f"grader {self.name!r}: sample {i}: {e}", kind)

    def _python(self, samples: list[dict], items: list[Any]) -> list[Outcome]:
        try:
            out = run_python_grader(self.source, list(zip(samples, items)))
        except ValueError as e:  # the whole batch: its process failed
            error = GradingError(f"grader {self.name!r}: {e}", "python_grader_server_error")
            return [error] * len(samples)
        return [self._error(i, v, "python_grader_runtime_error") if isinstance(v, str) else v
                for i, v in enumerate(out)]

    def _model(self, samples: list[dict], items: list[Any], judge: Judge | None) -> list[Outcome]:
        """One call a sample, all run by the judge together; each reply read as a score."""
        out: list[Outcome | None] = [None] * len(samples)
        calls = {}
        for i, (sample, item) in enumerate(zip(samples, items)):
            try:
                calls[i] = self.model.call(item, sample)
            except ValueError as e:
                out[i] = self._error(i, e, "invalid_variable_error")
        if calls:
            try:
                if judge is None:
                    raise LookupError("no model serves graders here (a model grader needs the engine's judge)")
                replies = judge(list(calls.values()))
            except (LookupError, ValueError, RuntimeError) as e:
                for i in calls:
                    out[i] = self._error(i, e, "model_grader_server_error")
            else:
                for i, reply in zip(calls, replies):
                    try:
                        out[i] = self.model.score(reply)
                    except ValueError as e:
                        out[i] = self._error(i, e, "model_grader_parse_error")
        return out


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
    if kind not in TYPES:
        raise ValueError(f"{where}.type: expected one of {', '.join(TYPES)}, got {kind!r}")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name: expected a non-empty name")
    g = Grader(kind, name, spec, where)
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
    elif kind in MODEL_TYPES:
        g.model = parse_model_grader(spec, where)
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


def grader_reward(grader: Grader, judge: Judge | None = None):
    """The grader as a GRPO reward function (``LLM.finetune(reward_funcs=...)``): each completion scored against its
    record's other fields as the ``item`` (a chat completion's text is its message's content); ``judge`` runs a
    model grader's calls. A completion that cannot be graded gets 0, as OpenAI's reinforcement fine-tuning gives it;
    after each call the function's ``grading_errors`` counts them by kind, and its ``grading_tokens`` the model
    graders' tokens by model (what a GRPO step logs)."""

    def reward(prompts: list, completions: list, completion_ids: list | None = None, **columns: list) -> list[float]:
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        items = [{k: v[i] for k, v in columns.items()} for i in range(len(texts))]
        counting = CountingJudge(judge) if judge is not None else None
        outcomes = grader.outcomes([make_sample(t) for t in texts], items, counting)[0]
        reward.grading_errors = dict(Counter(x.kind for x in outcomes if isinstance(x, GradingError)))
        reward.grading_tokens = counting.per_model if counting is not None else {}
        return [0.0 if isinstance(x, GradingError) else x for x in outcomes]

    reward.__name__ = grader.name
    reward.grading_errors, reward.grading_tokens = {}, {}
    return reward
