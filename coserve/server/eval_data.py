"""What OpenAI's Evals API takes, checked at the boundary (a 400 naming the field): an eval's data source config
and testing criteria (graders, ``coserve/finetune/graders.py``), a run's data source (its items, from the request
or a file of purpose ``evals``, and for a ``completions`` run the conversation template, the model and how to
sample), and ``evals`` files; each item's conversation rendered from its template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, get_args

from coserve.finetune.grader_template import Template, make_sample
from coserve.finetune.graders import Grader
from coserve.finetune.model_graders import parse_messages
from coserve.guided.schema import SchemaError
from coserve.guided.validate import SchemaValidator
from coserve.server.errors import APIError, bad_request, found
from coserve.server.grader_judge import request_grader
from coserve.server.response_format import guided_schema
from coserve.server.protocol import ReasoningEffort
from coserve.server.response_items import output_messages

CRITERIA_TYPES = ("string_check", "text_similarity", "python", "score_model", "label_model")
MAX_ITEMS = 10_000  # items a run may have
SAMPLE_SCHEMA = {"type": "object", "properties": {"output_text": {"type": "string"}, "output_json": {"type": "object"},
                                                  "output_tools": {"type": "array"}, "model": {"type": "string"},
                                                  "choices": {"type": "array"}}, "required": []}
STORED_ITEM_SCHEMA = {"type": "object", "properties": {"input": {"type": "array"}}, "required": ["input"]}
SAMPLING_FIELDS = ("max_completion_tokens", "seed", "temperature", "top_p", "response_format")
DEFAULT_MAX_TOKENS = 256  # a completion's tokens unless sampling_params.max_completion_tokens says otherwise


@dataclass(frozen=True, slots=True)
class Criterion:
    """A testing criterion: its grader and how a score passes."""

    grader: Grader
    threshold: float | None  # a score at or above it passes; None: only a perfect 1 (string_check, label_model)

    def passed(self, score: float) -> bool:
        return score >= self.threshold if self.threshold is not None else score == 1.0


def parse_eval_jsonl(data: bytes) -> list[dict]:
    """An ``evals`` file: one JSON object a line, ``{"item": {...}, "sample": {...}}`` (the sample optional) or the
    item itself; ValueError naming the line."""
    entries = []
    for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"line {number}: not JSON ({e})") from None
        entries.append(_entry(obj, f"line {number}"))
    if not entries:
        raise ValueError("the file has no items")
    return entries


def _entry(obj: Any, where: str) -> dict:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object (an item, or {{\"item\": ..., \"sample\": ...}})")
    if "item" not in obj:
        return {"item": obj, "sample": None}
    if not isinstance(obj["item"], dict):
        raise ValueError(f"{where}.item: expected an object")
    sample = obj.get("sample")
    if sample is not None and not isinstance(sample, dict):
        raise ValueError(f"{where}.sample: expected an object")
    return {"item": obj["item"], "sample": sample}


def check_data_source_config(config: Any) -> dict:
    """An eval's ``data_source_config`` as the eval object shows it: ``custom`` (items a run brings, their schema
    given), or ``logs`` (OpenAI's newer name) or ``stored_completions`` (the tenant's stored chat completions or
    responses: ``item.input`` the messages each answered, ``sample`` its reply; ``metadata`` what a run's source
    usually filters them by)."""
    kind = config.get("type") if isinstance(config, dict) else None
    if kind in ("logs", "stored_completions"):
        metadata = config.get("metadata") or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise bad_request("data_source_config.metadata: expected an object of strings",
                              "data_source_config.metadata")
        properties = {"item": STORED_ITEM_SCHEMA, "sample": SAMPLE_SCHEMA}
        return {"type": kind, "metadata": metadata,
                "schema": {"type": "object", "properties": properties, "required": list(properties)}}
    if kind != "custom":
        raise bad_request(f"data_source_config.type: expected 'custom' (items a run brings), 'logs' or "
                          f"'stored_completions', not {kind!r}", "data_source_config.type")
    schema = config.get("item_schema")
    if not isinstance(schema, dict):
        raise bad_request("data_source_config.item_schema: expected a JSON schema object",
                          "data_source_config.item_schema")
    with_sample = config.get("include_sample_schema", False)
    if not isinstance(with_sample, bool):
        raise bad_request("data_source_config.include_sample_schema: expected true or false",
                          "data_source_config.include_sample_schema")
    properties = {"item": schema, **({"sample": SAMPLE_SCHEMA} if with_sample else {})}
    return {"type": "custom", "schema": {"type": "object", "properties": properties, "required": list(properties)}}


def item_schema(ev: dict) -> dict | bool:
    """The schema an eval's items follow (its ``data_source_config``'s ``item``)."""
    return ev["data_source_config"]["schema"]["properties"]["item"]


def check_criteria(given: Any, allow_python: bool, servable) -> list[dict]:
    """An eval's ``testing_criteria`` (graders, each with its ``pass_threshold`` where it takes one), checked;
    ``servable(model)``: whether a model grader's model may be used."""
    if not isinstance(given, list) or not given:
        raise bad_request("testing_criteria: expected a non-empty array of graders", "testing_criteria")
    names = set()
    for i, spec in enumerate(given):
        where = f"testing_criteria.{i}"
        criterion = parse_criterion(spec, where, allow_python, servable)
        if criterion.grader.name in names:
            raise bad_request(f"{where}.name: {criterion.grader.name!r} names another criterion too", f"{where}.name")
        names.add(criterion.grader.name)
    return given


