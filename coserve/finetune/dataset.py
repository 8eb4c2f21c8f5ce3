"""Finetuning data sets: JSON or JSONL files of text, Alpaca or OpenAI chat records, as token ids and targets.

The format is told by content: a file whose first non-space character is ``[`` is one JSON array
of records (a record's ``line`` is its 1-based index); anything else is JSONL, one record per line
(blank lines ignored, ``line`` is the 1-based line number). A record is one of

* ``{"text": str}``: the tokenizer's own ids (bos included where it adds one), loss on every token;
* Alpaca ``{"instruction": str, "input": str (optional), "output": str}``: the Stanford Alpaca
  prompt, then the output and eos; loss on the output and eos only unless ``train_on_prompt``;
* OpenAI chat ``{"messages": [...]}``: see :mod:`coserve.finetune.chat_format`.

Other fields are ignored; when a record has several shapes' fields, ``messages`` wins over
``instruction``/``output``, which win over ``text`` (tatsu-lab/alpaca carries a ``text`` column).
Bad records are skipped and reported by line with a reason that names the field; a file without a
single valid example is a :class:`DatasetError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from coserve.finetune.chat_format import (NOT_UNICODE, EmptyCompletionError, encode_chat, is_unicode_text,
                                         json_type)
from coserve.finetune.sequence_state import IGNORE_INDEX

__all__ = ["ALPACA_PROMPT", "ALPACA_PROMPT_NO_INPUT", "DatasetError", "DatasetReport", "EmptyCompletionError",
           "IGNORE_INDEX", "TrainingExample", "encode_record", "load_dataset", "load_records"]

ALPACA_PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further "
                 "context. Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
                          "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
_SHOW = 5  # bad lines named in a summary or an error


@dataclass(slots=True)
class TrainingExample:
    """One finetuning sequence."""

    token_ids: list[int]  # the whole sequence
    targets: list[int]  # targets[t] = token_ids[t+1] where token t+1 is a loss token, else IGNORE_INDEX
    line: int  # 1-based line (JSONL) or array index (JSON) of the source record; 0 from encode_record


@dataclass(slots=True)
class DatasetReport:
    """What :func:`load_dataset` kept and skipped."""

    path: str
    num_records: int  # records seen, malformed ones included (blank JSONL lines are not records)
    num_examples: int
    malformed: list[tuple[int, str]] = field(default_factory=list)  # (line, reason) of skipped records
    truncated: int = 0  # examples cut to max_seq_len
    empty_completion: list[int] = field(default_factory=list)  # lines skipped for having no loss token
    max_seq_len: int = 0
    json_array: bool = False  # the file is one JSON array (lines are array indices)

    def summary(self) -> str:
        """One human line, e.g. ``"1000 examples from data.jsonl; 2 malformed (lines 3, 9)"``."""
        unit = "record" if self.json_array else "line"
        parts = [f"{_plural(self.num_examples, 'example')} from {Path(self.path).name}"]
        if self.malformed:
            parts.append(f"{len(self.malformed)} malformed ({_lines(unit, [n for n, _ in self.malformed])})")
        if self.truncated:
            parts.append(f"{self.truncated} truncated to {self.max_seq_len} tokens")
        if self.empty_completion:
            parts.append(f"{len(self.empty_completion)} with an empty completion "
                         f"({_lines(unit, self.empty_completion)})")
        return "; ".join(parts)


class DatasetError(ValueError):
    """A data set file that is missing, unreadable, or holds no valid example."""


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _lines(unit: str, lines: list[int]) -> str:
    shown = ", ".join(map(str, lines[:_SHOW]))
    more = f", ... ({len(lines) - _SHOW} more)" if len(lines) > _SHOW else ""
    return f"{unit if len(lines) == 1 else unit + 's'} {shown}{more}"


def _string(record: dict, key: str, optional: bool = False) -> str:
    value = record.get(key)
    if value is None and optional:
        return ""
    if key not in record:
        raise ValueError(f"{key}: missing")
    if not isinstance(value, str):
        raise ValueError(f"{key}: expected a string, got {json_type(value)}")
    if not is_unicode_text(value):
        raise ValueError(f"{key}: {NOT_UNICODE}")
    return value


def _ids(tokenizer: PreTrainedTokenizerBase, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"])


def _encode_text(record: dict, tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[bool]]:
    text = _string(record, "text")
    if not text.strip():
        raise EmptyCompletionError("text: empty")
    ids = _ids(tokenizer, text, special=True)
    return ids, [True] * len(ids)


def _encode_alpaca(record: dict, tokenizer: PreTrainedTokenizerBase,
                   train_on_prompt: bool) -> tuple[list[int], list[bool]]:
    instruction, output = _string(record, "instruction"), _string(record, "output")
    input_text = _string(record, "input", optional=True)
    if not output.strip():
        raise EmptyCompletionError("output: empty")
    if tokenizer.eos_token_id is None:
        raise ValueError("output: the tokenizer has no eos token to end the completion with")
    if input_text.strip():
        prompt = ALPACA_PROMPT.format(instruction=instruction, input=input_text)
    else:
        prompt = ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)
    prompt_ids = _ids(tokenizer, prompt, special=True)
    completion = _ids(tokenizer, output, special=False) + [tokenizer.eos_token_id]
    return prompt_ids + completion, [train_on_prompt] * len(prompt_ids) + [True] * len(completion)


def encode_record(record: dict, tokenizer: PreTrainedTokenizerBase, max_seq_len: int,
                  train_on_prompt: bool = False) -> tuple[TrainingExample, bool]:
    """Encodes one record as ``(example, was_truncated)``; ``example.line`` is 0.

    Sequences longer than ``max_seq_len`` are cut to it, and the last kept position gets no target.
    Raises :class:`EmptyCompletionError` (a ``ValueError``) for a record without a loss token (empty
    completion, or all of it cut off) and ``ValueError`` naming the field for a bad record.
    """
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be at least 2, got {max_seq_len}")
    if not isinstance(record, dict):
        raise ValueError(f"record: expected a JSON object, got {json_type(record)}")
    if "messages" in record:
        ids, mask = encode_chat(record["messages"], tokenizer, train_on_prompt)
    elif "instruction" in record or "output" in record:
        ids, mask = _encode_alpaca(record, tokenizer, train_on_prompt)
    elif "text" in record:
        ids, mask = _encode_text(record, tokenizer)
    else:
        keys = ", ".join(map(repr, list(record)[:8])) or "none"
        raise ValueError(f"record: no 'text', 'instruction'/'output' or 'messages' field (fields: {keys})")
    return example_of(ids, mask, max_seq_len)


def example_of(ids: list[int], mask: list[bool], max_seq_len: int) -> tuple[TrainingExample, bool]:
    """A sequence's ids and loss mask as ``(example, was_truncated)``: cut to ``max_seq_len``, each loss token the
    target of the position before it; ``EmptyCompletionError`` when no loss token is left."""
    truncated = len(ids) > max_seq_len
    ids, mask = ids[:max_seq_len], mask[:max_seq_len]
    targets = [IGNORE_INDEX] * len(ids)
    for t in range(len(ids) - 1):
        if mask[t + 1]:
            targets[t] = ids[t + 1]
    if all(t == IGNORE_INDEX for t in targets):
        cut = f" within max_seq_len={max_seq_len}" if truncated else ""
        raise EmptyCompletionError(f"no loss token{cut}")
    return TrainingExample(token_ids=ids, targets=targets, line=0), truncated


def _read_records(path: Path) -> tuple[bool, list[tuple[int, object, str | None]]]:
    """``(is_json_array, [(line, record, error)])``; ``error`` is set for a line that does not parse."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DatasetError(f"{path}: no such data set file") from None
    except OSError as e:
        raise DatasetError(f"{path}: cannot read the data set ({e.strerror or e})") from e
    raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark
    if raw.lstrip()[:1] == b"[":
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DatasetError(f"{path}: not UTF-8 text (byte {e.start})") from e
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: starts with '[' but is not a valid JSON array "
                               f"(line {e.lineno} column {e.colno}: {e.msg})") from e
        return True, [(i, rec, None) for i, rec in enumerate(data, 1)]
    records: list[tuple[int, object, str | None]] = []
    for n, chunk in enumerate(raw.split(b"\n"), 1):
        if not chunk.strip():
            continue
        try:
            records.append((n, json.loads(chunk.decode("utf-8")), None))
        except UnicodeDecodeError as e:
            records.append((n, None, f"not UTF-8 text (byte {e.start} of the line)"))
        except json.JSONDecodeError as e:
            records.append((n, None, f"invalid JSON ({e.msg} at column {e.colno})"))
    return False, records


