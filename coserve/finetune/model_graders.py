"""OpenAI's model graders, graded by a model the engine serves (the base model, or an adapter): ``score_model``
(the model answers a number within ``range``) and ``label_model`` (the model answers one of ``labels``; the sample
passes, 1, when it is one of ``passing_labels``, else 0).

``input`` is a conversation whose messages' content are templates (``grader_template.py``), rendered per sample and
sent to ``model`` with the model's chat template. The reply's form is enforced by structured output: a score model
writes the JSON object ``{"result": <number>}`` (coserve's guided JSON; OpenAI's models also write their reasoning
steps, coserve's answer at once), a label model one of the labels (guided choice). The judge (``Judge``) runs the
calls: the server's engine for the caller's models (``coserve/server/grader_judge.py``), or an ``LLM``'s
(``coserve/engine/chat_judge.py``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from coserve.finetune.grader_template import Template
from coserve.scheduler import SamplingParams

ROLES = ("system", "developer", "user", "assistant")
TEXT_PARTS = ("input_text", "output_text")
SAMPLING_FIELDS = ("temperature", "top_p", "seed", "max_completions_tokens", "reasoning_effort")
DEFAULT_MAX_TOKENS = 64  # a reply's tokens unless sampling_params.max_completions_tokens says otherwise
MAX_LABELS = 256


@dataclass(frozen=True, slots=True)
class ModelCall:
    """One conversation for a grader model: ``model`` as a request names it, chat ``messages``, and how to sample
    (the reply's form enforced by ``params``' guide)."""

    model: str
    messages: list[dict[str, str]]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class ModelReply:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


Judge = Callable[[list[ModelCall]], list[ModelReply]]  # replies in order; LookupError names a model it cannot serve


class CountingJudge:
    """A judge that counts the tokens of the calls it passes on, by model (OpenAI's grader run reports them as
    ``model_grader_token_usage_per_model``)."""

    def __init__(self, judge: Judge) -> None:
        self.judge = judge
        self.per_model: dict[str, dict[str, int]] = {}

    def __call__(self, calls: list[ModelCall]) -> list[ModelReply]:
        replies = self.judge(calls)
        for call, reply in zip(calls, replies):
            n = self.per_model.setdefault(call.model, {"prompt_tokens": 0, "completion_tokens": 0,
                                                       "total_tokens": 0, "cached_tokens": 0})
            n["prompt_tokens"] += reply.prompt_tokens
            n["completion_tokens"] += reply.completion_tokens
            n["total_tokens"] += reply.prompt_tokens + reply.completion_tokens
        return replies


@dataclass(frozen=True, slots=True)
class ModelGrading:
    """A checked model grader: what it asks (``call``) and how it reads the reply (``score``)."""

    kind: str  # score_model or label_model
    model: str
    messages: tuple[tuple[str, Template], ...]  # (role, content template)
    params: SamplingParams
    low: float = 0.0  # score_model's range
    high: float = 1.0
    labels: tuple[str, ...] = ()  # label_model's labels, and those that pass
    passing: frozenset[str] = frozenset()

    def call(self, item: Any, sample: dict) -> ModelCall:
        """The sample's call; ValueError naming a template place the item or the sample lacks."""
        return ModelCall(self.model, [{"role": "system" if role == "developer" else role,
                                       "content": t.render(item, sample)} for role, t in self.messages], self.params)

    def score(self, reply: ModelReply) -> float:
        """The reply's score; ValueError saying why it cannot be read as one."""
        if reply.finish_reason == "length":
            raise ValueError(f"the grader model's reply was cut at {self.params.max_tokens} tokens "
                             "(sampling_params.max_completions_tokens)")
        if self.kind == "label_model":
            if reply.text not in self.labels:
                raise ValueError(f"the grader model's reply {reply.text[:200]!r} is not one of the labels")
            return 1.0 if reply.text in self.passing else 0.0
        try:
            result = json.loads(reply.text)["result"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"the grader model's reply {reply.text[:200]!r} is not {{\"result\": number}}") from None
        if isinstance(result, bool) or not isinstance(result, (int, float)) or not self.low <= result <= self.high:
            raise ValueError(f"the grader model's result {result!r} is outside the range [{self.low:g}, "
                             f"{self.high:g}]")
        return float(result)