def parse_criterion(spec: Any, where: str, allow_python: bool = True, servable=None) -> Criterion:
    """A testing criterion's grader and pass threshold; a 400 naming the field (``servable``: as
    ``request_grader`` takes it)."""
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind not in CRITERIA_TYPES:
        raise bad_request(f"{where}.type: expected one of {', '.join(CRITERIA_TYPES)}, got {kind!r}", f"{where}.type")
    grader = request_grader(spec, where, allow_python, servable)
    threshold = spec.get("pass_threshold")
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))):
        raise bad_request(f"{where}.pass_threshold: expected a number", f"{where}.pass_threshold")
    if kind == "text_similarity" and threshold is None:
        raise bad_request(f"{where}.pass_threshold: a text_similarity criterion needs one", f"{where}.pass_threshold")
    if kind in ("string_check", "label_model"):
        threshold = None  # they pass on a match (a passing label)
    elif threshold is None:  # python: half marks; a score model: the middle of its range
        threshold = 0.5 if kind == "python" else (grader.model.low + grader.model.high) / 2
    return Criterion(grader, None if threshold is None else float(threshold))


@dataclass(frozen=True, slots=True)
class RunSource:
    """A run's data source, checked: its items and, for a ``completions`` run, how each is sampled."""

    entries: list[dict]  # {"item", "sample"}
    model: str | None = None  # completions: the model that samples
    template: tuple[tuple[str, Template], ...] | None = None  # completions: (role, content) of the conversation
    item_reference: str | None = None  # completions: the item's field holding its conversation
    sampling: dict | None = None  # completions: the chat request's sampling fields
    route: str = "chat"  # what samples: the chat API (a completions run) or the Responses API (a responses run)