def load_dataset(path: str | Path, tokenizer: PreTrainedTokenizerBase, max_seq_len: int,
                 train_on_prompt: bool = False) -> tuple[list[TrainingExample], DatasetReport]:
    """Reads a JSON-array or JSONL data set and encodes its records (see the module docstring).

    Records that do not parse or fit no shape are skipped and listed in ``report.malformed``;
    records without a loss token in ``report.empty_completion``. Raises :class:`DatasetError`
    naming the file when it is missing or unreadable or holds no valid example.
    """
    return load_records(path, max_seq_len,
                        lambda record: encode_record(record, tokenizer, max_seq_len, train_on_prompt))


def load_records(path: str | Path, max_seq_len: int, encode) -> tuple[list, DatasetReport]:
    """``load_dataset``'s reading and reporting, each record turned into an item by ``encode(record) -> (item,
    was_truncated)`` (an item has a ``line``; ``encode`` raises as ``encode_record`` does)."""
    path = Path(path)
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be at least 2, got {max_seq_len}")
    json_array, records = _read_records(path)
    report = DatasetReport(path=str(path), num_records=len(records), num_examples=0,
                           max_seq_len=max_seq_len, json_array=json_array)
    examples = []
    for line, record, error in records:
        if error is not None:
            report.malformed.append((line, error))
            continue
        try:
            example, truncated = encode(record)
        except EmptyCompletionError:
            report.empty_completion.append(line)
            continue
        except ValueError as e:
            report.malformed.append((line, str(e)))
            continue
        example.line = line
        examples.append(example)
        report.truncated += truncated
    report.num_examples = len(examples)
    if not examples:
        raise DatasetError(_no_example_message(report))
    return examples, report


def _no_example_message(report: DatasetReport) -> str:
    unit = "record" if report.json_array else "line"
    if not report.num_records:
        return f"{report.path}: no records (the file is empty)"
    msg = f"{report.path}: no valid training example among {_plural(report.num_records, 'record')}"
    bad = [f"{unit} {n}: {reason}" for n, reason in report.malformed[:_SHOW]]
    if len(report.malformed) > _SHOW:
        bad.append(f"{len(report.malformed) - _SHOW} more malformed")
    if report.empty_completion:
        bad.append(f"{len(report.empty_completion)} with no loss token ({_lines(unit, report.empty_completion)})")
    return msg + "; " + "; ".join(bad)