def parse_model_grader(spec: dict, where: str) -> ModelGrading:
    """A ``score_model`` or ``label_model`` spec checked; ValueError naming the field."""
    kind = spec["type"]
    model = spec.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError(f"{where}.model: expected the name of a model this server serves")
    messages = parse_messages(spec.get("input"), f"{where}.input")
    if kind == "label_model":
        labels = spec.get("labels")
        if (not isinstance(labels, list) or not labels or len(labels) > MAX_LABELS
                or not all(isinstance(x, str) and x for x in labels) or len(set(labels)) != len(labels)):
            raise ValueError(f"{where}.labels: expected 1 to {MAX_LABELS} distinct non-empty strings")
        passing = spec.get("passing_labels")
        if not isinstance(passing, list) or not passing or not all(isinstance(x, str) for x in passing):
            raise ValueError(f"{where}.passing_labels: expected a non-empty array of labels")
        unknown = [x for x in passing if x not in labels]
        if unknown:
            raise ValueError(f"{where}.passing_labels: {unknown[0]!r} is not one of the labels")
        params = SamplingParams(temperature=0.0, max_tokens=DEFAULT_MAX_TOKENS, guided_choice=list(labels))
        return ModelGrading(kind, model, messages, params, labels=tuple(labels), passing=frozenset(passing))
    low, high = _range(spec.get("range", [0, 1]), f"{where}.range")
    schema = {"type": "object", "properties": {"result": {"type": "number", "minimum": math.floor(low),
                                                          "maximum": math.ceil(high)}},
              "required": ["result"], "additionalProperties": False}  # whole-number bounds; score() checks exactly
    params = _sampling(spec.get("sampling_params"), f"{where}.sampling_params", schema)
    return ModelGrading(kind, model, messages, params, low=low, high=high)


def parse_messages(given: object, where: str) -> tuple[tuple[str, Template], ...]:
    """The grader's conversation: messages with a role and text content (a string, a text part, or text parts),
    each text a template."""
    if not isinstance(given, list) or not given:
        raise ValueError(f"{where}: expected an array of messages")
    out = []
    for i, m in enumerate(given):
        at = f"{where}.{i}"
        if not isinstance(m, dict):
            raise ValueError(f"{at}: expected a message object with a role and content")
        if m.get("type", "message") != "message":
            raise ValueError(f"{at}.type: expected 'message', got {m.get('type')!r}")
        if m.get("role") not in ROLES:
            raise ValueError(f"{at}.role: expected one of {', '.join(ROLES)}, got {m.get('role')!r}")
        content = m.get("content")
        parts = content if isinstance(content, list) else [content]
        texts = []
        for j, part in enumerate(parts):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in TEXT_PARTS and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{at}.content{f'.{j}' if isinstance(content, list) else ''}: expected text or an "
                                 f"input_text/output_text part, got {kind!r} (coserve's models read text only)")
        out.append((m["role"], Template("".join(texts), f"{at}.content")))
    return tuple(out)


def _range(given: object, where: str) -> tuple[float, float]:
    if (not isinstance(given, list) or len(given) != 2
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in given)
            or not given[0] < given[1]):
        raise ValueError(f"{where}: expected [low, high], two finite numbers with low < high")
    if max(abs(given[0]), abs(given[1])) > 1e15:
        raise ValueError(f"{where}: the bounds must be within 1e15")
    return float(given[0]), float(given[1])


def _sampling(given: object, where: str, schema: dict) -> SamplingParams:
    """A score model's ``sampling_params``: greedy and up to ``DEFAULT_MAX_TOKENS`` tokens unless they say
    otherwise."""
    given = {} if given is None else given
    if not isinstance(given, dict):
        raise ValueError(f"{where}: expected an object")
    for key in given:
        if key not in SAMPLING_FIELDS:
            raise ValueError(f"{where}.{key}: not a sampling parameter of a score model grader (one of "
                             f"{', '.join(SAMPLING_FIELDS)})")
    effort = given.get("reasoning_effort")
    if effort not in (None, "default"):
        raise ValueError(f"{where}.reasoning_effort: coserve's models do not reason at set efforts; leave it out")
    tokens = given.get("max_completions_tokens")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= 4096):
        raise ValueError(f"{where}.max_completions_tokens: expected an integer from 1 to 4096")
    seed = given.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ValueError(f"{where}.seed: expected an integer from 0 to 2^63 - 1")
    temperature = _number(given, "temperature", 0.0, where, 0.0, 2.0)
    top_p = _number(given, "top_p", 1.0, where, 0.0, 1.0)
    if top_p == 0:
        raise ValueError(f"{where}.top_p: must be above 0")
    return SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_tokens=tokens or DEFAULT_MAX_TOKENS,
                          guided_json=schema)


def _number(given: dict, key: str, default: float, where: str, low: float, high: float) -> float:
    value = given.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"{where}.{key}: expected a number from {low:g} to {high:g}")
    return float(value)