def check_run_source(given: Any, store, tenant: str, servable, item_schema: dict | bool = True,
                     as_of: int | None = None) -> RunSource:
    """A run's ``data_source`` (``jsonl``; ``completions``, sampled through the chat API; ``responses``, through the
    Responses API), its items matching the eval's ``item_schema`` (where coserve can check that schema: the keywords
    of its guided decoding); 400 naming the field, 404 for a file the tenant does not have."""
    if not isinstance(given, dict) or given.get("type") not in ("jsonl", "completions", "responses"):
        kind = given.get("type") if isinstance(given, dict) else None
        raise bad_request(f"data_source.type: expected 'jsonl', 'completions' or 'responses', got {kind!r}",
                          "data_source.type")
    kind = given["source"].get("type") if isinstance(given.get("source"), dict) else None
    stored = kind in ("stored_completions", "responses")
    if kind == "stored_completions" and given["type"] != "completions":
        raise bad_request("data_source.source.type: stored completions are a completions run's source",
                          "data_source.source.type")
    if kind == "responses" and given["type"] != "responses":
        raise bad_request("data_source.source.type: stored responses are a responses run's source",
                          "data_source.source.type")
    entries = (stored_entries(given["source"], store, tenant, as_of) if kind == "stored_completions"
               else stored_response_entries(given["source"], store, tenant, as_of) if stored
               else _source_entries(given.get("source"), store, tenant))
    try:
        validator = SchemaValidator(item_schema)
    except SchemaError:
        validator = None  # a schema beyond the guided-decoding keywords: its items are not checked
    bad = next((i for i, e in enumerate(entries) if validator is not None and not validator.matches(e["item"])), None)
    if bad is not None:
        param = "data_source.source.content" if given["source"]["type"] == "file_content" else "data_source.source.id"
        raise bad_request(f"{param}: item {bad} does not match the eval's item_schema", param)
    if given["type"] == "jsonl":
        missing = next((i for i, e in enumerate(entries) if e["sample"] is None), None)
        if missing is not None:
            raise bad_request(f"data_source.source: item {missing} has no sample (a jsonl run grades samples it is "
                              "given; a completions run samples a model)", "data_source.source")
        return RunSource(entries)
    model = given.get("model")
    if stored and model is None:  # the stored replies are the samples graded
        return RunSource(entries)
    if not isinstance(model, str) or not model:
        raise bad_request(f"data_source.model: a {given['type']} run needs the model that samples",
                          "data_source.model")
    if not servable(model):
        raise APIError(404, f"The model '{model}' does not exist", "data_source.model", "model_not_found")
    asked = given.get("input_messages")
    if stored and asked is None:  # sampled again from the messages each stored completion or response answered
        asked = {"type": "item_reference", "item_reference": "item.input"}
    template, reference = parse_input_messages(asked)
    route = "responses" if given["type"] == "responses" else "chat"
    return RunSource(entries, model, template, reference, _sampling(given.get("sampling_params")), route)


def _stored_filters(source: dict, as_of: int | None) -> dict:
    """A stored source's filters that stored chat completions and stored responses share: ``metadata``, ``model``,
    ``created`` (``created_after``, ``created_before``: none stored after ``as_of``, a run's creation, so that a run
    resumed after a restart has the items it had) and ``limit`` (at most ``MAX_ITEMS``); a 400 naming the field."""
    where = "data_source.source"
    metadata = source.get("metadata") or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in metadata.items()):
        raise bad_request(f"{where}.metadata: expected an object of strings", f"{where}.metadata")
    model = source.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"{where}.model: expected a model name", f"{where}.model")
    bounds = {}
    for key in ("created_after", "created_before", "limit"):
        value = source.get(key)
        least = 1 if key == "limit" else 0
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise bad_request(f"{where}.{key}: expected an integer of at least {least}", f"{where}.{key}")
        bounds[key] = value
    if as_of is not None:
        bounds["created_before"] = min(as_of, bounds["created_before"] if bounds["created_before"] is not None
                                       else as_of)
    return {"model": model, "metadata": metadata,
            "limit": min(bounds["limit"] if bounds["limit"] is not None else MAX_ITEMS, MAX_ITEMS),
            "created": (bounds["created_after"], bounds["created_before"])}


def stored_entries(source: dict, store, tenant: str, as_of: int | None = None) -> list[dict]:
    """The tenant's stored chat completions a ``stored_completions`` source picks (``_stored_filters``), oldest
    first, as items (``input``: the messages each answered) and samples (its first choice's reply, as a completions
    run's sample shows it)."""
    where = "data_source.source"
    try:
        found, _ = store.list_chat_completions(tenant, **_stored_filters(source, as_of))
    except ValueError as e:
        raise bad_request(f"{where}.{e}", f"{where}.metadata") from None
    if not found:
        raise bad_request(f"{where}: no stored chat completion matches", where)
    answered = store.chat_messages(tenant, [c["id"] for c in found])
    entries = []
    for c in found:
        messages = answered[c["id"]]
        choice, usage = c["choices"][0], c.get("usage") or {}
        reply = choice["message"].get("content") or ""
        sample = {"input": messages, "output": [{"role": "assistant", "content": reply}],
                  "finish_reason": choice.get("finish_reason") or "", "model": c.get("model"),
                  "usage": {k: usage.get(k, 0) for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
                  "error": None}
        entries.append({"item": {"input": messages, "completion_id": c["id"]}, "sample": sample})
    return entries


def response_sample(reply: dict) -> dict:
    """A Responses API reply as the sample OpenAI's output items show: its message text, and its usage."""
    text = "".join(p.get("text", "") for o in reply.get("output", []) if o.get("type") == "message"
                   for p in o.get("content", []))
    usage = reply.get("usage") or {}
    finish = "length" if reply.get("status") == "incomplete" else "stop"
    return {"output": [{"role": "assistant", "content": text}], "finish_reason": finish, "model": reply.get("model"),
            "usage": {"prompt_tokens": usage.get("input_tokens", 0), "completion_tokens": usage.get("output_tokens", 0),
                      "total_tokens": usage.get("total_tokens", 0),
                      "cached_tokens": (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)}}


RESPONSE_FILTERS = ("type", "metadata", "model", "created_after", "created_before", "limit", "instructions_search",
                    "temperature", "top_p", "users", "tools", "reasoning_effort")


def stored_response_entries(source: dict, store, tenant: str, as_of: int | None = None) -> list[dict]:
    """The tenant's finished stored responses a ``responses`` source picks (``_stored_filters``, and
    ``instructions_search``, ``temperature``, ``top_p``, ``users``, ``tools``, ``reasoning_effort``: the request's
    ``reasoning.effort``), oldest first, as items (``input``: the messages each answered, ``response_id``) and samples
    (its reply, as a responses run's sample shows it); a filter OpenAI does not have is a 400 naming it."""
    where = "data_source.source"
    unknown = next((k for k in source if k not in RESPONSE_FILTERS), None)
    if unknown is not None:
        raise bad_request(f"{where}.{unknown}: not a filter coserve applies (it filters by "
                          f"{', '.join(RESPONSE_FILTERS[1:])})", f"{where}.{unknown}")
    search = source.get("instructions_search")
    if search is not None and not isinstance(search, str):
        raise bad_request(f"{where}.instructions_search: expected a string", f"{where}.instructions_search")
    numbers = {}
    for key in ("temperature", "top_p"):
        value = source.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise bad_request(f"{where}.{key}: expected a number", f"{where}.{key}")
        numbers[key] = value
    names = {}
    for key in ("users", "tools"):
        value = source.get(key)
        if value is not None and not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
            raise bad_request(f"{where}.{key}: expected a non-empty array of strings", f"{where}.{key}")
        names[key] = value
    effort = source.get("reasoning_effort")
    if effort is not None and effort not in get_args(ReasoningEffort):
        raise bad_request(f"{where}.reasoning_effort: expected one of {', '.join(get_args(ReasoningEffort))}",
                          f"{where}.reasoning_effort")
    try:
        found = store.list_responses(tenant, **_stored_filters(source, as_of), instructions_search=search, **numbers,
                                     **names, reasoning_effort=effort)
    except ValueError as e:
        raise bad_request(f"{where}.{e}", f"{where}.metadata") from None
    if not found:
        raise bad_request(f"{where}: no stored response matches", where)
    entries = []
    for obj, conversation in found:
        messages = conversation[:len(conversation) - len(output_messages(obj["output"]))]
        sample = {"input": messages, **response_sample(obj), "error": None}
        entries.append({"item": {"input": messages, "response_id": obj["id"]}, "sample": sample})
    return entries


def _source_entries(source: Any, store, tenant: str) -> list[dict]:
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "file_content":
        content = source.get("content")
        if not isinstance(content, list) or not content:
            raise bad_request("data_source.source.content: expected a non-empty array of {\"item\": ...}",
                              "data_source.source.content")
        try:
            entries = [_entry(c, f"data_source.source.content.{i}") for i, c in enumerate(content)]
        except ValueError as e:
            raise bad_request(str(e), str(e).split(":", 1)[0]) from None
    elif kind == "file_id":
        file_id = source.get("id")
        if not isinstance(file_id, str):
            raise bad_request("data_source.source.id: expected a file id", "data_source.source.id")
        f = found(store.get_file(tenant, file_id), "file", file_id, "data_source.source.id")
        if f["purpose"] != "evals":
            raise bad_request(f"data_source.source.id: the file's purpose is {f['purpose']!r}, not 'evals'",
                              "data_source.source.id")
        try:
            entries = parse_eval_jsonl(store.file_path(file_id).read_bytes())
        except ValueError as e:
            raise bad_request(f"data_source.source.id: {e}", "data_source.source.id") from None
    else:
        raise bad_request(f"data_source.source.type: expected 'file_content' or 'file_id', got {kind!r}",
                          "data_source.source.type")
    if len(entries) > MAX_ITEMS:
        raise bad_request(f"data_source.source: {len(entries)} items; at most {MAX_ITEMS}", "data_source.source")
    return entries


def parse_input_messages(given: Any) -> tuple[tuple[tuple[str, Template], ...] | None, str | None]:
    where = "data_source.input_messages"
    kind = given.get("type") if isinstance(given, dict) else None
    if kind == "item_reference":
        ref = given.get("item_reference")
        if not isinstance(ref, str) or not ref.startswith("item."):
            raise bad_request(f"{where}.item_reference: expected a path into the item (item.<field>)",
                              f"{where}.item_reference")
        return None, ref
    if kind != "template":
        raise bad_request(f"{where}.type: expected 'template' or 'item_reference', got {kind!r}", f"{where}.type")
    try:  # the same form as a model grader's conversation
        return parse_messages(given.get("template"), f"{where}.template"), None
    except ValueError as e:
        raise bad_request(str(e), str(e).split(":", 1)[0]) from None


def _sampling(given: Any) -> dict:
    """The chat request's fields for ``sampling_params`` (checked here for their form; the chat API checks the
    rest, per item)."""
    where = "data_source.sampling_params"
    given = {} if given is None else given
    if not isinstance(given, dict):
        raise bad_request(f"{where}: expected an object", where)
    for key in given:
        if key not in SAMPLING_FIELDS:
            raise bad_request(f"{where}.{key}: not one of {', '.join(SAMPLING_FIELDS)}", f"{where}.{key}")
    if given.get("response_format") is not None:
        try:
            guided_schema(given["response_format"])
        except APIError as e:
            raise bad_request(f"{where}.{e.message}", f"{where}.{e.param}") from None
    out = {"temperature": 1.0, "top_p": 1.0, "max_completion_tokens": DEFAULT_MAX_TOKENS,
           **{k: v for k, v in given.items() if v is not None}}
    for key in ("temperature", "top_p"):
        if isinstance(out[key], bool) or not isinstance(out[key], (int, float)):
            raise bad_request(f"{where}.{key}: expected a number", f"{where}.{key}")
    for key in ("max_completion_tokens", "seed"):
        if key in out and (isinstance(out[key], bool) or not isinstance(out[key], int)):
            raise bad_request(f"{where}.{key}: expected an integer", f"{where}.{key}")
    return out


def item_messages(source: RunSource, item: dict) -> list[dict]:
    """The conversation a completions run sends for ``item``; ValueError naming what the item lacks."""
    if source.template is not None:
        return [{"role": role, "content": t.render(item, {})} for role, t in source.template]
    value: Any = {"item": item}
    for key in source.item_reference.split("."):
        if not isinstance(value, dict) or key not in value:
            raise ValueError(f"the item has no {source.item_reference}")
        value = value[key]
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                              and isinstance(m.get("role"), str) for m in value):
        raise ValueError(f"{source.item_reference}: expected a conversation (messages with a role and text content)")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def grader_sample(sample: dict) -> dict:
    """The graders' ``sample`` namespace of a run's sample: as given (a jsonl run's; its ``output_json`` read
    from its ``output_text`` when absent), or a completions run's reply text."""
    if "output_text" in sample and "output" not in sample:
        return {**make_sample(str(sample["output_text"])), **sample}
    text = "".join(m.get("content") or "" for m in sample.get("output", []))
    return make_sample(text)
